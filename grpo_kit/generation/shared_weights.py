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

FP8 base weights (``base_weights='fp8'``, :mod:`grpo_kit.model.fp8`): one FP8 copy, read by vLLM's FP8 linear
kernels and wrapped by the training model's :class:`~grpo_kit.model.fp8.FP8Linear` layers. The engine is started
with a quantisation config whose layout is the kit's (:func:`vllm_fp8_quantization`, passed as
``hf_overrides={"quantization_config": ...}`` with dummy weights): per output channel, vLLM's compressed-tensors
W8A8-FP8 scheme (channel-wise weight scales, dynamic per-token activation scales: the kit's W8A8 definition); with
128 x 128 blocks, vLLM's ``fp8`` method with ``weight_block_size``. After loading, vLLM holds per layer:

* ``weight`` float8_e4m3fn: per channel, the (out, in) codes as a transposed view (in, out) (``.t()``, for its
  GEMM), so ``weight.t()`` is the contiguous (out, in) storage; with blocks, (out, in) as it is;
* ``weight_scale`` float32 (out, 1) per channel; with blocks ``weight_scale_inv`` (or the compressed-tensors
  ``weight_scale``) (ceil(out / 128), ceil(in / 128)), which despite its name multiplies like the kit's scale.

A fused layer (``qkv_proj``, ``gate_up_proj``) is split as for 16-bit weights: the codes' rows, the channel
scales' rows, or the block scales' block rows (a shard that does not start on a block boundary is refused).
vLLM's online ``quantization="fp8"`` (per-tensor scales, requantised to one scale per fused layer) cannot back
per-channel layers and is refused. :func:`build_shared_model` with ``fp8=True`` builds the training model on
these tensors; :func:`fill_fp8` then quantises each 16-bit weight (streamed, or random) into them, layer by
layer, so the engine serves the kit's codes and scales (equal ``data_ptr``). The adapter reaches the engine
through vLLM's LoRA kernels (``vllm_lora_sync='adapter'``): a merge into FP8 weights would round them again.
"""

from __future__ import annotations

import torch

from grpo_kit.model.fp8 import FP8_BLOCK, FP8_DTYPE, FP8Linear, quantize_fp8
from grpo_kit.model.loading import meta_model, normal_init, set_default_attention
from grpo_kit.model.quantize import quantizable_linears


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


def _out_rows(tensor: torch.Tensor) -> int:
    """A layer tensor's output rows: dim 0, or dim 1 of FP8 codes held transposed (vLLM's per-channel layout)."""
    return tensor.shape[1] if tensor.dtype == FP8_DTYPE and not tensor.is_contiguous() else tensor.shape[0]


def _engine_layer(engine_model, hf_name: str, packed: dict[str, list[str]]):
    """``(layer, rows)``: the engine layer holding HF parameter ``hf_name`` (``path.attr``), and ``(offset,
    size)`` of its output rows within a fused layer (None where not fused)."""
    path, attr = hf_name.rsplit(".", 1)
    parent, _, leaf = path.rpartition(".")
    module = _submodule(engine_model, path)
    if module is not None:
        if getattr(_base(module), attr, None) is None:
            raise UnshareableError(f"{hf_name}: the engine's {path} has no {attr!r} tensor")
        return _base(module), None
    for fused, parts in packed.items():
        if leaf not in parts:
            continue
        module = _submodule(engine_model, f"{parent}.{fused}" if parent else fused)
        if module is None:
            continue
        layer = _base(module)
        sizes = list(getattr(layer, "output_sizes", []) or [])
        tensor = getattr(layer, attr, None)
        if len(sizes) != len(parts) or tensor is None or sum(sizes) != _out_rows(tensor):
            raise UnshareableError(
                f"{hf_name}: the engine's fused {fused} does not split into {parts} "
                f"(output_sizes {sizes}, {attr} {None if tensor is None else tuple(tensor.shape)})"
            )
        k = parts.index(leaf)
        return layer, (sum(sizes[:k]), sizes[k])
    raise UnshareableError(
        f"{hf_name}: no engine module {path} and no fused module holding {leaf!r} (engine fusions: {packed or 'none'})"
    )


def _engine_tensor(engine_model, hf_name: str, packed: dict[str, list[str]]) -> torch.Tensor:
    """The engine tensor (a view where fused) that holds HF parameter ``hf_name``."""
    layer, rows = _engine_layer(engine_model, hf_name, packed)
    tensor = getattr(layer, hf_name.rsplit(".", 1)[1])
    return tensor if rows is None else tensor.narrow(0, *rows)


def _fp8_layout(layer, name: str) -> tuple[torch.Tensor, torch.Tensor, int | None]:
    """``(codes (out, in), scale, block)`` of an engine layer with FP8 weights, views of its tensors: the codes
    un-transposed where vLLM holds them (in, out); ``scale`` (out, 1) per channel (block None) or per ``block``
    x ``block`` tile. Per-tensor scales and other layouts raise :class:`UnshareableError`."""
    w = getattr(layer, "weight", None)
    w = w.data if isinstance(w, torch.nn.Parameter) else w
    if w is None or w.dtype != FP8_DTYPE:
        raise UnshareableError(
            f"{name}: the engine's weight is {None if w is None else w.dtype}, not FP8 e4m3 (start "
            "the engine with vllm_fp8_quantization())"
        )
    codes = w if w.is_contiguous() else w.t() if w.t().is_contiguous() else None
    scale = getattr(layer, "weight_scale_inv", None)
    scale = getattr(layer, "weight_scale", None) if scale is None else scale
    scale = scale.data if isinstance(scale, torch.nn.Parameter) else scale
    if codes is None or scale is None or scale.dtype != torch.float32:
        raise UnshareableError(
            f"{name}: the engine's FP8 layout is not the kit's (weight strides {tuple(w.stride())}, "
            f"scale {None if scale is None else (tuple(scale.shape), scale.dtype)})"
        )
    n, k = codes.shape
    if scale.numel() == n:  # per output channel
        return codes, scale.reshape(n, 1), None
    block = (getattr(layer, "weight_block_size", None) or [None])[0]
    if block and tuple(scale.shape) == (-(-n // block), -(-k // block)):
        return codes, scale, block
    raise UnshareableError(
        f"{name}: the engine's FP8 scales {tuple(scale.shape)} are neither per channel nor "
        f"per block for ({n}, {k}) codes (per-tensor scales, vLLM's online quantization='fp8', "
        "cannot back the training model's per-channel scales)"
    )


def fp8_engine_views(engine_model, layers: dict[str, tuple[int, int, int | None]]) -> dict[str, torch.Tensor]:
    """``{"<module>.weight": codes view, "<module>.weight_scale": scale view}`` for every FP8 layer of the HF
    model, or :class:`UnshareableError`. ``layers``: ``{module name: (out, in, block)}`` (block None: per
    channel). A fused engine layer's shard: its rows of codes and scales (block rows: the shard must start on a
    block boundary and end on one or at the layer's end)."""
    packed = dict(getattr(engine_model, "packed_modules_mapping", None) or {})
    views = {}
    for path, (n, k, block) in layers.items():
        layer, rows = _engine_layer(engine_model, f"{path}.weight", packed)
        codes, scale, engine_block = _fp8_layout(layer, path)
        if engine_block != block:
            raise UnshareableError(
                f"{path}: the engine's FP8 scales are {engine_block or 'per channel'}, the "
                f"training model's {block or 'per channel'}"
            )
        if rows is not None:
            off, size = rows
            if block and (off % block or (size % block and off + size != codes.shape[0])):
                raise UnshareableError(f"{path}: rows {off}..{off + size} of the fused layer cross a {block}-row block")
            codes = codes.narrow(0, off, size)
            scale = scale.narrow(0, off // block, -(-size // block)) if block else scale.narrow(0, off, size)
        if tuple(codes.shape) != (n, k):
            raise UnshareableError(f"{path}: engine FP8 codes {tuple(codes.shape)}, training shape {(n, k)}")
        views[f"{path}.weight"], views[f"{path}.weight_scale"] = codes, scale
    return views


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
            raise UnshareableError(
                f"{name}: the engine holds it as {type(t).__name__}, not a plain tensor "
                "(quantised engine weights cannot back a 16-bit training model)"
            )
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


def _fp8_meta_layers(model, dtype: torch.dtype, block: int | None) -> dict[str, tuple[int, int, int | None]]:
    """Replace ``model``'s (meta) linear layers but lm_head by meta :class:`FP8Linear` layers (the rule of
    :func:`grpo_kit.model.quantize.quantizable_linears`); returns ``{name: (out, in, block)}``."""
    layers = {}
    for name in quantizable_linears(model):
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        lin = getattr(parent, child)
        setattr(
            parent,
            child,
            FP8Linear(
                lin.in_features,
                lin.out_features,
                bias=lin.bias is not None,
                compute_dtype=dtype,
                block=block,
                device="meta",
            ),
        )
        layers[name] = (lin.out_features, lin.in_features, block)
    return layers


def build_shared_model(engine_model, config, dtype: torch.dtype, *, fp8: bool = False, fp8_block: int | None = None):
    """A ``*ForCausalLM`` for ``config`` whose parameters are all views of ``engine_model``'s tensors.

    Every parameter is frozen. Raises :class:`UnshareableError` (nothing allocated but buffers) when a
    weight cannot be mapped. ``model.grpo_kit_shared_weights`` is set to True. ``fp8``: the layer projections
    are :class:`FP8Linear` layers (per channel, or ``fp8_block`` tiles) whose codes and scales are views of the
    engine's FP8 tensors (module docstring); the rest in ``dtype``.
    """
    if fp8_block not in (None, FP8_BLOCK):
        raise ValueError(f"fp8_block={fp8_block!r}: None (per channel) or {FP8_BLOCK}")
    set_default_attention(config)
    model = meta_model(config, dtype=dtype, real_buffers=True)  # buffers real (on the CPU), moved below
    fp8_layers = _fp8_meta_layers(model, dtype, fp8_block) if fp8 else {}
    tied = bool(getattr(config, "tie_word_embeddings", False))
    # Meta init leaves a tied head as its own tensor: map the embedding only and tie the head to it after.
    head = {n for n, _ in model.named_parameters() if n.startswith("lm_head.")} if tied else set()
    fp8_params = {f"{n}.{a}" for n in fp8_layers for a in ("weight", "weight_scale")}
    params = {n: p for n, p in model.named_parameters() if n not in head}
    views = engine_views(engine_model, {n: (tuple(p.shape), p.dtype) for n, p in params.items() if n not in fp8_params})
    views.update(fp8_engine_views(engine_model, fp8_layers))
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


def fill_fp8(model, read) -> int:
    """Quantise each :class:`FP8Linear` layer of ``model`` (whose codes and scales are engine views, from
    :func:`build_shared_model` with ``fp8=True``) from its 16-bit weight into those views, in place, one layer at
    a time: ``read(name)`` gives the 16-bit weight (out, in) of layer ``name`` on the engine's device (from the
    checkpoint, or random), quantised there and dropped. The engine then serves the kit's codes and scales.
    Returns the layers filled."""
    done = 0
    for name, layer in model.named_modules():
        if isinstance(layer, FP8Linear):
            codes, scale = quantize_fp8(read(name), layer.block)
            with torch.no_grad():
                layer.weight.copy_(codes)
                layer.weight_scale.copy_(scale)
            done += 1
    return done


def fill_shared_fp8(model, tensors: dict | None, *, seed: int = 0) -> dict:
    """Write the weights of a shared FP8 model (:func:`build_shared_model` with ``fp8=True``), and so of the engine
    under it, which started on placeholder weights. ``tensors``: ``{checkpoint name: reader()}``
    (:func:`grpo_kit.model.loading.checkpoint_tensors`, each read onto the engine's device when asked): each
    :class:`FP8Linear` quantised from its 16-bit weight (:func:`fill_fp8`), every other parameter (embeddings,
    norms, head, biases) copied and cast; a name the checkpoint lacks is a ValueError naming it. ``None`` (a
    random-weight architecture): the FP8 layers from normal(0, ``initializer_range``) as transformers initialises
    them, seeded, the rest as the engine's dummy initialisation left it. Returns ``{"fp8_layers", "copied"}``."""
    device = next(model.parameters()).device
    if tensors is None:
        normal = normal_init(model.config, device, seed)

        def random(name: str) -> torch.Tensor:
            layer = model.get_submodule(name)
            return normal((layer.out_features, layer.in_features), layer.compute_dtype)

        return {"fp8_layers": fill_fp8(model, random), "copied": 0}

    def read(name: str) -> torch.Tensor:
        if name not in tensors:
            raise ValueError(f"the checkpoint has no tensor {name!r} (it has {len(tensors)} others)")
        return tensors[name]()

    layers = fill_fp8(model, lambda name: read(f"{name}.weight"))
    fp8 = {f"{n}.{a}" for n, m in model.named_modules() if isinstance(m, FP8Linear) for a in ("weight", "weight_scale")}
    copied = 0
    with torch.no_grad():
        for name, p in model.named_parameters():  # a tied head once, under its embedding's name
            if name not in fp8:
                p.copy_(read(name).to(p.dtype))
                copied += 1
    return {"fp8_layers": layers, "copied": copied}


def vllm_fp8_quantization(block: int | None = None) -> dict:
    """The ``quantization_config`` (for vLLM's ``hf_overrides``) under which vLLM's layers hold FP8 weights in the
    kit's layout (module docstring): per output channel with dynamic per-token activation scales (compressed-tensors
    W8A8-FP8, the kit's W8A8), or ``block`` x ``block`` weight tiles (vLLM's ``fp8`` method). lm_head stays in 16
    bit, as the kit's :func:`grpo_kit.model.fp8.quantize_model_fp8` keeps it."""
    if block is not None:
        return {
            "quant_method": "fp8",
            "fmt": "e4m3",
            "activation_scheme": "dynamic",
            "weight_block_size": [block, block],
            "ignored_layers": ["lm_head"],
        }
    return {
        "quant_method": "compressed-tensors",
        "format": "float-quantized",
        "ignore": ["lm_head"],
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": {"num_bits": 8, "type": "float", "strategy": "channel", "symmetric": True, "dynamic": False},
                "input_activations": {
                    "num_bits": 8,
                    "type": "float",
                    "strategy": "token",
                    "symmetric": True,
                    "dynamic": True,
                },
            }
        },
    }


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
