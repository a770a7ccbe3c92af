"""Does the main job learn? Held-out accuracy before/after over seeds, and step time vs stock TRL.

    python -m grpo_kit bench learning --seeds 0 1 2
    python -m grpo_kit bench learning --config configs/tools.yaml --variant tool: --variant no_tool:tools=[] \
        --seeds 0 --timing-steps 0

Runs ``python -m grpo_kit train`` (the default job, or ``--config``) once per seed and variant (each in its own
process and run folder), then, for step time, a short run of the kit's trainer and of TRL's stock
``GRPOTrainer`` with the same settings, interleaved (ours, TRL, ours, TRL). A variant (``NAME:KEY=VALUE,...``)
adds its overrides to every run of its rows: the same seeds and budget, side by side in one run (e.g. the tool
task with and without its tool; with tools the held-out rows also give the share of answers that called one).
Writes ``bench/results/data/learning.jsonl`` (page ``learning.md``).
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


def run_job(out: Path, sets: list[str], config: str | None = None) -> dict:
    cfg_args = ["--config", config] if config else []
    cmd = [sys.executable, "-m", "grpo_kit", "train", *cfg_args, "--output-dir", str(out)]
    for s in sets:
        cmd += ["--set", s]
    t = time.perf_counter()
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{r.stderr[-3000:]}")
    summary = json.loads((out / "summary.json").read_text())
    summary["wall_seconds"] = round(time.perf_counter() - t, 1)
    summary["command"] = " ".join(["python -m grpo_kit train", *cfg_args, *[f"--set {s}" for s in sets]])
    ev = json.loads((out / "eval.json").read_text()) if (out / "eval.json").is_file() else {}
    summary["by_level_after"] = ev.get("after", {}).get("by_level", {})
    for when in ("before", "after"):  # the tool task's held-out figures (absent without tools)
        for key in ("tool_use_share", "tool_failure_rate"):
            if key in ev.get(when, {}):
                summary[f"{key}_{when}"] = ev[when][key]
    return summary


def parse_variant(text: str) -> tuple[str, list[str]]:
    """``NAME:KEY=VALUE,KEY=VALUE`` (or ``NAME:`` for none) -> (name, overrides). A value holding a comma must
    be a YAML list or mapping (``tools=[a,b]``): commas inside brackets do not split."""
    name, sep, rest = text.partition(":")
    if not sep or not name.isidentifier():
        raise argparse.ArgumentTypeError(
            f"--variant {text!r}: want NAME:KEY=VALUE,... (NAME a word, e.g. no_tool:tools=[])"
        )
    sets, depth, cur = [], 0, ""
    for ch in rest:
        depth += (ch in "[{") - (ch in "]}")
        if ch == "," and depth == 0:
            sets.append(cur)
            cur = ""
        else:
            cur += ch
    sets += [cur] if cur else []
    bad = [x for x in sets if "=" not in x]
    if bad:
        raise argparse.ArgumentTypeError(f"--variant {text!r}: {bad[0]!r} is not KEY=VALUE")
    return name, sets


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
            res[name].append(
                dict(
                    step_times(out),
                    peak_rss_gib=s["peak_memory_gib"],
                    backend=s["generation"].get("backend"),
                    command=s["command"],
                )
            )
            r = res[name][-1]
            print(
                f"timing {name} round {rnd}: {r['mean_step_time_s']:.2f} s/step ({r['mean_after_first_s']:.2f} "
                f"after step 1), peak RSS {s['peak_memory_gib']:.2f} GiB",
                flush=True,
            )
    return res


def step_times(run_dir: Path) -> dict:
    """Mean step time over all steps and over steps 2+, and step 1's, from the run's metrics.csv."""
    with (run_dir / "metrics.csv").open() as fh:
        t = [float(row["step_time_s"]) for row in csv.DictReader(fh) if row.get("step_time_s")]
    return {
        "mean_step_time_s": sum(t) / len(t),
        "mean_after_first_s": sum(t[1:]) / max(1, len(t) - 1),
        "first_step_s": t[0],
    }


def signal_steps(run_dir: Path) -> int:
    """Steps in which at least one group's rewards differed (the others have zero advantage)."""
    with (run_dir / "metrics.csv").open() as fh:
        return sum(
            1
            for row in csv.DictReader(fh)
            if row.get("frac_reward_zero_std") not in (None, "") and float(row["frac_reward_zero_std"]) < 1.0
        )


def config_line(run_dir: Path) -> str:
    from grpo_kit.app.config import GRPOKitConfig

    c = GRPOKitConfig.from_yaml(run_dir / "config.yaml")
    prompts = c.per_device_train_batch_size * c.gradient_accumulation_steps // c.num_generations
    return (
        f"{c.model}, LoRA r={c.lora_rank}, {c.task} levels {c.levels}, {prompts} prompt(s) x "
        f"{c.num_generations} generations x {c.max_completion_length} tokens per step, "
        f"{c.max_steps} steps, rewards {c.reward_funcs}"
    )


def run_seeds(runs: Path, variants, seeds, sets, config=None) -> list[dict]:
    """One run of the job per (variant, seed), in its own folder; each summary gains ``row`` (the variant),
    ``seed`` and ``signal_steps``. Seed by seed, the variants side by side: a pass cut short still has pairs."""
    rows = []
    for seed in seeds:
        for name, variant_sets in variants:
            folder = runs / (f"seed{seed}" if len(variants) == 1 else f"{name}_seed{seed}")
            s = run_job(folder, [*sets, *variant_sets, f"seed={seed}"], config)
            s.update(row=name, seed=seed, signal_steps=signal_steps(Path(s["run_dir"])))
            tool = (
                f", tool used in {s['tool_use_share_after']:.0%} of answers after"
                if "tool_use_share_after" in s
                else ""
            )
            print(
                f"{name} seed {seed}: before {s['accuracy_before']:.3f} after {s['accuracy_after']:.3f}{tool} "
                f"({s['wall_seconds']:.0f} s, {s['mean_step_time_s']:.2f} s/step)",
                flush=True,
            )
            rows.append(s)
    return rows


