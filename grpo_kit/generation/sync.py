"""Weight sync from the training model to a vLLM engine: names, LoRA merging, checks.

vLLM's model classes load HF checkpoint names (``model.layers.0.self_attn.q_proj.weight``),
so the training model's parameters are streamed under those names, one tensor at a time.
A PEFT LoRA model is streamed *merged* without touching the training weights: each
adapted base weight is yielded as ``W + scale * B @ A`` (a fresh tensor), so there is
no merge/unmerge round trip that would add float error to ``W`` every step.

Before anything reaches the engine, the names and shapes are checked against the
checkpoint the engine was started from (:func:`checkpoint_manifest`), so a wrong model
fails with a ``ValueError`` instead of half-loading.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open

from grpo_kit.model.loading import meta_model
from grpo_kit.readers.bounded import read_json

# How a LoRA adapter reaches a vLLM engine (VLLMGenerator(lora_sync=...), the config's vllm_lora_sync): merged
# into the shared weights, or as a vLLM LoRA adapter.
LORA_SYNC_MODES = ("merge", "adapter")


def unwrap(model):
    """The model inside DDP / accelerate wrappers (PEFT wrappers are kept)."""
    while hasattr(model, "module") and isinstance(model.module, torch.nn.Module):
        model = model.module
    return model


def is_peft_model(model) -> bool:
    return hasattr(model, "peft_config") and hasattr(model, "get_base_model")


def _lora_owner(model, name: str):
    """The PEFT LoRA layer owning base weight ``name`` (``...q_proj.base_layer.weight``), else None."""
    if ".base_layer." not in name:
        return None
    try:
        from peft.tuners.lora import LoraLayer  # lazy: peft is slow to import (it pulls in bitsandbytes)
    except ImportError:  # no peft: no LoRA layers either
        return None
    owner = model.get_submodule(name.rsplit(".base_layer.", 1)[0])
    return owner if isinstance(owner, LoraLayer) else None


def _checkpoint_name(name: str, adapter: str | None) -> str | None:
    """HF checkpoint name for a (possibly PEFT) parameter name; None for tensors vLLM has no slot for."""
    name = name.removeprefix("base_model.model.")
    if ".lora_" in name or "original_module" in name:
        return None
    name = name.replace(".base_layer.", ".")
    if adapter is not None:
        name = name.replace(f".modules_to_save.{adapter}.", ".")
    return name


def weight_manifest(model) -> dict[str, tuple[int, ...]]:
    """``{checkpoint name: shape}`` of what :func:`iter_vllm_weights` would yield (nothing is merged)."""
    model = unwrap(model)
    adapter = getattr(model, "active_adapter", None) if is_peft_model(model) else None
    out = {}
    for name, p in model.named_parameters():
        ck = _checkpoint_name(name, adapter)
        if ck is not None:
            out[ck] = tuple(p.shape)
    return out


def iter_vllm_weights(model, dtype: torch.dtype | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(checkpoint name, tensor)`` for every weight, LoRA merged on the fly.

    ``dtype``: cast each tensor to the engine's dtype here, one at a time (vLLM would
    otherwise warn per tensor). Tied embeddings appear once (``named_parameters``
    de-duplicates), which is what vLLM's loaders expect.
    """
    model = unwrap(model)
    peft = is_peft_model(model)
    adapter = getattr(model, "active_adapter", None) if peft else None
    with torch.no_grad():
        for name, p in model.named_parameters():
            ck = _checkpoint_name(name, adapter)
            if ck is None:
                continue
            t = p.detach()
            owner = _lora_owner(model, name) if peft and name.endswith(".weight") else None
            if owner is not None and not owner.merged and not getattr(owner, "disable_adapters", False):
                deltas = [owner.get_delta_weight(a) for a in owner.active_adapters if a in owner.lora_A]
                if deltas:
                    t = t + sum(d.to(t.dtype) for d in deltas)
            yield ck, (t.to(dtype) if dtype is not None and t.dtype != dtype else t)


def _base_model(model):
    """The transformers model under a PEFT wrapper (its conversion mapping is the class's)."""
    model = unwrap(model)
    return model.get_base_model() if is_peft_model(model) else model


def checkpoint_layout(model, weights: dict) -> dict:
    """``weights`` (``{checkpoint name: tensor}`` as :func:`iter_vllm_weights` names them) in the layout the
    model's checkpoints are saved in: transformers 5 fuses some weights when it loads (an MoE layer's experts into
    ``experts.gate_up_proj`` / ``experts.down_proj``) and splits them again when it saves; an engine loaded the
    saved form. Meta tensors give the names and shapes alone."""
    from transformers.core_model_loading import revert_weight_conversion  # lazy: transformers is slow to import

    return revert_weight_conversion(_base_model(model), dict(weights))


def checkpoint_layout_manifest(model) -> dict[str, tuple[int, ...]]:
    """:func:`weight_manifest` in the saved layout (:func:`checkpoint_layout`), from meta tensors."""
    shapes = weight_manifest(model)
    metas = {k: torch.empty(v, device="meta") for k, v in shapes.items()}
    return {k: tuple(t.shape) for k, t in checkpoint_layout(model, metas).items()}


def checkpoint_manifest(model_dir: str | Path) -> dict[str, tuple[int, ...]]:
    """``{name: shape}`` from the safetensors headers of a HF folder (sharded or not); reads no tensor data."""
    model_dir = Path(model_dir)
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(read_json(index)["weight_map"].values()))
    else:
        files = sorted(p.name for p in model_dir.glob("*.safetensors"))
    if not files:
        raise ValueError(
            f"model_dir={str(model_dir)!r} has no *.safetensors files (vLLM sync needs a safetensors checkpoint)"
        )
    out = {}
    for f in files:
        with safe_open(str(model_dir / f), framework="pt") as fh:
            for k in fh.keys():
                out[k] = tuple(fh.get_slice(k).get_shape())
    return out


def config_manifest(model_dir: str | Path) -> dict[str, tuple[int, ...]]:
    """``{name: shape}`` of the HF model that ``model_dir/config.json`` describes (for a folder without
    weights, started with random ones); the model is built on the meta device, nothing is allocated."""
    from transformers import AutoConfig  # lazy: transformers is slow to import

    return weight_manifest(meta_model(AutoConfig.from_pretrained(str(model_dir))))


def check_compatible(model_weights: dict, checkpoint: dict, *, tied_head: bool) -> None:
    """ValueError when the training model's weights do not match the engine's checkpoint."""
    ckpt = dict(checkpoint)
    ours = dict(model_weights)
    if tied_head:  # a tied head is the embedding; either side may list it
        ckpt.pop("lm_head.weight", None)
        ours.pop("lm_head.weight", None)
    missing = sorted(set(ckpt) - set(ours))
    unknown = sorted(set(ours) - set(ckpt))
    wrong = sorted(k for k in set(ours) & set(ckpt) if tuple(ours[k]) != tuple(ckpt[k]))
    if missing or unknown or wrong:
        parts = []
        if missing:
            parts.append(f"{len(missing)} engine weights not in the model (e.g. {missing[:3]})")
        if unknown:
            parts.append(f"{len(unknown)} model weights the engine does not have (e.g. {unknown[:3]})")
        if wrong:
            parts.append(
                "shape mismatch: " + ", ".join(f"{k} {tuple(ours[k])} vs engine {tuple(ckpt[k])}" for k in wrong[:3])
            )
        raise ValueError(
            "sync_weights: the model does not match the checkpoint the vLLM engine was started from: "
            + "; ".join(parts)
        )
