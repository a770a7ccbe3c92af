"""Pre-flight check: will GRPO get a learning signal from this model, task and rewards at the start?

GRPO learns only from groups whose rewards differ (an all-equal group has zero advantage). This samples
``num_generations`` completions for a few training prompts from the untrained model, scores them with the
config's reward functions and reports the share of groups with no reward spread, the truncation rate, a
histogram per reward function and, when most groups carry no signal, what to change. It is what
``python -m grpo_kit preflight`` prints; ``train`` prints :func:`advice` after its first step.
"""

from __future__ import annotations

import collections
import time
from dataclasses import dataclass, field

import torch

from grpo_kit.generation import SamplingConfig, make_generator
from grpo_kit.generation.spec import GenerationSpec
from grpo_kit.model.devices import DeviceSpec, resolve_device, resolve_dtype
from grpo_kit.model.loading import load_model, load_tokenizer
from grpo_kit.tasks.data import DataSpec, build_datasets, default_system_prompt, make_prompt
from grpo_kit.tasks.rewards import checked_reward_func, get_reward_funcs
from grpo_kit.tasks.sandbox import set_default_filesystem

# Above this share of no-signal groups the report gives advice ("most groups carry no signal").
NO_SIGNAL_ADVICE_SHARE = 0.5
# Above this share of completions cut at max_completion_length, longer completions are advised.
TRUNCATION_ADVICE_SHARE = 0.3
FORMAT_REWARDS = ("format_soft", "format_strict")


@dataclass
class PreflightReport:
    """``zero_spread_share``: share of prompts whose ``num_generations`` weighted rewards are all equal, in
    [0, 1]; ``truncation_rate``: share of completions that hit ``max_completion_length``; ``histograms``:
    reward function name -> {value (or "lo..hi" bin): count}; ``means``: name -> mean reward."""

    num_prompts: int
    num_generations: int
    zero_spread_share: float
    truncation_rate: float
    means: dict
    histograms: dict
    advice: list = field(default_factory=list)
    seconds: float = 0.0
    samples: list = field(default_factory=list)
    constant: dict = field(default_factory=dict)  # name -> the one value a reward function gave every sample

    def text(self) -> str:
        lines = [
            f"pre-flight: {self.num_prompts} prompts x {self.num_generations} completions from the untrained "
            f"model ({self.seconds:.1f} s)",
            f"  groups with no reward spread (no learning signal): {self.zero_spread_share:.0%}",
            f"  completions cut at max_completion_length: {self.truncation_rate:.0%}",
        ]
        for name, hist in self.histograms.items():
            counts = ", ".join(f"{k}: {v}" for k, v in hist.items())
            lines.append(f"  {name}: mean {self.means[name]:.3f}; histogram {{{counts}}}")
        lines += [f"  {dead_reward_text(name, value)}" for name, value in self.constant.items()]
        lines += [f"  sample: {s!r}" for s in self.samples[:2]]
        lines += (
            ["advice:"] + [f"  - {a}" for a in self.advice] if self.advice else ["advice: none, the start has signal"]
        )
        return "\n".join(lines)


def dead_reward_text(name: str, value: float) -> str:
    """What a reward function that gave every sample the same ``value`` means for the run."""
    return (
        f"{name} gave {value:.3f} to every sample: it adds nothing to any advantage (does the prompt ask for "
        "what it pays? drop it from reward_funcs, or make it pay for something the model can do)"
    )


def constant_rewards(scores: dict) -> dict:
    """``{name: value}`` of the reward functions whose scores (``{name: [score or None]}``) are one value for
    every sample.

    >>> constant_rewards({"correctness": [0.0, 1.0], "format_soft": [0.0, 0.0]})
    {'format_soft': 0.0}
    """
    out = {}
    for name, values in scores.items():
        distinct = {round(v or 0.0, 12) for v in values}
        if len(values) > 1 and len(distinct) == 1:
            out[name] = distinct.pop()
    return out


def histogram(values: list[float], max_distinct: int = 6, bins: int = 5) -> dict:
    """Counts per distinct value (rounded to 3 decimals) when there are few, else per equal-width bin.

    >>> histogram([0.0, 1.0, 0.0, 0.5])
    {0.0: 2, 0.5: 1, 1.0: 1}
    >>> histogram([0.1 * i for i in range(10)], bins=2)
    {'0.00..0.45': 5, '0.45..0.90': 5}
    """
    rounded = [round(v, 3) for v in values]
    distinct = sorted(set(rounded))
    if len(distinct) <= max_distinct:
        c = collections.Counter(rounded)
        return {v: c[v] for v in distinct}
    lo, hi = min(values), max(values)
    width = (hi - lo) / bins
    out = collections.Counter(min(int((v - lo) / width), bins - 1) for v in values)
    return {f"{lo + i * width:.2f}..{lo + (i + 1) * width:.2f}": out[i] for i in range(bins)}


