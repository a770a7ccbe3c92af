"""The main job: GRPO on a model and task from one ``GRPOKitConfig``, into a run folder.

Run folder contents: ``config.yaml`` (what ran), ``metrics.csv`` (one row per logged
step), ``rewards.png``, ``samples.jsonl`` (completions with their rewards),
``eval.json`` (held-out accuracy before/after), ``adapter/`` or ``model/``
(safetensors), ``summary.json`` and, with ``report_to`` TensorBoard, ``tensorboard/`` (its event files).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import time
from pathlib import Path

import psutil
import torch
from accelerate import PartialState
from transformers.integrations import TensorBoardCallback

from grpo_kit.app.config import KIT_ONLY_TRL_NAMES, ConfigError, GRPOKitConfig
from grpo_kit.app.console import closing_lines, plan_lines, quiet_console, quiet_trainer_logs, rounded
from grpo_kit.app.evaluation import evaluate_accuracy, evaluate_with_tools
from grpo_kit.app.metrics import MetricsCallback, SampleRecorder, metric_columns, peak_memory_gib, plot_rewards
from grpo_kit.app.resume_policy import restore_run_files, resume_config
from grpo_kit.app.run_folder import claim_run_folder
from grpo_kit.app.tool_warmup import tool_warmup
from grpo_kit.generation.plan import plan_generation, start_generation
from grpo_kit.generation.spec import GenerationSpec
from grpo_kit.memory import estimate_for_config, total_gpu_bytes
from grpo_kit.memory.spec import StepSpec
from grpo_kit.model.anatomy import inspect_config, resolve_lora_targets, router_aux_coef
from grpo_kit.model.devices import DeviceSpec, resolve_device, resolve_dtype  # noqa: F401 (also the app's public names)
from grpo_kit.model.families import check_supported, family_of
from grpo_kit.model.fp8 import fp8_lora_config
from grpo_kit.model.loading import BUILTIN_MODELS, load_model, load_tokenizer, meta_model, model_config
from grpo_kit.model.offload import AUX_LOSS_OFF_REASON
from grpo_kit.readers.bounded import read_json
from grpo_kit.tasks.chat_template import check_tool_template, use_tool_template
from grpo_kit.tasks.data import (
    DataSpec,
    build_datasets,
    default_system_prompt,
    max_distinct_problems,
    to_prompt_dataset,
)
from grpo_kit.tasks.prompts import calibration_batches
from grpo_kit.tasks.prompts import check_prompt_lengths as check_prompt_tokens
from grpo_kit.tasks.rewards import get_reward_funcs
from grpo_kit.tasks.sandbox import set_default_filesystem
from grpo_kit.tasks.tools import environment_tools, get_tools, resolve_environment
from grpo_kit.trainer.channel import channel
from grpo_kit.trainer.checkpoints import (
    DISK_FULL,
    SignalStop,
    checkpoint_step,
    disk_full_error,
    find_resume_checkpoint,
    read_run_state,
    resume_hint,
)
from grpo_kit.trainer.sharding import check_launch_env, save_whole
from grpo_kit.trainer.spec import TrainerSpec


def _prompt_tools(cfg: GRPOKitConfig) -> list | None:
    """The tool schemas a prompt carries: the config's tools and its environment's methods (from one instance)."""
    tools = (get_tools(cfg.tools) if cfg.tools else []) + (
        environment_tools(resolve_environment(cfg.environment)()) if cfg.environment is not None else []
    )
    return tools or None


def check_prompt_lengths(tokenizer, examples: list[dict], cfg: GRPOKitConfig, system_prompt: str) -> int:
    """:func:`grpo_kit.tasks.prompts.check_prompt_lengths` with the config's tools and ``max_prompt_length``."""
    return check_prompt_tokens(
        tokenizer, examples, system_prompt, max_prompt_length=cfg.max_prompt_length, tools=_prompt_tools(cfg)
    )


def _release(generator, *, standby: bool) -> None:
    """Put the engine in standby (``standby``) or close it; never lose the run over a failing shutdown."""
    try:
        generator.sleep() if standby else generator.close()
    except Exception as e:
        print(
            f"warning: {'standby of' if standby else 'closing'} the {generator.name} generator failed: {e}", flush=True
        )


