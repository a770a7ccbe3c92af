"""Live training dashboard for notebooks: a ``transformers.TrainerCallback``.

Every logged step it records reward mean/std, each reward function's mean, the share of groups with no
reward spread, loss, KL, mean completion length, step time and memory (CUDA allocated / peak, process
RSS), with tools TRL's tool-call and tool-failure frequencies, and shows them as two rows of matplotlib panels
(a tool-call panel added when tools were called) plus a
table of the latest sample completions (read from the run folder's ``samples.jsonl``,
which ``grpo_kit.app.run.train`` writes). With a widget front end (Jupyter, Colab) the
figure and table live in an ``ipywidgets.Output`` redrawn in place; without one
(CI, a plain script) nothing is redrawn during training. In both modes one static
figure and table are shown at the end (papermill saves no widget views, and cannot be
told apart from Jupyter from inside the kernel).

Usage::

    dash = LiveDashboard()
    grpo_kit.app.run.train(cfg, callbacks=(dash,))
"""

from __future__ import annotations

import html
import os
from pathlib import Path

import psutil
import torch
from transformers import TrainerCallback

from grpo_kit.app.console import reward_name
from grpo_kit.readers.bounded import parse_json

MODES = ("auto", "widgets", "static")
# TRL 1.16 log keys -> dashboard column names
_LOG_KEYS = {
    "reward": "reward_mean",
    "reward_std": "reward_std",
    "loss": "loss",
    "kl": "kl",
    "completions/mean_length": "completion_length",
    "frac_reward_zero_std": "frac_reward_zero_std",
    "step_time": "step_time_s",
    "tools/call_frequency": "tool_call_frequency",
    "tools/failure_frequency": "tool_failure_frequency",
}
# (row key, title); two rows of four panels. "rewards": one line per reward function (rewards/<fn>/mean).
PANELS = (
    ("reward_mean", "reward (mean ± std)"),
    ("rewards", "each reward function"),
    ("frac_reward_zero_std", "no-signal groups"),
    ("loss", "loss"),
    ("kl", "KL (k3)"),
    ("completion_length", "completion length"),
    ("step_time_s", "step time"),
    ("memory", "memory"),
)
Y_LABELS = {
    "reward_mean": "reward",
    "rewards": "mean reward",
    "frac_reward_zero_std": "share of groups",
    "loss": "loss",
    "kl": "KL",
    "completion_length": "tokens",
    "step_time_s": "seconds",
    "memory": "GiB",
    "tools": "per rollout / per call",
}
PANEL_ROWS = 2
# With tools (TRL logs tools/call_frequency): calls per rollout and the share of calls that failed.
TOOL_PANEL = ("tools", "tool calls")


def widget_frontend_available() -> bool:
    """True inside a Jupyter/Colab kernel with ipywidgets installed, unless the run is
    headless: papermill/CI (``GRPO_KIT_STATIC_DASHBOARD=1`` or ``CI`` set) have no front
    end to render widgets, so the static fallback is used there."""
    if os.environ.get("GRPO_KIT_STATIC_DASHBOARD") or os.environ.get("CI"):
        return False
    try:
        import ipywidgets  # noqa: F401  # lazy: the widgets' front end is optional
        from IPython import get_ipython  # lazy: IPython is there only inside a notebook kernel
    except ImportError:
        return False
    shell = get_ipython()
    return shell is not None and type(shell).__name__ in ("ZMQInteractiveShell", "Shell")  # Shell: Colab


