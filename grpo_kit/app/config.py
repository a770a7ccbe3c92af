"""The one config object of the kit: ``GRPOKitConfig``.

Field names follow TRL's ``GRPOConfig`` where the meaning is the same. The config is
validated once, at the edge (CLI, YAML, notebook parameters), by ``validate()``; every
problem is reported in one ``ConfigError`` naming the field, the value and what is
allowed, before any model is loaded. Inside the kit it is trusted.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib.util
import json
import math
import os
import reprlib
import textwrap
import typing
from dataclasses import dataclass, field
from pathlib import Path

import torch
import yaml

from grpo_kit.app.run_folder import unsafe_run_folder
from grpo_kit.app.specs import layer_spec
from grpo_kit.generation.base import GENERATION_BACKENDS
from grpo_kit.generation.spec import GenerationSpec
from grpo_kit.generation.sync import LORA_SYNC_MODES
from grpo_kit.loss.advantage import SCALE_REWARDS
from grpo_kit.loss.objective import (
    ENGINE_IS_DEFAULT,
    ENGINE_IS_MODES,
    ENGINE_IS_TOKEN_MODES,
    IMPORTANCE_SAMPLING_LEVELS,
    LOSS_TYPES,
    ObjectiveSpec,
)
from grpo_kit.loss.registry import registered_loss_types
from grpo_kit.memory.formulas import KV_DTYPE_BYTES
from grpo_kit.memory.spec import StepSpec
from grpo_kit.model.devices import checkpointing_on
from grpo_kit.model.fp8 import BASE_WEIGHTS, FP8_BLOCK, fp8_support
from grpo_kit.model.loading import check_model_name
from grpo_kit.model.nf4_matmul import NF4_MATMULS
from grpo_kit.readers.bounded import InputError, parse_json
from grpo_kit.tasks.data import ARITHMETIC_TASKS, LEVELS, TASKS
from grpo_kit.tasks.rewards import (
    REWARD_ERRORS,
    REWARD_FUNCTIONS,
    REWARD_TIME_LIMIT_S,
    get_reward_funcs,
    reward_func_spec,
)
from grpo_kit.tasks.sandbox import FILESYSTEMS
from grpo_kit.tasks.tools import (
    READY_TOOLS,
    TOOL_OUTPUT_TOKENS,
    TOOL_TIME_LIMIT_S,
    get_tools,
    resolve_environment,
    tool_spec,
)

REWARD_FUNCS = tuple(REWARD_FUNCTIONS)
DTYPES = ("auto", "fp32", "bf16", "fp16")
DEVICES = ("auto", "cpu", "cuda")
TRAINERS = ("grpo_kit", "trl")
# auto: the KV cache in the model's dtype; else a dtype the calculator prices that is narrower than 16 bit (FP8)
KV_CACHE_DTYPES = ("auto", *(name for name, size in KV_DTYPE_BYTES.items() if size < 2))
# The experiment trackers report_to names (TRL's names): the modules whose presence makes each available (as
# transformers checks it) and the package that installs it.
TRACKERS = {"tensorboard": (("tensorboard", "tensorboardX"), "tensorboard"), "wandb": (("wandb",), "wandb"),
            "trackio": (("trackio",), "trackio")}
# Fields whose "automatic" value is null (as in TRL); configs saved before they were, wrote 0 for it. A run folder
# of that time resumes with 0 read as null (resume_policy.resume_config); a new config's 0 is refused with the note.
NULL_MEANS_AUTO = ("epsilon_high", "loss_chunk_size", "vllm_gpu_memory_utilization")
# transformers' SchedulerType values, written out because importing transformers would make this module heavy;
# tests/test_config.py holds them equal to transformers'.
LR_SCHEDULER_TYPES = ("linear", "cosine", "cosine_with_restarts", "polynomial", "constant", "constant_with_warmup",
                      "inverse_sqrt", "reduce_lr_on_plateau", "cosine_with_min_lr", "cosine_warmup_with_min_lr",
                      "warmup_stable_decay", "greedy")

# The kit's defaults for fields TRL's GRPOConfig also has, where they differ from TRL's (each with its reason);
# every other TRL-named field has TRL's default (tests/test_config.py holds both).
KIT_DEFAULTS_OVER_TRL = {
    "output_dir": "runs/default",  # one run folder per run, beside the others
    "seed": 0,
    "max_steps": 40,  # a run that learns arithmetic on the CPU
    "save_steps": 10,
    "logging_steps": 1,  # a metrics.csv row and a console line every step
    "per_device_train_batch_size": StepSpec.per_device_train_batch_size,  # 2 prompts a step (StepSpec says why)
    "max_completion_length": StepSpec.max_completion_length,  # the arithmetic task's answers are short
    "temperature": 0.7,
    "beta": 0.04,  # DeepSeekMath's KL coefficient
    "loss_type": "grpo",  # DeepSeekMath's per-sequence normalisation
    "reward_weights": [],  # empty: all 1.0 (TRL: None)
    "learning_rate": 2e-4,  # a LoRA adapter's rate
    "lr_scheduler_type": "constant_with_warmup",
    "warmup_steps": 2,
    "use_bias_correction_kl": False,  # DeepSeekMath's plain k3 estimator (TRL multiplies it by the ratio)
    "vllm_gpu_memory_utilization": None,  # null: sized from the VRAM calculator for the kit's own engine
    "gradient_checkpointing": "auto",  # on where it saves memory (CUDA), off where it only recomputes (CPU)
}
# TRL-named fields that do not go to GRPOConfig: the kit's own vLLM engine takes this one (TRL's configures TRL's).
KIT_ONLY_TRL_NAMES = ("vllm_gpu_memory_utilization",)
# ObjectiveSpec's name for TRL's epsilon (the config keeps TRL's name).
OBJECTIVE_RENAMES = {"epsilon_low": "epsilon"}


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
    "max_steps": MAX_STEPS, "save_steps": MAX_STEPS, "keep_checkpoints": 10**4, "max_bad_steps": MAX_STEPS,
    "logging_steps": MAX_STEPS, "num_train_samples": MAX_SAMPLES, "num_eval_samples": MAX_SAMPLES,
    "num_generations": MAX_BATCH, "per_device_train_batch_size": MAX_BATCH, "gradient_accumulation_steps": MAX_BATCH,
    "max_prompt_length": MAX_TOKENS, "max_completion_length": MAX_TOKENS, "temperature": 100, "top_k": MAX_TOKENS,
    "beta": 1000, "epsilon_high": 100, "num_iterations": 1000, "reward_time_limit_s": 3600, "learning_rate": 1,
    "warmup_steps": MAX_STEPS, "weight_decay": 10, "max_grad_norm": 1e6, "lora_rank": MAX_BATCH,
    "lora_alpha": MAX_TOKENS, "vllm_kv_cache_gib": 4096, "loss_chunk_size": MAX_BATCH * MAX_TOKENS,
    "scoring_batch_size": MAX_BATCH, "tool_time_limit_s": 3600, "tool_output_tokens": MAX_TOKENS,
    "max_tool_calling_iterations": 1000, "tool_warmup_steps": MAX_STEPS, "tool_warmup_learning_rate": 1,
}
# The allowed range of every numeric field: (low, high, low_open, high_open); None: only NUMERIC_LIMITS' bound.
# validate() also refuses NaN and infinities in every float field, and bools where numbers are expected.
NUMERIC_RANGES = {
    "seed": (0, 2**32 - 1, False, False), "max_steps": (1, None, False, False),
    "save_steps": (0, None, False, False), "keep_checkpoints": (0, None, False, False),
    "max_bad_steps": (1, None, False, False), "logging_steps": (1, None, False, False),
    "num_train_samples": (1, None, False, False), "num_eval_samples": (0, None, False, False),
    "num_generations": (2, None, False, False), "per_device_train_batch_size": (1, None, False, False),
    "gradient_accumulation_steps": (1, None, False, False), "max_prompt_length": (1, None, False, False),
    "max_completion_length": (1, None, False, False), "temperature": (0, None, True, False),
    "top_p": (0, 1, True, False), "top_k": (0, None, False, False), "min_p": (0, 1, False, True),
    "beta": (0, None, False, False), "epsilon": (0, 1, False, True), "epsilon_high": (0, None, True, False),
    "num_iterations": (1, None, False, False), "reward_time_limit_s": (0, None, False, False),
    "learning_rate": (0, None, True, False), "warmup_steps": (0, None, False, False),
    "weight_decay": (0, None, False, False), "max_grad_norm": (0, None, False, False),
    "lora_rank": (1, None, False, False), "lora_alpha": (1, None, False, False),
    "lora_dropout": (0, 1, False, True), "vllm_gpu_memory_utilization": (0, 1, True, False),
    "vllm_kv_cache_gib": (0, None, True, False), "loss_chunk_size": (1, None, False, False),
    "scoring_batch_size": (1, None, False, False), "tool_time_limit_s": (0, None, False, False),
    "tool_output_tokens": (1, None, False, False), "max_tool_calling_iterations": (1, None, False, False),
    "load_in_4bit_auto_allowance": (0, 4, False, False), "tool_warmup_steps": (0, None, False, False),
    "tool_warmup_learning_rate": (0, None, True, False),
}

# What a YAML config (file or --set value) may hold: a config is a flat mapping of short values, so anything
# larger is refused before it is built (an alias bomb expands to billions of entries from a few lines).
MAX_YAML_BYTES = 1 << 20
MAX_YAML_DEPTH = 16
MAX_YAML_ALIASES = 100
MAX_YAML_NODES = 100_000  # after aliases are expanded
MAX_LIST_ENTRIES = 10_000
# Why a bound is what it is, where that is not obvious; appended to the message.
_RANGE_NOTES = {
    "num_generations": "advantages compare completions within a group",
    "vllm_gpu_memory_utilization": "or null for automatic", "vllm_kv_cache_gib": "or null for automatic",
    "max_grad_norm": "0: no clipping", "reward_time_limit_s": "0: no limit; at most an hour",

    "epsilon_high": "or null for the same as epsilon", "loss_chunk_size": "or null for automatic",
    "scoring_batch_size": "or 'auto', or null for per_device_train_batch_size",
    "min_p": "0 or null: off",
}
# The fields with a fixed set of values, each read from the module that owns it (null also allowed where the
# field's type says `| None`). A callable is read when a value is checked: loss types registered after import
# (grpo_kit.loss.registry.register_loss) are then allowed too.
CHOICES = {
    "device": DEVICES, "dtype": DTYPES, "trainer": TRAINERS, "task": TASKS, "loss_type": registered_loss_types,
    "scale_rewards": SCALE_REWARDS, "reward_errors": REWARD_ERRORS, "generation_backend": GENERATION_BACKENDS,
    "lr_scheduler_type": LR_SCHEDULER_TYPES, "kv_cache_dtype": KV_CACHE_DTYPES, "vllm_lora_sync": LORA_SYNC_MODES,
    "load_in_4bit_matmul": NF4_MATMULS, "importance_sampling_level": IMPORTANCE_SAMPLING_LEVELS,
    "base_weights": BASE_WEIGHTS, "fp8_block": (FP8_BLOCK,), "vllm_importance_sampling_mode": ENGINE_IS_MODES,
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


def _numeric_problem(name: str, value, kind: str) -> str | None:
    """The message for a numeric field outside its type or range (NUMERIC_RANGES), else None."""
    low, high, low_open, high_open = NUMERIC_RANGES[name]
    wanted = "an integer" if kind == "int" else "a finite number"
    note = f" ({_RANGE_NOTES[name]})" if name in _RANGE_NOTES else ""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (kind == "int" and not isinstance(value, int)):
        return f"{name}={short(value)} must be {wanted} {_range_text(low, high, low_open, high_open)}{note}"
    ok = math.isfinite(value) and (value > low if low_open else value >= low) and (
        high is None or (value < high if high_open else value <= high))
    if ok:
        limit = NUMERIC_LIMITS.get(name)
        return None if limit is None or value <= limit else f"{name}={short(value)} must be at most {limit}{note}"
    finite = "" if kind == "int" else " and finite"
    return f"{name}={value!r} must be {_range_text(low, high, low_open, high_open)}{finite}{note}"


def _hashable_in(value, options: list) -> bool:
    """``value in options`` for a value of any type (a nested list is compared by type first, never walked)."""
    return isinstance(value, (str, int, float, type(None))) and value in options


def _allowed_text(name: str, kind: str) -> str:

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


def _field_problem(name: str, value, kind: str) -> str | None:
    """One field checked alone (its type, range or choices), or None when it is fine. ``kind``: the field's
    annotation as a string; ``| None`` allows null, ``| str`` allows 'auto'."""
    if (value is None and kind.endswith("| None")) or (value == "auto" and "| str" in kind):
        return None
    if name in NUMERIC_RANGES:
        return _numeric_problem(name, value, "int" if kind.startswith("int") else "float")
    if name in CHOICES:
        options = choices(name)
        return None if _hashable_in(value, options) else (f"{name}={short(value)} is not allowed; choose one of {options}"
                                              + (" or null" if kind.endswith("| None") else ""))
    if kind.startswith("bool"):
        return None if isinstance(value, bool) else f"{name}={short(value)} is not allowed: {_allowed_text(name, kind)}"
    if name in OBJECTIVE_FIELDS:  # the objective's own checks (ObjectiveSpec), one field at a time
        try:
            ObjectiveSpec(**{name: value})
        except ValueError as e:
            return f"{name}={value!r} is not allowed: {e}"
    return None


def _f(default, help: str, **kw):
    """A dataclass field whose help text lives in its metadata (as in TRL's configs)."""
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda d=default: type(d)(d), metadata={"help": help, **kw})
    return field(default=default, metadata={"help": help, **kw})