def grpo_args(cfg: GRPOKitConfig, device: str, dtype: torch.dtype):
    """TRL ``GRPOConfig`` from the kit's config: every field TRL also has passes by name (but
    ``KIT_ONLY_TRL_NAMES``), then the few the kit writes its own way are put in TRL's form."""
    from trl import GRPOConfig  # lazy: TRL is slow to import, and `import grpo_kit.app.run` must not need it

    shared = {f.name for f in dataclasses.fields(GRPOConfig) if f.init} & {f.name for f in dataclasses.fields(cfg)}
    values = {name: getattr(cfg, name) for name in shared - set(KIT_ONLY_TRL_NAMES)}
    values.update(
        save_strategy="steps" if cfg.save_steps else "no",
        save_steps=cfg.save_steps or 500,  # 0: no checkpoints
        min_p=cfg.min_p or None,
        reward_weights=cfg.reward_weights or None,  # 0 and []: off / all 1.0
        gradient_checkpointing=cfg.checkpointing_on(device),
        data_seed=cfg.seed,
        use_cpu=(device == "cpu"),
        bf16=(dtype == torch.bfloat16),
        fp16=(dtype == torch.float16),
        # the kit writes its own metrics.csv, samples.jsonl and console line (report_to passes by name)
        disable_tqdm=False,
        log_completions=False,
        remove_unused_columns=False,
    )
    return GRPOConfig(**values)


def train(
    cfg: GRPOKitConfig,
    *,
    progress: bool = True,
    callbacks: tuple = (),
    resume: bool = False,
    overwrite: bool = False,
    verbose: bool = False,
) -> dict:
    """Run the main job for a config; returns the summary also written to ``summary.json``.

    ``callbacks``: extra ``transformers.TrainerCallback`` objects (e.g. a notebook dashboard). ``verbose``: vLLM's
    log and third-party warnings as the libraries print them; by default the console shows the plan, the held-out
    accuracy, a line per step and a closing table (:mod:`grpo_kit.app.console`).

    The config is validated and the data built before any model is loaded, so bad input
    fails in seconds. Nothing already in the run folder is deleted: a folder that holds a run is
    refused unless ``overwrite=True``, which moves that run aside (:mod:`grpo_kit.app.run_folder`), and
    the folder is locked against a second writer while the run lasts.

    ``resume=True``: continue the run in ``cfg.output_dir`` from its last complete checkpoint (use
    :func:`resume`, which also checks the config against the saved one). A run that
    already finished is left as it is; one stopped at ``max_steps`` during its final save or
    evaluation finishes those without training further.
    """
    quiet_console(verbose)  # before TRL's and vLLM's imports, whose warnings and log it sets
    cfg.validate()
    set_default_filesystem(cfg.sandbox_filesystem)  # what model code run by the rewards and tools sees
    check_launch_env()  # a sharding mode without a passing test stops here, before any data or model loads
    device = resolve_device(cfg.spec(DeviceSpec))
    check_task_size(cfg)  # before the data: drawing more distinct problems than a task has would never end
    train_ex, heldout = build_datasets(cfg.spec(DataSpec))  # data errors surface before the model loads
    reward_funcs = get_reward_funcs(cfg.reward_funcs)
    # Under `accelerate launch` every process runs this function; only the main one evaluates and writes.
    state = PartialState(cpu=(device == "cpu"))
    config = model_config(cfg.model, trust_remote_code=cfg.trust_remote_code)  # read once, handed to each phase
    check_before_load(cfg, config, device, train_ex, heldout, num_processes=state.num_processes)
    run_dir = Path(cfg.output_dir)
    with SignalStop() as signals:
        lock = claim_run_folder(run_dir, resume=resume, overwrite=overwrite) if state.is_main_process else None
        signals.run_dir = run_dir  # a second signal names the checkpoint to resume from
        if lock is None:  # other processes: the main one owns the folder
            run_dir.mkdir(parents=True, exist_ok=True)
        run = _Run(
            cfg,
            run_dir,
            device,
            resolve_dtype(cfg.spec(DeviceSpec), device),
            state.is_main_process,
            progress,
            train_ex,
            heldout,
            _system_prompt(cfg),
            config,
            signals,
        )
        started = finished = False
        try:
            ready = _prepare(run, reward_funcs, callbacks, resume)
            if isinstance(ready, dict):  # resumed a run that had finished: its summary, nothing to do
                finished = True
                return ready
            started = True  # from here on, the run folder holds what was trained
            summary = _finish(run, ready)
            finished = True
            return summary
        except OSError as e:
            if e.errno not in DISK_FULL:
                raise
            raise disk_full_error(run_dir, e, "the run's files") from None
        finally:
            if lock is not None and not (finished or started or resume):  # nothing trained: nothing left
                for name in UNSTARTED_FILES:
                    (run_dir / name).unlink(missing_ok=True)
                lock.abandon()
            elif lock is not None:
                lock.release()


