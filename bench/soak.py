"""Soak: many GRPO steps on a tiny model on the CPU, resident memory (RSS) sampled every step.

    python -m grpo_kit bench soak --steps 200

Runs the main job (``grpo_kit.app.run.train``: data, LoRA, ``EfficientGRPOTrainer``, TRL's HF
generation, reward functions, metrics and sample files) on ``tiny-llama`` with no evaluation,
and records the process's RSS (psutil) at the end of every optimiser step. After a warm-up
(default: the first 20% of the steps, at least 5) it reports the least-squares slope of RSS
per 100 steps and the max - min, plus steps/s. A leak that keeps something alive every step
shows as a positive slope; allocator noise does not grow with the step count.

``--leak-mib X`` injects a leak on purpose (X MiB of tensors kept alive at each step, as when a
step's outputs are appended to a list), to show what a leak looks like in these figures.
``--check-slope MIB`` exits with status 1 when the slope is above that many MiB per 100 steps;
``--check-floor MIB`` the same for the rise of the RSS floor (minimum of the second half of the
measured steps minus that of the first half, per 100 steps), which ignores transient per-step buffers
and so suits short runs (``tests/test_soak.py``: 20 steps, with and without ``--leak-mib``).

Appends to ``bench/results/data/soak.jsonl`` (``--out``'s folder to change, ``--no-write`` for none).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from _common import hardware, hardware_line, record_report

ROOT = Path(__file__).resolve().parent.parent


def drift(rss_mib: list[float], warmup: int) -> dict:
    """Slope (MiB per 100 steps, least squares) and max - min of RSS after ``warmup`` samples."""
    ys = rss_mib[warmup:]
    n = len(ys)
    if n < 2:
        raise ValueError(f"need at least 2 samples after a warm-up of {warmup}, got {n}")
    xs = list(range(warmup, warmup + n))
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx
    # The floor (minimum) of each half: a step's transient buffers lift single samples by a few MiB and
    # tilt a short run's slope, but only memory that stays allocated lifts the floor.
    half = n // 2
    floor_rise = (min(ys[half:]) - min(ys[:half])) / max(1, n - half) if half else 0.0
    return {
        "warmup_steps": warmup,
        "steps_measured": n,
        "slope_mib_per_100_steps": round(100 * slope, 3),
        "floor_rise_mib_per_100_steps": round(100 * floor_rise, 3),
        "max_minus_min_mib": round(max(ys) - min(ys), 3),
        "rss_first_mib": round(ys[0], 1),
        "rss_last_mib": round(ys[-1], 1),
        "rss_max_mib": round(max(ys), 1),
    }


def soak(
    steps: int = 200,
    *,
    warmup: int | None = None,
    leak_mib: float = 0.0,
    output_dir: str | None = None,
    seed: int = 0,
    extra_sets: tuple[str, ...] = (),
) -> dict:
    """Run ``steps`` GRPO steps of the main job on tiny-llama; RSS per step and its drift."""
    import psutil
    import torch
    from transformers import TrainerCallback

    from grpo_kit.app.config import GRPOKitConfig
    from grpo_kit.app.run import train

    out = output_dir or str(ROOT / "runs" / "bench_soak")
    cfg = GRPOKitConfig(
        model="tiny-llama",
        max_steps=steps,
        num_eval_samples=0,
        num_train_samples=max(64, steps),
        num_generations=4,
        per_device_train_batch_size=8,
        max_completion_length=16,
        output_dir=out,
        seed=seed,
        save_steps=0,
    )
    cfg.apply_overrides(list(extra_sets))
    proc = psutil.Process(os.getpid())
    rss: list[float] = []
    times: list[float] = []
    kept: list = []  # the injected leak, if any

    class RSSCallback(TrainerCallback):
        def __init__(self):
            self.t = None

        def on_step_begin(self, args, state, control, **kw):
            self.t = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            times.append(time.perf_counter() - self.t)
            if leak_mib:
                kept.append(torch.ones(int(leak_mib * 2**20) // 4))  # touched, so it is resident
            rss.append(proc.memory_info().rss / 2**20)

    t0 = time.perf_counter()
    summary = train(cfg, progress=False, callbacks=(RSSCallback(),), overwrite=True)  # a scratch folder, reused
    wall = time.perf_counter() - t0
    warm = warmup if warmup is not None else max(5, steps // 5)
    result = {
        "steps": len(rss),
        "config": {
            k: getattr(cfg, k)
            for k in (
                "model",
                "num_generations",
                "per_device_train_batch_size",
                "max_completion_length",
                "beta",
                "use_lora",
                "lora_rank",
                "loss_type",
                "trainer",
                "seed",
            )
        },
        "injected_leak_mib_per_step": leak_mib,
        "rss_mib": [round(r, 2) for r in rss],
        "step_time_s": [round(t, 4) for t in times],
        "wall_seconds": round(wall, 1),
        "train_seconds": summary.get("train_seconds"),
        "steps_per_second": round(len(times) / sum(times), 3) if times else None,
        "steps_per_second_after_warmup": (
            round(len(times[warm:]) / sum(times[warm:]), 3) if len(times) > warm else None
        ),
        "metrics_finite": summary.get("metrics_finite"),
        **drift(rss, warm),
    }
    return result


def write_results(result: dict, out: Path, command: str) -> None:
    hw = hardware("cpu")  # the soak runs on the CPU (a machine shared with other jobs)
    result = {
        "command": command,
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "hardware": hw,
        "torch": hw["torch"],
        **result,
    }
    rss = result["rss_mib"]
    marks = sorted({0, result["warmup_steps"], *range(0, len(rss), max(1, len(rss) // 10)), len(rss) - 1})
    lines = [
        "# Soak: GRPO steps on tiny-llama (CPU), RSS per step",
        "",
        f"- command: `{command}`",
        f"- date: {result['date']}",
        f"- hardware: {hardware_line(result['hardware'])} (CPU only, shared with other jobs)",
        f"- torch {result['torch']}; run: the main job (`grpo_kit.app.run.train`) with "
        + ", ".join(f"{k}={v}" for k, v in result["config"].items())
        + ", no evaluation",
        f"- injected leak: {result['injected_leak_mib_per_step']} MiB per step",
        "",
        "| figure | value |",
        "|---|---|",
        f"| steps run | {result['steps']} |",
        f"| warm-up excluded | first {result['warmup_steps']} steps |",
        f"| RSS slope after warm-up | {result['slope_mib_per_100_steps']:+.2f} MiB per 100 steps |",
        f"| RSS max - min after warm-up | {result['max_minus_min_mib']:.2f} MiB |",
        f"| RSS floor rise (min of 2nd half - min of 1st half) | "
        f"{result['floor_rise_mib_per_100_steps']:+.2f} MiB per 100 steps |",
        f"| RSS after warm-up, first / last / max | {result['rss_first_mib']} / {result['rss_last_mib']} / "
        f"{result['rss_max_mib']} MiB |",
        f"| steps/s (all steps / after warm-up) | {result['steps_per_second']} / "
        f"{result['steps_per_second_after_warmup']} |",
        f"| wall time | {result['wall_seconds']} s |",
        f"| loss and reward finite | {result['metrics_finite']} |",
        "",
        "RSS (MiB) at selected steps (1-based):",
        "",
        "| step | " + " | ".join(str(i + 1) for i in marks) + " |",
        "|---" * (len(marks) + 1) + "|",
        "| RSS | " + " | ".join(f"{rss[i]:.1f}" for i in marks) + " |",
        "",
        "Per-step RSS and step times are in the data file's row (`detail`).",
    ]
    record_report("soak", result, lines, out.parent)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--warmup", type=int, default=None, help="steps excluded from the drift (default 20%%, >= 5)")
    p.add_argument("--leak-mib", type=float, default=0.0, help="inject a leak of this many MiB per step")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="extra config override")
    p.add_argument("--runs-dir", default=str(ROOT / "runs" / "bench_soak"))
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "soak_cpu"))
    p.add_argument("--no-write", action="store_true")
    p.add_argument(
        "--check-slope", type=float, default=None, metavar="MIB", help="exit 1 when the slope exceeds MIB per 100 steps"
    )
    p.add_argument(
        "--check-floor",
        type=float,
        default=None,
        metavar="MIB",
        help="exit 1 when the RSS floor rises more than MIB per 100 steps",
    )
    args = p.parse_args(argv)
    result = soak(
        args.steps,
        warmup=args.warmup,
        leak_mib=args.leak_mib,
        output_dir=args.runs_dir,
        seed=args.seed,
        extra_sets=tuple(args.set),
    )
    command = "python -m grpo_kit bench soak " + " ".join(argv if argv is not None else sys.argv[1:])
    print(
        f"{result['steps']} steps, {result['steps_per_second']} steps/s; RSS after {result['warmup_steps']} "
        f"warm-up steps: slope {result['slope_mib_per_100_steps']:+.2f} MiB/100 steps, max-min "
        f"{result['max_minus_min_mib']:.2f} MiB, floor {result['floor_rise_mib_per_100_steps']:+.2f} MiB/100 steps "
        f"({result['rss_first_mib']} -> {result['rss_last_mib']} MiB)",
        flush=True,
    )
    if not args.no_write:
        write_results(result, Path(args.out), command.strip())
        print("wrote", Path(args.out).parent / "data" / "soak.jsonl")
    if args.check_slope is not None and result["slope_mib_per_100_steps"] > args.check_slope:
        print(f"FAIL: slope above {args.check_slope} MiB per 100 steps", file=sys.stderr)
        return 1
    if args.check_floor is not None and result["floor_rise_mib_per_100_steps"] > args.check_floor:
        print(f"FAIL: RSS floor rises more than {args.check_floor} MiB per 100 steps", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
