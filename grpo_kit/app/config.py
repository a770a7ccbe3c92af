"""The one config object of the kit: ``GRPOKitConfig``.

Field names follow TRL's ``GRPOConfig`` where the meaning is the same. The config is
validated once, at the edge (CLI, YAML, notebook parameters), by ``validate()``; every
problem is reported in one ``ConfigError`` naming the field, the value and what is
allowed, before any model is loaded. Inside the kit it is trusted.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import math
import os
import typing
from dataclasses import dataclass, field
from pathlib import Path

from grpo_kit.generation.base import GENERATION_BACKENDS
from grpo_kit.generation.sync import LORA_SYNC_MODES
from grpo_kit.loss.objective import LOSS_TYPES
from grpo_kit.model.nf4_matmul import NF4_MATMULS
from grpo_kit.tasks.rewards import REWARD_ERRORS
from grpo_kit.tasks.rewards import REWARD_TIME_LIMIT_S

TASKS = ("arithmetic", "word_problems", "gsm8k")
REWARD_FUNCS = ("correctness", "format_strict", "format_soft")
DTYPES = ("auto", "fp32", "bf16", "fp16")
DEVICES = ("auto", "cpu", "cuda")
TRAINERS = ("grpo_kit", "trl")
KV_CACHE_DTYPES = ("auto", "fp8")
SCALE_REWARDS = ("group", "batch", "none")
# Fields that only vLLM generation reads, with their "off" value: set to anything else they need vLLM.
VLLM_ONLY_OPTIONS = (("kv_cache_dtype", "auto"), ("vllm_gpu_memory_utilization", None), ("vllm_kv_cache_gib", None),
                     ("vllm_lora_dual_stream", None), ("vllm_lora_sync", None))
# Fields whose "automatic" value is null (as in TRL); configs saved before they were, wrote 0 for it. A run folder
# of that time resumes with 0 read as null (resume_policy.resume_config); a new config's 0 is refused with the note.
NULL_MEANS_AUTO = ("epsilon_high", "loss_chunk_size", "vllm_gpu_memory_utilization")
# transformers' SchedulerType values (checked against transformers by tests/test_config.py), so a bad name is
# refused before any model loads instead of inside the trainer.
LR_SCHEDULER_TYPES = ("linear", "cosine", "cosine_with_restarts", "polynomial", "constant", "constant_with_warmup",
                      "inverse_sqrt", "reduce_lr_on_plateau", "cosine_with_min_lr", "cosine_warmup_with_min_lr",
                      "warmup_stable_decay", "greedy")


class ConfigError(ValueError):
    """A config value that is not allowed; the message names the field and the options."""


# The allowed range of every numeric field: (low, high, low_open, high_open); None: no bound on that side.
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
    "scoring_batch_size": (1, None, False, False),
    "load_in_4bit_auto_allowance": (0, 4, False, False),
}
# Why a bound is what it is, where that is not obvious; appended to the message.
_RANGE_NOTES = {
    "num_generations": "advantages compare completions within a group",
    "vllm_gpu_memory_utilization": "or null for automatic", "vllm_kv_cache_gib": "or null for automatic",
    "max_grad_norm": "0: no clipping", "reward_time_limit_s": "0: no limit",
    "epsilon_high": "or null for the same as epsilon", "loss_chunk_size": "or null for automatic",
    "scoring_batch_size": "or 'auto', or null for per_device_train_batch_size",
    "min_p": "0 or null: off",
}


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
        return f"{name}={value!r} must be {wanted} {_range_text(low, high, low_open, high_open)}{note}"
    ok = math.isfinite(value) and (value > low if low_open else value >= low) and (
        high is None or (value < high if high_open else value <= high))
    if ok:
        return None
    finite = "" if kind == "int" else " and finite"
    return f"{name}={value!r} must be {_range_text(low, high, low_open, high_open)}{finite}{note}"


def _f(default, help: str, **kw):
    """A dataclass field whose help text lives in its metadata (as in TRL's configs)."""
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda d=default: type(d)(d), metadata={"help": help, **kw})
    return field(default=default, metadata={"help": help, **kw})


