"""The matmul of a 4-bit (NF4) linear layer, with each weight dequantised once per decoder-layer call.

bitsandbytes' ``Linear4bit`` dequantises its weight for every matmul, forward and backward, in five host calls
and three kernels. Under the kit's offloaded checkpointing (:mod:`grpo_kit.checkpointing`) a decoder layer
calls each of its linears many times per micro-batch, per token slice S of the layer's work:

    reference pass (no grad)                   1
    policy forward (no grad)                   1
    backward: q, k, v without grad (attention core), then with grad and their backward      3
              o, gate, up, down with grad and their backward                                 2

that is 31 dequantisations of a Llama layer's 7 weights per slice (31 x S per micro-batch; S = 1 at 1,536
tokens, 6 at 20,992). Here :func:`layer_weight_cache` keeps each dequantised weight for the rest of one layer
call (a forward, or a recompute with its backward), so a layer dequantises 21 weights per micro-batch at any
length: 7 in each of the three calls. The price is one layer's weights in 16 bit while the layer runs (436 MiB
for Llama-3.1-8B in fp16), which ``grpo_kit.memory.estimate`` counts. Each dequantisation is one Triton launch
(:mod:`grpo_kit.kernels.nf4_dequant`, bit-equal to bitsandbytes'; its path where the kernel does not apply).

Outside a layer call and without gradient (generation, plain inference) the layer runs bitsandbytes' own
forward, which multiplies the few rows of a decoding step with the 4-bit weight directly (gemv, or its fused
small-batch kernels). The weight is never saved for backward: the backward takes it from the cache, or dequantises it again (outside
the kit's checkpointing, as bitsandbytes does), so autograd never holds a model's worth of 16-bit weights.
The arithmetic is bitsandbytes': ``y = x W^T (+ b)`` and ``dx = dy W`` with W in the compute dtype.
``use_nf4_matmul(model, "bitsandbytes")`` puts bitsandbytes' own forward back (the benchmark compares both).
"""

from __future__ import annotations

import contextlib
import types
import warnings

import torch
import torch.nn.functional as F

from .kernels import nf4_dequant as K
from .names import NF4_MATMULS
from .quantize import is_quantized

__all__ = ["NF4_MATMULS", "layer_weight_cache", "dequantized", "use_nf4_matmul", "reset_stats"]
_cache: dict | None = None  # module -> its dequantised weight, inside layer_weight_cache
_depth = 0
_stats = {"dequantized": 0}  # calls to _dequantize since the last reset_stats (tests and benchmarks read it)
_warned: set = set()  # (device, dtype) where the kernel's probe failed, said once


@contextlib.contextmanager
def layer_weight_cache():
    """Within it, each 4-bit layer's weight is dequantised at most once (the first use) and kept; the weights
    are released when the outermost such block ends. Costs nothing when the model has no 4-bit layers."""
    global _cache, _depth
    if _depth == 0:
        _cache = {}
    _depth += 1
    try:
        yield
    finally:
        _depth -= 1
        if _depth == 0:
            _cache = None


def dequantized(module: torch.nn.Module) -> torch.Tensor:
    """``module``'s weight (out, in) in its compute dtype: from the layer cache when one is open."""
    if _cache is None:
        return _dequantize(module)
    w = _cache.get(module)
    if w is None:
        w = _cache[module] = _dequantize(module)
    return w


def _dequantize(module) -> torch.Tensor:
    _stats["dequantized"] += 1
    p = module.weight
    qs = p.quant_state
    if K.triton_usable(p.data, qs) and _kernel_ok(p.device, qs.dtype):
        w = K.dequantize_triton(p.data, qs)
    else:
        w = K.dequantize_bitsandbytes(p.data, qs)
    dtype = module.compute_dtype or qs.dtype
    return w if w.dtype == dtype else w.to(dtype)


def _kernel_ok(device: torch.device, dtype: torch.dtype) -> bool:
    ok = K.kernel_matches_bitsandbytes(str(device), dtype)
    if not ok and (str(device), dtype) not in _warned:
        _warned.add((str(device), dtype))
        warnings.warn(f"the NF4 dequantisation kernel did not reproduce bitsandbytes' bits on {device} for {dtype}; "
                      "dequantising through bitsandbytes instead (slower, same results)", stacklevel=3)
    return ok


class _NF4Matmul(torch.autograd.Function):
    """``x W^T`` for a 4-bit layer; saves no weight (backward dequantises again or takes it from the cache).
    x (..., in) in the compute dtype -> (..., out)."""

    @staticmethod
    def forward(ctx, x, module):
        ctx.module = module
        return F.linear(x, dequantized(module))

    @staticmethod
    def backward(ctx, gy):
        module, ctx.module = ctx.module, None
        return gy @ dequantized(module), None


def _forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    """Replacement ``forward`` of a bitsandbytes ``Linear4bit`` (its dtype handling, the kit's matmul)."""
    needs_grad = torch.is_grad_enabled() and x.requires_grad
    if _cache is None and not needs_grad:
        # generation, or inference outside the kit's checkpointed layer calls: nothing to reuse, and for the
        # few rows of a decoding step bitsandbytes multiplies the 4-bit weight directly (gemv / its fused
        # small-batch kernels) instead of writing out the 16-bit weight first
        return type(self).forward(self, x, *args, **kwargs)
    if getattr(self.weight, "quant_state", None) is None:
        raise RuntimeError(f"{type(self).__name__} has no quantisation state: its weight was never quantised "
                           "(move the model to a device bitsandbytes supports first)")
    inp_dtype = x.dtype
    dtype = self.compute_dtype or self.weight.quant_state.dtype
    x = x.to(dtype)
    bias = None if self.bias is None else self.bias.to(dtype)
    if needs_grad:
        y = _NF4Matmul.apply(x, self)
        if bias is not None:
            y = y + bias
    else:
        y = F.linear(x, dequantized(self), bias)
    return y.to(inp_dtype)


def use_nf4_matmul(model: torch.nn.Module, impl: str) -> int:
    """Make every bitsandbytes ``Linear4bit`` in ``model`` multiply with ``impl`` (``NF4_MATMULS``: ``kit``, this
    module's; ``bitsandbytes``, its own forward back). Returns how many layers were set."""
    if impl not in NF4_MATMULS:
        raise ValueError(f"nf4 matmul {impl!r} is not allowed: one of {', '.join(NF4_MATMULS)}")
    n = 0
    for m in model.modules():
        if is_quantized(m):
            if impl == "kit":
                m.forward = types.MethodType(_forward, m)
            else:
                m.__dict__.pop("forward", None)
            n += 1
    return n


def reset_stats() -> dict:
    """The dequantisation count since the last call (then zero)."""
    out = dict(_stats)
    _stats["dequantized"] = 0
    return out
