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

Prefix sharing (``prefix_sharing``, ``grpo_kit`` only: each group's prompt scored once, :mod:`grpo_kit.model.prefix`):
a training forward runs ``ceil(micro_batch / G)`` prompts and every row's completion (saved activations, final
norm, recompute), holds those prompts' keys and values of every layer through the loss and backward, and its
completions' layers read them expanded to each row (with their gradient in backward); the scoring pass runs one
group at a time. vLLM's KV cache holds each prompt once (its prefix cache) with or without it; so does the price.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import os
import warnings
from dataclasses import dataclass

import pandas as pd
import torch
from transformers import AutoConfig

from grpo_kit.loss.efficient import auto_chunk_rows
from grpo_kit.memory import formulas as F
from grpo_kit.memory.formulas import GB, Arch, GiB
from grpo_kit.memory.spec import StepSpec
from grpo_kit.model.anatomy import num_experts
from grpo_kit.model.loading import BUILTIN_MODELS, check_model_name, meta_model, model_config
from grpo_kit.readers.bounded import read_json

# The training dtypes (formulas.DTYPE_BYTES) as torch names them, for the loss's own chunk rule
_TORCH_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}

METHODS = ("trl", "unsloth", "grpo_kit")
AUTO = "auto"  # scoring_batch / scoring_batch_size: chosen by the calculator (auto_scoring_batch)
SCORING_BOUND_PHASES = ("loss", "backward")  # what an auto scoring batch stays within beside a vLLM engine
QUANTIZATIONS = (None, "4bit", "fp8")  # the base weights: 16-bit, NF4 (load_in_4bit), FP8 (base_weights)

# Unsloth's published table (blog "Long-context GRPO", PUBLISHED_SOURCE below): Llama 3.1 8B, 20K context,
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
    """:class:`Arch` from a transformers config object of a decoder family (its text config for a multimodal
    one); a mixture of experts is priced with all its experts' weights and its active experts' activations."""
    cfg = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    need = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
    missing = [k for k in need if getattr(cfg, k, None) is None]
    if missing:
        raise ValueError(
            f"model config {name or type(cfg).__name__} lacks {missing}; "
            "the calculator handles decoder configs with these numbers"
        )
    heads = cfg.num_attention_heads
    model_type = getattr(cfg, "model_type", "") or ""
    experts = num_experts(cfg)
    moe = {}
    if experts:
        width = getattr(cfg, "moe_intermediate_size", None) or cfg.intermediate_size
        active = int(cfg.num_experts_per_tok)
        moe = dict(
            experts=experts,
            active_experts=active,
            expert_intermediate=width,
            intermediate=active * width,
            expert_bias=model_type == "gpt_oss",
        )
    arch = Arch(
        name=name or getattr(cfg, "name_or_path", "") or model_type,
        model_type=model_type,
        vocab=cfg.vocab_size,
        hidden=cfg.hidden_size,
        intermediate=cfg.intermediate_size,
        layers=cfg.num_hidden_layers,
        heads=heads,
        kv_heads=getattr(cfg, "num_key_value_heads", None) or heads,
        head_dim=getattr(cfg, "head_dim", None) or cfg.hidden_size // heads,
        tied=bool(getattr(cfg, "tie_word_embeddings", False)),
        qkv_bias=model_type == "qwen2" or bool(getattr(cfg, "attention_bias", False)),
        o_bias=model_type != "qwen2" and bool(getattr(cfg, "attention_bias", False)),
        mlp_bias=bool(getattr(cfg, "mlp_bias", False)),
    )
    arch = dataclasses.replace(arch, **moe) if moe else arch
    return dataclasses.replace(arch, extra_params=_unnamed_params(cfg, F.param_counts(arch)["total"]))


_META_PARAMS: dict[str, int | None] = {}  # a config's JSON text -> its meta-device build's parameter count


def _meta_params(cfg) -> int | None:
    key = cfg.to_json_string(use_diff=False)
    if key not in _META_PARAMS:
        try:
            _META_PARAMS[key] = sum(p.numel() for p in meta_model(cfg).parameters())
        except Exception:  # noqa: BLE001 - a config transformers cannot build: the formulas' count stands
            _META_PARAMS[key] = None
    return _META_PARAMS[key]


def _unnamed_params(cfg, named: int) -> int:
    """Parameters of ``cfg``'s model that the formulas do not name (QK-norms, a family's further norms, attention
    sinks): its meta-device build's count less ``named``; 0 where it cannot be built or counts fewer."""
    if not hasattr(cfg, "to_json_string"):
        return 0
    total = _meta_params(cfg)
    return max(0, total - named) if total is not None else 0


def _is_hub_id(name: str) -> bool:
    try:
        return check_model_name(name) == "hub"
    except ValueError:
        return False


def resolve_arch(model) -> Arch:
    """A built-in name (``grpo_kit.model.loading.BUILTIN_MODELS``), a path to a ``config.json`` (or a
    folder holding one), a hub id ``org/name`` (its config.json only, from the local hub cache or, online,
    the hub), a transformers config object, or an :class:`Arch`. Never downloads weights."""
    if isinstance(model, Arch):
        return model
    if isinstance(model, str):
        if model in BUILTIN_MODELS:
            return arch_from_config(model_config(model), model)
        path = os.path.join(model, "config.json") if os.path.isdir(model) else model
        if path.endswith(".json") and os.path.isfile(path):
            data = read_json(path)
            if "model_type" not in data:
                raise ValueError(f"model={model!r}: {path} has no 'model_type'")
            cfg = AutoConfig.for_model(**data)
            return arch_from_config(cfg, os.path.basename(os.path.dirname(os.path.abspath(path))) or path)
        if _is_hub_id(model):  # its config.json only: from the local hub cache, or downloaded when online
            try:
                return arch_from_config(model_config(model), model)
            except OSError as e:
                raise ValueError(
                    f"model={model!r}: its config.json is neither in the local hub cache nor "
                    f"reachable ({type(e).__name__}); pass a folder or a config.json path "
                    "instead"
                ) from None
        raise ValueError(
            f"model={model!r} is not a built-in name or a path to a config.json. "
            f"Built-in names: {', '.join(BUILTIN_MODELS)}"
        )
    if hasattr(model, "hidden_size") and hasattr(model, "num_hidden_layers"):
        return arch_from_config(model)
    raise ValueError(
        f"model must be a built-in name, a config.json path or a transformers config, got {type(model).__name__}"
    )


# ----------------------------------------------------------------------------- validation


