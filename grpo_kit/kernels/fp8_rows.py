"""FP8 e4m3 per-row scaling: activations quantised row by row, and per-channel FP8 weights back to 16 bit.

The two element-wise halves of the FP8 matmuls of :mod:`grpo_kit.model.fp8`, each as a torch twin (the
definition, any device) and a Triton kernel (CUDA) that gives the same bits:

* :func:`quantize_rows`: x (M, K) -> codes float8_e4m3fn (M, K) and scale float32 (M, 1), with
  ``scale[m] = max_k |v[m, k]| / FP8_MAX`` (1 for a zero row) and ``codes = clamp(v / scale, +-FP8_MAX)`` rounded
  to the nearest e4m3 value, where ``v = x`` in fp32, or ``x * col_scale`` (one fp32 factor per column, rounded
  once) when ``col_scale`` (1, K) is given: the FP8 backward folds the weight's per-channel scales into the output
  gradient that way before quantising it.
* :func:`dequantize_channels`: codes float8_e4m3fn (N, K) and scale float32 (N, 1) -> ``codes * scale`` in fp32,
  rounded once to the output dtype (nearest even).

Why kernels: in eager torch the row quantiser is six launches over fp32 copies of x (cast, abs, max, divide, clamp,
cast: about 30 bytes of traffic per element of a bf16 x); the kernel reads x twice (once for the maximum, once for
the codes, the second mostly from L2) and writes one byte per element. The dequantisation is three launches with an
fp32 (N, K) in between; the kernel reads one byte and writes two. Divisions are IEEE (``div_rn``: Triton's ``/``
on fp32 is an approximation) so the kernels match the twins to the bit, NaN and infinities included (a NaN stays
NaN, so the trainer's NaN guard still sees it); ``tests/test_fp8_rows.py`` checks that in Triton's CPU interpreter,
and :func:`kernels_match` on the GPU before real tensors use them.
"""

from __future__ import annotations

import functools
import warnings

import torch

from grpo_kit.kernels._triton import HAS_TRITON, OUT_DTYPE_CODE, interpreter_active, launch_device, tl, triton

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8_DTYPE).max  # 448.0
_BLOCK_K = 1024  # row elements per step of the quantiser's loops
_DEQ_BLOCK = (32, 256)  # weights per dequantisation program: rows x columns
LAUNCH_OPTIONS: dict = {}  # Triton compile options for both launches
# Rows whose maximum is below this get scale 1: their scale amax / 448 would be an fp32 subnormal, which the GPU's
# Triton arithmetic flushes to zero (the codes of such a row round to zero either way)
MIN_AMAX = FP8_MAX * torch.finfo(torch.float32).tiny


def safe_scale(amax: torch.Tensor) -> torch.Tensor:
    """fp32 scales ``amax / FP8_MAX`` (IEEE division); 1 where ``amax`` is 0 or below ``MIN_AMAX`` (the codes are
    0 whatever the scale) or NaN (a row holding a NaN keeps it: its codes are NaN there)."""
    # divided by a tensor: by a Python number, CUDA torch multiplies by the rounded reciprocal instead (a last-bit
    # difference from the CPU and from the kernels, seen on an H100 and an H200)
    return torch.where(amax >= MIN_AMAX, amax / torch.full_like(amax, FP8_MAX), torch.ones_like(amax))


