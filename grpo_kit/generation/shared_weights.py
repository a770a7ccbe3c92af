"""One copy of the weights: the training model's frozen base weights are views of a vLLM engine's tensors.

vLLM fuses ``q_proj/k_proj/v_proj`` into ``qkv_proj`` and ``gate_proj/up_proj`` into ``gate_up_proj``
(its model class lists them in ``packed_modules_mapping``). Each HF weight is then a block of rows of
the fused tensor, ``fused.narrow(0, offset, size)`` with the offsets from the fused layer's
``output_sizes``: a contiguous view, no copy. vLLM pads the embedding and head to a multiple of 64
rows; the HF tensor is the first ``vocab_size`` rows. With ``enable_lora=True`` vLLM wraps each layer
and keeps the original in ``base_layer``. Tied embeddings are one tensor on both sides.

The HF model is built with its parameters on the meta device (no memory), then every parameter is
replaced by its view, frozen (``requires_grad=False``: LoRA trains adapters on top; full fine-tuning
keeps a separate engine copy). Buffers (RoPE frequencies) are real tensors moved to the engine's
device. A layout this module cannot map (another fusion, quantised engine weights, a dtype or shape
that differs) raises :class:`UnshareableError` naming the weight, before anything is changed; the
caller then starts a separate engine copy.

Only on CUDA: vLLM's CPU backend repacks the linear weights for its GEMM and drops the originals.
"""

from __future__ import annotations

import torch

from grpo_kit.model.loading import meta_model


class UnshareableError(ValueError):
    """The engine's weights cannot back the training model; the message names the weight and why."""


def _base(module):
    """The layer under vLLM's LoRA wrapper (``...WithLoRA.base_layer``), else the module itself."""
    return getattr(module, "base_layer", module)


def _submodule(model, path: str):
    try:
        return model.get_submodule(path)
    except AttributeError:
        return None


def _engine_tensor(engine_model, hf_name: str, packed: dict[str, list[str]]) -> torch.Tensor:
    """The engine tensor (a view where fused) that holds HF parameter ``hf_name``."""
    path, attr = hf_name.rsplit(".", 1)
    parent, _, leaf = path.rpartition(".")
    module = _submodule(engine_model, path)
    if module is not None:
        tensor = getattr(_base(module), attr, None)
        if tensor is None:
            raise UnshareableError(f"{hf_name}: the engine's {path} has no {attr!r} tensor")
        return tensor
    for fused, parts in packed.items():
        if leaf not in parts:
            continue
        module = _submodule(engine_model, f"{parent}.{fused}" if parent else fused)
        if module is None:
            continue
        layer = _base(module)
        sizes = list(getattr(layer, "output_sizes", []) or [])
        tensor = getattr(layer, attr, None)
        if len(sizes) != len(parts) or tensor is None or sum(sizes) != tensor.shape[0]:
            raise UnshareableError(f"{hf_name}: the engine's fused {fused} does not split into {parts} "
                                   f"(output_sizes {sizes}, {attr} {None if tensor is None else tuple(tensor.shape)})")
        k = parts.index(leaf)
        return tensor.narrow(0, sum(sizes[:k]), sizes[k])
    raise UnshareableError(f"{hf_name}: no engine module {path} and no fused module holding {leaf!r} "
                           f"(engine fusions: {packed or 'none'})")