def _kit(name: str, help: str):
    """A TRL-named field with the kit's own default (``KIT_DEFAULTS_OVER_TRL``)."""
    return _f(KIT_DEFAULTS_OVER_TRL[name], help)


def _with_objective_fields(cls):
    """Adds every :class:`ObjectiveSpec` field the class does not declare (name, type and default read from
    ObjectiveSpec, the kit's default where ``KIT_DEFAULTS_OVER_TRL`` has one), so YAML and ``--set`` reach each
    option of the objective. Their help is TRL's (:func:`trl_field_help`)."""
    for f in dataclasses.fields(ObjectiveSpec):
        if f.name in cls.__annotations__ or f.name in OBJECTIVE_RENAMES:
            continue
        cls.__annotations__[f.name] = f.type
        setattr(cls, f.name, field(default=KIT_DEFAULTS_OVER_TRL.get(f.name, f.default), metadata={"objective": True}))
    return cls


@dataclass
@_with_objective_fields
class GRPOKitConfig:
    # --- run -------------------------------------------------------------------------
    model: str = _f(StepSpec.model, "Built-in name (see `grpo_kit.model.loading.BUILTIN_MODELS`), a local "
                    "folder, or a hub id such as `Qwen/Qwen2.5-1.5B-Instruct`.")
    output_dir: str = _kit("output_dir", "Run folder: metrics.csv, rewards.png, samples, adapter/weights.")
    seed: int = _kit("seed", "Seed for data, sampling and initialisation.")
    max_steps: int = _kit("max_steps", "Optimiser steps to run.")
    save_steps: int = _kit("save_steps", "Write a resumable checkpoint (run folder's checkpoints/checkpoint-N: weights, "
                         "optimiser, scheduler, RNG and data position, metrics so far) every N steps and at the end; "
                         "0: none. A multiple of logging_steps. Resume with `train --resume RUN_DIR`.")
    keep_checkpoints: int = _f(2, "Complete checkpoints kept (the newest N; 0: all). Older ones are deleted only "
                               "after a new one is complete.")
    max_bad_steps: int = _f(3, "Consecutive steps with a non-finite loss or gradient (each one skipped: no "
                            "optimiser update) before training stops with the state saved.")
    logging_steps: int = _kit("logging_steps", "Log metrics every N steps.")
    report_to: str | list = _f("none", "Experiment trackers that receive every logged step, as TRL's `report_to`: "
                               f"`none`, one of {list(TRACKERS)}, several as a list (`[tensorboard, wandb]`, or "
                               "the comma string `tensorboard,wandb`), or `all` (every integration transformers finds "
                               "installed). They get TRL's metrics and the kit's own (step_time_s, peak_memory_gib). "
                               "TensorBoard writes to the run folder's `tensorboard/`; W&B and Trackio log where "
                               "their own settings say (WANDB_PROJECT, WANDB_DIR; Trackio's local store). A tracker "
                               "that is not installed is refused with its install command.")
    run_name: str | None = _f(None, "The run's name in the trackers of report_to (TRL's `run_name`); null: each "
                              "tracker names it.")
    device: str = _f("auto", f"Where to train: one of {DEVICES}; `auto` picks CUDA when available.")
    dtype: str = _f(StepSpec.dtype, f"Training dtype, one of {DTYPES}; `auto`: bf16 on GPUs that support it, else fp16 "
                    "on GPU (with a GradScaler), fp32 on CPU.")
    trainer: str = _f(StepSpec.trainer, f"Which trainer runs the job, one of {TRAINERS}: `grpo_kit` is the kit's "
                      "EfficientGRPOTrainer (no full logits), `trl` TRL's stock GRPOTrainer.")
    # --- data ------------------------------------------------------------------------
    task: str = _f("arithmetic", f"Training task, one of {TASKS}.")
    levels: list = _f([1, 2], "Difficulty levels of the generated tasks (" + "; ".join(
        f"{n}: {what}" for n, what in LEVELS.items()) + ").")
    dataset_path: str = _f("", "GSM8K-format jsonl (`question`, `answer` with `#### N`) for task=gsm8k; empty: "
                           "the hub dataset openai/gsm8k's train split (needs network).")
    eval_dataset_path: str = _f("", "task=gsm8k: the held-out problems, a GSM8K-format jsonl (GSM8K's test split); "
                                "empty: the hub's test split when dataset_path is empty too, else the held-out "
                                "problems are drawn from dataset_path's file (and never trained on).")
    num_train_samples: int = _f(1000, "Training problems to generate (or to take from the jsonl).")
    num_eval_samples: int = _f(200, "Held-out problems for before/after accuracy (0: no evaluation).")
    system_prompt: str = _f("", "System prompt; empty: the kit's default for the task (arithmetic: the answer only, "
                            "as `Answer: <number>`; word problems and GSM8K: brief reasoning, then that line).")
    # --- GRPO (names as in TRL's GRPOConfig) -------------------------------------------
    num_generations: int = _f(StepSpec.num_generations, "Completions sampled per prompt (the group size); at least 2.")
    per_device_train_batch_size: int = _kit("per_device_train_batch_size", "Completions per micro-batch (one "
                                            "forward/backward); per_device_train_batch_size x "
                                            "gradient_accumulation_steps must be a multiple of num_generations. The "
                                            "default is 2 prompts per step: with 1 prompt most early steps of an "
                                            "untrained small model have no reward spread to learn from.")
    gradient_accumulation_steps: int = _f(StepSpec.gradient_accumulation_steps, "Micro-batches per optimiser step.")
    max_prompt_length: int = _f(StepSpec.max_prompt_length, "Longest prompt in tokens; longer prompts are an error, not silently cut.")
    max_completion_length: int = _kit("max_completion_length", "Longest completion in tokens.")
    temperature: float = _kit("temperature", "Sampling temperature (> 0).")
    top_p: float = _f(1.0, "Nucleus sampling threshold in (0, 1].")
    top_k: int = _f(0, "Top-k sampling (0: off).")
    min_p: float | None = _f(None, "Min-p sampling threshold in [0, 1) (null or 0: off).")
    beta: float = _kit("beta", "KL coefficient (k3 estimator against the reference model); 0 skips the "
                       "reference pass.")
    epsilon: float = _f(0.2, "Lower clipping range of the ratio.")
    epsilon_high: float | None = _f(None, "Upper clipping range (null: same as epsilon).")
    loss_type: str = _kit("loss_type", f"GRPO objective and normalisation (TRL's), one of {LOSS_TYPES}.")
    scale_rewards: str = _f("group", f"Advantage scaling, one of {SCALE_REWARDS}.")
    num_iterations: int = _f(StepSpec.num_iterations, "Optimisation passes per generated batch (mu in the paper).")
    mask_truncated_completions: bool = _f(False, "Exclude completions that hit max_completion_length from the loss.")
    reward_funcs: list = _f(["correctness", "format_soft"], f"Reward functions: built-in names from {REWARD_FUNCS}, "
                            "`module:function` strings (an importable module, e.g. `my_rewards:length_penalty`) or, "
                            "from Python (notebook, trainer API), callables `fn(prompts, completions, **columns)`.")
    reward_weights: list = _kit("reward_weights", "One weight per reward function (empty: all 1.0).")
    reward_errors: str = _f("raise", f"When a reward function raises, one of {REWARD_ERRORS}: `raise` stops training "
                            "with an error naming the function and the sample; `zero` scores that sample 0.0 and "
                            "logs a warning with the same details.")
    reward_time_limit_s: float = _f(REWARD_TIME_LIMIT_S, "Wall-clock seconds one reward function call may take "
                                    "(0: no limit); a call that runs longer is stopped and its samples re-run one "
                                    "by one within one more such budget; a sample that runs out of it scores 0.0 "
                                    "with a warning naming the function and the sample.")
    sandbox_filesystem: str = _f("minimal", "What model code run by the code verifier and the python tool sees of "
                                 "the host's files: `minimal` (the interpreter, its standard library and packages "
                                 "read-only, a private /tmp; code execution is refused where no mount namespace can "
                                 "be built) or `host` (weaker: the host's file system, as far as the run's uid may "
                                 "read it; the plan line names it). See docs/reliability.md.")
    tools: list = _f([], f"Tools the model may call in its rollout (TRL's multi-turn tool loop): ready tools from "
                     f"{list(READY_TOOLS)}, `module:function` strings (a typed function with a Google-style "
                     "docstring) or, from Python, callables. Needs a chat template that carries tool calls (the "
                     "kit's for SmolLM2 and the tiny models).")
    environment: str | None = _f(None, "An environment factory `module:Factory` (TRL's environment_factory): each "
                                 "rollout gets an instance; its reset(**row) starts it and its public methods are "
                                 "tools.")
    tool_time_limit_s: float = _f(TOOL_TIME_LIMIT_S, "Wall-clock seconds one tool call may take (0: no limit); a "
                                  "call that runs longer is a tool failure and the rollout goes on.")
    tool_output_tokens: int = _f(TOOL_OUTPUT_TOKENS, "Tokens of a tool's text result the model sees; the rest is "
                                 "cut with a marker.")
    max_tool_calling_iterations: int | None = _f(None, "Rounds of tool calls per rollout (null: until the model "
                                                 "stops calling).")
    tool_warmup_steps: int = _f(0, "Supervised warm-up before GRPO (0: none): this many AdamW steps on the adapter "
                                "over worked calculator transcripts of the training questions (the call, the tool's "
                                "result, the answer; loss on the assistant's tokens), 4 a step, for a model that "
                                "otherwise never calls the tool. Needs the `calculator` tool and questions holding "
                                "one arithmetic expression (task arithmetic or multiplication); the held-out "
                                "accuracy is measured after it too.")
    tool_warmup_learning_rate: float = _f(2e-4, "Learning rate of the tool warm-up's AdamW.")
    learning_rate: float = _kit("learning_rate", "Peak learning rate (AdamW).")
    lr_scheduler_type: str = _kit("lr_scheduler_type", "transformers scheduler name.")
    warmup_steps: int = _kit("warmup_steps", "Linear warm-up steps.")
    weight_decay: float = _f(0.0, "AdamW weight decay.")
    max_grad_norm: float = _f(1.0, "Gradient clipping norm.")
    # --- LoRA ------------------------------------------------------------------------
    use_lora: bool = _f(StepSpec.use_lora, "Train a LoRA adapter (the reference model is then the base with it disabled). "
                        "false: full fine-tuning; with beta > 0 TRL loads a reference copy from the model's "
                        "checkpoint folder, so a random built-in then needs beta=0.")
    trust_remote_code: bool = _f(False, "Let a checkpoint's own modelling code run (its config.json's `auto_map`). "
                                 "Off: such a checkpoint is refused before it loads.")
    lora_rank: int = _f(StepSpec.lora_rank, "LoRA rank r.")
    lora_alpha: int = _f(32, "LoRA alpha.")
    lora_dropout: float = _f(StepSpec.lora_dropout, "LoRA dropout. Above 0 the kit's checkpointing recomputes each layer whole "
                             "(the random masks cannot be split into token slices) and each adapter saves its own "
                             "dropped input and mask; the VRAM calculator prices both.")
    lora_target_modules: list | str = _f("auto", "Module names that get LoRA adapters, or `auto`: every linear "
                                         "projection of the model's decoder layers (attention, MLP, linear "
                                         "attention; routers and the head excluded), found from the model; MoE "
                                         "experts are fused parameters and not among them.")
    # --- memory / generation -----------------------------------------------------------
    generation_backend: str = _f(StepSpec.generation_backend, f"Generation backend of the grpo_kit trainer, one of {GENERATION_BACKENDS}: "
                                 "`vllm` runs vLLM in the training process (weights synced every optimiser step; "
                                 "an error when vLLM is not installed, with the install command); `hf` is "
                                 "transformers `generate` on the training model; `auto` is vLLM where it is "
                                 "installed and can load the model (the embedded model, a local folder or a hub "
                                 "id; on CUDA also the random-weight built-ins, started with random weights), else HF (with a warning when vLLM is "
                                 "installed but cannot be used). trainer=trl always uses TRL's own HF generation.")
    vllm_gpu_memory_utilization: float | None = _kit("vllm_gpu_memory_utilization", "Share of GPU memory (CUDA) "
                                            "or of host RAM (vLLM's CPU backend) that vLLM reserves for its weights and KV cache, in (0, 1]; null: "
                                            "automatic (on CUDA what the VRAM calculator's training estimate leaves "
                                            "of the card, less 1 GiB; on the CPU a KV cache of a quarter of free "
                                            "RAM, at most 4 GiB). A value that cannot fit stops the run before "
                                            "training starts.")
    kv_cache_dtype: str = _f(StepSpec.kv_cache_dtype, f"vLLM KV cache dtype, one of {KV_CACHE_DTYPES}: `fp8` stores the KV cache in "
                             "FP8 (half of bf16), on platforms whose vLLM supports it; needs the vLLM backend.")
    vllm_kv_cache_gib: float | None = _f(None, "vLLM's KV cache in GiB (CUDA); null: what one generation batch needs "
                                         "(prompts x (prompt + num_generations x completion) tokens, the VRAM "
                                         "calculator's KV row), so the engine holds no more than that. A budget that "
                                         "cannot fit beside training stops the run before any model loads, with the "
                                         "calculator's numbers.")
    vllm_lora_dual_stream: bool | None = _f(None, "CUDA, vllm_lora_sync='adapter': run vLLM's LoRA "
                                           "kernels on a second CUDA stream beside each base matmul "
                                           "(VLLM_LORA_ENABLE_DUAL_STREAM) instead of after it. null: the kit's "
                                           "default (grpo_kit.generation.plan.LORA_DUAL_STREAM_DEFAULT).")
    vllm_enforce_eager: bool | None = _f(None, "vLLM without CUDA graphs and torch.compile (vLLM's enforce_eager): "
                                        "the engine starts in seconds instead of compiling and capturing graphs, and "
                                        "decodes slower; also a way to tell a compiled kernel's numerics from the "
                                        "eager ones. null: eager on the CPU, CUDA graphs on CUDA.")
    vllm_emulate_precision_casts: bool = _f(False, "vLLM compiled (not enforce_eager): have torch.compile round each "
                                            "intermediate to the model's dtype where eager PyTorch does (Inductor's "
                                            "emulate_precision_casts). Off, a fused kernel keeps fp32 values the "
                                            "trainer rounds to bf16 first, such as a norm's output before FP8 "
                                            "activation quantisation: the engine's log-probs drift further from the "
                                            "trainer's. No effect with enforce_eager or on the CPU.")
    vllm_lora_sync: str | None = _f(None, f"How the LoRA adapter reaches vLLM each step, one of {LORA_SYNC_MODES} or "
                                    "null. With shared weights: `adapter` hands the adapter over in memory and vLLM "
                                    "runs it in its LoRA kernels on every token; `merge` merges it into the shared "
                                    "weights for each generation and restores their exact bits after it "
                                    "(grpo_kit.generation.reversible_merge), so vLLM decodes dense. With a "
                                    "separate engine copy: `merge` loads the merged weights into the copy, "
                                    "`adapter` runs the adapter in the copy's LoRA kernels. null: `merge`, so vLLM "
                                    "decodes dense (grpo_kit.generation.plan.lora_sync_mode).")
    vllm_importance_sampling_mode: str = _f(ENGINE_IS_DEFAULT, f"vLLM generation: how the loss corrects for the gap "
                                            "between the engine's log-probs of the sampled tokens and the trainer's "
                                            f"(TRL's field), one of {ENGINE_IS_MODES}. `token_*` weights each token by "
                                            "its own ratio exp(trainer - engine), `sequence_*` each sequence by the "
                                            "product of its tokens' ratios; `*_truncate` clips the ratio to TRL's "
                                            "bounds (at most 3), `*_mask` sets it to 0 outside them. A per-token gap "
                                            "of one sign compounds over a sequence's length in the sequence modes "
                                            "(docs/generation.md).")
    vllm_share_weights: bool | str = _f("auto", "One copy of the weights on CUDA: the training model's frozen base "
                                        "weights are views of the vLLM engine's tensors, LoRA reaches vLLM in "
                                        "memory each step, and the engine releases only its KV cache while "
                                        "training runs (standby). true, false (a separate engine copy, weights "
                                        "synced each step) or `auto` (shared on CUDA with LoRA and 16-bit or FP8 base "
                                        "weights; a layout vLLM cannot share falls back to a copy with a warning).")
    base_weights: str = _f(StepSpec.base_weights, f"How the frozen base linear weights are held, one of {BASE_WEIGHTS}: `16bit` in "
                           "the training dtype; `fp8`: FP8 e4m3 with per-output-channel scales, quantised layer by "
                           "layer on the GPU (grpo_kit.model.fp8), the forward as a W8A8 matmul, LoRA on top in the "
                           "training dtype. `fp8` needs use_lora, a CUDA GPU with FP8 tensor cores (compute "
                           "capability 8.9 or newer: L4, RTX 40/50, H100, H200, B200) and load_in_4bit off. With vLLM the "
                           "engine serves these same codes and scales (one FP8 copy, shared weights) and runs the "
                           "adapter in its LoRA kernels; without shared weights it generates with HF generate. "
                           "Rounding activations to FP8 carries the engine's and the trainer's small kernel "
                           "differences to FP8's scale, a wider log-prob gap between them (docs/quantization.md): "
                           "prefer 16bit where accuracy matters and memory allows.")
    fp8_block: int | None = _f(None, "FP8 base weights' scales: null, one per output channel (vLLM's compressed-tensors "
                                "W8A8 layout), or 128 (FP8_BLOCK): one per 128 x 128 tile (vLLM's block-FP8 layout, "
                                "which needs every fused shard to start on a 128-row boundary; a model whose shards do "
                                "not generates with HF generate). Applies with base_weights: fp8.")
    load_in_4bit: bool = _f(StepSpec.load_in_4bit, "QLoRA: the training model's base linear weights in 4 bit (bitsandbytes NF4, "
                            "double quantisation; matmuls in the training dtype), LoRA on top, except the layers "
                            "in load_in_4bit_skip_modules. Needs use_lora, a CUDA GPU and bitsandbytes; generates "
                            "with HF generate (vLLM cannot take a 4-bit training model's weights yet).")
    load_in_4bit_skip_modules: list | str = _f(["lm_head"], "Layers kept in 16 bit when load_in_4bit is on: a list "
                                               "of names (substrings of the module names, e.g. `down_proj`, "
                                               "`model.layers.0.`; lm_head always stays 16-bit) or `auto`: lm_head "
                                               "plus the layers whose NF4 error on a short calibration pass is "
                                               "largest, within load_in_4bit_auto_allowance (grpo_kit.model.quantize).")
    load_in_4bit_auto_allowance: float = _f(0.1, "With load_in_4bit_skip_modules=auto: the extra memory the "
                                            "16-bit layers may cost, as a fraction of the 4-bit weights' bytes.")
    load_in_4bit_matmul: str = _f("kit", "How a 4-bit layer multiplies when load_in_4bit is on: `kit` "
                                  "(grpo_kit.model.nf4_matmul: each weight dequantised once per decoder-layer call by one "
                                  "Triton kernel, bit-equal to bitsandbytes', and kept for that call; one layer's "
                                  "weights in 16 bit extra) or `bitsandbytes` (its own Linear4bit, which dequantises "
                                  "for every matmul, forward and backward, and for short inputs on some GPUs multiplies "
                                  "with its own fused kernel, which rounds differently).")
    gradient_checkpointing: bool | str = _kit("gradient_checkpointing", "Gradient checkpointing: true, false "
                                              "or `auto` (on when training on a CUDA GPU, off on the CPU, where it "
                                              "would only recompute). With the grpo_kit trainer on a GPU the layer inputs are "
                                              "offloaded to CPU RAM (grpo_kit.model.offload).")
    loss_chunk_size: int | None = _f(None, "Rows per logits chunk in the efficient loss (null: chosen from free "
                                    "memory).")
    scoring_batch_size: int | str | None = _f(StepSpec.scoring_batch_size, "Completions per no-grad forward when the grpo_kit trainer "
                                              "scores a generation batch (the reference model's log-probs, and TRL's "
                                              "old-policy pass where it runs; verl's log_prob_micro_batch_size). "
                                              "Larger means fewer, fuller forwards (with 4-bit weights, fewer "
                                              "dequantisations) for the activations of that many sequences, which "
                                              "the VRAM calculator prices as its own phase. `auto`: the largest, up "
                                              "to one generation batch, that does not raise the calculator's peak "
                                              "of the step (with vLLM, of its training phases: the engine's KV "
                                              "cache is memory the scoring pass cannot use; the run folder's "
                                              "summary.json records the choice); null: "
                                              "per_device_train_batch_size, as TRL. Safe to change on resume.")

    # ---------------------------------------------------------------------------------
    def spec(self, kind: type):
        """This config as the spec ``kind`` that a layer below the app takes (``grpo_kit.app.specs``)."""
        return layer_spec(self, kind)

    def checkpointing_on(self, device: str) -> bool:
        """Whether gradient checkpointing runs on ``device`` (``cpu`` / ``cuda``): ``auto`` means on a GPU."""
        return checkpointing_on(self.gradient_checkpointing, device)

    def vllm_options_set(self) -> list[str]:
        """``name=value`` of each vLLM-only option (``grpo_kit.generation.spec.VLLM_ONLY_OPTIONS``) not at its off value."""
        return self.spec(GenerationSpec).vllm_options_set()

    @classmethod
    def field_help(cls) -> dict[str, str]:
        """Each field's help: the kit's own, or TRL's for the objective's options the kit adds as they are."""
        trl = trl_field_help() if any("help" not in f.metadata for f in dataclasses.fields(cls)) else {}
        return {f.name: f.metadata.get("help") or f"(TRL's help) {trl.get(f.name, '')}" for f in dataclasses.fields(cls)}

    @classmethod
    def describe(cls, width: int = 100) -> str:
        """Every field with its type, default, allowed values and help (``train --help-config``)."""
        out = []
        helps = cls.field_help()
        for f in dataclasses.fields(cls):
            default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
            allowed = _allowed_text(f.name, str(f.type))
            out.append(f"{f.name}: {f.type} = {json.dumps(default)}" + (f"  [{allowed}]" if allowed else ""))
            out += textwrap.wrap(helps[f.name], width, initial_indent="    ", subsequent_indent="    ")
        return "\n".join(out)

    @classmethod
    def from_dict(cls, values: dict) -> GRPOKitConfig:
        """Build from a mapping; unknown keys and wrong types raise ``ConfigError``."""
        if not isinstance(values, dict):
            raise ConfigError(f"config must be a mapping of field: value, got {type(values).__name__}")
        cfg = cls()
        for key, value in values.items():
            cfg.set(key, value)
        return cfg

    @classmethod
    def from_yaml(cls, path: str | os.PathLike, overrides: typing.Sequence[str] = ()) -> GRPOKitConfig:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file {str(path)!r} does not exist")
        if p.stat().st_size > MAX_YAML_BYTES:
            raise ConfigError(f"config file {str(path)!r} is {p.stat().st_size / 2**20:.1f} MiB; a config is at most "
                              f"{MAX_YAML_BYTES / 2**20:.0f} MiB")
        try:
            values = load_yaml(p.read_text(encoding="utf-8"), f"config file {str(path)!r}") or {}
        except UnicodeDecodeError as e:
            raise ConfigError(f"config file {str(path)!r} is not UTF-8 text (byte {e.start})") from None
        except yaml.YAMLError as e:
            raise ConfigError(f"config file {str(path)!r} is not valid YAML: {e}") from None
        except RecursionError:
            raise ConfigError(f"config file {str(path)!r} is nested too deeply to be a config") from None
        cfg = cls.from_dict(values)
        cfg.apply_overrides(overrides)
        return cfg

    def apply_overrides(self, overrides: typing.Sequence[str]) -> GRPOKitConfig:
        """Apply ``key=value`` strings (as given to ``--set``); values are parsed as YAML scalars."""
        for item in overrides:
            if "=" not in item:
                raise ConfigError(f"--set expects key=value, got {item!r}")
            key, raw = item.split("=", 1)
            if len(raw) > MAX_YAML_BYTES:
                raise ConfigError(f"--set {key.strip()}=...: the value is {len(raw)} characters; at most "
                                  f"{MAX_YAML_BYTES}")
            try:
                value = load_yaml(raw, f"--set {key.strip()}=...") if raw != "" else ""
            except yaml.YAMLError:
                value = raw
            self.set(key.strip(), value)
        return self

    def set(self, key: str, value) -> None:
        """Set one field with type coercion; unknown names suggest the closest field."""
        fields = {f.name: f for f in dataclasses.fields(self)}
        if key not in fields:
            close = difflib.get_close_matches(key, fields, n=3)
            hint = f" Did you mean {', '.join(close)}?" if close else ""
            raise ConfigError(f"unknown config key {key!r}.{hint} Known keys: {', '.join(fields)}")
        setattr(self, key, _coerce(key, value, fields[key].type))

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def save(self, path: str | os.PathLike) -> None:
        values = self.to_dict()
        values["reward_funcs"] = [reward_func_spec(r) for r in values["reward_funcs"]]  # callables as module:name
        values["tools"] = [tool_spec(t) if callable(t) else t for t in values["tools"]]
        Path(path).write_text(yaml.safe_dump(values, sort_keys=False))

    # ---------------------------------------------------------------------------------
    def validate(self) -> GRPOKitConfig:
        """Check every field; raise one ``ConfigError`` listing all problems. Loads nothing heavy."""
        errors: list[str] = []
        kind = None
        try:
            kind = check_model_name(self.model)
        except ValueError as e:
            errors.append(str(e))
        bad = set()
        for f in dataclasses.fields(self):
            problem = _field_problem(f.name, getattr(self, f.name), str(f.type))
            if problem:
                errors.append(problem)
                bad.add(f.name)
        errors += _run_problems(self, kind, bad)
        list_errors = _list_problems(self)
        if list_errors is None:  # a list field that is no list: the element checks below need lists
            raise ConfigError("invalid config:\n  - " + "\n  - ".join(errors + _not_lists(self)))
        errors += list_errors + _generation_problems(self) + _4bit_problems(self) + _data_problems(self)
        errors += _tracker_problems(self)
        errors += _fp8_problems(self)
        if errors:
            raise ConfigError("invalid config:\n  - " + "\n  - ".join(errors))
        return self


