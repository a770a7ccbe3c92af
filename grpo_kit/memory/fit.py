"""Does it fit? The calculator's peak against a GPU's memory, and the longest context that still fits.

The estimate grows monotonically with the context (weights fixed; KV cache, activations, logits chunks and
checkpoints all grow with tokens), so the longest fitting context is found by bisection over
:func:`grpo_kit.memory.estimate.estimate`. Formulas only: no GPU is touched.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from grpo_kit.memory.estimate import AUTO, EstimateSpec, config_estimate_spec, estimate, total_gpu_bytes
from grpo_kit.memory.formulas import GiB as GIB
from grpo_kit.memory.spec import StepSpec
from grpo_kit.model.fp8 import FP8_MIN_CAPABILITY, fp8_support

# Upper end of the context search (tokens): beyond every built-in model's positions.
MAX_SEARCH_CONTEXT = 1 << 20


@dataclass(frozen=True)
class FitVerdict:
    """``peak_gib``: the estimate's GPU peak at ``context`` tokens; ``gpu_gib``: the memory it is compared
    with; ``max_context``: the longest context (prompt + completion tokens) that fits, None when not even
    ``prompt_length + 1`` tokens fit. What the peak is made of, at ``context`` (GiB): ``weights_gib`` (the model's
    weights and any separate vLLM copy), ``optimizer_gib`` (the trained parameters' AdamW state: the LoRA adapters
    with theirs, or every weight's under full fine-tuning), ``kv_cache_gib`` (generation's KV cache) and
    ``peak_phase`` (the step's largest phase); ``shortest_peak_gib``: the peak at ``prompt_length + 1`` tokens;
    ``weights_what`` / ``optimizer_what``: those two in words (vLLM's copy of the weights where it has one; the
    LoRA adapters with their optimiser state)."""

    method: str
    context: int
    peak_gib: float
    gpu_gib: float
    max_context: int | None
    prompt_length: int = 0
    weights_gib: float = 0.0
    optimizer_gib: float = 0.0
    kv_cache_gib: float = 0.0
    peak_phase: str = ""
    shortest_peak_gib: float | None = None
    weights_what: str = "the weights"
    optimizer_what: str = "the optimiser state"

    @property
    def fits(self) -> bool:
        return self.peak_gib <= self.gpu_gib

    def reason(self) -> str:
        """What does not fit, in words: the weights alone, the weights with the optimiser state, or the step's
        largest phase (with the KV cache's share when that is generation)."""
        w, opt, kv, peak = self.weights_gib, self.optimizer_gib, self.kv_cache_gib, self.peak_gib
        if w > self.gpu_gib:
            return f"{self.weights_what} alone take {w:.2f} GiB (the step {peak:.2f} GiB)"
        if w + opt > self.gpu_gib:
            return (
                f"{self.weights_what} ({w:.2f} GiB) and {self.optimizer_what} ({opt:.2f} GiB) alone take "
                f"{w + opt:.2f} GiB (the step {peak:.2f} GiB)"
            )
        phase = f"{self.weights_what} take {w:.2f} GiB and the step's {self.peak_phase} phase {peak:.2f} GiB"
        return phase + (f", {kv:.2f} GiB of it the KV cache" if self.peak_phase == "generation" and kv > 0 else "")

    def text(self) -> str:
        head = (
            f"{self.method}: fits, {self.peak_gib:.2f} of {self.gpu_gib:.2f} GiB "
            f"({self.gpu_gib - self.peak_gib:.2f} GiB to spare)"
            if self.fits
            else f"{self.method}: does not fit on {self.gpu_gib:.2f} GiB: {self.reason()}"
        )
        if self.max_context is not None:
            longest = f"the longest context that fits is {self.max_context:,} tokens" + (
                " (or more: the search stops there)" if self.max_context >= MAX_SEARCH_CONTEXT else ""
            )
        elif self.weights_gib + self.optimizer_gib > self.gpu_gib:
            longest = "no context fits"
        else:
            longest = (
                f"no context fits: at {self.prompt_length + 1:,} tokens (the prompt and one more) the step "
                f"needs {self.shortest_peak_gib:.2f} GiB"
            )
        return f"{head}; {longest}"


def detected_gpu_gib() -> tuple[float, str] | None:
    """(total memory in GiB, name) of CUDA device 0, or None without one."""
    if not torch.cuda.is_available():
        return None
    props = torch.cuda.get_device_properties(0)
    return props.total_memory / GIB, props.name


# Compute capability of the GPUs the kit names (NVIDIA's published values): FP8 tensor cores from
# grpo_kit.model.fp8.FP8_MIN_CAPABILITY on.
GPU_CAPABILITY = {
    "T4": (7, 5),
    "V100": (7, 0),
    "A100": (8, 0),
    "A10G": (8, 6),
    "RTX 3090": (8, 6),
    "L4": (8, 9),
    "RTX 4090": (8, 9),
    "L40S": (8, 9),
    "H100": (9, 0),
    "H200": (9, 0),
    "B200": (10, 0),
    "RTX 5090": (12, 0),
}


def has_fp8(gpu: str | None = None) -> bool:
    """Whether ``gpu`` (a ``GPU_CAPABILITY`` name, or a device name containing one such as ``"NVIDIA H100 80GB
    HBM3"``; None: CUDA device 0 here) has FP8 tensor cores, so ``base_weights='fp8'`` can run on it."""
    if gpu is None:
        return fp8_support("cuda") is None
    found = [cap for name, cap in GPU_CAPABILITY.items() if name.lower() in gpu.lower()]
    if not found:
        raise ValueError(f"unknown GPU {gpu!r}: one of {list(GPU_CAPABILITY)}")
    return found[0] >= FP8_MIN_CAPABILITY


def base_weights_for(gpu: str | None = None) -> dict:
    """The calculator's and the config's base-weight settings for ``gpu`` (see :func:`has_fp8`): FP8 where it
    has FP8 tensor cores (``{"base_weights": "fp8", "quantization": "fp8"}``), else 16-bit (``"16bit"``, None)."""
    fp8 = has_fp8(gpu)
    return {"base_weights": "fp8" if fp8 else "16bit", "quantization": "fp8" if fp8 else None}


def _peak_bytes(model, context: int, spec: EstimateSpec) -> float:
    """The GPU peak (bytes) of ``spec`` at ``context`` tokens: its prompt, the rest completion."""
    at = dataclasses.replace(spec, completion_length=context - spec.prompt_length)
    return total_gpu_bytes(estimate(model, at))


def longest_fitting_context(model, gpu_bytes: float, spec: EstimateSpec) -> int | None:
    """Largest ``spec.prompt_length + completion`` (tokens) whose estimated GPU peak is at most ``gpu_bytes``,
    ``spec`` with its completion length varied from one token up; None when ``spec.prompt_length + 1`` already
    does not fit."""
    lo = spec.prompt_length + 1
    if _peak_bytes(model, lo, spec) > gpu_bytes:
        return None
    hi = MAX_SEARCH_CONTEXT
    if _peak_bytes(model, hi, spec) <= gpu_bytes:
        return hi
    while hi - lo > 1:  # invariant: lo fits, hi does not
        mid = (lo + hi) // 2
        if _peak_bytes(model, mid, spec) <= gpu_bytes:
            lo = mid
        else:
            hi = mid
    return lo


def _gib(df, *components: str) -> float:
    """The GPU bytes of ``components`` in an :func:`estimate` table, in GiB."""
    return float(df.loc[df["component"].isin(components), "GiB"].sum())


def fit_verdict(model, gpu_gib: float, spec: EstimateSpec) -> FitVerdict:
    """Whether ``spec``'s step (its method, at ``spec.prompt_length + spec.completion_length`` tokens) fits in
    ``gpu_gib`` GiB, what its peak is made of, and the longest context that fits. A ``scoring_batch`` of ``auto``
    is priced as None: ``auto`` never raises the peak, so the verdict is the same without its search."""
    if not gpu_gib > 0:
        raise ValueError(f"gpu_gib={gpu_gib} must be > 0")
    if spec.scoring_batch == AUTO:
        spec = dataclasses.replace(spec, scoring_batch=None)
    context, prompt_length = spec.prompt_length + spec.completion_length, spec.prompt_length
    df = estimate(model, spec)
    longest = longest_fitting_context(model, gpu_gib * GIB, spec)
    shortest = None if longest is not None else _peak_bytes(model, prompt_length + 1, spec) / GIB
    return FitVerdict(
        method=spec.method,
        context=context,
        peak_gib=total_gpu_bytes(df) / GIB,
        gpu_gib=gpu_gib,
        max_context=longest,
        prompt_length=prompt_length,
        weights_gib=_gib(df, "model weights", "inference copy (vLLM)"),
        optimizer_gib=_gib(df, "LoRA + optimiser states"),
        kv_cache_gib=_gib(df, "KV cache (generation)"),
        peak_phase=df.attrs["peak_phase"],
        shortest_peak_gib=shortest,
        weights_what="the weights" + (" and vLLM's copy of them" if _gib(df, "inference copy (vLLM)") else ""),
        optimizer_what="the LoRA adapters with their optimiser state"
        if df.attrs["lora_rank"]
        else "the optimiser state",
    )


# Colab's free T4: 15 GiB nominal, less of it visible to torch; the budget leaves room for the CUDA context and the
# allocator's slack (memory reserved above what is allocated, which the calculator does not price; the qlora
# benchmark measures both).
FREE_T4_GIB = 14.0
# Context lengths a preset picks are rounded down to this many tokens.
PRESET_ROUND = 256


def free_t4_preset(
    model="llama-3.1-8b", *, num_generations: int = 8, prompt_length: int = 512, lora_rank: int = 16
) -> dict:
    """Settings for a free Colab T4 (fp16, no bf16): 4-bit base weights (QLoRA), HF generation (4-bit runs
    generate with HF ``generate``, all ``num_generations`` of a prompt at once), one sequence per
    micro-batch, and the longest context (prompt + completion, rounded down to ``PRESET_ROUND``) whose
    whole step, generation's KV cache included, the calculator fits in ``FREE_T4_GIB``. Returns
    ``context_length``, ``four_bit``, ``dtype``, ``generation_backend``, ``budget_gib`` and
    ``estimate_gib`` (the calculator's peak at that context); raises ValueError when nothing fits."""
    spec = EstimateSpec(
        num_generations=num_generations,
        prompt_length=prompt_length,
        completion_length=1,  # the search below varies it
        dtype="fp16",
        lora_rank=lora_rank,
        quantization="4bit",
        micro_batch_size=1,
        vllm=False,
        include_generation=True,
    )
    longest = longest_fitting_context(model, FREE_T4_GIB * GIB, spec)
    context = None if longest is None else longest // PRESET_ROUND * PRESET_ROUND
    if context is None or context <= prompt_length:
        raise ValueError(
            f"free_t4_preset: {model!r} with {num_generations} generations does not fit "
            f"{FREE_T4_GIB} GiB in 4-bit even at a {prompt_length}-token prompt"
        )
    peak = _peak_bytes(model, context, spec) / GIB
    return dict(
        context_length=context,
        four_bit=True,
        dtype="fp16",
        generation_backend="hf",
        budget_gib=FREE_T4_GIB,
        estimate_gib=peak,
        base_weights=base_weights_for("T4")["base_weights"],
    )


def config_fit(
    step: StepSpec, *, calculator_model=None, gpu_gib: float | None = None, detect: bool = True
) -> tuple[FitVerdict, str]:
    """The kit's step for a run (:class:`StepSpec`, or an object that makes one such as the app's config) against a
    GPU: the detected one (``detect``), else ``gpu_gib``. Returns the verdict and where the GPU size came from.
    ``calculator_model``: the built-in architecture to price (default ``step.model``, e.g. for a hub id without a
    local config). ``generation_backend: auto`` is priced as HF generation, whose KV cache (every sequence padded to
    the full context, in the model's dtype) is the larger; which backend ``auto`` becomes is known only when the run
    starts (its memory plan then prices vLLM's). ValueError when neither a GPU nor ``gpu_gib`` is there."""
    step = StepSpec.of(step)
    detected = detected_gpu_gib() if detect else None
    if detected is None and gpu_gib is None:
        raise ValueError("config_fit: no CUDA GPU detected; pass gpu_gib= (the card's memory in GiB)")
    budget, source = detected if detected else (gpu_gib, "gpu_gib parameter")
    verdict = fit_verdict(calculator_model or step.model, budget, config_estimate_spec(step))
    return verdict, source


def require_fit(step: StepSpec, *, calculator_model=None, gpu_gib: float | None = None) -> FitVerdict:
    """:func:`config_fit`, printed; a step that does not fit stops here with the numbers and what to change
    (RuntimeError), before any model loads."""
    step = StepSpec.of(step)
    verdict, source = config_fit(step, calculator_model=calculator_model, gpu_gib=gpu_gib)
    print(f"{source}: {verdict.text()}")
    if not verdict.fits:
        fix = (
            f"max_completion_length <= {verdict.max_context - step.max_prompt_length}"
            if verdict.max_context and verdict.max_context > step.max_prompt_length
            else "a smaller model"
        )
        weights = (
            "FP8 base weights (base_weights='fp8'), "
            if step.base_weights != "fp8" and detected_gpu_gib() and has_fp8()
            else ""
        )
        raise RuntimeError(
            f"the run does not fit: {verdict.text()}; try {fix}, fewer generations per micro-batch, "
            f"{weights}4-bit weights (load_in_4bit) or an FP8 KV cache (kv_cache_dtype='fp8')"
        )
    return verdict
