"""Generation backends behind one interface: ``HFGenerator`` and ``VLLMGenerator`` (layer: generation; may import
the core layers, ``kernels`` to ``memory``; not TRL's trainer, ``trainer`` or ``app``).

``make_generator(backend, ...)`` picks and builds one (the run's :func:`grpo_kit.generation.plan.start_generation`
builds through it too). vLLM is optional: this package imports without it, ``backend="auto"`` then uses HF, and
``backend="vllm"`` stops with the exact install command for the machine. An architecture vLLM cannot load falls
back to HF with a warning.

Which backend a run uses, whether the engine shares the training model's weights (CUDA), and how the GPU is
split: :mod:`grpo_kit.generation.plan` (decided before any model loads). One copy of the weights:
:mod:`.shared_weights`; LoRA in memory: :mod:`.lora_memory`; standby: :mod:`.standby`.

Trainer integration: :class:`grpo_kit.trainer.generation_hook.KitGenerationMixin`.
"""

from __future__ import annotations

import warnings
from pathlib import Path

from grpo_kit.generation.base import (
    GENERATION_BACKENDS,
    GenerationEngineError,
    GenerationResult,
    Generator,
    SamplingConfig,
)
from grpo_kit.generation.hf import HFGenerator, process_logits, sampling_logprobs_reference
from grpo_kit.generation.vllm_backend import (
    UnsupportedArchitectureError,
    VLLMGenerator,
    VLLMNotInstalledError,
    check_vllm_architecture,
    import_vllm,
    vllm_available,
    vllm_install_advice,
    vllm_install_command,
)

BACKENDS = GENERATION_BACKENDS

__all__ = [
    "BACKENDS",
    "GenerationEngineError",
    "GenerationResult",
    "Generator",
    "HFGenerator",
    "SamplingConfig",
    "UnsupportedArchitectureError",
    "VLLMGenerator",
    "VLLMNotInstalledError",
    "make_generator",
    "process_logits",
    "sampling_logprobs_reference",
    "vllm_available",
    "vllm_install_advice",
    "vllm_install_command",
]


def make_generator(
    backend: str = "auto", *, model=None, tokenizer=None, model_dir=None, fallback: bool = True, **vllm_kwargs
) -> Generator:
    """A generator for ``backend`` (``"auto"``, ``"hf"`` or ``"vllm"``): the one place either is built.

    ``model``/``tokenizer``: the training model (HF backend; may also be given later via
    ``sync_weights``). ``model_dir``: the HF folder vLLM starts from (for the embedded
    model :func:`grpo_kit.model.loading.embedded_model_dir`). ``vllm_kwargs`` go to
    :class:`VLLMGenerator`. ``"auto"``: vLLM when it is importable and ``model_dir`` is
    given, else HF. An architecture vLLM cannot load gives HF generate with a warning, or with
    ``fallback=False`` raises :class:`UnsupportedArchitectureError` (for a caller that falls back itself).
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r} is not allowed; choose one of {list(BACKENDS)}")
    if backend == "hf" or (backend == "auto" and (model_dir is None or not vllm_available())):
        return HFGenerator(model, tokenizer)
    if model_dir is None:
        raise ValueError("backend='vllm' needs model_dir (the HF folder the engine loads)")
    if not Path(model_dir, "config.json").is_file():
        raise ValueError(f"model_dir={str(model_dir)!r} is not a HF model folder (no config.json)")
    import_vllm()  # VLLMNotInstalledError with the install command
    try:
        check_vllm_architecture(model_dir)
    except UnsupportedArchitectureError as e:
        if not fallback:
            raise
        warnings.warn(f"{e}; falling back to HF generate", RuntimeWarning, stacklevel=2)
        return HFGenerator(model, tokenizer)
    return VLLMGenerator(model_dir, tokenizer=tokenizer, **vllm_kwargs)
