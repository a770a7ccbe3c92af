"""The matmul of a 4-bit (NF4) linear layer, with each weight dequantised once per decoder-layer call.

bitsandbytes' ``Linear4bit`` dequantises its weight for every matmul, forward and backward, in five host calls
and three kernels. Under the kit's offloaded checkpointing (:mod:`grpo_kit.model.offload`) a decoder layer
calls each of its linears many times per micro-batch, per token slice S of the layer's work:

    reference pass (no grad)                   1
    policy forward (no grad)                   1
    backward: q, k, v without grad (attention core), then with grad and their backward      3
              o, gate, up, down with grad and their backward                                 2

that is 31 dequantisations of a Llama layer's 7 weights per slice (31 x S per micro-batch; S = 1 at 1,536
tokens, 6 at 20,992). Here :func:`layer_weight_cache` keeps each dequantised weight for the rest of one layer
call (a forward, or a recompute with its backward), so a layer dequantises 21 weights per micro-batch at any
length: 7 in each of the three calls. The price is one layer's weights in 16 bit while the layer runs (436 MB
for Llama-3.1-8B in fp16), which ``grpo_kit.memory.estimate`` counts. Each dequantisation is one Triton launch
(:mod:`grpo_kit.kernels.nf4_dequant`, bit-equal to bitsandbytes'; its path where the kernel does not apply).

Outside a layer call and without gradient (generation, plain inference) the layer runs bitsandbytes' own forward,
which multiplies the few rows of a decoding step with the 4-bit weight directly (gemv, or its fused small-batch
kernels). Inside a layer call the matmul is a plain ``F.linear`` on the cached weight: autograd saves that same
tensor, which the cache holds until the call ends anyway, and the call's backward runs before it ends. (Under an
autocast dtype other than the layer's compute dtype autograd would save a cast copy per call instead; the kit's
runs autocast in the model's own dtype.) Outside one (no kit checkpointing) the weight is never saved for backward:
an autograd Function dequantises it again there, as bitsandbytes does, so autograd never holds a model's worth of
16-bit weights. The arithmetic is bitsandbytes' dequantise-then-multiply path's: W dequantised straight into the
compute dtype, ``y = F.linear(x, W, b)``, ``dx = dy W``. (bitsandbytes' own forward takes its fused 4-bit kernel
instead for inputs of up to 1,536 rows on some GPUs, which rounds differently.)
:func:`use_nf4_matmul` gives a model's 4-bit layers this matmul by replacing each in its parent with a module of
the class ``Kit<its class>`` that holds the same parameters and quant state (no object changes class);
``use_nf4_matmul(model, "bitsandbytes")`` puts bitsandbytes' own class back (the benchmark compares both).
"""

from __future__ import annotations

import contextlib
import functools
import threading
import warnings

import torch
import torch.nn.functional as F

from grpo_kit.kernels import nf4_dequant as K
from grpo_kit.model.quantize import is_quantized

NF4_MATMULS = ("kit", "bitsandbytes")  # how a 4-bit layer multiplies (the config's load_in_4bit_matmul)

__all__ = ["NF4_MATMULS", "layer_weight_cache", "dequantized", "use_nf4_matmul", "with_nf4_matmul", "reset_stats"]
# Per thread: the reentrant backward of a layer (grpo_kit.model.offload) runs its recompute and its backward on
# the thread that opened the cache; another thread would miss it and dequantise afresh, never share it.
_local = threading.local()
_stats = {"dequantized": 0}  # calls to _dequantize since the last reset_stats (tests and benchmarks read it)
_warned: set = set()  # (device, dtype) where the kernel's probe failed: said once, not probed again


def _open_cache() -> dict | None:
    return getattr(_local, "cache", None)


@contextlib.contextmanager
def layer_weight_cache():
    """Within it, each 4-bit layer's weight is dequantised at most once (the first use) and kept; the weights
    are released when the outermost such block of this thread ends. A graph built within it saves the cached
    weights, so run its backward within it too (as the kit's checkpointing does), or they live until then.
    Costs nothing without 4-bit layers."""
    outer = _open_cache() is None
    if outer:
        _local.cache = {}
    try:
        yield
    finally:
        if outer:
            _local.cache = None


def dequantized(module: torch.nn.Module, dtype: torch.dtype) -> torch.Tensor:
    """``module``'s weight (out, in) in ``dtype`` (its compute dtype): from the layer cache when one is open."""
    cache = _open_cache()
    if cache is None:
        return _dequantize(module, dtype)
    w = cache.get(module)
    if w is None or w.dtype != dtype:
        w = cache[module] = _dequantize(module, dtype)
    return w


