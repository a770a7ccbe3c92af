"""What the generation layer takes from a run: :class:`GenerationSpec`, built by the app from its config (field
names as there), and the vLLM-only options with their "off" values (:data:`VLLM_ONLY_OPTIONS`)."""

from __future__ import annotations

from dataclasses import dataclass

from grpo_kit.loss.objective import ENGINE_IS_DEFAULT
from grpo_kit.memory.spec import StepSpec

# The options that only vLLM generation reads, with their "off" value: set to anything else they need vLLM (the
# app's config refuses them with HF generation; the plan never drops them silently). kv_cache_dtype is the step's.
VLLM_ONLY_OPTIONS = (
    ("kv_cache_dtype", "auto"),
    ("vllm_gpu_memory_utilization", None),
    ("vllm_kv_cache_gib", None),
    ("vllm_lora_dual_stream", None),
    ("vllm_lora_sync", None),
    ("vllm_enforce_eager", None),
    ("vllm_emulate_precision_casts", False),
    ("vllm_importance_sampling_mode", ENGINE_IS_DEFAULT),
)


@dataclass(frozen=True)
class GenerationSpec:
    """A run's generation settings (names, values and meanings as in ``GRPOKitConfig``): the sampling
    (``temperature``, ``top_p``, ``top_k``, ``min_p``; ``seed``), the vLLM engine's options and ``step``, the run's
    step as the VRAM calculator prices it (model, backend, trainer, sizes, the base weights' format, LoRA rank),
    which the plan reads its sizes from and prices its memory with."""

    step: StepSpec
    seed: int
    temperature: float
    top_p: float
    top_k: int
    min_p: float | None
    gradient_checkpointing: bool | str
    fp8_block: int | None
    vllm_share_weights: bool | str
    vllm_lora_sync: str | None
    vllm_lora_dual_stream: bool | None
    vllm_kv_cache_gib: float | None
    vllm_gpu_memory_utilization: float | None
    vllm_enforce_eager: bool | None
    vllm_emulate_precision_casts: bool
    vllm_importance_sampling_mode: str

    @classmethod
    def of(cls, source) -> GenerationSpec:
        """``source`` itself, or the spec it makes: an object with ``spec(kind)``, such as the app's config
        (``GRPOKitConfig.spec``), for callers (notebooks, benchmarks) that hold a config."""
        return source if isinstance(source, cls) else source.spec(cls)

    def vllm_options_set(self) -> list[str]:
        """``name=value`` of each vLLM-only option (:data:`VLLM_ONLY_OPTIONS`) that is not at its off value."""
        values = {name: getattr(self.step if name == "kv_cache_dtype" else self, name) for name, _ in VLLM_ONLY_OPTIONS}
        return [f"{name}={values[name]!r}" for name, off in VLLM_ONLY_OPTIONS if values[name] != off]
