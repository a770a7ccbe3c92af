"""The main job: GRPO on a model and task from one ``GRPOKitConfig``, into a run folder.

Run folder contents: ``config.yaml`` (what ran), ``metrics.csv`` (one row per logged
step), ``rewards.png``, ``samples.jsonl`` (completions with their rewards),
``eval.json`` (held-out accuracy before/after), ``adapter/`` or ``model/``
(safetensors), ``summary.json`` and, with ``report_to`` TensorBoard, ``tensorboard/`` (its event files).
"""

from __future__ import annotations

import csv
import dataclasses
import json
import math
import os
import resource
import time
from pathlib import Path

import matplotlib
import psutil
import torch
from accelerate import PartialState
from tqdm import tqdm
from transformers import TrainerCallback
from transformers.integrations import TensorBoardCallback

from grpo_kit.app.config import KIT_ONLY_TRL_NAMES, ConfigError, GRPOKitConfig
from grpo_kit.app.console import closing_lines, plan_lines, quiet_console, quiet_trainer_logs, rounded, step_line
from grpo_kit.app.evaluation import evaluate_accuracy, evaluate_with_tools
from grpo_kit.app.preflight import advice, dead_reward_text
from grpo_kit.app.resume_policy import restore_run_files, resume_config
from grpo_kit.app.run_folder import claim_run_folder
from grpo_kit.app.tool_warmup import tool_warmup
from grpo_kit.generation.plan import plan_generation, start_generation
from grpo_kit.memory import estimate_for_config, total_gpu_bytes
from grpo_kit.model.anatomy import inspect_config, lora_targets, router_aux_coef
from grpo_kit.model.devices import resolve_device, resolve_dtype  # noqa: F401 (also the app's public names)
from grpo_kit.model.families import check_supported, family_of
from grpo_kit.model.fp8 import fp8_lora_config
from grpo_kit.model.loading import BUILTIN_MODELS, load_model, load_tokenizer, meta_model, model_config
from grpo_kit.model.offload import AUX_LOSS_OFF_REASON
from grpo_kit.readers.bounded import read_json
from grpo_kit.tasks.chat_template import check_tool_template, use_tool_template
from grpo_kit.tasks.data import (
    build_datasets,
    default_system_prompt,
    make_prompt,
    max_distinct_problems,
    to_prompt_dataset,
)
from grpo_kit.tasks.rewards import completion_text, get_reward_funcs
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

METRIC_COLUMNS = ["step", "reward_mean", "reward_std", "loss", "kl", "completion_length", "step_time_s",
                  "peak_memory_gib", "learning_rate", "grad_norm", "clip_ratio", "frac_reward_zero_std"]
# The kit's own per-step metrics, added to the trainer's logged dict for the trackers of report_to (TRL logs the
# others: rewards per function, frac_reward_zero_std, generation/seconds, ...).
KIT_LOGGED_METRICS = ("step_time_s", "peak_memory_gib")


def metric_columns(history: list[dict]) -> list[str]:
    """metrics.csv's header: ``METRIC_COLUMNS``, then every other key TRL logged in the first row (the full
    dict: per-reward means and stds, entropy, clipped ratio, token counts, ...), in TRL's order."""
    return METRIC_COLUMNS + [k for k in (history[0] if history else {}) if k not in METRIC_COLUMNS]


def peak_memory_gib(device: str) -> float:
    """Peak allocated CUDA memory, or the process's peak resident set size on the CPU."""
    if device == "cuda":
        return torch.cuda.max_memory_allocated() / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


class SampleRecorder:
    """Keeps what each step generated and how it scored: the first reward function's checked scores
    (once per generation batch, enough to follow the completions), as ``on_rewards`` of
    :func:`grpo_kit.tasks.rewards.checked_reward_func`."""

    def __init__(self, path: Path, keep_per_step: int = 4):
        self.path, self.keep, self.step = path, keep_per_step, 0

    def record(self, name: str, prompts, completions, columns: dict, rewards: list) -> None:
        with self.path.open("a", encoding="utf-8") as fh:
            for i in range(min(self.keep, len(completions))):
                prompt = prompts[i][-1]["content"] if isinstance(prompts[i], list) else prompts[i]
                fh.write(json.dumps({"step": self.step, "prompt": prompt, "completion": completion_text(completions[i]),
                                     "answer": columns.get("answer", [None] * len(completions))[i],
                                     name: rewards[i]}) + "\n")
        self.step += 1


