"""``python -m grpo_kit vram``: does a run fit a GPU? The VRAM estimate as a plain-text table (and a plot), a
verdict against the GPU's memory and the longest context that fits.

By default it prices ``python -m grpo_kit train``'s own run on a CUDA GPU: the kit's defaults (``StepSpec()``, whose
defaults the app's config takes) with the named model and context; each flag given replaces one of them. ``--published-setting`` prices the setting of Unsloth's published table instead.

    python -m grpo_kit vram --model llama-3.1-8b --context 20480 --gpu-gib 24
    python -m grpo_kit vram --model llama-3.1-8b --context 20480 --generations 8 --published-setting
    python -m grpo_kit vram --model qwen2.5-1.5b --context 1024 --method all --plot vram.png
    python -m grpo_kit vram --model llama-3.1-8b --context 129024 --prompt-length 126976 --generations 8 \\
        --micro-batch 8 --standby --prefix-sharing both --gpu-gib 80
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys

import pandas as pd

from grpo_kit.memory import formulas as F
from grpo_kit.memory.estimate import (
    METHODS,
    PUBLISHED_SETUP,
    EstimateSpec,
    config_estimate_spec,
    estimate,
    is_published_setup,
    published_table,
    resolve_arch,
)
from grpo_kit.memory.fit import detected_gpu_gib, fit_verdict
from grpo_kit.memory.spec import StepSpec


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


def _defaults_help(run: StepSpec) -> dict[str, str]:
    """Each flag's default in words, for ``--help``: the kit's run's (read from ``run``) and, after it, the
    published setting's."""
    G = PUBLISHED_SETUP["num_generations"]
    s = config_estimate_spec(run)
    kit = dict(
        generations=f"num_generations, {s.num_generations}",
        prompt=f"max_prompt_length, {s.prompt_length}",
        lora=f"lora_rank, {s.lora_rank}" if s.lora_rank else "use_lora false: full fine-tuning",
        method=f"trainer, {s.method}",
        dtype=f"dtype {run.dtype!r}, {s.dtype} on a GPU",
        kv=f"kv_cache_dtype {run.kv_cache_dtype!r}, " + (s.kv_cache_dtype or "the model's dtype"),
        micro=f"per_device_train_batch_size, {s.micro_batch_size}",
        gen=f"generation_backend {run.generation_backend!r}, priced as "
        + ("vLLM" if s.vllm else "HF generate (every sequence's KV cache padded to the context, the larger)"),
    )
    return dict(
        generations=f"completions per prompt (default: the kit's {kit['generations']}; published setting: {G})",
        prompt=f"prompt tokens within --context (default: the kit's {kit['prompt']}; published setting: 0, the whole "
        "context is completion)",
        lora=f"LoRA rank on all linear layers (default: the kit's {kit['lora']}; published setting: full fine-tuning)",
        method=f"which method's step to price (default: the kit's {kit['method']}; published setting: all)",
        dtype=f"weights and activations (default: the kit's {kit['dtype']}; published setting: bf16)",
        kv=f"KV cache dtype (default: the kit's {kit['kv']}; published setting: --dtype)",
        micro=f"sequences per forward/backward (default: the kit's {kit['micro']}; published setting: all "
        "generations at once)",
        gen=f"the kit's {kit['gen']}; published setting: vLLM colocated, its KV cache resident",
    )


