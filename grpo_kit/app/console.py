"""What a training run prints: the plan, one compact line per logged step, a closing table; third-party logs quiet.

By default a run prints its plan (:func:`plan_lines`), the held-out accuracy before, one line per logged step
(:func:`step_line`; TRL's dict of ~27 keys goes to the run folder's ``metrics.csv``) and a closing table
(:func:`closing_lines`). :func:`quiet_console` keeps the rest off the console: vLLM's own log below errors, and each
third-party warning a default run meets (:data:`KNOWN_WARNINGS`) as one line of what it means for the run; with
``verbose`` all of it comes back as the libraries print it. :func:`warn_once_per_message` makes Python show each
warning text once (libraries warn the same text from several lines, e.g. TRL's vLLM version check at five import
sites); :func:`quiet_trainer_logs` takes the dict printing out of a transformers ``Trainer``'s progress callbacks.
"""

from __future__ import annotations

import logging
import math
import os
import sys
import warnings
from pathlib import Path

from grpo_kit.generation.vllm_backend import VLLM_LOGGER
from grpo_kit.model.prefix import AUTO_MIN_PROMPT_TOKENS

# Decimal places of the numbers written to summary.json and printed at the end of a run.
SUMMARY_DIGITS = 4
VERBOSE_HINT = "--verbose, or train(verbose=True)"  # how a user brings the full logs back
_VLLM_LEVEL_ENV = "VLLM_LOGGING_LEVEL"  # vLLM sets its logger's level from it when imported

# Third-party warnings a default run meets, each as (where it comes from: a logger's name or a warning category,
# the start of its text, what it means for a kit run). Without ``verbose`` the kit's line replaces it, once.
KNOWN_WARNINGS = (
    (
        UserWarning,
        "TRL currently supports vLLM versions",
        "TRL says the installed vLLM is outside the versions it was tested with; the kit drives vLLM itself "
        "(grpo_kit.generation), not through TRL's vLLM code",
    ),
    (
        "transformers.training_args",
        "torch.distributed process group is initialized, but parallel_mode",
        "transformers sees a torch.distributed group in a one-process run: vLLM's in-process engine opens a "
        "one-process group; the run is not distributed",
    ),
    (
        FutureWarning,
        "`torch.distributed.reduce_op` is deprecated",
        "vLLM's Triton dispatcher reads a deprecated torch name while it scans the loaded modules; harmless",
    ),
    # an empty line: dropped without one. bitsandbytes (which peft imports) has no optional CPU 4-bit kernel here;
    # only 4-bit runs on the CPU would use it, and the kit runs 4-bit on CUDA only
    ("bitsandbytes.backends.cpu.ops", "Failed to load CPU gemm_4bit_forward", ""),
)

_STATE = {"verbose": False, "set_vllm_env": False}
_SHOWN: set[tuple[type, str]] = set()  # (category, text) of the warnings shown so far in this process
_NOTES_SHOWN: set[str] = set()  # the kit's lines for KNOWN_WARNINGS said so far


def _known(source, text: str) -> str | None:
    """The kit's line for a warning from ``source`` (logger name or category) with ``text``, or None."""
    for where, start, note in KNOWN_WARNINGS:
        hit = where == source if isinstance(where, str) else isinstance(source, type) and issubclass(source, where)
        if hit and text.startswith(start):
            return note
    return None


def _say_once(note: str) -> None:
    if note and note not in _NOTES_SHOWN:
        _NOTES_SHOWN.add(note)
        print(f"note: {note} ({VERBOSE_HINT} shows the original)", flush=True)  # the kit's line, as the plan's


class _KnownLogLines(logging.Filter):
    """On a library's logger: a :data:`KNOWN_WARNINGS` line becomes the kit's note (once), unless verbose."""

    def filter(self, record: logging.LogRecord) -> bool:
        if _STATE["verbose"]:
            return True
        note = _known(record.name, record.getMessage())
        if note is None:
            return True
        _say_once(note)
        return False