def _dequantize(module, dtype: torch.dtype) -> torch.Tensor:
    """In the weight's own dtype (``quant_state.dtype``; the compute dtype in the kit's loads), then cast to
    ``dtype`` where they differ: the kernel and bitsandbytes' dequantisation give the same bits either way."""
    _stats["dequantized"] += 1
    p = module.weight
    qs = p.quant_state
    if K.triton_usable(p.data, qs) and _kernel_ok(p.device, qs.dtype):
        w = K.dequantize_triton(p.data, qs)
    else:
        w = K.dequantize_bitsandbytes(p.data, qs)
    return w if w.dtype == dtype else w.to(dtype)


def _kernel_ok(device: torch.device, dtype: torch.dtype) -> bool:
    key = (str(device), dtype)
    if key in _warned:
        return False
    try:
        ok, why = K.kernel_matches_bitsandbytes(*key), "did not reproduce bitsandbytes' bits"
    except Exception as e:  # noqa: BLE001 - e.g. no Triton backend for this GPU: bitsandbytes' path still works
        ok, why = False, f"could not run ({type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''})"
    if not ok:
        _warned.add(key)
        warnings.warn(
            f"the NF4 dequantisation kernel {why} on {device} for {dtype}; dequantising through "
            "bitsandbytes instead (slower, same results)",
            stacklevel=3,
        )
    return ok


class _NF4Matmul(torch.autograd.Function):
    """``x W^T + b`` for a 4-bit layer outside a layer call, bitsandbytes' arithmetic (``F.linear(x, W, b)``,
    ``dx = dy W``); saves no weight: backward dequantises it again (or takes it from a layer cache open by
    then). x (..., in) in the compute dtype, bias (out,) or None -> (..., out)."""

    @staticmethod
    def forward(ctx, x, bias, module):
        ctx.module, ctx.dtype = module, x.dtype
        ctx.bias_dtype = None if bias is None else bias.dtype
        return F.linear(x, dequantized(module, x.dtype), bias)

    @staticmethod
    def backward(ctx, gy):
        gx = gb = None
        if ctx.needs_input_grad[0]:  # under autocast gy may come back in another dtype (bitsandbytes casts too)
            gx = gy @ dequantized(ctx.module, ctx.dtype).to(gy.dtype)
        if ctx.needs_input_grad[1]:
            gb = gy.reshape(-1, gy.shape[-1]).sum(0, dtype=ctx.bias_dtype)
        return gx, gb, None


def _forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    """``KitLinear4bit.forward``: bitsandbytes' ``Linear4bit.forward`` with the kit's matmul."""
    self._grpo_kit_fix_quant_state(self)  # as bitsandbytes: a quant_state lost in a conversion (FSDP)
    qs = self.weight.quant_state
    needs_grad = torch.is_grad_enabled() and (x.requires_grad or (self.bias is not None and self.bias.requires_grad))
    if (_open_cache() is None and not needs_grad) or getattr(qs, "packing_format_for_cpu", False):
        # Generation, or inference outside the kit's checkpointed layer calls: nothing to reuse, and for the few
        # rows of a decoding step bitsandbytes multiplies the 4-bit weight directly (gemv, its fused small-batch
        # kernels) instead of writing out the 16-bit weight. Its CPU eval layout (repacked for AVX512-BF16, once
        # converted) is one only it reads. (Through the recorded base class: super(type(self)) would come back
        # here in a class made from this one.)
        return type(self)._grpo_kit_base.forward(self, x, *args, **kwargs)
    if not self.compute_type_is_set:  # bitsandbytes' rule for a layer made without a compute dtype
        self.set_compute_type(x)
        self.compute_type_is_set = True
    inp_dtype = x.dtype
    if self.compute_dtype is not None:
        x = x.to(self.compute_dtype)
    bias = None if self.bias is None else self.bias.to(x.dtype)
    if needs_grad and _open_cache() is None:
        # outside a layer call autograd must not save the 16-bit weight: it would hold every layer's until backward
        y = _NF4Matmul.apply(x, bias, self)
    else:
        # Inside a layer call (grpo_kit.model.offload) the weight stays cached until the call ends, and a graph
        # built there is backpropagated there too: autograd saving the cached weight holds nothing more, and its
        # own backward skips the Function's Python one, whose host cost per call exceeds the dequantisation's
        # on a fast GPU (bench nf4_host_cost).
        y = F.linear(x, dequantized(self, x.dtype), bias)
    return y.to(inp_dtype)