def advice(cfg, zero_spread_share: float, truncation_rate: float, means: dict | None = None) -> list[str]:
    """What to change when most groups carry no signal (``zero_spread_share`` > ``NO_SIGNAL_ADVICE_SHARE``);
    empty otherwise. ``means``: reward function name -> mean reward (all zero: the model never scores)."""
    if zero_spread_share <= NO_SIGNAL_ADVICE_SHARE:
        return []
    out = []
    if cfg.task in ("arithmetic", "word_problems", "long_document") and sorted(cfg.levels) != [1]:
        out.append(f"easier problems: --set levels=[1] (now {cfg.levels})")
    if truncation_rate > TRUNCATION_ADVICE_SHARE:
        out.append(
            f"longer completions: {truncation_rate:.0%} hit max_completion_length={cfg.max_completion_length}"
            f"; try --set max_completion_length={2 * cfg.max_completion_length}"
        )
    if not any(isinstance(r, str) and r in FORMAT_REWARDS for r in cfg.reward_funcs):
        out.append("a format reward that pays partial credit: add format_soft to reward_funcs")
    if means is not None and all(abs(m) < 1e-12 for m in means.values()):
        out.append("an SFT warm-up on a few solved examples: the untrained model earned no reward at all")
    else:
        out.append("an SFT warm-up on a few solved examples, so that more completions earn a reward")
    out.append(
        f"more completions per group (num_generations={cfg.num_generations}) raise the chance that a "
        "group has one success"
    )
    return out


def preflight(cfg, *, num_prompts: int = 8, backend: str = "hf") -> PreflightReport:
    """Run the check for a ``GRPOKitConfig`` (validated here): the first ``num_prompts`` training prompts,
    ``cfg.num_generations`` samples each with the config's sampling settings, scored by ``cfg.reward_funcs``
    (weighted by ``cfg.reward_weights``). ``backend``: ``hf`` (the model in this process) or ``vllm``."""
    if not isinstance(num_prompts, int) or num_prompts < 1:
        raise ValueError(f"num_prompts={num_prompts!r} must be an integer >= 1")
    cfg.validate()
    set_default_filesystem(cfg.sandbox_filesystem)  # what model code run by the rewards sees
    train_ex, _ = build_datasets(cfg.spec(DataSpec))
    examples = train_ex[:num_prompts]
    funcs = [checked_reward_func(f) for f in get_reward_funcs(cfg.reward_funcs)]
    weights = list(cfg.reward_weights) or [1.0] * len(funcs)
    run = cfg.spec(DeviceSpec)
    device = resolve_device(run)
    dtype = resolve_dtype(run, device)
    system = cfg.system_prompt or default_system_prompt(cfg.task)
    tok = load_tokenizer(cfg.model)
    messages = [make_prompt(e["question"], system) for e in examples]
    prompts = [tok.apply_chat_template(m, tokenize=False, add_generation_prompt=True) for m in messages]
    model = load_model(cfg.model, dtype=dtype, device=device, seed=cfg.seed)[0]
    gen = make_generator(backend, model=model, tokenizer=tok)
    g = cfg.num_generations
    t0 = time.perf_counter()
    with torch.no_grad():
        res = gen.generate(
            prompts,
            num_generations=g,
            sampling=SamplingConfig.from_config(
                cfg.spec(GenerationSpec), seed=cfg.seed, stop_token_ids=[tok.eos_token_id]
            ),
        )
    seconds = time.perf_counter() - t0
    columns = {"answer": [e["answer"] for e in examples for _ in range(g)]}
    group_prompts = [m for m in messages for _ in range(g)]
    scores = {f.__name__.removesuffix("_reward"): f(group_prompts, res.texts, **columns) for f in funcs}
    total = [sum(w * (s[j] or 0.0) for w, s in zip(weights, scores.values())) for j in range(len(res))]
    zero = sum(
        1 for i in range(len(examples)) if max(total[i * g : (i + 1) * g]) - min(total[i * g : (i + 1) * g]) < 1e-9
    ) / len(examples)
    truncated = sum(r == "length" for r in res.finish_reasons) / len(res)
    means = {k: sum(v or 0.0 for v in s) / len(s) for k, s in scores.items()}
    return PreflightReport(
        num_prompts=len(examples),
        num_generations=g,
        zero_spread_share=zero,
        truncation_rate=truncated,
        means=means,
        histograms={k: histogram([v or 0.0 for v in s]) for k, s in scores.items()},
        advice=advice(cfg, zero, truncated, means),
        seconds=seconds,
        samples=res.texts[:2],
        constant=constant_rewards(scores),
    )
