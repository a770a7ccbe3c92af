"""The common interface of the generation backends: sampling settings, results, protocol.

Every backend takes prompts as token ids (or strings, tokenised here the same way for
all backends), samples ``num_generations`` completions per prompt and returns a
:class:`GenerationResult` in prompt-major order: sample ``i * num_generations + g`` is
generation ``g`` of prompt ``i``.

Log-probs are those of the *sampling* distribution (temperature, min-p, top-k, top-p
applied, in vLLM's order), one fp32 value per completion token: what the
importance-sampling correction compares against the training model. With
``temperature == 0`` (greedy) they are the log-probs of the unscaled model distribution.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import torch

from grpo_kit.generation.spec import GenerationSpec

GENERATION_BACKENDS = ("auto", "hf", "vllm")  # make_generator's backend, the config's generation_backend


@dataclass(frozen=True)
class SamplingConfig:
    """Sampling settings shared by all backends.

    ``temperature`` >= 0 (0: greedy), ``top_p`` in (0, 1], ``top_k`` >= 0 (0: off),
    ``min_p`` in [0, 1) (0: off), ``max_tokens`` >= 1 new tokens per completion,
    ``min_tokens`` >= 0: no stop token before this many (fixed-length runs on random weights),
    ``seed`` (None: the backend's running generator; an int makes a call reproducible),
    ``stop_token_ids``: generation of a sample ends at the first of these (kept in the
    completion, as TRL does with EOS); empty: the tokenizer's EOS.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    max_tokens: int = 32
    min_tokens: int = 0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()

    def __post_init__(self):
        def bad(name, allowed):
            raise ValueError(f"{name}={getattr(self, name)!r} is not allowed: {allowed}")

        def is_num(x):
            return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)

        if not is_num(self.temperature) or self.temperature < 0:
            bad("temperature", "a number >= 0 (0 means greedy)")
        if not is_num(self.top_p) or not 0 < self.top_p <= 1:
            bad("top_p", "a number in (0, 1]")
        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool) or self.top_k < 0:
            bad("top_k", "an integer >= 0 (0 means off)")
        if not is_num(self.min_p) or not 0 <= self.min_p < 1:
            bad("min_p", "a number in [0, 1) (0 means off)")
        if not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool) or self.max_tokens < 1:
            bad("max_tokens", "an integer >= 1")
        if (
            not isinstance(self.min_tokens, int)
            or isinstance(self.min_tokens, bool)
            or not 0 <= self.min_tokens <= self.max_tokens
        ):
            bad("min_tokens", f"an integer in [0, max_tokens={self.max_tokens}]")
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool) or self.seed < 0):
            bad("seed", "None or an integer >= 0")
        ids = tuple(self.stop_token_ids)
        if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids):
            bad("stop_token_ids", "a sequence of token ids (integers >= 0)")
        object.__setattr__(self, "stop_token_ids", ids)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @classmethod
    def from_config(
        cls, gen: GenerationSpec, *, seed: int | None = None, stop_token_ids: Sequence[int] = ()
    ) -> SamplingConfig:
        """From a run's :class:`~grpo_kit.generation.spec.GenerationSpec` (or an object that makes one, such as the
        app's config): its sampling fields (TRL's names) and ``max_completion_length``."""
        gen = GenerationSpec.of(gen)
        return cls(
            temperature=gen.temperature,
            top_p=gen.top_p,
            top_k=gen.top_k,
            min_p=gen.min_p or 0.0,
            max_tokens=gen.step.max_completion_length,
            seed=seed,
            stop_token_ids=tuple(stop_token_ids),
        )


