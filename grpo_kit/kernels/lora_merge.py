"""The passes of the reversible LoRA merge (``grpo_kit.generation.reversible_merge``) over one weight.

W (out, in) in bf16 or fp16; the adapter folded into ``B' = [s_1 B_1 | s_2 B_2 | ...]`` (out, K) and
``A' = [A_1; A_2; ...]`` (K, in), float32, K padded with zeros to a power of two >= 16 (zeros add exactly
nothing); ``dW = B' @ A'`` in float32, formed tile by tile and never stored. Three passes:

* ``scan``: ``W' = round(W + dW)``, ``R = round(W' - dW)``; returns ``miss = bits(R) != bits(W)``
  (bool from the torch pass, int8 from the kernel; (out, in)) and a checksum of W's bits; writes nothing to W.
* ``merge``: ``W <- round(W + dW)`` in place.
* ``restore``: ``W <- round(W - dW)`` in place (W holding W'); returns the checksum of the result.

The checksum (:func:`bit_sum`) weights each element's bit pattern by ``1 + (flat index mod 32768)``, so
errors that cancel in a plain sum (+1 / -1 unit in the last place) do not here.

Two implementations with the same arithmetic: torch, over row blocks of at most ``CHUNK_ELEMENTS``
(any device; the CPU's path), and Triton (CUDA), one kernel for the three passes with one fixed tile
and ``MODE`` a runtime argument, so that the scan, the merge and the restore run one compiled binary
and form dW with the same instructions in the same order. (Compiled once per pass, with ``MODE`` a
constexpr, they did not on the H200: the merge-only binary folded W into the dot's accumulator, and
every restore checksum failed.) :func:`kernel_round_trips`
checks that binary on a probe weight before it touches real ones. The merge's exactness needs only
that: whichever implementation runs, it runs for all passes of a weight. Under ``TRITON_INTERPRET=1``
(set before Triton is imported) the kernel runs in Triton's CPU interpreter, which is how CI checks it.

On the GPU the kernel and the torch passes take about the same time per weight: a whole merge's cost is in
the per-weight waits and small ops around the passes, so ``grpo_kit.generation.reversible_merge`` waits once
per weight at merge and twice for a whole restore.
"""

from __future__ import annotations

import functools

import torch

from grpo_kit.kernels._triton import HAS_TRITON, interpreter_active, tl, triton  # noqa: F401

CHUNK_ELEMENTS = 1 << 23  # torch passes: elements per row block (float32 temporaries of 32 MiB each)
SCAN, MERGE, RESTORE = 0, 1, 2
_WEIGHT_PERIOD = 32768  # checksum position weights 1..32768: 16-bit patterns times them fit int32
_SUM_CHUNK = 1 << 23  # checksum: elements per chunk, a multiple of _WEIGHT_PERIOD
assert _SUM_CHUNK % _WEIGHT_PERIOD == 0  # bit_sum restarts its position-weight table at every chunk
_INT_VIEW = {torch.bfloat16: torch.int16, torch.float16: torch.int16}
_SAME_SIZE_INT = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_TILE = (64, 128, 4)  # Triton (BLOCK_M, BLOCK_N, num_warps) on the GPU: fixed, the same for every pass
_INTERP_TILE = (16, 32, 4)  # in the interpreter: small, so the masked edge tiles are exercised


# ----------------------------------------------------------------------------------------------
# shared pieces
# ----------------------------------------------------------------------------------------------
@functools.lru_cache(maxsize=8)
def _position_weights(device: str) -> torch.Tensor:
    """``1 + (i mod 32768)`` for i < _SUM_CHUNK (int32): every chunk starts at a multiple of 32768, so each
    chunk's weights are this table's first n entries."""
    return (torch.arange(_SUM_CHUNK, dtype=torch.int32, device=device) & (_WEIGHT_PERIOD - 1)) + 1


def bit_sum(t: torch.Tensor) -> torch.Tensor:
    """The checksum of ``t``'s bit patterns (any dtype, read as integers of its size), each weighted by
    ``1 + (flat index mod 32768)``, summed in int64 (a 0-dim tensor on ``t``'s device, so that callers can
    compare many before waiting for any): equal for equal bits; one changed element, or two that change by
    opposite amounts, change it. Sums of 4- and 8-byte patterns wrap, identically for equal bits."""
    flat = t.detach().reshape(-1).view(_SAME_SIZE_INT[t.element_size()])
    wide = torch.int32 if t.element_size() <= 2 else torch.int64  # 16-bit patterns x 32768 fit int32
    table = _position_weights(str(flat.device))
    total = torch.zeros((), dtype=torch.int64, device=flat.device)
    for s in range(0, flat.numel(), _SUM_CHUNK):
        x = flat[s : s + _SUM_CHUNK]
        total += (x.to(wide) * table[: x.numel()]).sum(dtype=torch.int64)
    return total


