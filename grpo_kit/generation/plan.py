"""Which generator a run uses and how it shares the GPU with training, decided once, before any model loads.

* :func:`plan_generation` reads the run's :class:`~grpo_kit.generation.spec.GenerationSpec`, the model's config (no
  weights) and the device and
  returns a :class:`GenerationPlan`: backend (``hf``, ``vllm``, ``trl``), the engine's folder,
  whether the weights are shared, and on CUDA the memory plan, where the KV cache is what one
  generation batch needs (or the run's ``vllm_kv_cache_gib``) and the VRAM calculator's step
  peak (weights counted once, the KV cache in the generation phase only under standby) must fit the
  free memory. Options the user set for vLLM are never dropped silently: when vLLM cannot honour
  them, this raises; so does a KV budget that cannot fit, with the calculator's numbers.
* :func:`start_generation` carries a plan out: the engine first and the training model on its
  weights when they are shared, otherwise the training model from ``load_model`` and an engine copy
  (or HF generate). Returns ``(generator, model, info)``; ``info`` goes to the run folder.
"""

from __future__ import annotations

import copy
import math
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch
from huggingface_hub import snapshot_download
from transformers import AutoConfig

from grpo_kit.generation import make_generator
from grpo_kit.generation.base import GenerationEngineError
from grpo_kit.generation.shared_weights import UnshareableError
from grpo_kit.generation.spec import GenerationSpec
from grpo_kit.generation.versions import check_vllm_version
from grpo_kit.generation.vllm_backend import (
    UnsupportedArchitectureError,
    fp32_checkpoint_dtype,
    vllm_available,
    vllm_install_advice,
)
from grpo_kit.memory import estimate_for_config, resolve_arch, scoring_batch_for_config
from grpo_kit.memory.formulas import kv_cache_bytes, vllm_kv_tokens
from grpo_kit.model.devices import checkpointing_on
from grpo_kit.model.loading import (
    cache_dir,
    causal_lm_class,
    check_model_name,
    embedded_model_dir_as,
    load_tokenizer,
    model_config,
)

# vLLM's ``max_num_batched_tokens`` on CUDA, whatever the context: prompts are short next to completions, decoding
# takes one token per sequence, and a longer prompt is prefilled in chunks of this size (chunked prefill, asked for
# explicitly so that vLLM never raises the budget to the context on its own). The engine's profile run, and so its
# workspace, scales with it: at 8 x (512 + 20,480) the context's 20,992 tokens would hold about 2 GiB more of an
# 8B's activations than these 4,096.
CUDA_BATCHED_TOKENS = 4096
VLLM_LORA_RANKS = (8, 16, 32, 64, 128, 256, 320, 512)  # the max_lora_rank values vLLM accepts
# vllm_lora_dual_stream=null on CUDA with the adapter in vLLM: vLLM's LoRA kernels on a second stream beside the
# base matmuls, which hides much of the adapter's decode cost (measured by bench rl_step).
LORA_DUAL_STREAM_DEFAULT = True
CPU_BLOCK_TOKENS = 128  # vLLM's CPU backend's KV cache block, its default (formulas.VLLM_BLOCK_TOKENS is CUDA's)
HEADROOM_BYTES = 1 << 30  # kept free beside the calculator's peak (CUDA context, fragmentation)


@dataclass
class GenerationPlan:
    requested: str
    backend: str  # "hf" | "vllm" | "trl"
    reason: str = ""  # why auto did not pick vLLM
    warn: bool = False  # say the reason as a warning (vLLM installed but unusable)
    model_dir: Path | None = None
    share_weights: bool = False
    share_reason: str = ""  # why the weights are not shared
    vllm_kwargs: dict = field(default_factory=dict)
    memory: dict = field(default_factory=dict)
    explicit: list = field(default_factory=list)  # vLLM options the user set: never dropped for HF

    def info(self) -> dict:
        out = {"requested": self.requested, "backend": self.backend}
        if self.reason:
            out["reason"] = self.reason
        if self.backend == "vllm":
            out["weights"] = "shared" if self.share_weights else f"separate copy ({self.share_reason})"
        if self.memory:
            out["memory_plan"] = self.memory
        return out


