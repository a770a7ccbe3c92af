"""The one config object of the kit: ``GRPOKitConfig``, a list of fields by group.

Field names follow TRL's ``GRPOConfig`` where the meaning is the same. Each field's help text is in
:mod:`grpo_kit.app.config_help`; reading YAML and ``--set`` in :mod:`grpo_kit.app.config_loading`; the checks in
:mod:`grpo_kit.app.config_checks`. The config is validated once, at the edge (CLI, YAML, notebook parameters), by
``validate()``; every problem is reported in one ``ConfigError`` naming the field, the value and what is allowed,
before any model is loaded. Inside the kit it is trusted; the layers below the app take their own narrow spec of it
(``spec()``, :mod:`grpo_kit.app.specs`).
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import os
import textwrap
import typing
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from grpo_kit.app.config_checks import ConfigError, allowed_text, validate_config
from grpo_kit.app.config_help import FIELD_HELP, trl_field_help
from grpo_kit.app.config_loading import coerce, parse_override, read_config_file
from grpo_kit.app.specs import layer_spec
from grpo_kit.generation.spec import GenerationSpec
from grpo_kit.loss.objective import ENGINE_IS_DEFAULT, ObjectiveSpec
from grpo_kit.memory.spec import StepSpec
from grpo_kit.model.devices import checkpointing_on
from grpo_kit.tasks.rewards import REWARD_TIME_LIMIT_S, reward_func_spec
from grpo_kit.tasks.tools import TOOL_OUTPUT_TOKENS, TOOL_TIME_LIMIT_S, tool_spec

__all__ = [
    "GRPOKitConfig",
    "ConfigError",
    "KIT_DEFAULTS_OVER_TRL",
    "KIT_ONLY_TRL_NAMES",
    "NULL_MEANS_AUTO",
    "OBJECTIVE_FIELDS",
    "OBJECTIVE_RENAMES",
]

# Fields whose "automatic" value is null (as in TRL); configs saved before they were, wrote 0 for it. A run folder
# of that time resumes with 0 read as null (resume_policy.resume_config); a new config's 0 is refused with the note.
NULL_MEANS_AUTO = ("epsilon_high", "loss_chunk_size", "vllm_gpu_memory_utilization")

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


def _list(default: list):
    """A list field: each config gets its own copy of ``default``."""
    return field(default_factory=lambda d=default: list(d))


def _kit(name: str):
    """A TRL-named field with the kit's own default (``KIT_DEFAULTS_OVER_TRL``)."""
    default = KIT_DEFAULTS_OVER_TRL[name]
    return _list(default) if isinstance(default, list) else field(default=default)


def _objective(name: str):
    """One of the objective's further options: ``ObjectiveSpec``'s default (the kit's where
    ``KIT_DEFAULTS_OVER_TRL`` has one), marked so that validation hands it to ``ObjectiveSpec``'s own checks."""
    default = KIT_DEFAULTS_OVER_TRL.get(name, ObjectiveSpec.__dataclass_fields__[name].default)
    return field(default=default, metadata={"objective": True})


