"""grpo_kit: memory-efficient GRPO for LLMs, Jupyter first.

Modules (one job each): ``config`` (the one config object), ``models`` (loading
the embedded model, tiny and config-only architectures), ``data`` (tasks and
GSM8K), ``rewards`` (verifiers), ``loss`` (the efficient GRPO loss and its
reference), ``checkpointing`` (offloaded gradient checkpointing), ``memory``
(VRAM estimate and profiling), ``trainer`` (the TRL-based trainer),
``generation`` (HF and vLLM backends), ``console`` (what a run prints), ``preflight``
(the learning-signal check before training), ``colab`` (the notebooks' Colab install).
"""

__version__ = "0.1.0"
