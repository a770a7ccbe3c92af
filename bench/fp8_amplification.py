"""Why FP8 weights widen the rollout-trainer log-prob gap: a difference at bf16's last bit upstream of a linear
layer is carried to FP8's (e4m3: 3 mantissa bits against bf16's 7) wherever it moves an activation across an FP8
rounding boundary, and W8A8 rounds every linear layer's input to FP8.

    python -m grpo_kit bench fp8_amplification [--prompts 8 --completions 2 --tokens 96]

The embedded model (bf16) samples completions of the main job's prompts; their per-token log-probs (at the job's
temperature) are then computed twice with two attention implementations, ``eager`` and ``sdpa`` (the same math,
bf16-level differences, as between vLLM's kernels and the trainer's), under four forms of the weights: bf16,
FP8 with FP8 activations (W8A8: the kit's training forward and vLLM's FP8 engine), FP8 with 16-bit activations
(W8A16), both with one scale per output channel (the default), and W8A8 with 128 x 128 weight tiles and
activations quantised per 128 columns (``fp8_block: 128``, as vLLM's block FP8 method runs). The gap under each
form is the same perturbation seen through that form. Each FP8 form against bf16 is also given (what the
quantisation itself moves: how faithful each scale granularity is). Runs on the CPU (the FP8 matmuls' torch
twins) or a GPU.
Writes ``bench/results/data/fp8_amplification.jsonl`` (page ``fp8_amplification.md``).
"""

from __future__ import annotations

import argparse
import copy
import sys
import time

import torch
from _common import hardware, hardware_line, record_report

from grpo_kit.app.config import GRPOKitConfig
from grpo_kit.kernels.grpo_epilogue import lse_logp_torch
from grpo_kit.model.fp8 import FP8_BLOCK, quantize_model_fp8
from grpo_kit.model.loading import load_model
from grpo_kit.tasks.data import default_system_prompt, generate_tasks, make_prompt

ATTENTION = ("eager", "sdpa")  # two implementations of the same attention, different rounding
# weight form -> (FP8Linear activations, fp8 block) or None for the 16-bit weights
FORMS = {"bf16": None, "fp8_w8a8": ("fp8", None), "fp8_w8a16": ("16bit", None), "fp8_block_w8a8": ("fp8", FP8_BLOCK)}


def sample(
    model, tok, questions: list[str], system_prompt: str, completions: int, tokens: int, temperature: float, seed: int
):
    """``[(ids (T,) int64, prompt_len)]``: ``completions`` sampled continuations of each question's chat prompt."""
    torch.manual_seed(seed)
    out = []
    for q in questions:
        ids = tok.apply_chat_template(
            make_prompt(q, system_prompt), add_generation_prompt=True, return_tensors="pt", return_dict=True
        )["input_ids"]
        with torch.no_grad():
            gen = model.generate(
                ids,
                do_sample=True,
                temperature=temperature,
                max_new_tokens=tokens,
                num_return_sequences=completions,
                pad_token_id=tok.eos_token_id,
            )
        out += [(g[: _end(g, ids.shape[1], tok.eos_token_id)], ids.shape[1]) for g in gen]
    return out


def _end(g: torch.Tensor, start: int, eos: int) -> int:
    """The sequence's length up to and with its first EOS after the prompt (generate pads after it)."""
    hits = (g[start:] == eos).nonzero()
    return start + int(hits[0]) + 1 if len(hits) else len(g)


def token_logps(model, seqs, attention: str, temperature: float) -> torch.Tensor:
    """Float32 (N,): each completion token's log-prob under ``model`` with ``attention``, as the kit's loss scores
    a sampled token (:func:`~grpo_kit.kernels.grpo_epilogue.lse_logp_torch` at ``temperature``), all sequences
    concatenated."""
    model.set_attn_implementation(attention)
    out = []
    with torch.no_grad():
        for ids, start in seqs:
            out.append(lse_logp_torch(model(ids[None]).logits[0, start - 1 : -1], ids[start:], 1.0 / temperature)[0])
    return torch.cat(out)


def gap_stats(a: torch.Tensor, b: torch.Tensor) -> dict:
    d = (a - b).abs()
    return {
        "mean": d.mean().item(),
        "median": d.median().item(),
        "p99": d.quantile(0.99).item(),
        "max": d.max().item(),
        "tokens": d.numel(),
    }


def table_line(r: dict) -> str:
    ratio = f"{r['mean_over_bf16']:.2f}" if "mean_over_bf16" in r else ""
    return (
        f"| {r['row']} | {r['compared']} | {r['mean']:.4f} | {ratio} | {r['median']:.4f} | {r['p99']:.3f} | "
        f"{r['max']:.3f} | {r['tokens']} |"
    )


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prompts", type=int, default=8, help="questions of the main job's task")
    p.add_argument("--completions", type=int, default=2, help="sampled completions per question")
    p.add_argument("--tokens", type=int, default=96, help="most tokens per completion")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cpu")
    p.add_argument("--out-dir", default=None)
    args = p.parse_args(argv)
    cfg = GRPOKitConfig().validate()
    model, tok = load_model(cfg.model, dtype=torch.bfloat16, device=args.device)
    model.eval()
    questions = [t["question"] for t in generate_tasks(cfg.task, args.prompts, levels=cfg.levels, seed=args.seed)]
    system_prompt = cfg.system_prompt or default_system_prompt(cfg.task)  # the main job's, as its run builds it
    seqs = sample(model, tok, questions, system_prompt, args.completions, args.tokens, cfg.temperature, args.seed)
    scored, rows = {}, []
    for form, fp8 in FORMS.items():
        m = model
        if fp8 is not None:
            m = copy.deepcopy(model)
            quantize_model_fp8(m, activations=fp8[0], block=fp8[1])
        scored[form] = {att: token_logps(m, seqs, att, cfg.temperature) for att in ATTENTION}
        rows.append({"row": form, "compared": " vs ".join(ATTENTION), **gap_stats(*scored[form].values())})
    for form in FORMS:
        if form != "bf16":
            rows.append(
                {
                    "row": f"{form} vs bf16",
                    "compared": "quantisation (sdpa)",
                    **gap_stats(scored[form]["sdpa"], scored["bf16"]["sdpa"]),
                }
            )
    base = rows[0]["mean"]
    for r in rows[: len(FORMS)]:
        r["mean_over_bf16"] = r["mean"] / base
    result = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "command": "python -m grpo_kit bench fp8_amplification " + " ".join(sys.argv[1:] if argv is None else argv),
        "hardware": hardware(args.device),
        "model": cfg.model,
        "temperature": cfg.temperature,
        "sequences": len(seqs),
        "rows": rows,
    }
    lines = [
        f"# FP8 activations amplify an upstream bf16 difference ({result['hardware'].get('gpu') or 'CPU'})",
        "",
        f"- command: `{result['command']}`",
        f"- date: {result['date']}",
        f"- hardware: {hardware_line(result['hardware'])}",
        f"- {cfg.model} in bf16, {len(seqs)} sampled completions of the main job's prompts, log-probs at "
        f"temperature {cfg.temperature}",
        "",
        "| weights | compared | mean abs dlogp | x bf16's | median | p99 | max | tokens |",
        "|---|---|---|---|---|---|---|---|",
        *map(table_line, rows),
    ]
    print("\n".join(lines))
    record_report("fp8_amplification", result, lines, args.out_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
