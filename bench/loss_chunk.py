"""How the efficient loss's time and memory depend on its chunk size (rows per head GEMM).

    python -m grpo_kit bench loss_chunk [--head llama] [--length 65536] [--chunks auto,768,896,1024]

One set of inputs (as ``bench/loss.py`` builds them: B=8, bf16, grpo loss with old/ref
log-probs), then forward + backward of ``efficient_grpo_loss`` per chunk size (``auto``: the
loss's own choice), median over ``--reps`` after a warm-up, and the extra peak memory over the
inputs. Written to ``loss_chunk_<tag>.md``/``.json``; CUDA only.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch  # noqa: E402
from _common import hardware, hardware_line, record_report  # noqa: E402
from loss import HEADS, bench_one, make_inputs, rel_err  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--head", default="llama", choices=list(HEADS))
    ap.add_argument("--length", type=int, default=65536)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--chunks", default="auto,768,896,1024")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out-dir", default=str(Path(__file__).resolve().parent / "results"))
    ap.add_argument("--tag", default="h200")
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench loss_chunk needs a CUDA GPU")
    dev = torch.device("cuda")
    H, V = HEADS[a.head]
    inp = make_inputs(a.batch, a.length, H, V, dev, torch.bfloat16, seed=0)
    rows, first_grad = [], None
    for c in a.chunks.split(","):
        res = bench_one("ours", {}, inp, dev, warmup=1, reps=a.reps, chunk_size=None if c == "auto" else int(c))
        first_grad = res["grad"] if first_grad is None else first_grad
        rows.append(
            dict(
                chunk=c,
                median_ms=res["ms"],
                times_ms=res["ms_all"],
                extra_peak_gib=res["extra_gib"],
                rel_grad_diff_vs_first=rel_err(res["grad"], first_grad),
            )
        )
        print(json.dumps(rows[-1]), flush=True)
    hw = hardware()
    cmd = "python -m grpo_kit bench loss_chunk " + " ".join(argv if argv is not None else sys.argv[1:])
    md = [
        f"# Efficient loss vs chunk size ({hw['gpu']})",
        "",
        f"Command: `{cmd}`  ",
        f"Date: {hw['date']}; {hardware_line(hw)}. {a.head} head (H={H}, V={V}), B={a.batch}, T={a.length}, "
        f"bf16, forward + backward, median of {a.reps} after 1 warm-up.",
        "",
        "| chunk rows | median ms | extra peak GiB | rel. grad diff vs first row |",
        "|---|---|---|---|",
    ]
    md += [
        f"| {r['chunk']} | {r['median_ms']:.1f} | {r['extra_peak_gib']:.3f} | {r['rel_grad_diff_vs_first']:.1e} |"
        for r in rows
    ]
    record_report("loss_chunk", dict(command=cmd, hardware=hw, rows=rows), md, a.out_dir)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