class MetricsCallback(TrainerCallback):
    """Writes one metrics.csv row per logged step (TRL's whole dict, with step time and peak memory) and
    prints the step's compact line (grpo_kit.app.console.step_line). It adds ``KIT_LOGGED_METRICS`` to the
    logged dict, so the trackers' callbacks, which run after it (:func:`_connect_trackers`), log them too."""

    def __init__(self, cfg: GRPOKitConfig, run_dir: Path, device: str, history: list):
        self.cfg, self.device, self.history = cfg, device, history
        self._t0 = None
        self._times: list[float] = []
        self.csv_path = run_dir / "metrics.csv"
        self._started = bool(history)  # resumed: metrics.csv already has the rows so far
        self.columns = metric_columns(history)
        self._first_row = not history  # a resumed run had its first step already

    def on_step_begin(self, args, state, control, **kw):
        self._t0 = time.perf_counter()

    def on_step_end(self, args, state, control, **kw):
        if self._t0 is not None:
            self._times.append(time.perf_counter() - self._t0)

    def on_log(self, args, state, control, logs=None, **kw):
        logs = logs or {}
        if "reward" not in logs or not state.is_world_process_zero:  # summary line, or another process
            return
        row = {
            "step": state.global_step, "reward_mean": logs.get("reward"), "reward_std": logs.get("reward_std"),
            "loss": logs.get("loss"), "kl": logs.get("kl"), "completion_length": logs.get("completions/mean_length"),
            "step_time_s": sum(self._times) / len(self._times) if self._times else None,
            "peak_memory_gib": peak_memory_gib(self.device), "learning_rate": logs.get("learning_rate"),
            "grad_norm": logs.get("grad_norm"), "clip_ratio": logs.get("clip_ratio/region_mean"),
            # Share of groups whose rewards are all equal: zero advantage, so no learning signal.
            "frac_reward_zero_std": logs.get("frac_reward_zero_std"),
        }
        row.update({k: v for k, v in logs.items() if k not in row})
        logs.update({k: row[k] for k in KIT_LOGGED_METRICS if row[k] is not None})  # after the row: same columns
        self._times.clear()
        self.history.append(row)
        if not self._started:  # created on the first row, so other processes never truncate it
            self.columns = metric_columns(self.history)
            with self.csv_path.open("w", newline="") as fh:
                csv.writer(fh).writerow(self.columns)
            self._started = True
        with self.csv_path.open("a", newline="") as fh:
            csv.writer(fh).writerow([row.get(c) for c in self.columns])
        tqdm.write(step_line(row, self.cfg.max_steps))  # above the progress bar, not through it
        if self._first_row:  # the short pre-flight check: did the start carry a learning signal?
            self._first_row = False
            tqdm.write(first_step_advice(self.cfg, row))


def first_step_advice(cfg: GRPOKitConfig, row: dict) -> str:
    """The lines after the first logged step: its share of no-signal groups and, when most groups had none,
    the pre-flight advice (grpo_kit.app.preflight.advice); then one line per reward function that gave every sample
    the same value."""
    zero = row.get("frac_reward_zero_std") or 0.0
    means = {k: v for k, v in row.items() if k.startswith("rewards/") and k.endswith("/mean") and v is not None}
    tips = advice(cfg, zero, row.get("completions/clipped_ratio") or 0.0, means)
    head = f"pre-flight (step {row.get('step')}): {zero:.0%} of groups had no reward spread"
    text = (f"{head}; try: {'; '.join(tips)}. Details: python -m grpo_kit preflight" if tips else
            f"{head}: the start has a learning signal")
    # TRL logs each reward function's std over the step's samples: 0 means one value for all of them
    dead = [dead_reward_text(k.removeprefix("rewards/").removesuffix("/std"), row.get(k.removesuffix("std") + "mean")
                             or 0.0)
            for k, v in row.items() if k.startswith("rewards/") and k.endswith("/std") and v == 0.0]
    return "\n".join([text, *(f"pre-flight (step {row.get('step')}): {d}" for d in dead)])


