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
import os
import typing
from dataclasses import dataclass, field
from pathlib import Path

from .names import GENERATION_BACKENDS, LOSS_TYPES, REWARD_ERRORS

TASKS = ("arithmetic", "word_problems", "gsm8k")
REWARD_FUNCS = ("correctness", "format_strict", "format_soft")
DTYPES = ("auto", "fp32", "bf16", "fp16")
DEVICES = ("auto", "cpu", "cuda")
TRAINERS = ("grpo_kit", "trl")
KV_CACHE_DTYPES = ("auto", "fp8")
SCALE_REWARDS = ("group", "batch", "none")
# Fields that only vLLM generation reads, with their "off" value: set to anything else they need vLLM.
VLLM_ONLY_OPTIONS = (("kv_cache_dtype", "auto"), ("load_in_4bit", False), ("vllm_gpu_memory_utilization", 0.0),
                     ("vllm_kv_cache_gib", None))


class ConfigError(ValueError):
    """A config value that is not allowed; the message names the field and the options."""


def _f(default, help: str, **kw):
    """A dataclass field whose help text lives in its metadata (as in TRL's configs)."""
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda d=default: type(d)(d), metadata={"help": help, **kw})
    return field(default=default, metadata={"help": help, **kw})


@dataclass
class GRPOKitConfig:
    # --- run -------------------------------------------------------------------------
    model: str = _f("smollm2-135m-instruct", "Built-in name (see `grpo_kit.models.BUILTIN_MODELS`), a local "
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
                           "the hub dataset openai/gsm8k (needs network).")
    num_train_samples: int = _f(1000, "Training problems to generate (or to take from the jsonl).")
    num_eval_samples: int = _f(200, "Held-out problems for before/after accuracy (0: no evaluation).")
    system_prompt: str = _f("", "System prompt; empty: the kit's default for the task (arithmetic: the answer only, "
                            "as `Answer: <number>`; word problems and GSM8K: brief reasoning, then that line).")
    # --- GRPO (names as in TRL's GRPOConfig) -------------------------------------------
    num_generations: int = _f(8, "Completions sampled per prompt (the group size); at least 2.")
    per_device_train_batch_size: int = _f(16, "Completions per micro-batch; must be a multiple of num_generations. "
                                          "The default 16 is 2 prompts per step: with 1 prompt most early steps of "
                                          "the untrained embedded model had no reward spread, and a seed could fail "
                                          "to learn (bench/results/learning_cpu_vllm*.md).")
    gradient_accumulation_steps: int = _f(1, "Micro-batches per optimiser step.")
    max_prompt_length: int = _f(256, "Longest prompt in tokens; longer prompts are an error, not silently cut.")
    max_completion_length: int = _f(24, "Longest completion in tokens.")
    temperature: float = _f(0.7, "Sampling temperature (> 0).")
    top_p: float = _f(1.0, "Nucleus sampling threshold in (0, 1].")
    top_k: int = _f(0, "Top-k sampling (0: off).")
    min_p: float = _f(0.0, "Min-p sampling threshold in [0, 1) (0: off).")
    beta: float = _f(0.04, "KL coefficient (k3 estimator against the reference model); 0 skips the reference pass.")
    epsilon: float = _f(0.2, "Lower clipping range of the ratio.")
    epsilon_high: float = _f(0.0, "Upper clipping range (0: same as epsilon).")
    loss_type: str = _f("grpo", f"GRPO objective and normalisation (TRL's), one of {LOSS_TYPES}.")
    scale_rewards: str = _f("group", f"Advantage scaling, one of {SCALE_REWARDS}.")
    num_iterations: int = _f(1, "Optimisation passes per generated batch (mu in the paper).")
    mask_truncated_completions: bool = _f(False, "Exclude completions that hit max_completion_length from the loss.")
    reward_funcs: list = _f(["correctness", "format_soft"], f"Reward functions by name, from {REWARD_FUNCS}.")
    reward_weights: list = _f([], "One weight per reward function (empty: all 1.0).")
    reward_errors: str = _f("raise", f"When a reward function raises, one of {REWARD_ERRORS}: `raise` stops training "
                            "with an error naming the function and the sample; `zero` scores that sample 0.0 and "
                            "logs a warning with the same details.")
    learning_rate: float = _f(2e-4, "Peak learning rate (AdamW).")
    lr_scheduler_type: str = _f("constant_with_warmup", "transformers scheduler name.")
    warmup_steps: int = _f(2, "Linear warm-up steps.")
    weight_decay: float = _f(0.0, "AdamW weight decay.")
    max_grad_norm: float = _f(1.0, "Gradient clipping norm.")
    # --- LoRA ------------------------------------------------------------------------
    use_lora: bool = _f(True, "Train a LoRA adapter (the reference model is then the base with it disabled).")
    lora_rank: int = _f(16, "LoRA rank r.")
    lora_alpha: int = _f(32, "LoRA alpha.")
    lora_dropout: float = _f(0.0, "LoRA dropout.")
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
    vllm_gpu_memory_utilization: float = _f(0.0, "Share of GPU memory (CUDA) or of host RAM (vLLM's CPU backend) "
                                            "that vLLM reserves for its weights and KV cache, in (0, 1]; 0: "
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
    vllm_share_weights: bool | str = _f("auto", "One copy of the weights on CUDA: the training model's frozen base "
                                        "weights are views of the vLLM engine's tensors, LoRA reaches vLLM in "
                                        "memory each step, and the engine releases only its KV cache while "
                                        "training runs (standby). true, false (a separate engine copy, weights "
                                        "synced each step) or `auto` (shared on CUDA with LoRA and 16-bit engine "
                                        "weights; a layout vLLM cannot share falls back to a copy with a warning).")
    load_in_4bit: bool = _f(False, "Generate with 4-bit (bitsandbytes NF4) weights in vLLM, except the modules in "
                            "load_in_4bit_skip_modules (\"dynamic 4-bit\"); needs the vLLM backend on CUDA and the "
                            "bitsandbytes package. Training weights are not affected.")
    load_in_4bit_skip_modules: list = _f(["lm_head"], "Module names kept in 16 bit when load_in_4bit is on "
                                         "(substrings of the checkpoint names, e.g. `lm_head`, `down_proj`, "
                                         "`model.layers.0.`).")
    gradient_checkpointing: bool | str = _f("auto", "Gradient checkpointing: true, false or `auto` (on when "
                                            "training on a CUDA GPU, off on the CPU, where it would only "
                                            "recompute). With the grpo_kit trainer on a GPU the layer inputs are "
                                            "offloaded to CPU RAM (grpo_kit.checkpointing).")
    loss_chunk_size: int = _f(0, "Rows per logits chunk in the efficient loss (0: chosen from free memory).")

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
            values = yaml.safe_load(p.read_text()) or {}
        except yaml.YAMLError as e:
            raise ConfigError(f"config file {str(path)!r} is not valid YAML: {e}") from None
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

        Path(path).write_text(yaml.safe_dump(self.to_dict(), sort_keys=False))

    # ---------------------------------------------------------------------------------
    def validate(self) -> "GRPOKitConfig":
        """Check every field; raise one ``ConfigError`` listing all problems. Loads nothing heavy."""
        from .models import check_model_name

        errors: list[str] = []

        def need(ok: bool, msg: str):
            if not ok:
                errors.append(msg)

        def choice(name: str, options):
            value = getattr(self, name)
            need(value in options, f"{name}={value!r} is not allowed; choose one of {list(options)}")

        try:
            check_model_name(self.model)
        except ValueError as e:
            errors.append(str(e))
        for name, options in [("device", DEVICES), ("dtype", DTYPES), ("trainer", TRAINERS), ("task", TASKS),
                              ("loss_type", LOSS_TYPES), ("scale_rewards", SCALE_REWARDS), ("reward_errors", REWARD_ERRORS),
                              ("generation_backend", GENERATION_BACKENDS)]:
            choice(name, options)
        need(isinstance(self.gradient_checkpointing, bool) or self.gradient_checkpointing == "auto",
             f"gradient_checkpointing={self.gradient_checkpointing!r} is not allowed: true, false or 'auto'")
        need(self.num_generations >= 2, f"num_generations={self.num_generations} must be at least 2 "
             "(advantages compare completions within a group)")
        need(self.per_device_train_batch_size >= 1, "per_device_train_batch_size must be >= 1")
        if self.num_generations >= 2 and self.per_device_train_batch_size >= 1:
            total = self.per_device_train_batch_size * self.gradient_accumulation_steps
            need(total % self.num_generations == 0,
                 f"per_device_train_batch_size × gradient_accumulation_steps = {total} must be a multiple of "
                 f"num_generations={self.num_generations} (e.g. {self.num_generations} or "
                 f"{2 * self.num_generations})")
        for name in ("max_steps", "gradient_accumulation_steps", "max_prompt_length", "max_completion_length",
                     "num_train_samples", "num_iterations", "logging_steps", "lora_rank", "lora_alpha"):
            need(getattr(self, name) >= 1, f"{name}={getattr(self, name)} must be >= 1")
        for name in ("save_steps", "num_eval_samples", "warmup_steps", "top_k", "loss_chunk_size", "keep_checkpoints"):
            need(getattr(self, name) >= 0, f"{name}={getattr(self, name)} must be >= 0")
        need(self.max_bad_steps >= 1, f"max_bad_steps={self.max_bad_steps} must be >= 1")
        need(self.save_steps <= 0 or self.logging_steps < 1 or self.save_steps % self.logging_steps == 0,
             f"save_steps={self.save_steps} must be a multiple of logging_steps={self.logging_steps} (a checkpoint "
             "between two logged steps would lose the metrics of the steps in between on resume)")
        need(self.temperature > 0, f"temperature={self.temperature} must be > 0")
        need(0 < self.top_p <= 1, f"top_p={self.top_p} must be in (0, 1]")
        need(0 <= self.min_p < 1, f"min_p={self.min_p} must be in [0, 1)")
        need(self.beta >= 0, f"beta={self.beta} must be >= 0")
        need(0 <= self.epsilon < 1, f"epsilon={self.epsilon} must be in [0, 1)")
        need(self.epsilon_high >= 0, f"epsilon_high={self.epsilon_high} must be >= 0")
        need(self.learning_rate > 0, f"learning_rate={self.learning_rate} must be > 0")
        need(0 <= self.lora_dropout < 1, f"lora_dropout={self.lora_dropout} must be in [0, 1)")
        bad = [r for r in self.reward_funcs if r not in REWARD_FUNCS]
        need(not bad and len(self.reward_funcs) > 0,
             f"reward_funcs={self.reward_funcs!r}: each must be one of {list(REWARD_FUNCS)}, at least one")
        need(not self.reward_weights or len(self.reward_weights) == len(self.reward_funcs),
             f"reward_weights has {len(self.reward_weights)} entries but reward_funcs has {len(self.reward_funcs)}")
        bad_levels = [lv for lv in self.levels if lv not in (1, 2, 3, 4)]
        need(self.task == "gsm8k" or (self.levels and not bad_levels),
             f"levels={self.levels!r}: each must be one of [1, 2, 3, 4], at least one")
        need(self.vllm_gpu_memory_utilization == 0 or 0 < self.vllm_gpu_memory_utilization <= 1,
             f"vllm_gpu_memory_utilization={self.vllm_gpu_memory_utilization} must be in (0, 1], or 0 for automatic")
        need(self.vllm_kv_cache_gib is None or self.vllm_kv_cache_gib > 0,
             f"vllm_kv_cache_gib={self.vllm_kv_cache_gib} must be > 0 GiB, or null for automatic")
        need(isinstance(self.vllm_share_weights, bool) or self.vllm_share_weights == "auto",
             f"vllm_share_weights={self.vllm_share_weights!r} is not allowed: true, false or 'auto'")
        need(self.vllm_share_weights is not True or (self.use_lora and not self.load_in_4bit),
             f"vllm_share_weights=True needs use_lora=True and load_in_4bit=False (use_lora={self.use_lora}, "
             f"load_in_4bit={self.load_in_4bit}): full fine-tuning updates the weights vLLM would share, and "
             "4-bit engine weights cannot back 16-bit training")
        choice("kv_cache_dtype", KV_CACHE_DTYPES)
        need(all(isinstance(m, str) and m for m in self.load_in_4bit_skip_modules),
             f"load_in_4bit_skip_modules={self.load_in_4bit_skip_modules!r}: each must be a non-empty module name")
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

            need(importlib.util.find_spec("bitsandbytes") is not None,
                 "load_in_4bit=True needs the bitsandbytes package (4-bit weights in vLLM, CUDA only), which is not "
                 "installed; install it on a CUDA machine (python -m pip install bitsandbytes) or set "
                 "load_in_4bit=False")
        if self.task == "gsm8k" and self.dataset_path:
            need(os.path.isfile(self.dataset_path), f"dataset_path={self.dataset_path!r} does not exist")
        if errors:
            raise ConfigError("invalid config:\n  - " + "\n  - ".join(errors))
        return self


def _coerce(key: str, value, annotation):
    """Coerce YAML/CLI/papermill values to the field's type, or raise a clear error."""
    typ = {"int": int, "float": float, "bool": bool, "str": str, "list": list}.get(
        annotation if isinstance(annotation, str) else getattr(annotation, "__name__", ""), None)
    err = ConfigError(f"{key}={value!r} has the wrong type: expected {getattr(typ, '__name__', annotation)}")
    if isinstance(annotation, str) and annotation.endswith(" | None"):  # null, or a value of the type
        if value is None or (isinstance(value, str) and value.strip().lower() in ("null", "none", "~")):
            return None
        return _coerce(key, value, annotation.removesuffix(" | None"))
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
        if isinstance(value, bool) or not isinstance(value, (int, float)) or int(value) != value:
            raise err
        return int(value)
    if typ is float:
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