def resume(run_dir: str | os.PathLike, overrides=(), **train_kwargs) -> dict:
    """Continue the run in ``run_dir`` from its last complete checkpoint (notebook entry point).

    ``overrides``: ``key=value`` strings, only for :data:`grpo_kit.app.resume_policy.SAFE_RESUME_OVERRIDES` (e.g. ``max_steps=80``).
    Other keyword arguments go to :func:`train` (``progress``, ``callbacks``).
    """
    cfg = resume_config(run_dir, overrides)
    return train(cfg, resume=True, **train_kwargs)


def _system_prompt(cfg: GRPOKitConfig) -> str:
    """The run's system prompt: the config's, or the task's default (with tools: one that says to use them)."""
    return cfg.system_prompt or default_system_prompt(cfg.task, tools=bool(cfg.tools or cfg.environment))


@dataclasses.dataclass(frozen=True)
class _Run:
    """What every phase of one run reads, fixed before the first: the config, where and in which dtype it trains,
    this process's part, its data and system prompt, the model's transformers config (read once) and the signals."""

    cfg: GRPOKitConfig
    run_dir: Path
    device: str
    dtype: torch.dtype
    is_main: bool
    progress: bool
    train_ex: list
    heldout: list
    system_prompt: str
    model_config: object
    signals: SignalStop | None = None  # SIGTERM/SIGINT while the run lasts


@dataclasses.dataclass(frozen=True)
class _ResumePoint:
    """The checkpoint a run resumes from (:func:`_find_resume_point`): its folder, its run state (metrics, evals,
    recorder step) and whether it is at max_steps already (only the final save and evaluation are left)."""

    ckpt: Path
    state: dict
    finishing: bool


@dataclasses.dataclass(frozen=True)
class _Loaded:
    """What :func:`_load` brings: the tokenizer, the training model, the generator (None: TRL's own), the
    generation plan, what was used (``info``, summary.json's ``generation``) and the adapters' module names."""

    tokenizer: object
    model: object
    generator: object
    plan: object
    info: dict
    lora_targets: tuple


@dataclasses.dataclass(frozen=True)
class _RunFiles:
    """This process's samples file, its recorder, and the metrics rows so far (``history``: the list the metrics
    callback appends each logged step to, and checkpoints save)."""

    samples_path: Path
    recorder: SampleRecorder
    history: list


@dataclasses.dataclass(frozen=True)
class _Ready:
    """A run set up to train, as :func:`_prepare` returns it: where it resumes from (None: a new run), the loaded
    model and generator, the trainer, the run's files, the held-out results so far (``evals``, the dict the
    checkpoints save and later phases add to) and the clock at its start."""

    resume_point: _ResumePoint | None
    loaded: _Loaded
    trainer: object
    files: _RunFiles
    evals: dict
    t_start: float


# What a run writes into its folder before training starts (removed again when it fails before then).
UNSTARTED_FILES = ("config.yaml", "samples.jsonl")


def check_task_size(cfg: GRPOKitConfig) -> None:
    """num_train_samples + num_eval_samples within the distinct problems the task can generate (ConfigError)."""
    most = max_distinct_problems(cfg.task, cfg.levels)
    if most is not None and cfg.num_train_samples + cfg.num_eval_samples > most:
        raise ConfigError(
            f"num_train_samples={cfg.num_train_samples}: task={cfg.task!r} at levels {cfg.levels} has "
            f"only {most} distinct problems, and the held-out set takes num_eval_samples="
            f"{cfg.num_eval_samples} of them; ask for at most {max(0, most - cfg.num_eval_samples)}, "
            "or add levels"
        )


