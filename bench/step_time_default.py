"""Per-step time of the default run: the kit's trainer with vLLM (default where installed) and with
HF generation, against stock TRL, interleaved rounds on the same machine.

    python -m grpo_kit bench step_time_default [--rounds 2] [--steps 8]

Each row is ``python -m grpo_kit train --set trainer=... --set max_steps=N --set num_eval_samples=0``
(the default config otherwise); prints one line per run and writes ``--out`` as JSON. The table in
``bench/results/step_time_cpu_default.md`` was written from that JSON.
"""

import argparse
import json
import sys
from pathlib import Path

from learning import timing_runs  # noqa: E402

ROWS = (("grpo_kit_vllm", ["trainer=grpo_kit"]),
        ("grpo_kit_hf", ["trainer=grpo_kit", "generation_backend=hf"]),
        ("trl", ["trainer=trl"]))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--runs-dir", default="/tmp/timing_runs")
    p.add_argument("--out", default="/tmp/timing.json")
    a = p.parse_args(argv)
    res = timing_runs(Path(a.runs_dir), ROWS, steps=a.steps, rounds=a.rounds)
    Path(a.out).write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
