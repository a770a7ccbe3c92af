"""Per-chunk epilogue of the efficient GRPO loss: two row-wise passes over a logits chunk.

The loss (``grpo_kit.loss.efficient``) computes one chunk of logits ``z = h_c @ W^T`` at a time,
shape (n, V) in the matmul dtype (bf16/fp16/fp32), and hands it here twice:

1. ``lse_logp(z, ids, inv_temp)``: per row, in fp32, ``lse = logsumexp(z * inv_temp)``,
   ``logp = z[ids] * inv_temp - lse`` and optionally the entropy of ``softmax(z * inv_temp)``.
   Reads the chunk once, writes three (n,) fp32 vectors.
2. ``softmax_grad_(z, ids, lse, coef, inv_temp)``: overwrites the chunk in place with
   ``coef[:, None] * inv_temp * (softmax(z * inv_temp) - onehot(ids))``, i.e. the gradient of
   ``sum_rows(-coef * logp)`` w.r.t. the raw logits. Reads and writes the chunk once.

Each pass has two implementations with the same numbers: a readable torch one (CPU, and the
reference in tests) and a Triton one (CUDA). ``backend="auto"`` picks Triton on CUDA tensors
when Triton imports, else torch. With ``TRITON_INTERPRET=1`` set before Triton is imported, the
Triton kernels run in Triton's CPU interpreter, so CI checks the very kernel code the GPU runs.
"""

from __future__ import annotations

import functools

import torch

from grpo_kit.kernels._triton import HAS_TRITON, interpreter_active, tl, triton  # noqa: F401

BACKENDS = ("auto", "torch", "triton")


# ----------------------------------------------------------------------------------------------
# torch reference path
# ----------------------------------------------------------------------------------------------
def lse_logp_torch(z: torch.Tensor, ids: torch.Tensor, inv_temp: float, compute_entropy: bool = False):
    """Row logsumexp, target log-prob and (optionally) entropy of ``softmax(z * inv_temp)``.

    z: (n, V) any float dtype; ids: (n,) int64 in [0, V). Returns (logp, lse, entropy-or-None),
    each (n,) fp32.
    """
    s = z.float() * inv_temp  # fp32 whatever the matmul dtype: log-softmax needs the range
    lse = torch.logsumexp(s, dim=-1)
    logp = s.gather(1, ids.view(-1, 1)).squeeze(1) - lse
    entropy = None
    if compute_entropy:
        p = torch.exp(s - lse[:, None])
        entropy = lse - (p * s).sum(-1)
    return logp, lse, entropy


def softmax_grad_torch_(z: torch.Tensor, ids: torch.Tensor, lse: torch.Tensor, coef: torch.Tensor, inv_temp: float):
    """In place: ``z <- coef * inv_temp * (softmax(z * inv_temp) - onehot(ids))``.

    z: (n, V), overwritten in its own dtype; ids: (n,) int64; lse, coef: (n,) fp32.
    Returns z.
    """
    g = torch.exp(z.float() * inv_temp - lse[:, None])
    g.scatter_add_(1, ids.view(-1, 1), torch.full_like(lse, -1.0).view(-1, 1))
    g.mul_((coef * inv_temp)[:, None])
    z.copy_(g)
    return z


# ----------------------------------------------------------------------------------------------
# Triton path (one program per row, looping over the vocabulary in BLOCK-wide tiles)
# ----------------------------------------------------------------------------------------------
def _lse_logp_kernel(
    Z, stride_z, IDS, LOGP, LSE, ENT, inv_temp, n_cols: tl.constexpr, COMPUTE_ENT: tl.constexpr, BLOCK: tl.constexpr
):
    row = tl.program_id(0).to(tl.int64)
    z_row = Z + row * stride_z
    offs = tl.arange(0, BLOCK)
    m = tl.full([], float("-inf"), tl.float32)  # running max
    d = tl.full([], 0.0, tl.float32)  # running sum of exp(s - m)
    t = tl.full([], 0.0, tl.float32)  # running sum of exp(s - m) * s (entropy only)
    for start in range(0, n_cols, BLOCK):
        cols = start + offs
        inb = cols < n_cols
        s = tl.load(z_row + cols, mask=inb, other=float("-inf")).to(tl.float32) * inv_temp
        m_new = tl.maximum(m, tl.max(s, axis=0))
        alpha = tl.exp(m - m_new)
        e = tl.exp(s - m_new)
        d = d * alpha + tl.sum(e, axis=0)
        if COMPUTE_ENT:
            t = t * alpha + tl.sum(e * tl.where(inb, s, 0.0), axis=0)  # e is 0 off the row
        m = m_new
    lse = m + tl.log(d)
    y = tl.load(IDS + row)
    s_y = tl.load(z_row + y).to(tl.float32) * inv_temp
    tl.store(LOGP + row, s_y - lse)
    tl.store(LSE + row, lse)
    if COMPUTE_ENT:
        tl.store(ENT + row, lse - t / d)


