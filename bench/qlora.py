"""4-bit quality on the real embedded model: what NF4 does to SmolLM2-135M-Instruct (pretrained), and
whether the ``auto`` skip list (``grpo_kit.model.quantize``) protects it better than a fixed list of the same size.

    python -m grpo_kit bench qlora [--n 100] [--device cpu|cuda] [--tag cpu]

Variants, all from the same 16-bit weights (bf16), matmuls in bf16:

* ``bf16``   the reference: no quantisation.
* ``nf4``    every decoder linear layer in NF4 (double quantisation); lm_head 16-bit, as bitsandbytes /
             transformers leave it by default (the kit always does: its loss reads the head densely).
* ``fixed``  NF4 but the first and the last decoder layer kept in 16 bit (``model.layers.0.``,
             ``model.layers.{L-1}.``), the usual hand-written "dynamic" list.
* ``auto``   NF4 but the layers ``load_in_4bit_skip_modules: auto`` picks, with an allowance equal to what
             ``fixed`` spends, so the two lists cost the same memory.

Per variant on ``--n`` held-out problems of the default task (arithmetic, levels 1-2, the run's own
split): greedy held-out accuracy (the kit's verifier), the mean absolute per-token log-prob difference
against bf16 on bf16's own greedy completions (teacher-forced), the share of those tokens where the
variant's greedy choice differs, and the linear-layer bytes held. The calibration pass of ``auto`` reads
8 training prompts (never the held-out ones). Results: ``bench/results/data/qlora.jsonl`` (page ``qlora.md``).

``--memory``: the GPU memory rows instead (Llama-3.1-8B in 4-bit fp16 under a 15 GiB cap, 16-bit bf16 beside it,
Qwen2.5-1.5B): ``bench/qlora_memory.py``, whose options follow.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from _common import command_line, hardware, record_report

from grpo_kit.app.config import GRPOKitConfig
from grpo_kit.app.evaluation import evaluate_accuracy
from grpo_kit.app.run import calibration_batches
from grpo_kit.memory.formulas import NF4_BITS_PER_PARAM
from grpo_kit.model.loading import load_model
from grpo_kit.model.quantize import auto_skip_modules, quantizable_linears, quantize_model
from grpo_kit.tasks.data import build_datasets, default_system_prompt, make_prompt

ROOT = Path(__file__).resolve().parent.parent
VARIANTS = ("bf16", "nf4", "fixed", "auto")


def _linear_bytes(model, skip) -> float:
    """Bytes of the decoder linear weights: NF4 for the quantised ones, 2 per weight for those kept."""
    q = set(quantizable_linears(model, skip))
    total = 0.0
    for name in quantizable_linears(model):
        n = model.get_submodule(name).weight.numel()
        total += n * NF4_BITS_PER_PARAM / 8 if name in q else n * 2
    return total


@torch.no_grad()
def _token_logprobs(model, seqs, device):
    """Per-token log-probs (and greedy choices) of each (prompt ids, completion ids) under ``model``."""
    out = []
    for prompt, comp in seqs:
        ids = torch.tensor([prompt + comp], device=device)
        logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float()
        lp = torch.log_softmax(logits, -1)
        out.append((lp.gather(-1, torch.tensor(comp, device=device)[:, None])[:, 0].cpu(), lp.argmax(-1).cpu()))
    return out


def main(argv=None) -> int:
    argv = list(__import__("sys").argv[1:] if argv is None else argv)
    if "--memory" in argv:  # the GPU memory rows: their own script and options
        import qlora_memory

        return qlora_memory.main([x for x in argv if x != "--memory"])
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--n", type=int, default=100, help="held-out problems")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--tag", default=None)
    p.add_argument("--out-dir", default=str(ROOT / "bench" / "results"))
    a = p.parse_args(argv)
    tag = a.tag or a.device
    cfg = GRPOKitConfig(num_eval_samples=a.n)
    train, heldout = build_datasets(cfg)
    system = default_system_prompt(cfg.task)
    base, tok = load_model(dtype=torch.bfloat16, device="cpu")
    layers = base.config.num_hidden_layers
    calib = calibration_batches(tok, train, system)
    fixed = ["model.layers.0.", f"model.layers.{layers - 1}."]
    allowance = _linear_bytes(base, fixed) - _linear_bytes(base, [])
    _, auto_report = auto_skip_modules(base, calib, allowance_bytes=allowance)
    skips = {"nf4": [], "fixed": fixed, "auto": auto_report["chosen"]}

    rows, ref = [], None
    for variant in VARIANTS:
        t0 = time.perf_counter()
        model, _ = load_model(dtype=torch.bfloat16, device="cpu")
        if variant != "bf16":
            quantize_model(model, compute_dtype=torch.bfloat16, device=a.device, skip_modules=skips[variant])
        model = model.to(a.device).eval()
        acc = evaluate_accuracy(model, tok, heldout, system_prompt=system, max_new_tokens=cfg.max_completion_length)
        if ref is None:  # bf16's greedy completions are the texts every variant is scored on
            seqs = []
            for e in heldout:
                text = tok.apply_chat_template(
                    make_prompt(e["question"], system), tokenize=False, add_generation_prompt=True
                )
                prompt = tok(text, add_special_tokens=False)["input_ids"]
                out = model.generate(
                    torch.tensor([prompt], device=a.device),
                    max_new_tokens=cfg.max_completion_length,
                    do_sample=False,
                    pad_token_id=tok.pad_token_id,
                )
                seqs.append((prompt, out[0, len(prompt) :].tolist()))
            ref = _token_logprobs(model, seqs, a.device)
            diff, flips = 0.0, 0.0
        else:
            got = _token_logprobs(model, seqs, a.device)
            tokens = sum(len(r[0]) for r in ref)
            diff = sum(float((g[0] - r[0]).abs().sum()) for g, r in zip(got, ref)) / tokens
            flips = sum(int((g[1] != r[1]).sum()) for g, r in zip(got, ref)) / tokens
        rows.append(
            dict(
                variant=variant,
                accuracy=acc["accuracy"],
                n=acc["n"],
                mean_abs_logprob_diff=diff,
                greedy_token_flips=flips,
                kept_16bit=skips.get(variant, "all"),
                linear_bytes=_linear_bytes(base, skips[variant])
                if variant != "bf16"
                else sum(base.get_submodule(n).weight.numel() * 2 for n in quantizable_linears(base)),
                seconds=time.perf_counter() - t0,
            )
        )
        print(json.dumps({k: v for k, v in rows[-1].items() if k != "kept_16bit"}), flush=True)
        del model

    cmd = command_line("qlora", argv)
    hw = dict(hardware(torch.device(a.device)), device=a.device)
    lines = [
        f"# 4-bit quality on the embedded SmolLM2-135M-Instruct ({tag})",
        "",
        f"Command: `{cmd}`",
        f"Hardware: {hw}",
        "",
        f"{a.n} held-out problems (arithmetic, levels 1-2), greedy, "
        f"max {cfg.max_completion_length} new tokens; log-prob differences on bf16's own greedy completions.",
        "",
        "| variant | layers kept 16-bit | linear weights MB | held-out accuracy | mean abs log-prob diff vs "
        "bf16 | greedy token flips |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        kept = r["kept_16bit"] if isinstance(r["kept_16bit"], str) else (", ".join(r["kept_16bit"]) or "none")
        lines.append(
            f"| {r['variant']} | {kept} | {r['linear_bytes'] / 1e6:.1f} | {r['accuracy']:.3f} | "
            f"{r['mean_abs_logprob_diff']:.4f} | {r['greedy_token_flips']:.3%} |"
        )
    lines += [
        "",
        f"auto: {auto_report['rule']}; allowance {auto_report['allowance_bytes'] / 1e6:.2f} MB (what "
        f"`fixed` spends), spent {auto_report['extra_bytes'] / 1e6:.2f} MB. Largest errors: "
        + ", ".join(f"{k} {v:.4f}" for k, v in list(auto_report["errors"].items())[:6]),
    ]
    record_report("qlora", {"command": cmd, "hardware": hw, "auto": auto_report, "rows": rows}, lines, a.out_dir)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