def generation_model_dir(
    name: str, device: str, dtype: torch.dtype | None = None, config=None
) -> tuple[Path | None, bool]:
    """``(folder, dummy_weights)``: the HF folder a vLLM engine starts from for model ``name``.

    The embedded model's cached export in the engine's dtype (``dtype``, or None: the one vLLM runs an fp32
    checkpoint in here), so that it loads each weight as it is; a local folder, or a hub id's cached snapshot
    (real weights);
    on CUDA, for the random-weight built-ins, a cached folder with their ``config.json`` and the
    embedded tokenizer, which the engine fills with random weights (``load_format="dummy"``). None on
    the CPU for those: there they are test models, and an engine start costs more than their run. ``config``: the
    model's transformers config where the caller read it already (None: read here).
    """
    kind = check_model_name(name)
    if kind in ("tiny", "config-only"):
        if device != "cuda":
            return None, False
        target = cache_dir() / "config-only" / name
        if not (target / "config.json").is_file():
            config = copy.deepcopy(config) if config is not None else model_config(name)  # the caller's unchanged
            config.architectures = [causal_lm_class(config).__name__]
            target.mkdir(parents=True, exist_ok=True)
            load_tokenizer(name).save_pretrained(target)
            config.to_json_file(str(target / "config.json"))  # last: its presence marks a complete folder
        return target, True
    if kind == "embedded":
        return embedded_model_dir_as(dtype or fp32_checkpoint_dtype()), False
    if Path(name).is_dir():
        return Path(name), False
    # the training model's own files, already cached
    return Path(snapshot_download(name, allow_patterns=["*.json", "*.safetensors", "*.model", "*.txt"])), False


def _share_decision(gen: GenerationSpec, device: str) -> tuple[bool, str]:
    reasons = [
        why
        for why, bad in (
            ("not on CUDA", device != "cuda"),
            ("full fine-tuning", not gen.step.use_lora),
            ("4-bit training weights", gen.step.load_in_4bit),
        )
        if bad
    ]
    if gen.vllm_share_weights is False:
        return False, "vllm_share_weights=False"
    if reasons and gen.vllm_share_weights is True:
        raise ValueError(
            f"vllm_share_weights=True is not possible here: {', '.join(reasons)}; set it to 'auto' or false"
        )
    return not reasons, ", ".join(reasons)


def lora_sync_mode(gen: GenerationSpec) -> str:
    """``vllm_lora_sync`` resolved: null is ``merge`` (dense decoding; with shared weights the adapter is merged
    into them for each generation and their exact bits restored after). Chosen by measurement: dense decoding
    of the merged weights outran the adapter in vLLM's LoRA kernels (bench rl_step). With FP8 base weights null is
    ``adapter``: a merge would round the FP8 codes again (the config refuses ``merge`` with them)."""
    gen = GenerationSpec.of(gen)
    return gen.vllm_lora_sync or ("adapter" if gen.step.base_weights == "fp8" else "merge")


def lora_dual_stream(gen: GenerationSpec, *, device: str) -> bool:
    """``vllm_lora_dual_stream`` resolved: it applies where vLLM runs the adapter in its LoRA kernels on CUDA
    (``lora_sync_mode`` is ``adapter``); null is ``LORA_DUAL_STREAM_DEFAULT``."""
    gen = GenerationSpec.of(gen)
    if not (device == "cuda" and lora_sync_mode(gen) == "adapter"):
        return False
    return LORA_DUAL_STREAM_DEFAULT if gen.vllm_lora_dual_stream is None else bool(gen.vllm_lora_dual_stream)


