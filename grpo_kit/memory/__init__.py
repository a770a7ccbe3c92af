"""VRAM calculator and profiler: ``estimate()`` before a run, ``profile()`` during it (layer: memory; may import
``kernels``, ``readers``, ``loss``, ``model`` and ``tasks``; no TRL).

* :class:`EstimateSpec` (one step's settings) / :func:`estimate` / :func:`compare` / :func:`published_table`
  (``estimate.py``; every byte count in ``formulas.py`` with its derivation); :func:`config_estimate_spec`: a run's
  step as a spec;
* :func:`profile` / :class:`Profiler` / :func:`phase` (``profiler.py``): measured peak memory per
  phase (CUDA allocator statistics and snapshot; CPU resident set size); :func:`live_at_peak`: what a
  snapshot's history had allocated at its largest moment, by the line that allocated it;
* :func:`plot_components` / :func:`plot_vs_context` (``plot.py``, matplotlib, Agg-safe; imported
  on first use);
* :func:`cli_main` (``cli.py``): ``python -m grpo_kit vram ...``.
"""

from grpo_kit.memory.cli import cli_main
from grpo_kit.memory.estimate import (
    METHODS,
    EstimateSpec,
    compare,
    config_estimate_spec,
    estimate,
    estimate_for_config,
    published_table,
    resolve_arch,
    scoring_batch_for_config,
    total_gpu_bytes,
)
from grpo_kit.memory.profiler import Profiler, ProfileResult, live_at_peak, phase, profile


def plot_components(*args, **kwargs):
    """Stacked bars by component (see :func:`grpo_kit.memory.plot.plot_components`)."""
    from grpo_kit.memory.plot import plot_components as _f  # lazy: matplotlib

    return _f(*args, **kwargs)


def plot_vs_context(*args, **kwargs):
    """GPU peak vs context length (see :func:`grpo_kit.memory.plot.plot_vs_context`)."""
    from grpo_kit.memory.plot import plot_vs_context as _f  # lazy: matplotlib

    return _f(*args, **kwargs)


__all__ = [
    "METHODS",
    "EstimateSpec",
    "estimate",
    "config_estimate_spec",
    "estimate_for_config",
    "scoring_batch_for_config",
    "compare",
    "published_table",
    "resolve_arch",
    "total_gpu_bytes",
    "Profiler",
    "ProfileResult",
    "live_at_peak",
    "phase",
    "profile",
    "cli_main",
    "plot_components",
    "plot_vs_context",
]