OBJECTIVE_FIELDS = tuple(f.name for f in dataclasses.fields(GRPOKitConfig) if f.metadata.get("objective"))
LIST_FIELDS = ("levels", "reward_funcs", "reward_weights", "tools")


def _run_problems(cfg: GRPOKitConfig, kind: str | None, bad: set[str]) -> list[str]:
    """Fields that must agree: the batch with the group size, checkpoints with logging, the reference model
    with the weights. ``bad``: fields already refused alone (not checked again here)."""
    errors = []
    # TRL builds its reference model for full fine-tuning from the policy's checkpoint folder, which a random
    # built-in does not have (TRL fails deep inside from_pretrained otherwise)
    if "beta" not in bad and not (cfg.use_lora or cfg.beta == 0 or kind not in ("tiny", "config-only")):
        errors.append(f"use_lora=False with beta={cfg.beta} needs a reference model, which TRL loads from the "
                      f"model's checkpoint folder; model={cfg.model!r} is a random-weight built-in with none. Set "
                      "beta=0, or use_lora=True (the reference is the model with its adapter off), or save the "
                      "model and set model= to that folder")
    if not bad & {"num_generations", "per_device_train_batch_size", "gradient_accumulation_steps"}:
        total = cfg.per_device_train_batch_size * cfg.gradient_accumulation_steps
        if total % cfg.num_generations:
            errors.append(f"per_device_train_batch_size × gradient_accumulation_steps = {total} must be a multiple "
                          f"of num_generations={cfg.num_generations} (e.g. {cfg.num_generations} or "
                          f"{2 * cfg.num_generations})")
    if not bad & {"save_steps", "logging_steps"} and cfg.save_steps > 0 and cfg.save_steps % cfg.logging_steps:
        errors.append(f"save_steps={cfg.save_steps} must be a multiple of logging_steps={cfg.logging_steps} (a "
                      "checkpoint between two logged steps would lose the metrics of the steps in between on resume)")
    if not (isinstance(cfg.output_dir, str) and cfg.output_dir.strip()):
        errors.append(f"output_dir={cfg.output_dir!r} must name a run folder (a non-empty path)")
    elif (blocker := _non_folder_on_path(cfg.output_dir)) is not None:
        errors.append(f"output_dir={cfg.output_dir!r} cannot be a run folder: {blocker!r} exists and is not a folder")
    elif (why := unsafe_run_folder(cfg.output_dir)) is not None:
        errors.append(f"output_dir={cfg.output_dir!r} cannot be a run folder: {why}")

    if cfg.scoring_batch_size not in (None, "auto") and cfg.trainer != "grpo_kit":
        errors.append(f"scoring_batch_size={cfg.scoring_batch_size} needs trainer='grpo_kit' (TRL's GRPOTrainer "
                      "scores with per_device_train_batch_size); leave it 'auto' or null with trainer='trl'")
    return errors


