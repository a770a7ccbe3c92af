"""VRAM calculator and profiler: ``estimate()`` before a run, ``profile()`` during it (layer: memory; may import
``kernels``, ``loss``, ``model`` and ``tasks``; no TRL).

* :func:`estimate` / :func:`compare` / :func:`published_table` (``estimate.py``; every byte count
  in ``formulas.py`` with its derivation);
* :func:`profile` / :class:`Profiler` / :func:`phase` (``profiler.py``): measured peak memory per
  phase (CUDA allocator statistics and snapshot; CPU resident set size);
* :func:`plot_components` / :func:`plot_vs_context` (``plot.py``, matplotlib, Agg-safe; imported
  on first use);
* :func:`cli_main` (``cli.py``): ``python -m grpo_kit vram ...``.
"""

import importlib

# public name -> the module of this package that defines it; imported on first use, so that a module needing only
# the formulas (the config's KV-cache dtypes) does not import the estimate's transformers and pandas
_PUBLIC = {
    "METHODS": "estimate", "compare": "estimate", "estimate": "estimate", "estimate_for_config": "estimate",
    "published_table": "estimate", "resolve_arch": "estimate", "scoring_batch_for_config": "estimate",
    "total_gpu_bytes": "estimate", "Profiler": "profiler", "ProfileResult": "profiler", "phase": "profiler",
    "profile": "profiler", "cli_main": "cli", "plot_components": "plot", "plot_vs_context": "plot",
}

__all__ = list(_PUBLIC)


def __getattr__(name):  # PEP 562
    if name in _PUBLIC:
        value = getattr(importlib.import_module(f"grpo_kit.memory.{_PUBLIC[name]}"), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'grpo_kit.memory' has no attribute {name!r}")