def warn_once_per_message() -> None:
    """Show each distinct warning (category and text) once per process, whichever line raises it; a
    :data:`KNOWN_WARNINGS` one as the kit's line instead, unless :func:`quiet_console` was told ``verbose``. The
    filters still decide what is shown; this only drops repeats. (Python's ``"once"`` action cannot do it: it
    keys on the calling module's registry, which is cleared whenever any filter changes.)"""
    if getattr(warnings.showwarning, "_grpo_kit_once", False):
        return
    inner = warnings.showwarning

    def show(message, category, filename, lineno, file=None, line=None):
        key = (category, str(message))
        if key in _SHOWN:
            return
        _SHOWN.add(key)
        note = None if _STATE["verbose"] else _known(category, str(message))
        if note is None:
            inner(message, category, filename, lineno, file, line)
        else:
            _say_once(note)

    show._grpo_kit_once = True
    warnings.showwarning = show


class _StdoutLines(logging.StreamHandler):
    """The kit's own log lines (a tool call that failed in a rollout, a reward that raised) on whatever
    ``sys.stdout`` is when they are written: a notebook cell's output, not its stderr box."""

    @property
    def stream(self):
        return sys.stdout

    @stream.setter
    def stream(self, value):  # StreamHandler.__init__ sets it; the current stdout is read at each line instead
        pass


def _kit_lines_to_stdout() -> None:
    """Route the ``grpo_kit`` loggers' warnings to stdout where nothing else would show them (no handler of the
    user's, only Python's last-resort stderr); a process that configured logging keeps its own handlers."""
    kit = logging.getLogger("grpo_kit")
    if not kit.handlers and not logging.getLogger().handlers:
        kit.addHandler(_StdoutLines())


def quiet_console(verbose: bool = False) -> None:
    """Set what third-party code prints for the runs that follow in this process (call before they import it:
    vLLM reads its level when imported). Quiet (default): vLLM's log at errors only, unless ``VLLM_LOGGING_LEVEL``
    is set in the environment (its loading bar goes with it); the :data:`KNOWN_WARNINGS` as the kit's
    line, once; every other warning once. ``verbose``: all of it as the libraries print it (repeats of one
    Python warning text still once). transformers' progress bars go with the quiet console. The kit's notes and its
    loggers' warnings go to stdout with its other lines, so a notebook shows no stderr box for them."""
    _STATE["verbose"] = bool(verbose)
    warn_once_per_message()
    _kit_lines_to_stdout()
    for where, _, _ in KNOWN_WARNINGS:
        logger = logging.getLogger(where) if isinstance(where, str) else None
        if logger is not None and not any(isinstance(f, _KnownLogLines) for f in logger.filters):
            logger.addFilter(_KnownLogLines())
    from transformers.utils import logging as hf_logging  # lazy: the CLI imports this module for every command

    # transformers' own bars ("Loading weights" per model load); the kit's bars (held-out, training) stay
    (hf_logging.enable_progress_bar if verbose else hf_logging.disable_progress_bar)()
    if _STATE["set_vllm_env"] or _VLLM_LEVEL_ENV not in os.environ:  # the user's own setting stays
        level = "INFO" if verbose else "ERROR"
        os.environ[_VLLM_LEVEL_ENV] = level
        _STATE["set_vllm_env"] = True
        logging.getLogger(VLLM_LOGGER).setLevel(level)  # where vLLM is imported already


def console_line() -> str:
    """What the console leaves out, and how to see it (the plan's last line)."""
    if _STATE["verbose"]:
        return "console: verbose (vLLM's log and third-party warnings as the libraries print them)"
    return (
        f"console: vLLM's log off (errors only), known third-party warnings one line each; {VERBOSE_HINT} "
        "shows them all"
    )


def _num(value, fmt: str) -> str:
    return "-" if value is None or (isinstance(value, float) and math.isnan(value)) else format(value, fmt)