def check_before_load(
    cfg: GRPOKitConfig, config, device: str, train_ex: list, heldout: list, num_processes: int = 1
) -> None:
    """What the model's config, the data and the machine allow, checked before any model loads (ConfigError):
    lora_rank within the hidden size, prompt and completion within the context, a step's prompts within the
    data, the held-out set as large as asked, and the step within memory as the VRAM calculator prices it. The kit's
    trainer first: a model family it has not proven, or a layout it cannot map (decoder layers, head, logit form),
    is refused here, from the config alone. ``config``: the model's transformers config (``model_config``)."""
    if cfg.trainer == "grpo_kit":
        try:
            check_supported(config, cfg.model, trust_remote_code=cfg.trust_remote_code)
            inspect_config(config)
        except ValueError as e:
            raise ConfigError(str(e)) from None
    errors = []
    hidden = getattr(config, "hidden_size", None)
    if cfg.use_lora and hidden and cfg.lora_rank > hidden:
        errors.append(
            f"lora_rank={cfg.lora_rank} is more than the model's hidden size {hidden} (an adapter of a "
            f"higher rank than its weights adds nothing); choose at most {hidden}"
        )
    limit = getattr(config, "max_position_embeddings", None)
    if limit and cfg.max_prompt_length + cfg.max_completion_length > limit:
        errors.append(
            f"max_prompt_length={cfg.max_prompt_length} + max_completion_length="
            f"{cfg.max_completion_length} is beyond the model's context ({limit} tokens, "
            f"max_position_embeddings); together they may be at most {limit}"
        )
    prompts = max(
        1, cfg.per_device_train_batch_size * cfg.gradient_accumulation_steps * num_processes // cfg.num_generations
    )
    if len(train_ex) < prompts:
        errors.append(
            f"the data has {len(train_ex)} training problems, fewer training problems than one step takes "
            f"({prompts} prompts: per_device_train_batch_size x gradient_accumulation_steps x processes / "
            "num_generations); use more data or a smaller batch"
        )
    if len(heldout) < cfg.num_eval_samples:
        errors.append(
            f"num_eval_samples={cfg.num_eval_samples}, but the data has only {len(heldout)} held-out "
            f"problems; lower num_eval_samples to at most {len(heldout)}, or give more data"
        )
    errors += [p for p in (_memory_problem(cfg, config, device),) if p]
    if errors:
        raise ConfigError(errors[0] if len(errors) == 1 else "invalid config:\n  - " + "\n  - ".join(errors))


def _memory_problem(cfg: GRPOKitConfig, config, device: str) -> str | None:
    """The step against the device's whole memory (host RAM on the CPU) as the VRAM calculator prices it, or None."""
    try:
        need = total_gpu_bytes(estimate_for_config(cfg.spec(StepSpec), config))
    except Exception:  # an architecture the calculator cannot price: the run itself finds out
        return None
    on_gpu = device == "cuda"
    have = torch.cuda.get_device_properties(0).total_memory if on_gpu else psutil.virtual_memory().total
    if need <= have:
        return None
    return (
        f"the step does not fit in memory: the VRAM calculator estimates {need / 2**30:.1f} GiB at its peak "
        f"(num_generations={cfg.num_generations}, per_device_train_batch_size={cfg.per_device_train_batch_size}, "
        f"max_prompt_length + max_completion_length = {cfg.max_prompt_length + cfg.max_completion_length}), "
        f"and {'the GPU has' if on_gpu else 'this machine has'} {have / 2**30:.1f} GiB; lower them "
        "(python -m grpo_kit vram prices other settings)"
    )


def _prepare(run: _Run, reward_funcs: list, callbacks: tuple, resume: bool) -> _Ready | dict:
    """:func:`train` once the run folder is this process's: every phase before training, in order (the summary
    instead, when a resumed run had finished)."""
    cfg = run.cfg
    point = _find_resume_point(run) if resume else None
    if point is not None and point.finishing and (run.run_dir / "summary.json").is_file():
        print(
            f"the run in {run.run_dir} is already finished ({point.ckpt.name}, max_steps={cfg.max_steps}, "
            f"summary.json written); nothing to do. To train longer: train --resume {run.run_dir} --set "
            "max_steps=N",
            flush=True,
        )
        return {**read_json(run.run_dir / "summary.json"), "already_finished": True}
    if point is not None:
        print(
            f"resuming from {point.ckpt}"
            + (
                " (max_steps reached: finishing the final save and evaluation, no more training)"
                if point.finishing
                else ""
            ),
            flush=True,
        )
    if run.is_main:
        cfg.save(run.run_dir / "config.yaml")
    torch.manual_seed(cfg.seed)
    t_start = time.perf_counter()
    loaded = _load(run)
    evals = dict(point.state.get("evals") or {}) if point is not None else {}
    if run.heldout and run.is_main and "before" not in evals:
        evals["before"] = _evaluate(run, loaded.model, loaded.tokenizer, "before")
    files = _run_files(run, point)
    trainer = _make_trainer(run, loaded, reward_funcs, callbacks, files, evals)
    if cfg.tool_warmup_steps and "warmup" not in evals:  # a resumed adapter holds it already
        evals.update(_warm_up(run, trainer, loaded.tokenizer))
    return _Ready(point, loaded, trainer, files, evals, t_start)


