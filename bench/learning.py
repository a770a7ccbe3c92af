"""Does the main job learn? Held-out accuracy before/after over seeds, and step time vs stock TRL.

    python -m grpo_kit bench learning --seeds 0 1 2

Runs the default ``python -m grpo_kit train`` once per seed (each in its own process and run
folder), then, for step time, a short run of the kit's trainer and of TRL's stock
``GRPOTrainer`` with the same settings, interleaved (ours, TRL, ours, TRL). Writes
``bench/results/data/learning.jsonl`` (page ``learning.md``).
"""

from __future__ import annotations

import argparse
import csv
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

from _common import hardware, hardware_line, record_report

ROOT = Path(__file__).resolve().parent.parent


def run_job(out: Path, sets: list[str]) -> dict:
    cmd = [sys.executable, "-m", "grpo_kit", "train", "--output-dir", str(out)]
    for s in sets:
        cmd += ["--set", s]
    t = time.perf_counter()
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{r.stderr[-3000:]}")
    summary = json.loads((out / "summary.json").read_text())
    summary["wall_seconds"] = round(time.perf_counter() - t, 1)
    summary["command"] = " ".join(["python -m grpo_kit train", *[f"--set {s}" for s in sets]])
    return summary


def timing_runs(runs: Path, rows, *, steps: int, rounds: int, sets=()) -> dict:
    """Short runs without evaluation, interleaved (each row once per round), for step time.

    ``rows``: ``(name, [KEY=VALUE, ...])`` pairs; ``sets`` go to every run. Returns, per name, one
    dict per round: mean s/step over all steps (the run summary's figure) and over steps 2+
    (without step 1's one-off costs, e.g. vLLM's first sync and warm-up), step 1's time, peak
    RSS, generation backend and the command.
    """
    res = {name: [] for name, _ in rows}
    for rnd in range(rounds):
        for name, row_sets in rows:
            out = runs / f"timing_{name}_{rnd}"
            s = run_job(out, [*sets, *row_sets, f"max_steps={steps}", "num_eval_samples=0"])
            res[name].append(dict(step_times(out), peak_rss_gib=s["peak_memory_gib"],
                                  backend=s["generation"].get("backend"), command=s["command"]))
            r = res[name][-1]
            print(f"timing {name} round {rnd}: {r['mean_step_time_s']:.2f} s/step ({r['mean_after_first_s']:.2f} "
                  f"after step 1), peak RSS {s['peak_memory_gib']:.2f} GiB", flush=True)
    return res


def step_times(run_dir: Path) -> dict:
    """Mean step time over all steps and over steps 2+, and step 1's, from the run's metrics.csv."""
    with (run_dir / "metrics.csv").open() as fh:
        t = [float(row["step_time_s"]) for row in csv.DictReader(fh) if row.get("step_time_s")]
    return {"mean_step_time_s": sum(t) / len(t), "mean_after_first_s": sum(t[1:]) / max(1, len(t) - 1),
            "first_step_s": t[0]}


def signal_steps(run_dir: Path) -> int:
    """Steps in which at least one group's rewards differed (the others have zero advantage)."""
    with (run_dir / "metrics.csv").open() as fh:
        return sum(1 for row in csv.DictReader(fh) if row.get("frac_reward_zero_std") not in (None, "")
                   and float(row["frac_reward_zero_std"]) < 1.0)