def _not_lists(cfg: GRPOKitConfig) -> list[str]:
    """The list fields that are no flat list of single values (the element checks need them)."""
    return [p for name in LIST_FIELDS if (p := _plain_list_problem(name, getattr(cfg, name)))]


def _list_problems(cfg: GRPOKitConfig) -> list[str] | None:
    """The list fields' elements (None when one of them is no list at all); the reward functions are
    resolved here (built-in names, ``module:function`` strings imported, callables)."""
    if _not_lists(cfg):
        return None
    errors = []
    targets = cfg.lora_target_modules
    if targets != "auto" and not (isinstance(targets, list) and _plain_list_problem("lora_target_modules", targets)
                                  is None and targets and all(isinstance(m, str) and m.strip() for m in targets)):
        errors.append(f"lora_target_modules={short(targets)}: 'auto' or a list of module names (non-empty strings), "
                      "at least one")
    bad_weights = [w for w in cfg.reward_weights
                   if isinstance(w, bool) or not isinstance(w, (int, float)) or not math.isfinite(w)]
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
        errors.append(f"tool_warmup_steps={cfg.tool_warmup_steps} writes calculator transcripts, but tools="
                      f"{cfg.tools!r} has no 'calculator'; add it or set tool_warmup_steps=0")
    if cfg.tool_warmup_steps and cfg.task not in ARITHMETIC_TASKS:
        errors.append(f"tool_warmup_steps={cfg.tool_warmup_steps} needs questions holding one arithmetic expression "
                      f"(task {' or '.join(ARITHMETIC_TASKS)}), but task={cfg.task!r}")
    if cfg.reward_weights and len(cfg.reward_weights) != len(cfg.reward_funcs):
        errors.append(f"reward_weights has {len(cfg.reward_weights)} entries but reward_funcs has "
                      f"{len(cfg.reward_funcs)}")
    bad_levels = [lv for lv in cfg.levels if isinstance(lv, bool) or lv not in LEVELS]
    if cfg.task != "gsm8k" and (not cfg.levels or bad_levels):
        errors.append(f"levels={cfg.levels!r}: each must be one of {sorted(LEVELS)}, at least one")
    skip = cfg.load_in_4bit_skip_modules
    if skip != "auto" and not (isinstance(skip, list) and all(isinstance(m, str) and m for m in skip)):
        errors.append(f"load_in_4bit_skip_modules={skip!r} is not allowed: 'auto' or a list of non-empty module "
                      "names")
    return errors


