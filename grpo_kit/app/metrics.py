"""The run's record of its steps: metrics.csv (one row per logged step), the compact step line, the step-1
pre-flight line, samples.jsonl and rewards.png. :func:`grpo_kit.app.run.train` composes them into the trainer's
callbacks; the notebooks' dashboard reads the same rows."""

from __future__ import annotations

import csv
import json
import resource
import time
from pathlib import Path

import matplotlib
import torch
from tqdm import tqdm
from transformers import TrainerCallback

from grpo_kit.app.config import GRPOKitConfig
from grpo_kit.app.console import step_line
from grpo_kit.app.preflight import advice, dead_reward_text
from grpo_kit.tasks.rewards import completion_text

METRIC_COLUMNS = [
    "step",
    "reward_mean",
    "reward_std",
    "loss",
    "kl",
    "completion_length",
    "step_time_s",
    "peak_memory_gib",
    "learning_rate",
    "grad_norm",
    "clip_ratio",
    "frac_reward_zero_std",
]
# The kit's own per-step metrics, added to the trainer's logged dict for the trackers of report_to (TRL logs the
# others: rewards per function, frac_reward_zero_std, generation/seconds, ...).
KIT_LOGGED_METRICS = ("step_time_s", "peak_memory_gib")


def metric_columns(history: list[dict]) -> list[str]:
    """metrics.csv's header: ``METRIC_COLUMNS``, then every other key TRL logged in the first row (the full
    dict: per-reward means and stds, entropy, clipped ratio, token counts, ...), in TRL's order."""
    return METRIC_COLUMNS + [k for k in (history[0] if history else {}) if k not in METRIC_COLUMNS]


def peak_memory_gib(device: str) -> float:
    """Peak allocated CUDA memory, or the process's peak resident set size on the CPU."""
    if device == "cuda":
        return torch.cuda.max_memory_allocated() / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


class SampleRecorder:
    """Keeps what each step generated and how it scored: the first reward function's checked scores
    (once per generation batch, enough to follow the completions), as ``on_rewards`` of
    :func:`grpo_kit.tasks.rewards.checked_reward_func`."""

    def __init__(self, path: Path, keep_per_step: int = 4):
        self.path, self.keep, self.step = path, keep_per_step, 0

    def record(self, name: str, prompts, completions, columns: dict, rewards: list) -> None:
        with self.path.open("a", encoding="utf-8") as fh:
            for i in range(min(self.keep, len(completions))):
                prompt = prompts[i][-1]["content"] if isinstance(prompts[i], list) else prompts[i]
                fh.write(
                    json.dumps(
                        {
                            "step": self.step,
                            "prompt": prompt,
                            "completion": completion_text(completions[i]),
                            "answer": columns.get("answer", [None] * len(completions))[i],
                            name: rewards[i],
                        }
                    )
                    + "\n"
                )
        self.step += 1


