"""4-bit training memory on the GPU: the issue's ``bench qlora`` memory rows (``python -m grpo_kit bench qlora
--memory`` runs this; so does ``python -m grpo_kit bench qlora_memory``).

Whole training steps (``bench/step.py``: reference pass under the disabled adapter, policy forward/backward
of every generation one sequence per micro-batch, optimiser; offloaded checkpointing and the efficient loss),
LoRA r=16 on all linear layers, beta 0.04, prompt 512 tokens, random weights:

* Llama-3.1-8B, fp16 (a T4 has no bf16: HF's GradScaler), 4-bit (the kit's QLoRA load: each linear layer
  created on the GPU and quantised to NF4 there at once, lm_head 16-bit; the kit's 4-bit matmul,
  ``grpo_kit.model.nf4_matmul``), 8 generations at completion 1K, 4K and 20K,
  each under ``torch.cuda.set_per_process_memory_fraction`` = ``--budget-gib`` (15), plus the longest
  completion the calculator says fits that budget, confirmed by a step at that length under the cap with
  ``--confirm-gens`` generations (the peak is one micro-batch's: more generations only take longer);
* the same lengths in 16-bit bf16 without a cap (its weights alone are 15 GiB), for step time and memory;
* Qwen2.5-1.5B, fp16, 4-bit, 8 x 1,024 under the cap.

Each model runs in its own process (one model on the GPU at a time). Beside each measured peak: the VRAM
calculator's figure for the same step (``grpo_kit.memory.estimate``, ``include_generation=False``), which
should be within 10% of ``peak_allocated_gib``. Results: ``bench/results/data/qlora_memory.jsonl`` (page ``qlora_memory.md``)
(``rows``: model, dtype, load_in_4bit, generations, completion_len, budget_gib, peak_gib, step_s, ok, ...).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from _common import command_line, hardware, record_report

ROOT = Path(__file__).resolve().parent.parent
PROMPT = 512
LORA_RANK = 16
ERROR_TARGET = 0.10


def calculator_gib(model: str, dtype: str, four_bit: bool, G: int, C: int) -> float:
    """The calculator's GPU peak (GiB) for the bench/step.py row ``ours_offload`` of this setup."""
    from grpo_kit.memory import EstimateSpec, estimate, total_gpu_bytes

    df = estimate(
        model,
        EstimateSpec(
            num_generations=G,
            prompt_length=PROMPT,
            completion_length=C,
            dtype=dtype,
            lora_rank=LORA_RANK,
            quantization="4bit" if four_bit else None,
            micro_batch_size=1,
            vllm=False,
            include_generation=False,
        ),
    )
    return total_gpu_bytes(df) / 2**30


def longest_completion(model: str, dtype: str, budget_gib: float, step: int = 1024) -> int:
    """The longest completion (a multiple of ``step``) whose calculator peak fits ``budget_gib``, 4-bit, one
    generation (``grpo_kit.memory.fit.longest_fitting_context`` over the same step as ``calculator_gib``)."""
    from grpo_kit.memory import EstimateSpec
    from grpo_kit.memory.fit import GIB, longest_fitting_context

    spec = EstimateSpec(
        num_generations=1,
        prompt_length=PROMPT,
        completion_length=step,
        dtype=dtype,
        lora_rank=LORA_RANK,
        quantization="4bit",
        micro_batch_size=1,
        vllm=False,
        include_generation=False,
    )  # the search varies its completion length
    context = longest_fitting_context(model, budget_gib * GIB, spec)
    return 0 if context is None else (context - PROMPT) // step * step


def plan(a) -> list[dict]:
    """One entry per process: the model, its bench/step.py options and its (T, G) points."""
    lens = [int(x) for x in a.completions.split(",")]
    longest = longest_completion("llama-3.1-8b", "fp16", a.budget_gib)
    four = [(PROMPT + c, 8) for c in lens] + ([(PROMPT + longest, a.confirm_gens)] if longest > max(lens) else [])
    return [
        dict(
            name="llama8b_4bit",
            model="llama-3.1-8b",
            dtype="fp16",
            four_bit=True,
            points=four,
            budget=a.budget_gib,
            longest=longest,
        ),
        dict(
            name="llama8b_bf16",
            model="llama-3.1-8b",
            dtype="bf16",
            four_bit=False,
            points=[(PROMPT + c, 8) for c in lens],
            budget=None,
        ),
        dict(
            name="qwen1.5b_4bit",
            model="qwen2.5-1.5b",
            dtype="fp16",
            four_bit=True,
            points=[(PROMPT + 1024, 8)],
            budget=a.budget_gib,
        ),
    ]


def run_process(p: dict, out_dir: Path, timeout: int) -> tuple[list[dict], str]:
    seq = ",".join(f"{T}:{G}" for T, G in p["points"])
    cmd = [
        sys.executable,
        str(ROOT / "bench" / "step.py"),
        "--model",
        p["model"],
        "--seq-len",
        seq,
        "--prompt-len",
        str(PROMPT),
        "--rows",
        "ours_offload",
        "--dtype",
        p["dtype"],
        "--beta",
        "0.04",
        "--lora-r",
        str(LORA_RANK),
        "--out-dir",
        str(out_dir),
        "--tag",
        p["name"],
    ]
    if p["four_bit"]:
        cmd.append("--load-in-4bit")
    if p["budget"]:
        cmd += ["--budget-gib", str(p["budget"])]
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT)
        log = (r.stdout + r.stderr)[-4000:]
    except subprocess.TimeoutExpired as e:
        log = f"timeout after {timeout} s: {str(e.stdout or '')[-2000:]}"
    path = out_dir / f"step_{p['name']}.json"
    results = json.loads(path.read_text())["results"] if path.is_file() else []
    if log.startswith("timeout"):  # the points the process did not reach say why
        p["missing_status"] = f"not reached: the process hit its {timeout} s limit"
    return results, " ".join(cmd[1:]) + "\n" + log