def _generation_problems(cfg: GRPOKitConfig) -> list[str]:
    """The generation options that must agree with the backend, the trainer and the LoRA setting."""
    errors = []
    if cfg.vllm_share_weights is True and not (cfg.use_lora and not cfg.load_in_4bit):
        errors.append(f"vllm_share_weights=True needs use_lora=True and load_in_4bit=False (use_lora={cfg.use_lora}, "
                      f"load_in_4bit={cfg.load_in_4bit}): full fine-tuning updates the weights vLLM would share, "
                      "and a 4-bit training model has no 16-bit weights to share")
    if cfg.vllm_lora_sync is not None and not cfg.use_lora:
        errors.append(f"vllm_lora_sync={cfg.vllm_lora_sync!r} needs use_lora=True (full fine-tuning syncs the whole "
                      "weights)")
    if cfg.vllm_lora_sync == "merge" and cfg.vllm_lora_dual_stream:
        errors.append("vllm_lora_dual_stream=True needs the adapter in vLLM's LoRA kernels, but vllm_lora_sync="
                      "'merge' generates with merged weights and no LoRA kernels; drop one of the two")
    if (
        cfg.loss_type == "vespo"
        and cfg.generation_backend == "vllm"
        and cfg.vllm_importance_sampling_mode not in ENGINE_IS_TOKEN_MODES
    ):
        errors.append(f"loss_type='vespo' with vLLM generation weights each token by its own importance ratio, but "
                      f"vllm_importance_sampling_mode={cfg.vllm_importance_sampling_mode!r} forms one per sequence; "
                      f"set it to {' or '.join(map(repr, ENGINE_IS_TOKEN_MODES))}")
    vllm_only = cfg.vllm_options_set()
    if (
        cfg.generation_backend == "vllm" or (vllm_only and cfg.generation_backend != "hf")
    ) and cfg.trainer != "grpo_kit":
        errors.append(f"generation_backend={cfg.generation_backend!r} with {', '.join(vllm_only) or 'vLLM'} needs "
                      "trainer='grpo_kit' (trainer='trl' generates with TRL's own HF path)")
    if vllm_only and cfg.generation_backend == "hf":
        errors.append(f"{', '.join(vllm_only)} only apply to vLLM generation, but generation_backend='hf'; set "
                      "generation_backend='vllm' (or 'auto'), or leave them at their defaults")
    return errors