def memory_plan(
    gen: GenerationSpec,
    model_config,
    *,
    share_weights: bool,
    free_bytes: float,
    total_bytes: float,
    batched_tokens: int = CUDA_BATCHED_TOKENS,
) -> dict:
    """The CUDA memory plan: KV cache bytes, vLLM's share, and the calculator's phases, in GiB.

    On CUDA the engine sleeps while training runs either way (standby with shared weights; for a separate
    copy vLLM's level-2 sleep, which drops the weights, where every sync rewrites them whole (merged LoRA, full
    fine-tuning), and level 1, weights to host RAM, with an in-memory adapter), so the KV cache counts in the
    generation phase only; a separate copy adds its weights there. ValueError when the largest
    phase does not fit ``free_bytes`` less 1 GiB of headroom; the message names the numbers and
    what to lower. ``batched_tokens``: the engine's ``max_num_batched_tokens`` (its workspace row). ``gen``: a
    :class:`GenerationSpec` or an object that makes one (:meth:`GenerationSpec.of`).
    """
    gen = GenerationSpec.of(gen)
    step, kv_gib = gen.step, gen.vllm_kv_cache_gib
    df = estimate_for_config(
        step,
        model_config,
        vllm=True,
        standby=True,
        method="grpo_kit",
        offload=None if checkpointing_on(gen.gradient_checkpointing, "cuda") else False,
        vllm_batched_tokens=batched_tokens,
        kv_cache_bytes=kv_gib * 2**30 if kv_gib else None,
    ).set_index("component")
    row = lambda c: float(df.at[c, "GB"] * 1e9)  # noqa: E731
    weights, kv, workspace = row("model weights"), row("KV cache (generation)"), row("vLLM workspace (generation)")
    copy = 0.0 if share_weights else weights
    phases = dict(df.attrs["phase_bytes"])
    phases["generation"] += copy
    need = max(phases.values())
    gib = lambda b: round(b / 2**30, 2)  # noqa: E731
    plan = {
        "kv_cache_gib": round(kv / 2**30, 3),
        "kv_cache_dtype": step.kv_cache_dtype,
        "kv_source": "vllm_kv_cache_gib" if kv_gib else "calculator (one generation batch)",
        "generation_rows": step.per_device_train_batch_size * step.gradient_accumulation_steps,
        "calculator_phases_gib": {k: gib(v) for k, v in phases.items()},
        "calculator_peak_gib": gib(need),
        "weights_gib": gib(weights),
        "engine_weight_copy_gib": gib(copy),
        "free_gib": gib(free_bytes),
        "device_total_gib": gib(total_bytes),
        # scoring_batch_size as this estimate resolved it (``auto``: priced with vLLM's generation phase)
        "scoring_batch_size": df.attrs["scoring_batch"],
    }
    if need + HEADROOM_BYTES > free_bytes:
        raise ValueError(
            f"vLLM generation cannot fit beside training on this GPU: the VRAM calculator puts the step at "
            f"{need / 2**30:.1f} GiB (weights {weights / 2**30:.1f}{' + a separate engine copy' if copy else ''}, "
            f"KV cache {kv / 2**30:.1f} GiB in {step.kv_cache_dtype}; phases "
            f"{plan['calculator_phases_gib']} GiB) but {free_bytes / 2**30:.1f} of "
            f"{total_bytes / 2**30:.1f} GiB is free (1 GiB kept as headroom). Lower vllm_kv_cache_gib, "
            "max_completion_length, per_device_train_batch_size or gradient_accumulation_steps; set "
            "kv_cache_dtype=fp8; or generate with generation_backend=hf"
        )
    # vLLM checks its share against free memory at start-up; with an explicit KV size it uses it for nothing else.
    plan["vllm_share"] = min(0.95, math.ceil((weights + kv + workspace + HEADROOM_BYTES) / total_bytes * 100) / 100)
    plan["kv_cache_memory_bytes"] = int(kv)
    return plan


def _outside_window(requested: str, device: str) -> str | None:
    """Why the installed vLLM is outside the versions the kit drives, or None; asked for by name, an error."""
    outside = check_vllm_version()
    if outside is not None and requested == "vllm":
        raise ValueError(
            f"generation_backend='vllm': {outside}; install a tested vLLM "
            f"({vllm_install_advice(device == 'cuda')}) or use generation_backend='hf'"
        )
    return outside