def rows_of(p: dict, results: list[dict]) -> list[dict]:
    rows = []
    done = {(r["seq_len"], r["gens"]): r for r in results}
    for T, G in p["points"]:
        r = done.get((T, G), {})
        calc = calculator_gib(p["model"], p["dtype"], p["four_bit"], G, T - PROMPT)
        peak = r.get("peak_allocated_gib")
        rows.append(
            dict(
                model=p["model"],
                dtype=p["dtype"],
                load_in_4bit=p["four_bit"],
                generations=G,
                completion_len=T - PROMPT,
                prompt_len=PROMPT,
                budget_gib=p["budget"],
                peak_gib=r.get("peak_reserved_gib"),
                peak_allocated_gib=peak,
                step_s=r.get("step_s"),
                ok=r.get("status") == "ok",
                status=r.get("status", p.get("missing_status", "not run")),
                error=r.get("error"),
                calculator_gib=calc,
                calculator_error=(calc / peak - 1) if peak else None,
                weights_gib=r.get("weights_gib"),
                grad_scale=r.get("grad_scale"),
                longest_by_calculator=p.get("longest") == T - PROMPT,
                process=p["name"],
            )
        )
    return rows


def write(rows: list[dict], logs: dict, a, out_dir: Path, hw: dict) -> None:
    cmd = command_line("qlora", ["--memory", *a.argv])
    data = dict(command=cmd, hardware=hw, rows=rows, logs=logs)
    f = lambda v, d=2: "" if v is None else f"{v:.{d}f}"  # noqa: E731
    lines = [
        f"# 4-bit training memory ({a.tag})",
        "",
        f"Command: `{cmd}`",
        f"Hardware: {hw}",
        "",
        "Whole training step (bench/step.py `ours_offload`): reference pass, policy forward/backward one "
        "sequence per micro-batch, AdamW; LoRA r=16 on all linear layers, beta 0.04, prompt 512. peak = "
        "`max_memory_reserved` over the step (what the cap limits), allocated beside it; calculator = "
        "`grpo_kit.memory.estimate(model, EstimateSpec(..., include_generation=False))` against the allocated "
        "peak.",
        "",
        "| model | dtype | 4-bit | G x completion | budget GiB | peak reserved GiB | peak allocated GiB | "
        "calculator GiB | calc. error | step s | status |",
        "|" + "---|" * 11,
    ]
    for r in rows:
        err = f"{r['calculator_error']:+.1%}" if r["calculator_error"] is not None else ""
        mark = " (calculator's longest)" if r["longest_by_calculator"] else ""
        lines.append(
            f"| {r['model']} | {r['dtype']} | {r['load_in_4bit']} | {r['generations']} x "
            f"{r['completion_len']:,}{mark} | {f(r['budget_gib'], 1)} | {f(r['peak_gib'])} | "
            f"{f(r['peak_allocated_gib'])} | {f(r['calculator_gib'])} | {err} | {f(r['step_s'], 1)} | "
            f"{r['status']} |"
        )
    record_report("qlora_memory", data, lines, out_dir)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--budget-gib", type=float, default=15.0, help="the cap for the 4-bit rows (a T4: 15)")
    p.add_argument("--completions", default="1024,4096,20480", help="completion lengths of the 8B rows")
    p.add_argument("--confirm-gens", type=int, default=2, help="generations of the longest-length confirmation step")
    p.add_argument("--timeout", type=int, default=420, help="seconds per model process")
    p.add_argument("--tag", default="h200")
    p.add_argument("--out-dir", default=str(ROOT / "bench" / "results"))
    p.add_argument("--dry-run", action="store_true", help="print the plan with the calculator's figures; run nothing")
    a = p.parse_args(argv)
    a.argv = list(sys.argv[1:] if argv is None else argv)
    if a.budget_gib <= 0 or a.confirm_gens < 1:
        raise SystemExit(f"--budget-gib must be > 0 and --confirm-gens >= 1, got {a.budget_gib}, {a.confirm_gens}")
    procs = plan(a)
    if a.dry_run:
        for q in procs:
            for T, G in q["points"]:
                gib = calculator_gib(q["model"], q["dtype"], q["four_bit"], G, T - PROMPT)
                print(q["name"], f"{G} x {T - PROMPT}", f"{gib:.2f} GiB")
        return 0
    hw = hardware()
    out_dir = Path(a.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    rows, logs = [], {}
    with tempfile.TemporaryDirectory() as tmp:
        for q in procs:
            results, logs[q["name"]] = run_process(q, Path(tmp), a.timeout)
            rows += rows_of(q, results)
            print(json.dumps(rows[-len(q["points"]) :], default=str), flush=True)
    write(rows, logs, a, out_dir, hw)  # once: the data file is appended to
    return 0


if __name__ == "__main__":
    sys.exit(main())
