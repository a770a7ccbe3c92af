"""The training notebooks (03, 04) executed by papermill on a CUDA GPU, without vLLM.

    python -m grpo_kit bench notebooks_gpu [--out-dir DIR] [--tag h200]

CI runs every notebook on the CPU only. This runs the GPU code paths of 03 and 04 the way
a user's batch run would (``papermill NB out.ipynb -p ...``), in three rows:

* ``03_fallback``  notebook 03 with its defaults except the step count: on a GPU without
                   vLLM ``setup="auto"`` picks the embedded-model fallback, on CUDA;
* ``03_full_hf``   notebook 03's full setup (GSM8K, LoRA, efficient loss) on a Qwen2.5-1.5B
                   architecture with random weights (no hub here), HF generation;
* ``04_full_hf``   notebook 04's full setup (offloaded checkpointing, efficient loss) on a
                   Llama-3.2-1B architecture with random weights, HF generation, 1.5K context.

vLLM, 4-bit weights and the FP8 KV cache are not in the GPU image, so those paths stay
untested here. Per row: status, wall time, the notebook's printed setup/device lines and
its run report. Executed notebooks and ``notebooks_gpu_<tag>.md``/``.json`` go to ``--out-dir``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from _common import hardware, hardware_line, record_report

ROOT = Path(__file__).resolve().parent.parent

ROWS = {
    "03_fallback": ("03_qwen2.5_grpo", dict(fallback_max_steps=3, num_eval_samples=8)),
    "03_full_hf": (
        "03_qwen2.5_grpo",
        dict(
            setup="full",
            model="qwen2.5-1.5b",
            dataset_path=str(ROOT / "data" / "gsm8k_sample.jsonl"),
            generation_backend="hf",
            max_steps=3,
            max_completion_length=128,
            num_train_samples=32,
            num_eval_samples=8,
        ),
    ),
    "04_full_hf": (
        "04_llama3.1_grpo_long_context",
        dict(
            setup="full",
            model="llama-3.2-1b",
            calculator_model="llama-3.2-1b",
            dataset_path=str(ROOT / "data" / "gsm8k_sample.jsonl"),
            generation_backend="hf",
            context_length=1536,
            max_prompt_length=512,
            max_steps=2,
            num_train_samples=32,
            num_eval_samples=4,
            gpu_gib=139.0,
        ),
    ),
}
KEEP = ("setup:", "device:", "peak", "accuracy", "step")  # printed lines worth quoting in the report


def run_row(name: str, out_dir: Path) -> dict:
    import papermill

    notebook, params = ROWS[name]
    params = dict(params, output_dir=str(out_dir / f"run_{name}"), dashboard="static")
    out_nb = out_dir / f"{name}.ipynb"
    start = time.perf_counter()
    try:
        papermill.execute_notebook(
            str(ROOT / "notebooks" / f"{notebook}.ipynb"),
            str(out_nb),
            parameters=params,
            cwd=str(ROOT / "notebooks"),
            progress_bar=False,
            kernel_name="python3",
        )
        status, error = "ok", ""
    except Exception as e:  # papermill raises PapermillExecutionError with the cell's traceback
        status, error = "failed", f"{type(e).__name__}: {e}"[-2000:]
    wall = time.perf_counter() - start
    lines = []
    if out_nb.exists():
        import nbformat

        nb = nbformat.read(out_nb, as_version=4)
        for cell in nb.cells:
            for out in cell.get("outputs", []):
                text = out.get("text", "") if out.get("output_type") == "stream" else ""
                lines += [ln for ln in text.splitlines() if any(k in ln for k in KEEP) and len(ln) < 300]
    return dict(
        row=name,
        notebook=notebook,
        params=params,
        status=status,
        error=error,
        wall_s=round(wall, 1),
        printed=lines[:40],
    )


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", default=",".join(ROWS))
    p.add_argument("--out-dir", default=str(ROOT / "bench" / "results"))
    p.add_argument("--tag", default="h200")
    a = p.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("bench notebooks_gpu needs a CUDA GPU")
    out = Path(a.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    results = []
    for name in a.rows.split(","):
        res = run_row(name, out)
        print(json.dumps(res)[:3000], flush=True)
        results.append(res)
    cmd = "python -m grpo_kit bench notebooks_gpu " + " ".join(argv if argv is not None else sys.argv[1:])
    hw = hardware()
    md = [
        f"# Notebooks 03/04 on a GPU ({hw['gpu']}), papermill, no vLLM",
        "",
        f"Command: `{cmd}`  ",
        f"Date: {hw['date']}; {hardware_line(hw)}.",
        "",
        "| row | notebook | status | wall s | parameters |",
        "|---|---|---|---|---|",
    ]
    for r in results:
        shown = {k: v for k, v in r["params"].items() if k not in ("output_dir", "dataset_path")}
        md.append(f"| {r['row']} | {r['notebook']} | {r['status']} | {r['wall_s']} | `{json.dumps(shown)}` |")
    for r in results:
        md += ["", f"## {r['row']}: printed", "", "```", *r["printed"], *([r["error"]] if r["error"] else []), "```"]
    record_report("notebooks_gpu", dict(command=cmd, hardware=hw, results=results), md, out)
    return 0 if all(r["status"] == "ok" for r in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
