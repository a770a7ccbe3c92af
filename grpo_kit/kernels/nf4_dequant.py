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
(:mod:`grpo_kit.model.nf4_matmul`) calls this 21 times per decoder layer per micro-batch, so the host calls
are what it saves. :func:`kernel_matches_bitsandbytes` checks the compiled kernel against bitsandbytes on a
probe weight before real weights use it. ``tests/test_nf4_dequant.py`` holds the three equal to the bit (Triton
in its CPU interpreter) and checks that the compiled kernel has no fused multiply-add.

Memory traffic: each thread reads its packed bytes in one 16-byte load and writes its weights two to a word in
16-byte stores (the PTX test checks both): storing each weight on its own, 32 two-byte stores per thread, made the
kernel slower than bitsandbytes'.
"""

from __future__ import annotations

import functools

import torch

from grpo_kit.kernels._triton import (  # noqa: F401
    HAS_TRITON,
    OUT_DTYPE_CODE,
    interpreter_active,
    launch_device,
    tl,
    triton,
)

# The format this kernel decodes, written by grpo_kit.model.quantize: bitsandbytes NF4 with double quantisation
# (what QLoRA and Unsloth load): 4 bits per weight, one 8-bit absmax per NF4_BLOCK weights, one fp32 absmax per
# NF4_NESTED_BLOCK of those blocks.
NF4_BLOCK = 64
NF4_NESTED_BLOCK = 256
NF4_BITS_PER_PARAM = 4 + 8 / NF4_BLOCK + 32 / (NF4_BLOCK * NF4_NESTED_BLOCK)

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


def _nf4_dequant_kernel(
    PACKED,
    ABSQ,
    CODE2,
    ABS2,
    OFFSET,
    CODE,
    OUT,
    NBYTES,
    QBLOCK: tl.constexpr,
    QBLOCK2: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK: tl.constexpr,
):
    # One program: BLOCK weights from BLOCK // 2 packed bytes, laid out as (constant blocks, bytes of a block),
    # so each block's constant is computed once and every byte is read once. OUT is the output seen as words of
    # two weights (int32 for 16-bit, int64 for float32): byte j's two weights are word j, the high nibble's
    # weight at the lower address. Whole words let the stores go out 16 bytes at a time.
    R: tl.constexpr = BLOCK // QBLOCK  # constant blocks per program
    C: tl.constexpr = QBLOCK // 2  # packed bytes per constant block
    blk = tl.program_id(0).to(tl.int64) * R + tl.arange(0, R)
    j = blk[:, None] * C + tl.arange(0, C)[None, :]
    m = j < NBYTES
    mb = blk * C < NBYTES
    byte = tl.load(PACKED + j, mask=m, other=0).to(tl.int32)
    aq = tl.load(ABSQ + blk, mask=mb, other=0).to(tl.int32)
    # two roundings, as bitsandbytes (its kernel's product, then torch's add): LAUNCH_OPTIONS keep the
    # compiler from contracting them into one fma
    absmax = tl.load(CODE2 + aq, mask=mb, other=0.0) * tl.load(ABS2 + blk // QBLOCK2, mask=mb, other=0.0)
    absmax = (absmax + tl.load(OFFSET))[:, None]
    hi = tl.load(CODE + (byte >> 4), mask=m, other=0.0) * absmax  # weight 2j
    lo = tl.load(CODE + (byte & 15), mask=m, other=0.0) * absmax  # weight 2j + 1
    if HALF == 0:  # float32 out
        h = hi.to(tl.int32, bitcast=True).to(tl.int64) & 0xFFFFFFFF
        word = h | (lo.to(tl.int32, bitcast=True).to(tl.int64) << 32)
    else:  # 1: float16, 2: bfloat16, each rounded to nearest even
        half = tl.float16 if HALF == 1 else tl.bfloat16
        h = hi.to(half, fp_downcast_rounding="rtne").to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
        low = lo.to(half, fp_downcast_rounding="rtne").to(tl.int16, bitcast=True).to(tl.int32)
        word = h | (low << 16)
    tl.store(OUT + j, word, mask=m)


_WORD = {torch.float32: torch.int64, torch.float16: torch.int32, torch.bfloat16: torch.int32}


def compile_signature(dtype: str, nbytes_multiple_of_16: bool = True) -> tuple[dict, dict, dict]:
    """The kernel's argument types, constants and alignment attributes for compiling it ahead of time (the PTX
    checks in the tests, for sm_90 and sm_75), output ``dtype`` ``"fp16"``, ``"bf16"`` or ``"fp32"``, as launched
    on the kit's 4-bit weights (blocks of ``NF4_BLOCK``, nested blocks of 256). ``nbytes_multiple_of_16``:
    Triton's specialisation of the byte count, true for every weight of the built-in models."""

    out = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}[dtype]
    sig = {
        "PACKED": "*u8",
        "ABSQ": "*u8",
        "CODE2": "*fp32",
        "ABS2": "*fp32",
        "OFFSET": "*fp32",
        "CODE": "*fp32",
        "OUT": f"*i{_WORD[out].itemsize * 8}",
        "NBYTES": "i32",
        "QBLOCK": "constexpr",
        "QBLOCK2": "constexpr",
        "HALF": "constexpr",
        "BLOCK": "constexpr",
    }
    const = {"QBLOCK": NF4_BLOCK, "QBLOCK2": NF4_NESTED_BLOCK, "HALF": OUT_DTYPE_CODE[out], "BLOCK": _BLOCK}
    # as Triton specialises a launch: every pointer 16-byte aligned (torch's allocations are), and the byte count
    aligned = [
        i
        for i, (name, kind) in enumerate(sig.items())
        if kind.startswith("*") or (name == "NBYTES" and nbytes_multiple_of_16)
    ]
    return sig, const, {(i,): [["tt.divisibility", 16]] for i in aligned}