def engine_views(engine_model, hf_params: dict[str, tuple[tuple[int, ...], torch.dtype]]) -> dict[str, torch.Tensor]:
    """``{hf name: engine view}`` for every HF parameter, or :class:`UnshareableError`.

    ``hf_params``: ``{name: (shape, dtype)}`` of the HF model (meta tensors are fine). Engine tensors
    with extra rows (vocabulary padding) are cut to the HF shape; any other difference is an error.
    """
    packed = dict(getattr(engine_model, "packed_modules_mapping", None) or {})
    views = {}
    for name, (shape, dtype) in hf_params.items():
        t = _engine_tensor(engine_model, name, packed)
        if type(t) is not torch.Tensor and not isinstance(t, torch.nn.Parameter):
            raise UnshareableError(f"{name}: the engine holds it as {type(t).__name__}, not a plain tensor "
                                   "(quantised engine weights cannot back a 16-bit training model)")
        t = t.data if isinstance(t, torch.nn.Parameter) else t
        if t.dtype != dtype:
            raise UnshareableError(f"{name}: engine dtype {t.dtype}, training dtype {dtype}")
        if tuple(t.shape) != tuple(shape):
            padded_rows = t.dim() == len(shape) and t.shape[0] > shape[0] and tuple(t.shape[1:]) == tuple(shape[1:])
            if not padded_rows:
                raise UnshareableError(f"{name}: engine shape {tuple(t.shape)}, training shape {tuple(shape)}")
            t = t.narrow(0, 0, shape[0])
        views[name] = t
    return views


def build_shared_model(engine_model, config, dtype: torch.dtype):
    """A ``*ForCausalLM`` for ``config`` whose parameters are all views of ``engine_model``'s tensors.

    Every parameter is frozen. Raises :class:`UnshareableError` (nothing allocated but buffers) when a
    weight cannot be mapped. ``model.grpo_kit_shared_weights`` is set to True.
    """
    config._attn_implementation = getattr(config, "_attn_implementation", None) or "sdpa"
    model = meta_model(config, dtype=dtype, real_buffers=True)  # buffers real (on the CPU), moved below
    tied = bool(getattr(config, "tie_word_embeddings", False))
    # Meta init leaves a tied head as its own tensor: map the embedding only and tie the head to it after.
    head = {n for n, _ in model.named_parameters() if n.startswith("lm_head.")} if tied else set()
    params = {n: p for n, p in model.named_parameters() if n not in head}
    views = engine_views(engine_model, {n: (tuple(p.shape), p.dtype) for n, p in params.items()})
    device = next(iter(views.values())).device
    new = {id(p): torch.nn.Parameter(views[n], requires_grad=False) for n, p in params.items()}
    for module in model.modules():  # every slot, so tied heads follow their embedding
        for slot, p in list(module._parameters.items()):
            if p is not None and id(p) in new:
                module._parameters[slot] = new[id(p)]
        for slot, b in list(module._buffers.items()):
            if b is not None:
                module._buffers[slot] = b.to(device)
    if tied:
        model.tie_weights()
    left = [n for n, p in model.named_parameters(remove_duplicate=False) if p.is_meta]
    if left:
        raise UnshareableError(f"{left[:3]}: no engine tensor was assigned (untied head of a tied config?)")
    model.grpo_kit_shared_weights = True
    return model


def storage_spans(engine_model) -> list[tuple[int, int]]:
    """``[(start, end)]`` addresses of the storages behind ``engine_model``'s parameters and buffers."""
    spans = []
    for t in list(engine_model.parameters()) + list(engine_model.buffers()):
        s = t.untyped_storage()
        spans.append((s.data_ptr(), s.data_ptr() + s.nbytes()))
    return spans


def inside_storage(t: torch.Tensor, spans) -> bool:
    """Whether ``t``'s bytes lie inside one of ``spans`` (a view of an engine tensor)."""
    lo, n = t.data_ptr(), t.numel() * t.element_size()
    return any(a <= lo and lo + n <= b for a, b in spans)


def shared_storage(model, engine_model) -> dict:
    """How much of ``model``'s parameter memory lies inside ``engine_model``'s tensors.

    Returns ``{"shared_params", "other_params", "shared_bytes", "other_bytes"}``: a parameter counts
    as shared when its ``data_ptr`` range lies inside an engine tensor's storage (a view of it).
    """
    spans = storage_spans(engine_model)
    out = dict(shared_params=0, other_params=0, shared_bytes=0, other_bytes=0)
    seen = set()
    for p in model.parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        n = p.numel() * p.element_size()
        key = "shared" if inside_storage(p, spans) else "other"
        out[f"{key}_params"] += 1
        out[f"{key}_bytes"] += n
    return out