def _finish(run: _Run, ready: _Ready) -> dict:
    """Train, evaluate after, and write eval.json and summary.json (the main process); returns the summary."""
    loaded, trainer, evals = ready.loaded, ready.trainer, ready.evals
    shared = bool(getattr(loaded.generator, "share_weights", False))
    try:
        generation_info = {**loaded.info, **_fit(run, ready, shared)}
        train_seconds = generation_info.pop("train_seconds")
        # FSDP: each forward gathers the weights' shards from every process, so all evaluate; the main one reports
        if run.heldout and (run.is_main or trainer.is_fsdp_enabled):
            evals["after"] = _evaluate(run, trainer.model, loaded.tokenizer, "after")
        if not run.is_main:
            return {"run_dir": str(run.run_dir), "main_process": False}
        (run.run_dir / "eval.json").write_text(json.dumps(evals, indent=2))
    finally:
        if shared:
            _release(loaded.generator, standby=False)
    summary = rounded(_summary(run, ready, generation_info, train_seconds))
    (run.run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    print("\n".join(closing_lines(summary)), flush=True)
    return summary


def _find_resume_point(run: _Run) -> _ResumePoint:
    """The checkpoint to resume from, its run state, and whether it stopped during the final save or evaluation."""
    ckpt = find_resume_checkpoint(run.run_dir)
    return _ResumePoint(ckpt, read_run_state(ckpt), checkpoint_step(ckpt) >= run.cfg.max_steps)


def _load(run: _Run) -> _Loaded:
    """Tokenizer, generation plan, engine and training model.

    The generation backend (config: generation_backend, kv_cache_dtype, vllm_share_weights, ...) is decided before
    any model loads, so that a bad option or a plan that cannot fit stops the run early; what was used goes to
    summary.json. With shared weights the engine starts first and the training model is built on its tensors."""
    cfg, dtype, config = run.cfg, run.dtype, run.model_config
    tokenizer = load_tokenizer(cfg.model, trust_remote_code=cfg.trust_remote_code)
    if cfg.tools or cfg.environment:
        if cfg.model in BUILTIN_MODELS:  # SmolLM2's ChatML vocabulary: the kit's tool-calling template
            use_tool_template(tokenizer)
        check_tool_template(tokenizer, cfg.model)  # one message naming what it lacks, before any model loads
    check_prompt_lengths(tokenizer, run.train_ex + run.heldout, cfg, run.system_prompt)
    targets = tuple(resolve_lora_targets(cfg.lora_target_modules, meta_model(config))) if cfg.use_lora else ()
    plan = plan_generation(
        cfg.spec(GenerationSpec),
        model_config=config,
        device=run.device,
        dtype=dtype,
        num_processes=PartialState().num_processes,
    )
    quant = (
        dict(
            load_in_4bit=True,
            skip_modules=cfg.load_in_4bit_skip_modules,
            auto_allowance=cfg.load_in_4bit_auto_allowance,
            nf4_matmul=cfg.load_in_4bit_matmul,
            calibration=calibration_batches(tokenizer, run.train_ex, run.system_prompt),
        )
        if cfg.load_in_4bit
        else {}
    )
    # the config refuses 4 bit and FP8 together
    quant = dict(base_weights="fp8", fp8_block=cfg.fp8_block) if cfg.base_weights == "fp8" else quant
    generator, model, info = start_generation(
        plan,
        tokenizer=tokenizer,
        dtype=dtype,
        load_model=lambda: load_model(
            cfg.model, dtype=dtype, device=run.device, seed=cfg.seed, trust_remote_code=cfg.trust_remote_code, **quant
        )[0],
    )
    info["model"] = model_plan(cfg, config, run.device, targets)
    if run.is_main:
        print("\n".join(plan_lines(cfg, device=run.device, dtype=dtype, info=info)), flush=True)
    return _Loaded(tokenizer, model, generator, plan, info, targets)


def model_plan(cfg: GRPOKitConfig, config, device: str, targets: tuple) -> dict:
    """What the kit found in the model and how it trains it: family, layers, logit form, LoRA targets, and for a
    mixture of experts, its experts (frozen) and the router's load-balancing loss (summary.json, the plan line)."""
    found = inspect_config(config)
    family = family_of(getattr(config, "model_type", None))
    out = {
        "family": family.name if family else getattr(config, "model_type", "?"),
        "layers": found.layers,
        "logits": found.logit_form.describe(),
        "lora_targets": list(targets),
    }
    if found.experts:
        coef = router_aux_coef(config)
        offloaded = cfg.trainer == "grpo_kit" and device == "cuda" and cfg.checkpointing_on(device)
        out["experts"] = (
            f"{found.experts} per layer, frozen: fused parameters, not LoRA targets (the pinned vLLM "
            "loads no adapter on them)"
        )
        out["router_aux_loss"] = (
            "none in the config"
            if not coef
            else f"off: {AUX_LOSS_OFF_REASON}"
            if offloaded
            else f"x{coef:g}, added to the loss as TRL adds it"
        )
    return out


def _evaluate(run: _Run, model, tokenizer, when: str) -> dict:
    """Greedy held-out accuracy ``before`` or ``after`` training, printed; with tools or an environment, multi-turn
    through training's tool loop, with the share of answers that called a tool and the tool failures."""
    cfg = run.cfg
    progress = f"held-out {when}" if run.progress and run.is_main else None
    multi_turn = bool(cfg.tools or cfg.environment)
    if multi_turn:
        environment = resolve_environment(cfg.environment) if cfg.environment is not None else None
        result = evaluate_with_tools(
            model,
            tokenizer,
            run.heldout,
            get_tools(cfg.tools),
            environment=environment,
            system_prompt=run.system_prompt,
            max_new_tokens=cfg.max_completion_length,
            max_tool_calling_iterations=cfg.max_tool_calling_iterations,
            tool_time_limit_s=cfg.tool_time_limit_s or None,
            tool_output_tokens=cfg.tool_output_tokens,
            progress=progress,
        )
    else:
        result = evaluate_accuracy(
            model,
            tokenizer,
            run.heldout,
            system_prompt=run.system_prompt,
            max_new_tokens=cfg.max_completion_length,
            progress=progress,
        )
    extra = f" (n={len(run.heldout)}, greedy)" if when == "before" else ""
    if multi_turn:
        extra += (
            f"; tool used in {result['tool_use_share']:.0%} of answers, {result['tool_calls']} calls, "
            f"{result['tool_failures']} failed"
        )
    if run.is_main:
        label = f"{when} training" if when in ("before", "after") else when
        print(f"held-out accuracy {label}: {result['accuracy']:.3f}{extra}", flush=True)
    return result


def _warm_up(run: _Run, trainer, tokenizer) -> dict:
    """The supervised tool warm-up (``tool_warmup_steps``) on the trainer's adapter, its line, and the held-out
    accuracy after it: the evals to add (``warmup`` and ``after_warmup``)."""
    cfg = run.cfg
    info = tool_warmup(
        trainer.model,
        tokenizer,
        run.train_ex,
        tools=get_tools(cfg.tools),
        system_prompt=run.system_prompt,
        steps=cfg.tool_warmup_steps,
        learning_rate=cfg.tool_warmup_learning_rate,
        seed=cfg.seed,
    )
    if run.is_main:
        print(
            f"tool warm-up: {info['steps']} steps on {info['transcripts']} worked calculator transcripts, loss "
            f"{info['loss_first']} -> {info['loss_last']} ({info['seconds']} s)",
            flush=True,
        )
    added = {"warmup": info}
    if run.heldout and run.is_main:
        added["after_warmup"] = _evaluate(run, trainer.model, tokenizer, "after the tool warm-up")
    return added


def _run_files(run: _Run, point: _ResumePoint | None) -> _RunFiles:
    """samples.jsonl (this process's) and its recorder; resuming, the metrics so far (the main process's)."""
    name = "samples.jsonl" if run.is_main else f"samples.rank{PartialState().process_index}.jsonl"
    samples_path = run.run_dir / name
    state = point.state if point is not None else {}
    history = []
    if point is not None:
        history = (
            restore_run_files(run.run_dir, state, metric_columns(state.get("metrics") or []), samples_path)
            if run.is_main
            else []
        )
    else:
        samples_path.write_text("")
    os.chmod(samples_path, 0o600)  # the questions with their answers: for the run's user alone
    recorder = SampleRecorder(samples_path)
    recorder.step = int(state.get("recorder_step") or 0)
    return _RunFiles(samples_path, recorder, history)


def _make_trainer(run: _Run, loaded: _Loaded, reward_funcs: list, callbacks: tuple, files: _RunFiles, evals: dict):
    """The trainer the config names, with the kit's guards, resumable checkpoints and console line. ``files`` and
    ``evals``: what its checkpoints save of the run (read at each save)."""
    from peft import LoraConfig  # lazy: peft is slow to import and full fine-tuning does not need it

    from grpo_kit.trainer.grpo_trainer import make_trainer  # lazy: imports TRL, after the checks above
    from grpo_kit.trainer.guards import configure_reliability  # lazy: imports TRL

    cfg = run.cfg
    metrics = MetricsCallback(cfg, run.run_dir, run.device, files.history)
    peft_config = (
        LoraConfig(
            r=cfg.lora_rank,
            lora_alpha=cfg.lora_alpha,
            lora_dropout=cfg.lora_dropout,
            target_modules=list(loaded.lora_targets),
            task_type="CAUSAL_LM",
        )
        if cfg.use_lora
        else None
    )
    if cfg.base_weights == "fp8":  # PEFT's LoRA layer for the FP8 base layers (use_lora: the config checked)
        peft_config = fp8_lora_config(peft_config)
    spec = cfg.spec(TrainerSpec)
    trainer = make_trainer(
        spec,
        model=loaded.model,
        tokenizer=loaded.tokenizer,
        reward_funcs=reward_funcs,
        args=grpo_args(cfg, run.device, run.dtype),
        train_dataset=to_prompt_dataset(run.train_ex, run.system_prompt),
        callbacks=[metrics, *callbacks],
        peft_config=peft_config,
        generator=loaded.generator,
        reliable=True,  # NaN/inf and OOM guards, atomic resumable checkpoints
        memory_plan=loaded.plan.memory,
        on_rewards=files.recorder.record,
    )
    samples_path, recorder = files.samples_path, files.recorder
    configure_reliability(
        trainer,
        spec,
        run_state_provider=lambda: {
            "metrics": list(files.history),
            "evals": evals,
            "recorder_step": recorder.step,
            "samples_bytes": samples_path.stat().st_size if samples_path.is_file() else 0,
        },
    )
    if not run.progress:
        trainer.args.disable_tqdm = True
    quiet_trainer_logs(trainer, progress_bar=run.progress)  # the compact step line instead of TRL's dict
    _connect_trackers(trainer, metrics, run.run_dir)
    return trainer


def _connect_trackers(trainer, metrics: MetricsCallback, run_dir: Path) -> None:
    """The kit's metrics callback first, before the trackers' callbacks of report_to (transformers puts those
    before the ones passed in), so they log what it adds; TensorBoard's event files in the run folder's
    ``tensorboard/`` (unless TENSORBOARD_LOGGING_DIR names another folder)."""
    callbacks = trainer.callback_handler.callbacks
    callbacks.remove(metrics)
    callbacks.insert(0, metrics)
    for callback in callbacks:
        if isinstance(callback, TensorBoardCallback) and callback.logging_dir is None:
            callback.logging_dir = str(run_dir / "tensorboard")


def _fit(run: _Run, ready: _Ready, shared: bool) -> dict:
    """Train (or, at max_steps already, load the checkpoint's weights); whatever happens, keep what was trained.
    Returns the training seconds (``train_seconds``) and what the generation did: the engine's weight syncs and its
    share of the training time (summary.json's ``generation``)."""
    trainer, tokenizer, generator = ready.trainer, ready.loaded.tokenizer, ready.loaded.generator
    point, history = ready.resume_point, ready.files.history
    t_train = time.perf_counter()
    kit = channel(trainer)  # what the trainer and the run exchange (grpo_kit.trainer.channel)
    kit.signals = run.signals  # a SIGTERM/SIGINT now saves at the next step's end and stops
    if run.signals is not None:
        run.signals.training = True
    generation = {}
    try:
        if point is not None and point.finishing:  # at max_steps already: the checkpoint's weights, no step
            trainer.load_checkpoint_weights(point.ckpt)
        else:
            trainer.train(resume_from_checkpoint=str(point.ckpt) if point is not None else None)
    finally:
        if run.signals is not None:  # a signal from now on stops at once; the checkpoints so far are resumable
            run.signals.training = False
            run.signals.hint = f"after training; {resume_hint(run.run_dir)}"
        if generator is not None:
            generation = _generation_record(generator, kit.sync_log)
            # Free the engine's memory before evaluation; an engine whose weights the model uses goes to
            # standby instead (KV cache released) and is closed after the last use of the model.
            _release(generator, standby=shared)
        save_dir = run.run_dir / ("adapter" if run.cfg.use_lora else "model")
        # the adapter (or weights): under FSDP2 every process gathers its shards, the main one writes
        save_whole(trainer.accelerator.unwrap_model(trainer.model), save_dir, writes=run.is_main)
        if run.is_main:  # and the metrics so far
            tokenizer.save_pretrained(save_dir)
            if history:
                plot_rewards(history, run.run_dir / "rewards.png")
    if kit.stop_error is not None:  # a guard stopped training (state saved)
        raise kit.stop_error
    train_seconds = time.perf_counter() - t_train
    if generator is not None and train_seconds > 0:  # what the GPU half of a step costs, measured per run
        gen_s = kit.generation_seconds
        generation.update(
            generation_seconds=round(gen_s, 1), generation_share_of_training=round(gen_s / train_seconds, 3)
        )
    return {**generation, "train_seconds": train_seconds}


def _generation_record(generator, sync_log: list) -> dict:
    """The engine's weight syncs (count, mean seconds) and, with vllm_lora_sync=merge on shared weights, its last
    merge."""
    syncs = [e["seconds"] for e in sync_log if "seconds" in e]
    out = dict(weight_syncs=len(syncs), weight_sync_seconds_mean=round(sum(syncs) / len(syncs), 4) if syncs else None)
    if getattr(generator, "last_merge", None) is not None:
        out["last_merge"] = generator.last_merge
    return out


def _summary(run: _Run, ready: _Ready, generation_info: dict, train_seconds: float) -> dict:
    """summary.json's contents (not yet rounded)."""
    cfg, trainer, model, evals = run.cfg, ready.trainer, ready.loaded.model, ready.evals
    history = ready.files.history
    finishing = ready.resume_point is not None and ready.resume_point.finishing
    finite = all(math.isfinite(r[k]) for r in history for k in ("reward_mean", "loss") if r[k] is not None)
    # over the logged rows that carry a time (logging_steps > 1 logs fewer rows than steps)
    timed = [r["step_time_s"] for r in history if r["step_time_s"]]
    return {
        "model": cfg.model,
        "task": cfg.task,
        "steps": cfg.max_steps if finishing else trainer.state.global_step,
        "device": run.device,
        "dtype": str(run.dtype),
        "trainer": cfg.trainer,
        "train_seconds": round(train_seconds, 1),
        "total_seconds": round(time.perf_counter() - ready.t_start, 1),
        "mean_step_time_s": sum(timed) / len(timed) if timed else None,
        "peak_memory_gib": peak_memory_gib(run.device),
        "metrics_finite": finite,
        "accuracy_before": evals.get("before", {}).get("accuracy"),
        "accuracy_after": evals.get("after", {}).get("accuracy"),
        "generation": generation_info,
        # sequences per no-grad scoring forward as the trainer ran (scoring_batch_size, "auto" resolved; null:
        # per_device_train_batch_size)
        "scoring_batch_size": getattr(trainer, "scoring_batch_size", None),
        # what prefix sharing did: groups and rows scored with their prompt once, rows alone or too short
        "prefix_sharing": {"setting": cfg.prefix_sharing, **getattr(trainer, "prefix_sharing_stats", {})},
        "quantization": getattr(model, "grpo_kit_quantization", None),
        "run_dir": str(run.run_dir),
    }
