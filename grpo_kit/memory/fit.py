"""Does it fit? The calculator's peak against a GPU's memory, and the longest context that still fits.

The estimate grows monotonically with the context (weights fixed; KV cache, activations, logits chunks and
checkpoints all grow with tokens), so the longest fitting context is found by bisection over
:func:`grpo_kit.memory.estimate.estimate`. Formulas only: no GPU is touched.
"""

from __future__ import annotations

from dataclasses import dataclass

from grpo_kit.memory.estimate import estimate, total_gpu_bytes

GIB = 2**30
# Upper end of the context search (tokens): beyond every built-in model's positions.
MAX_SEARCH_CONTEXT = 1 << 20


@dataclass(frozen=True)
class FitVerdict:
    """``peak_gib``: the estimate's GPU peak at ``context`` tokens; ``gpu_gib``: the memory it is compared
    with; ``max_context``: the longest context (prompt + completion tokens) that fits, None when not even
    ``prompt_length + 1`` tokens fit."""
    method: str
    context: int
    peak_gib: float
    gpu_gib: float
    max_context: int | None

    @property
    def fits(self) -> bool:
        return self.peak_gib <= self.gpu_gib

    def text(self) -> str:
        head = (f"{self.method}: fits, {self.peak_gib:.2f} of {self.gpu_gib:.2f} GiB "
                f"({self.gpu_gib - self.peak_gib:.2f} GiB to spare)" if self.fits else
                f"{self.method}: does not fit, needs {self.peak_gib:.2f} GiB, the GPU has {self.gpu_gib:.2f} GiB")
        longest = ("not even the prompt fits" if self.max_context is None else
                   f"longest context that fits: {self.max_context:,} tokens"
                   + (" (or more: the search stops there)" if self.max_context >= MAX_SEARCH_CONTEXT else ""))
        return f"{head}; {longest}"


def detected_gpu_gib() -> tuple[float, str] | None:
    """(total memory in GiB, name) of CUDA device 0, or None without one."""
    import torch

    if not torch.cuda.is_available():
        return None
    props = torch.cuda.get_device_properties(0)
    return props.total_memory / GIB, props.name


def _peak_bytes(model, context: int, prompt_length: int, kwargs: dict) -> float:
    return total_gpu_bytes(estimate(model, prompt_length=prompt_length, completion_length=context - prompt_length,
                                    **kwargs))


def longest_fitting_context(model, gpu_bytes: float, *, prompt_length: int = 0, **kwargs) -> int | None:
    """Largest ``prompt_length + completion`` (tokens) whose estimated GPU peak is at most ``gpu_bytes``
    (``kwargs``: the rest of :func:`estimate`'s arguments); None when ``prompt_length + 1`` already does not."""
    lo = prompt_length + 1
    if _peak_bytes(model, lo, prompt_length, kwargs) > gpu_bytes:
        return None
    hi = MAX_SEARCH_CONTEXT
    if _peak_bytes(model, hi, prompt_length, kwargs) <= gpu_bytes:
        return hi
    while hi - lo > 1:  # invariant: lo fits, hi does not
        mid = (lo + hi) // 2
        if _peak_bytes(model, mid, prompt_length, kwargs) <= gpu_bytes:
            lo = mid
        else:
            hi = mid
    return lo


def fit_verdict(model, gpu_gib: float, *, context: int, prompt_length: int = 0, method: str = "grpo_kit",
                **kwargs) -> FitVerdict:
    """Whether ``method``'s step at ``context`` tokens fits in ``gpu_gib`` GiB, and the longest context that
    does (``kwargs``: :func:`estimate`'s other arguments, e.g. ``num_generations``, ``lora_rank``)."""
    if not gpu_gib > 0:
        raise ValueError(f"gpu_gib={gpu_gib} must be > 0")
    kwargs = dict(kwargs, method=method)
    peak = _peak_bytes(model, context, prompt_length, kwargs) / GIB
    longest = longest_fitting_context(model, gpu_gib * GIB, prompt_length=prompt_length, **kwargs)
    return FitVerdict(method=method, context=context, peak_gib=peak, gpu_gib=gpu_gib, max_context=longest)