@functools.cache
def _kernel():
    return triton.jit(_nf4_dequant_kernel)


def triton_usable(packed: torch.Tensor, quant_state) -> bool:
    """The kernel takes this weight: Triton installed, NF4 with double quantisation (bitsandbytes' QLoRA
    default, and the kit's) in bitsandbytes' layout (not its CPU eval repacking), on CUDA (or any device under
    the interpreter)."""
    return (
        HAS_TRITON
        and quant_state.quant_type == "nf4"
        and bool(quant_state.nested)
        and not getattr(quant_state, "packing_format_for_cpu", False)
        and packed.dtype == torch.uint8
        and (packed.is_cuda or interpreter_active())
    )


def dequantize_triton(packed: torch.Tensor, quant_state, dtype: torch.dtype | None = None) -> torch.Tensor:
    """:func:`dequantize_reference` in one launch (see :func:`triton_usable` for what it takes), on the weight's
    device whichever is current. Does not wait. ``dtype``: float16, bfloat16 or float32."""
    dtype = dtype or quant_state.dtype
    n = quant_state.shape.numel()
    nbytes = (n + 1) // 2
    dev = packed.device
    # whole words of two weights: an odd n gets one spare element at the end, cut off below
    words = torch.empty(nbytes, dtype=_WORD[dtype], device=dev)
    s2 = quant_state.state2
    offset = torch.as_tensor(quant_state.offset, dtype=torch.float32, device=dev).reshape(1)
    block = max(_BLOCK, quant_state.blocksize)
    with launch_device(dev):
        _kernel()[(triton.cdiv(2 * nbytes, block),)](
            packed,
            quant_state.absmax,
            s2.code.to(dev),
            s2.absmax,
            offset,
            quant_state.code.to(dev),
            words,
            nbytes,
            QBLOCK=quant_state.blocksize,
            QBLOCK2=s2.blocksize,
            HALF=OUT_DTYPE_CODE[dtype],
            BLOCK=block,
            **LAUNCH_OPTIONS,
        )
    return words.view(dtype)[:n].view(quant_state.shape)


def dequantize_bitsandbytes(packed: torch.Tensor, quant_state) -> torch.Tensor:
    """bitsandbytes' own dequantisation (the kit's path where the kernel does not apply)."""
    import bitsandbytes.functional as BF  # lazy: bitsandbytes is optional (the 4-bit extra)

    return BF.dequantize_4bit(packed, quant_state)


@functools.cache
def kernel_matches_bitsandbytes(device: str, dtype: torch.dtype) -> bool:
    """Whether the compiled kernel gives bitsandbytes' bits on a probe weight (odd size: a partial block and a
    half-used last byte) on ``device`` for output ``dtype``; checked once, before real weights use it. Where it
    does not, the kit's matmul dequantises through bitsandbytes."""
    import bitsandbytes.functional as BF  # lazy: bitsandbytes is optional (the 4-bit extra)

    g = torch.Generator(device="cpu").manual_seed(1234)
    w = (torch.randn(333, 515, generator=g) * 0.02).to(device=device, dtype=dtype)
    packed, qs = BF.quantize_4bit(w, blocksize=64, compress_statistics=True, quant_type="nf4")
    ints = {2: torch.int16, 4: torch.int32}[w.element_size()]
    return torch.equal(dequantize_triton(packed, qs).view(ints), BF.dequantize_4bit(packed, qs).view(ints))
