"""``python -m grpo_kit vram``: print the VRAM estimate as a plain-text table (and plot it).

    python -m grpo_kit vram --model llama-3.1-8b --context 20480 --generations 8
    python -m grpo_kit vram --model qwen2.5-1.5b --context 1024 --method grpo_kit --lora-rank 16 --plot vram.png
"""

from __future__ import annotations

import argparse
import math
import sys

import pandas as pd

from grpo_kit.memory import formulas as F
from grpo_kit.memory.estimate import METHODS, _is_published_setup, estimate, published_table, resolve_arch
from grpo_kit.memory.fit import detected_gpu_gib, fit_verdict


def _positive_int(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {v}")
    return v


def _non_negative_int(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if v < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {v}")
    return v


def _positive_float(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not v > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {v}")
    return v


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m grpo_kit vram",
                                description="Estimate the GPU memory of one GRPO step, by component.")
    p.add_argument("--model", required=True, help="built-in name (e.g. llama-3.1-8b) or path to a config.json")
    p.add_argument("--context", type=_positive_int, required=True, help="tokens per sequence (prompt + completion)")
    p.add_argument("--generations", type=_positive_int, default=8, help="completions per prompt (default 8)")
    p.add_argument("--prompt-length", type=_non_negative_int, default=0,
                   help="prompt tokens within --context (default 0: the whole context is completion, "
                        "as in Unsloth's published table)")
    p.add_argument("--lora-rank", type=_positive_int, default=None, help="LoRA rank on all linear layers "
                   "(default: full fine-tuning)")
    p.add_argument("--lora-dropout", action="store_true", help="LoRA dropout above 0 (needs --lora-rank): every "
                   "adapter saves its own dropped input and a mask, and grpo_kit recomputes each layer whole")
    p.add_argument("--method", choices=[*METHODS, "all"], default="all")
    p.add_argument("--dtype", choices=list(F.DTYPE_BYTES), default="bf16")
    p.add_argument("--quantization", choices=["4bit"], default=None, help="NF4 weights (needs --lora-rank)")
    p.add_argument("--kv-cache-dtype", choices=list(F.KV_DTYPE_BYTES), default=None, help="default: --dtype")
    p.add_argument("--micro-batch", type=_positive_int, default=None,
                   help="sequences per forward/backward (default: all generations at once)")
    p.add_argument("--no-vllm", action="store_true", help="generation by HF generate (KV cache freed before training)")
    p.add_argument("--training-only", action="store_true", help="leave out generation (KV cache)")
    p.add_argument("--standby", action="store_true", help="vLLM releases its KV cache while training runs "
                   "(grpo_kit's shared-weight engine): the KV cache counts in the generation phase only")
    p.add_argument("--gpu-gib", type=_positive_float, default=None, metavar="GIB",
                   help="GPU memory to check the estimate against (default: the detected CUDA GPU's, if any): "
                        "a verdict per method and the longest context that fits")
    p.add_argument("--plot", default=None, metavar="OUT.png", help="also draw stacked bars to this file")
    return p


def _fmt(v: float, digits: int = 2) -> str:
    return "" if (v is None or (isinstance(v, float) and math.isnan(v))) else f"{v:.{digits}f}"


def _print_one(df: pd.DataFrame, out) -> None:
    a = df.attrs
    print(f"method {a['method']}: peak during the {a['peak_phase']} phase", file=out)
    t = pd.DataFrame({
        "component": df["component"], "where": df["where"],
        "GB": df["GB"].map(_fmt), "GiB": df["GiB"].map(_fmt),
        "at peak": df["in_peak"].map(lambda x: "yes" if x else ""),
        "published": df["published"].map(lambda v: _fmt(v, 1)),
        "note": [f"[{i + 1}]" for i in range(len(df))],
    })
    print(t.to_string(index=False), file=out)
    for i, note in enumerate(df["note"]):
        print(f"  [{i + 1}] {note}", file=out)
    print(file=out)


def cli_main(argv: list[str]) -> int:
    """Entry point of ``python -m grpo_kit vram``; returns the exit status (argparse exits 2 on
    bad input, before any work)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.prompt_length >= args.context:
        parser.error(f"--prompt-length ({args.prompt_length}) must be smaller than --context ({args.context})")
    if args.standby and args.no_vllm:
        parser.error("--standby describes a vLLM engine; it cannot go with --no-vllm")
    if args.quantization and args.lora_rank is None:
        parser.error("--quantization 4bit needs --lora-rank (4-bit weights are frozen; only LoRA trains)")
    if args.lora_dropout and args.lora_rank is None:
        parser.error("--lora-dropout needs --lora-rank (LoRA dropout acts on the adapters)")
    try:
        arch = resolve_arch(args.model)
    except ValueError as e:
        parser.error(str(e))
    kw = dict(num_generations=args.generations, prompt_length=args.prompt_length,
              completion_length=args.context - args.prompt_length, dtype=args.dtype, lora_rank=args.lora_rank,
              quantization=args.quantization, vllm=not args.no_vllm, kv_cache_dtype=args.kv_cache_dtype,
              micro_batch_size=args.micro_batch, include_generation=not args.training_only, standby=args.standby,
              lora_dropout=args.lora_dropout)
    methods = list(METHODS) if args.method == "all" else [args.method]
    try:
        tables = {m: estimate(arch, method=m, **kw) for m in methods}
    except ValueError as e:
        parser.error(str(e))
    out = sys.stdout
    a = next(iter(tables.values())).attrs
    print(f"VRAM estimate: {args.model}, {args.generations} generations x {args.context} tokens "
          f"(prompt {args.prompt_length} + completion {args.context - args.prompt_length}), "
          f"micro-batch {a['micro_batch_size']} sequences, {args.dtype}"
          + (f", LoRA r={args.lora_rank}" if args.lora_rank else ", full fine-tuning")
          + (f", {args.quantization} weights" if args.quantization else "")
          + (", HF generate" if args.no_vllm else ", vLLM colocated")
          + f", KV cache {a['kv_cache_dtype']}" + (", training step only" if args.training_only else ""), file=out)
    print("GB = 1e9 bytes, GiB = 2^30 bytes; 'published' = Unsloth's published figure for the same component "
          "(grpo_kit: Unsloth's column, the figure to beat).\n", file=out)
    for df in tables.values():
        _print_one(df, out)
    if _is_published_setup(arch, args.generations, args.prompt_length, args.context - args.prompt_length, args.dtype):
        pt = published_table(arch)
        print(f"Published table reproduced ({pt.attrs['source']}); 'derived' is our formula rounded as published:",
              file=out)
        print(pt.drop(columns=["derivation"]).to_string(index=False), file=out)
        for comp, how in zip(pt["component"], pt["derivation"]):
            print(f"  {comp}: {how}", file=out)
        print("  TRL's 414 GB training memory has no published derivation (shown as published, not derived); "
              "our own derivation for TRL's setup is the 'trl' table above.", file=out)
    gpu = (args.gpu_gib, "--gpu-gib") if args.gpu_gib else detected_gpu_gib()
    if gpu is None:
        print("No GPU given or detected: pass --gpu-gib N for a verdict (e.g. 15 for a T4, 80 for an H100).",
              file=out)
    else:
        print(f"Does it fit in {gpu[0]:.2f} GiB ({gpu[1]})?", file=out)
        for m in methods:
            v = fit_verdict(arch, gpu[0], context=args.context, method=m,
                            **{k: val for k, val in kw.items() if k not in ("completion_length",)})
            print(f"  {v.text()}", file=out)
    if args.plot:
        from grpo_kit.memory.plot import plot_components  # lazy: matplotlib, for --plot only

        fig = plot_components(tables)
        fig.savefig(args.plot, dpi=120)
        print(f"\nplot written to {args.plot}", file=out)
    return 0


if __name__ == "__main__":
    raise SystemExit(cli_main(sys.argv[1:]))