def reward_name(key: str) -> str:
    """Short name of a reward function for the console: ``rewards/correctness_reward/mean`` -> ``correctness``."""
    name = key.split("/")[1] if key.startswith("rewards/") else key
    return name.removesuffix("_reward")


def step_line(row: dict, max_steps: int | None = None) -> str:
    """One logged step as a line. ``row``: the run's metrics row (``reward_mean``, ``reward_std``,
    ``rewards/<fn>/mean``, ``frac_reward_zero_std``, ``kl``, ``completion_length``, ``step_time_s``,
    ``peak_memory_gib``; missing values print as ``-``).

    >>> step_line({"step": 3, "reward_mean": 0.5, "reward_std": 0.25, "rewards/correctness_reward/mean": 0.375,
    ...            "frac_reward_zero_std": 0.5, "kl": 0.00123, "completion_length": 17.25, "step_time_s": 9.87,
    ...            "peak_memory_gib": 1.234}, max_steps=40)
    'step 3/40 | reward 0.500±0.250 | correctness 0.375 | no-signal groups 50% | kl 0.0012 | len 17.2 | 9.87 s/step | peak 1.23 GiB'
    """
    step = f"step {row.get('step')}" + (f"/{max_steps}" if max_steps else "")
    per_reward = " ".join(
        f"{reward_name(k)} {_num(v, '.3f')}" for k, v in row.items() if k.startswith("rewards/") and k.endswith("/mean")
    )
    zero = row.get("frac_reward_zero_std")
    parts = [
        step,
        f"reward {_num(row.get('reward_mean'), '.3f')}±{_num(row.get('reward_std'), '.3f')}",
        per_reward,
        f"no-signal groups {_num(None if zero is None else 100 * zero, '.0f')}%",
        f"kl {_num(row.get('kl'), '.4f')}",
        f"len {_num(row.get('completion_length'), '.1f')}",
        f"{_num(row.get('step_time_s'), '.2f')} s/step",
        f"peak {_num(row.get('peak_memory_gib'), '.2f')} GiB",
    ]
    return " | ".join(p for p in parts if p)