@dataclass
class GRPOKitConfig:
    # --- run -------------------------------------------------------------------------
    model: str = _f("smollm2-135m-instruct", "Built-in name (see `grpo_kit.model.loading.BUILTIN_MODELS`), a local "
                    "folder, or a hub id such as `Qwen/Qwen2.5-1.5B-Instruct`.")
    output_dir: str = _f("runs/default", "Run folder: metrics.csv, rewards.png, samples, adapter/weights.")
    seed: int = _f(0, "Seed for data, sampling and initialisation.")
    max_steps: int = _f(40, "Optimiser steps to run.")
    save_steps: int = _f(10, "Write a resumable checkpoint (run folder's checkpoints/checkpoint-N: weights, "
                         "optimiser, scheduler, RNG and data position, metrics so far) every N steps and at the end; "
                         "0: none. A multiple of logging_steps. Resume with `train --resume RUN_DIR`.")
    keep_checkpoints: int = _f(2, "Complete checkpoints kept (the newest N; 0: all). Older ones are deleted only "
                               "after a new one is complete.")
    max_bad_steps: int = _f(3, "Consecutive steps with a non-finite loss or gradient (each one skipped: no "
                            "optimiser update) before training stops with the state saved.")
    logging_steps: int = _f(1, "Log metrics every N steps.")
    device: str = _f("auto", f"Where to train: one of {DEVICES}; `auto` picks CUDA when available.")
    dtype: str = _f("auto", f"Training dtype, one of {DTYPES}; `auto`: bf16 on GPUs that support it, else fp16 "
                    "on GPU (with a GradScaler), fp32 on CPU.")
    trainer: str = _f("grpo_kit", f"Which trainer runs the job, one of {TRAINERS}: `grpo_kit` is the kit's "
                      "EfficientGRPOTrainer (no full logits), `trl` TRL's stock GRPOTrainer.")
    # --- data ------------------------------------------------------------------------
    task: str = _f("arithmetic", f"Training task, one of {TASKS}.")
    levels: list = _f([1, 2], "Difficulty levels of the generated tasks (1 = one-digit +/-, 2 = two-digit +/- "
                      "one-digit, 3 = two-digit +/-, 4 = two-digit x one-digit and three-digit +/-).")
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
    num_generations: int = _f(8, "Completions sampled per prompt (the group size); at least 2.")
    per_device_train_batch_size: int = _f(16, "Completions per micro-batch (one forward/backward); per_device_train_batch_"
                                          "size x gradient_accumulation_steps must be a multiple of num_generations. "
                                          "The default 16 is 2 prompts per step: with 1 prompt most early steps of "
                                          "the untrained embedded model had no reward spread, and a seed could fail "
                                          "to learn (bench/results/learning_cpu_vllm*.md).")
    gradient_accumulation_steps: int = _f(1, "Micro-batches per optimiser step.")
    max_prompt_length: int = _f(256, "Longest prompt in tokens; longer prompts are an error, not silently cut.")
    max_completion_length: int = _f(24, "Longest completion in tokens.")
    temperature: float = _f(0.7, "Sampling temperature (> 0).")
    top_p: float = _f(1.0, "Nucleus sampling threshold in (0, 1].")
    top_k: int = _f(0, "Top-k sampling (0: off).")
    min_p: float | None = _f(None, "Min-p sampling threshold in [0, 1) (null or 0: off).")
    beta: float = _f(0.04, "KL coefficient (k3 estimator against the reference model); 0 skips the reference pass.")
    epsilon: float = _f(0.2, "Lower clipping range of the ratio.")
    epsilon_high: float | None = _f(None, "Upper clipping range (null: same as epsilon).")
    loss_type: str = _f("grpo", f"GRPO objective and normalisation (TRL's), one of {LOSS_TYPES}.")
    scale_rewards: str = _f("group", f"Advantage scaling, one of {SCALE_REWARDS}.")
    num_iterations: int = _f(1, "Optimisation passes per generated batch (mu in the paper).")
    mask_truncated_completions: bool = _f(False, "Exclude completions that hit max_completion_length from the loss.")
    reward_funcs: list = _f(["correctness", "format_soft"], f"Reward functions: built-in names from {REWARD_FUNCS}, "
                            "`module:function` strings (an importable module, e.g. `my_rewards:length_penalty`) or, "
                            "from Python (notebook, trainer API), callables `fn(prompts, completions, **columns)`.")
    reward_weights: list = _f([], "One weight per reward function (empty: all 1.0).")
    reward_errors: str = _f("raise", f"When a reward function raises, one of {REWARD_ERRORS}: `raise` stops training "
                            "with an error naming the function and the sample; `zero` scores that sample 0.0 and "
                            "logs a warning with the same details.")
    reward_time_limit_s: float = _f(REWARD_TIME_LIMIT_S, "Wall-clock seconds one reward function call may take "
                                    "(0: no limit); a call that runs longer is stopped and its samples re-run one "
                                    "by one within one more such budget; a sample that runs out of it scores 0.0 "
                                    "with a warning naming the function and the sample.")
    learning_rate: float = _f(2e-4, "Peak learning rate (AdamW).")
    lr_scheduler_type: str = _f("constant_with_warmup", "transformers scheduler name.")
    warmup_steps: int = _f(2, "Linear warm-up steps.")
    weight_decay: float = _f(0.0, "AdamW weight decay.")
    max_grad_norm: float = _f(1.0, "Gradient clipping norm.")
    # --- LoRA ------------------------------------------------------------------------
    use_lora: bool = _f(True, "Train a LoRA adapter (the reference model is then the base with it disabled). "
                        "false: full fine-tuning; with beta > 0 TRL loads a reference copy from the model's "
                        "checkpoint folder, so a random built-in then needs beta=0.")
    lora_rank: int = _f(16, "LoRA rank r.")
    lora_alpha: int = _f(32, "LoRA alpha.")
    lora_dropout: float = _f(0.0, "LoRA dropout. Above 0 the kit's checkpointing recomputes each layer whole "
                             "(the random masks cannot be split into token slices) and each adapter saves its own "
                             "dropped input and mask; the VRAM calculator prices both (the 8B's 20K backward: "
                             "18.2 -> 25.6 GiB).")
    lora_target_modules: list = _f(["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
                                   "Module names that get LoRA adapters.")
    # --- memory / generation -----------------------------------------------------------
    generation_backend: str = _f("auto", f"Generation backend of the grpo_kit trainer, one of {GENERATION_BACKENDS}: "
                                 "`vllm` runs vLLM in the training process (weights synced every optimiser step; "
                                 "an error when vLLM is not installed, with the install command); `hf` is "
                                 "transformers `generate` on the training model; `auto` is vLLM where it is "
                                 "installed and can load the model (the embedded model, a local folder or a hub "
                                 "id; on CUDA also the random-weight built-ins, started with random weights), else HF (with a warning when vLLM is "
                                 "installed but cannot be used). trainer=trl always uses TRL's own HF generation.")
    vllm_gpu_memory_utilization: float | None = _f(None, "Share of GPU memory (CUDA) or of host RAM (vLLM's CPU "
                                            "backend) that vLLM reserves for its weights and KV cache, in (0, 1]; null: "
                                            "automatic (on CUDA what the VRAM calculator's training estimate leaves "
                                            "of the card, less 1 GiB; on the CPU a KV cache of a quarter of free "
                                            "RAM, at most 4 GiB). A value that cannot fit stops the run before "
                                            "training starts.")
    kv_cache_dtype: str = _f("auto", f"vLLM KV cache dtype, one of {KV_CACHE_DTYPES}: `fp8` stores the KV cache in "
                             "FP8 (half of bf16), on platforms whose vLLM supports it; needs the vLLM backend.")
    vllm_kv_cache_gib: float | None = _f(None, "vLLM's KV cache in GiB (CUDA); null: what one generation batch needs "
                                         "(prompts x (prompt + num_generations x completion) tokens, the VRAM "
                                         "calculator's KV row), so the engine holds no more than that. A budget that "
                                         "cannot fit beside training stops the run before any model loads, with the "
                                         "calculator's numbers.")
    vllm_lora_dual_stream: bool | None = _f(None, "CUDA, vllm_lora_sync='adapter': run vLLM's LoRA "
                                           "kernels on a second CUDA stream beside each base matmul "
                                           "(VLLM_LORA_ENABLE_DUAL_STREAM) instead of after it. null: the kit's "
                                           "measured choice (grpo_kit.generation.plan.LORA_DUAL_STREAM_DEFAULT).")
    vllm_lora_sync: str | None = _f(None, f"How the LoRA adapter reaches vLLM each step, one of {LORA_SYNC_MODES} or "
                                    "null. With shared weights: `adapter` hands the adapter over in memory and vLLM "
                                    "runs it in its LoRA kernels on every token; `merge` merges it into the shared "
                                    "weights for each generation and restores their exact bits after it "
                                    "(grpo_kit.generation.reversible_merge), so vLLM decodes dense. With a "
                                    "separate engine copy: `merge` loads the merged weights into the copy, "
                                    "`adapter` runs the adapter in the copy's LoRA kernels. null: `merge` (measured "
                                    "faster: grpo_kit.generation.plan.lora_sync_mode).")
    vllm_share_weights: bool | str = _f("auto", "One copy of the weights on CUDA: the training model's frozen base "
                                        "weights are views of the vLLM engine's tensors, LoRA reaches vLLM in "
                                        "memory each step, and the engine releases only its KV cache while "
                                        "training runs (standby). true, false (a separate engine copy, weights "
                                        "synced each step) or `auto` (shared on CUDA with LoRA and 16-bit engine "
                                        "weights; a layout vLLM cannot share falls back to a copy with a warning).")
    load_in_4bit: bool = _f(False, "QLoRA: the training model's base linear weights in 4 bit (bitsandbytes NF4, "
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
    gradient_checkpointing: bool | str = _f("auto", "Gradient checkpointing: true, false or `auto` (on when "
                                            "training on a CUDA GPU, off on the CPU, where it would only "
                                            "recompute). With the grpo_kit trainer on a GPU the layer inputs are "
                                            "offloaded to CPU RAM (grpo_kit.model.offload).")
    loss_chunk_size: int | None = _f(None, "Rows per logits chunk in the efficient loss (null: chosen from free "
                                    "memory).")
    scoring_batch_size: int | str | None = _f("auto", "Completions per no-grad forward when the grpo_kit trainer "
                                              "scores a generation batch (the reference model's log-probs, and TRL's "
                                              "old-policy pass where it runs; verl's log_prob_micro_batch_size). "
                                              "Larger means fewer, fuller forwards (with 4-bit weights, fewer "
                                              "dequantisations) for the activations of that many sequences, which "
                                              "the VRAM calculator prices as its own phase. `auto`: the largest, up "
                                              "to one generation batch, that does not raise the calculator's peak "
                                              "of the step (the run folder's summary.json records it); null: "
                                              "per_device_train_batch_size, as TRL. Safe to change on resume.")

    # ---------------------------------------------------------------------------------
    def checkpointing_on(self, device: str) -> bool:
        """Whether gradient checkpointing runs on ``device`` (``cpu`` / ``cuda``): ``auto`` means on a GPU."""
        return device == "cuda" if self.gradient_checkpointing == "auto" else bool(self.gradient_checkpointing)

    def vllm_options_set(self) -> list[str]:
        """``name=value`` of each vLLM-only option (``VLLM_ONLY_OPTIONS``) that is not at its off value."""
        return [f"{name}={getattr(self, name)!r}" for name, off in VLLM_ONLY_OPTIONS if getattr(self, name) != off]

    @classmethod
    def field_help(cls) -> dict[str, str]:
        return {f.name: f.metadata["help"] for f in dataclasses.fields(cls)}

    @classmethod
    def from_dict(cls, values: dict) -> "GRPOKitConfig":
        """Build from a mapping; unknown keys and wrong types raise ``ConfigError``."""
        if not isinstance(values, dict):
            raise ConfigError(f"config must be a mapping of field: value, got {type(values).__name__}")
        cfg = cls()
        for key, value in values.items():
            cfg.set(key, value)
        return cfg

    @classmethod
    def from_yaml(cls, path: str | os.PathLike, overrides: typing.Sequence[str] = ()) -> "GRPOKitConfig":
        import yaml

        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file {str(path)!r} does not exist")
        try:
            values = yaml.safe_load(p.read_text(encoding="utf-8")) or {}
        except UnicodeDecodeError as e:
            raise ConfigError(f"config file {str(path)!r} is not UTF-8 text (byte {e.start})") from None
        except yaml.YAMLError as e:
            raise ConfigError(f"config file {str(path)!r} is not valid YAML: {e}") from None
        except RecursionError:
            raise ConfigError(f"config file {str(path)!r} is nested too deeply to be a config") from None
        cfg = cls.from_dict(values)
        cfg.apply_overrides(overrides)
        return cfg

    def apply_overrides(self, overrides: typing.Sequence[str]) -> "GRPOKitConfig":
        """Apply ``key=value`` strings (as given to ``--set``); values are parsed as YAML scalars."""
        import yaml

        for item in overrides:
            if "=" not in item:
                raise ConfigError(f"--set expects key=value, got {item!r}")
            key, raw = item.split("=", 1)
            try:
                value = yaml.safe_load(raw) if raw != "" else ""
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
        import yaml

        from grpo_kit.tasks.rewards import reward_func_spec

        values = self.to_dict()
        values["reward_funcs"] = [reward_func_spec(r) for r in values["reward_funcs"]]  # callables as module:name
        Path(path).write_text(yaml.safe_dump(values, sort_keys=False))

    # ---------------------------------------------------------------------------------
    def validate(self) -> "GRPOKitConfig":
        """Check every field; raise one ``ConfigError`` listing all problems. Loads nothing heavy."""
        from grpo_kit.model.loading import check_model_name

        errors: list[str] = []

        def need(ok: bool, msg: str):
            if not ok:
                errors.append(msg)

        def choice(name: str, options):
            value = getattr(self, name)
            need(value in options, f"{name}={value!r} is not allowed; choose one of {list(options)}")

        kind = None
        try:
            kind = check_model_name(self.model)
        except ValueError as e:
            errors.append(str(e))
        for name, options in [("device", DEVICES), ("dtype", DTYPES), ("trainer", TRAINERS), ("task", TASKS),
                              ("loss_type", LOSS_TYPES), ("scale_rewards", SCALE_REWARDS), ("reward_errors", REWARD_ERRORS),
                              ("generation_backend", GENERATION_BACKENDS)]:
            choice(name, options)
        need(isinstance(self.gradient_checkpointing, bool) or self.gradient_checkpointing == "auto",
             f"gradient_checkpointing={self.gradient_checkpointing!r} is not allowed: true, false or 'auto'")
        kinds = {f.name: str(f.type) for f in dataclasses.fields(self)}
        out_of_range = set()
        for name in NUMERIC_RANGES:
            value = getattr(self, name)
            if (value is None and kinds[name].endswith("| None")) or (value == "auto" and "| str" in kinds[name]):
                continue
            problem = _numeric_problem(name, value, "int" if kinds[name].startswith("int") else "float")
            if problem:
                errors.append(problem)
                out_of_range.add(name)
        # TRL builds its reference model for full fine-tuning from the policy's checkpoint folder, which a random
        # built-in does not have (TRL fails deep inside from_pretrained otherwise)
        if "beta" not in out_of_range:
            need(self.use_lora or self.beta == 0 or kind not in ("tiny", "config-only"),
                 f"use_lora=False with beta={self.beta} needs a reference model, which TRL loads from the model's "
                 f"checkpoint folder; model={self.model!r} is a random-weight built-in with none. Set beta=0, or "
                 "use_lora=True (the reference is the model with its adapter off), or save the model and set model= "
                 "to that folder")
        if not out_of_range & {"num_generations", "per_device_train_batch_size", "gradient_accumulation_steps"}:
            total = self.per_device_train_batch_size * self.gradient_accumulation_steps
            need(total % self.num_generations == 0,
                 f"per_device_train_batch_size × gradient_accumulation_steps = {total} must be a multiple of "
                 f"num_generations={self.num_generations} (e.g. {self.num_generations} or "
                 f"{2 * self.num_generations})")
        if not out_of_range & {"save_steps", "logging_steps"}:
            need(self.save_steps <= 0 or self.save_steps % self.logging_steps == 0,
                 f"save_steps={self.save_steps} must be a multiple of logging_steps={self.logging_steps} (a "
                 "checkpoint between two logged steps would lose the metrics of the steps in between on resume)")
        choice("lr_scheduler_type", LR_SCHEDULER_TYPES)
        need(isinstance(self.output_dir, str) and self.output_dir.strip() != "",
             f"output_dir={self.output_dir!r} must name a run folder (a non-empty path)")
        if isinstance(self.output_dir, str) and self.output_dir.strip():
            blocker = _non_folder_on_path(self.output_dir)
            need(blocker is None, f"output_dir={self.output_dir!r} cannot be a run folder: {blocker!r} exists and "
                 "is not a folder")
        lists = ("levels", "reward_funcs", "reward_weights", "lora_target_modules")
        for name in lists:
            need(isinstance(getattr(self, name), list), f"{name}={getattr(self, name)!r} must be a list")
        if not all(isinstance(getattr(self, name), list) for name in lists):  # element checks need lists
            raise ConfigError("invalid config:\n  - " + "\n  - ".join(errors))
        need(bool(self.lora_target_modules) and all(isinstance(m, str) and m.strip() for m in self.lora_target_modules),
             f"lora_target_modules={self.lora_target_modules!r}: each must be a non-empty module name (a string), "
             "at least one")
        bad_weights = [w for w in self.reward_weights
                       if isinstance(w, bool) or not isinstance(w, (int, float)) or not math.isfinite(w)]
        if bad_weights:
            errors.append(f"reward_weights={self.reward_weights!r}: each must be a finite number, not "
                          f"{bad_weights[0]!r}")
        need(len(self.reward_funcs) > 0, f"reward_funcs={self.reward_funcs!r}: at least one is needed")
        try:  # built-in names, module:function strings (imported here) or callables
            from grpo_kit.tasks.rewards import get_reward_funcs

            get_reward_funcs(self.reward_funcs)
        except ValueError as e:
            errors.append(f"reward_funcs: {e}")
        need(not self.reward_weights or len(self.reward_weights) == len(self.reward_funcs),
             f"reward_weights has {len(self.reward_weights)} entries but reward_funcs has {len(self.reward_funcs)}")
        bad_levels = [lv for lv in self.levels if isinstance(lv, bool) or lv not in (1, 2, 3, 4)]
        need(self.task == "gsm8k" or (self.levels and not bad_levels),
             f"levels={self.levels!r}: each must be one of [1, 2, 3, 4], at least one")
        need(isinstance(self.vllm_share_weights, bool) or self.vllm_share_weights == "auto",
             f"vllm_share_weights={self.vllm_share_weights!r} is not allowed: true, false or 'auto'")
        need(self.vllm_share_weights is not True or (self.use_lora and not self.load_in_4bit),
             f"vllm_share_weights=True needs use_lora=True and load_in_4bit=False (use_lora={self.use_lora}, "
             f"load_in_4bit={self.load_in_4bit}): full fine-tuning updates the weights vLLM would share, and "
             "a 4-bit training model has no 16-bit weights to share")
        choice("kv_cache_dtype", KV_CACHE_DTYPES)
        need(self.vllm_lora_dual_stream is None or isinstance(self.vllm_lora_dual_stream, bool),
             f"vllm_lora_dual_stream={self.vllm_lora_dual_stream!r} is not allowed: true, false or null (automatic)")
        need(self.vllm_lora_sync is None or self.vllm_lora_sync in LORA_SYNC_MODES,
             f"vllm_lora_sync={self.vllm_lora_sync!r} is not allowed: one of {list(LORA_SYNC_MODES)} or null")
        need(self.vllm_lora_sync is None or self.use_lora, f"vllm_lora_sync={self.vllm_lora_sync!r} needs use_lora=True "
             "(full fine-tuning syncs the whole weights)")
        need(not (self.vllm_lora_sync == "merge" and self.vllm_lora_dual_stream),
             "vllm_lora_dual_stream=True needs the adapter in vLLM's LoRA kernels, but vllm_lora_sync='merge' "
             "generates with merged weights and no LoRA kernels; drop one of the two")
        need(self.load_in_4bit_skip_modules == "auto" or (isinstance(self.load_in_4bit_skip_modules, list) and all(
            isinstance(m, str) and m for m in self.load_in_4bit_skip_modules)),
             f"load_in_4bit_skip_modules={self.load_in_4bit_skip_modules!r} is not allowed: 'auto' or a list of "
             "non-empty module names")
        need(self.load_in_4bit_matmul in NF4_MATMULS, f"load_in_4bit_matmul={self.load_in_4bit_matmul!r} is not "
             f"allowed: one of {list(NF4_MATMULS)}")
        need(self.scoring_batch_size in (None, "auto") or self.trainer == "grpo_kit",
             f"scoring_batch_size={self.scoring_batch_size} needs trainer='grpo_kit' (TRL's GRPOTrainer scores "
             "with per_device_train_batch_size); leave it 'auto' or null with trainer='trl'")
        vllm_only = self.vllm_options_set()
        if self.generation_backend == "vllm" or (vllm_only and self.generation_backend != "hf"):
            need(self.trainer == "grpo_kit", f"generation_backend={self.generation_backend!r} with "
                 f"{', '.join(vllm_only) or 'vLLM'} needs trainer='grpo_kit' (trainer='trl' generates with TRL's own "
                 "HF path)")
        if vllm_only:
            need(self.generation_backend != "hf", f"{', '.join(vllm_only)} only apply to vLLM generation, but "
                 "generation_backend='hf'; set generation_backend='vllm' (or 'auto'), or leave them at their defaults")
        if self.load_in_4bit:
            import importlib.util

            need(self.use_lora, "load_in_4bit=True needs use_lora=True: 4-bit weights are frozen (bitsandbytes "
                 "stores them packed, they have no gradient), so full fine-tuning would train nothing")
            need(self.device != "cpu", "load_in_4bit=True needs a CUDA GPU (bitsandbytes' 4-bit training path), "
                 "but device='cpu'; use device=auto on a GPU machine, or load_in_4bit=False")
            if self.device == "auto":  # where the run will train: known here, before any model or data loads
                import torch

                need(torch.cuda.is_available(), "load_in_4bit=True needs a CUDA GPU (bitsandbytes' 4-bit training "
                     "path), but device='auto' finds none on this machine; run on a GPU machine or set "
                     "load_in_4bit=False")
            need(self.generation_backend != "vllm", "load_in_4bit=True generates with HF generate: vLLM cannot "
                 "take a 4-bit training model's weights yet; set generation_backend='hf' or 'auto'")
            need(importlib.util.find_spec("bitsandbytes") is not None,
                 "load_in_4bit=True needs the bitsandbytes package, which is not installed: python -m pip install "
                 "bitsandbytes==0.50.2 (CUDA), or set load_in_4bit=False")
        for name in ("dataset_path", "eval_dataset_path"):
            path = getattr(self, name)
            if self.task == "gsm8k" and path:
                need(os.path.isfile(path), f"{name}={path!r} does not exist")
        need(not self.eval_dataset_path or self.task == "gsm8k",
             f"eval_dataset_path={self.eval_dataset_path!r} applies to task='gsm8k' only (task={self.task!r}: its "
             "held-out set is generated)")
        if errors:
            raise ConfigError("invalid config:\n  - " + "\n  - ".join(errors))
        return self


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
    err = ConfigError(f"{key}={value!r} has the wrong type: expected {getattr(typ, '__name__', annotation)}")
    if isinstance(annotation, str) and annotation.endswith(" | None"):  # null, or a value of the type
        if value is None or (isinstance(value, str) and value.strip().lower() in ("null", "none", "~")):
            return None
        return _coerce(key, value, annotation.removesuffix(" | None"))
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
                value = json.loads(value)
            except json.JSONDecodeError:
                value = [v.strip() for v in value.split(",") if v.strip()]
        if not isinstance(value, (list, tuple)):
            raise err
        return list(value)
    return value
