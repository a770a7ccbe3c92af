"""Per-step time of the default run: the kit's trainer with vLLM (default where installed) and with
HF generation, against stock TRL, interleaved rounds on the same machine.

    python -m grpo_kit bench step_time_default [--rounds 2] [--steps 8]

Each row is ``python -m grpo_kit train --set trainer=... --set max_steps=N --set num_eval_samples=0``
(the default config otherwise); prints one line per run and appends the runs to
``bench/results/data/step_time_default.jsonl`` (``--out-dir``), whose page is ``step_time_default.md``.
"""

import argparse
import sys
from pathlib import Path

from _common import hardware, record_report  # noqa: E402
from learning import timing_runs  # noqa: E402

ROWS = (
    ("grpo_kit_vllm", ["trainer=grpo_kit"]),
    ("grpo_kit_hf", ["trainer=grpo_kit", "generation_backend=hf"]),
    ("trl", ["trainer=trl"]),
)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--runs-dir", default="/tmp/timing_runs")
    p.add_argument("--out-dir", default=str(Path(__file__).resolve().parent / "results"))
    a = p.parse_args(argv)
    res = timing_runs(Path(a.runs_dir), ROWS, steps=a.steps, rounds=a.rounds)
    rows = [dict(r, row=name, round=i + 1) for name, runs in res.items() for i, r in enumerate(runs)]
    record_report(
        "step_time_default",
        dict(rows=rows, hardware=hardware(), command=rows[0].get("command", "")),
        [f"{r['row']} round {r['round']}: {r['mean_after_first_s']:.2f} s/step after the first" for r in rows],
        a.out_dir,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