def to_fp8(t: torch.Tensor) -> torch.Tensor:
    """fp32 ``t`` to e4m3, nearest even, clamped first: the cast alone gives NaN above 448 (e4m3fn has no
    infinity)."""
    return t.clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def quantize_rows_reference(
    x: torch.Tensor, col_scale: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The row quantiser in torch (module docstring). x (M, K) any float dtype; ``col_scale`` float32 (1, K) or
    None -> ``(codes float8_e4m3fn (M, K), scale float32 (M, 1))``."""
    v = x.float() if col_scale is None else x.float() * col_scale
    scale = safe_scale(v.abs().amax(dim=1, keepdim=True))
    return to_fp8(v / scale), scale


def dequantize_channels_reference(
    codes: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """``codes`` float8_e4m3fn (N, K) times ``scale`` float32 (N, 1) in fp32, rounded once to ``dtype``."""
    w = codes.float() * scale
    return w if dtype == torch.float32 else w.to(dtype)


def _device_function(fn):
    # a helper the kernels call must itself be a Triton function; without Triton it is never called
    return triton.jit(fn) if HAS_TRITON else fn


@_device_function
def _round_e4m3(q):
    # fp32 q (|q| <= 448) to the nearest e4m3 value, ties to even, in fp32 arithmetic: what the GPU's cast does,
    # written out because Triton's CPU interpreter rounds ties up and loses the carry into the exponent
    bits = q.to(tl.int32, bitcast=True)
    normal = ((bits + 0x7FFFF + ((bits >> 20) & 1)) & -0x100000).to(tl.float32, bitcast=True)  # 3 mantissa bits
    a = tl.abs(q)
    sub = ((a * 512.0 + 12582912.0) - 12582912.0) * 0.001953125  # multiples of 2^-9 (1.5 x 2^23 rounds to them)
    sub = (sub.to(tl.int32, bitcast=True) | (bits & -0x80000000)).to(tl.float32, bitcast=True)  # q's sign, -0 too
    return tl.where(a < 0.015625, sub, normal)  # e4m3's subnormals lie below 2^-6


def _quantize_rows_kernel(X, COLS, Q, S, K, stride_x, MIN_AMAX, HAS_COLS: tl.constexpr, BLOCK_K: tl.constexpr):
    # one program per row: its maximum in a first sweep, its codes in a second
    row = tl.program_id(0).to(tl.int64)
    x_row, q_row = X + row * stride_x, Q + row * K
    amax = tl.zeros((BLOCK_K,), dtype=tl.float32)
    nan = tl.zeros((BLOCK_K,), dtype=tl.int32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        v = tl.load(x_row + k, mask=k < K, other=0.0).to(tl.float32)
        if HAS_COLS:
            v = v * tl.load(COLS + k, mask=k < K, other=0.0)
        amax = tl.maximum(amax, tl.abs(v))
        nan = nan | (v != v).to(tl.int32)  # the GPU's maximum skips NaN: counted apart, as the twin's NaN maximum
    m = tl.max(amax, axis=0)
    scale = tl.where(m >= MIN_AMAX, tl.math.div_rn(m, 448.0), 1.0)
    scale = tl.where(tl.max(nan, axis=0) > 0, 1.0, scale)
    tl.store(S + row, scale)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        v = tl.load(x_row + k, mask=k < K, other=0.0).to(tl.float32)
        if HAS_COLS:
            v = v * tl.load(COLS + k, mask=k < K, other=0.0)
        q = tl.math.div_rn(v, scale)
        r = _round_e4m3(tl.minimum(tl.maximum(q, -448.0), 448.0))  # exact below: r is an e4m3 value already
        code = r.to(tl.float8e4nv).to(tl.uint8, bitcast=True)
        # NaN stays NaN (0x7F), written as bits: the GPU's clamp would make it a number, the interpreter's cast 384
        tl.store(q_row + k, tl.where(q != q, 0x7F, code).to(tl.uint8), mask=k < K)


def _dequantize_channels_kernel(
    Q, S, OUT, N, K, stride_q, HALF: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr
):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    m = (rows[:, None] < N) & (cols[None, :] < K)
    bits = tl.load(Q + rows[:, None] * stride_q + cols[None, :], mask=m, other=0)  # the codes as uint8
    q = bits.to(tl.float8e4nv, bitcast=True).to(tl.float32)
    q = tl.where((bits & 0x7F) == 0x7F, float("nan"), q)  # NaN codes, decoded by hand (the interpreter gives 384)
    w = q * tl.load(S + rows, mask=rows < N, other=1.0)[:, None]
    if HALF == 1:
        w = w.to(tl.float16, fp_downcast_rounding="rtne")
    elif HALF == 2:  # rounded in the bits first (the interpreter's cast truncates), then cast exactly; NaN kept
        b = w.to(tl.int32, bitcast=True)
        r = ((b + 0x7FFF + ((b >> 16) & 1)) & -0x10000).to(tl.float32, bitcast=True)
        w = tl.where(w != w, w, r).to(tl.bfloat16)
    tl.store(OUT + rows[:, None] * K + cols[None, :], w, mask=m)


@functools.cache
def _kernels():
    return triton.jit(_quantize_rows_kernel), triton.jit(_dequantize_channels_kernel)


def quantize_rows_triton(x: torch.Tensor, col_scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`quantize_rows_reference` in one launch (CUDA, or any device under the interpreter). x (M, K)
    float16/bfloat16/float32 with unit column stride (copied otherwise); ``col_scale`` float32 (1, K) or None."""
    if x.stride(1) != 1:
        x = x.contiguous()
    m, k = x.shape
    codes = torch.empty(m, k, dtype=FP8_DTYPE, device=x.device)
    scale = torch.empty(m, 1, dtype=torch.float32, device=x.device)
    cols = x if col_scale is None else col_scale.reshape(k).float().contiguous()
    if m:
        with launch_device(x.device):
            _kernels()[0][(m,)](
                x,
                cols,
                codes.view(torch.uint8),
                scale,
                k,
                x.stride(0),
                MIN_AMAX,
                HAS_COLS=col_scale is not None,
                BLOCK_K=min(_BLOCK_K, triton.next_power_of_2(max(k, 16))),
                num_warps=4,
                **LAUNCH_OPTIONS,
            )
    return codes, scale


def dequantize_channels_triton(
    codes: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """:func:`dequantize_channels_reference` in one launch (CUDA, or any device under the interpreter). ``codes``
    (N, K) with unit column stride, ``scale`` float32 (N, 1); ``dtype`` float16, bfloat16 or float32."""
    if codes.stride(1) != 1:
        codes = codes.contiguous()
    n, k = codes.shape
    out = torch.empty(n, k, dtype=dtype, device=codes.device)
    bn, bk = _DEQ_BLOCK
    if out.numel():
        with launch_device(codes.device):
            _kernels()[1][(triton.cdiv(n, bn), triton.cdiv(k, bk))](
                codes.view(torch.uint8),
                scale.reshape(n).contiguous(),
                out,
                n,
                k,
                codes.stride(0),
                HALF=OUT_DTYPE_CODE[dtype],
                BLOCK_N=bn,
                BLOCK_K=bk,
                num_warps=4,
                **LAUNCH_OPTIONS,
            )
    return out


@functools.cache
def kernels_match(device: str) -> bool:
    """Whether both compiled kernels give their twins' bits on ``device`` (odd shapes, a zero row, values past
    e4m3's range, every output dtype); checked once, before real tensors use them."""
    g = torch.Generator(device="cpu").manual_seed(7)
    x = torch.randn(37, 1500, generator=g) * torch.logspace(-6, 4, 37)[:, None]
    x[3] = 0
    x[5, 7], x[6, 9], x[7, 11] = float("nan"), float("inf"), -float("inf")  # kept as the twin keeps them
    x[8] *= 1e-37  # a maximum below MIN_AMAX
    cols = torch.rand(1, 1500, generator=g) * 3
    codes, scale = quantize_rows_reference(torch.randn(45, 333, generator=g) * 100)
    codes[2, 3] = float("nan")
    try:
        ok = True
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            xd = x.to(dtype).to(device)
            for c in (None, cols.to(device)):
                got, want = quantize_rows_triton(xd, c), quantize_rows_reference(xd, c)
                ok &= same_bits(got[0], want[0]) and same_bits(got[1], want[1])
            cd, sd = codes.to(device), scale.to(device)
            ok &= same_bits(dequantize_channels_triton(cd, sd, dtype), dequantize_channels_reference(cd, sd, dtype))
    except Exception as e:  # e.g. a GPU without FP8 (Triton compiles e4m3 from compute capability 8.9 on)
        warnings.warn(
            f"the FP8 row kernels could not run on {device} ({type(e).__name__}); their torch twins serve there",
            stacklevel=3,
        )
        return False
    return bool(ok)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """``a`` and ``b`` hold the same values to the bit, NaN where the other has NaN (whatever its sign and payload:
    the GPU and the CPU write different NaNs)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    nan_a, nan_b = a.float().isnan(), b.float().isnan()
    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32}[a.element_size()]
    return torch.equal(nan_a, nan_b) and torch.equal(a.view(ints)[~nan_a], b.view(ints)[~nan_b])


def use_triton(t: torch.Tensor) -> bool:
    """The kernels serve ``t``: Triton installed, on CUDA (or any device under the interpreter), and the
    compiled kernels equal their twins there (:func:`kernels_match`)."""
    return HAS_TRITON and (t.is_cuda or interpreter_active()) and kernels_match(str(t.device))


def quantize_rows(x: torch.Tensor, col_scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The row quantiser (module docstring): the kernel where :func:`use_triton`, else the twin."""
    fn = quantize_rows_triton if use_triton(x) else quantize_rows_reference
    return fn(x, col_scale)


def dequantize_channels(codes: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Per-channel FP8 weights back to ``dtype``: the kernel where :func:`use_triton`, else the twin."""
    fn = dequantize_channels_triton if dtype in OUT_DTYPE_CODE and use_triton(codes) else dequantize_channels_reference
    return fn(codes, scale, dtype)
