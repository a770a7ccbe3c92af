"""The config's validation: what each field allows (its range, its choices, its type) and which fields must agree,
checked once at the edge by :func:`validate_config` (``GRPOKitConfig.validate``). Every problem is one line naming
the field, the value and what is allowed; all of them are reported in one ``ConfigError``, before any model loads.
Each check's ``cfg`` is a ``GRPOKitConfig`` (not imported: ``grpo_kit.app.config`` imports this module).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import os
import reprlib
from pathlib import Path

import torch

from grpo_kit.app.run_folder import unsafe_run_folder
from grpo_kit.generation.base import GENERATION_BACKENDS
from grpo_kit.generation.sync import LORA_SYNC_MODES
from grpo_kit.loss.advantage import SCALE_REWARDS
from grpo_kit.loss.objective import ENGINE_IS_MODES, ENGINE_IS_TOKEN_MODES, IMPORTANCE_SAMPLING_LEVELS, ObjectiveSpec
from grpo_kit.loss.registry import registered_loss_types
from grpo_kit.memory.formulas import KV_DTYPE_BYTES
from grpo_kit.model.fp8 import BASE_WEIGHTS, FP8_BLOCK, fp8_support
from grpo_kit.model.loading import check_model_name
from grpo_kit.model.nf4_matmul import NF4_MATMULS
from grpo_kit.tasks.data import ARITHMETIC_TASKS, TASKS, task_levels
from grpo_kit.tasks.rewards import REWARD_ERRORS, get_reward_funcs
from grpo_kit.tasks.sandbox import FILESYSTEMS
from grpo_kit.tasks.tools import get_tools, resolve_environment

DTYPES = ("auto", "fp32", "bf16", "fp16")
DEVICES = ("auto", "cpu", "cuda")
TRAINERS = ("grpo_kit", "trl")
# auto: the KV cache in the model's dtype; else a dtype the calculator prices that is narrower than 16 bit (FP8)
KV_CACHE_DTYPES = ("auto", *(name for name, size in KV_DTYPE_BYTES.items() if size < 2))
# The experiment trackers report_to names (TRL's names): the modules whose presence makes each available (as
# transformers checks it) and the package that installs it.
TRACKERS = {
    "tensorboard": (("tensorboard", "tensorboardX"), "tensorboard"),
    "wandb": (("wandb",), "wandb"),
    "trackio": (("trackio",), "trackio"),
}
# transformers' SchedulerType values, written out because importing transformers would make this module heavy;
# tests/test_config.py holds them equal to transformers'.
LR_SCHEDULER_TYPES = (
    "linear",
    "cosine",
    "cosine_with_restarts",
    "polynomial",
    "constant",
    "constant_with_warmup",
    "inverse_sqrt",
    "reduce_lr_on_plateau",
    "cosine_with_min_lr",
    "cosine_warmup_with_min_lr",
    "warmup_stable_decay",
    "greedy",
)


class ConfigError(ValueError):
    """A config value that is not allowed; the message names the field and the options."""


# Upper bounds of the counts and sizes whose range has no natural end: far beyond any run the kit can make, low
# enough that a typo (1e12) is refused with its limit instead of failing later (an overflow, an allocation, a loop
# that never ends). The sizes that depend on the model, the task or the machine are checked again before the model
# loads (grpo_kit.app.run: lora_rank against the hidden size, the data against the task, the step against memory).
MAX_STEPS = 10**7
MAX_BATCH = 2**16  # sequences in one micro-batch, one generation batch or one group
MAX_TOKENS = 2**20  # prompt or completion tokens: beyond every model's context
MAX_SAMPLES = 10**6
NUMERIC_LIMITS = {
    "max_steps": MAX_STEPS,
    "save_steps": MAX_STEPS,
    "keep_checkpoints": 10**4,
    "max_bad_steps": MAX_STEPS,
    "logging_steps": MAX_STEPS,
    "num_train_samples": MAX_SAMPLES,
    "num_eval_samples": MAX_SAMPLES,
    "num_generations": MAX_BATCH,
    "per_device_train_batch_size": MAX_BATCH,
    "gradient_accumulation_steps": MAX_BATCH,
    "max_prompt_length": MAX_TOKENS,
    "max_completion_length": MAX_TOKENS,
    "temperature": 100,
    "top_k": MAX_TOKENS,
    "beta": 1000,
    "epsilon_high": 100,
    "num_iterations": 1000,
    "reward_time_limit_s": 3600,
    "learning_rate": 1,
    "warmup_steps": MAX_STEPS,
    "weight_decay": 10,
    "max_grad_norm": 1e6,
    "lora_rank": MAX_BATCH,
    "lora_alpha": MAX_TOKENS,
    "vllm_kv_cache_gib": 4096,
    "loss_chunk_size": MAX_BATCH * MAX_TOKENS,
    "scoring_batch_size": MAX_BATCH,
    "tool_time_limit_s": 3600,
    "tool_output_tokens": MAX_TOKENS,
    "max_tool_calling_iterations": 1000,
    "tool_warmup_steps": MAX_STEPS,
    "tool_warmup_learning_rate": 1,
}
# The allowed range of every numeric field: (low, high, low_open, high_open); None: only NUMERIC_LIMITS' bound.
# validate() also refuses NaN and infinities in every float field, and bools where numbers are expected.
NUMERIC_RANGES = {
    "seed": (0, 2**32 - 1, False, False),
    "max_steps": (1, None, False, False),
    "save_steps": (0, None, False, False),
    "keep_checkpoints": (0, None, False, False),
    "max_bad_steps": (1, None, False, False),
    "logging_steps": (1, None, False, False),
    "num_train_samples": (1, None, False, False),
    "num_eval_samples": (0, None, False, False),
    "num_generations": (2, None, False, False),
    "per_device_train_batch_size": (1, None, False, False),
    "gradient_accumulation_steps": (1, None, False, False),
    "max_prompt_length": (1, None, False, False),
    "max_completion_length": (1, None, False, False),
    "temperature": (0, None, True, False),
    "top_p": (0, 1, True, False),
    "top_k": (0, None, False, False),
    "min_p": (0, 1, False, True),
    "beta": (0, None, False, False),
    "epsilon": (0, 1, False, True),
    "epsilon_high": (0, None, True, False),
    "num_iterations": (1, None, False, False),
    "reward_time_limit_s": (0, None, False, False),
    "learning_rate": (0, None, True, False),
    "warmup_steps": (0, None, False, False),
    "weight_decay": (0, None, False, False),
    "max_grad_norm": (0, None, False, False),
    "lora_rank": (1, None, False, False),
    "lora_alpha": (1, None, False, False),
    "lora_dropout": (0, 1, False, True),
    "vllm_gpu_memory_utilization": (0, 1, True, False),
    "vllm_kv_cache_gib": (0, None, True, False),
    "loss_chunk_size": (1, None, False, False),
    "scoring_batch_size": (1, None, False, False),
    "tool_time_limit_s": (0, None, False, False),
    "tool_output_tokens": (1, None, False, False),
    "max_tool_calling_iterations": (1, None, False, False),
    "load_in_4bit_auto_allowance": (0, 4, False, False),
    "tool_warmup_steps": (0, None, False, False),
    "tool_warmup_learning_rate": (0, None, True, False),
}
MAX_LIST_ENTRIES = 10_000
# Why a bound is what it is, where that is not obvious; appended to the message.
_RANGE_NOTES = {
    "num_generations": "advantages compare completions within a group",
    "vllm_gpu_memory_utilization": "or null for automatic",
    "vllm_kv_cache_gib": "or null for automatic",
    "max_grad_norm": "0: no clipping",
    "reward_time_limit_s": "0: no limit; at most an hour",
    "epsilon_high": "or null for the same as epsilon",
    "loss_chunk_size": "or null for automatic",
    "scoring_batch_size": "or 'auto', or null for per_device_train_batch_size",
    "min_p": "0 or null: off",
}
# The fields with a fixed set of values, each read from the module that owns it (null also allowed where the
# field's type says `| None`). A callable is read when a value is checked: loss types registered after import
# (grpo_kit.loss.registry.register_loss) are then allowed too.
CHOICES = {
    "device": DEVICES,
    "dtype": DTYPES,
    "trainer": TRAINERS,
    "task": TASKS,
    "loss_type": registered_loss_types,
    "scale_rewards": SCALE_REWARDS,
    "reward_errors": REWARD_ERRORS,
    "generation_backend": GENERATION_BACKENDS,
    "lr_scheduler_type": LR_SCHEDULER_TYPES,
    "kv_cache_dtype": KV_CACHE_DTYPES,
    "vllm_lora_sync": LORA_SYNC_MODES,
    "load_in_4bit_matmul": NF4_MATMULS,
    "importance_sampling_level": IMPORTANCE_SAMPLING_LEVELS,
    "base_weights": BASE_WEIGHTS,
    "fp8_block": (FP8_BLOCK,),
    "vllm_importance_sampling_mode": ENGINE_IS_MODES,
    "sandbox_filesystem": FILESYSTEMS,
}


def choices(name: str) -> list:
    """The values a field with a fixed set of values allows, now."""
    allowed = CHOICES[name]
    return list(allowed() if callable(allowed) else allowed)


def _range_text(low, high, low_open: bool, high_open: bool) -> str:
    if high is None:
        return f"> {low}" if low_open else f"at least {low}"
    return f"in {'(' if low_open else '['}{low}, {high}{')' if high_open else ']'}"


def numeric_problem(name: str, value, kind: str) -> str | None:
    """The message for a numeric field outside its type or range (NUMERIC_RANGES), else None."""
    low, high, low_open, high_open = NUMERIC_RANGES[name]
    wanted = "an integer" if kind == "int" else "a finite number"
    note = f" ({_RANGE_NOTES[name]})" if name in _RANGE_NOTES else ""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (kind == "int" and not isinstance(value, int)):
        return f"{name}={short(value)} must be {wanted} {_range_text(low, high, low_open, high_open)}{note}"
    ok = (
        math.isfinite(value)
        and (value > low if low_open else value >= low)
        and (high is None or (value < high if high_open else value <= high))
    )
    if ok:
        limit = NUMERIC_LIMITS.get(name)
        return None if limit is None or value <= limit else f"{name}={short(value)} must be at most {limit}{note}"
    finite = "" if kind == "int" else " and finite"
    return f"{name}={value!r} must be {_range_text(low, high, low_open, high_open)}{finite}{note}"


def _hashable_in(value, options: list) -> bool:
    """``value in options`` for a value of any type (a nested list is compared by type first, never walked)."""
    return isinstance(value, (str, int, float, type(None))) and value in options


def allowed_text(name: str, kind: str) -> str:
    """What a field takes, from its range, its choices or its type (``kind``: the annotation as a string)."""
    extra = [*(["'auto'"] if "| str" in kind else []), *(["null"] if kind.endswith("| None") else [])]
    if name in NUMERIC_RANGES:
        base = ("an integer " if kind.startswith("int") else "a number ") + _range_text(*NUMERIC_RANGES[name])
        base += f", at most {NUMERIC_LIMITS[name]}" if name in NUMERIC_LIMITS else ""
    elif name in CHOICES:
        base = f"one of {choices(name)}"
    elif kind.startswith("bool"):
        base = "true, false"
    elif kind.startswith(("int", "float")):
        base = "an integer" if kind.startswith("int") else "a number"
    else:
        return ""
    return base + "".join(f", {e}" for e in extra[:-1]) + (f" or {extra[-1]}" if extra else "")


def _field_problem(name: str, value, kind: str, objective: bool) -> str | None:
    """One field checked alone (its type, range or choices), or None when it is fine. ``kind``: the field's
    annotation as a string; ``| None`` allows null, ``| str`` allows 'auto'. ``objective``: one of the objective's
    further options (``ObjectiveSpec``'s), which it checks itself."""
    if (value is None and kind.endswith("| None")) or (value == "auto" and "| str" in kind):
        return None
    if name in NUMERIC_RANGES:
        return numeric_problem(name, value, "int" if kind.startswith("int") else "float")
    if name in CHOICES:
        options = choices(name)
        return (
            None
            if _hashable_in(value, options)
            else (
                f"{name}={short(value)} is not allowed; choose one of {options}"
                + (" or null" if kind.endswith("| None") else "")
            )
        )
    if kind.startswith("bool"):
        return None if isinstance(value, bool) else f"{name}={short(value)} is not allowed: {allowed_text(name, kind)}"
    if objective:  # the objective's own checks (ObjectiveSpec), one field at a time
        try:
            ObjectiveSpec(**{name: value})
        except ValueError as e:
            return f"{name}={value!r} is not allowed: {e}"
    return None


LIST_FIELDS = ("levels", "reward_funcs", "reward_weights", "tools")


def _run_problems(cfg, kind: str | None, bad: set[str]) -> list[str]:
    """Fields that must agree: the batch with the group size, checkpoints with logging, the reference model
    with the weights. ``bad``: fields already refused alone (not checked again here)."""
    errors = []
    # TRL builds its reference model for full fine-tuning from the policy's checkpoint folder, which a random
    # built-in does not have (TRL fails deep inside from_pretrained otherwise)
    if "beta" not in bad and not (cfg.use_lora or cfg.beta == 0 or kind not in ("tiny", "config-only")):
        errors.append(
            f"use_lora=False with beta={cfg.beta} needs a reference model, which TRL loads from the "
            f"model's checkpoint folder; model={cfg.model!r} is a random-weight built-in with none. Set "
            "beta=0, or use_lora=True (the reference is the model with its adapter off), or save the "
            "model and set model= to that folder"
        )
    if not bad & {"num_generations", "per_device_train_batch_size", "gradient_accumulation_steps"}:
        total = cfg.per_device_train_batch_size * cfg.gradient_accumulation_steps
        if total % cfg.num_generations:
            errors.append(
                f"per_device_train_batch_size × gradient_accumulation_steps = {total} must be a multiple "
                f"of num_generations={cfg.num_generations} (e.g. {cfg.num_generations} or "
                f"{2 * cfg.num_generations})"
            )
    if not bad & {"save_steps", "logging_steps"} and cfg.save_steps > 0 and cfg.save_steps % cfg.logging_steps:
        errors.append(
            f"save_steps={cfg.save_steps} must be a multiple of logging_steps={cfg.logging_steps} (a "
            "checkpoint between two logged steps would lose the metrics of the steps in between on resume)"
        )
    if not (isinstance(cfg.output_dir, str) and cfg.output_dir.strip()):
        errors.append(f"output_dir={cfg.output_dir!r} must name a run folder (a non-empty path)")
    elif (blocker := _non_folder_on_path(cfg.output_dir)) is not None:
        errors.append(f"output_dir={cfg.output_dir!r} cannot be a run folder: {blocker!r} exists and is not a folder")
    elif (why := unsafe_run_folder(cfg.output_dir)) is not None:
        errors.append(f"output_dir={cfg.output_dir!r} cannot be a run folder: {why}")

    if cfg.prefix_sharing is True and cfg.trainer != "grpo_kit":
        errors.append(
            "prefix_sharing=true needs trainer='grpo_kit' (TRL's GRPOTrainer scores every row's prompt); "
            "leave it 'auto' or false with trainer='trl'"
        )
    if cfg.scoring_batch_size not in (None, "auto") and cfg.trainer != "grpo_kit":
        errors.append(
            f"scoring_batch_size={cfg.scoring_batch_size} needs trainer='grpo_kit' (TRL's GRPOTrainer "
            "scores with per_device_train_batch_size); leave it 'auto' or null with trainer='trl'"
        )
    return errors


def _not_lists(cfg) -> list[str]:
    """The list fields that are no flat list of single values (the element checks need them)."""
    return [p for name in LIST_FIELDS if (p := plain_list_problem(name, getattr(cfg, name)))]


def _list_problems(cfg) -> list[str] | None:
    """The list fields' elements (None when one of them is no list at all); the reward functions are
    resolved here (built-in names, ``module:function`` strings imported, callables)."""
    if _not_lists(cfg):
        return None
    errors = []
    targets = cfg.lora_target_modules
    if targets != "auto" and not (
        isinstance(targets, list)
        and plain_list_problem("lora_target_modules", targets) is None
        and targets
        and all(isinstance(m, str) and m.strip() for m in targets)
    ):
        errors.append(
            f"lora_target_modules={short(targets)}: 'auto' or a list of module names (non-empty strings), at least one"
        )
    bad_weights = [
        w for w in cfg.reward_weights if isinstance(w, bool) or not isinstance(w, (int, float)) or not math.isfinite(w)
    ]
    if bad_weights:
        errors.append(f"reward_weights={cfg.reward_weights!r}: each must be a finite number, not {bad_weights[0]!r}")
    if not cfg.reward_funcs:
        errors.append(f"reward_funcs={cfg.reward_funcs!r}: at least one is needed")
    try:
        get_reward_funcs(cfg.reward_funcs)
    except ValueError as e:
        errors.append(f"reward_funcs: {e}")
    try:
        get_tools(cfg.tools)
    except ValueError as e:
        errors.append(f"tools: {e}")
    try:
        resolve_environment(cfg.environment) if cfg.environment is not None else None
    except ValueError as e:
        errors.append(str(e))
    if cfg.tool_warmup_steps and "calculator" not in cfg.tools:
        errors.append(
            f"tool_warmup_steps={cfg.tool_warmup_steps} writes calculator transcripts, but tools="
            f"{cfg.tools!r} has no 'calculator'; add it or set tool_warmup_steps=0"
        )
    if cfg.tool_warmup_steps and cfg.task not in ARITHMETIC_TASKS:
        errors.append(
            f"tool_warmup_steps={cfg.tool_warmup_steps} needs questions holding one arithmetic expression "
            f"(task {' or '.join(ARITHMETIC_TASKS)}), but task={cfg.task!r}"
        )
    if cfg.reward_weights and len(cfg.reward_weights) != len(cfg.reward_funcs):
        errors.append(
            f"reward_weights has {len(cfg.reward_weights)} entries but reward_funcs has {len(cfg.reward_funcs)}"
        )
    allowed = task_levels(cfg.task)
    bad_levels = [lv for lv in cfg.levels if isinstance(lv, bool) or lv not in allowed]
    if cfg.task != "gsm8k" and (not cfg.levels or bad_levels):
        errors.append(f"levels={cfg.levels!r}: each must be one of {list(allowed)} for task={cfg.task!r}, at least one")
    skip = cfg.load_in_4bit_skip_modules
    if skip != "auto" and not (isinstance(skip, list) and all(isinstance(m, str) and m for m in skip)):
        errors.append(f"load_in_4bit_skip_modules={skip!r} is not allowed: 'auto' or a list of non-empty module names")
    return errors


def _generation_problems(cfg) -> list[str]:
    """The generation options that must agree with the backend, the trainer and the LoRA setting."""
    errors = []
    if cfg.vllm_share_weights is True and not (cfg.use_lora and not cfg.load_in_4bit):
        errors.append(
            f"vllm_share_weights=True needs use_lora=True and load_in_4bit=False (use_lora={cfg.use_lora}, "
            f"load_in_4bit={cfg.load_in_4bit}): full fine-tuning updates the weights vLLM would share, "
            "and a 4-bit training model has no 16-bit weights to share"
        )
    if cfg.vllm_lora_sync is not None and not cfg.use_lora:
        errors.append(
            f"vllm_lora_sync={cfg.vllm_lora_sync!r} needs use_lora=True (full fine-tuning syncs the whole weights)"
        )
    if cfg.vllm_lora_sync == "merge" and cfg.vllm_lora_dual_stream:
        errors.append(
            "vllm_lora_dual_stream=True needs the adapter in vLLM's LoRA kernels, but vllm_lora_sync="
            "'merge' generates with merged weights and no LoRA kernels; drop one of the two"
        )
    if (
        cfg.loss_type == "vespo"
        and cfg.generation_backend == "vllm"
        and cfg.vllm_importance_sampling_mode not in ENGINE_IS_TOKEN_MODES
    ):
        errors.append(
            f"loss_type='vespo' with vLLM generation weights each token by its own importance ratio, but "
            f"vllm_importance_sampling_mode={cfg.vllm_importance_sampling_mode!r} forms one per sequence; "
            f"set it to {' or '.join(map(repr, ENGINE_IS_TOKEN_MODES))}"
        )
    vllm_only = cfg.vllm_options_set()
    if (
        cfg.generation_backend == "vllm" or (vllm_only and cfg.generation_backend != "hf")
    ) and cfg.trainer != "grpo_kit":
        errors.append(
            f"generation_backend={cfg.generation_backend!r} with {', '.join(vllm_only) or 'vLLM'} needs "
            "trainer='grpo_kit' (trainer='trl' generates with TRL's own HF path)"
        )
    if vllm_only and cfg.generation_backend == "hf":
        errors.append(
            f"{', '.join(vllm_only)} only apply to vLLM generation, but generation_backend='hf'; set "
            "generation_backend='vllm' (or 'auto'), or leave them at their defaults"
        )
    return errors


def _4bit_problems(cfg) -> list[str]:
    """What load_in_4bit needs: LoRA, a CUDA GPU, bitsandbytes and HF generation."""
    if not cfg.load_in_4bit:
        return []
    errors = []
    if not cfg.use_lora:
        errors.append(
            "load_in_4bit=True needs use_lora=True: 4-bit weights are frozen (bitsandbytes stores them "
            "packed, they have no gradient), so full fine-tuning would train nothing"
        )
    if cfg.device == "cpu":
        errors.append(
            "load_in_4bit=True needs a CUDA GPU (bitsandbytes' 4-bit training path), but device='cpu'; "
            "use device=auto on a GPU machine, or load_in_4bit=False"
        )
    elif cfg.device == "auto" and not torch.cuda.is_available():  # where the run will train, known before loading
        errors.append(
            "load_in_4bit=True needs a CUDA GPU (bitsandbytes' 4-bit training path), but device='auto' "
            "finds none on this machine; run on a GPU machine or set load_in_4bit=False"
        )
    if cfg.generation_backend == "vllm":
        errors.append(
            "load_in_4bit=True generates with HF generate: vLLM cannot take a 4-bit training model's "
            "weights yet; set generation_backend='hf' or 'auto'"
        )
    if importlib.util.find_spec("bitsandbytes") is None:
        errors.append(
            "load_in_4bit=True needs the bitsandbytes package, which is not installed: python -m pip "
            "install bitsandbytes==0.50.2 (CUDA), or set load_in_4bit=False"
        )
    return errors


def _fp8_problems(cfg) -> list[str]:
    """What base_weights='fp8' needs: LoRA, no 4-bit, vLLM on shared weights with the adapter unmerged, and a
    device with FP8 tensor cores (where the run will train, known before any model loads:
    grpo_kit.model.fp8.fp8_support names it)."""
    if cfg.base_weights != "fp8":
        return (
            [
                f"fp8_block={cfg.fp8_block} applies to base_weights='fp8' only (base_weights={cfg.base_weights!r}); "
                "leave it null"
            ]
            if cfg.fp8_block is not None
            else []
        )
    errors = []
    if not cfg.use_lora:
        errors.append(
            "base_weights='fp8' needs use_lora=True: the FP8 base weights are frozen (no gradient reaches "
            "them, only the LoRA adapters on top train), so full fine-tuning would train nothing; use "
            "base_weights='16bit' for full fine-tuning"
        )
    if cfg.load_in_4bit:
        errors.append(
            "base_weights='fp8' and load_in_4bit=True are two formats for the same base weights; choose "
            "one (FP8 on GPUs with FP8 tensor cores, 4 bit elsewhere)"
        )
    if cfg.vllm_lora_sync == "merge":
        errors.append(
            "base_weights='fp8' with vllm_lora_sync='merge': a merge into the FP8 weights would round them "
            "again, so their exact bits could not be restored; leave vllm_lora_sync null (the adapter runs "
            "in vLLM's LoRA kernels) or use base_weights='16bit'"
        )
    if cfg.generation_backend == "vllm" and cfg.vllm_share_weights is False:
        errors.append(
            "base_weights='fp8' with generation_backend='vllm' needs vllm_share_weights 'auto' or true: "
            "vLLM serves the training model's own FP8 codes, there is no separate FP8 copy to sync"
        )
    device = cfg.device if cfg.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    if cfg.device in DEVICES and (why := fp8_support(device)) is not None:
        errors.append(f"base_weights='fp8': {why}")
    return errors


def tracker_installed(name: str) -> bool:
    """Whether the experiment tracker ``name`` (a ``TRACKERS`` key) can be imported here."""
    return any(importlib.util.find_spec(module) is not None for module in TRACKERS[name][0])


def _tracker_problems(cfg) -> list[str]:
    """report_to: 'none', 'all', or known tracker names, each installed (else its install command)."""
    value = cfg.report_to
    if value in ("none", "all"):
        return []
    names = [value] if isinstance(value, str) else value
    if not (isinstance(names, list) and names and all(isinstance(n, str) for n in names)):
        return [
            f"report_to={short(value)} is not allowed: 'none', 'all', or tracker names from {list(TRACKERS)} "
            "(a list or a comma-separated string)"
        ]
    unknown = [n for n in names if n not in TRACKERS]
    if unknown:
        return [
            f"report_to={short(value)}: {short(unknown[0])} is not a tracker the kit passes on; choose from "
            f"{list(TRACKERS)} (several as a list), or 'none' or 'all' alone"
        ]
    return [
        f"report_to={short(value)}: {n} is not installed; install it with `python -m pip install "
        f"{TRACKERS[n][1]}`, or drop it from report_to"
        for n in names
        if not tracker_installed(n)
    ]


def _data_problems(cfg) -> list[str]:
    """The GSM8K files exist, and a held-out file only where the task reads one."""
    errors = [
        f"{name}={getattr(cfg, name)!r} does not exist"
        for name in ("dataset_path", "eval_dataset_path")
        if cfg.task == "gsm8k" and getattr(cfg, name) and not os.path.isfile(getattr(cfg, name))
    ]
    if cfg.eval_dataset_path and cfg.task != "gsm8k":
        errors.append(
            f"eval_dataset_path={cfg.eval_dataset_path!r} applies to task='gsm8k' only (task="
            f"{cfg.task!r}: its held-out set is generated)"
        )
    return errors


_SHORT = reprlib.Repr()
_SHORT.maxlevel, _SHORT.maxlist, _SHORT.maxtuple, _SHORT.maxdict = 3, 8, 8, 8
_SHORT.maxstring, _SHORT.maxother, _SHORT.maxlong = 200, 200, 60


def short(value) -> str:
    """``repr(value)`` cut short for a message: a nested or self-referring value costs no more than its first
    entries (a plain ``repr`` of an alias bomb runs out of memory, of a deep list out of recursion)."""
    return _SHORT.repr(value)


def plain_list_problem(name: str, value) -> str | None:
    """Why a list field's value is not a flat list of plain values (or callables), else None."""
    if not isinstance(value, list):
        return f"{name}={short(value)} must be a list"
    if len(value) > MAX_LIST_ENTRIES:
        return f"{name}: {len(value)} entries; at most {MAX_LIST_ENTRIES}"
    bad = next((v for v in value if isinstance(v, (list, tuple, dict, set))), None)
    return None if bad is None else f"{name}={short(value)}: each entry must be a single value, not {short(bad)}"


def _non_folder_on_path(path: str) -> str | None:
    """The first existing path on the way to ``path`` (itself included) that is not a folder, or None."""
    p = Path(path).absolute()
    for q in (p, *p.parents):
        if q.exists() or q.is_symlink():
            return None if q.is_dir() else str(q)
    return None


def validate_config(cfg) -> None:
    """Check every field of ``cfg`` (a ``GRPOKitConfig``); raise one ``ConfigError`` listing all problems. Loads
    nothing heavy."""
    errors: list[str] = []
    kind = None
    try:
        kind = check_model_name(cfg.model)
    except ValueError as e:
        errors.append(str(e))
    bad = set()
    for f in dataclasses.fields(cfg):
        problem = _field_problem(f.name, getattr(cfg, f.name), str(f.type), bool(f.metadata.get("objective")))
        if problem:
            errors.append(problem)
            bad.add(f.name)
    errors += _run_problems(cfg, kind, bad)
    list_errors = _list_problems(cfg)
    if list_errors is None:  # a list field that is no list: the element checks below need lists
        raise ConfigError("invalid config:\n  - " + "\n  - ".join(errors + _not_lists(cfg)))
    errors += list_errors + _generation_problems(cfg) + _4bit_problems(cfg) + _data_problems(cfg)
    errors += _tracker_problems(cfg)
    errors += _fp8_problems(cfg)
    if errors:
        raise ConfigError("invalid config:\n  - " + "\n  - ".join(errors))