def rounded(value, digits: int = SUMMARY_DIGITS):
    """``value`` with every float rounded to ``digits`` decimals (dicts and lists recursively).

    >>> rounded({"a": 0.123456789, "b": [1.0000001, 2], "c": "x"})
    {'a': 0.1235, 'b': [1.0, 2], 'c': 'x'}
    """
    if isinstance(value, float):
        return round(value, digits) if math.isfinite(value) else value
    if isinstance(value, dict):
        return {k: rounded(v, digits) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(rounded(v, digits) for v in value)
    return value


def quiet_trainer_logs(trainer, *, progress_bar: bool = True) -> None:
    """Stop a transformers ``Trainer`` from printing its raw log dict: its progress callbacks (tqdm bar, or
    the bar-less printer) give way to a tqdm bar without the dict lines (``progress_bar``) or to nothing.
    The run prints :func:`step_line` instead."""
    # lazy: transformers is slow to import, and the CLI imports this module for every command
    from transformers.trainer_callback import PrinterCallback, ProgressCallback  # lazy: see above

    class BarOnly(ProgressCallback):
        def on_log(self, args, state, control, logs=None, **kwargs):
            pass

    for cls in (ProgressCallback, PrinterCallback):
        while any(isinstance(cb, cls) for cb in trainer.callback_handler.callbacks):
            trainer.remove_callback(cls)
    if progress_bar:
        trainer.add_callback(BarOnly)


def _memory_text(memory: dict) -> str:
    """The generation memory plan (:mod:`grpo_kit.generation.plan`) in a line."""
    if memory.get("kv_cache_gib") is None:
        return f"vLLM's KV cache from {memory.get('kv_source')}"
    dtype = "" if memory.get("kv_cache_dtype") in (None, "auto") else f" in {memory['kv_cache_dtype']}"
    text = f"vLLM's KV cache {memory['kv_cache_gib']:.2f} GiB{dtype} from {memory['kv_source']}"
    if "calculator_peak_gib" in memory:  # CUDA: the whole step priced against the free memory
        text += (
            f"; the calculator's step peak {memory['calculator_peak_gib']:.2f} GiB of {memory['free_gib']:.2f} GiB free"
        )
    return text


def plan_lines(cfg, *, device: str, dtype, info: dict) -> list[str]:
    """The run's plan, printed before the model trains: model, device and dtype, the generation backend, whether
    the engine shares the training weights or holds a copy, the memory plan, and what the console leaves out.
    ``info``: :func:`grpo_kit.generation.plan.start_generation`'s."""
    adapter = f"LoRA r={cfg.lora_rank}" if cfg.use_lora else "full fine-tuning"
    lines = [
        f"plan: {cfg.model} on {device} in {str(dtype).removeprefix('torch.')}, {adapter}, task {cfg.task}, "
        f"{cfg.max_steps} steps"
    ]
    generation = f"  generation: {info['backend']}" + (f" ({info['reason']})" if info.get("reason") else "")
    if info.get("weights"):
        generation += f", weights {info['weights']}"
    lines.append(generation)
    if info.get("model"):
        m = info["model"]
        text = f"  model: {m['family']}, {m['layers']} layers, logits {m['logits']}"
        if m.get("lora_targets"):
            text += f"; LoRA on {', '.join(m['lora_targets'])}"
        lines.append(text)
        if m.get("experts"):
            lines.append(f"  experts: {m['experts']}; router load-balancing loss {m['router_aux_loss']}")
    if info.get("memory_plan"):
        lines.append(f"  memory: {_memory_text(info['memory_plan'])}")
    if cfg.prefix_sharing is not False and cfg.trainer == "grpo_kit":
        lines.append(
            f"  prefix sharing: {cfg.prefix_sharing} (a group's shared prompt scored once; auto: where it "
            f"is at least {AUTO_MIN_PROMPT_TOKENS:,} tokens and as long as the completions; summary.json "
            "counts what it did)"
        )
    if cfg.sandbox_filesystem == "host":
        lines.append(
            "  sandbox: sandbox_filesystem=host, the weaker mode: model code sees the host's file system "
            "(run folders, data files, the home folder, as far as its uid may read them)"
        )
    lines.append(f"  {console_line()}")
    return lines


def _files_text(run_dir: Path) -> str:
    """What the run folder holds, checkpoints counted."""
    if not run_dir.is_dir():
        return "-"
    entries = sorted(p for p in run_dir.iterdir() if not p.name.startswith("."))  # not the run's lock
    names = [p.name + ("/" if p.is_dir() else "") for p in entries if not p.name.startswith("checkpoint-")]
    checkpoints = sum(p.name.startswith("checkpoint-") for p in entries)
    return ", ".join(names + ([f"{checkpoints} checkpoint(s)"] if checkpoints else []))


def closing_lines(summary: dict) -> list[str]:
    """The closing table of a run from its ``summary.json`` dict: held-out accuracy before -> after, steps and
    time, peak memory, the run folder and what it holds."""

    def acc(key):
        return _num(summary.get(key), ".3f")

    peak = "CUDA allocated" if summary.get("device") == "cuda" else "process RSS"
    return [
        f"run folder: {summary['run_dir']}",
        f"  held-out accuracy: {acc('accuracy_before')} -> {acc('accuracy_after')}",
        f"  steps: {summary.get('steps')} ({_num(summary.get('train_seconds'), '.1f')} s training, "
        f"{_num(summary.get('mean_step_time_s'), '.2f')} s/step; {_num(summary.get('total_seconds'), '.1f')} s "
        "in all)",
        f"  peak memory: {_num(summary.get('peak_memory_gib'), '.2f')} GiB ({peak})",
        f"  files: {_files_text(Path(summary['run_dir']))}",
    ]
