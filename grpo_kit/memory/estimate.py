"""VRAM estimate of one GRPO step, by component, for TRL, Unsloth and grpo_kit; and the
reproduction of Unsloth's published Llama-3.1-8B table.

The byte counts live in :mod:`grpo_kit.memory.formulas`; this module picks which of them each
method has, where each lives (GPU / CPU), and which are alive at the same time.

When things are alive (the peak rule). One step has phases:

* persistent: weights, the inference copy, LoRA + optimiser states, gradients;
* generation: the KV cache. vLLM colocated keeps its KV pool for the whole run (``vllm=True``:
  counted at the training peak too); HF generate frees it before training (``vllm=False``: the
  generation phase is its own candidate peak);
* loss: the saved activations on the GPU + the loss's logits (+ hidden states and their
  gradient for the chunked losses);
* backward: the saved activations on the GPU + one layer's recompute peak.

The GPU total is the largest phase; ``in_peak`` marks the rows of that phase. CUDA context and
allocator fragmentation (reserved minus allocated) are not counted: compare with
``torch.cuda.max_memory_allocated``. The reference log-prob pass counts as its own
``scoring`` phase only when it scores more sequences per forward than a micro-batch (``scoring_batch``);
otherwise it (and TRL's old-policy pass) is smaller than the training step. Not modelled: vLLM's own
activations and CUDA graphs.
"""

from __future__ import annotations

import json
import math
import numbers
import os
import warnings

import pandas as pd

from grpo_kit.memory import formulas as F
from grpo_kit.memory.formulas import GB, GiB, Arch

METHODS = ("trl", "unsloth", "grpo_kit")
AUTO = "auto"  # scoring_batch / scoring_batch_size: chosen by the calculator (auto_scoring_batch)
QUANTIZATIONS = (None, "4bit")

# Unsloth's published table (blog "Long-context GRPO", 20 Feb 2025): Llama 3.1 8B, 20K context,
# num_generations = 8, "GB". Per row: (Unsloth, TRL + FA2, shown decimals, our unit that matches).
PUBLISHED = {
    "training memory": (42.0, 414.0, 0, "GB"),
    "GRPO loss (logits)": (9.8, 78.3, 1, "GiB"),
    "inference weights": (0.0, 16.0, 0, "GB"),
    "KV cache (20K)": (2.5, 2.5, 1, "GiB"),
    "total": (54.3, 510.8, 1, "mixed"),
}
PUBLISHED_SOURCE = "Unsloth blog 'Long-context GRPO' (2025-02-20): Llama 3.1 8B, 20K context, 8 generations"
PUBLISHED_SETUP = dict(model="llama-3.1-8b", num_generations=8, context=20480)


# ----------------------------------------------------------------------------- model resolution


def arch_from_config(cfg, name: str = "") -> Arch:
    """:class:`Arch` from a transformers config object (Llama / Qwen2 / Mistral style)."""
    need = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
    missing = [k for k in need if getattr(cfg, k, None) is None]
    if missing:
        raise ValueError(f"model config {name or type(cfg).__name__} lacks {missing}; "
                         "the calculator handles Llama / Qwen2 / Mistral-style decoder configs")
    heads = cfg.num_attention_heads
    model_type = getattr(cfg, "model_type", "") or ""
    return Arch(
        name=name or getattr(cfg, "name_or_path", "") or model_type,
        model_type=model_type,
        vocab=cfg.vocab_size, hidden=cfg.hidden_size, intermediate=cfg.intermediate_size,
        layers=cfg.num_hidden_layers, heads=heads,
        kv_heads=getattr(cfg, "num_key_value_heads", None) or heads,
        head_dim=getattr(cfg, "head_dim", None) or cfg.hidden_size // heads,
        tied=bool(getattr(cfg, "tie_word_embeddings", False)),
        qkv_bias=model_type == "qwen2" or bool(getattr(cfg, "attention_bias", False)),
        o_bias=model_type != "qwen2" and bool(getattr(cfg, "attention_bias", False)),
        mlp_bias=bool(getattr(cfg, "mlp_bias", False)),
    )


def _is_hub_id(name: str) -> bool:
    from grpo_kit.model.loading import check_model_name

    try:
        return check_model_name(name) == "hub"
    except ValueError:
        return False