def _int_at_least(name, val, lo):
    if isinstance(val, bool) or not isinstance(val, numbers.Integral) or val < lo:
        raise ValueError(f"{name} must be an int >= {lo}, got {val!r}")
    return int(val)


def _check_bool(name, val, none_ok=False):
    if not (isinstance(val, bool) or (none_ok and val is None)):
        raise ValueError(f"{name} must be {'None or ' if none_ok else ''}a bool, got {val!r}")


def _check_sizes(spec: EstimateSpec) -> None:
    """The step's sizes, types and storage formats (one clear ValueError each)."""
    G = _int_at_least("num_generations", spec.num_generations, 1)
    _int_at_least("prompt_length", spec.prompt_length, 0)
    _int_at_least("completion_length", spec.completion_length, 1)
    _int_at_least("tool_turns", spec.tool_turns, 0)
    _int_at_least("tool_result_tokens", spec.tool_result_tokens, 0)
    dtype, method, quantization, lora_rank = spec.dtype, spec.method, spec.quantization, spec.lora_rank
    if dtype not in F.DTYPE_BYTES:
        raise ValueError(f"dtype must be one of {list(F.DTYPE_BYTES)}, got {dtype!r}")
    if method not in METHODS:
        raise ValueError(f"method must be one of {list(METHODS)}, got {method!r}")
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {list(QUANTIZATIONS)}, got {quantization!r}")
    if lora_rank is not None:
        _int_at_least("lora_rank", lora_rank, 1)
    if quantization is not None and lora_rank is None:
        raise ValueError(
            f"quantization={quantization!r} needs lora_rank: quantised weights are frozen, "
            "only LoRA adapters can train on top of them"
        )
    _check_bool("vllm", spec.vllm)
    kv_cache_dtype = spec.kv_cache_dtype
    if kv_cache_dtype is not None and kv_cache_dtype not in F.KV_DTYPE_BYTES:
        raise ValueError(
            f"kv_cache_dtype must be None (= dtype) or one of {list(F.KV_DTYPE_BYTES)}, got {kv_cache_dtype!r}"
        )
    if spec.micro_batch_size is not None:
        _int_at_least("micro_batch_size", spec.micro_batch_size, 1)
    if spec.generation_batch is not None:
        gb = _int_at_least("generation_batch", spec.generation_batch, 1)
        if gb % G:
            raise ValueError(f"generation_batch must be a multiple of num_generations={G} (whole groups), got {gb}")
    _check_bool("standby", spec.standby)
    if spec.standby and not spec.vllm:
        raise ValueError("standby=True describes a vLLM engine (vllm=True) that releases its KV cache while training")
    kv_cache_bytes = spec.kv_cache_bytes
    if kv_cache_bytes is not None and (
        isinstance(kv_cache_bytes, bool) or not isinstance(kv_cache_bytes, numbers.Real) or kv_cache_bytes <= 0
    ):
        raise ValueError(f"kv_cache_bytes must be None or a number of bytes > 0, got {kv_cache_bytes!r}")


def _check_options(spec: EstimateSpec) -> None:
    """The switches of each method's training step, and which methods they apply to."""
    method = spec.method
    if spec.chunk_tokens is not None:
        _int_at_least("chunk_tokens", spec.chunk_tokens, 1)
    _check_bool("prefetch", spec.prefetch)
    _int_at_least("vllm_batched_tokens", spec.vllm_batched_tokens, 1)
    for name in ("include_generation", "loss_fp32", "lora_dropout"):
        _check_bool(name, getattr(spec, name))
    _check_bool("offload", spec.offload, none_ok=True)
    if spec.offload and method == "trl":
        raise ValueError("offload=True is not available with method='trl' (TRL has no offloaded checkpointing)")
    if spec.loss_epilogue not in ("triton", "torch"):
        raise ValueError(f"loss_epilogue must be 'triton' or 'torch', got {spec.loss_epilogue!r}")
    if spec.loss_fp32 and method != "trl":
        raise ValueError(f"loss_fp32 applies to method='trl' only (full logits), got method={method!r}")
    _check_bool("old_policy_pass", spec.old_policy_pass, none_ok=True)
    _check_bool("prefix_sharing", spec.prefix_sharing)
    if spec.prefix_sharing and method != "grpo_kit":
        raise ValueError(
            f"prefix_sharing applies to method='grpo_kit' only (TRL and Unsloth score every row's "
            f"prompt), got method={method!r}"
        )
    if spec.lora_dropout and spec.lora_rank is None:
        raise ValueError("lora_dropout=True needs lora_rank (LoRA dropout acts on the adapters)")
    scoring_batch = spec.scoring_batch
    if scoring_batch is not None and scoring_batch != AUTO:  # auto: chosen by estimate (auto_scoring_batch)
        if isinstance(scoring_batch, str):
            raise ValueError(f"scoring_batch must be None, {AUTO!r} or an integer >= 1, got {scoring_batch!r}")
        _int_at_least("scoring_batch", scoring_batch, 1)
        if method != "grpo_kit":
            raise ValueError(
                f"scoring_batch applies to method='grpo_kit' only (the kit trainer's scoring_batch_size), "
                f"got method={method!r}"
            )


# ----------------------------------------------------------------------------- the spec