def plan_generation(
    gen: GenerationSpec, *, model_config, device: str, dtype: torch.dtype, num_processes: int = 1
) -> GenerationPlan:
    """Decide the generator for a run (see the module docstring); loads no model. ``gen``: a
    :class:`GenerationSpec`, or an object that makes one (:meth:`GenerationSpec.of`); ``model_config``: the
    model's transformers config, read once by the caller."""
    gen = GenerationSpec.of(gen)
    step = gen.step
    requested = step.generation_backend
    if step.trainer == "trl":
        return GenerationPlan(requested, "trl", reason="trainer='trl' generates with TRL's own HF path")
    explicit = gen.vllm_options_set()

    def hf(reason: str, warn: bool) -> GenerationPlan:
        if explicit:
            raise ValueError(
                f"{', '.join(explicit)} need vLLM generation, but {reason}; "
                "leave them at their defaults or make vLLM usable"
            )
        return GenerationPlan(requested, "hf", reason=reason if requested == "auto" else "", warn=warn)

    context = step.max_prompt_length + step.max_completion_length
    limit = getattr(model_config, "max_position_embeddings", None)
    if limit and context > limit:  # either backend would fail at the first generate call
        raise ValueError(
            f"max_prompt_length + max_completion_length = {step.max_prompt_length} + "
            f"{step.max_completion_length} = {context} is beyond the model's context ({limit} tokens, "
            f"max_position_embeddings); lower max_completion_length to at most "
            f"{limit - step.max_prompt_length}"
        )
    if requested == "hf":
        return hf("", False)
    if step.load_in_4bit:  # config refuses 'vllm' with it
        return hf("load_in_4bit: vLLM cannot take a 4-bit training model's weights yet", False)
    if step.base_weights == "fp8" and device != "cuda":  # the config refuses FP8 off CUDA; kept for direct callers
        return hf("base_weights='fp8': vLLM's FP8 engine shares the training model's weights on CUDA only", False)
    if requested == "auto" and not vllm_available():
        return hf(f"vLLM is not installed ({vllm_install_advice(device == 'cuda')})", device == "cuda")
    if (outside := _outside_window(requested, device)) is not None:  # before any engine or model loads
        return hf(outside, True)
    model_dir, dummy = generation_model_dir(step.model, device, dtype if device == "cuda" else None, model_config)
    if model_dir is None:
        if requested == "vllm":
            raise ValueError(
                f"generation_backend='vllm' needs a model folder; model={step.model!r} is a "
                "random-weight built-in, which vLLM runs on CUDA only; use generation_backend='hf' or "
                "'auto'"
            )
        return hf(f"model={step.model!r} has random weights and no checkpoint folder for vLLM", False)
    if requested == "auto" and num_processes > 1:
        return hf(
            f"{num_processes} processes (colocated vLLM runs with one process here; set "
            "generation_backend='vllm' to force it)",
            True,
        )
    share, why = _share_decision(gen, device)
    if step.base_weights == "fp8" and not share:  # the engine's FP8 codes are the only copy
        return hf(f"base_weights='fp8' generates with vLLM only on shared weights ({why})", False)
    plan = GenerationPlan(
        requested,
        "vllm",
        model_dir=model_dir,
        share_weights=share,
        share_reason=why,
        vllm_kwargs=_engine_kwargs(gen, device, share=share, dummy=dummy),
        explicit=explicit,
    )
    if device != "cuda":
        _size_cpu_engine(plan, gen, model_config)
        return plan
    try:
        _size_cuda_engine(plan, gen, model_config, dtype)
    except ValueError as e:
        if requested == "vllm" or explicit:
            raise
        return hf(f"vLLM could not be planned ({e})", True)
    return plan


def _engine_kwargs(gen: GenerationSpec, device: str, *, share: bool, dummy: bool) -> dict:
    """The engine's arguments that follow from the run alone (sizes of its KV cache and batch come after);
    ValueError for a dual stream asked for where nothing runs on it."""
    step = gen.step
    rank = next(r for r in VLLM_LORA_RANKS if r >= step.lora_rank) if step.lora_rank <= 512 else 512
    kwargs = dict(
        max_model_len=step.max_prompt_length + step.max_completion_length,
        seed=gen.seed,
        kv_cache_dtype=step.kv_cache_dtype,
        gpu_memory_utilization=gen.vllm_gpu_memory_utilization,
        share_weights=share,
        dummy_weights=dummy,
        lora_sync=lora_sync_mode(gen),
        max_lora_rank=rank,
        lora_dual_stream=lora_dual_stream(gen, device=device),
        base_weights=step.base_weights,
        enforce_eager=gen.vllm_enforce_eager,
        emulate_precision_casts=gen.vllm_emulate_precision_casts,
        fp8_block=gen.fp8_block,
    )
    if gen.vllm_lora_dual_stream and not kwargs["lora_dual_stream"]:  # asked for, and nothing to run it on
        raise ValueError(
            "vllm_lora_dual_stream=True needs vLLM running the adapter in its LoRA kernels on CUDA, but "
            + (
                "this run is not on CUDA"
                if device != "cuda"
                else f"the adapter reaches vLLM merged (vllm_lora_sync resolves to 'merge' with "
                f"{'shared weights' if share else 'a separate engine copy'})"
            )
            + "; set vllm_lora_sync='adapter', or leave vllm_lora_dual_stream null"
        )
    return kwargs


