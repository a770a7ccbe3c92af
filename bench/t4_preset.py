"""Notebook 04's free-T4 preset on a GPU: its generation phase, under the T4's memory, against the calculator.

``grpo_kit.memory.fit.free_t4_preset`` picks the longest context whose whole GRPO step the calculator fits in
14 GiB (a T4 has about 15 GiB usable): Llama-3.1-8B, 4-bit base weights, fp16, HF generation, 8 generations of a
512-token prompt. Its peak is the generation phase (the KV cache of all 8 sequences beside the weights and the
LoRA optimiser states; `bench qlora` measures the training step at 4K and 20K: lower). This script runs that
phase on the kit's own QLoRA load (``grpo_kit.model.loading.load_model``, random weights), the GPU capped with
``torch.cuda.set_per_process_memory_fraction`` at ``--budget-gib`` (15: the T4), LoRA r=16 on every linear
layer and AdamW's states allocated, as after the first step, and reports the peak allocated and reserved bytes
against the calculator's generation-phase total. Two ways:

* default, the end of the generation (about a minute): HF's KV cache (``DynamicCache``) holding the 8 sequences'
  keys and values for all but the last ``--tail`` tokens of the context (random values, the cache's full size),
  then HF ``generate`` of those last ``--tail`` tokens through it: the largest cache, the decoding steps' own
  buffers and the cache's growth by concatenation, as at the end of a full generation; not the allocator's
  fragmentation from thousands of growth steps, so its reserved figure can be lower than a whole run's;
* ``--full``: the whole generation through :class:`grpo_kit.generation.HFGenerator` (what the trainer calls with
  ``generation_backend: hf``), 8 completions of one 512-token prompt at the preset's full length (random
  weights: fixed length through ``min_tokens``): the deciding run for the reserved memory. On the H200 this is
  minutes of decoding.

The training step at the same length: ``bench/step.py --seq-len CONTEXT:8 --load-in-4bit --dtype fp16
--budget-gib 15``. Results: ``bench/results/data/t4_preset.jsonl`` (page ``t4_preset.md``). On the CPU it runs the same code on
a tiny model (``--model tiny-llama --completion 16 --tail 4``) without a cap, for checking the script only.

    python -m grpo_kit bench t4_preset --tag h200
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
from _common import LORA_TARGETS, command_line, hardware, hardware_line, record_report

ROOT = Path(__file__).resolve().parent.parent
PROMPT = 512
GENERATIONS = 8
LORA_RANK = 16


def calculator_gib(model: str, context: int) -> dict:
    """The calculator's generation phase, its whole-step peak and every phase's total (GiB) for this setup."""
    from grpo_kit.memory import EstimateSpec, estimate, total_gpu_bytes

    df = estimate(
        model,
        EstimateSpec(
            num_generations=GENERATIONS,
            prompt_length=PROMPT,
            completion_length=context - PROMPT,
            dtype="fp16",
            lora_rank=LORA_RANK,
            quantization="4bit",
            micro_batch_size=1,
            vllm=False,
            include_generation=True,
        ),
    )
    phases = {k: round(v / 2**30, 3) for k, v in df.attrs["phase_bytes"].items()}
    return {
        "generation": df.attrs["phase_bytes"]["generation"] / 2**30,
        "peak_phase": df.attrs["peak_phase"],
        "step": total_gpu_bytes(df) / 2**30,
        "phases": phases,
    }


def build(model_name: str, device: torch.device):
    """The 4-bit model with LoRA and AdamW's states (zeros, as allocated at the first optimiser step)."""
    import peft

    from grpo_kit.model.loading import load_model, load_tokenizer

    model, _ = load_model(model_name, dtype=torch.float16, device=device, load_in_4bit=True)
    if device.type == "cpu":  # the CPU check only: bitsandbytes 0.50.2 repacks 4-bit weights for eval on CPUs
        for m in model.modules():  # with AVX512-BF16 and fails on widths not a multiple of 64 (the tiny model's 160)
            if hasattr(m, "support_avx512bf16_for_cpu"):
                m.support_avx512bf16_for_cpu = False
    model = peft.get_peft_model(
        model, peft.LoraConfig(r=LORA_RANK, lora_alpha=LORA_RANK, lora_dropout=0.0, target_modules=LORA_TARGETS)
    )
    trainable = [p for p in model.parameters() if p.requires_grad]  # fp32: PEFT's adapter dtype under fp16
    opt = torch.optim.AdamW(trainable, lr=1e-5)
    for p in trainable:
        opt.state[p] = {"step": torch.tensor(0.0), "exp_avg": torch.zeros_like(p), "exp_avg_sq": torch.zeros_like(p)}
    tok = load_tokenizer(model_name)
    tok.padding_side = "left"
    return model, opt, tok