class MetricsCallback(TrainerCallback):
    """Writes one metrics.csv row per logged step (TRL's whole dict, with step time and peak memory) and
    prints the step's compact line (grpo_kit.app.console.step_line). It adds ``KIT_LOGGED_METRICS`` to the
    logged dict, so the trackers' callbacks, which run after it (:func:`_connect_trackers`), log them too."""

    def __init__(self, cfg: GRPOKitConfig, run_dir: Path, device: str, history: list):
        self.cfg, self.device, self.history = cfg, device, history
        self._t0 = None
        self._times: list[float] = []
        self.csv_path = run_dir / "metrics.csv"
        self._started = bool(history)  # resumed: metrics.csv already has the rows so far
        self.columns = metric_columns(history)
        self._first_row = not history  # a resumed run had its first step already

    def on_step_begin(self, args, state, control, **kw):
        self._t0 = time.perf_counter()

    def on_step_end(self, args, state, control, **kw):
        if self._t0 is not None:
            self._times.append(time.perf_counter() - self._t0)

    def on_log(self, args, state, control, logs=None, **kw):
        logs = logs or {}
        if "reward" not in logs or not state.is_world_process_zero:  # summary line, or another process
            return
        row = {
            "step": state.global_step,
            "reward_mean": logs.get("reward"),
            "reward_std": logs.get("reward_std"),
            "loss": logs.get("loss"),
            "kl": logs.get("kl"),
            "completion_length": logs.get("completions/mean_length"),
            "step_time_s": sum(self._times) / len(self._times) if self._times else None,
            "peak_memory_gib": peak_memory_gib(self.device),
            "learning_rate": logs.get("learning_rate"),
            "grad_norm": logs.get("grad_norm"),
            "clip_ratio": logs.get("clip_ratio/region_mean"),
            # Share of groups whose rewards are all equal: zero advantage, so no learning signal.
            "frac_reward_zero_std": logs.get("frac_reward_zero_std"),
        }
        row.update({k: v for k, v in logs.items() if k not in row})
        logs.update({k: row[k] for k in KIT_LOGGED_METRICS if row[k] is not None})  # after the row: same columns
        self._times.clear()
        self.history.append(row)
        if not self._started:  # created on the first row, so other processes never truncate it
            self.columns = metric_columns(self.history)
            with self.csv_path.open("w", newline="") as fh:
                csv.writer(fh).writerow(self.columns)
            self._started = True
        with self.csv_path.open("a", newline="") as fh:
            csv.writer(fh).writerow([row.get(c) for c in self.columns])
        tqdm.write(step_line(row, self.cfg.max_steps))  # above the progress bar, not through it
        if self._first_row:  # the short pre-flight check: did the start carry a learning signal?
            self._first_row = False
            tqdm.write(first_step_advice(self.cfg, row))


def first_step_advice(cfg: GRPOKitConfig, row: dict) -> str:
    """The lines after the first logged step: its share of no-signal groups and, when most groups had none,
    the pre-flight advice (grpo_kit.app.preflight.advice); then one line per reward function that gave every sample
    the same value."""
    zero = row.get("frac_reward_zero_std") or 0.0
    means = {k: v for k, v in row.items() if k.startswith("rewards/") and k.endswith("/mean") and v is not None}
    tips = advice(cfg, zero, row.get("completions/clipped_ratio") or 0.0, means)
    head = f"pre-flight (step {row.get('step')}): {zero:.0%} of groups had no reward spread"
    text = (
        f"{head}; try: {'; '.join(tips)}. Details: python -m grpo_kit preflight"
        if tips
        else f"{head}: the start has a learning signal"
    )
    # TRL logs each reward function's std over the step's samples: 0 means one value for all of them
    dead = [
        dead_reward_text(
            k.removeprefix("rewards/").removesuffix("/std"), row.get(k.removesuffix("std") + "mean") or 0.0
        )
        for k, v in row.items()
        if k.startswith("rewards/") and k.endswith("/std") and v == 0.0
    ]
    return "\n".join([text, *(f"pre-flight (step {row.get('step')}): {d}" for d in dead)])


def plot_rewards(history: list[dict], path: Path) -> None:
    """Reward mean ± std per step (and each reward function's mean) to a PNG."""
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # lazy: after choosing the Agg backend, which pyplot reads on import

    fig, ax = plt.subplots(figsize=(7, 4))
    steps = [r["step"] for r in history]
    mean = [r["reward_mean"] for r in history]
    std = [r["reward_std"] or 0.0 for r in history]
    ax.plot(steps, mean, label="reward (weighted sum)", color="C0")
    ax.fill_between(steps, [m - s for m, s in zip(mean, std)], [m + s for m, s in zip(mean, std)], alpha=0.2)
    for key in sorted({k for r in history for k in r if k.startswith("rewards/") and k.endswith("/mean")}):
        ax.plot(steps, [r.get(key) for r in history], label=key.split("/")[1], lw=1)
    ax.set_xlabel("step")
    ax.set_ylabel("reward")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