def _size_cuda_engine(plan: GenerationPlan, gen: GenerationSpec, model_config, dtype: torch.dtype) -> None:
    """The CUDA engine's dtype, batch and memory: the calculator's plan (:func:`memory_plan`) against the free
    memory, its share and KV size given to vLLM unless the run sets them; ValueError when it cannot fit."""
    kwargs, step = plan.vllm_kwargs, gen.step
    gen_rows = step.per_device_train_batch_size * step.gradient_accumulation_steps
    batched = max(CUDA_BATCHED_TOKENS, gen_rows)  # what the engine gets is what the calculator prices (vLLM: >= seqs)
    kwargs.update(
        dtype=str(dtype).removeprefix("torch."),
        max_num_seqs=gen_rows,
        llm_kwargs={"max_num_batched_tokens": batched, "enable_chunked_prefill": True},
    )
    free, total = torch.cuda.mem_get_info()
    mem = memory_plan(
        gen, model_config, share_weights=plan.share_weights, free_bytes=free, total_bytes=total, batched_tokens=batched
    )
    plan.memory = mem
    if gen.vllm_gpu_memory_utilization is None:
        kwargs.update(gpu_memory_utilization=mem["vllm_share"], kv_cache_memory_bytes=mem["kv_cache_memory_bytes"])
    elif gen.vllm_kv_cache_gib:
        kwargs.update(kv_cache_memory_bytes=mem["kv_cache_memory_bytes"])


def cpu_kv_cache(gen: GenerationSpec, model_config) -> dict:
    """The CPU engine's KV cache as the calculator prices one step's generation: ``{"bytes", "tokens", "rows"}``.

    ``rows`` (per_device_train_batch_size x gradient_accumulation_steps) sequences of up to max_prompt_length +
    max_completion_length tokens in vLLM's CPU blocks (``CPU_BLOCK_TOKENS``), each with its own prompt blocks
    (a group's completions are scheduled together, before their prompt's blocks are cached to be shared), at the
    prompt length that takes the most blocks; K and V of every layer in the engine's KV dtype (the model's 16-bit
    dtype, or the one vLLM runs an fp32 checkpoint in; 1 byte with ``kv_cache_dtype`` fp8). The held-out
    evaluation generates with the training model, not the engine. ``gen``: a :class:`GenerationSpec` or an object
    that makes one."""
    step = GenerationSpec.of(gen).step
    rows = step.per_device_train_batch_size * step.gradient_accumulation_steps
    tokens = max(
        vllm_kv_tokens(p, step.max_completion_length, 1, rows, block=CPU_BLOCK_TOKENS)
        for p in range(1, step.max_prompt_length + 1)
    )
    own = getattr(model_config, "dtype", None)
    dtype = own if own in (torch.bfloat16, torch.float16) else fp32_checkpoint_dtype()
    kv_b = 1 if step.kv_cache_dtype != "auto" else torch.empty(0, dtype=dtype).element_size()
    return {"bytes": kv_cache_bytes(resolve_arch(model_config), tokens, kv_b), "tokens": tokens, "rows": rows}