def plot_rewards(history: list[dict], path: Path) -> None:
    """Reward mean ± std per step (and each reward function's mean) to a PNG."""
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # lazy: after choosing the Agg backend, which pyplot reads on import

    fig, ax = plt.subplots(figsize=(7, 4))
    steps = [r["step"] for r in history]
    mean = [r["reward_mean"] for r in history]
    std = [r["reward_std"] or 0.0 for r in history]
    ax.plot(steps, mean, label="reward (weighted sum)", color="C0")
    ax.fill_between(steps, [m - s for m, s in zip(mean, std)], [m + s for m, s in zip(mean, std)], alpha=0.2)
    for key in sorted({k for r in history for k in r if k.startswith("rewards/") and k.endswith("/mean")}):
        ax.plot(steps, [r.get(key) for r in history], label=key.split("/")[1], lw=1)
    ax.set_xlabel("step")
    ax.set_ylabel("reward")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def prompt_ids(tokenizer, question: str, system_prompt: str, tools: list | None = None) -> list[int]:
    """A question's token ids as the model sees them: system prompt and question in the chat template (with the
    ``tools``' schema when given, as TRL renders it)."""
    text = tokenizer.apply_chat_template(make_prompt(question, system_prompt), tools=tools or None, tokenize=False,
                                         add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def check_prompt_lengths(tokenizer, examples: list[dict], cfg: GRPOKitConfig, system_prompt: str) -> int:
    """Longest rendered prompt in tokens (the schema of the config's tools and of its environment's methods, from
    one instance, included); one over ``max_prompt_length`` is an error, not a silent cut. What an environment's
    ``reset`` adds is known only at generation, where the trainer checks it
    (:class:`grpo_kit.trainer.generation_hook.KitGenerationMixin`)."""
    longest, worst = 0, None
    tools = (get_tools(cfg.tools) if cfg.tools else []) + (
        environment_tools(resolve_environment(cfg.environment)()) if cfg.environment is not None else []
    )
    tools = tools or None
    for e in examples:
        n = len(prompt_ids(tokenizer, e["question"], system_prompt, tools))
        if n > longest:
            longest, worst = n, e["question"]
    if longest > cfg.max_prompt_length:
        raise ValueError(f"a prompt is {longest} tokens, over max_prompt_length={cfg.max_prompt_length}: "
                         f"{worst[:80]!r}... Raise max_prompt_length or shorten the prompts.")
    return longest


def calibration_batches(tokenizer, examples: list[dict], system_prompt: str, n: int = 8) -> list[torch.Tensor]:
    """``input_ids`` (1, T) of the first ``n`` training prompts as the model sees them: the activations
    ``load_in_4bit_skip_modules: auto`` measures NF4's error on."""
    return [torch.tensor([prompt_ids(tokenizer, e["question"], system_prompt)]) for e in examples[:n]]


def resolve_lora_targets(targets, model) -> tuple[str, ...]:
    """The LoRA target names of a run: ``auto``, every projection of ``model``'s decoder layers
    (:func:`grpo_kit.model.anatomy.lora_targets`; a meta-device model is enough); a list, checked to exist."""
    if targets == "auto":
        return tuple(lora_targets(model))
    names = {n.rsplit(".", 1)[-1] for n, _ in model.named_modules()}
    missing = [t for t in targets if t not in names]
    if missing:
        linear = sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)})
        raise ValueError(f"lora_target_modules {missing} do not exist in {type(model).__name__}; "
                         f"its linear layers are: {linear}")
    return tuple(targets)


def _release(generator, *, standby: bool) -> None:
    """Put the engine in standby (``standby``) or close it; never lose the run over a failing shutdown."""
    try:
        generator.sleep() if standby else generator.close()
    except Exception as e:
        print(f"warning: {'standby of' if standby else 'closing'} the {generator.name} generator failed: {e}",
              flush=True)


def grpo_args(cfg: GRPOKitConfig, device: str, dtype: torch.dtype):
    """TRL ``GRPOConfig`` from the kit's config: every field TRL also has passes by name (but
    ``KIT_ONLY_TRL_NAMES``), then the few the kit writes its own way are put in TRL's form."""
    from trl import GRPOConfig  # lazy: TRL is slow to import, and `import grpo_kit.app.run` must not need it

    shared = {f.name for f in dataclasses.fields(GRPOConfig) if f.init} & {f.name for f in dataclasses.fields(cfg)}
    values = {name: getattr(cfg, name) for name in shared - set(KIT_ONLY_TRL_NAMES)}
    values.update(
        save_strategy="steps" if cfg.save_steps else "no", save_steps=cfg.save_steps or 500,  # 0: no checkpoints
        min_p=cfg.min_p or None, reward_weights=cfg.reward_weights or None,  # 0 and []: off / all 1.0
        gradient_checkpointing=cfg.checkpointing_on(device), data_seed=cfg.seed, use_cpu=(device == "cpu"),
        bf16=(dtype == torch.bfloat16), fp16=(dtype == torch.float16),
        # the kit writes its own metrics.csv, samples.jsonl and console line (report_to passes by name)
        disable_tqdm=False, log_completions=False, remove_unused_columns=False)
    return GRPOConfig(**values)