def config_line(run_dir: Path) -> str:
    from grpo_kit.app.config import GRPOKitConfig

    c = GRPOKitConfig.from_yaml(run_dir / "config.yaml")
    prompts = c.per_device_train_batch_size * c.gradient_accumulation_steps // c.num_generations
    return (f"{c.model}, LoRA r={c.lora_rank}, {c.task} levels {c.levels}, {prompts} prompt(s) x "
            f"{c.num_generations} generations x {c.max_completion_length} tokens per step, "
            f"{c.max_steps} steps, rewards {c.reward_funcs}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--timing-steps", type=int, default=8, help="steps of each short timing run (0: skip)")
    p.add_argument("--timing-rounds", type=int, default=2)
    p.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
                   help="config override passed to every run (repeatable), e.g. generation_backend=hf")
    p.add_argument("--runs-dir", default=str(ROOT / "runs" / "bench_learning"))
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "learning_cpu"))
    args = p.parse_args(argv)
    runs = Path(args.runs_dir)

    seeds = []
    for seed in args.seeds:
        s = run_job(runs / f"seed{seed}", [*args.sets, f"seed={seed}"])
        s["seed"], s["signal_steps"] = seed, signal_steps(Path(s["run_dir"]))
        print(f"seed {seed}: before {s['accuracy_before']:.3f} after {s['accuracy_after']:.3f} "
              f"({s['wall_seconds']:.0f} s, {s['mean_step_time_s']:.2f} s/step)", flush=True)
        seeds.append(s)

    timing = timing_runs(runs, (("grpo_kit", ["trainer=grpo_kit"]), ("trl", ["trainer=trl"])),
                         steps=args.timing_steps, rounds=args.timing_rounds if args.timing_steps else 0, sets=args.sets)

    before = [s["accuracy_before"] for s in seeds]
    after = [s["accuracy_after"] for s in seeds]
    gains = [a - b for a, b in zip(after, before)]
    spread = statistics.pstdev(after) if len(after) > 1 else 0.0
    result = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "command": "python -m grpo_kit bench learning " + " ".join(sys.argv[1:]),
        "hardware": hardware(),
        "seeds": seeds, "timing": timing,
        "mean_gain": statistics.mean(gains), "after_std": spread,
        "learns": statistics.mean(gains) > 2 * spread,
    }
    out = Path(args.out)
    lines = [
        "# Learning on the embedded model (CPU)", "",
        f"- command: `{result['command']}`", f"- date: {result['date']}", f"- hardware: {hardware_line(result['hardware'])}",
        f"- each seed: `python -m grpo_kit train {' '.join('--set ' + x for x in args.sets)} --set seed=S` "
        f"({config_line(Path(seeds[0]['run_dir'])) if seeds else 'no seeds'}); generation: "
        f"{seeds[0].get('generation', {}).get('backend', '?') if seeds else '?'}; held-out: the fixed 200 problems "
        "(`data/arithmetic_heldout.jsonl`), greedy; signal steps: steps with at least one group whose rewards "
        "differed", "",
        "| seed | accuracy before | accuracy after | gain | level 1 after | level 2 after | signal steps | s/step | wall |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for s in seeds:
        ev = json.loads((Path(s["run_dir"]) / "eval.json").read_text())
        lv = ev["after"].get("by_level", {})
        lines.append(f"| {s['seed']} | {s['accuracy_before']:.3f} | {s['accuracy_after']:.3f} | "
                     f"{s['accuracy_after'] - s['accuracy_before']:+.3f} | {lv.get('1', float('nan')):.3f} | "
                     f"{lv.get('2', float('nan')):.3f} | {s['signal_steps']}/{s['steps']} | "
                     f"{s['mean_step_time_s']:.2f} | {s['wall_seconds']:.0f} s |")
    lines += ["", f"Mean gain {result['mean_gain']:+.3f}; seed-to-seed std of the after-accuracy {spread:.3f}; "
              f"gain > 2 x spread: {result['learns']}."]
    if any(timing.values()):
        lines += ["", f"Step time, short runs of {args.timing_steps} steps without evaluation, interleaved:", "",
                  "| trainer | s/step, steps 2+, per round | s/step incl. step 1 | peak RSS (GiB) |",
                  "|---|---|---|---|"]
        for k, v in timing.items():
            after, times, rss = (", ".join(f"{x[key]:.2f}" for x in v)
                                 for key in ("mean_after_first_s", "mean_step_time_s", "peak_rss_gib"))
            lines.append(f"| {k} | {after} | {times} | {rss} |")
    record_report("learning", result, lines, out.parent)
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
