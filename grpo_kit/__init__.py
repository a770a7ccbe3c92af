"""grpo_kit: memory-efficient GRPO for LLMs, Jupyter first.

The layers are the folders, lowest first (each ``__init__`` says what it owns and may import):

* ``kernels/``: Triton kernels, each with a plain-torch twin;
* ``readers/``: untrusted input (JSON documents, JSON-lines files) read within size and depth limits;
* ``loss/``: the GRPO objective, its registry of variants and the memory-efficient loss;
* ``model/``: loading, 4-bit base weights, the pad-free layout, activation offload;
* ``tasks/``: tasks, rewards and verifiers, the sandbox;
* ``memory/``: the VRAM calculator and profiler;
* ``generation/``: HF and vLLM generation, one copy of the weights shared with training;
* ``trainer/``: the TRL adapter (``EfficientGRPOTrainer``), guards, resumable checkpoints;
* ``app/``: the one config, ``train()``, the run folder, the command line;
* ``notebook/``: the dashboard and the notebooks' helpers.

The public names below are imported on first use, so ``import grpo_kit`` stays light and imports no TRL.
"""

import importlib

__version__ = "0.1.0"

# public name -> the module that defines it
_PUBLIC = {
    "efficient_grpo_loss": "grpo_kit.loss.efficient",
    "per_token_logps": "grpo_kit.loss.efficient",
    "grpo_loss_reference": "grpo_kit.loss.reference",
    "register_loss": "grpo_kit.loss.registry",
    "ObjectiveSpec": "grpo_kit.loss.objective",
    "load_model": "grpo_kit.model.loading",
    "load_tokenizer": "grpo_kit.model.loading",
    "estimate": "grpo_kit.memory.estimate",
    "EstimateSpec": "grpo_kit.memory.estimate",
    "profile": "grpo_kit.memory.profiler",
    "fit_verdict": "grpo_kit.memory.fit",
    "make_generator": "grpo_kit.generation",
    "EfficientGRPOTrainer": "grpo_kit.trainer.grpo_trainer",
    "GRPOKitConfig": "grpo_kit.app.config",
    "train": "grpo_kit.app.run",
    "resume": "grpo_kit.app.run",
    "preflight": "grpo_kit.app.preflight",
    "LiveDashboard": "grpo_kit.notebook.dashboard",
}

__all__ = ["__version__", *_PUBLIC]


def __getattr__(name):  # PEP 562: the module behind a public name is imported when the name is first asked for
    if name in _PUBLIC:
        value = getattr(importlib.import_module(_PUBLIC[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'grpo_kit' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_PUBLIC))