def gain_row(name: str, rows: list[dict]) -> dict:
    """A variant's seeds in one row: mean gain, seed-to-seed spread of the after-accuracy, and whether the gain
    clears twice that spread (``learns``)."""
    after = [s["accuracy_after"] for s in rows]
    gains = [s["accuracy_after"] - s["accuracy_before"] for s in rows]
    spread = statistics.pstdev(after) if len(after) > 1 else 0.0
    out = {
        "row": f"{name} (all seeds)",
        "seeds_run": len(rows),
        "mean_after": statistics.mean(after),
        "mean_gain": statistics.mean(gains),
        "after_std": spread,
        "learns": statistics.mean(gains) > 2 * spread,
    }
    if all("tool_use_share_after" in s for s in rows):
        out["mean_tool_use_share_after"] = statistics.mean(s["tool_use_share_after"] for s in rows)
    return out


def seed_line(s: dict) -> str:
    lv = s["by_level_after"]
    tool = (
        f"{s['tool_use_share_before']:.2f} -> {s['tool_use_share_after']:.2f}" if "tool_use_share_after" in s else "-"
    )
    return (
        f"| {s['row']} | {s['seed']} | {s['accuracy_before']:.3f} | {s['accuracy_after']:.3f} | "
        f"{s['accuracy_after'] - s['accuracy_before']:+.3f} | {lv.get('1', float('nan')):.3f} | "
        f"{lv.get('2', float('nan')):.3f} | {tool} | {s['signal_steps']}/{s['steps']} | "
        f"{s['mean_step_time_s']:.2f} | {s['wall_seconds']:.0f} s |"
    )


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--config", default=None, help="a YAML config for every run (default: the main job's defaults)")
    p.add_argument(
        "--variant",
        dest="variants",
        action="append",
        type=parse_variant,
        default=[],
        metavar="NAME:KEY=VALUE,...",
        help="rows to compare (repeatable), each run over every seed with "
        "its overrides added, e.g. --variant tool: --variant no_tool:tools=[]",
    )
    p.add_argument("--timing-steps", type=int, default=8, help="steps of each short timing run (0: skip)")
    p.add_argument("--timing-rounds", type=int, default=2)
    p.add_argument(
        "--set",
        dest="sets",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="config override passed to every run (repeatable), e.g. generation_backend=hf",
    )
    p.add_argument("--runs-dir", default=str(ROOT / "runs" / "bench_learning"))
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "learning_cpu"))
    args = p.parse_args(argv)
    runs = Path(args.runs_dir)
    variants = args.variants or [("main_job" if not args.config else Path(args.config).stem, [])]
    seeds = run_seeds(runs, variants, args.seeds, args.sets, args.config)
    timing = timing_runs(
        runs,
        (("grpo_kit", ["trainer=grpo_kit"]), ("trl", ["trainer=trl"])),
        steps=args.timing_steps,
        rounds=args.timing_rounds if args.timing_steps else 0,
        sets=args.sets,
    )
    summaries = [gain_row(name, [s for s in seeds if s["row"] == name]) for name, _ in variants]
    result = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "command": "python -m grpo_kit bench learning " + " ".join(sys.argv[1:] if argv is None else argv),
        "hardware": hardware(),
        "timing": timing,
        "seeds": [*seeds, *summaries],
    }
    first = Path(seeds[0]["run_dir"]) if seeds else None
    lines = [
        f"# Learning on the embedded model ({result['hardware'].get('gpu') or 'CPU'})",
        "",
        f"- command: `{result['command']}`",
        f"- date: {result['date']}",
        f"- hardware: {hardware_line(result['hardware'])}",
        f"- each run: `python -m grpo_kit train {'--config ' + args.config + ' ' if args.config else ''}"
        f"{' '.join('--set ' + x for x in args.sets)} [variant's sets] --set seed=S` "
        f"({config_line(first) if first else 'no seeds'}); generation: "
        f"{seeds[0].get('generation', {}).get('backend', '?') if seeds else '?'}; held-out: greedy; signal steps: "
        "steps with at least one group whose rewards differed",
        "",
        "| variant | seed | accuracy before | accuracy after | gain | level 1 after | level 2 after | tool use "
        "before -> after | signal steps | s/step | wall |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
        *[seed_line(s) for s in seeds],
        "",
        *[
            f"{g['row']}: mean after {g['mean_after']:.3f}, mean gain {g['mean_gain']:+.3f}; seed-to-seed std of the "
            f"after-accuracy {g['after_std']:.3f}; gain > 2 x spread: {g['learns']}."
            for g in summaries
        ],
    ]
    if any(timing.values()):
        lines += [
            "",
            f"Step time, short runs of {args.timing_steps} steps without evaluation, interleaved:",
            "",
            "| trainer | s/step, steps 2+, per round | s/step incl. step 1 | peak RSS (GiB) |",
            "|---|---|---|---|",
        ]
        for k, v in timing.items():
            after, times, rss = (
                ", ".join(f"{x[key]:.2f}" for x in v)
                for key in ("mean_after_first_s", "mean_step_time_s", "peak_rss_gib")
            )
            lines.append(f"| {k} | {after} | {times} | {rss} |")
    record_report("learning", result, lines, Path(args.out).parent)
    return 0


if __name__ == "__main__":
    sys.exit(main())