def fold_factors(factors, device, dtype=torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """``[(A (r, in), B (out, r), scale)]`` -> ``(B' (out, K), A' (K, in))`` in ``dtype``: the scales folded
    into B', the adapters side by side, K padded with zeros to a power of two >= 16 (``tl.arange`` needs a
    power of two, ``tl.dot`` at least 16)."""
    b = torch.cat([bb.detach().to(device, dtype) * float(s) for _, bb, s in factors], dim=1)
    a = torch.cat([aa.detach().to(device, dtype) for aa, _, _ in factors], dim=0)
    pad = max(16, 1 << (b.shape[1] - 1).bit_length()) - b.shape[1]
    if pad:
        b = torch.cat([b, b.new_zeros(b.shape[0], pad)], dim=1)
        a = torch.cat([a, a.new_zeros(pad, a.shape[1])], dim=0)
    return b.contiguous(), a.contiguous()


# ----------------------------------------------------------------------------------------------
# torch passes (row blocks)
# ----------------------------------------------------------------------------------------------
def _wide(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float32 else torch.float32


def row_blocks(weight: torch.Tensor, start: int = 0, end: int | None = None):
    """``(r0, r1)`` of the row blocks of at most ``CHUNK_ELEMENTS`` elements covering rows ``start:end``."""
    step = max(1, CHUNK_ELEMENTS // max(1, weight.shape[1]))
    end = weight.shape[0] if end is None else end
    for r0 in range(start, end, step):
        yield r0, min(r0 + step, end)


def scan_torch(weight, b, a):
    """(miss (out, in) bool, checksum of W (0-dim int64)). ``b``, ``a``: :func:`fold_factors` in the weight's
    wide dtype."""
    ints = _SAME_SIZE_INT[weight.element_size()]
    miss = torch.empty(weight.shape, dtype=torch.bool, device=weight.device)
    for r0, r1 in row_blocks(weight):
        w = weight[r0:r1]
        d = b[r0:r1] @ a
        merged = (w.to(d.dtype) + d).to(weight.dtype)
        back = (merged.to(d.dtype) - d).to(weight.dtype)
        miss[r0:r1] = back.view(ints) != w.view(ints)
    return miss, bit_sum(weight)


def _add_rows_torch(weight, b, a, start: int, end: int, subtract: bool):
    for r0, r1 in row_blocks(weight, start, end):
        w = weight[r0:r1]
        d = b[r0:r1] @ a
        w.copy_(((w.to(d.dtype) - d) if subtract else (w.to(d.dtype) + d)).to(weight.dtype))
        yield r1


def merge_rows_torch(weight, b, a, start: int, end: int):
    """``W <- round(W + dW)`` for rows ``start:end``, block by block; yields each finished block's end row."""
    return _add_rows_torch(weight, b, a, start, end, subtract=False)


def restore_rows_torch(weight, b, a, start: int, end: int):
    """``W <- round(W - dW)`` for rows ``start:end``, block by block; yields each finished block's end row."""
    return _add_rows_torch(weight, b, a, start, end, subtract=True)


# ----------------------------------------------------------------------------------------------
# Triton: one kernel, three passes
# ----------------------------------------------------------------------------------------------
def _merge_kernel(
    W, B, A, MISS, SUMS, M, N, MODE, K: tl.constexpr, PERIOD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr
):
    # MODE is a runtime value and every pass runs the same instructions: one compiled binary forms W + dW and
    # W' - dW alike for the scan, the merge and the restore. With MODE a constexpr each pass was its own
    # compilation, and on the H200 every restore checksum failed: where the dot's result has one use, as in
    # the merge-only binary, Triton folds dot(b, a) + w into dot(b, a, acc=w), a different rounding of W + dW
    # from the scan's (seen in that binary's TTIR, compiled for sm_90 on the CPU). Here d has three uses, and
    # MODE must not be specialised (Triton specialises an integer argument equal to 1, i.e. MERGE, as a
    # constant). tests/test_lora_merge_kernel.py checks the compiled dot starts from zero; kernel_round_trips
    # checks the binary before real weights.
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rmask = rows < M
    cmask = cols < N
    inside = rmask[:, None] & cmask[None, :]
    ks = tl.arange(0, K)
    b = tl.load(B + rows[:, None].to(tl.int64) * K + ks[None, :], mask=rmask[:, None], other=0.0)
    a = tl.load(A + ks[:, None].to(tl.int64) * N + cols[None, :], mask=cmask[None, :], other=0.0)
    d = tl.dot(b, a, input_precision="ieee")  # full float32
    offs = rows[:, None].to(tl.int64) * N + cols[None, :]
    w = tl.load(W + offs, mask=inside, other=0.0)
    added = (w.to(tl.float32) + d).to(w.dtype, fp_downcast_rounding="rtne")  # scan, merge: W' = round(W + dW)
    taken = (w.to(tl.float32) - d).to(w.dtype, fp_downcast_rounding="rtne")  # restore: round(W' - dW)
    back = (added.to(tl.float32) - d).to(w.dtype, fp_downcast_rounding="rtne")  # scan: R
    w_bits = w.to(tl.int16, bitcast=True)
    miss = back.to(tl.int16, bitcast=True) != w_bits
    tl.store(MISS + offs, miss.to(tl.int8), mask=inside & (MODE == 0))
    tl.store(W + offs, tl.where(MODE == 1, added, taken), mask=inside & (MODE != 0))
    bits = tl.where(MODE == 0, w_bits, taken.to(tl.int16, bitcast=True)).to(tl.int32)
    weights = (offs % PERIOD).to(tl.int32) + 1  # bit_sum's position weights
    part = tl.sum(tl.sum(tl.where(inside, bits * weights, 0).to(tl.int64), axis=1), axis=0)
    tl.store(SUMS + pid_m * tl.num_programs(1) + pid_n, part, mask=MODE != 1)


@functools.cache
def _kernel():
    # no specialisation on the values or alignments that differ between passes or weights: one binary per
    # (dtype, K), which is what kernel_round_trips checks
    return triton.jit(
        _merge_kernel,
        do_not_specialize=["M", "N", "MODE"],
        do_not_specialize_on_alignment=["W", "B", "A", "MISS", "SUMS"],
    )


def triton_usable(weight: torch.Tensor) -> bool:
    """The kernel takes this weight: Triton installed, a 16-bit contiguous 2-D weight on CUDA (or any device
    under the interpreter)."""
    return (
        HAS_TRITON
        and weight.dtype in _INT_VIEW
        and weight.dim() == 2
        and weight.is_contiguous()
        and (weight.is_cuda or interpreter_active())
    )


def _tile() -> tuple[int, int, int]:
    return _INTERP_TILE if interpreter_active() else _TILE


def run_triton(mode: int, weight, b, a):
    """One pass of the kernel over ``weight``; returns (miss as int8 (out, in) or None, checksum (0-dim int64 on the
    weight's device) or None). Nothing here waits for the GPU."""
    m, n = weight.shape
    bm, bn, warps = _tile()
    grid = (triton.cdiv(m, bm), triton.cdiv(n, bn))
    miss = torch.empty(weight.shape if mode == SCAN else (1,), dtype=torch.int8, device=weight.device)
    sums = torch.empty(grid[0] * grid[1] if mode != MERGE else 1, dtype=torch.int64, device=weight.device)
    _kernel()[grid](
        weight,
        b,
        a,
        miss,
        sums,
        m,
        n,
        mode,
        K=b.shape[1],
        PERIOD=_WEIGHT_PERIOD,
        BLOCK_M=bm,
        BLOCK_N=bn,
        num_warps=warps,
    )
    return (miss if mode == SCAN else None), (sums.sum() if mode != MERGE else None)


@functools.cache
def kernel_round_trips(device: str, dtype: torch.dtype, k: int) -> bool:
    """Whether the kernel's scan, merge and restore give every bit of a probe weight back on ``device`` for
    ``dtype`` and folded rank ``k``: the compiled binary the real weights will run (one per (dtype, K)) checked
    once before it touches them; where it does not round-trip the merge uses the torch passes. The probe spans
    4 x 8 tiles of the pass's tile size, the last ones masked (200 x 1000 on the GPU)."""
    bm, bn, _ = _tile()
    m, n = 3 * bm + 8, 8 * bn - 24  # edge tiles in both dims (the interpreter's tiles are small: a small probe)
    g = torch.Generator(device="cpu").manual_seed(1234)
    w = (torch.randn(m, n, generator=g) * 0.02).to(device=device, dtype=dtype)
    b = (torch.randn(m, k, generator=g) * 0.05).to(device)
    a = (torch.randn(k, n, generator=g) * 0.05).to(device)
    original = w.clone()
    miss, bits = run_triton(SCAN, w, b, a)
    keep = miss.view(-1).nonzero().squeeze(1)
    kept = w.view(-1)[keep].clone()
    run_triton(MERGE, w, b, a)
    changed = not torch.equal(w, original)
    _, restored = run_triton(RESTORE, w, b, a)
    restored_ok = bool(restored == bit_sum(w))  # the restore's checksum is R's, before the kept values go back
    w.view(-1)[keep] = kept
    ints = _INT_VIEW[dtype]
    return (
        changed and restored_ok and torch.equal(w.view(ints), original.view(ints)) and bool(bits == bit_sum(original))
    )