def resolve_arch(model) -> Arch:
    """A built-in name (``grpo_kit.model.loading.BUILTIN_MODELS``), a path to a ``config.json`` (or a
    folder holding one), a hub id ``org/name`` (its config.json only, from the local hub cache or, online,
    the hub), a transformers config object, or an :class:`Arch`. Never downloads weights."""
    from grpo_kit.model.loading import BUILTIN_MODELS, model_config

    if isinstance(model, Arch):
        return model
    if isinstance(model, str):
        if model in BUILTIN_MODELS:
            return arch_from_config(model_config(model), model)
        path = os.path.join(model, "config.json") if os.path.isdir(model) else model
        if path.endswith(".json") and os.path.isfile(path):
            from transformers import AutoConfig

            with open(path) as fh:
                data = json.load(fh)
            if "model_type" not in data:
                raise ValueError(f"model={model!r}: {path} has no 'model_type'")
            cfg = AutoConfig.for_model(**data)
            return arch_from_config(cfg, os.path.basename(os.path.dirname(os.path.abspath(path))) or path)
        if _is_hub_id(model):  # its config.json only: from the local hub cache, or downloaded when online
            try:
                return arch_from_config(model_config(model), model)
            except OSError as e:
                raise ValueError(f"model={model!r}: its config.json is neither in the local hub cache nor "
                                 f"reachable ({type(e).__name__}); pass a folder or a config.json path "
                                 "instead") from None
        raise ValueError(f"model={model!r} is not a built-in name or a path to a config.json. "
                         f"Built-in names: {', '.join(BUILTIN_MODELS)}")
    if hasattr(model, "hidden_size") and hasattr(model, "num_hidden_layers"):
        return arch_from_config(model)
    raise ValueError(f"model must be a built-in name, a config.json path or a transformers config, got {type(model).__name__}")


# ----------------------------------------------------------------------------- validation


def _int_at_least(name, val, lo):
    if isinstance(val, bool) or not isinstance(val, numbers.Integral) or val < lo:
        raise ValueError(f"{name} must be an int >= {lo}, got {val!r}")
    return int(val)


def _check(num_generations, prompt_length, completion_length, dtype, lora_rank, quantization, method, vllm,
           kv_cache_dtype, micro_batch_size, loss_chunk_bytes, chunk_tokens, prefetch, generation_batch, standby,
           kv_cache_bytes):
    G = _int_at_least("num_generations", num_generations, 1)
    _int_at_least("prompt_length", prompt_length, 0)
    _int_at_least("completion_length", completion_length, 1)
    if dtype not in F.DTYPE_BYTES:
        raise ValueError(f"dtype must be one of {list(F.DTYPE_BYTES)}, got {dtype!r}")
    if method not in METHODS:
        raise ValueError(f"method must be one of {list(METHODS)}, got {method!r}")
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization must be None or '4bit', got {quantization!r}")
    if lora_rank is not None:
        _int_at_least("lora_rank", lora_rank, 1)
    if quantization is not None and lora_rank is None:
        raise ValueError(f"quantization={quantization!r} needs lora_rank: 4-bit weights are frozen, "
                         "only LoRA adapters can train on top of them")
    if not isinstance(vllm, bool):
        raise ValueError(f"vllm must be a bool, got {vllm!r}")
    if kv_cache_dtype is not None and kv_cache_dtype not in F.KV_DTYPE_BYTES:
        raise ValueError(f"kv_cache_dtype must be None (= dtype) or one of {list(F.KV_DTYPE_BYTES)}, got {kv_cache_dtype!r}")
    if micro_batch_size is not None:
        _int_at_least("micro_batch_size", micro_batch_size, 1)
    if generation_batch is not None:
        gb = _int_at_least("generation_batch", generation_batch, 1)
        if gb % G:
            raise ValueError(f"generation_batch must be a multiple of num_generations={G} (whole groups), got {gb}")
    if not isinstance(standby, bool):
        raise ValueError(f"standby must be a bool, got {standby!r}")
    if standby and not vllm:
        raise ValueError("standby=True describes a vLLM engine (vllm=True) that releases its KV cache while training")
    if kv_cache_bytes is not None and (isinstance(kv_cache_bytes, bool) or not isinstance(kv_cache_bytes, numbers.Real)
                                       or kv_cache_bytes <= 0):
        raise ValueError(f"kv_cache_bytes must be None or a number of bytes > 0, got {kv_cache_bytes!r}")
    _int_at_least("loss_chunk_bytes", loss_chunk_bytes, 1)
    if chunk_tokens is not None:
        _int_at_least("chunk_tokens", chunk_tokens, 1)
    if not isinstance(prefetch, bool):
        raise ValueError(f"prefetch must be a bool, got {prefetch!r}")


# ----------------------------------------------------------------------------- the estimate


def _is_published_setup(a: Arch, G: int, P: int, C: int, dtype: str) -> bool:
    ref = resolve_arch(PUBLISHED_SETUP["model"])
    same = (a.vocab, a.hidden, a.intermediate, a.layers, a.kv_dim) == (ref.vocab, ref.hidden, ref.intermediate,
                                                                      ref.layers, ref.kv_dim)
    return same and G == PUBLISHED_SETUP["num_generations"] and P + C == PUBLISHED_SETUP["context"] and dtype == "bf16"


