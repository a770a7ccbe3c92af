"""Plots of the VRAM estimate (matplotlib ``Figure`` objects; no pyplot, so Agg-safe and headless).

* :func:`plot_components`: stacked bars, one bar per estimate, one colour per GPU component, the
  peak total on top (components not alive at the peak are left out of the stack).
* :func:`plot_vs_context`: estimated GPU peak against context length for several methods (one
  :class:`~grpo_kit.memory.estimate.EstimateSpec`, its completion varied), with measured points (e.g. a
  benchmark's peaks) overlaid.

Both return the figure; save it with ``fig.savefig(path)``; in Jupyter it displays itself.
"""

from __future__ import annotations

import dataclasses

import matplotlib
import pandas as pd
from matplotlib.figure import Figure

from grpo_kit.memory.estimate import METHODS, EstimateSpec, estimate, total_gpu_bytes
from grpo_kit.memory.formulas import GiB

_TOTALS = ("total GPU (peak)", "total CPU")


def plot_components(
    estimates, *, unit: str = "GiB", title: str | None = None, budget_gib: float | None = None
) -> Figure:
    """Stacked bars of GPU components at the peak.

    ``estimates``: one :func:`estimate` DataFrame, or a dict ``label -> DataFrame``.
    ``budget_gib``: draw a horizontal line at this many GiB (e.g. 80 for an 80 GB card).
    """
    if unit not in ("GB", "GiB"):
        raise ValueError(f"unit must be 'GB' or 'GiB', got {unit!r}")
    if isinstance(estimates, pd.DataFrame):
        estimates = {estimates.attrs.get("method", "estimate"): estimates}
    if not isinstance(estimates, dict) or not estimates:
        raise ValueError("estimates must be an estimate() DataFrame or a non-empty dict of them")
    comps = []
    for df in estimates.values():
        for c in df.loc[(df["where"] == "GPU") & ~df["component"].isin(_TOTALS), "component"]:
            if c not in comps:
                comps.append(c)
    fig = Figure(figsize=(1.8 + 1.6 * len(estimates), 4.8))
    ax = fig.add_subplot(1, 1, 1)
    cmap = matplotlib.colormaps["tab10"]
    labels = list(estimates)
    handles = {}
    for i, label in enumerate(labels):
        df = estimates[label].set_index("component")
        bottom = 0.0
        for j, c in enumerate(comps):
            if c not in df.index or not bool(df.at[c, "in_peak"]):
                continue
            v = float(df.at[c, unit])
            bars = ax.bar(i, v, bottom=bottom, color=cmap(j % 10), edgecolor="white", width=0.6)
            handles.setdefault(c, bars)
            bottom += v
        ax.text(i, bottom, f"{bottom:.1f}", ha="center", va="bottom", fontsize=9)
    if budget_gib is not None:
        y = budget_gib if unit == "GiB" else budget_gib * GiB / 1e9
        ax.axhline(y, color="black", linestyle="--", linewidth=1)
        ax.text(len(labels) - 0.5, y, f" {budget_gib:g} GiB", va="bottom", ha="right", fontsize=8)
    ax.set_xticks(range(len(labels)), labels)
    ax.set_ylabel(f"GPU memory at the peak ({unit})")
    first = next(iter(estimates.values())).attrs
    ax.set_title(
        title
        or (
            f"{first.get('model', '')}: {first.get('num_generations')} generations x "
            f"{first.get('prompt_length', 0) + first.get('completion_length', 0)} tokens"
        )
    )
    ax.legend(list(handles.values()), list(handles), fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    return fig


def plot_vs_context(
    model,
    contexts,
    spec: EstimateSpec,
    *,
    methods=METHODS,
    measured=None,
    budget_gib: float | None = None,
    title: str | None = None,
) -> Figure:
    """Estimated GPU peak (GiB) against context length (tokens per sequence), one line per
    method: ``spec`` with each method, its prompt length and the rest of each context as completion;
    ``measured``: dict ``label -> [(context, GiB), ...]`` drawn as markers."""
    prompt_length = spec.prompt_length
    contexts = sorted(int(c) for c in contexts)
    if not contexts or contexts[0] <= prompt_length:
        raise ValueError(f"contexts must be non-empty and each > prompt_length={prompt_length}, got {contexts}")
    fig = Figure(figsize=(7, 4.5))
    ax = fig.add_subplot(1, 1, 1)
    for m in methods:
        ys = [
            total_gpu_bytes(estimate(model, dataclasses.replace(spec, method=m, completion_length=c - prompt_length)))
            / GiB
            for c in contexts
        ]
        ax.plot(contexts, ys, marker=".", label=f"estimate: {m}")
    for label, pts in (measured or {}).items():
        pts = sorted(pts)
        ax.plot(
            [p[0] for p in pts],
            [p[1] for p in pts],
            linestyle="none",
            marker="o",
            markersize=7,
            markerfacecolor="none",
            label=f"measured: {label}",
        )
    if budget_gib is not None:
        ax.axhline(budget_gib, color="black", linestyle="--", linewidth=1, label=f"{budget_gib:g} GiB budget")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("tokens per sequence")
    ax.set_ylabel("GPU peak (GiB)")
    ax.set_title(title or f"{model}: GPU peak vs context")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig
