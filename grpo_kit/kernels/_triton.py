"""Triton, where installed: the kernels' one optional import (the torch twins never need it)."""

import contextlib
import os

import torch

try:
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # pragma: no cover - depends on the environment
    triton = None
    tl = None
    HAS_TRITON = False


def interpreter_active() -> bool:
    """True when Triton runs kernels in its CPU interpreter (TRITON_INTERPRET=1 before import)."""
    if not HAS_TRITON:
        return False
    knobs = getattr(triton, "knobs", None)  # Triton >= 3.4; older ones (with torch 2.6-2.8) read the variable
    return bool(knobs.runtime.interpret) if knobs is not None else os.environ.get("TRITON_INTERPRET") == "1"


# The output dtype as a kernel's HALF constant: 0 float32, 1 float16, 2 bfloat16 (each kernel stores its own way)
OUT_DTYPE_CODE = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}


def launch_device(device: torch.device):
    """The context to launch a kernel for tensors on ``device`` in: Triton launches on the current CUDA device,
    so that one is made current; nothing elsewhere (the interpreter)."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()
