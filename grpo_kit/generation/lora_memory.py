"""A PEFT LoRA adapter handed to an in-process vLLM engine as tensors: no file, no merge.

vLLM loads adapters in its worker through ``WorkerLoRAManager._load_adapter(request)``, which reads
``adapter_config.json`` and the safetensors from ``request.lora_path`` and builds a ``LoRAModel``
with ``LoRAModel.from_lora_tensors``. :func:`install_memory_loader` wraps that method once per
engine: a request whose id has tensors waiting in ``manager.grpo_kit_pending`` is built from them
with the same ``from_lora_tensors`` call (same name parsing, q/k/v packing, scaling into B), any
other request loads from disk as before. So a sync is: put the tensors in the worker, then the
ordinary ``add_lora``. Tensors are cloned in the adapter dtype first because vLLM scales B in place.
"""

from __future__ import annotations

import torch

PATH_PREFIX = "grpo-kit-memory://"  # vLLM requires a non-empty lora_path; nothing reads it


def adapter_state(model) -> tuple[dict[str, torch.Tensor], dict]:
    """``(tensors, config)`` of ``model``'s active PEFT LoRA adapter, in the names PEFT saves.

    ``tensors``: ``{"base_model.model....q_proj.lora_A.weight": tensor}`` (live parameters, not
    copies); ``config``: the fields vLLM's ``PEFTHelper`` reads. ValueError for adapter features vLLM
    does not load (DoRA, per-module rank or alpha patterns, trained biases, modules_to_save).
    """
    from peft import get_peft_model_state_dict  # lazy: peft is slow to import (it pulls in bitsandbytes)

    name = model.active_adapter
    cfg = model.peft_config[name]
    problems = [
        what
        for what, bad in (
            ("use_dora", getattr(cfg, "use_dora", False)),
            ("rank_pattern", getattr(cfg, "rank_pattern", None)),
            ("alpha_pattern", getattr(cfg, "alpha_pattern", None)),
            (f"bias={cfg.bias!r}", cfg.bias != "none"),
            ("modules_to_save", getattr(cfg, "modules_to_save", None)),
        )
        if bad
    ]
    if problems:
        raise ValueError(
            f"the LoRA adapter uses {', '.join(problems)}, which vLLM cannot load as an adapter; "
            "sync it merged into a separate engine copy instead (vllm_share_weights=false, "
            "vllm_lora_sync='merge')"
        )
    tensors = get_peft_model_state_dict(model, adapter_name=name)
    targets = cfg.target_modules
    config = {
        "r": int(cfg.r),
        "lora_alpha": cfg.lora_alpha,
        "use_rslora": bool(cfg.use_rslora),
        "target_modules": sorted(targets) if isinstance(targets, (set, list, tuple)) else targets,
    }
    return tensors, config


def _name_mapper(model):
    """The model's HF-to-vLLM name mapper without its q/k/v and gate/up fusions, as ``_load_adapter``
    passes it (vLLM 0.26: ``get_unstacked_mapper``; 0.32: ``get_rename_mapper``); None without one."""
    mapper = getattr(model, "hf_to_vllm_mapper", None)
    if mapper is None:
        return None
    for name in ("get_unstacked_mapper", "get_rename_mapper"):
        if hasattr(mapper, name):
            return getattr(mapper, name)()
    return mapper


def install_memory_loader(worker) -> None:
    """Wrap the worker's ``lora_manager._load_adapter`` so waiting tensors are loaded from memory."""
    manager = worker.model_runner.lora_manager
    if getattr(manager, "grpo_kit_pending", None) is not None:
        return
    from vllm.lora.peft_helper import PEFTHelper  # lazy: vLLM is optional and slow to import

    original = manager._load_adapter
    manager.grpo_kit_pending = {}

    def load(request):
        item = manager.grpo_kit_pending.pop(request.lora_int_id, None)
        if item is None:
            return original(request)
        tensors, config = item
        helper = PEFTHelper.from_dict(dict(config))
        helper.validate_legal(manager.lora_config)
        model = manager._adapter_manager.model
        return manager._lora_model_cls.from_lora_tensors(
            lora_model_id=request.lora_int_id,
            tensors=tensors,
            peft_helper=helper,
            device=str(manager.device),
            dtype=manager.lora_config.lora_dtype,
            model_vocab_size=manager.vocab_size,
            weights_mapper=_name_mapper(model),
            skip_prefixes=getattr(model, "lora_skip_prefixes", None),
        )

    manager._load_adapter = load


def stage_in_worker(worker, lora_id: int, tensors: dict, config: dict) -> int:
    """Run in the worker (``collective_rpc``): copy ``tensors`` to the adapter dtype and device and
    leave them for the next load of ``lora_id``. Returns the bytes staged."""
    install_memory_loader(worker)
    manager = worker.model_runner.lora_manager
    dtype, device = manager.lora_config.lora_dtype, torch.device(str(manager.device))
    staged = {}
    with torch.no_grad():
        for k, t in tensors.items():
            t = t.detach()
            same = t.dtype == dtype and t.device == device
            staged[k] = t.clone() if same else t.to(device=device, dtype=dtype)  # vLLM scales B in place
    manager.grpo_kit_pending[lora_id] = (staged, config)
    return sum(t.numel() * t.element_size() for t in staged.values())
