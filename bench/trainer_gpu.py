"""The whole trainer on a GPU: ``python -m grpo_kit train`` runs, kit trainer vs stock TRL.

    python -m grpo_kit bench trainer_gpu [--model llama-3.2-1b] [--steps 3] [--completion 512]

Each row is one ``grpo_kit.app.run.train`` call in its own process (so peaks do not mix), on a
config-only architecture with random weights (memory and speed do not depend on weight
values; the embedded tokenizer is used, so only the tokenizer files need be cached):

* ``kit_bf16_offload``  the kit's trainer, bf16, gradient checkpointing on -> offloaded
                        checkpointing (the trainer's default on CUDA) + efficient loss;
* ``kit_fp16_offload``  the same in fp16 (the T4 path: GradScaler through accelerate);
* ``kit_bf16``          the kit's trainer without checkpointing;
* ``trl_bf16_ckpt``     stock TRL ``GRPOTrainer``, bf16, HF gradient checkpointing.

Reported per row: peak ``max_memory_allocated`` over the run, mean step time (steps after
the first) split into phases (generation, scoring + old/ref log-probs, forward + backward,
the rest: optimiser and logging), mean completion length, whether offload buffers were in
use, loss/reward finite, LoRA weights changed.
Results: ``bench/results/data/trainer_gpu.jsonl`` (page ``trainer_gpu.md``).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import hardware, hardware_line, record_report

ROOT = Path(__file__).resolve().parent.parent

ROWS = {
    "kit_bf16_offload": ["trainer=grpo_kit", "dtype=bf16", "gradient_checkpointing=true"],
    "kit_fp16_offload": ["trainer=grpo_kit", "dtype=fp16", "gradient_checkpointing=true"],
    "kit_bf16": ["trainer=grpo_kit", "dtype=bf16", "gradient_checkpointing=false"],
    "trl_bf16_ckpt": ["trainer=trl", "dtype=bf16", "gradient_checkpointing=true"],
}


PHASES = (
    ("_generate_single_turn", "generate"),
    ("_generate_and_score_completions", "gen_score"),
    ("training_step", "training_step"),
)


def time_phases(classes) -> dict:
    """Wrap the trainer methods in ``PHASES`` on ``classes`` with synchronised timers that add
    into the returned dict. Only the outermost call of a name counts, so a subclass method
    calling ``super()`` is not timed twice."""
    import functools

    import torch

    totals = dict.fromkeys((n for _, n in PHASES), 0.0)
    depth = dict.fromkeys(totals, 0)

    def sync():
        if torch.cuda.is_available():
            torch.cuda.synchronize()

    def timed(name, fn):
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            depth[name] += 1
            outer = depth[name] == 1
            if outer:
                sync()
                start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                if outer:
                    sync()
                    totals[name] += time.perf_counter() - start
                depth[name] -= 1

        return wrapper

    for cls in classes:
        for attr, name in PHASES:
            if attr in cls.__dict__:
                setattr(cls, attr, timed(name, cls.__dict__[attr]))
    return totals


def one_row(sets: list[str], out_dir: str) -> dict:
    """Child process: one training run with a probe callback; prints a JSON line."""
    import torch
    from transformers import TrainerCallback
    from trl import GRPOTrainer

    from grpo_kit.app.config import GRPOKitConfig
    from grpo_kit.app.run import train
    from grpo_kit.model.offload import offload_stats
    from grpo_kit.trainer.generation_hook import KitGenerationMixin
    from grpo_kit.trainer.grpo_trainer import EfficientGRPOTrainer

    totals = time_phases((GRPOTrainer, KitGenerationMixin, EfficientGRPOTrainer))

    class Probe(TrainerCallback):
        def __init__(self):
            self.first = None
            self.host_gib = 0.0
            self.scaler = None
            self.step_peaks = []
            self.phases = []  # per optimiser step: seconds per phase name

        def on_step_end(self, args, state, control, model=None, **kw):
            self.phases.append(dict(totals))
            for k in totals:
                totals[k] = 0.0
            self.host_gib = max(self.host_gib, offload_stats(model)["host_bytes"] / 2**30)
            if torch.cuda.is_available():
                self.step_peaks.append(torch.cuda.max_memory_allocated() / 2**30)
            if self.first is None:
                self.first = {
                    n: p.detach().float().cpu().clone() for n, p in model.named_parameters() if p.requires_grad
                }

        def on_train_end(self, args, state, control, model=None, **kw):
            last = {n: p.detach().float().cpu() for n, p in model.named_parameters() if p.requires_grad}
            self.changed = any(not torch.equal(self.first[n], last[n]) for n in last) if self.first else None
            self.trainable_dtypes = sorted({str(p.dtype) for p in model.parameters() if p.requires_grad})

    # Random weights score 0 on every task reward, so advantages (and the policy gradient)
    # would be zero; a bench-only reward with spread makes the update real.
    import grpo_kit.app.config as kit_config
    import grpo_kit.tasks.rewards as kit_rewards

    def spread_reward(prompts, completions, **kw):
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        return [(sum(map(ord, t)) % 7) / 6.0 for t in texts]

    kit_rewards.REWARD_FUNCTIONS["bench_spread"] = spread_reward
    kit_config.REWARD_FUNCS = (*kit_config.REWARD_FUNCS, "bench_spread")
    cfg = GRPOKitConfig()
    cfg.output_dir = out_dir
    cfg.apply_overrides(sets)
    probe = Probe()
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    summary = train(cfg, progress=False, callbacks=(probe,), overwrite=True)  # a scratch folder, reused
    import csv

    rows = list(csv.DictReader(open(Path(out_dir) / "metrics.csv")))
    times = [float(r["step_time_s"]) for r in rows if r.get("step_time_s")]
    later = probe.phases[1:] or probe.phases
    mean = {k: sum(p[k] for p in later) / len(later) for k in totals}
    step_s = sum(times[1:]) / max(1, len(times) - 1)
    phase_s = {
        "generate": mean["generate"],
        "score_and_logps": mean["gen_score"] - mean["generate"],
        "forward_backward": mean["training_step"] - mean["gen_score"],
        "rest": step_s - mean["training_step"],
    }
    lengths = [float(r["completion_length"]) for r in rows if r.get("completion_length")]
    res = dict(
        summary,
        host_offload_gib=probe.host_gib,
        lora_changed_after_step1=probe.changed,
        trainable_dtypes=probe.trainable_dtypes,
        step_peaks_gib=probe.step_peaks,
        step_times_s=times,
        mean_step_s_after_first=step_s,
        phase_s_after_first=phase_s,
        phases_per_step=probe.phases,
        completion_lengths=lengths,
        losses=[r.get("loss") for r in rows],
        rewards=[r.get("reward_mean") for r in rows],
    )
    print("ROW " + json.dumps(res), flush=True)
    return res


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="llama-3.2-1b")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--generations", type=int, default=8)
    p.add_argument("--completion", type=int, default=512, help="max_completion_length (random weights rarely stop)")
    p.add_argument("--rows", default=",".join(ROWS))
    p.add_argument("--out-dir", default=str(ROOT / "bench" / "results"))
    p.add_argument("--tag", default="h200")
    p.add_argument("--one", help=argparse.SUPPRESS)
    p.add_argument("--run-dir", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.one:
        one_row(json.loads(a.one), a.run_dir)
        return 0

    import torch

    if not torch.cuda.is_available():
        raise SystemExit("bench trainer_gpu needs a CUDA GPU")
    common = [
        f"model={a.model}",
        f"max_steps={a.steps}",
        f"num_generations={a.generations}",
        f"per_device_train_batch_size={a.generations}",
        f"max_completion_length={a.completion}",
        "num_eval_samples=0",
        "num_train_samples=64",
        "device=cuda",
        "generation_backend=hf",
        "warmup_steps=0",
        "reward_funcs=[correctness, bench_spread]",
    ]
    results = []
    for name in a.rows.split(","):
        sets = common + ROWS[name]
        with tempfile.TemporaryDirectory() as run_dir:
            cmd = [sys.executable, __file__, "--one", json.dumps(sets), "--run-dir", run_dir]
            t0 = time.perf_counter()
            r = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
            wall = time.perf_counter() - t0
        line = [ln for ln in r.stdout.splitlines() if ln.startswith("ROW ")]
        if r.returncode != 0 or not line:
            res = dict(row=name, status="failed", error=(r.stderr or r.stdout)[-2500:])
        else:
            res = dict(json.loads(line[-1][4:]), row=name, status="ok")
        res.update(sets=sets, wall_s=round(wall, 1))
        print(json.dumps({k: v for k, v in res.items() if k not in ("error",)})[:1500], flush=True)
        if res["status"] != "ok":
            print(res["error"], flush=True)
        results.append(res)

    hw = hardware()
    cmd = "python -m grpo_kit bench trainer_gpu " + " ".join(argv if argv is not None else sys.argv[1:])
    lines = [
        f"# The whole trainer on a GPU ({hw['gpu']})",
        "",
        f"Command: `{cmd}`  ",
        f"Date: {hw['date']}; hardware: {hardware_line(hw)}.",
        "",
        f"`python -m grpo_kit train` in-process per row (own process each), model {a.model} (random weights, "
        f"embedded tokenizer), {a.generations} generations x up to {a.completion} completion tokens per step, "
        f"{a.steps} steps, LoRA r=16 on all linear layers, HF generate.",
        "",
        "| row | status | peak alloc GiB | mean step s (after 1st) | generate s | score + old/ref logp s "
        "| fwd + bwd s | rest s | mean completion tokens | host offload GiB | loss/reward finite "
        "| LoRA changed | trainable dtype |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        if r["status"] != "ok":
            lines.append(f"| {r['row']} | failed |" + " |" * 11)
            continue
        ph = r["phase_s_after_first"]
        length = (
            sum(r["completion_lengths"]) / len(r["completion_lengths"]) if r["completion_lengths"] else float("nan")
        )
        lines.append(
            f"| {r['row']} | ok | {r['peak_memory_gib']:.2f} | {r['mean_step_s_after_first']:.2f} | "
            f"{ph['generate']:.2f} | {ph['score_and_logps']:.2f} | {ph['forward_backward']:.2f} | "
            f"{ph['rest']:.2f} | {length:.0f} | "
            f"{r['host_offload_gib']:.2f} | {r['metrics_finite']} | {r['lora_changed_after_step1']} | "
            f"{','.join(r['trainable_dtypes'])} |"
        )
    record_report("trainer_gpu", dict(command=cmd, hardware=hw, results=results), lines, a.out_dir)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
