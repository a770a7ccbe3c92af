"""Triton, where installed: the kernels' one optional import (the torch twins never need it)."""

import os

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