def train(cfg: GRPOKitConfig, *, progress: bool = True, callbacks: tuple = (), resume: bool = False,
          overwrite: bool = False, verbose: bool = False) -> dict:
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
    device = resolve_device(cfg)
    check_task_size(cfg)  # before the data: drawing more distinct problems than a task has would never end
    train_ex, heldout = build_datasets(cfg)  # data errors surface before the model loads
    reward_funcs = get_reward_funcs(cfg.reward_funcs)
    # Under `accelerate launch` every process runs this function; only the main one evaluates and writes.
    state = PartialState(cpu=(device == "cpu"))
    check_before_load(cfg, device, train_ex, heldout, num_processes=state.num_processes)
    run_dir = Path(cfg.output_dir)
    with SignalStop() as signals:
        lock = claim_run_folder(run_dir, resume=resume, overwrite=overwrite) if state.is_main_process else None
        signals.run_dir = run_dir  # a second signal names the checkpoint to resume from
        if lock is None:  # other processes: the main one owns the folder
            run_dir.mkdir(parents=True, exist_ok=True)
        run = _Run(cfg, run_dir, device, state.is_main_process, progress, train_ex, heldout, signals=signals)
        finished = False
        try:
            summary = _train(run, reward_funcs, callbacks, resume)
            finished = True
            return summary
        except OSError as e:
            if e.errno not in DISK_FULL:
                raise
            raise disk_full_error(run_dir, e, "the run's files") from None
        finally:
            if lock is not None and not (finished or run.started or resume):  # nothing trained: nothing left
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


@dataclasses.dataclass
class _Run:
    """What one run's phases share: the config, where it trains, its data, and what each phase adds."""

    cfg: GRPOKitConfig
    run_dir: Path
    device: str
    is_main: bool
    progress: bool
    train_ex: list
    heldout: list
    dtype: torch.dtype | None = None
    system_prompt: str = ""
    ckpt: Path | None = None  # the checkpoint resumed from
    resumed: dict = dataclasses.field(default_factory=dict)  # its run state (metrics, evals, recorder step)
    finishing: bool = False  # resumed at max_steps: only the final save and evaluation are left
    evals: dict = dataclasses.field(default_factory=dict)
    history: list = dataclasses.field(default_factory=list)
    signals: SignalStop | None = None  # SIGTERM/SIGINT while the run lasts
    started: bool = False  # training began (a failure before it removes what the run wrote)
    lora_targets: tuple = ()  # the adapters' module names, resolved from the model before it loads


# What a run writes into its folder before training starts (removed again when it fails before then).
UNSTARTED_FILES = ("config.yaml", "samples.jsonl")


def check_task_size(cfg: GRPOKitConfig) -> None:
    """num_train_samples + num_eval_samples within the distinct problems the task can generate (ConfigError)."""
    most = max_distinct_problems(cfg.task, cfg.levels)
    if most is not None and cfg.num_train_samples + cfg.num_eval_samples > most:
        raise ConfigError(f"num_train_samples={cfg.num_train_samples}: task={cfg.task!r} at levels {cfg.levels} has "
                          f"only {most} distinct problems, and the held-out set takes num_eval_samples="
                          f"{cfg.num_eval_samples} of them; ask for at most {max(0, most - cfg.num_eval_samples)}, "
                          "or add levels")