@functools.cache
def _kit_class(base: type) -> type:
    """``Kit<base>``: bitsandbytes' ``base`` (``Linear4bit`` or a subclass that keeps its forward) with
    :func:`_forward`, made on first use (bitsandbytes is optional) and reachable as
    ``grpo_kit.model.nf4_matmul.Kit<base>`` (so a pickled model finds it)."""
    from bitsandbytes.nn.modules import fix_4bit_weight_quant_state_from_module  # lazy: bitsandbytes is optional

    return type(
        f"Kit{base.__name__}",
        (base,),
        {
            "forward": _forward,
            "_grpo_kit_base": base,
            "__module__": __name__,
            "_grpo_kit_fix_quant_state": staticmethod(fix_4bit_weight_quant_state_from_module),  # imported once
            "__doc__": f"bitsandbytes' {base.__name__} with the kit's matmul (grpo_kit.model.nf4_matmul)",
        },
    )


def __getattr__(name):  # PEP 562: Kit<bitsandbytes class> exists once bitsandbytes is imported
    if name.startswith("Kit"):
        import bitsandbytes as bnb  # lazy: bitsandbytes is optional

        base = getattr(bnb.nn, name[3:], None)
        if isinstance(base, type) and issubclass(base, bnb.nn.Linear4bit):
            return _kit_class(base)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _target_class(cls: type, impl: str) -> type | None:
    """The class a 4-bit layer of class ``cls`` has with ``impl``; None for a class that is neither bitsandbytes'
    own forward nor the kit's (a forward of its own, or someone else's subclass): left as it is."""
    import bitsandbytes as bnb  # lazy: bitsandbytes is optional

    base = getattr(cls, "_grpo_kit_base", None)
    if base is not None and cls is _kit_class(base):  # the kit's
        return base if impl == "bitsandbytes" else cls
    if base is None and cls.forward is bnb.nn.Linear4bit.forward:  # bitsandbytes'
        return _kit_class(cls) if impl == "kit" else cls
    return None


def with_nf4_matmul(layer: torch.nn.Module, impl: str) -> torch.nn.Module:
    """``layer`` (a bitsandbytes 4-bit linear) multiplying with ``impl`` (``NF4_MATMULS``): ``layer`` itself
    where it already does or where its class is neither bitsandbytes' own forward nor the kit's, else a new
    module of the other class holding ``layer``'s state: the same parameter, quant-state, buffer and hook
    objects (nothing copied; the weight's back-reference to its module moves to the new one). ``layer`` keeps
    its class; put the result where ``layer`` was (:func:`use_nf4_matmul` does, in each parent)."""
    if impl not in NF4_MATMULS:
        raise ValueError(f"nf4 matmul {impl!r} is not allowed: one of {', '.join(NF4_MATMULS)}")
    cls = _target_class(type(layer), impl) if is_quantized(layer) else None
    if cls is None or cls is type(layer):
        return layer
    new = cls.__new__(cls)
    new.__dict__.update(layer.__dict__)  # a module's state is its __dict__ (as copy.copy takes it)
    if getattr(layer.weight, "module", None) is layer:  # bitsandbytes sets module.quant_state through it
        layer.weight.module = new
    return new


def use_nf4_matmul(model: torch.nn.Module, impl: str) -> int:
    """Make the bitsandbytes 4-bit layers in ``model`` multiply with ``impl`` (``NF4_MATMULS``: ``kit``, this
    module's matmul; ``bitsandbytes``, its own): each such layer is replaced in its parent by
    :func:`with_nf4_matmul`'s module (``Kit<its class>`` and back; PEFT's LoRA layers get a new ``base_layer``).
    No object changes class. A layer whose class has a forward of its own (not ``Linear4bit``'s), or that
    something else subclassed, is left as it is. ``model`` itself is not replaced: pass its parent, or call
    :func:`with_nf4_matmul` on a lone layer. Returns how many layers now use ``impl``."""
    if impl not in NF4_MATMULS:
        raise ValueError(f"nf4 matmul {impl!r} is not allowed: one of {', '.join(NF4_MATMULS)}")
    done: dict[int, torch.nn.Module] = {}  # id(old layer) -> its replacement: a layer in two parents stays one
    for parent in list(model.modules()):
        for name, child in list(parent._modules.items()):
            if child is None or not is_quantized(child) or _target_class(type(child), impl) is None:
                continue
            if id(child) not in done:
                done[id(child)] = with_nf4_matmul(child, impl)
            parent._modules[name] = done[id(child)]
    return len(done)


def reset_stats() -> dict:
    """The dequantisation count since the last call (then zero)."""
    out = dict(_stats)
    _stats["dequantized"] = 0
    return out