@dataclass
class GRPOKitConfig:
    # --- run -------------------------------------------------------------------------
    model: str = StepSpec.model
    output_dir: str = _kit("output_dir")
    seed: int = _kit("seed")
    max_steps: int = _kit("max_steps")
    save_steps: int = _kit("save_steps")
    keep_checkpoints: int = 2
    max_bad_steps: int = 3
    logging_steps: int = _kit("logging_steps")
    report_to: str | list = "none"
    run_name: str | None = None
    device: str = "auto"
    dtype: str = StepSpec.dtype
    trainer: str = StepSpec.trainer
    # --- data ------------------------------------------------------------------------
    task: str = "arithmetic"
    levels: list = _list([1, 2])
    dataset_path: str = ""
    eval_dataset_path: str = ""
    num_train_samples: int = 1000
    num_eval_samples: int = 200
    system_prompt: str = ""
    # --- GRPO (names as in TRL's GRPOConfig) -------------------------------------------
    num_generations: int = StepSpec.num_generations
    per_device_train_batch_size: int = _kit("per_device_train_batch_size")
    gradient_accumulation_steps: int = StepSpec.gradient_accumulation_steps
    max_prompt_length: int = StepSpec.max_prompt_length
    max_completion_length: int = _kit("max_completion_length")
    temperature: float = _kit("temperature")
    top_p: float = 1.0
    top_k: int = 0
    min_p: float | None = None
    beta: float = _kit("beta")
    epsilon: float = 0.2
    epsilon_high: float | None = None
    loss_type: str = _kit("loss_type")
    scale_rewards: str = "group"
    num_iterations: int = StepSpec.num_iterations
    mask_truncated_completions: bool = False
    # correctness alone by default: the embedded model answers the arithmetic prompt with its number and never
    # wrote "Answer: <n>" in 40 steps, so format_soft paid 0.000 to every sample (a reward with no spread adds
    # nothing to any advantage); the pre-flight proposes it where a run starts with no reward at all
    reward_funcs: list = _list(["correctness"])
    reward_weights: list = _kit("reward_weights")
    reward_errors: str = "raise"
    reward_time_limit_s: float = REWARD_TIME_LIMIT_S
    sandbox_filesystem: str = "minimal"
    tools: list = _list([])
    environment: str | None = None
    tool_time_limit_s: float = TOOL_TIME_LIMIT_S
    tool_output_tokens: int = TOOL_OUTPUT_TOKENS
    max_tool_calling_iterations: int | None = None
    tool_warmup_steps: int = 0
    tool_warmup_learning_rate: float = 2e-4
    learning_rate: float = _kit("learning_rate")
    lr_scheduler_type: str = _kit("lr_scheduler_type")
    warmup_steps: int = _kit("warmup_steps")
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0
    # --- LoRA ------------------------------------------------------------------------
    use_lora: bool = StepSpec.use_lora
    trust_remote_code: bool = False
    lora_rank: int = StepSpec.lora_rank
    lora_alpha: int = 32
    lora_dropout: float = StepSpec.lora_dropout
    lora_target_modules: list | str = "auto"
    # --- memory / generation -----------------------------------------------------------
    generation_backend: str = StepSpec.generation_backend
    vllm_gpu_memory_utilization: float | None = _kit("vllm_gpu_memory_utilization")
    kv_cache_dtype: str = StepSpec.kv_cache_dtype
    vllm_kv_cache_gib: float | None = None
    vllm_lora_dual_stream: bool | None = None
    vllm_enforce_eager: bool | None = None
    vllm_emulate_precision_casts: bool = False
    vllm_lora_sync: str | None = None
    vllm_importance_sampling_mode: str = ENGINE_IS_DEFAULT
    vllm_share_weights: bool | str = "auto"
    base_weights: str = StepSpec.base_weights
    fp8_block: int | None = None
    load_in_4bit: bool = StepSpec.load_in_4bit
    load_in_4bit_skip_modules: list | str = _list(["lm_head"])
    load_in_4bit_auto_allowance: float = 0.1
    load_in_4bit_matmul: str = "kit"
    gradient_checkpointing: bool | str = _kit("gradient_checkpointing")
    loss_chunk_size: int | None = None
    scoring_batch_size: int | str | None = StepSpec.scoring_batch_size
    prefix_sharing: bool | str = StepSpec.prefix_sharing
    # --- the objective's further options: ObjectiveSpec's (name, type, default), TRL's help ---
    delta: float | None = _objective("delta")
    importance_sampling_level: str = _objective("importance_sampling_level")
    use_bias_correction_kl: bool = _objective("use_bias_correction_kl")
    top_entropy_quantile: float = _objective("top_entropy_quantile")
    off_policy_mask_threshold: float | None = _objective("off_policy_mask_threshold")
    sapo_temperature_pos: float = _objective("sapo_temperature_pos")
    sapo_temperature_neg: float = _objective("sapo_temperature_neg")
    vespo_k_pos: float = _objective("vespo_k_pos")
    vespo_lambda_pos: float = _objective("vespo_lambda_pos")
    vespo_k_neg: float = _objective("vespo_k_neg")
    vespo_lambda_neg: float = _objective("vespo_lambda_neg")

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
        """Each field's help: the kit's own (``FIELD_HELP``), or TRL's for the objective's further options."""
        fields = dataclasses.fields(cls)
        trl = trl_field_help() if any(f.name not in FIELD_HELP for f in fields) else {}
        return {f.name: FIELD_HELP.get(f.name) or f"(TRL's help) {trl.get(f.name, '')}" for f in fields}

    @classmethod
    def describe(cls, width: int = 100) -> str:
        """Every field with its type, default, allowed values and help (``train --help-config``)."""
        out = []
        helps = cls.field_help()
        for f in dataclasses.fields(cls):
            default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
            allowed = allowed_text(f.name, str(f.type))
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
        """Build from a YAML file (:func:`grpo_kit.app.config_loading.read_config_file`), then ``overrides``."""
        cfg = cls.from_dict(read_config_file(path))
        cfg.apply_overrides(overrides)
        return cfg

    def apply_overrides(self, overrides: typing.Sequence[str]) -> GRPOKitConfig:
        """Apply ``key=value`` strings (as given to ``--set``); values are parsed as YAML scalars."""
        for item in overrides:
            self.set(*parse_override(item))
        return self

    def set(self, key: str, value) -> None:
        """Set one field with type coercion; unknown names suggest the closest field."""
        fields = {f.name: f for f in dataclasses.fields(self)}
        if key not in fields:
            close = difflib.get_close_matches(key, fields, n=3)
            hint = f" Did you mean {', '.join(close)}?" if close else ""
            raise ConfigError(f"unknown config key {key!r}.{hint} Known keys: {', '.join(fields)}")
        setattr(self, key, coerce(key, value, fields[key].type))

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def save(self, path: str | os.PathLike) -> None:
        values = self.to_dict()
        values["reward_funcs"] = [reward_func_spec(r) for r in values["reward_funcs"]]  # callables as module:name
        values["tools"] = [tool_spec(t) if callable(t) else t for t in values["tools"]]
        Path(path).write_text(yaml.safe_dump(values, sort_keys=False))

    # ---------------------------------------------------------------------------------
    def validate(self) -> GRPOKitConfig:
        """Check every field; raise one ``ConfigError`` listing all problems (:mod:`grpo_kit.app.config_checks`).
        Loads nothing heavy."""
        validate_config(self)
        return self


OBJECTIVE_FIELDS = tuple(f.name for f in dataclasses.fields(GRPOKitConfig) if f.metadata.get("objective"))