def check_before_load(cfg: GRPOKitConfig, device: str, train_ex: list, heldout: list, num_processes: int = 1) -> None:
    """What the model's config, the data and the machine allow, checked before any model loads (ConfigError):
    lora_rank within the hidden size, prompt and completion within the context, a step's prompts within the
    data, the held-out set as large as asked, and the step within memory as the VRAM calculator prices it. The kit's
    trainer first: a model family it has not proven, or a layout it cannot map (decoder layers, head, logit form),
    is refused here, from the config alone."""
    config = model_config(cfg.model, trust_remote_code=cfg.trust_remote_code)
    if cfg.trainer == "grpo_kit":
        try:
            check_supported(config, cfg.model, trust_remote_code=cfg.trust_remote_code)
            inspect_config(config)
        except ValueError as e:
            raise ConfigError(str(e)) from None
    errors = []
    hidden = getattr(config, "hidden_size", None)
    if cfg.use_lora and hidden and cfg.lora_rank > hidden:
        errors.append(f"lora_rank={cfg.lora_rank} is more than the model's hidden size {hidden} (an adapter of a "
                      f"higher rank than its weights adds nothing); choose at most {hidden}")
    limit = getattr(config, "max_position_embeddings", None)
    if limit and cfg.max_prompt_length + cfg.max_completion_length > limit:
        errors.append(f"max_prompt_length={cfg.max_prompt_length} + max_completion_length="
                      f"{cfg.max_completion_length} is beyond the model's context ({limit} tokens, "
                      f"max_position_embeddings); together they may be at most {limit}")
    prompts = max(1, cfg.per_device_train_batch_size * cfg.gradient_accumulation_steps * num_processes
                  // cfg.num_generations)
    if len(train_ex) < prompts:
        errors.append(f"the data has {len(train_ex)} training problems, fewer training problems than one step takes "
                      f"({prompts} prompts: per_device_train_batch_size x gradient_accumulation_steps x processes / "
                      "num_generations); use more data or a smaller batch")
    if len(heldout) < cfg.num_eval_samples:
        errors.append(f"num_eval_samples={cfg.num_eval_samples}, but the data has only {len(heldout)} held-out "
                      f"problems; lower num_eval_samples to at most {len(heldout)}, or give more data")
    errors += [p for p in (_memory_problem(cfg, config, device),) if p]
    if errors:
        raise ConfigError(errors[0] if len(errors) == 1 else "invalid config:\n  - " + "\n  - ".join(errors))


def _memory_problem(cfg: GRPOKitConfig, config, device: str) -> str | None:
    """The step against the device's whole memory (host RAM on the CPU) as the VRAM calculator prices it, or None."""
    try:
        need = total_gpu_bytes(estimate_for_config(cfg, config))
    except Exception:  # an architecture the calculator cannot price: the run itself finds out
        return None
    on_gpu = device == "cuda"
    have = torch.cuda.get_device_properties(0).total_memory if on_gpu else psutil.virtual_memory().total
    if need <= have:
        return None
    return (f"the step does not fit in memory: the VRAM calculator estimates {need / 2**30:.1f} GiB at its peak "
            f"(num_generations={cfg.num_generations}, per_device_train_batch_size={cfg.per_device_train_batch_size}, "
            f"max_prompt_length + max_completion_length = {cfg.max_prompt_length + cfg.max_completion_length}), "
            f"and {'the GPU has' if on_gpu else 'this machine has'} {have / 2**30:.1f} GiB; lower them "
            "(python -m grpo_kit vram prices other settings)")



def _train(run: _Run, reward_funcs: list, callbacks: tuple, resume: bool) -> dict:
    """:func:`train` once the run folder is this process's: the run's phases, in order."""
    cfg, run_dir = run.cfg, run.run_dir
    run.dtype = resolve_dtype(cfg, run.device)
    run.system_prompt = cfg.system_prompt or default_system_prompt(cfg.task, tools=bool(cfg.tools or cfg.environment))
    if resume and (done := _find_resume_point(run)) is not None:
        return done
    if run.is_main:
        cfg.save(run_dir / "config.yaml")
    torch.manual_seed(cfg.seed)
    t_start = time.perf_counter()
    tokenizer, model, generator, plan, generation_info = _load(run)
    run.evals = dict(run.resumed.get("evals") or {})
    if run.heldout and run.is_main and "before" not in run.evals:
        run.evals["before"] = _evaluate(run, model, tokenizer, "before")
    samples_path, recorder = _run_files(run, resume)
    trainer = _make_trainer(run, model, tokenizer, generator, plan, reward_funcs, recorder, callbacks, samples_path)
    if cfg.tool_warmup_steps and "warmup" not in run.evals:  # a resumed adapter holds it already
        _warm_up(run, trainer, tokenizer)
    shared = bool(getattr(generator, "share_weights", False))
    try:
        train_seconds = _fit(run, trainer, tokenizer, generator, generation_info, shared)
        # FSDP: each forward gathers the weights' shards from every process, so all evaluate; the main one reports
        if run.heldout and (run.is_main or trainer.is_fsdp_enabled):
            run.evals["after"] = _evaluate(run, trainer.model, tokenizer, "after")
        if not run.is_main:
            return {"run_dir": str(run_dir), "main_process": False}
        (run_dir / "eval.json").write_text(json.dumps(run.evals, indent=2))
    finally:
        if shared:
            _release(generator, standby=False)
    summary = rounded(_summary(run, trainer, model, generation_info, train_seconds, t_start))
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    print("\n".join(closing_lines(summary)), flush=True)
    return summary


def _find_resume_point(run: _Run) -> dict | None:
    """Sets the checkpoint to resume from and its run state; the summary when the run is already finished."""
    run.ckpt = find_resume_checkpoint(run.run_dir)
    run.resumed = read_run_state(run.ckpt)
    run.finishing = checkpoint_step(run.ckpt) >= run.cfg.max_steps  # stopped during the final save or evaluation
    if run.finishing and (run.run_dir / "summary.json").is_file():
        print(f"the run in {run.run_dir} is already finished ({run.ckpt.name}, max_steps={run.cfg.max_steps}, "
              f"summary.json written); nothing to do. To train longer: train --resume {run.run_dir} --set "
              "max_steps=N", flush=True)
        return {**read_json(run.run_dir / "summary.json"), "already_finished": True}
    print(f"resuming from {run.ckpt}" + (" (max_steps reached: finishing the final save and evaluation, no more "
                                         "training)" if run.finishing else ""), flush=True)
    return None


def _load(run: _Run):
    """Tokenizer, generation plan, engine and training model: (tokenizer, model, generator, plan, info).

    The generation backend (config: generation_backend, kv_cache_dtype, vllm_share_weights, ...) is decided before
    any model loads, so that a bad option or a plan that cannot fit stops the run early; what was used goes to
    summary.json. With shared weights the engine starts first and the training model is built on its tensors."""
    cfg, dtype = run.cfg, run.dtype
    tokenizer = load_tokenizer(cfg.model, trust_remote_code=cfg.trust_remote_code)
    if cfg.tools or cfg.environment:
        if cfg.model in BUILTIN_MODELS:  # SmolLM2's ChatML vocabulary: the kit's tool-calling template
            use_tool_template(tokenizer)
        check_tool_template(tokenizer, cfg.model)  # one message naming what it lacks, before any model loads
    check_prompt_lengths(tokenizer, run.train_ex + run.heldout, cfg, run.system_prompt)
    config = model_config(cfg.model, trust_remote_code=cfg.trust_remote_code)
    if cfg.use_lora:
        run.lora_targets = resolve_lora_targets(cfg.lora_target_modules, meta_model(config))
    plan = plan_generation(cfg, model_config=config, device=run.device, dtype=dtype,
                           num_processes=PartialState().num_processes)
    quant = dict(load_in_4bit=True, skip_modules=cfg.load_in_4bit_skip_modules,
                 auto_allowance=cfg.load_in_4bit_auto_allowance, nf4_matmul=cfg.load_in_4bit_matmul,
                 calibration=calibration_batches(tokenizer, run.train_ex, run.system_prompt)) if cfg.load_in_4bit else {}
    # the config refuses 4 bit and FP8 together
    quant = dict(base_weights="fp8", fp8_block=cfg.fp8_block) if cfg.base_weights == "fp8" else quant
    generator, model, info = start_generation(
        plan, tokenizer=tokenizer, dtype=dtype,
        load_model=lambda: load_model(cfg.model, dtype=dtype, device=run.device, seed=cfg.seed,
                                      trust_remote_code=cfg.trust_remote_code, **quant)[0])
    info["model"] = model_plan(cfg, config, run.device, run.lora_targets)
    if run.is_main:
        print("\n".join(plan_lines(cfg, device=run.device, dtype=dtype, info=info)), flush=True)
    return tokenizer, model, generator, plan, info


def model_plan(cfg: GRPOKitConfig, config, device: str, targets: tuple) -> dict:
    """What the kit found in the model and how it trains it: family, layers, logit form, LoRA targets, and for a
    mixture of experts, its experts (frozen) and the router's load-balancing loss (summary.json, the plan line)."""
    found = inspect_config(config)
    family = family_of(getattr(config, "model_type", None))
    out = {"family": family.name if family else getattr(config, "model_type", "?"), "layers": found.layers,
           "logits": found.logit_form.describe(), "lora_targets": list(targets)}
    if found.experts:
        coef = router_aux_coef(config)
        offloaded = cfg.trainer == "grpo_kit" and device == "cuda" and cfg.checkpointing_on(device)
        out["experts"] = (f"{found.experts} per layer, frozen: fused parameters, not LoRA targets (the pinned vLLM "
                          "loads no adapter on them)")
        out["router_aux_loss"] = ("none in the config" if not coef else f"off: {AUX_LOSS_OFF_REASON}" if offloaded
                                  else f"x{coef:g}, added to the loss as TRL adds it")
    return out


def _evaluate(run: _Run, model, tokenizer, when: str) -> dict:
    """Greedy held-out accuracy ``before`` or ``after`` training, printed; with tools or an environment, multi-turn
    through training's tool loop, with the share of answers that called a tool and the tool failures."""
    cfg = run.cfg
    progress = f"held-out {when}" if run.progress and run.is_main else None
    multi_turn = bool(cfg.tools or cfg.environment)
    if multi_turn:
        environment = resolve_environment(cfg.environment) if cfg.environment is not None else None
        result = evaluate_with_tools(model, tokenizer, run.heldout, get_tools(cfg.tools), environment=environment,
                                     system_prompt=run.system_prompt, max_new_tokens=cfg.max_completion_length,
                                     max_tool_calling_iterations=cfg.max_tool_calling_iterations,
                                     tool_time_limit_s=cfg.tool_time_limit_s or None,
                                     tool_output_tokens=cfg.tool_output_tokens, progress=progress)
    else:
        result = evaluate_accuracy(model, tokenizer, run.heldout, system_prompt=run.system_prompt,
                                   max_new_tokens=cfg.max_completion_length, progress=progress)
    extra = f" (n={len(run.heldout)}, greedy)" if when == "before" else ""
    if multi_turn:
        extra += (f"; tool used in {result['tool_use_share']:.0%} of answers, {result['tool_calls']} calls, "
                  f"{result['tool_failures']} failed")
    if run.is_main:
        label = f"{when} training" if when in ("before", "after") else when
        print(f"held-out accuracy {label}: {result['accuracy']:.3f}{extra}", flush=True)
    return result


def _warm_up(run: _Run, trainer, tokenizer) -> None:
    """The supervised tool warm-up (``tool_warmup_steps``) on the trainer's adapter, its line, and the held-out
    accuracy after it (``run.evals["warmup"]`` and ``["after_warmup"]``)."""
    cfg = run.cfg
    info = tool_warmup(trainer.model, tokenizer, run.train_ex, tools=get_tools(cfg.tools),
                       system_prompt=run.system_prompt, steps=cfg.tool_warmup_steps,
                       learning_rate=cfg.tool_warmup_learning_rate, seed=cfg.seed)
    if run.is_main:
        print(f"tool warm-up: {info['steps']} steps on {info['transcripts']} worked calculator transcripts, loss "
              f"{info['loss_first']} -> {info['loss_last']} ({info['seconds']} s)", flush=True)
    run.evals["warmup"] = info
    if run.heldout and run.is_main:
        run.evals["after_warmup"] = _evaluate(run, trainer.model, tokenizer, "after the tool warm-up")


def _run_files(run: _Run, resume: bool):
    """samples.jsonl (this process's) and its recorder; metrics so far into ``run.history`` when resuming."""
    name = "samples.jsonl" if run.is_main else f"samples.rank{PartialState().process_index}.jsonl"
    samples_path = run.run_dir / name
    if resume:
        run.history = restore_run_files(run.run_dir, run.resumed, metric_columns(run.resumed.get("metrics") or []),
                                        samples_path) if run.is_main else []
    else:
        samples_path.write_text("")
    os.chmod(samples_path, 0o600)  # the questions with their answers: for the run's user alone
    recorder = SampleRecorder(samples_path)
    recorder.step = int(run.resumed.get("recorder_step") or 0)
    return samples_path, recorder


def _make_trainer(run: _Run, model, tokenizer, generator, plan, reward_funcs, recorder, callbacks, samples_path):
    """The trainer the config names, with the kit's guards, resumable checkpoints and console line."""
    from peft import LoraConfig  # lazy: peft is slow to import and full fine-tuning does not need it

    from grpo_kit.trainer.grpo_trainer import make_trainer  # lazy: imports TRL, after the checks above
    from grpo_kit.trainer.guards import configure_reliability  # lazy: imports TRL

    cfg = run.cfg
    metrics = MetricsCallback(cfg, run.run_dir, run.device, run.history)
    peft_config = LoraConfig(r=cfg.lora_rank, lora_alpha=cfg.lora_alpha, lora_dropout=cfg.lora_dropout,
                             target_modules=list(run.lora_targets), task_type="CAUSAL_LM") if cfg.use_lora else None
    if cfg.base_weights == "fp8":  # PEFT's LoRA layer for the FP8 base layers (use_lora: the config checked)
        peft_config = fp8_lora_config(peft_config)
    trainer = make_trainer(cfg, model=model, tokenizer=tokenizer, reward_funcs=reward_funcs,
                           args=grpo_args(cfg, run.device, run.dtype),
                           train_dataset=to_prompt_dataset(run.train_ex, run.system_prompt),
                           callbacks=[metrics, *callbacks],
                           peft_config=peft_config, generator=generator,
                           reliable=True,  # NaN/inf and OOM guards, atomic resumable checkpoints
                           memory_plan=plan.memory, on_rewards=recorder.record)
    configure_reliability(trainer, cfg, run_state_provider=lambda: {
        "metrics": list(run.history), "evals": run.evals, "recorder_step": recorder.step,
        "samples_bytes": samples_path.stat().st_size if samples_path.is_file() else 0})
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


def _fit(run: _Run, trainer, tokenizer, generator, generation_info: dict, shared: bool) -> float:
    """Train (or, at max_steps already, load the checkpoint's weights); whatever happens, keep what was trained.
    Returns the training seconds; records the engine's weight syncs and generation share in ``generation_info``."""
    t_train = time.perf_counter()
    run.started = True
    kit = channel(trainer)  # what the trainer and the run exchange (grpo_kit.trainer.channel)
    kit.signals = run.signals  # a SIGTERM/SIGINT now saves at the next step's end and stops
    if run.signals is not None:
        run.signals.training = True
    try:
        if run.finishing:  # at max_steps already: the checkpoint's weights, and no training step
            trainer.load_checkpoint_weights(run.ckpt)
        else:
            trainer.train(resume_from_checkpoint=str(run.ckpt) if run.ckpt is not None else None)
    finally:
        if run.signals is not None:  # a signal from now on stops at once; the checkpoints so far are resumable
            run.signals.training = False
            run.signals.hint = f"after training; {resume_hint(run.run_dir)}"

        if generator is not None:
            syncs = [e["seconds"] for e in kit.sync_log if "seconds" in e]
            generation_info.update(weight_syncs=len(syncs), weight_sync_seconds_mean=(
                round(sum(syncs) / len(syncs), 4) if syncs else None))
            if getattr(generator, "last_merge", None) is not None:  # vllm_lora_sync=merge, shared weights
                generation_info["last_merge"] = generator.last_merge
            # Free the engine's memory before evaluation; an engine whose weights the model uses goes to
            # standby instead (KV cache released) and is closed after the last use of the model.
            _release(generator, standby=shared)
        save_dir = run.run_dir / ("adapter" if run.cfg.use_lora else "model")
        # the adapter (or weights): under FSDP2 every process gathers its shards, the main one writes
        save_whole(trainer.accelerator.unwrap_model(trainer.model), save_dir, writes=run.is_main)
        if run.is_main:  # and the metrics so far
            tokenizer.save_pretrained(save_dir)
            if run.history:
                plot_rewards(run.history, run.run_dir / "rewards.png")
    if kit.stop_error is not None:  # a guard stopped training (state saved)
        raise kit.stop_error
    train_seconds = time.perf_counter() - t_train
    if generator is not None and train_seconds > 0:  # what the GPU half of a step costs, measured per run
        gen_s = kit.generation_seconds
        generation_info.update(generation_seconds=round(gen_s, 1),
                               generation_share_of_training=round(gen_s / train_seconds, 3))
    return train_seconds


def _summary(run: _Run, trainer, model, generation_info: dict, train_seconds: float, t_start: float) -> dict:
    """summary.json's contents (not yet rounded)."""
    history, cfg = run.history, run.cfg
    finite = all(math.isfinite(r[k]) for r in history for k in ("reward_mean", "loss") if r[k] is not None)
    # over the logged rows that carry a time (logging_steps > 1 logs fewer rows than steps)
    timed = [r["step_time_s"] for r in history if r["step_time_s"]]
    return {
        "model": cfg.model, "task": cfg.task, "steps": cfg.max_steps if run.finishing else trainer.state.global_step,
        "device": run.device, "dtype": str(run.dtype), "trainer": cfg.trainer, "train_seconds": round(train_seconds, 1),
        "total_seconds": round(time.perf_counter() - t_start, 1),
        "mean_step_time_s": sum(timed) / len(timed) if timed else None,
        "peak_memory_gib": peak_memory_gib(run.device), "metrics_finite": finite,
        "accuracy_before": run.evals.get("before", {}).get("accuracy"),
        "accuracy_after": run.evals.get("after", {}).get("accuracy"),
        "generation": generation_info,
        # sequences per no-grad scoring forward as the trainer ran (scoring_batch_size, "auto" resolved; null:
        # per_device_train_batch_size)
        "scoring_batch_size": getattr(trainer, "scoring_batch_size", None),
        "quantization": getattr(model, "grpo_kit_quantization", None),
        "run_dir": str(run.run_dir),
    }
