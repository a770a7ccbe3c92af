"""Where the FP8 training pass spends its time: decoder layers of an 8B architecture, bf16 against FP8 base weights
with each of the FP8 matmul's parts in torch or in the kit's kernels, on one GPU (FP8 tensor cores).

    python -m grpo_kit bench fp8_train [--model llama-3.1-8b] [--layers 4] [--tokens 4608] [--reps 5]
                                       [--variants bf16,fp8_torch,fp8,fp8_bwd8] [--tag h100]

The first ``--layers`` decoder layers of ``--model`` (random weights, bf16, LoRA r=16 on every linear layer, B
random so both factors get gradients) on one sequence of ``--tokens`` tokens, the decoder alone (no head: the
loss's work is the same for every variant). Variants:

* ``bf16``: the 16-bit base weights (the kit's default training path);
* ``fp8_torch``: FP8 base weights, W8A8 forward through ``torch._scaled_mm`` with the activations quantised by
  the torch twin, backward from the weight dequantised by the torch twin (the FP8 path before its kernels);
* ``fp8``: the same with :mod:`grpo_kit.kernels.fp8_rows`' Triton row quantiser and dequantiser (the default);
* ``fp8_bwd8``: ``fp8`` with the input gradient as an FP8 GEMM (``FP8Linear.grad_input = "fp8"``);
* ``fp8_w8a16``: the activations unquantised against the dequantised weight (``activations="16bit"``).

Per variant: a no-grad forward (the reference pass, and the checkpointed forward before its recompute) and a
forward + backward, median of ``--reps`` after a warm-up, in ms per decoder layer; the peak memory of the forward
+ backward; the LoRA gradients' relative error against ``fp8``'s (same weights: how much the backward's
arithmetic moves them) and the decoder output's against ``bf16``; the top CUDA kernels of one forward + backward
under the profiler. Then the two kernels alone against their twins on the 8B's shapes. Results:
``bench/results/data/fp8_train.jsonl`` (page ``fp8_train.md``).
"""

from __future__ import annotations

import argparse
import statistics

import torch
from _common import LORA_TARGETS, command_line, hardware, kernel_profile, record_report, rel_err, timed_ms

from grpo_kit.kernels import fp8_rows
from grpo_kit.model.fp8 import FP8Linear, fp8_lora_config, fp8_support, quantize_model_fp8
from grpo_kit.model.loading import build_random_model, model_config

VARIANTS = ("bf16", "fp8_torch", "fp8", "fp8_bwd8", "fp8_w8a16")
_TWIN_ONLY = {"fp8_torch"}  # variants whose element-wise FP8 parts run in torch


def _model(a, variant: str):
    """The variant's decoder (PEFT-wrapped), same random weights for every variant (seed 0)."""
    from peft import LoraConfig, get_peft_model  # lazy: peft is slow to import

    cfg = model_config(a.model)
    cfg.num_hidden_layers = a.layers
    model = build_random_model(cfg, dtype=torch.bfloat16, device=a.device, seed=0)
    lora = LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules=LORA_TARGETS)
    if variant != "bf16":
        quantize_model_fp8(model, activations="16bit" if variant == "fp8_w8a16" else "fp8")
        for m in model.modules():
            if isinstance(m, FP8Linear):
                m.grad_input = "fp8" if variant == "fp8_bwd8" else "dequant"
        lora = fp8_lora_config(lora)
    model = get_peft_model(model, lora)
    g = torch.Generator(device=a.device).manual_seed(1)
    for n, p in model.named_parameters():
        if "lora_B" in n:
            p.data.normal_(0.0, 0.02, generator=g)
    return model


def _measure(a, variant: str, ids: torch.Tensor, probe: torch.Tensor) -> tuple[dict, torch.Tensor, dict]:
    model = _model(a, variant)
    decoder = model.base_model.model.model

    def forward():
        return decoder(input_ids=ids).last_hidden_state

    def forward_backward():
        model.zero_grad(set_to_none=True)
        (forward().float() * probe).sum().backward()

    with torch.no_grad():
        out = forward().float()
        for _ in range(2):
            forward()
        fwd = [timed_ms(forward, a.device) for _ in range(a.reps)]
    forward_backward()
    cuda = a.device == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    fb = [timed_ms(forward_backward, a.device) for _ in range(a.reps)]
    peak = (torch.cuda.max_memory_allocated() - base) / 2**30 if cuda else None
    grads = {n: p.grad.detach().float().clone() for n, p in model.named_parameters() if p.grad is not None}
    prof = kernel_profile(forward_backward, a.device, top=12) if cuda else {"top_cuda": []}
    row = dict(
        variant=variant,
        model=a.model,
        layers=a.layers,
        T=a.tokens,
        forward_ms_per_layer=statistics.median(fwd) / a.layers,
        forward_backward_ms_per_layer=statistics.median(fb) / a.layers,
        forward_ms=[round(t, 3) for t in fwd],
        forward_backward_ms=[round(t, 3) for t in fb],
        fwd_bwd_peak_gib=None if peak is None else round(peak, 3),
        top_cuda=[
            {k: (round(v, 3) if isinstance(v, float) else v) for k, v in r.items() if k != "self_cpu_ms"}
            for r in prof["top_cuda"]
        ],
    )
    del model
    if cuda:
        torch.cuda.empty_cache()
    return row, out, grads


