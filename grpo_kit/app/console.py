"""What a training run prints: one compact line per logged step, each distinct warning once, rounded numbers.

TRL logs a dict of ~27 keys every step; the console gets :func:`step_line` instead (the full dict goes to the
run folder's ``metrics.csv``). :func:`quiet_trainer_logs` takes the dict printing out of a transformers
``Trainer``'s progress callbacks, :func:`warn_once_per_message` makes Python show each warning text once
(libraries warn the same text from several lines, e.g. TRL's vLLM version check at five import sites).
"""

from __future__ import annotations

import math
import warnings

# Decimal places of the numbers written to summary.json and printed at the end of a run.
SUMMARY_DIGITS = 4


_SHOWN: set[tuple[type, str]] = set()  # (category, text) of the warnings shown so far in this process


def warn_once_per_message() -> None:
    """Show each distinct warning (category and text) once per process, whichever line raises it. The filters
    still decide what is shown; this only drops repeats. (Python's ``"once"`` action cannot do it: it keys on
    the calling module's registry, which is cleared whenever any filter changes.)"""
    if getattr(warnings.showwarning, "_grpo_kit_once", False):
        return
    inner = warnings.showwarning

    def show(message, category, filename, lineno, file=None, line=None):
        key = (category, str(message))
        if key not in _SHOWN:
            _SHOWN.add(key)
            inner(message, category, filename, lineno, file, line)

    show._grpo_kit_once = True
    warnings.showwarning = show


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
    per_reward = " ".join(f"{reward_name(k)} {_num(v, '.3f')}" for k, v in row.items()
                          if k.startswith("rewards/") and k.endswith("/mean"))
    zero = row.get("frac_reward_zero_std")
    parts = [step, f"reward {_num(row.get('reward_mean'), '.3f')}±{_num(row.get('reward_std'), '.3f')}",
             per_reward, f"no-signal groups {_num(None if zero is None else 100 * zero, '.0f')}%",
             f"kl {_num(row.get('kl'), '.4f')}", f"len {_num(row.get('completion_length'), '.1f')}",
             f"{_num(row.get('step_time_s'), '.2f')} s/step", f"peak {_num(row.get('peak_memory_gib'), '.2f')} GiB"]
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