def estimate(model, *, num_generations: int, prompt_length: int, completion_length: int, dtype: str = "bf16",
             lora_rank: int | None = None, quantization: str | None = None, method: str = "grpo_kit",
             vllm: bool = True, kv_cache_dtype: str | None = None, micro_batch_size: int | None = None,
             loss_chunk_bytes: int = 256 * 2**20, chunk_tokens: int | None = None, prefetch: bool = True,
             include_generation: bool = True, offload: bool | None = None, loss_fp32: bool = False,
             loss_epilogue: str = "triton", generation_batch: int | None = None, standby: bool = False,
             kv_cache_bytes: float | None = None, vllm_batched_tokens: int = 4096,
             scoring_batch: int | str | None = None, lora_dropout: bool = False,
             old_policy_pass: bool | None = None) -> pd.DataFrame:
    """Estimated memory of one GRPO step, one row per component, plus GPU and CPU totals.

    Args:
        model: built-in name, path to a ``config.json``, or a transformers config (no weights).
        num_generations: completions per prompt (G); all are trained on in one step.
        prompt_length / completion_length: tokens; a sequence is P + C tokens. ``prompt_length=0``
            counts the whole context as completion (as the published table does).
        dtype: ``"bf16" | "fp16" | "fp32"``, weights and activations.
        lora_rank: LoRA on all 7 linear layers (None: full fine-tuning).
        quantization: None or ``"4bit"`` (NF4 weights; needs ``lora_rank``).
        method: ``"trl"`` (TRL + FA2: full logits, standard checkpointing, separate vLLM copy),
            ``"unsloth"`` (Feb 2025 design: one sequence of logits at a time, offloaded
            checkpoints, weights shared with vLLM), ``"grpo_kit"`` (chunked loss, offloaded and
            chunked recompute, shared weights).
        vllm: generation by colocated vLLM (its KV pool stays resident) or by HF generate.
        kv_cache_dtype: ``None`` (= dtype) or ``"fp8"`` etc.
        micro_batch_size: sequences per forward/backward (None: all G at once, as published).
        generation_batch: completions per generation call, whole groups of G (None: the larger of G and
            the micro-batch); vLLM's KV cache holds all of them at once, HF generate pads each to P + C.
        loss_chunk_bytes: grpo_kit's logits chunk budget (``grpo_kit.loss.efficient``: 256 MiB).
        chunk_tokens / prefetch: grpo_kit's checkpointing slice size (None: its automatic rule,
            :func:`formulas.auto_chunk_tokens`) and prefetch of the next layer input.
        include_generation: False leaves out the KV cache (a training step alone, as the
            whole-step benchmark measures it).
        offload: None: the method's own choice (unsloth, grpo_kit: layer inputs to CPU; trl: no);
            False: every layer input stays on the GPU (e.g. grpo_kit's recompute without offload).
        loss_fp32: ``trl`` only: the full logits are upcast to fp32 before the log-softmax (HF
            style; the whole-step benchmark's baseline). At the loss backward the fp32 saved
            output, its incoming gradient and the input gradient coexist: 3 x 4 B per logit,
            instead of TRL's bf16 path (2 x 2 B, as published).
        loss_epilogue: grpo_kit's loss epilogue, ``"triton"`` (CUDA, in place) or ``"torch"``
            (CPU: the chunk budget counts three fp32 temporaries per logit; two exist at a time).
        standby: vLLM releases its KV cache while training runs and keeps the (shared) weights
            (:mod:`grpo_kit.generation.standby`): the KV cache then counts in the generation phase only.
        kv_cache_bytes: the KV cache vLLM is given (None: what the generation batch needs,
            :func:`formulas.vllm_kv_tokens`).
        vllm_batched_tokens: vLLM's ``max_num_batched_tokens`` (its workspace row).
        scoring_batch: ``grpo_kit`` only: sequences per no-grad forward that scores completions (the
            reference and old-policy log-probs; ``scoring_batch_size``), at most the generation batch. None, or
            at most the micro-batch: that pass is smaller than the training step and not counted; more adds a
            ``scoring`` phase (priced sliced, as with LoRA dropout off). ``"auto"``: the largest that does not
            raise the step's peak (:func:`auto_scoring_batch`); None for the other methods, which score by micro-batch.
        lora_dropout: LoRA dropout above 0 (needs ``lora_rank``): every adapted linear saves its own dropped input
            and a mask (:func:`formulas.layer_saved_terms`), and grpo_kit's checkpointing runs such layers whole,
            in the recompute and in no-grad passes (their random masks cannot be split into slices).
        old_policy_pass: ``grpo_kit`` with LoRA: TRL's old-policy log-prob pass runs too (adapters on, which costs
            more than the reference pass: :func:`formulas.scoring_forward_peak`), as it does under vLLM's
            importance-sampling correction or with ``num_iterations`` > 1. None: when ``vllm``.

    Phases: ``generation`` (weights, LoRA states, the KV cache, vLLM's workspace), ``loss`` and
    ``backward`` (training), and ``scoring`` where ``scoring_batch`` exceeds the micro-batch; the GPU
    total is the largest.

    Returns:
        DataFrame with columns ``component, where, GB, GiB, in_peak, published, note``; the last
        two rows are ``total GPU (peak)`` and ``total CPU``. ``published`` holds Unsloth's
        published figure for the same component when the setup is the published one (for
        ``grpo_kit``: Unsloth's column, the figure to beat), NaN otherwise. ``df.attrs`` holds the
        inputs, the peak phase and the per-phase GPU totals (bytes).
    """
    if scoring_batch == AUTO:
        args = {k: v for k, v in locals().items() if k not in ("model", "scoring_batch")}
        return auto_scoring_batch(model, **args)
    _check(num_generations, prompt_length, completion_length, dtype, lora_rank, quantization, method, vllm,
           kv_cache_dtype, micro_batch_size, loss_chunk_bytes, chunk_tokens, prefetch, generation_batch, standby,
           kv_cache_bytes)
    _int_at_least("vllm_batched_tokens", vllm_batched_tokens, 1)
    for name, val in (("include_generation", include_generation), ("loss_fp32", loss_fp32),
                      ("lora_dropout", lora_dropout)):
        if not isinstance(val, bool):
            raise ValueError(f"{name} must be a bool, got {val!r}")
    if offload is not None and not isinstance(offload, bool):
        raise ValueError(f"offload must be None or a bool, got {offload!r}")
    if offload and method == "trl":
        raise ValueError("offload=True is not available with method='trl' (TRL has no offloaded checkpointing)")
    if loss_epilogue not in ("triton", "torch"):
        raise ValueError(f"loss_epilogue must be 'triton' or 'torch', got {loss_epilogue!r}")
    if loss_fp32 and method != "trl":
        raise ValueError(f"loss_fp32 applies to method='trl' only (full logits), got method={method!r}")
    if old_policy_pass is not None and not isinstance(old_policy_pass, bool):
        raise ValueError(f"old_policy_pass must be None or a bool, got {old_policy_pass!r}")
    if lora_dropout and lora_rank is None:
        raise ValueError("lora_dropout=True needs lora_rank (LoRA dropout acts on the adapters)")
    if scoring_batch is not None:
        if isinstance(scoring_batch, str):
            raise ValueError(f"scoring_batch must be None, {AUTO!r} or an integer >= 1, got {scoring_batch!r}")
        _int_at_least("scoring_batch", scoring_batch, 1)
        if method != "grpo_kit":
            raise ValueError(f"scoring_batch applies to method='grpo_kit' only (the kit trainer's scoring_batch_size), "
                             f"got method={method!r}")
    a = resolve_arch(model)
    G, P, C = int(num_generations), int(prompt_length), int(completion_length)
    T = P + C
    M = G if micro_batch_size is None else int(micro_batch_size)
    gen_rows = int(generation_batch) if generation_batch is not None else -(-max(G, M) // G) * G
    b = F.DTYPE_BYTES[dtype]
    kv_b = F.KV_DTYPE_BYTES[kv_cache_dtype or dtype]
    lora = lora_rank is not None
    offload = method in ("unsloth", "grpo_kit") if offload is None else offload
    tokens = M * T
    n = F.param_counts(a)
    # TRL scores one generation batch at a time, so no forward holds more of it than that
    S = None if scoring_batch is None else min(int(scoring_batch), gen_rows)
    scoring = S is not None and S > M  # its own phase: larger than the micro-batch's pass
    scoring_phase = ("scoring",) if scoring else ()
    # TRL's old-policy pass (adapters on) runs beside the reference pass; only LoRA makes the two differ
    old_policy = lora and (vllm if old_policy_pass is None else old_policy_pass)
    step_phases = ("generation", "loss", "backward") + scoring_phase

    rows: list[dict] = []

    def add(component, where, nbytes, phases, note):
        rows.append(dict(component=component, where=where, bytes=float(nbytes), phases=phases, note=note))

    persistent = step_phases
    w = F.weight_bytes(a, b, quantization)
    add("model weights", "GPU", w, persistent,
        f"{n['total'] / 1e9:.2f}e9 params" + (" (layer projections NF4 4.127 bit)" if quantization else f" x {b} B"))
    if vllm and method == "trl":
        add("inference copy (vLLM)", "GPU", w, persistent, "TRL colocate: vLLM loads its own copy of the weights")
    else:
        add("inference copy (vLLM)", "GPU", 0, persistent,
            "weights shared with vLLM" if vllm else "HF generate uses the training weights")
    if lora:
        n_lora = F.lora_param_count(a, lora_rank)
        add("LoRA + optimiser states", "GPU", F.lora_state_bytes(n_lora), persistent,
            f"{n_lora / 1e6:.1f}M adapter params x (4 B fp32 weight + 8 B AdamW)")
        add("gradients", "GPU", n_lora * F.FP32, ("loss", "backward"), "fp32 LoRA gradients")
    else:
        add("LoRA + optimiser states", "GPU", F.full_optimizer_bytes(n["total"], b), persistent,
            f"full fine-tuning: AdamW exp_avg + exp_avg_sq, 2 x {b} B per parameter")
        add("gradients", "GPU", n["total"] * b, ("loss", "backward"), f"full fine-tuning: {b} B per parameter")

    if offload and a.layers > 1:
        add("saved activations (GPU)", "GPU", F.checkpoint_bytes(a, tokens, b, 1), ("loss", "backward"),
            f"last layer's input stays on the GPU: {M} seq x {T} tok x {a.hidden} x {b} B")
        add("saved activations (CPU)", "CPU", F.checkpoint_bytes(a, tokens, b, a.layers - 1), (),
            f"{a.layers - 1} layer inputs offloaded to pinned host RAM")
    else:
        add("saved activations (GPU)", "GPU", F.checkpoint_bytes(a, tokens, b, a.layers), ("loss", "backward"),
            f"standard checkpointing: {a.layers} layer inputs of {M} seq x {T} tok x {a.hidden} x {b} B")
        add("saved activations (CPU)", "CPU", 0, (), "nothing offloaded")

    # The layer being recomputed uses its own input (counted above: the last layer's, or one
    # brought back in its place); grpo_kit's prefetch adds the next one.
    extra_in = 1 if (method == "grpo_kit" and offload and prefetch and a.layers > 1) else 0
    if method == "grpo_kit":
        chunk_tokens = F.auto_chunk_tokens(a) if chunk_tokens is None else int(chunk_tokens)
    if method == "grpo_kit" and not lora_dropout:
        rec = F.chunked_recompute_peak(a, tokens, b, lora_rank, extra_in, chunk_tokens)
        rec_note = (f"chunked recompute ({chunk_tokens}-token slices): q/k/v, attention output + grad, hidden grads"
                    + (", next layer's input prefetched" if extra_in else ""))
    else:
        rec = F.full_recompute_peak(a, tokens, b, lora_rank, extra_in, lora_dropout)
        rec_note = ("whole layer recomputed with grad: all its saved activations + MLP backward grads + hidden grads"
                    + (" (LoRA dropout: its masks cannot be split into slices)" if method == "grpo_kit" else "")
                    + (", dropout masks and each adapter's own dropped input" if lora_dropout else ""))
    add("recompute peak of one layer", "GPU", rec, ("backward",), rec_note)
    if quantization == "4bit" and method == "grpo_kit":  # grpo_kit.model.nf4_matmul: a layer's weights kept per call
        layer = sum(i * o for _, i, o in a.layer_linears())
        add("dequantised 4-bit weights of one layer", "GPU", layer * b, ("backward",) + scoring_phase,
            f"the running layer's {len(a.layer_linears())} projections ({layer / 1e6:.0f}M weights) dequantised to "
            f"{b} B each, kept for its recompute and backward (grpo_kit.model.nf4_matmul)")
    elif quantization == "4bit":  # bitsandbytes dequantises one weight per matmul, forward and backward
        add("dequantised 4-bit weight (transient)", "GPU", a.intermediate * a.hidden * b, ("loss", "backward"),
            f"the largest projection ({a.intermediate} x {a.hidden}) dequantised to {b} B per weight for its matmul")

    norm = F.final_norm_bytes(a, tokens, b, not lora)
    if method == "trl":
        if loss_fp32:
            add("logits for the loss", "GPU", F.logits_bytes(3, M, C, a.vocab, F.FP32), ("loss",),
                f"3 x ({M} seq, {C} tok, {a.vocab} vocab) x 4 B: fp32 log-softmax output, its gradient and the "
                "input gradient at the loss backward")
        else:
            add("logits for the loss", "GPU", F.logits_bytes(2, M, C, a.vocab, b), ("loss",),
                f"2 x ({M} seq, {C} tok, {a.vocab} vocab) x {b} B: logits + log-softmax saved for backward")
        add("final norm + hidden states (loss)", "GPU", norm, ("loss",),
            "final RMSNorm's saved fp32 input; the head's gradient is built in backward")
    else:
        if method == "unsloth":
            logit = F.logits_bytes(2, 1, C, a.vocab, b)
            lnote = f"one sequence at a time: 2 x ({C} tok, {a.vocab} vocab) x {b} B"
        else:
            # the torch epilogue budgets three fp32 temporaries per logit; two exist at a time
            budget_elt, per_elt = (b + 3 * F.FP32, b + 2 * F.FP32) if loss_epilogue == "torch" else (b, b)
            rows_c = min(F.loss_chunk_rows(a.vocab, budget_elt, loss_chunk_bytes), M * C)
            logit = rows_c * a.vocab * per_elt
            lnote = f"one chunk of {rows_c} token rows x {a.vocab} vocab x {per_elt} B"
        add("logits for the loss", "GPU", logit, ("loss",), lnote)
        add("final norm + hidden states (loss)", "GPU", norm + tokens * a.hidden * b + M * C * a.hidden * b,
            ("loss",), "final RMSNorm's fp32 input, the final hidden states and their gradient (computed in the "
            "forward, completion tokens)")
    if scoring:  # grpo_kit only: chunk_tokens is resolved above
        rows_s = min(F.loss_chunk_rows(a.vocab, budget_elt, loss_chunk_bytes), S * C)  # per_token_logps' chunk
        slice_tokens = None if lora_dropout else chunk_tokens  # dropout: each layer runs whole
        add("scoring pass (no grad)", "GPU",
            F.scoring_forward_peak(a, S, T, b, slice_tokens, rows_s * a.vocab * per_elt, old_policy), ("scoring",),
            f"{S} sequences per no-grad forward (" + ("old-policy log-probs, adapters on, the larger of its two "
                                                      "passes" if old_policy else "reference log-probs")
            + "): embeddings, a layer's input and output, its attention or "
            + (f"one {chunk_tokens}-token MLP slice" if slice_tokens else "its whole MLP (LoRA dropout: unsliced)")
            + f", and one logits chunk of {rows_s} rows")

    kv_what = f"{a.layers} layers x 2 x {a.kv_dim} x {kv_b} B per token"
    prompts = gen_rows // G
    if not include_generation:
        add("KV cache (generation)", "GPU", 0, (), "not counted: training step only")
    elif vllm:
        slots = F.vllm_kv_tokens(P, C, G, prompts)
        kv = F.kv_cache_bytes(a, slots, kv_b) if kv_cache_bytes is None else float(kv_cache_bytes)
        how = (f"{prompts} prompt(s) once (prefix cache) + {G} completions each, {slots} slots in "
               f"{F.VLLM_BLOCK_TOKENS}-token blocks" if kv_cache_bytes is None else "the KV budget given")
        add("KV cache (generation)", "GPU", kv, ("generation",) if standby else persistent,
            f"vLLM: {how}; {kv_what}; " + ("released while training (standby)" if standby else "stays resident"))
        add("vLLM workspace (generation)", "GPU", F.vllm_workspace_bytes(a, vllm_batched_tokens, gen_rows, b),
            ("generation",), f"one layer's activations for {vllm_batched_tokens} batched tokens + fp32 sampler "
            f"buffers for {gen_rows} rows")
    else:
        add("KV cache (generation)", "GPU", F.kv_cache_bytes(a, gen_rows * T, kv_b), ("generation",),
            f"HF generate, {gen_rows} sequences; {kv_what}; freed before training")

    # peak phase
    phase_tot = {ph: sum(r["bytes"] for r in rows if r["where"] == "GPU" and ph in r["phases"])
                 for ph in step_phases}
    peak_phase = max(phase_tot, key=lambda k: (phase_tot[k], k == "backward"))
    for r in rows:
        r["in_peak"] = r["where"] == "GPU" and peak_phase in r["phases"] and r["bytes"] > 0

    published = (_is_published_setup(a, G, P, C, dtype) and not loss_fp32
                 and offload == (method in ("unsloth", "grpo_kit")))
    pub_map = {"saved activations (GPU)": "training memory", "logits for the loss": "GRPO loss (logits)",
               "inference copy (vLLM)": "inference weights", "KV cache (generation)": "KV cache (20K)"}
    if method == "unsloth" or method == "grpo_kit":
        pub_map["saved activations (CPU)"] = "training memory"
        del pub_map["saved activations (GPU)"]
    col = 1 if method == "trl" else 0
    pub_notes = {
        ("trl", "training memory"): "published 414 GB 'training memory': no published derivation (shown, not derived)",
        ("unsloth", "training memory"): "published 42 GB 'training memory' is counted in Unsloth's VRAM total; "
                                        "one bf16 checkpoint per layer is 42.9 GB",
        ("grpo_kit", "training memory"): "Unsloth's published 42 GB 'training memory' (counted in its VRAM total)",
        ("any", "KV cache (20K)"): "published 2.5 (GiB) counts one 20,480-token sequence",
        ("any", "GRPO loss (logits)"): "published figure is in GiB",
    }
    for r in rows:
        key = pub_map.get(r["component"])
        r["published"] = PUBLISHED[key][col] if (published and key) else math.nan
        extra = (pub_notes.get((method, key)) or pub_notes.get(("any", key))) if (published and key) else None
        if extra:
            r["note"] += f" | {extra}"

    gpu = phase_tot[peak_phase]
    cpu = sum(r["bytes"] for r in rows if r["where"] == "CPU")
    rows.append(dict(component="total GPU (peak)", where="GPU", bytes=gpu, phases=(), in_peak=True,
                     published=PUBLISHED["total"][col] if published else math.nan,
                     note=f"peak during the {peak_phase} phase; excludes CUDA context and fragmentation"))
    rows.append(dict(component="total CPU", where="CPU", bytes=cpu, phases=(), in_peak=False, published=math.nan,
                     note="pinned host RAM for offloaded layer inputs"))
    df = pd.DataFrame(rows)
    df["GB"] = df["bytes"] / GB
    df["GiB"] = df["bytes"] / GiB
    df = df[["component", "where", "GB", "GiB", "in_peak", "published", "note"]]
    df.attrs.update(dict(model=a.name, method=method, num_generations=G, prompt_length=P, completion_length=C,
                         micro_batch_size=M, dtype=dtype, lora_rank=lora_rank, quantization=quantization, vllm=vllm,
                         kv_cache_dtype=kv_cache_dtype or dtype, include_generation=include_generation,
                         generation_batch=gen_rows, standby=standby, scoring_batch=S, lora_dropout=lora_dropout,
                         old_policy_pass=bool(old_policy),
                         offload=offload, loss_fp32=loss_fp32, loss_epilogue=loss_epilogue,
                         peak_phase=peak_phase,
                         phase_bytes=phase_tot, published_source=PUBLISHED_SOURCE if published else None))
    return df


def auto_scoring_batch(model, **kwargs) -> pd.DataFrame:
    """:func:`estimate` (same arguments, ``scoring_batch`` aside) with the largest ``scoring_batch`` whose
    ``scoring`` phase stays within the largest of the step's other phases: fuller no-grad forwards (with 4-bit
    weights, fewer dequantisations) at no cost to the peak. The scoring phase grows with the batch, so a
    bisection between one micro-batch and one generation batch finds it. Where none fits, or the method is not
    ``grpo_kit`` (TRL and Unsloth score by micro-batch), the estimate without one (``scoring_batch=None``).
    ``df.attrs["scoring_batch"]`` holds the choice and ``df.attrs["scoring_batch_auto"]`` is True."""
    base = estimate(model, **kwargs, scoring_batch=None)
    best, low, high = base, base.attrs["micro_batch_size"] + 1, base.attrs["generation_batch"]
    while kwargs.get("method", "grpo_kit") == "grpo_kit" and low <= high:
        mid = (low + high) // 2
        df = estimate(model, **kwargs, scoring_batch=mid)
        phases = df.attrs["phase_bytes"]
        if phases["scoring"] <= max(v for k, v in phases.items() if k != "scoring"):
            best, low = df, mid + 1
        else:
            high = mid - 1
    best.attrs["scoring_batch_auto"] = True
    return best


def estimate_for_config(cfg, model=None, **overrides) -> pd.DataFrame:
    """:func:`estimate` for a ``GRPOKitConfig``: its generations, prompt/completion lengths, dtype,
    LoRA rank, trainer (``trl`` or ``grpo_kit`` method), backend and micro-batch. ``model``: a
    config or name (default ``cfg.model``); ``overrides`` replace any of the derived arguments."""
    return estimate(model if model is not None else cfg.model, **config_estimate_kwargs(cfg, **overrides))


def scoring_batch_for_config(cfg, model=None, **overrides) -> int | None:
    """``cfg.scoring_batch_size`` as the trainer takes it: the number or null as set, or for ``auto`` the
    calculator's choice for the config's step (:func:`auto_scoring_batch`; ``overrides`` as in
    :func:`estimate_for_config`, e.g. the generation plan's pricing). None with ``trainer='trl'``, and (with a
    warning) for an architecture the calculator cannot price."""
    if cfg.scoring_batch_size != AUTO:
        return cfg.scoring_batch_size
    try:
        return estimate_for_config(cfg, model, **overrides).attrs["scoring_batch"]
    except ValueError as e:  # an architecture resolve_arch does not know: score as TRL does
        warnings.warn(f"scoring_batch_size='auto': the VRAM calculator cannot price this model ({e}); scoring "
                      "per_device_train_batch_size sequences per forward", stacklevel=2)
        return None


def config_estimate_kwargs(cfg, **overrides) -> dict:
    """The :func:`estimate` arguments (all but the model) that describe a ``GRPOKitConfig``'s step."""
    kw = dict(num_generations=cfg.num_generations, prompt_length=cfg.max_prompt_length,
              completion_length=cfg.max_completion_length,
              dtype={"fp32": "fp32", "fp16": "fp16"}.get(cfg.dtype, "bf16"),
              lora_rank=cfg.lora_rank if cfg.use_lora else None, quantization="4bit" if cfg.load_in_4bit else None,
              method="trl" if cfg.trainer == "trl" else "grpo_kit", vllm=cfg.generation_backend == "vllm",
              kv_cache_dtype="fp8" if cfg.kv_cache_dtype == "fp8" else None,
              micro_batch_size=cfg.per_device_train_batch_size,
              generation_batch=cfg.per_device_train_batch_size * cfg.gradient_accumulation_steps,
              scoring_batch=None if cfg.trainer == "trl" else cfg.scoring_batch_size,
              lora_dropout=bool(cfg.use_lora and cfg.lora_dropout),
              old_policy_pass=True if cfg.num_iterations > 1 else None)  # else: with vLLM's sampling correction
    kw.update(overrides)
    return kw


def total_gpu_bytes(df: pd.DataFrame) -> float:
    """The ``total GPU (peak)`` of an :func:`estimate` table, in bytes."""
    return float(df.loc[df["component"] == "total GPU (peak)", "GB"].iloc[0] * GB)


def compare(model, *, methods=METHODS, unit: str = "GB", **kwargs) -> pd.DataFrame:
    """One column per method (``unit`` GB or GiB), rows as in :func:`estimate`."""
    if unit not in ("GB", "GiB"):
        raise ValueError(f"unit must be 'GB' or 'GiB', got {unit!r}")
    bad = [m for m in methods if m not in METHODS]
    if bad or not methods:
        raise ValueError(f"methods must be a non-empty subset of {list(METHODS)}, got {list(methods)!r}")
    cols = {}
    for m in methods:
        df = estimate(model, method=m, **kwargs)
        cols[m] = df.set_index("component")[unit]
    return pd.DataFrame(cols)


# ----------------------------------------------------------------------------- published table


def published_table(model="llama-3.1-8b") -> pd.DataFrame:
    """Unsloth's published table (Llama 3.1 8B, 20K = 20,480 tokens, 8 generations) beside our
    derivation of each figure, rounded to the decimals shown.

    Derivations (bytes; unit of the published figure in brackets):

    * GRPO loss (logits) [GiB]: TRL 2 tensors (policy + reference) x 2 B x 8 x 20,480 x V;
      Unsloth the same for one generation at a time (÷ 8).
    * KV cache (20K) [GiB]: 2 (K, V) x 2 B x L x 20,480 x kv, one sequence.
    * inference weights [GB]: TRL a second bf16 copy, params x 2 B; Unsloth 0 (shared).
    * training memory [GB]: Unsloth one bf16 checkpoint per layer, 2 B x L x 8 x 20,480 x h
      = 42.9 GB (40.0 GiB); the published 42 is not reproduced to the unit (31 layers, the last
      one kept on the GPU, would give 41.6; a 20,000-token context 41.9; the source says neither).
      TRL's 414 has no published derivation: shown as published, not derived.
    * total: the published totals are the sums of the four rows as shown.

    Columns: ``unsloth_published, unsloth_derived, unsloth_status, trl_published, trl_derived,
    trl_status, unit, derivation``. Status: ``exact`` (derived rounds to the published figure),
    ``approx``, ``published, not derived``.
    """
    a = resolve_arch(model)
    T, G, b = PUBLISHED_SETUP["context"], PUBLISHED_SETUP["num_generations"], 2
    n = F.param_counts(a)["total"]
    derived = {
        "training memory": (F.checkpoint_bytes(a, G * T, b, a.layers) / GB, math.nan),
        "GRPO loss (logits)": (F.logits_bytes(2, 1, T, a.vocab, b) / GiB, F.logits_bytes(2, G, T, a.vocab, b) / GiB),
        "inference weights": (0.0, n * b / GB),
        "KV cache (20K)": (F.kv_cache_bytes(a, T, b) / GiB, F.kv_cache_bytes(a, T, b) / GiB),
    }
    how = {
        "training memory": f"Unsloth: 2 B x {a.layers} layers x {G} x {T} x {a.hidden} (GB); TRL: no published derivation",
        "GRPO loss (logits)": f"2 tensors x 2 B x ({G} | 1) seq x {T} x {a.vocab} (GiB)",
        "inference weights": f"{n / 1e9:.2f}e9 params x 2 B (GB); 0 when shared",
        "KV cache (20K)": f"2 x 2 B x {a.layers} layers x {T} x {a.kv_dim}, one sequence (GiB)",
        "total": "sum of the four rows as shown",
    }
    rows = []
    sums = [0.0, 0.0]
    for comp, (u_pub, t_pub, dec, unit) in PUBLISHED.items():
        row = dict(component=comp, unit=unit, derivation=how[comp])
        for i, (who, pub) in enumerate((("unsloth", u_pub), ("trl", t_pub))):
            if comp == "total":
                val = round(sums[i], dec)
                status = "exact" if val == pub else "approx"
            else:
                d = derived[comp][i]
                if math.isnan(d):
                    val, status = pub, "published, not derived"
                else:
                    # shown like the published figure, one more decimal when it does not round to it
                    val = round(d, dec)
                    status = "exact" if val == pub else "approx"
                    if status == "approx":
                        val = round(d, dec + 1)
                sums[i] += val
            row[f"{who}_published"] = pub
            row[f"{who}_derived"] = val
            row[f"{who}_status"] = status
        rows.append(row)
    cols = ["component", "unsloth_published", "unsloth_derived", "unsloth_status", "trl_published", "trl_derived",
            "trl_status", "unit", "derivation"]
    df = pd.DataFrame(rows)[cols]
    df.attrs["source"] = PUBLISHED_SOURCE
    return df