def _kernel_rows(a) -> list[dict]:
    """The two element-wise kernels against their twins on the 8B's activation and weight shapes."""
    cfg = model_config(a.model)
    h, f = cfg.hidden_size, cfg.intermediate_size
    rows = []
    for k in (h, f):
        x = torch.randn(a.tokens, k, device="cuda", dtype=torch.bfloat16)
        for impl, fn in (("triton", fp8_rows.quantize_rows_triton), ("torch", fp8_rows.quantize_rows_reference)):
            ms = statistics.median(timed_ms(lambda: fn(x), "cuda") for _ in range(20))
            rows.append(
                dict(variant=f"quantize_rows_{impl}", dims=f"{a.tokens}x{k}", ms=ms, gb_per_s=x.numel() * 3 / ms / 1e6)
            )  # bytes that must move: read 2, write 1
    for n, k in ((f, h), (h, f)):
        codes, scale = fp8_rows.quantize_rows_reference(torch.randn(n, k, device="cuda"))
        for impl, fn in (
            ("triton", fp8_rows.dequantize_channels_triton),
            ("torch", fp8_rows.dequantize_channels_reference),
        ):
            ms = statistics.median(timed_ms(lambda: fn(codes, scale, torch.bfloat16), "cuda") for _ in range(20))
            rows.append(
                dict(variant=f"dequantize_{impl}", dims=f"{n}x{k}", ms=ms, gb_per_s=codes.numel() * 3 / ms / 1e6)
            )  # read 1, write 2
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="llama-3.1-8b")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--tokens", type=int, default=4608, help="one sequence's tokens (the 4K step's 512 + 4,096)")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--variants", default="bf16,fp8_torch,fp8,fp8_bwd8,fp8_w8a16")
    p.add_argument(
        "--device",
        default="cuda" if torch.cuda.is_available() else "cpu",
        help="cuda (the measurement; FP8 tensor cores) or cpu (a smoke run: the torch twins)",
    )
    p.add_argument("--tag", default=None)
    p.add_argument("--out-dir", default=None)
    a = p.parse_args(argv)
    variants = a.variants.split(",")
    bad = [v for v in variants if v not in VARIANTS]
    if bad:
        p.error(f"unknown variants {bad}: choose from {', '.join(VARIANTS)}")
    if a.device == "cuda":
        if (why := fp8_support("cuda")) is not None:
            p.error(why)
        print(f"kernels equal their twins on this GPU: {fp8_rows.kernels_match('cuda:0')}", flush=True)
    cfg = model_config(a.model)
    g = torch.Generator(device=a.device).manual_seed(2)
    ids = torch.randint(0, cfg.vocab_size, (1, a.tokens), device=a.device, generator=g)
    probe = torch.randn(1, a.tokens, cfg.hidden_size, device=a.device, generator=g) / a.tokens**0.5
    rows, outs, grads = [], {}, {}
    use_triton = fp8_rows.use_triton
    for v in variants:
        fp8_rows.use_triton = (lambda t: False) if v in _TWIN_ONLY else use_triton
        try:
            row, outs[v], grads[v] = _measure(a, v, ids, probe)
        finally:
            fp8_rows.use_triton = use_triton
        rows.append(row)
        print(
            {
                k: row[k]
                for k in ("variant", "forward_ms_per_layer", "forward_backward_ms_per_layer", "fwd_bwd_peak_gib")
            },
            flush=True,
        )
    for row in rows:
        v = row["variant"]
        if "bf16" in outs and v != "bf16":
            row["output_rel_err_vs_bf16"] = rel_err(outs[v], outs["bf16"])
        if "fp8" in grads and v.startswith("fp8") and v != "fp8":
            row["lora_grad_rel_err_vs_fp8"] = rel_err(
                torch.cat([t.flatten() for t in grads[v].values()]),
                torch.cat([t.flatten() for t in grads["fp8"].values()]),
            )
    if a.device == "cuda":
        rows += _kernel_rows(a)
    cmd = command_line("fp8_train", argv)
    lines = [f"# fp8_train ({a.tag or 'gpu'})", f"Command: `{cmd}`", ""]
    for r in rows:
        lines.append(
            " ".join(
                f"{k}={r[k]:.4g}" if isinstance(r[k], float) else f"{k}={r[k]}" for k in r if not isinstance(r[k], list)
            )
        )
    record_report("fp8_train", {"command": cmd, "hardware": hardware(a.device), "rows": rows}, lines, a.out_dir)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