def build_parser(run: StepSpec | None = None) -> argparse.ArgumentParser:
    """The ``vram`` arguments; ``run``: the run priced by default (None: the kit's, ``StepSpec()``; or an object
    that makes one, :meth:`StepSpec.of`), its values appear in the help."""
    h = _defaults_help(StepSpec() if run is None else StepSpec.of(run))
    p = argparse.ArgumentParser(
        prog="python -m grpo_kit vram",
        description="Does a GRPO run fit a GPU? Estimates the GPU memory of one step, by component, against "
        "--gpu-gib (or the detected CUDA GPU), with the longest context that fits. By default it prices "
        "the run `python -m grpo_kit train` makes with --model and --context on a CUDA GPU (the config's "
        "defaults, each flag below replacing one); --published-setting prices the setting of Unsloth's "
        "published long-context table instead.",
    )
    p.add_argument("--model", required=True, help="built-in name (e.g. llama-3.1-8b) or path to a config.json")
    p.add_argument("--context", type=_positive_int, required=True, help="tokens per sequence (prompt + completion)")
    p.add_argument(
        "--published-setting",
        action="store_true",
        help="Unsloth's published table's setting instead of the kit's run: a prompt of 0 tokens, full "
        "fine-tuning, all generations in one forward, vLLM colocated without standby, the KV cache "
        "in --dtype, all three methods",
    )
    p.add_argument("--generations", type=_positive_int, default=None, help=h["generations"])
    p.add_argument("--prompt-length", type=_non_negative_int, default=None, help=h["prompt"])
    p.add_argument("--lora-rank", type=_positive_int, default=None, help=h["lora"])
    p.add_argument("--full-finetuning", action="store_true", help="no LoRA: every weight trains, with AdamW's state")
    p.add_argument(
        "--lora-dropout",
        action="store_true",
        help="LoRA dropout above 0: every adapter saves its own "
        "dropped input and a mask, and grpo_kit recomputes each layer whole",
    )
    p.add_argument("--method", choices=[*METHODS, "all"], default=None, help=h["method"])
    p.add_argument("--dtype", choices=list(F.DTYPE_BYTES), default=None, help=h["dtype"])
    p.add_argument("--quantization", choices=["4bit"], default=None, help="NF4 weights (needs LoRA)")
    p.add_argument("--kv-cache-dtype", choices=list(F.KV_DTYPE_BYTES), default=None, help=h["kv"])
    p.add_argument("--micro-batch", type=_positive_int, default=None, help=h["micro"])
    p.add_argument("--no-vllm", action="store_true", help="generation by HF generate (KV cache freed before training)")
    p.add_argument(
        "--standby",
        action="store_true",
        help="generation by the kit's vLLM engine on shared weights, which "
        "releases its KV cache while training runs: the KV cache counts in the generation phase only. "
        f"Without --standby or --no-vllm: {h['gen']}",
    )
    p.add_argument("--training-only", action="store_true", help="leave out generation (KV cache)")
    p.add_argument(
        "--prefix-sharing",
        choices=["on", "off", "both"],
        default=None,
        help="grpo_kit only: each group's prompt scored once in the training passes (grpo_kit.model.prefix; "
        "vLLM's prefix cache holds it once in generation either way); `both` prices the step with and "
        "without it, side by side (default: the kit's prefix_sharing, `auto` priced as off, its bound)",
    )
    p.add_argument(
        "--gpu-gib",
        type=_positive_float,
        default=None,
        metavar="GIB",
        help="GPU memory to check the estimate against (default: the detected CUDA GPU's, if any): "
        "a verdict per method, naming what does not fit, and the longest context that fits",
    )
    p.add_argument("--plot", default=None, metavar="OUT.png", help="also draw stacked bars to this file")
    return p


def _check_args(parser, args) -> None:
    """Combinations that cannot be priced: one parser error each (exit 2)."""
    lora = args.lora_rank is not None or not (args.published_setting or args.full_finetuning)
    if args.full_finetuning and args.lora_rank is not None:
        parser.error("--full-finetuning and --lora-rank exclude each other")
    if args.standby and args.no_vllm:
        parser.error("--standby describes a vLLM engine; it cannot go with --no-vllm")
    if args.quantization and not lora:
        parser.error("--quantization 4bit needs LoRA (--lora-rank): 4-bit weights are frozen; only LoRA trains")
    if args.lora_dropout and not lora:
        parser.error("--lora-dropout needs LoRA (--lora-rank): LoRA dropout acts on the adapters")
    if args.prefix_sharing in ("on", "both") and args.method not in (None, "grpo_kit"):
        parser.error(
            f"--prefix-sharing {args.prefix_sharing} describes the grpo_kit trainer; --method "
            f"{args.method} scores every row's prompt"
        )


def _given(args) -> dict:
    """The estimate arguments the flags set, whichever setting they replace."""
    kw = dict(
        lora_dropout=args.lora_dropout or None,
        quantization=args.quantization,
        dtype=args.dtype,
        kv_cache_dtype=args.kv_cache_dtype,
        micro_batch_size=args.micro_batch,
        lora_rank=args.lora_rank,
        include_generation=False if args.training_only else None,
    )
    if args.no_vllm or args.standby:
        kw.update(vllm=not args.no_vllm, standby=args.standby)
    if args.prefix_sharing in ("on", "off"):
        kw["prefix_sharing"] = args.prefix_sharing == "on"
    return {k: v for k, v in kw.items() if v is not None}


