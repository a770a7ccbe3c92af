"""The step the calculator prices for a run: :class:`StepSpec`, the run's settings that size one GRPO step.

The app builds it from its config (``grpo_kit.app.specs``); its field names are the config's, and its defaults are
the kit's own run (``python -m grpo_kit train`` with no settings), which the config takes from here: the ``vram``
command prices that run without the app's config.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class StepSpec:
    """One run's step as the VRAM calculator prices it (names and meanings as in ``GRPOKitConfig``).

    ``model``: a built-in name, a folder or a hub id (the architecture priced). Sizes in tokens and sequences;
    ``dtype`` the config's name (``auto``, ``fp32``, ``bf16``, ``fp16``); ``scoring_batch_size``: an int, ``auto``
    or None; ``prefix_sharing``: ``auto``, True or False."""

    model: str = "smollm2-135m-instruct"
    num_generations: int = 8
    max_prompt_length: int = 256
    max_completion_length: int = 24  # the arithmetic task's answers are short
    per_device_train_batch_size: int = 16  # 2 prompts of 8 completions: fewer steps without reward spread
    gradient_accumulation_steps: int = 1
    num_iterations: int = 1
    dtype: str = "auto"
    trainer: str = "grpo_kit"
    use_lora: bool = True
    lora_rank: int = 16
    lora_dropout: float = 0.0
    load_in_4bit: bool = False
    base_weights: str = "16bit"
    generation_backend: str = "auto"
    kv_cache_dtype: str = "auto"
    scoring_batch_size: int | str | None = "auto"
    prefix_sharing: bool | str = "auto"  # grpo_kit.model.prefix: a group's shared prompt scored once

    @classmethod
    def of(cls, source) -> StepSpec:
        """``source`` itself, or the spec it makes: an object with ``spec(kind)``, such as the app's config
        (``GRPOKitConfig.spec``), so that a notebook may hand its config to the calculator's functions."""
        return source if isinstance(source, cls) else source.spec(cls)
