"""NF4 weights (bitsandbytes' layout, double quantisation) back to 16 bit in one kernel launch.

A bitsandbytes ``Params4bit`` weight W (out, in), n = out x in elements in row-major order, is held as:

* ``packed`` uint8 (ceil(n / 2), 1): byte j holds element 2j in its high nibble and 2j + 1 in its low one;
* ``code`` float32 (16,): the NF4 levels; element i is ``code[nibble(i)] * absmax[i // blocksize]``;
* with double quantisation (``quant_state.nested``) the absmax constants are themselves 8-bit:
  ``absmax[b] = code2[absmax_q[b]] * absmax2[b // blocksize2] + offset`` (``code2``: bitsandbytes' 256-level
  dynamic map, ``absmax2`` float32, ``offset`` their mean).

Every product and the sum are float32, each rounded on its own (no fused multiply-add), and the result is
rounded to the output dtype to nearest even: the arithmetic of bitsandbytes' CUDA kernels, which compute
``code[q] * absmax`` in float32, add the offset in a separate torch op and store through a rounding cast.
:func:`dequantize_reference` writes it in torch (any device; the readable definition), :func:`dequantize_triton`
in one Triton launch on CUDA. bitsandbytes' own ``dequantize_4bit`` takes five host calls and three kernels for
the same weight (the constants' dequantisation, the offset, the nibbles); the kit's 4-bit matmul
(:mod:`grpo_kit.nf4_matmul`) calls this 21 times per decoder layer per micro-batch, so the host calls
are what it saves. :func:`kernel_matches_bitsandbytes` checks the compiled kernel against bitsandbytes on a
probe weight before real weights use it. ``tests/test_nf4_dequant.py`` holds the three equal to the bit (Triton
in its CPU interpreter) and checks that the compiled kernel has no fused multiply-add.
"""

from __future__ import annotations

import contextlib
import functools

import torch

from ._triton import HAS_TRITON, interpreter_active, tl, triton  # noqa: F401

_BLOCK = 4096  # weights per Triton program (2048 packed bytes: 16 per thread of 4 warps)
# No fused multiply-add: bitsandbytes rounds the constants' product and the offset's sum each on its own
# (compiled with fusion on, the kernel's PTX has an fma there; tests/test_nf4_dequant.py checks it has none).
LAUNCH_OPTIONS = {"enable_fp_fusion": False}


def _absmax(quant_state) -> torch.Tensor:
    """The float32 absmax constants (one per block of ``quant_state.blocksize`` weights)."""
    if not quant_state.nested:
        return quant_state.absmax.float()
    s2 = quant_state.state2
    scale = s2.absmax.repeat_interleave(s2.blocksize)[: quant_state.absmax.numel()]
    return s2.code.to(quant_state.absmax.device)[quant_state.absmax.long()] * scale + quant_state.offset


def dequantize_reference(packed: torch.Tensor, quant_state, dtype: torch.dtype | None = None) -> torch.Tensor:
    """W (``quant_state.shape``; ``dtype``, default ``quant_state.dtype``) from ``packed`` (uint8, ceil(n / 2)
    bytes): the module docstring's formula in torch, op by op (eager torch rounds each product and sum on its
    own), rounded once to ``dtype``."""
    n = quant_state.shape.numel()
    b = packed.reshape(-1)
    nibbles = torch.stack((b >> 4, b & 15), dim=1).reshape(-1)[:n].long()
    scale = _absmax(quant_state).repeat_interleave(quant_state.blocksize)[:n]
    return (quant_state.code.to(b.device)[nibbles] * scale).to(dtype or quant_state.dtype).view(quant_state.shape)