def _4bit_problems(cfg: GRPOKitConfig) -> list[str]:
    """What load_in_4bit needs: LoRA, a CUDA GPU, bitsandbytes and HF generation."""
    if not cfg.load_in_4bit:
        return []
    errors = []
    if not cfg.use_lora:
        errors.append("load_in_4bit=True needs use_lora=True: 4-bit weights are frozen (bitsandbytes stores them "
                      "packed, they have no gradient), so full fine-tuning would train nothing")
    if cfg.device == "cpu":
        errors.append("load_in_4bit=True needs a CUDA GPU (bitsandbytes' 4-bit training path), but device='cpu'; "
                      "use device=auto on a GPU machine, or load_in_4bit=False")
    elif cfg.device == "auto" and not torch.cuda.is_available():  # where the run will train, known before loading
        errors.append("load_in_4bit=True needs a CUDA GPU (bitsandbytes' 4-bit training path), but device='auto' "
                      "finds none on this machine; run on a GPU machine or set load_in_4bit=False")
    if cfg.generation_backend == "vllm":
        errors.append("load_in_4bit=True generates with HF generate: vLLM cannot take a 4-bit training model's "
                      "weights yet; set generation_backend='hf' or 'auto'")
    if importlib.util.find_spec("bitsandbytes") is None:
        errors.append("load_in_4bit=True needs the bitsandbytes package, which is not installed: python -m pip "
                      "install bitsandbytes==0.50.2 (CUDA), or set load_in_4bit=False")
    return errors