def generate_tail(model, tok, context: int, tail: int, device: torch.device) -> int:
    """The last ``tail`` decoding steps of a generation of ``GENERATIONS`` sequences to ``context`` tokens: a
    DynamicCache filled with random fp16 keys and values for ``context - tail`` tokens per sequence, then HF
    ``generate`` of ``tail`` tokens through it (fixed length). Returns the tokens generated."""
    from transformers import DynamicCache

    cfg = model.get_base_model().config
    heads = cfg.num_key_value_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    past = context - tail
    cache = DynamicCache()
    for layer in range(cfg.num_hidden_layers):  # the update copies each (one layer's K or V transient at a time)
        k, v = (
            torch.randn(GENERATIONS, heads, past, head_dim, dtype=torch.float16, device=device).mul_(0.1)
            for _ in range(2)
        )
        cache.update(k, v, layer)
        del k, v
    g = torch.Generator(device="cpu").manual_seed(0)
    ids = torch.randint(0, cfg.vocab_size, (GENERATIONS, past + 1), generator=g).to(device)
    eos = tok.eos_token_id
    with torch.no_grad():
        out = model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            past_key_values=cache,
            max_new_tokens=tail,
            min_new_tokens=tail,
            do_sample=True,
            top_k=0,
            top_p=1.0,
            temperature=1.0,
            pad_token_id=eos,
            eos_token_id=eos,
        )
    return (out.shape[1] - ids.shape[1]) * GENERATIONS


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="llama-3.1-8b")
    p.add_argument("--budget-gib", type=float, default=15.0, help="memory cap on CUDA (the T4's usable 15 GiB)")
    p.add_argument(
        "--completion",
        type=int,
        default=None,
        help="completion tokens (default: the preset's context minus the 512-token prompt)",
    )
    p.add_argument("--tail", type=int, default=64, help="decoding steps after the pre-filled cache (default mode)")
    p.add_argument("--full", action="store_true", help="the whole generation through HFGenerator (minutes)")
    p.add_argument("--tag", default="gpu")
    p.add_argument("--out-dir", default=str(ROOT / "bench" / "results"))
    a = p.parse_args(argv)

    from grpo_kit.generation import HFGenerator, SamplingConfig
    from grpo_kit.memory.fit import free_t4_preset

    preset = free_t4_preset(a.model, num_generations=GENERATIONS, prompt_length=PROMPT, lora_rank=LORA_RANK)
    context = PROMPT + a.completion if a.completion else preset["context_length"]
    if not a.full and not 0 < a.tail < context - PROMPT:
        p.error(f"--tail {a.tail} is not allowed: between 1 and the completion length ({context - PROMPT}) - 1")
    calc = calculator_gib(a.model, context)
    cuda = torch.cuda.is_available()
    dev = torch.device("cuda" if cuda else "cpu")
    if cuda:
        total = torch.cuda.get_device_properties(dev).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, a.budget_gib * 2**30 / total), torch.cuda.current_device())
    t0 = time.perf_counter()
    model, opt, tok = build(a.model, dev)
    build_s = time.perf_counter() - t0
    prompt = tok(" hello" * (2 * PROMPT))["input_ids"][:PROMPT]
    gen = HFGenerator(model, tok)
    gen.generate([prompt], GENERATIONS, SamplingConfig(temperature=1.0, max_tokens=4, min_tokens=4))  # warm-up
    model.eval()
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats(dev)
    before = torch.cuda.memory_allocated(dev) / 2**30 if cuda else None
    row = dict(
        model=a.model,
        dtype="fp16",
        load_in_4bit=True,
        generations=GENERATIONS,
        prompt_len=PROMPT,
        completion_len=context - PROMPT,
        context=context,
        budget_gib=a.budget_gib if cuda else None,
        calculator_gib=round(calc["generation"], 3),
        calculator_step_gib=round(calc["step"], 3),
        calculator_peak_phase=calc["peak_phase"],
        calculator_phases_gib=calc["phases"],
        preset_context=preset["context_length"],
        preset_budget_gib=preset["budget_gib"],
        build_s=round(build_s, 1),
        allocated_before_gib=None if before is None else round(before, 3),
        mode="full" if a.full else f"the last {a.tail} tokens after a pre-filled cache",
    )
    t0 = time.perf_counter()
    try:
        if a.full:
            out = gen.generate(
                [prompt],
                GENERATIONS,
                SamplingConfig(temperature=1.0, max_tokens=context - PROMPT, min_tokens=context - PROMPT),
            )
            row.update(ok=True, tokens=sum(len(c) for c in out.completion_ids))
        else:
            row.update(ok=True, tokens=generate_tail(model, tok, context, a.tail, dev))
    except torch.OutOfMemoryError as e:
        row.update(ok=False, error=str(e).splitlines()[0][:300])
    row["generate_s"] = round(time.perf_counter() - t0, 1)
    if cuda:
        row["peak_allocated_gib"] = round(torch.cuda.max_memory_allocated(dev) / 2**30, 3)
        row["peak_reserved_gib"] = round(torch.cuda.max_memory_reserved(dev) / 2**30, 3)
        if row["ok"]:  # at an out-of-memory failure the peak is where it stopped, not the phase's
            row["calculator_error"] = round(calc["generation"] / row["peak_allocated_gib"] - 1, 4)
    if row.get("ok"):
        row["tokens_per_s"] = round(row["tokens"] / row["generate_s"], 1)
    print(row, flush=True)

    hw = hardware(dev)
    cmd = command_line("t4_preset", argv)
    data = {"command": cmd, "hardware": hw, "rows": [row]}
    fmt = lambda v: "" if v is None else v  # noqa: E731
    lines = [
        f"# Notebook 04's free-T4 preset: the generation phase ({a.tag})",
        "",
        f"Command: `{cmd}`",
        f"Hardware: {hardware_line(hw)}",
        "",
        f"The preset (`grpo_kit.memory.fit.free_t4_preset`): context {preset['context_length']:,} tokens, the "
        f"calculator's step {preset['estimate_gib']:.2f} of {preset['budget_gib']} GiB. Measured: "
        + (
            f"{GENERATIONS} completions of one {PROMPT}-token prompt by `HFGenerator` at {context - PROMPT:,} "
            "tokens each"
            if a.full
            else f"the end of a generation of {GENERATIONS} sequences to {context:,} tokens: HF's DynamicCache filled "
            f"with random keys and values for {context - a.tail:,} tokens each, then HF `generate` of the last "
            f"{a.tail} tokens through it"
        )
        + f", 4-bit {a.model} (random weights, fixed length), fp16, LoRA r={LORA_RANK} and AdamW states held, "
        f"under `set_per_process_memory_fraction` = {a.budget_gib} GiB"
        + ("" if cuda else " (not on the CPU)")
        + "."
        + (
            ""
            if a.full
            else " The reserved figure leaves out the allocator's fragmentation from a whole "
            "generation's thousands of cache growth steps: `--full` decides that."
        ),
        "",
        "| context | ok | peak allocated GiB | peak reserved GiB | calculator GiB (generation) | calc. error | "
        "generate s | tokens/s |",
        "|---|---|---|---|---|---|---|---|",
        f"| {context:,} | {row.get('ok')} | {fmt(row.get('peak_allocated_gib'))} | "
        f"{fmt(row.get('peak_reserved_gib'))} | {row['calculator_gib']} | {fmt(row.get('calculator_error'))} | "
        f"{row['generate_s']} | {fmt(row.get('tokens_per_s'))} |",
        "",
        f"The calculator's phases (GiB): {calc['phases']}; the step's peak is its {calc['peak_phase']} phase, "
        f"{calc['step']:.2f} GiB.",
    ]
    if not row.get("ok"):
        lines += ["", f"Failed: {row.get('error')}"]
    record_report("t4_preset", data, lines, a.out_dir)
    return 0 if row.get("ok") else 1


if __name__ == "__main__":
    raise SystemExit(main())