def _nf4_dequant_kernel(PACKED, ABSQ, CODE2, ABS2, OFFSET, CODE, OUT, N, QBLOCK: tl.constexpr, QBLOCK2: tl.constexpr,
                DOWNCAST: tl.constexpr, BLOCK: tl.constexpr):
    # one program: BLOCK weights from BLOCK // 2 packed bytes. Each byte is read once and its two weights share
    # their block's constant (QBLOCK is even), so a byte costs one constant's lookups, not two.
    j = tl.program_id(0).to(tl.int64) * (BLOCK // 2) + tl.arange(0, BLOCK // 2)
    mj = 2 * j < N  # the byte holds at least its high weight (an odd N leaves the last low nibble unused)
    byte = tl.load(PACKED + j, mask=mj, other=0).to(tl.int32)
    blk = (2 * j) // QBLOCK
    aq = tl.load(ABSQ + blk, mask=mj, other=0).to(tl.int32)
    # two roundings, as bitsandbytes (its kernel's product, then torch's add): LAUNCH_OPTIONS keep the
    # compiler from contracting them into one fma
    absmax = tl.load(CODE2 + aq, mask=mj, other=0.0) * tl.load(ABS2 + blk // QBLOCK2, mask=mj, other=0.0)
    absmax = absmax + tl.load(OFFSET)
    hi = tl.load(CODE + (byte >> 4), mask=mj, other=0.0) * absmax  # weight 2j
    lo = tl.load(CODE + (byte & 15), mask=mj, other=0.0) * absmax  # weight 2j + 1
    w = tl.interleave(hi, lo)
    i = tl.interleave(2 * j, 2 * j + 1)
    if DOWNCAST:
        w = w.to(OUT.dtype.element_ty, fp_downcast_rounding="rtne")
    tl.store(OUT + i, w, mask=i < N)


@functools.lru_cache(maxsize=None)
def _kernel():
    return triton.jit(_nf4_dequant_kernel, do_not_specialize=["N"])


def triton_usable(packed: torch.Tensor, quant_state) -> bool:
    """The kernel takes this weight: Triton installed, NF4 with double quantisation (bitsandbytes' QLoRA
    default, and the kit's) in bitsandbytes' layout (not its CPU eval repacking), on CUDA (or any device under
    the interpreter)."""
    return (HAS_TRITON and quant_state.quant_type == "nf4" and bool(quant_state.nested)
            and not getattr(quant_state, "packing_format_for_cpu", False) and packed.dtype == torch.uint8
            and (packed.is_cuda or interpreter_active()))


def dequantize_triton(packed: torch.Tensor, quant_state, dtype: torch.dtype | None = None) -> torch.Tensor:
    """:func:`dequantize_reference` in one launch (see :func:`triton_usable` for what it takes), on the weight's
    device whichever is current. Does not wait."""
    dtype = dtype or quant_state.dtype
    n = quant_state.shape.numel()
    dev = packed.device
    out = torch.empty(quant_state.shape, dtype=dtype, device=dev)
    s2 = quant_state.state2
    offset = torch.as_tensor(quant_state.offset, dtype=torch.float32, device=dev).reshape(1)
    with torch.cuda.device(dev) if dev.type == "cuda" else contextlib.nullcontext():  # Triton launches on the current one
        _kernel()[(triton.cdiv(n, _BLOCK),)](
            packed, quant_state.absmax, s2.code.to(dev), s2.absmax, offset, quant_state.code.to(dev), out, n,
            QBLOCK=quant_state.blocksize, QBLOCK2=s2.blocksize, DOWNCAST=dtype != torch.float32, BLOCK=_BLOCK,
            **LAUNCH_OPTIONS)
    return out


def dequantize_bitsandbytes(packed: torch.Tensor, quant_state) -> torch.Tensor:
    """bitsandbytes' own dequantisation (the kit's path where the kernel does not apply)."""
    import bitsandbytes.functional as BF

    return BF.dequantize_4bit(packed, quant_state)


@functools.lru_cache(maxsize=None)
def kernel_matches_bitsandbytes(device: str, dtype: torch.dtype) -> bool:
    """Whether the compiled kernel gives bitsandbytes' bits on a probe weight (odd size: a partial block and a
    half-used last byte) on ``device`` for output ``dtype``; checked once, before real weights use it. Where it
    does not, the kit's matmul dequantises through bitsandbytes."""
    import bitsandbytes.functional as BF

    g = torch.Generator(device="cpu").manual_seed(1234)
    w = (torch.randn(333, 515, generator=g) * 0.02).to(device=device, dtype=dtype)
    packed, qs = BF.quantize_4bit(w, blocksize=64, compress_statistics=True, quant_type="nf4")
    ints = {2: torch.int16, 4: torch.int32}[w.element_size()]
    return torch.equal(dequantize_triton(packed, qs).view(ints), BF.dequantize_4bit(packed, qs).view(ints))