@dataclass
class GenerationResult:
    """Completions of one ``generate`` call, prompt-major (``len == num_prompts * num_generations``).

    ``prompt_ids[j]``: the prompt of sample j (token ids); ``completion_ids[j]``: its
    completion, ending with the stop token when it stopped; ``texts[j]``: the completion
    decoded without special tokens; ``logprobs[j]``: fp32 tensor, shape
    ``(len(completion_ids[j]),)``, the sampling log-prob of each completion token;
    ``finish_reasons[j]``: ``"stop"`` or ``"length"``.
    """

    prompt_ids: list[list[int]]
    completion_ids: list[list[int]]
    texts: list[str]
    logprobs: list[torch.Tensor]
    finish_reasons: list[str]
    num_generations: int
    timings: dict = field(default_factory=dict)

    def __post_init__(self):
        n = len(self.completion_ids)
        for name in ("prompt_ids", "texts", "logprobs", "finish_reasons"):
            if len(getattr(self, name)) != n:
                raise ValueError(f"GenerationResult.{name} has {len(getattr(self, name))} entries, expected {n}")
        for j, (ids, lp) in enumerate(zip(self.completion_ids, self.logprobs)):
            if lp.dtype != torch.float32 or lp.shape != (len(ids),):
                raise ValueError(
                    f"GenerationResult.logprobs[{j}] must be fp32 of shape ({len(ids)},), "
                    f"got {lp.dtype} {tuple(lp.shape)}"
                )

    def __len__(self) -> int:
        return len(self.completion_ids)

    @property
    def num_completion_tokens(self) -> int:
        return sum(len(c) for c in self.completion_ids)

    def logprobs_lists(self) -> list[list[float]]:
        """The log-probs as plain lists (the form TRL's ``_generate_single_turn`` returns)."""
        return [lp.tolist() for lp in self.logprobs]


@runtime_checkable
class Generator(Protocol):
    """What the trainer needs from a generation backend."""

    name: str
    needs_sync: bool  # True while the backend holds no usable weights: sync_weights must run first

    def generate(
        self, prompts: list[list[int]] | list[str], num_generations: int = 1, sampling: SamplingConfig | None = None
    ) -> GenerationResult: ...

    def sync_weights(self, model) -> dict:
        """Make the backend generate with ``model``'s current weights; returns timing info."""

    def sleep(self) -> bool:
        """Release generation memory while training runs; False where unsupported (no-op)."""

    def wake(self) -> bool:
        """Undo :meth:`sleep`; False where unsupported (no-op)."""

    def close(self) -> None: ...


class GenerationEngineError(RuntimeError):
    """The generation engine failed or was closed; it cannot be used again."""


def encode_prompts(tokenizer, prompts, *, vocab_size: int | None = None) -> list[list[int]]:
    """Token ids for ``prompts``: strings are tokenised as-is (no chat template), id lists checked.

    Every backend goes through here, so a string prompt becomes the same ids everywhere.
    """
    if isinstance(prompts, (str, bytes)) or not isinstance(prompts, Sequence) or len(prompts) == 0:
        raise ValueError(
            f"prompts must be a non-empty list of strings or of token-id lists, got {type(prompts).__name__}"
            + (" (wrap a single prompt in a list)" if isinstance(prompts, str) else "")
        )
    out = []
    for i, p in enumerate(prompts):
        if isinstance(p, str):
            if tokenizer is None:
                raise ValueError("string prompts need a tokenizer; pass token ids or give the generator a tokenizer")
            ids = list(tokenizer(p, add_special_tokens=True)["input_ids"])
        elif isinstance(p, torch.Tensor):
            ids = p.tolist()
        else:
            ids = list(p)
        if not ids:
            raise ValueError(f"prompts[{i}] is empty; every prompt needs at least one token")
        if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids):
            raise ValueError(f"prompts[{i}] must hold token ids (integers >= 0)")
        if vocab_size is not None and max(ids) >= vocab_size:
            raise ValueError(f"prompts[{i}] holds token id {max(ids)}, outside the vocabulary (size {vocab_size})")
        out.append(ids)
    return out


def check_num_generations(num_generations) -> int:
    if not isinstance(num_generations, int) or isinstance(num_generations, bool) or num_generations < 1:
        raise ValueError(f"num_generations={num_generations!r} is not allowed: an integer >= 1")
    return num_generations


def check_context(prompt_ids: list[list[int]], max_tokens: int, max_len: int, what: str) -> None:
    """Prompt + ``max_tokens`` must fit the context; ValueError naming the numbers otherwise."""
    longest = max(len(p) for p in prompt_ids)
    if longest + max_tokens > max_len:
        raise ValueError(
            f"max_tokens={max_tokens} beyond the context: the longest prompt has {longest} tokens and "
            f"{what} is {max_len}, so max_tokens can be at most {max_len - longest}"
        )


def cut_at_stop(ids: list[int], stop_ids: Sequence[int]) -> tuple[list[int], str]:
    """Completion up to and including the first stop token; reason ``"stop"`` or ``"length"``."""
    stops = set(stop_ids)
    for k, t in enumerate(ids):
        if t in stops:
            return ids[: k + 1], "stop"
    return ids, "length"
