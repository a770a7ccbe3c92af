"""Triton, where installed: the kernels' one optional import (the torch twins never need it)."""

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
    return HAS_TRITON and bool(triton.knobs.runtime.interpret)