def _size_cpu_engine(plan: GenerationPlan, gen: GenerationSpec, model_config) -> None:
    """The CPU engine's KV cache and batch: the calculator's (:func:`cpu_kv_cache`) unless the run gives a KV
    size or a share of RAM (``vllm_gpu_memory_utilization``, which vLLM's CPU backend takes less this process's
    RSS); ``plan.memory`` says which."""
    kv = cpu_kv_cache(gen, model_config)
    plan.vllm_kwargs["max_num_seqs"] = kv["rows"]  # what one generation call sends
    if gen.vllm_kv_cache_gib:
        plan.vllm_kwargs["kv_cache_memory_bytes"] = int(gen.vllm_kv_cache_gib * 2**30)
        source = "vllm_kv_cache_gib"
    elif gen.vllm_gpu_memory_utilization is None:
        plan.vllm_kwargs["kv_cache_memory_bytes"] = kv["bytes"]
        source = f"calculator ({kv['rows']} sequences, {kv['tokens']} tokens in {CPU_BLOCK_TOKENS}-token blocks)"
    else:
        source = "vllm_gpu_memory_utilization (a share of RAM less this process's RSS)"
    size = plan.vllm_kwargs.get("kv_cache_memory_bytes")
    plan.memory = {
        "kv_cache_gib": None if size is None else round(size / 2**30, 3),
        "kv_cache_dtype": gen.step.kv_cache_dtype,
        "kv_source": source,
        "generation_rows": kv["rows"],
        # as the trainer resolves it without a CUDA plan
        "scoring_batch_size": scoring_batch_for_config(gen.step, model_config),
    }


def start_generation(plan: GenerationPlan, *, tokenizer, load_model, dtype: torch.dtype):
    """Carry ``plan`` out: ``(generator or None, model, info)``.

    ``load_model()``: returns the training model (called unless the weights are shared). With shared
    weights the engine starts first and the model is built on its tensors; a layout that cannot be
    shared keeps the engine and loads the model beside it (a separate copy, with a warning). With
    ``auto`` an engine that fails to start falls back to HF generate with a warning (unless the user
    set vLLM options). Generators are built by :func:`grpo_kit.generation.make_generator`.
    """
    info = plan.info()
    if plan.backend == "trl":
        return None, load_model(), info
    if plan.backend == "hf":
        if plan.warn:
            warnings.warn(
                f"generation_backend='auto': {plan.reason}; generating with HF generate", RuntimeWarning, stacklevel=2
            )
        model = load_model()
        gen = make_generator("hf", model=model, tokenizer=tokenizer)
        return gen, model, {**info, **gen.options()}
    try:
        gen = make_generator("vllm", model_dir=plan.model_dir, tokenizer=tokenizer, fallback=False, **plan.vllm_kwargs)
    except (GenerationEngineError, UnsupportedArchitectureError, ValueError) as e:
        if plan.requested == "vllm" or plan.explicit:
            raise
        reason = f"vLLM could not start ({e})"
        warnings.warn(f"generation_backend='auto': {reason}; generating with HF generate", RuntimeWarning, stacklevel=2)
        model = load_model()
        gen = make_generator("hf", model=model, tokenizer=tokenizer)
        return gen, model, {"requested": plan.requested, "backend": "hf", "reason": reason, **gen.options()}
    if gen.device == "cpu" and gen.kv_cache_dtype == "fp8":
        warnings.warn(
            "kv_cache_dtype='fp8' on vLLM's CPU backend: the KV cache really is FP8 (twice the tokens in "
            "the same memory), but the CPU backend generates with it much slower than with the default "
            "KV cache; use it to save memory, not time",
            RuntimeWarning,
            stacklevel=2,
        )
    model = None
    if plan.share_weights:
        try:
            model = gen.training_model(AutoConfig.from_pretrained(str(plan.model_dir)), dtype)
        except UnshareableError as e:
            if gen.base_weights == "fp8":  # its placeholder weights cannot serve as a separate copy
                gen.close()
                warnings.warn(
                    f"vLLM cannot share this model's FP8 weights ({e}); generating with HF generate",
                    RuntimeWarning,
                    stacklevel=2,
                )
                model = load_model()
                gen = make_generator("hf", model=model, tokenizer=tokenizer)
                return gen, model, {**info, "backend": "hf", "reason": str(e), **gen.options()}
            warnings.warn(
                f"vLLM cannot share this model's weights ({e}); keeping a separate engine copy, synced each step",
                RuntimeWarning,
                stacklevel=2,
            )
            gen.share_weights = False
            info["weights"] = f"separate copy ({e})"
    if model is None:
        model = load_model()
    return gen, model, {**info, **gen.options()}