@dataclass(frozen=True)
class EstimateSpec:
    """One GRPO step as :func:`estimate` prices it, checked when it is made (one clear ValueError per bad value,
    naming it and what is allowed). Vary a setting with :func:`dataclasses.replace`, which checks again.

    Attributes:
        num_generations: completions per prompt (G); all are trained on in one step.
        prompt_length / completion_length: tokens; a sequence is P + C tokens. ``prompt_length=0``
            counts the whole context as completion (as the published table does).
        dtype: ``"bf16" | "fp16" | "fp32"``, weights and activations.
        lora_rank: LoRA on all 7 linear layers (None: full fine-tuning).
        quantization: None, ``"4bit"`` (NF4 weights) or ``"fp8"`` (FP8 e4m3 weights with per-channel fp32 scales,
            grpo_kit.model.fp8); either needs ``lora_rank``.
        method: ``"trl"`` (TRL + FA2: full logits, standard checkpointing, separate vLLM copy),
            ``"unsloth"`` (its published long-context design: one sequence of logits at a time, offloaded
            checkpoints, weights shared with vLLM), ``"grpo_kit"`` (chunked loss, offloaded and chunked
            recompute, shared weights).
        vllm: generation by colocated vLLM (its KV pool stays resident) or by HF generate.
        kv_cache_dtype: ``None`` (= dtype) or ``"fp8"`` etc.
        micro_batch_size: sequences per forward/backward (None: all G at once, as published).
        chunk_tokens / prefetch: grpo_kit's checkpointing slice size (None: its automatic rule,
            :func:`formulas.auto_chunk_tokens`) and prefetch of the next layer input.
        include_generation: False leaves out the KV cache (a training step alone, as the whole-step benchmark).
        offload: None: the method's own choice (unsloth, grpo_kit: layer inputs to CPU; trl: no);
            False: every layer input stays on the GPU (e.g. grpo_kit's recompute without offload).
        loss_fp32: ``trl`` only: the full logits are upcast to fp32 before the log-softmax (HF style; the
            whole-step benchmark's baseline): 3 x 4 B per logit at the loss backward (the saved output, its
            incoming gradient, the input gradient) instead of TRL's bf16 path (2 x 2 B, as published).
        loss_epilogue: grpo_kit's loss epilogue, ``"triton"`` (CUDA, in place) or ``"torch"`` (CPU: the
            loss's chunk rule counts three fp32 temporaries per logit; two exist at a time). Its chunk rows
            follow the loss's own rule (``grpo_kit.loss.efficient``).
        generation_batch: completions per generation call, whole groups of G (None: the larger of G and
            the micro-batch); vLLM's KV cache holds all of them at once, HF generate pads each to P + C.
        standby: vLLM releases its KV cache while training runs and keeps the (shared) weights
            (:mod:`grpo_kit.generation.standby`): the KV cache then counts in the generation phase only.
        kv_cache_bytes: the KV cache vLLM is given (None: what the generation batch needs, formulas.vllm_kv_tokens).
        vllm_batched_tokens: vLLM's ``max_num_batched_tokens`` (its workspace row).
        scoring_batch: ``grpo_kit`` only: sequences per no-grad forward that scores completions (the
            reference and old-policy log-probs; ``scoring_batch_size``), at most the generation batch. None, or
            at most the micro-batch: that pass is smaller than the training step and not counted; more adds a
            ``scoring`` phase (priced sliced, as with LoRA dropout off). ``"auto"`` (:data:`AUTO`): the largest
            that does not raise the step's peak (with ``vllm``, that of the training phases:
            :func:`auto_scoring_batch`); None for the other methods, which score by micro-batch.
        lora_dropout: LoRA dropout above 0 (needs ``lora_rank``): every adapted linear saves its own dropped input
            and a mask (:func:`formulas.layer_saved_terms`), and grpo_kit's checkpointing runs such layers whole,
            in the recompute and in no-grad passes (their random masks cannot be split into slices).
        old_policy_pass: ``grpo_kit`` with LoRA: TRL's old-policy log-prob pass runs too (adapters on, which costs
            more than the reference pass: :func:`formulas.scoring_forward_peak`), as it does under vLLM's
            importance-sampling correction or with ``num_iterations`` > 1. None: when ``vllm``.
        tool_turns / tool_result_tokens: a multi-turn step (TRL's tool loop): ``tool_turns`` tool results of
            ``tool_result_tokens`` tokens each (as rendered: result, wrapper, next assistant header) follow the
            model's calls, ``completion_length`` counting the model's tokens of all turns. The KV cache holds the
            prompt plus all turns; every forward, the loss's included, runs over the tool tokens (masked, computed).
        prefix_sharing: ``grpo_kit`` only: each group's prompt scored once (the module docstring).
    """

    num_generations: int
    prompt_length: int
    completion_length: int
    dtype: str = "bf16"
    lora_rank: int | None = None
    quantization: str | None = None
    method: str = "grpo_kit"
    vllm: bool = True
    kv_cache_dtype: str | None = None
    micro_batch_size: int | None = None
    chunk_tokens: int | None = None
    prefetch: bool = True
    include_generation: bool = True
    offload: bool | None = None
    loss_fp32: bool = False
    loss_epilogue: str = "triton"
    generation_batch: int | None = None
    standby: bool = False
    kv_cache_bytes: float | None = None
    vllm_batched_tokens: int = 4096
    scoring_batch: int | str | None = None
    lora_dropout: bool = False
    old_policy_pass: bool | None = None
    tool_turns: int = 0
    tool_result_tokens: int = 0
    prefix_sharing: bool = False

    def __post_init__(self):
        _check_sizes(self)
        _check_options(self)


# ----------------------------------------------------------------------------- the step and its rows


def is_published_setup(a: Arch, G: int, P: int, C: int, dtype: str) -> bool:
    ref = resolve_arch(PUBLISHED_SETUP["model"])
    same = (a.vocab, a.hidden, a.intermediate, a.layers, a.kv_dim) == (
        ref.vocab,
        ref.hidden,
        ref.intermediate,
        ref.layers,
        ref.kv_dim,
    )
    return same and G == PUBLISHED_SETUP["num_generations"] and P + C == PUBLISHED_SETUP["context"] and dtype == "bf16"