def memory_now() -> dict:
    """Current memory in GiB: ``cpu_rss_gib`` always; ``gpu_allocated_gib`` and
    ``gpu_peak_gib`` when CUDA is initialised."""

    out = {"cpu_rss_gib": psutil.Process().memory_info().rss / 2**30}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out["gpu_allocated_gib"] = torch.cuda.memory_allocated() / 2**30
        out["gpu_peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
    return out


def read_samples(path: str | os.PathLike, n: int = 6) -> list[dict]:
    """The last ``n`` records of a ``samples.jsonl`` (``[]`` when the file is absent);
    a partly written last line is skipped."""
    p = Path(path)
    if not p.is_file():
        return []
    rows = []
    for line in p.read_text(encoding="utf-8").splitlines()[-n:]:
        try:
            rows.append(parse_json(line, str(p)))
        except ValueError:  # a partly written line, or one beyond the reader's limits
            continue
    return rows


def samples_html(rows: list[dict], max_chars: int = 120) -> str:
    """An HTML table of sample records (step, prompt, completion, answer, reward columns)."""
    if not rows:
        return "<i>no samples yet</i>"
    cols = ["step", "prompt", "completion", "answer"]
    cols += sorted({k for r in rows for k in r} - set(cols))

    def cell(v):
        text = f"{v:.3g}" if isinstance(v, float) else str(v)
        text = text if len(text) <= max_chars else text[:max_chars] + "…"
        return f"<td style='text-align:left'>{html.escape(text)}</td>"

    head = "".join(f"<th>{html.escape(c)}</th>" for c in cols)
    body = "".join("<tr>" + "".join(cell(r.get(c, "")) for c in cols) + "</tr>" for r in rows)
    return f"<table><tr>{head}</tr>{body}</table>"


class LiveDashboard(TrainerCallback):
    """Per-step metrics, memory and sample completions in a notebook.

    Args:
        mode: ``"auto"`` (widgets when a front end is attached, see
            :func:`widget_frontend_available`), ``"widgets"`` or ``"static"``.
        samples_path: ``samples.jsonl`` to show completions from; None: ``<output_dir>/samples.jsonl``
            of the trainer's args.
        num_samples: rows in the completions table.
        display: whether to display anything (False: only record; ``history`` and
            :meth:`figure` stay usable).

    ``history``: one dict per logged step with ``step``, the keys of ``PANELS`` that TRL
    logged (floats) and the ``memory_now()`` keys.
    """

    def __init__(
        self,
        mode: str = "auto",
        samples_path: str | os.PathLike | None = None,
        num_samples: int = 6,
        display: bool = True,
    ):
        if mode not in MODES:
            raise ValueError(f"mode={mode!r} is not allowed; choose one of {list(MODES)}")
        if not isinstance(num_samples, int) or isinstance(num_samples, bool) or num_samples < 0:
            raise ValueError(f"num_samples must be an int >= 0, got {num_samples!r}")
        self.mode = mode
        self.samples_path = Path(samples_path) if samples_path is not None else None
        self.num_samples = num_samples
        self.display = display
        self.history: list[dict] = []
        self.widgets = (mode == "widgets" or (mode == "auto" and widget_frontend_available())) and display
        self._out = self._table = None

    # --- TrainerCallback hooks ---------------------------------------------------------
    def on_train_begin(self, args, state, control, **kw):
        if self.samples_path is None:
            self.samples_path = Path(args.output_dir) / "samples.jsonl"
        if self.widgets:
            import ipywidgets as w  # lazy: the widgets' front end is optional
            from IPython.display import display  # lazy: IPython is there only inside a notebook kernel

            self._out, self._table = w.Output(), w.HTML()
            display(w.VBox([self._out, self._table]))

    def on_log(self, args, state, control, logs=None, **kw):
        logs = logs or {}
        if "reward" not in logs or not state.is_world_process_zero:  # the end-of-training summary, or not main
            return
        self.record(state.global_step, logs)
        if self.widgets and self._out is not None:
            self._redraw()

    def on_train_end(self, args, state, control, **kw):
        # Also in widget mode: a kernel driven by papermill looks like Jupyter but saves no widget
        # views, so a final static figure is the only record the executed notebook keeps.
        if self.display:
            self.show()

    # --- data and drawing --------------------------------------------------------------
    def record(self, step: int, logs: dict) -> dict:
        """Add one row from a TRL log dict (keys as TRL logs them) plus current memory."""
        row = {"step": int(step)}
        for key, name in _LOG_KEYS.items():
            if logs.get(key) is not None:
                row[name] = float(logs[key])
        row.update(
            {k: float(v) for k, v in logs.items() if k.startswith("rewards/") and k.endswith("/mean") and v is not None}
        )
        row.update(memory_now())
        self.history.append(row)
        return row

    def panels(self) -> tuple:
        """``PANELS``, and ``TOOL_PANEL`` when TRL logged tool calls."""
        return PANELS + ((TOOL_PANEL,) if any("tool_call_frequency" in r for r in self.history) else ())

    def figure(self):
        """A matplotlib Figure with one panel per entry of :meth:`panels` over the history."""
        import matplotlib.pyplot as plt  # lazy: pyplot after the backend is chosen

        panels = self.panels()
        cols = -(-len(panels) // PANEL_ROWS)
        fig, axes = plt.subplots(PANEL_ROWS, cols, figsize=(3.2 * cols, 2.6 * PANEL_ROWS), squeeze=False)
        for ax in axes.flat[len(panels) :]:  # an odd panel count leaves one cell empty
            ax.remove()
        steps = [r["step"] for r in self.history]
        for ax, (key, title) in zip(axes.flat, panels):
            ax.set_title(title, fontsize=9)
            ax.set_xlabel("step", fontsize=8)
            ax.set_ylabel(Y_LABELS[key], fontsize=8)
            ax.grid(alpha=0.3)
            if key == "rewards":
                names = sorted({k for r in self.history for k in r if k.startswith("rewards/")})
                for k in names:
                    ax.plot(steps, [r.get(k, float("nan")) for r in self.history], marker=".", label=reward_name(k))
                if names:
                    ax.legend(fontsize=7)
                continue
            if key == "tools":
                for tkey, label in (
                    ("tool_call_frequency", "calls per rollout"),
                    ("tool_failure_frequency", "failed share of calls"),
                ):
                    ax.plot(steps, [r.get(tkey, float("nan")) for r in self.history], marker=".", label=label)
                ax.legend(fontsize=7)
                continue
            if key == "memory":
                for mkey, label in (
                    ("cpu_rss_gib", "CPU RSS"),
                    ("gpu_allocated_gib", "GPU allocated"),
                    ("gpu_peak_gib", "GPU peak"),
                ):
                    vals = [r.get(mkey) for r in self.history]
                    if any(v is not None for v in vals):
                        ax.plot(steps, vals, marker=".", label=label)
                if self.history:
                    ax.legend(fontsize=7)
                continue
            vals = [r.get(key, float("nan")) for r in self.history]
            ax.plot(steps, vals, marker=".", color="C0")
            if key == "reward_mean":
                std = [r.get("reward_std", 0.0) for r in self.history]
                ax.fill_between(
                    steps, [m - s for m, s in zip(vals, std)], [m + s for m, s in zip(vals, std)], alpha=0.2, color="C0"
                )
        fig.tight_layout()
        return fig

    def samples(self) -> list[dict]:
        return read_samples(self.samples_path, self.num_samples) if self.samples_path else []

    def _redraw(self):
        import matplotlib.pyplot as plt  # lazy: pyplot after the backend is chosen
        from IPython.display import display  # lazy: IPython is there only inside a notebook kernel

        fig = self.figure()
        with self._out:
            self._out.clear_output(wait=True)
            display(fig)
        plt.close(fig)
        self._table.value = samples_html(self.samples())

    def show(self):
        """Display the figure and the samples table once (the static fallback)."""
        import matplotlib.pyplot as plt  # lazy: pyplot after the backend is chosen
        from IPython.display import HTML, display  # lazy: IPython is there only inside a notebook kernel

        fig = self.figure()
        display(fig)
        plt.close(fig)
        display(HTML(samples_html(self.samples())))