def _fp8_problems(cfg: GRPOKitConfig) -> list[str]:
    """What base_weights='fp8' needs: LoRA, no 4-bit, vLLM on shared weights with the adapter unmerged, and a
    device with FP8 tensor cores (where the run will train, known before any model loads:
    grpo_kit.model.fp8.fp8_support names it)."""
    if cfg.base_weights != "fp8":
        return [f"fp8_block={cfg.fp8_block} applies to base_weights='fp8' only (base_weights={cfg.base_weights!r}); "
                "leave it null"] if cfg.fp8_block is not None else []
    errors = []
    if not cfg.use_lora:
        errors.append("base_weights='fp8' needs use_lora=True: the FP8 base weights are frozen (no gradient reaches "
                      "them, only the LoRA adapters on top train), so full fine-tuning would train nothing; use "
                      "base_weights='16bit' for full fine-tuning")
    if cfg.load_in_4bit:
        errors.append("base_weights='fp8' and load_in_4bit=True are two formats for the same base weights; choose "
                      "one (FP8 on GPUs with FP8 tensor cores, 4 bit elsewhere)")
    if cfg.vllm_lora_sync == "merge":
        errors.append("base_weights='fp8' with vllm_lora_sync='merge': a merge into the FP8 weights would round them "
                      "again, so their exact bits could not be restored; leave vllm_lora_sync null (the adapter runs "
                      "in vLLM's LoRA kernels) or use base_weights='16bit'")
    if cfg.generation_backend == "vllm" and cfg.vllm_share_weights is False:
        errors.append("base_weights='fp8' with generation_backend='vllm' needs vllm_share_weights 'auto' or true: "
                      "vLLM serves the training model's own FP8 codes, there is no separate FP8 copy to sync")
    device = cfg.device if cfg.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    if cfg.device in DEVICES and (why := fp8_support(device)) is not None:
        errors.append(f"base_weights='fp8': {why}")
    return errors


def tracker_installed(name: str) -> bool:
    """Whether the experiment tracker ``name`` (a ``TRACKERS`` key) can be imported here."""
    return any(importlib.util.find_spec(module) is not None for module in TRACKERS[name][0])


def _tracker_problems(cfg: GRPOKitConfig) -> list[str]:
    """report_to: 'none', 'all', or known tracker names, each installed (else its install command)."""
    value = cfg.report_to
    if value in ("none", "all"):
        return []
    names = [value] if isinstance(value, str) else value
    if not (isinstance(names, list) and names and all(isinstance(n, str) for n in names)):
        return [f"report_to={short(value)} is not allowed: 'none', 'all', or tracker names from {list(TRACKERS)} "
                "(a list or a comma-separated string)"]
    unknown = [n for n in names if n not in TRACKERS]
    if unknown:
        return [f"report_to={short(value)}: {short(unknown[0])} is not a tracker the kit passes on; choose from "
                f"{list(TRACKERS)} (several as a list), or 'none' or 'all' alone"]
    return [f"report_to={short(value)}: {n} is not installed; install it with `python -m pip install "
            f"{TRACKERS[n][1]}`, or drop it from report_to" for n in names if not tracker_installed(n)]


def _report_to(key: str, value):
    """report_to from YAML, ``--set`` or a notebook: null, 'none', 'all', a name, a comma string or a list; a
    list of names, or 'none' / 'all' alone (names are checked by validate())."""
    if isinstance(value, str) and value.strip().startswith("["):  # a YAML/JSON list given as text
        if len(value) > MAX_YAML_BYTES:
            raise ConfigError(f"{key}: the value is {len(value)} characters; at most {MAX_YAML_BYTES}")
        try:
            value = load_yaml(value, f"{key}=...")  # within the config's limits, wherever the text came from
        except yaml.YAMLError:
            raise ConfigError(f"{key}={short(value)} is not a valid list") from None
    if value is None:
        return "none"
    if isinstance(value, str):
        names = [v.strip() for v in value.split(",") if v.strip()]
    elif isinstance(value, (list, tuple)):
        names = list(dict.fromkeys(value)) if all(isinstance(v, str) for v in value) else list(value)
    else:
        raise ConfigError(f"{key}={value!r} has the wrong type: expected 'none', 'all', a tracker name or a list")
    return "none" if names in ([], ["none"]) else "all" if names == ["all"] else names