@dataclass(frozen=True)
class _Step:
    """One GRPO step as :func:`estimate` prices it: its checked :class:`EstimateSpec` (named as there) and what
    follows from it. ``G`` completions per prompt of ``P`` prompt + ``C`` completion tokens, ``M`` sequences per
    forward/backward, ``gen_rows`` completions per generation call, ``S`` sequences per scoring forward. With
    tools, ``C`` is the whole rollout after the prompt: the model's tokens of every turn plus ``tool_tokens`` of
    tool results (out of the loss by TRL's tool mask, but in every forward and in the KV cache)."""

    a: Arch
    method: str
    dtype: str
    G: int
    P: int
    C: int
    M: int
    gen_rows: int
    S: int | None
    lora_rank: int | None
    quantization: str | None
    vllm: bool
    standby: bool
    kv_cache_dtype: str | None
    kv_cache_bytes: float | None
    vllm_batched_tokens: int
    include_generation: bool
    offload: bool  # resolved: the method's own choice where None was given
    prefetch: bool
    chunk_tokens: int | None  # resolved for grpo_kit (its automatic rule where None was given)
    loss_fp32: bool
    loss_epilogue: str
    lora_dropout: bool
    old_policy: bool  # TRL's old-policy pass (adapters on) runs beside the reference pass
    tool_tokens: int = 0  # tool-result tokens within C (tool_turns x tool_result_tokens)
    prefix_sharing: bool = False  # each group's prompt scored once (grpo_kit.model.prefix)

    @property
    def T(self) -> int:
        return self.P + self.C

    @property
    def b(self) -> int:
        return F.DTYPE_BYTES[self.dtype]

    @property
    def lora(self) -> bool:
        return self.lora_rank is not None

    @property
    def tokens(self) -> int:
        """Tokens of one forward/backward: with prefix sharing each group's prompt once."""
        if self.prefix_sharing:
            return F.shared_prefix_tokens(self.P, self.C, self.M, self.G)
        return self.M * self.T

    @property
    def prompts(self) -> int:
        """Prompts a micro-batch's forward runs once each with prefix sharing (its rows in whole groups)."""
        return -(-self.M // self.G)

    @property
    def scoring(self) -> bool:
        """The scoring forward is its own phase: it holds more sequences than the micro-batch's pass."""
        return self.S is not None and self.S > self.M

    @property
    def scoring_phase(self) -> tuple[str, ...]:
        return ("scoring",) if self.scoring else ()

    @property
    def step_phases(self) -> tuple[str, ...]:
        """Every phase of the step; persistent state is alive in all of them."""
        return ("generation", "loss", "backward") + self.scoring_phase


def _step(a: Arch, spec: EstimateSpec) -> _Step:
    """The :class:`_Step` of a checked spec: sizes as ints, the method's defaults filled in; the tool results joined
    to the completion (each turn's result follows the model's call in the same sequence)."""
    tool_tokens = int(spec.tool_turns) * int(spec.tool_result_tokens)
    G = int(spec.num_generations)
    M = G if spec.micro_batch_size is None else int(spec.micro_batch_size)
    gen_rows = int(spec.generation_batch) if spec.generation_batch is not None else -(-max(G, M) // G) * G
    method, chunk_tokens = spec.method, spec.chunk_tokens
    if method == "grpo_kit":
        chunk_tokens = F.auto_chunk_tokens(a) if chunk_tokens is None else int(chunk_tokens)
    lora = spec.lora_rank is not None
    return _Step(
        a=a,
        method=method,
        dtype=spec.dtype,
        G=G,
        P=int(spec.prompt_length),
        C=int(spec.completion_length) + tool_tokens,
        M=M,
        gen_rows=gen_rows,
        tool_tokens=tool_tokens,
        # TRL scores one generation batch at a time, so no forward holds more of it than that
        S=None if spec.scoring_batch is None else min(int(spec.scoring_batch), gen_rows),
        offload=method in ("unsloth", "grpo_kit") if spec.offload is None else spec.offload,
        chunk_tokens=chunk_tokens,
        lora_rank=spec.lora_rank,
        quantization=spec.quantization,
        vllm=spec.vllm,
        standby=spec.standby,
        kv_cache_dtype=spec.kv_cache_dtype,
        kv_cache_bytes=spec.kv_cache_bytes,
        vllm_batched_tokens=spec.vllm_batched_tokens,
        include_generation=spec.include_generation,
        prefetch=spec.prefetch,
        loss_fp32=spec.loss_fp32,
        loss_epilogue=spec.loss_epilogue,
        lora_dropout=spec.lora_dropout,
        prefix_sharing=spec.prefix_sharing,
        # only LoRA makes the old-policy pass (adapters on) differ from the reference pass (adapters off)
        old_policy=lora and (spec.vllm if spec.old_policy_pass is None else spec.old_policy_pass),
    )


def _row(component: str, where: str, nbytes: float, phases: tuple[str, ...], note: str) -> dict:
    """One component: ``bytes`` on the ``where`` device (GPU / CPU), alive in ``phases``."""
    return dict(component=component, where=where, bytes=float(nbytes), phases=phases, note=note)


def _state_rows(s: _Step) -> list[dict]:
    """The persistent state: weights, vLLM's copy of them, the trained parameters with AdamW's states; and the
    gradients, alive while training."""
    a, b, persistent = s.a, s.b, s.step_phases
    n = F.param_counts(a)
    w = F.weight_bytes(a, b, s.quantization)
    rows = [
        _row(
            "model weights",
            "GPU",
            w,
            persistent,
            f"{n['total'] / 1e9:.2f}e9 params"
            + {
                "4bit": " (layer projections NF4 4.127 bit)",
                "fp8": " (layer projections FP8 e4m3, 1 B + fp32 scale per output channel)",
            }.get(s.quantization, f" x {b} B"),
        )
    ]
    if s.vllm and s.method == "trl":
        rows.append(
            _row("inference copy (vLLM)", "GPU", w, persistent, "TRL colocate: vLLM loads its own copy of the weights")
        )
    else:
        rows.append(
            _row(
                "inference copy (vLLM)",
                "GPU",
                0,
                persistent,
                "weights shared with vLLM" if s.vllm else "HF generate uses the training weights",
            )
        )
    if s.lora:
        n_lora = F.lora_param_count(a, s.lora_rank)
        rows.append(
            _row(
                "LoRA + optimiser states",
                "GPU",
                F.lora_state_bytes(n_lora),
                persistent,
                f"{n_lora / 1e6:.1f}M adapter params x (4 B fp32 weight + 8 B AdamW)",
            )
        )
        rows.append(_row("gradients", "GPU", n_lora * F.FP32, ("loss", "backward"), "fp32 LoRA gradients"))
    else:
        rows.append(
            _row(
                "LoRA + optimiser states",
                "GPU",
                F.full_optimizer_bytes(n["total"], b),
                persistent,
                f"full fine-tuning: AdamW exp_avg + exp_avg_sq, 2 x {b} B per parameter",
            )
        )
        rows.append(
            _row("gradients", "GPU", n["total"] * b, ("loss", "backward"), f"full fine-tuning: {b} B per parameter")
        )
    return rows


def _tokens_what(s: _Step) -> str:
    """The tokens of one forward, in words."""
    if s.prefix_sharing:
        return f"({s.prompts} prompt(s) x {s.P} + {s.M} seq x {s.C}) tok"
    return f"{s.M} seq x {s.T} tok"


def _prefix_rows(s: _Step) -> list[dict]:
    """Prefix sharing's own GPU memory in the training phases: the prompts' keys and values of every layer."""
    if not s.prefix_sharing:
        return []
    return [
        _row(
            "prompt keys and values (prefix sharing)",
            "GPU",
            F.prefix_kv_bytes(s.a, s.prompts * s.P, s.b),
            ("loss", "backward"),
            f"{s.prompts} prompt(s) of {s.P} tokens, {s.a.layers} layers x 2 x "
            f"{s.a.kv_dim} x {s.b} B per token, held from the prompts' forward to each layer's backward",
        )
    ]


def _checkpoint_rows(s: _Step) -> list[dict]:
    """The layer inputs that gradient checkpointing saves, on the GPU or offloaded to the CPU."""
    a, b = s.a, s.b
    if s.offload and a.layers > 1:
        return [
            _row(
                "saved activations (GPU)",
                "GPU",
                F.checkpoint_bytes(a, s.tokens, b, 1),
                ("loss", "backward"),
                f"last layer's input stays on the GPU: {_tokens_what(s)} x {a.hidden} x {b} B",
            ),
            _row(
                "saved activations (CPU)",
                "CPU",
                F.checkpoint_bytes(a, s.tokens, b, a.layers - 1),
                (),
                f"{a.layers - 1} layer inputs offloaded to pinned host RAM",
            ),
        ]
    return [
        _row(
            "saved activations (GPU)",
            "GPU",
            F.checkpoint_bytes(a, s.tokens, b, a.layers),
            ("loss", "backward"),
            f"standard checkpointing: {a.layers} layer inputs of {_tokens_what(s)} x {a.hidden} x {b} B",
        ),
        _row("saved activations (CPU)", "CPU", 0, (), "nothing offloaded"),
    ]


def _recompute_rows(s: _Step) -> list[dict]:
    """The backward phase: one layer's recompute and backward, and the 4-bit weights dequantised for it."""
    a, b, kit = s.a, s.b, s.method == "grpo_kit"
    # The layer being recomputed uses its own input (counted above: the last layer's, or one
    # brought back in its place); grpo_kit's prefetch adds the next one.
    extra_in = 1 if (kit and s.offload and s.prefetch and a.layers > 1) else 0
    if kit and s.prefix_sharing:
        rec, note = _prefix_recompute(s, extra_in)
    elif kit and not s.lora_dropout:
        rec = F.chunked_recompute_peak(a, s.tokens, b, s.lora_rank, extra_in, s.chunk_tokens)
        note = f"chunked recompute ({s.chunk_tokens}-token slices): q/k/v, attention output + grad, hidden grads" + (
            ", next layer's input prefetched" if extra_in else ""
        )
    else:
        rec = F.full_recompute_peak(a, s.tokens, b, s.lora_rank, extra_in, s.lora_dropout)
        note = (
            "whole layer recomputed with grad: all its saved activations + MLP backward grads + hidden grads"
            + (" (LoRA dropout: its masks cannot be split into slices)" if kit else "")
            + (", dropout masks and each adapter's own dropped input" if s.lora_dropout else "")
        )
    rows = [_row("recompute peak of one layer", "GPU", rec, ("backward",), note)]
    if s.quantization == "4bit" and kit:  # grpo_kit.model.nf4_matmul: a layer's weights kept per call
        layer = sum(i * o for _, i, o in a.layer_linears())
        rows.append(
            _row(
                "dequantised 4-bit weights of one layer",
                "GPU",
                layer * b,
                ("backward",) + s.scoring_phase,
                f"the running layer's {len(a.layer_linears())} projections ({layer / 1e6:.0f}M weights) "
                f"dequantised to {b} B each, kept for its recompute and backward (grpo_kit.model.nf4_matmul)",
            )
        )
    elif s.quantization == "4bit":  # bitsandbytes dequantises one weight per matmul, forward and backward
        rows.append(
            _row(
                "dequantised 4-bit weight (transient)",
                "GPU",
                a.intermediate * a.hidden * b,
                ("loss", "backward"),
                f"the largest projection ({a.intermediate} x {a.hidden}) dequantised "
                f"to {b} B per weight for its matmul",
            )
        )
    elif s.quantization == "fp8":  # grpo_kit.model.fp8: one projection's matmul at a time
        slice_rows = s.chunk_tokens if kit and not s.lora_dropout else s.tokens
        rows.append(
            _row(
                "FP8 matmul transient (one projection)",
                "GPU",
                F.fp8_matmul_transient_bytes(a, b, min(slice_rows, s.tokens)),
                ("loss", "backward") + s.scoring_phase,
                f"the larger of the backward's dequantised {a.intermediate} x {a.hidden} weight (fp32 and "
                f"{b} B) and the W8A8 forward's per-row quantised input ({min(slice_rows, s.tokens)} rows x "
                f"{a.intermediate}: fp32 copy, fp32 quotient, e4m3 codes)",
            )
        )
    return rows


def _prefix_recompute(s: _Step, extra_in: int) -> tuple[float, str]:
    """(bytes, note) of one layer's backward with prefix sharing: the layer's own recompute (sliced, or whole
    under LoRA dropout) over the larger of a completions' layer (plus the prompts' keys and values expanded to
    every row, their gradient and the completions' mask) and a prompts' layer (plus the incoming gradient of its
    keys and values)."""
    a, b, P, C, M = s.a, s.b, s.P, s.C, s.M

    def layer(tokens):
        if s.lora_dropout:
            return F.full_recompute_peak(a, tokens, b, s.lora_rank, extra_in, True)
        return F.chunked_recompute_peak(a, tokens, b, s.lora_rank, extra_in, s.chunk_tokens)

    completions = (
        layer(M * C) + F.prefix_attention_bytes(a, M, P, C, b, with_grad=True) + F.prefix_mask_bytes(M, P, C, b)
    )
    prompts = layer(s.prompts * P) + F.prefix_kv_bytes(a, s.prompts * P, b) // a.layers
    which = (
        "a completions' layer (the prompt's keys and values expanded to its rows, their gradient, its mask)"
        if completions >= prompts
        else "a prompts' layer (with its keys' and values' incoming gradient)"
    )
    how = "each layer whole (LoRA dropout)" if s.lora_dropout else f"{s.chunk_tokens}-token slices"
    return max(completions, prompts), (
        f"prefix-shared recompute, {how}; the larger is {which}"
        + (", next layer's input prefetched" if extra_in else "")
    )


def _kit_logits_chunk(s: _Step, token_rows: int) -> tuple[int, int]:
    """(rows, bytes alive per logit) of one logits chunk of grpo_kit's loss over ``token_rows`` token rows: the
    loss's own rule (``grpo_kit.loss.efficient.auto_chunk_rows``, where free memory does not cap it) at its full
    budget, the one ``per_token_logps`` takes. The loss proper sizes its chunk for that budget less 48 B per token of per-token
    vectors (weights, advantages, log-probs, ids), which this chunk stands in for, within one 256-row tile."""
    rows = auto_chunk_rows(s.a.vocab, _TORCH_DTYPES[s.dtype], torch.device("cpu"), s.loss_epilogue)
    # the torch epilogue makes three fp32 temporaries per logit (its rule counts them); two exist at a time
    per_elt = s.b + 2 * F.FP32 if s.loss_epilogue == "torch" else s.b
    return min(rows, token_rows), per_elt


def _loss_rows(s: _Step) -> list[dict]:
    """The loss phase: the logits each method's loss keeps, the final norm's saved input and the hidden states."""
    a, b, M, C = s.a, s.b, s.M, s.C
    norm = F.final_norm_bytes(a, s.tokens, b, not s.lora)
    if s.method == "trl":
        if s.loss_fp32:
            logits = _row(
                "logits for the loss",
                "GPU",
                F.logits_bytes(3, M, C, a.vocab, F.FP32),
                ("loss",),
                f"3 x ({M} seq, {C} tok, {a.vocab} vocab) x 4 B: fp32 log-softmax output, its gradient "
                "and the input gradient at the loss backward",
            )
        else:
            logits = _row(
                "logits for the loss",
                "GPU",
                F.logits_bytes(2, M, C, a.vocab, b),
                ("loss",),
                f"2 x ({M} seq, {C} tok, {a.vocab} vocab) x {b} B: logits + log-softmax saved for backward",
            )
        return [
            logits,
            _row(
                "final norm + hidden states (loss)",
                "GPU",
                norm,
                ("loss",),
                "final RMSNorm's saved fp32 input; the head's gradient is built in backward",
            ),
        ]
    if s.method == "unsloth":
        logits = _row(
            "logits for the loss",
            "GPU",
            F.logits_bytes(2, 1, C, a.vocab, b),
            ("loss",),
            f"one sequence at a time: 2 x ({C} tok, {a.vocab} vocab) x {b} B",
        )
    else:
        rows_c, per_elt = _kit_logits_chunk(s, M * C)
        logits = _row(
            "logits for the loss",
            "GPU",
            rows_c * a.vocab * per_elt,
            ("loss",),
            f"one chunk of {rows_c} token rows x {a.vocab} vocab x {per_elt} B",
        )
    return [
        logits,
        _row(
            "final norm + hidden states (loss)",
            "GPU",
            norm + s.tokens * a.hidden * b + M * C * a.hidden * b,
            ("loss",),
            "final RMSNorm's fp32 input, the final hidden states and their gradient (computed "
            "in the forward, completion tokens)",
        ),
    ]


def _scoring_rows(s: _Step) -> list[dict]:
    """The scoring phase (grpo_kit only, where it holds more sequences than a micro-batch): one no-grad forward
    over ``S`` sequences that scores completions for the reference (or old-policy) log-probs."""
    if not s.scoring:
        return []
    a, S = s.a, s.S
    rows_s, per_elt = _kit_logits_chunk(s, S * s.C)  # per_token_logps' chunk
    slice_tokens = None if s.lora_dropout else s.chunk_tokens  # dropout: each layer runs whole
    if s.prefix_sharing:  # one group at a time: its prompt once, then its rows' completions
        rows_g = min(S, s.G)
        return [
            _row(
                "scoring pass (no grad)",
                "GPU",
                F.shared_scoring_peak(a, rows_g, s.P, s.C, s.b, slice_tokens, rows_s * a.vocab * per_elt, s.old_policy),
                ("scoring",),
                f"{S} sequences per scoring call, prefix-shared: one group at a time, its "
                f"prompt's keys and values ({a.layers} layers) and the larger of the prompt's forward and its "
                f"{rows_g} completions' (the prompt's keys and values expanded to each), one logits chunk of "
                f"{rows_s} rows",
            )
        ]
    return [
        _row(
            "scoring pass (no grad)",
            "GPU",
            F.scoring_forward_peak(a, S, s.T, s.b, slice_tokens, rows_s * a.vocab * per_elt, s.old_policy),
            ("scoring",),
            f"{S} sequences per no-grad forward ("
            + (
                "old-policy log-probs, adapters on, the larger of its two passes"
                if s.old_policy
                else "reference log-probs"
            )
            + "): embeddings, a layer's input and output, its attention or "
            + (f"one {s.chunk_tokens}-token MLP slice" if slice_tokens else "its whole MLP (LoRA dropout: unsliced)")
            + f", and one logits chunk of {rows_s} rows",
        )
    ]


def _generation_rows(s: _Step) -> list[dict]:
    """The generation phase: the KV cache (vLLM's pool or HF generate's) and vLLM's workspace."""
    a, G = s.a, s.G
    kv_b = F.KV_DTYPE_BYTES[s.kv_cache_dtype or s.dtype]
    kv_what = f"{a.layers} layers x 2 x {a.kv_dim} x {kv_b} B per token"
    if not s.include_generation:
        return [_row("KV cache (generation)", "GPU", 0, (), "not counted: training step only")]
    if not s.vllm:
        return [
            _row(
                "KV cache (generation)",
                "GPU",
                F.kv_cache_bytes(a, s.gen_rows * s.T, kv_b),
                ("generation",),
                f"HF generate, {s.gen_rows} sequences; {kv_what}; freed before training",
            )
        ]
    prompts = s.gen_rows // G
    slots = F.vllm_kv_tokens(s.P, s.C, G, prompts)
    given = s.kv_cache_bytes is not None
    kv = float(s.kv_cache_bytes) if given else F.kv_cache_bytes(a, slots, kv_b)
    how = (
        "the KV budget given"
        if given
        else f"{prompts} prompt(s) once (prefix cache) + {G} completions each"
        + (f" over all turns ({s.tool_tokens} tokens of tool results)" if s.tool_tokens else "")
        + f", {slots} slots in {F.VLLM_BLOCK_TOKENS}-token blocks"
    )
    return [
        _row(
            "KV cache (generation)",
            "GPU",
            kv,
            ("generation",) if s.standby else s.step_phases,
            f"vLLM: {how}; {kv_what}; " + ("released while training (standby)" if s.standby else "stays resident"),
        ),
        _row(
            "vLLM workspace (generation)",
            "GPU",
            F.vllm_workspace_bytes(a, s.vllm_batched_tokens, s.gen_rows, s.b),
            ("generation",),
            f"one layer's activations for {s.vllm_batched_tokens} batched tokens + fp32 sampler "
            f"buffers for {s.gen_rows} rows",
        ),
    ]


# Components whose figure Unsloth published, and the published row each matches; the notes say how they compare.
_PUBLISHED_ROWS = {
    "saved activations (GPU)": "training memory",
    "logits for the loss": "GRPO loss (logits)",
    "inference copy (vLLM)": "inference weights",
    "KV cache (generation)": "KV cache (20K)",
}
_PUBLISHED_NOTES = {
    ("trl", "training memory"): "published 414 GB 'training memory': no published derivation (shown, not derived)",
    ("unsloth", "training memory"): "published 42 GB 'training memory' is counted in Unsloth's VRAM total; "
    "one bf16 checkpoint per layer is 42.9 GB",
    ("grpo_kit", "training memory"): "Unsloth's published 42 GB 'training memory' (counted in its VRAM total)",
    ("any", "KV cache (20K)"): "published 2.5 (GiB) counts one 20,480-token sequence",
    ("any", "GRPO loss (logits)"): "published figure is in GiB",
}


def _mark_published(s: _Step, rows: list[dict]) -> bool:
    """Fills each row's ``published`` (Unsloth's figure for it, NaN unless the setup is the published one; TRL's
    column for ``trl``, Unsloth's otherwise) and notes how they compare. Returns whether the setup is published."""
    published = (
        is_published_setup(s.a, s.G, s.P, s.C, s.dtype)
        and not s.loss_fp32
        and s.offload == (s.method in ("unsloth", "grpo_kit"))
    )
    pub_map = dict(_PUBLISHED_ROWS)
    if s.method in ("unsloth", "grpo_kit"):  # their saved activations sit on the CPU
        pub_map["saved activations (CPU)"] = pub_map.pop("saved activations (GPU)")
    col = 1 if s.method == "trl" else 0
    for r in rows:
        key = pub_map.get(r["component"]) if published else None
        r["published"] = PUBLISHED[key][col] if key else math.nan
        extra = (_PUBLISHED_NOTES.get((s.method, key)) or _PUBLISHED_NOTES.get(("any", key))) if key else None
        if extra:
            r["note"] += f" | {extra}"
    return published


def _table(s: _Step, rows: list[dict]) -> pd.DataFrame:
    """The rows with the peak phase marked, the GPU and CPU totals appended, the step in ``attrs``."""
    phase_tot = {ph: sum(r["bytes"] for r in rows if r["where"] == "GPU" and ph in r["phases"]) for ph in s.step_phases}
    peak_phase = max(phase_tot, key=lambda k: (phase_tot[k], k == "backward"))
    for r in rows:
        r["in_peak"] = r["where"] == "GPU" and peak_phase in r["phases"] and r["bytes"] > 0
    published = _mark_published(s, rows)
    rows.append(
        dict(
            component="total GPU (peak)",
            where="GPU",
            bytes=phase_tot[peak_phase],
            phases=(),
            in_peak=True,
            published=PUBLISHED["total"][1 if s.method == "trl" else 0] if published else math.nan,
            note=f"peak during the {peak_phase} phase; excludes CUDA context and fragmentation",
        )
    )
    rows.append(
        dict(
            component="total CPU",
            where="CPU",
            bytes=sum(r["bytes"] for r in rows if r["where"] == "CPU"),
            phases=(),
            in_peak=False,
            published=math.nan,
            note="pinned host RAM for offloaded layer inputs",
        )
    )
    df = pd.DataFrame(rows)
    df["GB"] = df["bytes"] / GB
    df["GiB"] = df["bytes"] / GiB
    df = df[["component", "where", "GB", "GiB", "in_peak", "published", "note"]]
    df.attrs.update(
        dict(
            model=s.a.name,
            method=s.method,
            num_generations=s.G,
            prompt_length=s.P,
            completion_length=s.C - s.tool_tokens,
            tool_tokens=s.tool_tokens,
            sequence_length=s.T,
            micro_batch_size=s.M,
            dtype=s.dtype,
            lora_rank=s.lora_rank,
            quantization=s.quantization,
            vllm=s.vllm,
            kv_cache_dtype=s.kv_cache_dtype or s.dtype,
            include_generation=s.include_generation,
            generation_batch=s.gen_rows,
            standby=s.standby,
            scoring_batch=s.S,
            lora_dropout=s.lora_dropout,
            old_policy_pass=bool(s.old_policy),
            offload=s.offload,
            loss_fp32=s.loss_fp32,
            loss_epilogue=s.loss_epilogue,
            prefix_sharing=s.prefix_sharing,
            peak_phase=peak_phase,
            phase_bytes=phase_tot,
            published_source=PUBLISHED_SOURCE if published else None,
        )
    )
    return df


# ----------------------------------------------------------------------------- the estimate


def estimate(model, spec: EstimateSpec) -> pd.DataFrame:
    """Estimated memory of one GRPO step, one row per component, plus GPU and CPU totals.

    Args:
        model: built-in name, path to a ``config.json``, or a transformers config (no weights).
        spec: the step (:class:`EstimateSpec`, checked when it was made).

    Phases (the module docstring's peak rule): ``generation``, ``loss``, ``backward``, and ``scoring`` where
    ``spec.scoring_batch`` exceeds the micro-batch; the GPU total is the largest.

    Returns:
        DataFrame with columns ``component, where, GB, GiB, in_peak, published, note``; the last two rows are
        ``total GPU (peak)`` and ``total CPU``. ``published`` holds Unsloth's published figure for the same
        component when the setup is the published one (for ``grpo_kit``: Unsloth's column, the figure to beat),
        NaN otherwise. ``df.attrs`` holds the inputs, the peak phase and the per-phase GPU totals (bytes).
    """
    if not isinstance(spec, EstimateSpec):
        raise TypeError(
            f"estimate(model, spec): spec must be an EstimateSpec, got {type(spec).__name__} "
            f"{spec!r:.200}; make one with EstimateSpec(num_generations=..., prompt_length=..., "
            "completion_length=..., ...)"
        )
    if spec.scoring_batch == AUTO:
        return auto_scoring_batch(model, spec)
    s = _step(resolve_arch(model), spec)
    return _table(
        s,
        [
            *_state_rows(s),
            *_checkpoint_rows(s),
            *_prefix_rows(s),
            *_recompute_rows(s),
            *_loss_rows(s),
            *_scoring_rows(s),
            *_generation_rows(s),
        ],
    )


def auto_scoring_batch(model, spec: EstimateSpec) -> pd.DataFrame:
    """:func:`estimate` of ``spec`` (its ``scoring_batch`` aside) with the largest ``scoring_batch`` whose
    ``scoring`` phase stays within the largest of the step's other phases: fuller no-grad forwards (with 4-bit
    weights, fewer dequantisations) at no cost to the peak. With ``vllm`` the generation phase does not count
    (:data:`SCORING_BOUND_PHASES`): its KV cache lives in the engine's own memory pool, which PyTorch's allocator
    cannot reuse for the scoring pass (released in standby, kept otherwise), so a scoring pass priced just under
    that phase raised the step's peak on the GPU; HF ``generate``'s KV cache is freed into the allocator that
    scoring then draws from. The scoring phase grows with the batch, so a bisection between one micro-batch and
    one generation batch finds it. Where none fits, or the method is not ``grpo_kit`` (TRL and Unsloth score by
    micro-batch), the estimate without one (``scoring_batch=None``). ``df.attrs["scoring_batch"]`` holds the
    choice and ``df.attrs["scoring_batch_auto"]`` is True."""
    base = estimate(model, dataclasses.replace(spec, scoring_batch=None))
    bound = [k for k in base.attrs["phase_bytes"] if k in SCORING_BOUND_PHASES or not base.attrs["vllm"]]
    best, low, high = base, base.attrs["micro_batch_size"] + 1, base.attrs["generation_batch"]
    while spec.method == "grpo_kit" and low <= high:
        mid = (low + high) // 2
        df = estimate(model, dataclasses.replace(spec, scoring_batch=mid))
        phases = df.attrs["phase_bytes"]
        if phases["scoring"] <= max(phases[k] for k in bound):
            best, low = df, mid + 1
        else:
            high = mid - 1
    best.attrs["scoring_batch_auto"] = True
    return best


def estimate_for_config(step: StepSpec, model=None, **overrides) -> pd.DataFrame:
    """:func:`estimate` for a run's step (:class:`StepSpec`, or an object that makes one: :meth:`StepSpec.of`): its
    generations, prompt/completion lengths, dtype, LoRA rank, trainer (``trl`` or ``grpo_kit`` method), backend and
    micro-batch. ``model``: a config or name (default ``step.model``); ``overrides`` replace any of the derived
    :class:`EstimateSpec` fields."""
    step = StepSpec.of(step)
    return estimate(model if model is not None else step.model, config_estimate_spec(step, **overrides))


def scoring_batch_for_config(step: StepSpec, model=None, **overrides) -> int | None:
    """``step.scoring_batch_size`` as the trainer takes it: the number or null as set, or for ``auto`` the
    calculator's choice for the run's step (:func:`auto_scoring_batch`; ``overrides`` as in
    :func:`estimate_for_config`, e.g. the generation plan's pricing). None with ``trainer='trl'``, and (with a
    warning) for an architecture the calculator cannot price."""
    step = StepSpec.of(step)
    if step.scoring_batch_size != AUTO:
        return step.scoring_batch_size
    try:
        return estimate_for_config(step, model, **overrides).attrs["scoring_batch"]
    except ValueError as e:  # an architecture resolve_arch does not know: score as TRL does
        warnings.warn(
            f"scoring_batch_size='auto': the VRAM calculator cannot price this model ({e}); scoring "
            "per_device_train_batch_size sequences per forward",
            stacklevel=2,
        )
        return None


def config_estimate_spec(step: StepSpec, **overrides) -> EstimateSpec:
    """The :class:`EstimateSpec` that describes a run's step (:class:`StepSpec`, or an object that makes one);
    ``overrides`` replace any of its fields before it is checked.

    With tools, the step is priced at its bound as it stands: TRL's ``max_completion_length`` counts the model's
    and the tools' tokens together (its tool loop drops a result that would pass it), and ``max_prompt_length``
    covers the tools' schema (the app checks the rendered prompts), so no ``tool_turns`` are added on top."""
    s = StepSpec.of(step)
    quantization = "4bit" if s.load_in_4bit else "fp8" if s.base_weights == "fp8" else None
    kw = dict(
        num_generations=s.num_generations,
        prompt_length=s.max_prompt_length,
        completion_length=s.max_completion_length,
        dtype={"fp32": "fp32", "fp16": "fp16"}.get(s.dtype, "bf16"),
        lora_rank=s.lora_rank if s.use_lora else None,
        quantization=quantization,
        method="trl" if s.trainer == "trl" else "grpo_kit",
        vllm=s.generation_backend == "vllm",
        kv_cache_dtype="fp8" if s.kv_cache_dtype == "fp8" else None,
        micro_batch_size=s.per_device_train_batch_size,
        generation_batch=s.per_device_train_batch_size * s.gradient_accumulation_steps,
        scoring_batch=None if s.trainer == "trl" else s.scoring_batch_size,
        lora_dropout=bool(s.use_lora and s.lora_dropout),
        old_policy_pass=True if s.num_iterations > 1 else None,  # else: with vLLM's sampling correction
        # `auto` shares only what pays at the batch's own lengths: priced unshared, its bound
        prefix_sharing=s.prefix_sharing is True and s.trainer != "trl",
    )
    kw.update(overrides)
    return EstimateSpec(**kw)


def total_gpu_bytes(df: pd.DataFrame) -> float:
    """The ``total GPU (peak)`` of an :func:`estimate` table, in bytes."""
    return float(df.loc[df["component"] == "total GPU (peak)", "GB"].iloc[0] * GB)


def compare(model, spec: EstimateSpec, *, methods=METHODS, unit: str = "GB") -> pd.DataFrame:
    """One column per method (``spec`` with each method in turn; ``unit`` GB or GiB), rows as in :func:`estimate`."""
    if unit not in ("GB", "GiB"):
        raise ValueError(f"unit must be 'GB' or 'GiB', got {unit!r}")
    bad = [m for m in methods if m not in METHODS]
    if bad or not methods:
        raise ValueError(f"methods must be a non-empty subset of {list(METHODS)}, got {list(methods)!r}")
    cols = {}
    for m in methods:
        df = estimate(model, dataclasses.replace(spec, method=m))
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
    cols = [
        "component",
        "unsloth_published",
        "unsloth_derived",
        "unsloth_status",
        "trl_published",
        "trl_derived",
        "trl_status",
        "unit",
        "derivation",
    ]
    df = pd.DataFrame(rows)[cols]
    df.attrs["source"] = PUBLISHED_SOURCE
    return df
