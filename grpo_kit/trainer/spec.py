"""What the trainer layer takes from a run: :class:`TrainerSpec`, built by the app from its config (field names as
there)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from grpo_kit.memory.spec import StepSpec


@dataclass(frozen=True)
class TrainerSpec:
    """A run's trainer settings (names, values and meanings as in ``GRPOKitConfig``): the reward checks
    (``reward_errors``, ``reward_time_limit_s``), the tools and environment with their limits, the loss's chunk
    rows, the guards' ``max_bad_steps`` and ``keep_checkpoints``, and ``step``: the run's step as the VRAM
    calculator prices it (which trainer, sizes, ``scoring_batch_size``), for the scoring batch and the OOM
    message's estimate."""

    step: StepSpec
    tools: Sequence
    environment: str | None
    reward_errors: str
    reward_time_limit_s: float
    tool_time_limit_s: float
    tool_output_tokens: int
    loss_chunk_size: int | None
    max_bad_steps: int
    keep_checkpoints: int

    @classmethod
    def of(cls, source) -> TrainerSpec:
        """``source`` itself, or the spec it makes: an object with ``spec(kind)``, such as the app's config
        (``GRPOKitConfig.spec``), for callers (benchmarks, tests) that hold a config."""
        return source if isinstance(source, cls) else source.spec(cls)