def _data_problems(cfg: GRPOKitConfig) -> list[str]:
    """The GSM8K files exist, and a held-out file only where the task reads one."""
    errors = [f"{name}={getattr(cfg, name)!r} does not exist" for name in ("dataset_path", "eval_dataset_path")
              if cfg.task == "gsm8k" and getattr(cfg, name) and not os.path.isfile(getattr(cfg, name))]
    if cfg.eval_dataset_path and cfg.task != "gsm8k":
        errors.append(f"eval_dataset_path={cfg.eval_dataset_path!r} applies to task='gsm8k' only (task="
                      f"{cfg.task!r}: its held-out set is generated)")
    return errors


def trl_field_help() -> dict[str, str]:
    """TRL's help text of each ``GRPOConfig`` field (imports TRL)."""
    from trl import GRPOConfig  # lazy: TRL is slow to import; only help for the objective's options needs it

    return {f.name: f.metadata.get("help", "") for f in dataclasses.fields(GRPOConfig)}


class _LimitedLoader(yaml.SafeLoader):
    """PyYAML's safe loader that refuses, while it reads, nesting deeper than ``MAX_YAML_DEPTH`` and more than
    ``MAX_YAML_ALIASES`` aliases (each a ``_TooBig``)."""

    def __init__(self, stream):
        super().__init__(stream)
        self.kit_depth, self.kit_aliases = 0, 0

    def compose_node(self, parent, index):
        if self.check_event(yaml.AliasEvent):
            self.kit_aliases += 1
            if self.kit_aliases > MAX_YAML_ALIASES:
                raise _TooBig(f"uses more than {MAX_YAML_ALIASES} aliases (*name)")
            return super().compose_node(parent, index)
        self.kit_depth += 1
        try:
            if self.kit_depth > MAX_YAML_DEPTH:
                raise _TooBig(f"is nested more than {MAX_YAML_DEPTH} levels deep")
            return super().compose_node(parent, index)
        finally:
            self.kit_depth -= 1


class _TooBig(Exception):
    """A YAML text beyond the limits of a config (its message says which)."""


def _expanded_nodes(root) -> int:
    """Nodes of a composed YAML tree with every alias expanded, counted without expanding them (each node's count
    once); ``_TooBig`` beyond ``MAX_YAML_NODES`` or for a node that contains itself. Iterative: no recursion."""
    counts: dict[int, int] = {}
    stack, on_path = [(root, False)], set()
    while stack:
        node, children_done = stack.pop()
        children = (
            [c for item in node.value for c in (item if isinstance(item, tuple) else (item,))]
            if isinstance(node.value, list)
            else []
        )
        if children_done:
            on_path.discard(id(node))
            counts[id(node)] = min(MAX_YAML_NODES + 1, 1 + sum(counts[id(c)] for c in children))
            if counts[id(node)] > MAX_YAML_NODES:
                raise _TooBig(f"expands (aliases included) to more than {MAX_YAML_NODES} values")
            continue
        if id(node) in counts:
            continue
        if id(node) in on_path:
            raise _TooBig("holds an alias that refers to itself")
        on_path.add(id(node))
        stack.append((node, True))
        stack.extend((c, False) for c in children if id(c) not in counts)
    return counts[id(root)]


def load_yaml(text: str, what: str):
    """``yaml.safe_load`` within the limits of a config (``MAX_YAML_*``); a text beyond them is a ``ConfigError``
    naming ``what`` (the file or the --set value) and the limit, raised before any value is built. YAML syntax
    errors stay ``yaml.YAMLError``."""
    loader = _LimitedLoader(text)
    try:
        root = loader.get_single_node()
        if root is None:
            return None
        _expanded_nodes(root)
        return loader.construct_document(root)
    except _TooBig as e:
        raise ConfigError(f"{what} {e}; a config is a mapping of short values") from None
    finally:
        loader.dispose()


_SHORT = reprlib.Repr()
_SHORT.maxlevel, _SHORT.maxlist, _SHORT.maxtuple, _SHORT.maxdict = 3, 8, 8, 8
_SHORT.maxstring, _SHORT.maxother, _SHORT.maxlong = 200, 200, 60


def short(value) -> str:
    """``repr(value)`` cut short for a message: a nested or self-referring value costs no more than its first
    entries (a plain ``repr`` of an alias bomb runs out of memory, of a deep list out of recursion)."""
    return _SHORT.repr(value)


def _plain_list_problem(name: str, value) -> str | None:
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


def _coerce(key: str, value, annotation):
    """Coerce YAML/CLI/papermill values to the field's type, or raise a clear error."""
    typ = {"int": int, "float": float, "bool": bool, "str": str, "list": list}.get(
        annotation if isinstance(annotation, str) else getattr(annotation, "__name__", ""), None)
    err = ConfigError(f"{key}={short(value)} has the wrong type: expected {getattr(typ, '__name__', annotation)}")
    if isinstance(annotation, str) and annotation.endswith(" | None"):  # null, or a value of the type
        if value is None or (isinstance(value, str) and value.strip().lower() in ("null", "none", "~")):
            return None
        return _coerce(key, value, annotation.removesuffix(" | None"))
    if annotation == "str | list":  # report_to: TRL's 'none' / 'all', a name, several as a list or a comma string
        return _report_to(key, value)
    if annotation == "int | str":  # "auto", or an int
        if isinstance(value, str) and value.strip().lower() == "auto":
            return "auto"
        if isinstance(value, str):
            raise ConfigError(f"{key}={value!r} is not allowed: an integer, 'auto' or null")
        return _coerce(key, value, "int")
    if annotation == "list | str":  # "auto", or a list
        if isinstance(value, str) and value.strip().lower() == "auto":
            return "auto"
        return _coerce(key, value, "list")
    if annotation == "bool | str":  # true / false / "auto"
        if isinstance(value, str) and value.strip().lower() == "auto":
            return "auto"
        try:
            return _coerce(key, value, "bool")
        except ConfigError:
            raise ConfigError(f"{key}={value!r} is not allowed: true, false or 'auto'") from None
    if typ is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false", "1", "0", "yes", "no"):
            return value.lower() in ("true", "1", "yes")
        raise err
    if typ is int:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise err
        if isinstance(value, float) and not value.is_integer():  # 2.5, inf, nan: the range, no int() traceback
            raise ConfigError(_numeric_problem(key, value, "int") if key in NUMERIC_RANGES else str(err))
        return int(value)
    if typ is float:
        if isinstance(value, str):  # YAML 1.1 reads exponents without a dot (2e-4, 5e-5, 1e-6) as strings
            try:
                return float(value.strip())
            except ValueError:
                raise err from None
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise err
        return float(value)
    if typ is str:
        if not isinstance(value, str):
            raise err
        return value
    if typ is list:
        if isinstance(value, str):
            try:
                value = parse_json(value, f"{key}=...", max_bytes=MAX_YAML_BYTES)
            except InputError as e:
                raise ConfigError(f"{e}; expected a list of values") from None
            except json.JSONDecodeError:
                value = [v.strip() for v in value.split(",") if v.strip()]
        if not isinstance(value, (list, tuple)):
            raise err
        problem = _plain_list_problem(key, list(value))
        if problem:
            raise ConfigError(problem)
        return list(value)
    return value