def _prompt_length(args, run: StepSpec) -> int:
    """The prompt's tokens: ``--prompt-length``, else the setting's (the published table's 0, the run's
    ``max_prompt_length``)."""
    if args.published_setting:
        return args.prompt_length or 0
    return run.max_prompt_length if args.prompt_length is None else args.prompt_length


def _published_kwargs(args, P: int) -> dict:
    """:class:`EstimateSpec`'s fields for the published table's setting with a prompt of ``P`` tokens, flags
    applied."""
    G = args.generations or PUBLISHED_SETUP["num_generations"]
    return dict(
        num_generations=G,
        prompt_length=P,
        completion_length=args.context - P,
        dtype="bf16",
        lora_rank=None,
        quantization=None,
        vllm=True,
        kv_cache_dtype=None,
        micro_batch_size=None,
        include_generation=True,
        standby=False,
        lora_dropout=False,
    ) | _given(args)


def _kit_kwargs(args, run: StepSpec, P: int) -> dict:
    """:class:`EstimateSpec`'s fields for the kit's run: ``run`` with the model, the context, a prompt of ``P``
    tokens and the generations of the command line (``config_estimate_spec``, as the run's own fit check prices
    it), flags applied. A step generates the config's completions (``per_device_train_batch_size`` x
    ``gradient_accumulation_steps``) or at least one micro-batch, in whole groups."""
    G = args.generations or run.num_generations
    step = dataclasses.replace(
        run, model=args.model, num_generations=G, max_prompt_length=P, max_completion_length=args.context - P
    )
    micro = run.per_device_train_batch_size if args.micro_batch is None else args.micro_batch
    rows = max(run.per_device_train_batch_size * run.gradient_accumulation_steps, micro)
    kw = dataclasses.asdict(config_estimate_spec(step, generation_batch=-(-rows // G) * G)) | _given(args)
    if args.full_finetuning:
        kw.update(lora_rank=None, lora_dropout=False)
    return kw


def _fmt(v: float, digits: int = 2) -> str:
    return "" if (v is None or (isinstance(v, float) and math.isnan(v))) else f"{v:.{digits}f}"


def _print_one(df: pd.DataFrame, out, label: str | None = None) -> None:
    a = df.attrs
    print(f"method {label or a['method']}: peak during the {a['peak_phase']} phase", file=out)
    t = pd.DataFrame(
        {
            "component": df["component"],
            "where": df["where"],
            "GB": df["GB"].map(_fmt),
            "GiB": df["GiB"].map(_fmt),
            "at peak": df["in_peak"].map(lambda x: "yes" if x else ""),
            "published": df["published"].map(lambda v: _fmt(v, 1)),
            "note": [f"[{i + 1}]" for i in range(len(df))],
        }
    )
    print(t.to_string(index=False), file=out)
    for i, note in enumerate(df["note"]):
        print(f"  [{i + 1}] {note}", file=out)
    print(file=out)


def _method_kwargs(kw: dict, method: str) -> dict:
    """``kw`` for ``method``: TRL and Unsloth score by micro-batch (no ``scoring_batch``) and every row's prompt."""
    if method == "grpo_kit":
        return dict(kw, method=method)
    return dict(kw, method=method, scoring_batch=None, prefix_sharing=False)


def _variants(kw: dict, methods: list[str], both: bool) -> dict[str, dict]:
    """``{label: EstimateSpec fields}``: one per method, and with ``both`` grpo_kit without and with prefix sharing."""
    out = {}
    for m in methods:
        if m == "grpo_kit" and both:
            out["grpo_kit"] = dict(_method_kwargs(kw, m), prefix_sharing=False)
            out["grpo_kit + prefix sharing"] = dict(_method_kwargs(kw, m), prefix_sharing=True)
        else:
            out[m + (" + prefix sharing" if m == "grpo_kit" and kw.get("prefix_sharing") else "")] = _method_kwargs(
                kw, m
            )
    return out


def _header(args, kw: dict, a: dict) -> str:
    """The first line: what is priced."""
    P, C, G = kw["prompt_length"], kw["completion_length"], kw["num_generations"]
    what = (
        "Unsloth's published table's setting"
        if args.published_setting
        else "the run of `python -m grpo_kit train` on a CUDA GPU (its config's defaults; flags replace them; "
        "--published-setting for the published table's)"
    )
    gen = "vLLM colocated" + (", standby" if a["standby"] else "") if a["vllm"] else "HF generate"
    if not (a["vllm"] or args.no_vllm or args.published_setting):  # the config's backend, priced as HF
        gen += " (how the config's generation_backend is priced: its KV cache is the larger; --standby for vLLM's)"
    return (
        f"VRAM estimate of {what}: {args.model}, {G} generations x {args.context} tokens (prompt {P} + completion "
        f"{C}), micro-batch {a['micro_batch_size']} sequences, generation batch {a['generation_batch']}, "
        f"{a['dtype']}"
        + (f", LoRA r={a['lora_rank']}" if a["lora_rank"] else ", full fine-tuning")
        + (f", {a['quantization']} weights" if a["quantization"] else "")
        + f", {gen}"
        + f", KV cache {a['kv_cache_dtype']}"
        + ("" if a["include_generation"] else ", training step only")
    )


def _print_published(arch, out) -> None:
    pt = published_table(arch)
    print(
        f"Published table reproduced ({pt.attrs['source']}); 'derived' is our formula rounded as published:", file=out
    )
    print(pt.drop(columns=["derivation"]).to_string(index=False), file=out)
    for comp, how in zip(pt["component"], pt["derivation"]):
        print(f"  {comp}: {how}", file=out)
    print(
        "  TRL's 414 GB training memory has no published derivation (shown as published, not derived); "
        "our own derivation for TRL's setup is the 'trl' table above.",
        file=out,
    )


def _print_verdicts(arch, args, specs: dict[str, EstimateSpec], out) -> None:
    """Per method (and prefix-sharing setting): does the step fit the GPU, what does not, and the longest context
    that does."""
    gpu = (args.gpu_gib, "--gpu-gib") if args.gpu_gib else detected_gpu_gib()
    if gpu is None:
        print("No GPU given or detected: pass --gpu-gib N for a verdict (e.g. 15 for a T4, 80 for an H100).", file=out)
        return
    print(f"Does it fit in {gpu[0]:.2f} GiB ({gpu[1]})?", file=out)
    for label, spec in specs.items():
        v = fit_verdict(arch, gpu[0], spec)
        text = v.text()
        print(f"  {label + text[len(v.method) :] if text.startswith(v.method) else text}", file=out)


def cli_main(argv: list[str], run: StepSpec | None = None) -> int:
    """Entry point of ``python -m grpo_kit vram``; returns the exit status (argparse exits 2 on bad input, before
    any work). ``run``: the run priced unless ``--published-setting`` is given (None: the kit's own,
    ``StepSpec()``)."""
    run = StepSpec() if run is None else StepSpec.of(run)
    parser = build_parser(run)
    args = parser.parse_args(argv)
    _check_args(parser, args)
    try:
        arch = resolve_arch(args.model)
    except ValueError as e:
        parser.error(str(e))
    P = _prompt_length(args, run)
    if P >= args.context:
        parser.error(
            f"the prompt ({P} tokens"
            + (", the kit's max_prompt_length" if args.prompt_length is None else "")
            + f") must be shorter than --context ({args.context}); pass a smaller --prompt-length"
        )
    try:
        kw = _published_kwargs(args, P) if args.published_setting else _kit_kwargs(args, run, P)
        method = args.method or ("all" if args.published_setting else kw["method"])
        methods = list(METHODS) if method == "all" else [method]
        specs = {
            label: EstimateSpec(**variant)
            for label, variant in _variants(kw, methods, args.prefix_sharing == "both").items()
        }
        tables = {label: estimate(arch, spec) for label, spec in specs.items()}
    except ValueError as e:
        parser.error(str(e))
    out = sys.stdout
    print(_header(args, kw, next(iter(tables.values())).attrs), file=out)
    print(
        "GB = 1e9 bytes, GiB = 2^30 bytes; 'published' = Unsloth's published figure for the same component "
        "(grpo_kit: Unsloth's column, the figure to beat).\n",
        file=out,
    )
    for label, df in tables.items():
        _print_one(df, out, label)
    if args.published_setting and is_published_setup(
        arch, kw["num_generations"], kw["prompt_length"], kw["completion_length"], kw["dtype"]
    ):
        _print_published(arch, out)
    _print_verdicts(arch, args, specs, out)
    if args.plot:
        from grpo_kit.memory.plot import plot_components  # lazy: matplotlib, for --plot only

        fig = plot_components(tables)
        fig.savefig(args.plot, dpi=120)
        print(f"\nplot written to {args.plot}", file=out)
    return 0
