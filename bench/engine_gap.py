"""The rollout-trainer gap per configuration: how far vLLM's log-probs of the tokens it sampled are from the
trainer's, and what the importance-sampling correction then does to the batch.

    python -m grpo_kit bench engine_gap --steps 8 --variant fp8:base_weights=fp8 --variant bf16: \
        --variant fp8_eager:base_weights=fp8,vllm_enforce_eager=true

Runs ``python -m grpo_kit train`` (the default job on the embedded model, or ``--config``) for ``--steps`` steps
without evaluation, once per variant and seed (each in its own process and run folder, as ``bench learning``
runs them), and reads TRL's ``sampling/*`` columns from each run's ``metrics.csv``: per step the mean and the
largest per-token |engine - trainer| log-prob gap over the completion tokens, and the importance ratio's min,
mean and max after the correction (``vllm_importance_sampling_mode``; a ratio of 0 is a sequence the ``*_mask``
modes dropped). Per run: the gap's median over the steps, step 1's (LoRA's B starts at zero, so step 1 is the
base weights' gap alone), the largest single token, the mean ratio's median, and the steps in which the
correction dropped a sequence. Needs vLLM generation (``generation_backend`` resolving to ``vllm``).
Writes ``bench/results/data/engine_gap.jsonl`` (page ``engine_gap.md``).
"""

from __future__ import annotations

import argparse
import csv
import statistics
import sys
import time
from pathlib import Path

from _common import hardware, hardware_line, record_report
from learning import parse_variant, run_job

from grpo_kit.loss.objective import ENGINE_IS_METRICS

ROOT = Path(__file__).resolve().parent.parent
GAP, GAP_MAX, RATIO_MIN, RATIO_MEAN, _ = ENGINE_IS_METRICS  # TRL's metric names, as the kit logs them


def gap_figures(rows: list[dict]) -> dict:
    """The run's gap figures from its ``metrics.csv`` rows (dicts of strings; steps without the columns, e.g. HF
    generation, are skipped). ValueError when no step has them."""
    steps = [r for r in rows if r.get(GAP) not in (None, "")]
    if not steps:
        raise ValueError("no step has TRL's sampling/* columns: the run did not generate with vLLM")
    gap = [float(r[GAP]) for r in steps]
    return {
        "steps_with_gap": len(steps),
        "gap_median": statistics.median(gap),
        "gap_step1": gap[0],
        "gap_max_token": max(float(r[GAP_MAX]) for r in steps),
        "ratio_mean_median": statistics.median(float(r[RATIO_MEAN]) for r in steps),
        "steps_with_a_dropped_sequence": sum(float(r[RATIO_MIN]) == 0.0 for r in steps),
    }


def read_metrics(run_dir: Path) -> list[dict]:
    with (run_dir / "metrics.csv").open() as fh:
        return list(csv.DictReader(fh))


def table_line(r: dict) -> str:
    return (
        f"| {r['row']} | {r['seed']} | {r['base_weights']} | {r['lora_sync']} | {r['lora_dual_stream']} | "
        f"{r['enforce_eager']} | {r['emulate_precision_casts']} | {r['gap_median']:.4f} | {r['gap_step1']:.4f} | "
        f"{r['gap_max_token']:.3f} | {r['ratio_mean_median']:.3f} | "
        f"{r['steps_with_a_dropped_sequence']}/{r['steps_with_gap']} |"
    )


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--variant",
        dest="variants",
        action="append",
        type=parse_variant,
        required=True,
        help="NAME:KEY=VALUE,... config overrides of one row (NAME: for none); repeat for more rows",
    )
    p.add_argument("--seeds", type=int, nargs="+", default=[0])
    p.add_argument("--steps", type=int, default=8, help="optimiser steps per run (the gap is read at each)")
    p.add_argument("--config", default=None, help="a YAML config instead of the default job")
    p.add_argument("--set", dest="sets", action="append", default=[], help="KEY=VALUE for every run")
    p.add_argument("--runs-dir", default=str(ROOT / "runs" / "bench_engine_gap"))
    p.add_argument("--out-dir", default=str(ROOT / "bench" / "results"))
    args = p.parse_args(argv)
    if args.steps < 1:
        raise SystemExit(f"--steps must be >= 1, got {args.steps}")
    rows = []
    for seed in args.seeds:
        for name, sets in args.variants:
            out = Path(args.runs_dir) / f"{name}_seed{seed}"
            s = run_job(
                out, [*args.sets, *sets, f"max_steps={args.steps}", "num_eval_samples=0", f"seed={seed}"], args.config
            )
            gen = s.get("generation", {})
            row = dict(
                row=name,
                steps=args.steps,
                seed=seed,
                model=s.get("model", ""),
                command=s["command"],
                wall_s=s["wall_seconds"],
                backend=gen.get("backend"),
                base_weights=gen.get("base_weights"),
                lora_sync=(gen.get("lora_sync") or "").split(" ")[0],
                lora_dual_stream=gen.get("lora_dual_stream"),
                enforce_eager=gen.get("enforce_eager"),
                emulate_precision_casts=gen.get("emulate_precision_casts"),
                kv_cache_dtype=gen.get("kv_cache_dtype"),
                **gap_figures(read_metrics(out)),
            )
            rows.append(row)
            print(
                f"{name} seed {seed}: gap median {row['gap_median']:.4f} (step 1 {row['gap_step1']:.4f}, largest "
                f"token {row['gap_max_token']:.3f}), ratio mean {row['ratio_mean_median']:.3f}, a sequence dropped "
                f"in {row['steps_with_a_dropped_sequence']} of {row['steps_with_gap']} steps",
                flush=True,
            )
    result = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "command": "python -m grpo_kit bench engine_gap " + " ".join(sys.argv[1:] if argv is None else argv),
        "hardware": hardware(),
        "rows": rows,
    }
    lines = [
        f"# The rollout-trainer gap ({result['hardware'].get('gpu') or 'CPU'})",
        "",
        f"- command: `{result['command']}`",
        f"- hardware: {hardware_line(result['hardware'])}",
        "",
        "| variant | seed | base weights | LoRA sync | dual stream | eager | eager casts | gap median "
        "| gap step 1 | largest token | ratio mean | steps dropping a sequence |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
        *map(table_line, rows),
    ]
    record_report("engine_gap", result, lines, args.out_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