def _softmax_grad_kernel(Z, stride_z, IDS, LSE, COEF, inv_temp, n_cols: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    z_row = Z + row * stride_z
    offs = tl.arange(0, BLOCK)
    c = tl.load(COEF + row) * inv_temp
    lse = tl.load(LSE + row)
    y = tl.load(IDS + row)
    for start in range(0, n_cols, BLOCK):
        cols = start + offs
        inb = cols < n_cols
        s = tl.load(z_row + cols, mask=inb, other=0.0).to(tl.float32) * inv_temp
        g = tl.exp(s - lse) - tl.where(cols == y, 1.0, 0.0)
        tl.store(z_row + cols, (c * g).to(Z.dtype.element_ty), mask=inb)


# (BLOCK, num_warps) tried by the autotuner on the GPU, once per vocabulary size. Wider tiles put
# more bytes in flight per row; the best one depends on V and on the chip.
_TUNE_CONFIGS = ((4096, 8), (8192, 8), (8192, 16), (16384, 16), (16384, 32), (32768, 32))


def _prune(configs, named_args, **kwargs):
    n_cols = named_args.get("n_cols", kwargs.get("n_cols"))
    cap = triton.next_power_of_2(int(n_cols)) if n_cols else 1 << 30
    kept = [c for c in configs if c.kwargs["BLOCK"] <= cap]
    return kept or [min(configs, key=lambda c: c.kwargs["BLOCK"])]


@functools.cache
def _kernels():
    """The two kernels, jit-wrapped on first use; returns (lse_kernel, grad_kernel, autotuned).

    On the GPU they are autotuned over ``_TUNE_CONFIGS`` keyed by V (the in-place kernel restores
    its chunk between trials, which costs one chunk-sized copy during the first call only).
    Under TRITON_INTERPRET=1 (which must be set before Triton is imported, since its standard
    library is wrapped at import) ``triton.jit`` gives interpreted functions that run on CPU
    tensors with a fixed small tile: that is how CI checks this code.
    """
    if not HAS_TRITON:
        raise RuntimeError("Triton is not installed; use the torch epilogue")
    lse_k, grad_k = triton.jit(_lse_logp_kernel), triton.jit(_softmax_grad_kernel)
    if interpreter_active():
        return lse_k, grad_k, False
    configs = [triton.Config({"BLOCK": b}, num_warps=w) for b, w in _TUNE_CONFIGS]
    prune = {"early_config_prune": _prune}
    lse_k = triton.autotune(configs, key=["n_cols", "COMPUTE_ENT"], prune_configs_by=prune)(lse_k)
    grad_k = triton.autotune(configs, key=["n_cols"], prune_configs_by=prune, restore_value=["Z"])(grad_k)
    return lse_k, grad_k, True


def _check_device(z):
    if z.device.type != "cuda" and not interpreter_active():
        raise ValueError(
            f"the Triton epilogue needs CUDA tensors (got {z.device}) or TRITON_INTERPRET=1 set before Triton is imported"
        )


def _interp_config(n_cols: int):
    """Fixed tile for the interpreter (small, so that masking of the last tile is exercised)."""
    return {"BLOCK": min(128, triton.next_power_of_2(n_cols)), "num_warps": 4}


def lse_logp_triton(z, ids, inv_temp, compute_entropy=False):
    """Triton twin of :func:`lse_logp_torch` (same arguments and results)."""
    n, v = z.shape
    logp = torch.empty(n, dtype=torch.float32, device=z.device)
    lse = torch.empty_like(logp)
    ent = torch.empty_like(logp) if compute_entropy else logp  # dummy pointer when unused
    if n:
        _check_device(z)
        k, _, tuned = _kernels()
        extra = {} if tuned else _interp_config(v)
        k[(n,)](z, z.stride(0), ids, logp, lse, ent, float(inv_temp), v, COMPUTE_ENT=bool(compute_entropy), **extra)
    return logp, lse, (ent if compute_entropy else None)


def softmax_grad_triton_(z, ids, lse, coef, inv_temp):
    """Triton twin of :func:`softmax_grad_torch_` (same arguments, z overwritten in place)."""
    n, v = z.shape
    if n:
        _check_device(z)
        _, k, tuned = _kernels()
        extra = {} if tuned else _interp_config(v)
        k[(n,)](z, z.stride(0), ids, lse, coef, float(inv_temp), v, **extra)
    return z


# ----------------------------------------------------------------------------------------------
# dispatch
# ----------------------------------------------------------------------------------------------
def resolve_backend(backend: str, device: torch.device) -> str:
    """'auto' -> 'triton' on CUDA with Triton installed, else 'torch'."""
    if backend not in BACKENDS:
        raise ValueError(f"epilogue backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "auto":
        return "triton" if (HAS_TRITON and device.type == "cuda") else "torch"
    if backend == "triton" and not HAS_TRITON:
        raise ValueError("epilogue backend 'triton' asked for, but Triton is not installed")
    return backend


def _check_chunk(z, ids):
    if z.dim() != 2 or z.stride(1) != 1:
        raise ValueError(f"logits chunk must be 2-D with unit column stride, got shape {tuple(z.shape)}")
    if ids.shape != (z.shape[0],) or ids.dtype != torch.int64:
        raise ValueError(f"ids must be int64 of shape ({z.shape[0]},), got {ids.dtype} {tuple(ids.shape)}")


def lse_logp(z, ids, inv_temp, compute_entropy=False, backend="torch"):
    """Dispatch :func:`lse_logp_torch` / :func:`lse_logp_triton` (backend already resolved)."""
    _check_chunk(z, ids)
    if backend == "triton":
        return lse_logp_triton(z, ids, inv_temp, compute_entropy)
    return lse_logp_torch(z, ids, inv_temp, compute_entropy)


def softmax_grad_(z, ids, lse, coef, inv_temp, backend="torch"):
    """Dispatch :func:`softmax_grad_torch_` / :func:`softmax_grad_triton_` (backend already resolved)."""
    _check_chunk(z, ids)
    if backend == "triton":
        return softmax_grad_triton_(z, ids, lse, coef, inv_temp)
    return softmax_grad_torch_(z, ids, lse, coef, inv_temp)
