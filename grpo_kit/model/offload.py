"""Offloaded gradient checkpointing for the decoder layers of any transformers causal LM.

The layers are found generically (:func:`grpo_kit.model.anatomy.decoder_layers`) and wrapped as they are: no
replacement forward per model class. Each layer runs in one of two modes, chosen once by a probe at enable time
(:func:`_probe`: one forward of a few tokens through the body, each layer's own output held against the mode's):

* ``split``: the layer has the pre-norm layout ``x + o(attn(q, k, v of norm(x))); h + mlp(norm(h))`` (Llama, Qwen2/3,
  Mistral, Phi-3, ...): the per-token work runs over slices of tokens and only attention sees the whole sequence
  (below);
* ``whole``: any other layer (post-norm OLMo, Gemma's four norms, Granite's scaled residuals, NoPE layers, MoE
  blocks returning router scores, ...): the layer is recomputed as written, so sliding windows, QK-norm, attention
  sinks and NoPE pass through unchanged; its position-wise MLP (dense or MoE: whichever child the probe finds
  position-wise and largest) runs over slices of tokens, each slice recomputed in backward, so its (tokens x
  intermediate) activations are never whole.

What it does, per decoder layer, once :func:`enable_offloaded_checkpointing` is on:

* forward (autograd recording): the layer runs under ``no_grad`` (nothing of its
  inside is saved); its input hidden states ``x`` (B, T, H) are copied into a reusable
  pinned CPU buffer on a side CUDA stream. The last layer keeps its input on the GPU
  (its backward starts at once), as do inputs under ``min_bytes``.
* backward: ``x`` comes back (the previous layer's copy is already started on the side
  stream when ``prefetch``), the layer is recomputed with grad, and the gradient of
  ``x`` flows on. LoRA / trainable weights get their ``.grad`` accumulated during this
  inner backward (as with reentrant checkpointing), so use ``loss.backward()``, not
  ``torch.autograd.grad(loss, params)``.
* long sequences: the per-token work (RMSNorms, q/k/v/o projections with their LoRA,
  rotary, the MLP, the residual adds) runs over slices of ``chunk_tokens`` tokens, both
  in the no-grad forward and in the recompute; only attention sees the whole sequence
  (SDPA: memory O(T)). So one layer's recompute peak no longer holds the full
  (T x intermediate) MLP activations.
* ``torch.no_grad`` passes (reference / old-policy log-probs) run the same chunked
  forward, save nothing and take no offload buffers. Passes with a KV cache (generation)
  use the layer's original forward.
* layers with an active dropout (LoRA dropout > 0 in train mode, attention dropout)
  cannot be split into chunks without changing the random masks, so they use the
  layer's original forward for the no-grad run and recompute it whole, with the RNG
  state of the forward restored; offloading still applies.
* on a CPU-only machine nothing is offloaded; the wrapper does plain (chunked) recompute.

The readable reference is HF's own ``model.gradient_checkpointing_enable()``
(non-reentrant ``torch.utils.checkpoint``); tests hold the gradients equal, per family.
"""

from __future__ import annotations

import inspect
import math
import sys
import types
import warnings
import weakref
from contextlib import nullcontext

import torch
from torch import nn
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from grpo_kit.model.anatomy import AnatomyError, decoder_body, decoder_layers, head
from grpo_kit.model.nf4_matmul import layer_weight_cache
from grpo_kit.model.prefix import PrefixCache

__all__ = [
    "AUX_LOSS_OFF_REASON",
    "LAYER_MODES",
    "enable_offloaded_checkpointing",
    "disable_offloaded_checkpointing",
    "keep_hf_checkpointing_off",
    "offload_stats",
    "reserve_offload_buffers",
]

LAYER_MODES = ("split", "whole")  # see the module docstring
# The split mode's layer and attention children: the pre-norm layout; any other child means another layout.
_SPLIT_LAYER_CHILDREN = {"input_layernorm", "self_attn", "post_attention_layernorm", "mlp"}
_SPLIT_ATTN_CHILDREN = {"q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm", "rotary_emb"}
_PROBE_TOKENS = 12  # the probe's sequence: a few slices of _PROBE_CHUNK tokens, past a tiny sliding window
_PROBE_CHUNK = 4

# Why an MoE model trains without its router's load-balancing loss here (the trainer turns it off, the plan says so).
AUX_LOSS_OFF_REASON = (
    "the MoE router's load-balancing loss is off under offloaded checkpointing: each layer runs "
    "without grad in the forward and is recomputed in backward, so the routers' logits the loss "
    "reads carry no gradient; set gradient_checkpointing: false to train with it, as TRL does"
)
_STATE_ATTR = "_grpo_kit_offload_state"
_MLP_ATTR = "_grpo_kit_chunked_mlp"


# --------------------------------------------------------------------------- host buffers


class _HostBuffer:
    """One flat uint8 CPU buffer, page-locked when possible, exactly ``nbytes`` long.

    Page-locking goes through ``cudaHostRegister`` on an ordinary allocation (exact size;
    torch's pinned allocator rounds every block up to a power of two, which would double
    the host RAM at some lengths), then ``pin_memory=True``; if both fail it stays pageable.
    """

    def __init__(self, nbytes: int, pin: bool, stream):
        self.nbytes = nbytes
        self.pinned = False
        self._registered = False
        self._stream = stream  # copies into this buffer run here; synced before unregistering
        self.tensor = None
        if pin and torch.cuda.is_available():
            self.tensor = torch.empty(nbytes, dtype=torch.uint8)
            try:
                rc = torch.cuda.cudart().cudaHostRegister(self.tensor.data_ptr(), nbytes, 0)
                ok = int(rc) == 0
            except Exception:  # noqa: BLE001 - any failure means: try the next way
                ok = False
            if ok:
                self.pinned = self._registered = True
            else:
                try:
                    self.tensor = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
                    self.pinned = True
                except RuntimeError:
                    self.tensor = torch.empty(nbytes, dtype=torch.uint8)
        if self.tensor is None:
            self.tensor = torch.empty(nbytes, dtype=torch.uint8)

    def view(self, shape, dtype) -> torch.Tensor:
        n = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        return self.tensor[:n].view(dtype).view(shape)

    def __del__(self):
        if self._registered:
            try:
                if self._stream is not None:
                    self._stream.synchronize()
                torch.cuda.cudart().cudaHostUnregister(self.tensor.data_ptr())
            except Exception:  # noqa: BLE001 - interpreter shutdown: nothing left to do
                pass


class _BufferPool:
    """Free host buffers, reused across layers, micro-batches and steps.

    Sizes are rounded up to 1/8 of their power of two (at most 12.5% slack) so that
    micro-batches of slightly different lengths reuse the same buffers.
    """

    def __init__(self, pin: bool):
        self.pin = pin
        self.free: list[_HostBuffer] = []
        self.allocated_bytes = 0  # all buffers made and still owned (free or in use)
        self.pinned_bytes = 0
        self.warned = False

    @staticmethod
    def _round(nbytes: int) -> int:
        if nbytes <= 1 << 20:
            return 1 << 20
        step = 1 << max(0, nbytes.bit_length() - 4)
        return -(-nbytes // step) * step

    def acquire(self, nbytes: int, stream) -> _HostBuffer:
        fits = [b for b in self.free if b.nbytes >= nbytes]
        if fits:
            buf = min(fits, key=lambda b: b.nbytes)
            self.free.remove(buf)
            return buf
        if self.free:  # a too-small free buffer is stale now: give its memory back first
            small = min(self.free, key=lambda b: b.nbytes)
            self.free.remove(small)
            self._forget(small)
        buf = _HostBuffer(self._round(nbytes), self.pin, stream)
        self.allocated_bytes += buf.nbytes
        self.pinned_bytes += buf.nbytes if buf.pinned else 0
        if self.pin and not buf.pinned and not self.warned:
            self.warned = True
            warnings.warn(
                f"grpo_kit.model.offload: could not page-lock {buf.nbytes / 2**20:.0f} MiB of host memory "
                "(not enough pinned memory, or no CUDA); using pageable copies, which are slower and "
                "synchronous.",
                RuntimeWarning,
                stacklevel=4,
            )
        return buf

    def release(self, buf: _HostBuffer) -> None:
        self.free.append(buf)

    def _forget(self, buf: _HostBuffer) -> None:
        self.allocated_bytes -= buf.nbytes
        self.pinned_bytes -= buf.nbytes if buf.pinned else 0

    def clear(self) -> None:
        for b in self.free:
            self._forget(b)
        self.free.clear()


# --------------------------------------------------------------------------- saved inputs


class _Saved:
    """A layer input kept for backward: on the GPU as is, or in a host buffer.

    ``prev`` is the record of the layer before, in the same forward pass, so backward can
    start bringing it back while this layer recomputes.
    """

    def __init__(self, offloader: _Offloader, x: torch.Tensor, offload: bool):
        self.offloader = offloader
        self.shape, self.dtype, self.device = x.shape, x.dtype, x.device
        self.prev: _Saved | None = None
        self.host: _HostBuffer | None = None
        self.gpu: torch.Tensor | None = None
        self.ready = None  # CUDA event after which self.gpu holds the data
        if not offload:
            self.gpu = x
            return
        self.host = offloader.pool.acquire(x.numel() * x.element_size(), offloader.side_stream(x.device))
        dst = self.host.view(x.shape, x.dtype)
        if x.is_cuda:
            side = offloader.side_stream(x.device)
            side.wait_stream(torch.cuda.current_stream(x.device))  # x is complete
            with torch.cuda.stream(side):
                dst.copy_(x, non_blocking=True)
            x.record_stream(side)  # x's memory is not reused before the copy has read it
        else:
            dst.copy_(x)

    def bring_back(self) -> None:
        """Start the host -> GPU copy (no-op if done or not offloaded)."""
        if self.gpu is not None or self.host is None:
            return
        src = self.host.view(self.shape, self.dtype)
        if self.device.type == "cuda":
            main = torch.cuda.current_stream(self.device)
            side = self.offloader.side_stream(self.device)
            gpu = torch.empty(self.shape, dtype=self.dtype, device=self.device)
            side.wait_stream(main)  # the block we got may still be read by queued kernels
            with torch.cuda.stream(side):
                gpu.copy_(src, non_blocking=True)
                self.ready = torch.cuda.Event()
                self.ready.record(side)
            gpu.record_stream(side)
        else:
            gpu = src.clone()
        self.gpu = gpu
        # Same side stream for every copy: a later offload into this buffer queues behind
        # this read, so the buffer can go back to the pool now.
        self.offloader.pool.release(self.host)
        self.host = None

    def take(self) -> torch.Tensor:
        self.bring_back()
        if self.ready is not None:
            torch.cuda.current_stream(self.device).wait_event(self.ready)
        x, self.gpu, self.ready = self.gpu, None, None
        return x

    def __del__(self):
        # Graph dropped without a backward: the buffer returns to the pool.
        if self.host is not None:
            self.offloader.pool.release(self.host)
            self.host = None


class _Offloader:
    """Per-model state: options, the buffer pool, one side stream per device."""

    def __init__(self, *, offload, pin_memory, min_bytes, prefetch, chunk_tokens, offload_cpu):
        self.pool = _BufferPool(pin_memory)
        self._streams: dict = {}
        self._last = None  # weakref to the last record made, to link the next layer's to it
        self.configure(
            offload=offload,
            pin_memory=pin_memory,
            min_bytes=min_bytes,
            prefetch=prefetch,
            chunk_tokens=chunk_tokens,
            offload_cpu=offload_cpu,
        )

    def configure(self, *, offload, pin_memory, min_bytes, prefetch, chunk_tokens, offload_cpu):
        self.offload, self.min_bytes, self.prefetch = offload, min_bytes, prefetch
        self.chunk_tokens, self.offload_cpu = chunk_tokens, offload_cpu
        if pin_memory != self.pool.pin:
            self.pool.clear()
            self.pool.pin = pin_memory

    def side_stream(self, device: torch.device):
        if device.type != "cuda":
            return None
        key = device.index if device.index is not None else torch.cuda.current_device()
        if key not in self._streams:
            self._streams[key] = torch.cuda.Stream(device=key)
        return self._streams[key]

    def save(self, x: torch.Tensor, layer_index: int, is_last: bool) -> _Saved:
        big = x.numel() * x.element_size() >= self.min_bytes
        offload = self.offload and not is_last and big and (x.is_cuda or self.offload_cpu)
        rec = _Saved(self, x, offload)
        last = self._last() if self._last is not None else None
        if last is not None and getattr(last, "layer_index", None) == layer_index - 1:
            rec.prev = last
        rec.layer_index = layer_index
        self._last = weakref.ref(rec)
        return rec


# --------------------------------------------------------------------------- the layer, in pieces


# Matmul tiles are multiples of 64-128 rows: slices of such lengths leave no ragged tile but the last.
_SLICE_ALIGN = 128


def _rotary_fn(layer: nn.Module):
    """The model family's own ``apply_rotary_pos_emb`` (same arithmetic as HF's attention)."""
    fn = getattr(sys.modules[type(layer.self_attn).__module__], "apply_rotary_pos_emb", None)
    if fn is None:
        raise ValueError(f"{type(layer).__name__}: no apply_rotary_pos_emb in {type(layer.self_attn).__module__}")
    return fn


def _mlp_width(mlp: nn.Module) -> int:
    """The widest dimension of a position-wise MLP's weights: its intermediate size (dense), or an expert's fused
    gate/up width (MoE)."""
    return max((max(p.shape[-2:]) for p in mlp.parameters() if p.dim() >= 2), default=1)


def _auto_chunk_tokens(mlp: nn.Module) -> int:
    """Tokens per slice so one MLP intermediate (tokens x intermediate) is <= 2**26 elements
    (256 MiB in fp32, the dtype peft's default LoRA casts to); a power of two in [1024, 16384]."""
    t = 1 << max(0, (2**26 // max(int(_mlp_width(mlp)), 1)).bit_length() - 1)
    return min(16384, max(1024, t))


def _slices(T: int, B: int, chunk_tokens: int):
    """Token slices along the sequence, at most ``chunk_tokens`` tokens (B x t) each and close to equal:
    4,608 tokens in 4,096-token slices run as 2 x 2,304, not 4,096 + 512, whose small second matmuls use the
    GPU poorly. Slice lengths are rounded up to a multiple of ``_SLICE_ALIGN`` where that stays in bounds."""
    t_max = max(1, chunk_tokens // max(B, 1))
    t = -(-T // -(-T // t_max))  # ceil(T / number of slices)
    t = min(t_max, -(-t // _SLICE_ALIGN) * _SLICE_ALIGN)
    return [slice(s, min(s + t, T)) for s in range(0, T, t)]


def _qkv_chunk(layer, x_c, cos_c, sin_c, rotary):
    """Per-token attention inputs of a slice: (B, t, heads, head_dim) each, rotary applied."""
    attn = layer.self_attn
    B, t, _ = x_c.shape
    n = layer.input_layernorm(x_c)
    q = attn.q_proj(n).view(B, t, -1, attn.head_dim)
    k = attn.k_proj(n).view(B, t, -1, attn.head_dim)
    v = attn.v_proj(n).view(B, t, -1, attn.head_dim)
    if hasattr(attn, "q_norm"):  # QK-norm over each head (Qwen3); another placement fails the probe
        q, k = attn.q_norm(q), attn.k_norm(k)
    q, k = rotary(q, k, cos_c, sin_c, unsqueeze_dim=2)  # heads are dim 2 in this layout
    return q, k, v


def _qkv(layer, x, cos, sin, rotary, parts):
    """q, k, v of the whole sequence x (B, T, H), slice by slice: (B, T, heads, head_dim) each."""
    qs, ks, vs = [], [], []
    for s in parts:
        q, k, v = _qkv_chunk(layer, x[:, s], cos[:, s], sin[:, s], rotary)
        qs.append(q), ks.append(k), vs.append(v)
    return tuple(torch.cat(z, 1) if len(z) > 1 else z[0] for z in (qs, ks, vs))


def _out_chunk(layer, x_c, a_c):
    """Per-token rest of the layer: residual + o_proj, then residual + MLP(norm). (B, t, H)."""
    h = x_c + layer.self_attn.o_proj(a_c)
    return h + layer.mlp(layer.post_attention_layernorm(h))


def _sliding_window(attn: nn.Module):
    """The sliding window an HF attention module passes to the attention function: its own attribute where it
    has one (Qwen2/3, Gemma 3, gpt-oss: None on global layers), else its config's (Mistral, Phi-3; Llama: None)."""
    if hasattr(attn, "sliding_window"):
        return attn.sliding_window
    return getattr(attn.config, "sliding_window", None)


def _attention(layer, q, k, v, attention_mask, kwargs, sliding):
    """The attention core exactly as the HF attention module calls it. In/out (B, T, heads, d)."""
    attn = layer.self_attn
    mod = __import__(type(attn).__module__, fromlist=["eager_attention_forward"])
    impl = attn.config._attn_implementation
    if hasattr(ALL_ATTENTION_FUNCTIONS, "get_interface"):
        iface = ALL_ATTENTION_FUNCTIONS.get_interface(impl, mod.eager_attention_forward)
    else:  # older transformers: a plain mapping, eager not in it
        iface = mod.eager_attention_forward if impl == "eager" else ALL_ATTENTION_FUNCTIONS[impl]
    extra = {} if sliding is None else {"sliding_window": sliding}
    out, _ = iface(
        attn,
        q.transpose(1, 2),
        k.transpose(1, 2),
        v.transpose(1, 2),
        attention_mask,
        dropout=0.0 if not attn.training else attn.attention_dropout,
        scaling=attn.scaling,
        **extra,
        **kwargs,
    )
    B, T = q.shape[:2]
    return out.reshape(B, T, -1)


class _SplitPrefix:
    """A split layer's attention in a prefix-shared pass (:class:`_OffloadedPrefixLayer`).

    ``record`` (the prompt, batch 1): the forward keeps the layer's keys and values, (1, kv heads, P, d), in
    ``keys``/``values``; in backward their incoming gradients ``grads`` (the completions', same shapes, or None)
    join the attention's own. ``attend`` (the completions): ``keys``/``values`` are the prompt's, put before the
    layer's own keys and values for every row; backward leaves their gradients in ``grads``."""

    def __init__(self, mode: str, keys=None, values=None, grads=(None, None)):
        self.mode, self.keys, self.values, self.grads = mode, keys, values, grads

    def kv(self, k, v):
        """The keys and values attention reads, from the layer's own k, v (B, T, kv heads, d)."""
        if self.mode == "record":
            self.keys, self.values = k.transpose(1, 2), v.transpose(1, 2)
            return k, v
        B = k.shape[0]
        return (
            torch.cat([self.keys.expand(B, -1, -1, -1).transpose(1, 2), k], 1),
            torch.cat([self.values.expand(B, -1, -1, -1).transpose(1, 2), v], 1),
        )

    def leaves(self) -> None:
        """``attend``, before the recompute: the prompt's keys and values as leaves that collect their gradient."""
        if self.mode == "attend":
            self.keys, self.values = (t.detach().requires_grad_() for t in (self.keys, self.values))

    def layer_grads(self, gk, gv):
        """The gradients of the layer's own k, v (B, T, kv heads, d) after the attention backward: ``record`` adds
        the completions' (transposed to this layout); ``attend`` keeps the prompt's in ``grads``."""
        if self.mode == "attend":
            self.grads = (self.keys.grad, self.values.grad)
            return gk, gv
        return tuple(g if extra is None else g + extra.transpose(1, 2) for g, extra in zip((gk, gv), self.grads))


def _chunked_forward(layer, x, cos, sin, attention_mask, kwargs, sliding, chunk_tokens, prefix=None):
    """The decoder layer, per-token work in slices. x (B, T, H) -> (B, T, H), same dtype. ``prefix``: a
    :class:`_SplitPrefix` in a prefix-shared pass.

    Without grad it saves nothing; transient peak ~ q,k,v + attention output + one slice.
    """
    with layer_weight_cache():  # 4-bit weights: dequantised once for all slices
        return _chunked_forward_body(layer, x, cos, sin, attention_mask, kwargs, sliding, chunk_tokens, prefix)


def _chunked_forward_body(layer, x, cos, sin, attention_mask, kwargs, sliding, chunk_tokens, prefix=None):
    B, T, _ = x.shape
    rotary = _rotary_fn(layer)
    parts = _slices(T, B, chunk_tokens)
    q, k, v = _qkv(layer, x, cos, sin, rotary, parts)
    a = _attention(layer, q, *((k, v) if prefix is None else prefix.kv(k, v)), attention_mask, kwargs, sliding)
    del q, k, v
    y = torch.empty_like(x)
    for s in parts:
        y[:, s] = _out_chunk(layer, x[:, s], a[:, s])
    return y


def _chunked_backward(layer, x, gy, cos, sin, attention_mask, kwargs, sliding, chunk_tokens, need_gx, prefix=None):
    """Recompute the layer slice by slice and backpropagate ``gy`` (B, T, H).

    Parameter gradients accumulate into ``.grad``; returns the gradient of ``x`` (or None); with ``prefix`` (a
    :class:`_SplitPrefix`) the prompt's keys and values take part as there said.
    Order: q,k,v without grad -> attention with grad -> per-slice (o_proj + MLP) backward ->
    attention backward -> per-slice (norm + q,k,v) backward.
    """
    B, T, _ = x.shape
    rotary = _rotary_fn(layer)
    parts = _slices(T, B, chunk_tokens)
    with torch.no_grad():
        q, k, v = _qkv(layer, x, cos, sin, rotary, parts)
    q.requires_grad_(), k.requires_grad_(), v.requires_grad_()
    attend = prefix is not None and prefix.mode == "attend"
    if attend:
        prefix.leaves()
    with torch.enable_grad():
        a = _attention(layer, q, *(prefix.kv(k, v) if attend else (k, v)), attention_mask, kwargs, sliding)
    ga = torch.empty_like(a)
    gx = torch.zeros_like(x) if need_gx else None
    a_d = a.detach()
    for s in parts:
        x_c = x[:, s].detach().requires_grad_(need_gx)
        a_c = a_d[:, s].detach().requires_grad_()
        with torch.enable_grad():
            y_c = _out_chunk(layer, x_c, a_c)
        torch.autograd.backward(y_c, gy[:, s])
        ga[:, s] = a_c.grad
        if need_gx:
            gx[:, s] = x_c.grad
        del x_c, a_c, y_c
    torch.autograd.backward(a, ga)
    del a, a_d, ga
    gq, gk, gv = q.grad, k.grad, v.grad
    if prefix is not None:
        gk, gv = prefix.layer_grads(gk, gv)
    del q, k, v
    for s in parts:
        x_c = x[:, s].detach().requires_grad_(need_gx)
        with torch.enable_grad():
            qc, kc, vc = _qkv_chunk(layer, x_c, cos[:, s], sin[:, s], rotary)
        # a projection with nothing to train (LoRA on some of q/k/v only) under a frozen input has no graph
        pairs = [(t, g[:, s]) for t, g in ((qc, gq), (kc, gk), (vc, gv)) if t.requires_grad]
        if pairs:
            torch.autograd.backward([t for t, _ in pairs], [g for _, g in pairs])
        if need_gx:
            gx[:, s] += x_c.grad
        del x_c, qc, kc, vc, pairs
    return gx


def _has_active_dropout(layer: nn.Module) -> bool:
    if layer.training and any(float(getattr(m, "attention_dropout", 0.0) or 0.0) > 0 for m in layer.modules()):
        return True
    return any(isinstance(m, nn.Dropout) and m.p > 0 and m.training for m in layer.modules())


# --------------------------------------------------------------------------- autograd


class _GradAnchor:
    """An empty tensor that requires grad, passed into the Function so that its output
    requires grad (and its backward runs) even when the layer input does not, e.g. layer 0
    under LoRA with frozen embeddings."""

    _t: torch.Tensor | None = None

    @classmethod
    def get(cls) -> torch.Tensor:
        if cls._t is None:
            cls._t = torch.empty(0, requires_grad=True)
        return cls._t


class _OffloadedLayer(torch.autograd.Function):
    @staticmethod
    def forward(ctx, job, anchor, x):
        # Function.forward runs with grad off: nothing inside the layer is saved.
        ctx.job = job
        job.rec = job.offloader.save(x, job.layer_index, job.is_last)
        job.autocast = _autocast_state(x.device)
        if job.whole:
            job.rng = _rng_state(x.device) if job.dropout else None
            with layer_weight_cache():  # 4-bit: the kit's matmul, as in the recompute (the same rounding)
                return job.orig_forward(x, **job.call_kwargs)
        return _chunked_forward(job.layer, x, *job.cos_sin, job.mask, job.attn_kwargs, job.sliding, job.chunk)

    @staticmethod
    def backward(ctx, gy):
        job = ctx.job
        ctx.job = None
        rec, job.rec = job.rec, None
        x = rec.take()
        if job.offloader.prefetch and rec.prev is not None:
            rec.prev.bring_back()  # overlaps with this layer's recompute
        rec.prev = None
        need_gx = ctx.needs_input_grad[2]
        if gy is None:
            return None, None, None
        # 4-bit weights: dequantised once for the recompute and its backward (grpo_kit.model.nf4_matmul)
        with _autocast_ctx(x.device, job.autocast), layer_weight_cache():
            if job.whole:
                with _restored_rng(x.device, job.rng) if job.rng is not None else nullcontext():
                    xg = x.detach().requires_grad_(need_gx)
                    with torch.enable_grad():
                        y = job.orig_forward(xg, **job.call_kwargs)
                    torch.autograd.backward(y, gy)
                gx = xg.grad if need_gx else None
            else:
                gx = _chunked_backward(
                    job.layer, x, gy, *job.cos_sin, job.mask, job.attn_kwargs, job.sliding, job.chunk, need_gx
                )
        return None, None, gx


class _Job:
    """Everything one layer call needs again in backward (tensors shared across layers)."""

    __slots__ = (
        "layer",
        "offloader",
        "layer_index",
        "is_last",
        "orig_forward",
        "call_kwargs",
        "cos_sin",
        "mask",
        "attn_kwargs",
        "sliding",
        "whole",
        "dropout",
        "rec",
        "rng",
        "autocast",
        "chunk",
        "prefix_mode",
        "prefix_len",
    )


def _autocast_state(device):
    dt = device.type
    if not torch.is_autocast_enabled(dt):
        return None
    return torch.get_autocast_dtype(dt)


def _autocast_ctx(device, dtype):
    if dtype is None:
        return nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype)


def _rng_state(device):
    cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    return torch.get_rng_state(), cuda


class _restored_rng:
    """Run a block with the CPU (and CUDA) RNG as it was at forward time, then put it back."""

    def __init__(self, device, state):
        self.device, self.state = device, state

    def __enter__(self):
        self.saved = _rng_state(self.device)
        torch.set_rng_state(self.state[0])
        if self.state[1] is not None:
            torch.cuda.set_rng_state(self.state[1], self.device)

    def __exit__(self, *exc):
        torch.set_rng_state(self.saved[0])
        if self.saved[1] is not None:
            torch.cuda.set_rng_state(self.saved[1], self.device)
        return False


# --------------------------------------------------------------------------- the chunked MLP of whole layers


class _ChunkedMLP(torch.autograd.Function):
    """A position-wise MLP over slices of tokens: forward without grad (only its input is saved), backward
    recomputing each slice with grad. x (B, T, H) -> (B, T, H), or that and the MLP's other per-token outputs
    (router scores, no gradient) where it returns a tuple; tokens are sliced over the flattened (B * T) order, so
    an MoE block's per-token router outputs come in the order of the whole call."""

    @staticmethod
    def forward(ctx, mlp, chunk, anchor, x):
        ctx.mlp, ctx.chunk = mlp, chunk
        ctx.save_for_backward(x)
        out = _mlp_slices(mlp, x, chunk)
        if isinstance(out, tuple):
            ctx.mark_non_differentiable(*(t for t in out[1:] if isinstance(t, torch.Tensor)))
        return out

    @staticmethod
    def backward(ctx, gy, *_):
        (x,) = ctx.saved_tensors
        mlp, chunk = ctx.mlp, ctx.chunk
        need_gx = ctx.needs_input_grad[3]
        flat, gflat = x.reshape(1, -1, x.shape[-1]), gy.reshape(1, -1, gy.shape[-1])
        gx = torch.empty_like(flat) if need_gx else None
        for s in _slices(flat.shape[1], 1, chunk):
            xs = flat[:, s].detach().requires_grad_(need_gx)
            with torch.enable_grad():
                ys = _mlp_out(mlp(xs))
            if ys.requires_grad:
                torch.autograd.backward(ys, gflat[:, s])
            if need_gx:
                gx[:, s] = xs.grad if xs.grad is not None else 0
        return None, None, None, (gx.view_as(x) if need_gx else None)


def _mlp_out(out):
    """The hidden-state output of an MLP call: the tensor, or the first element where it returns a tuple (gpt-oss
    returns its router scores beside it)."""
    return out if isinstance(out, torch.Tensor) else out[0]


def _mlp_slices(mlp, x, chunk):
    """``mlp`` over slices of x's flattened tokens, no grad; the output in the call's form (tensor or tuple)."""
    flat = x.reshape(1, -1, x.shape[-1])
    outs = [mlp(flat[:, s]) for s in _slices(flat.shape[1], 1, chunk)]
    if isinstance(outs[0], torch.Tensor):
        return torch.cat(outs, 1).view(*x.shape[:-1], -1)
    first = torch.cat([o[0] for o in outs], 1).view(*x.shape[:-1], -1)
    return (
        first,
        *(
            torch.cat(parts, 0) if isinstance(parts[0], torch.Tensor) else parts[0]
            for parts in zip(*(o[1:] for o in outs))
        ),
    )


def _chunked_mlp_forward(mlp, *args, **kwargs):
    """Replacement ``forward`` of a whole-mode layer's position-wise MLP: slices of tokens when the call has more
    than one slice of them, the original forward otherwise (decoding, short sequences)."""
    st = mlp.__dict__[_MLP_ATTR]
    x = args[0] if args else kwargs.get("hidden_states")
    if (
        len(args) != 1
        or kwargs
        or not isinstance(x, torch.Tensor)
        or x.dim() != 3
        or x.shape[0] * x.shape[1] <= st["chunk"]()
        or (mlp.training and st["dropout"])
    ):
        return st["orig_forward"](*args, **kwargs)
    chunk = st["chunk"]()
    trainable = torch.is_grad_enabled() and (x.requires_grad or any(p.requires_grad for p in mlp.parameters()))
    if not trainable:
        return _mlp_slices(st["orig_forward"], x, chunk)
    return _ChunkedMLP.apply(st["orig_forward"], chunk, _GradAnchor.get(), x)


# --------------------------------------------------------------------------- the wrapped forward


def _call_args(sig: inspect.Signature, args, kwargs) -> tuple[torch.Tensor, dict]:
    """``(hidden_states, every other argument by name)`` of a decoder-layer call, ``**kwargs`` flattened."""
    bound = sig.bind(*args, **kwargs)
    named = dict(bound.arguments)
    for name, p in sig.parameters.items():
        if p.kind is inspect.Parameter.VAR_KEYWORD:
            named.update(named.pop(name, {}))
    first = next(iter(sig.parameters))
    return named.pop(first), named


def _wrapped_forward(layer, *args, **kwargs):
    """Replacement ``forward`` of a decoder layer (the layer's own call signature)."""
    st = layer.__dict__[_STATE_ATTR]
    off: _Offloader = st["offloader"]
    hidden_states, call_kwargs = _call_args(st["signature"], args, kwargs)
    split = st["mode"] == "split"
    chunk = off.chunk_tokens or st["auto_chunk"]
    cos_sin = call_kwargs.get("position_embeddings")
    if split and cos_sin is None:
        return st["orig_forward"](hidden_states, **call_kwargs)
    trainable = torch.is_grad_enabled() and (
        hidden_states.requires_grad or any(p.requires_grad for p in layer.parameters())
    )
    cached = call_kwargs.get("past_key_values") is not None
    dropout = _has_active_dropout(layer)
    attn_kwargs = {k: v for k, v in call_kwargs.items() if k not in ("attention_mask", "position_embeddings")}
    if not trainable:
        if cached or dropout or not split:  # generation with a cache; or the layer as written
            return st["orig_forward"](hidden_states, **call_kwargs)
        return _chunked_forward(
            layer, hidden_states, *cos_sin, call_kwargs.get("attention_mask"), attn_kwargs, st["sliding"], chunk
        )
    for k, v in list(call_kwargs.items()) + list(zip(("cos", "sin"), cos_sin or ())):
        if isinstance(v, torch.Tensor) and v.requires_grad:
            raise ValueError(
                f"offloaded checkpointing: argument {k!r} of {type(layer).__name__} requires grad; "
                "only hidden_states may (its gradient is the only one passed back)."
            )
    cache = call_kwargs.get("past_key_values")
    if isinstance(cache, PrefixCache):  # prefix sharing: the prompt's keys and values pass explicitly
        return _prefix_layer(layer, st, hidden_states, call_kwargs, cache, dropout)
    # As HF's checkpointing does in training: the recompute must not write a cache twice.
    for k, v in (("past_key_values", None), ("use_cache", False)):
        if k in call_kwargs:
            call_kwargs[k] = attn_kwargs[k] = v
    job = _Job()
    job.layer, job.offloader = layer, off
    job.layer_index, job.is_last = st["index"], st["is_last"]
    job.orig_forward, job.call_kwargs = st["orig_forward"], call_kwargs
    job.cos_sin, job.mask = cos_sin, call_kwargs.get("attention_mask")
    job.attn_kwargs = attn_kwargs
    job.sliding, job.whole, job.dropout, job.chunk = st["sliding"], not split or dropout, dropout, chunk
    anchor = _GradAnchor.get()
    return _OffloadedLayer.apply(job, anchor, hidden_states)


# --------------------------------------------------------------------------- prefix sharing


class _LayerKV(PrefixCache):
    """One layer's view of a :class:`PrefixCache` for one call of the layer (its forward or its recompute): it
    records into, or attends to, its own ``keys``/``values`` whatever the layer index, so that the recompute reads
    the tensors handed to it (leaves that collect the completions' gradient) and never the shared cache."""

    def __init__(self, mode: str, length: int, k=None, v=None):
        super().__init__()
        self.mode, self.length = mode, length
        if k is not None:
            self.keys[0], self.values[0] = k, v

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        return super().update(key_states, value_states, 0, *args, **kwargs)


class _OffloadedPrefixLayer(torch.autograd.Function):
    """A decoder layer under offloaded checkpointing in a prefix-shared pass: a split layer in its slices
    (:class:`_SplitPrefix`), any other as written.

    ``record`` (the prompt): x (1, P, H) -> (y, k, v), k and v the layer's keys and values (1, kv_heads, P, d),
    outputs so that the completions' gradient w.r.t. them reaches this layer's recompute together with y's.
    ``attend`` (the completions): (x (G, C, H), k, v) -> y, attending to k and v; backward returns their
    gradients (summed over the G rows by their expand). Only x is saved (offloaded like any layer input); a recompute
    reads the keys and values handed to it (a :class:`_LayerKV` of its own where the layer runs as written), so
    nothing is appended to the shared cache twice."""

    @staticmethod
    def forward(ctx, job, anchor, x, k, v):
        ctx.job = job
        job.rec = job.offloader.save(x, job.layer_index, job.is_last)
        job.autocast = _autocast_state(x.device)
        job.rng = _rng_state(x.device) if job.dropout else None
        attend = job.prefix_mode == "attend"
        if job.whole:
            kv = _LayerKV(job.prefix_mode, job.prefix_len, *((k, v) if attend else ()))
            with layer_weight_cache():
                y = job.orig_forward(x, **job.call_kwargs, past_key_values=kv)
            out_k, out_v = kv.keys[0], kv.values[0]
        else:
            prefix = _SplitPrefix(job.prefix_mode, k, v)
            y = _chunked_forward(job.layer, x, *job.cos_sin, job.mask, job.attn_kwargs, job.sliding, job.chunk, prefix)
            out_k, out_v = prefix.keys.contiguous(), prefix.values.contiguous()
        if attend:
            ctx.save_for_backward(k, v)
            return y
        return y, out_k, out_v

    @staticmethod
    def backward(ctx, gy, *gkv):
        job = ctx.job
        ctx.job = None
        rec, job.rec = job.rec, None
        x = rec.take()
        if job.offloader.prefetch and rec.prev is not None:
            rec.prev.bring_back()
        rec.prev = None
        need_gx = ctx.needs_input_grad[2]
        attend = job.prefix_mode == "attend"
        if not job.whole:
            prefix = _SplitPrefix(
                job.prefix_mode, *(ctx.saved_tensors if attend else ()), grads=(None, None) if attend else gkv
            )
            with _autocast_ctx(x.device, job.autocast), layer_weight_cache():
                gx = _chunked_backward(
                    job.layer, x, gy, *job.cos_sin, job.mask, job.attn_kwargs, job.sliding, job.chunk, need_gx, prefix
                )
            return (None, None, gx, *prefix.grads) if attend else (None, None, gx, None, None)
        leaves = [t.detach().requires_grad_() for t in ctx.saved_tensors] if attend else []
        rng = _restored_rng(x.device, job.rng) if job.rng is not None else nullcontext()
        with _autocast_ctx(x.device, job.autocast), layer_weight_cache(), rng:
            xg = x.detach().requires_grad_(need_gx)
            kv = _LayerKV(job.prefix_mode, job.prefix_len, *leaves)
            with torch.enable_grad():
                y = job.orig_forward(xg, **job.call_kwargs, past_key_values=kv)
            outs = [(y, gy)] if attend else [(y, gy), (kv.keys[0], gkv[0]), (kv.values[0], gkv[1])]
            outs = [(t, g) for t, g in outs if g is not None and t.requires_grad]
            if outs:
                torch.autograd.backward([t for t, _ in outs], [g for _, g in outs])
        gx = xg.grad if need_gx else None
        if attend:
            return None, None, gx, leaves[0].grad, leaves[1].grad
        return None, None, gx, None, None


def _prefix_layer(layer, st, hidden_states, call_kwargs, cache, dropout):
    """A trainable layer's call in a prefix-shared pass (:class:`_OffloadedPrefixLayer`); in ``record`` mode the
    layer's keys and values go into ``cache`` under this layer's index, as the autograd outputs they are."""
    job = _Job()
    job.layer, job.offloader = layer, st["offloader"]
    job.layer_index, job.is_last = st["index"], st["is_last"]
    job.orig_forward = st["orig_forward"]
    job.call_kwargs = {k: v for k, v in call_kwargs.items() if k != "past_key_values"}
    job.dropout, job.prefix_mode, job.prefix_len = dropout, cache.mode, cache.length
    # a split layer keeps its slices (its attention reads the prompt's keys and values, _SplitPrefix); any other
    # layer, or one with active dropout, runs as written with a cache of its own (_LayerKV)
    job.cos_sin, job.mask = call_kwargs.get("position_embeddings"), call_kwargs.get("attention_mask")
    job.whole = dropout or st["mode"] != "split" or job.cos_sin is None
    job.attn_kwargs = {
        k: v
        for k, v in call_kwargs.items()
        if k not in ("attention_mask", "position_embeddings", "past_key_values", "use_cache")
    }
    job.sliding, job.chunk = st["sliding"], job.offloader.chunk_tokens or st["auto_chunk"]
    anchor = _GradAnchor.get()
    if cache.mode == "attend":
        k, v = cache.keys[st["index"]], cache.values[st["index"]]
        return _OffloadedPrefixLayer.apply(job, anchor, hidden_states, k, v)
    y, k, v = _OffloadedPrefixLayer.apply(job, anchor, hidden_states, None, None)
    cache.keys[st["index"]], cache.values[st["index"]] = k, v
    return y


# --------------------------------------------------------------------------- the probe


def _split_layout(layer: nn.Module) -> bool:
    """Whether the layer has the children the split mode reads (the probe then holds its output to the layer's)."""
    attn = getattr(layer, "self_attn", None)
    return (
        attn is not None
        and {n for n, _ in layer.named_children()} <= _SPLIT_LAYER_CHILDREN
        and _SPLIT_LAYER_CHILDREN - {"mlp"} <= {n for n, _ in layer.named_children()}
        and hasattr(layer, "mlp")
        and {n for n, _ in attn.named_children()} <= _SPLIT_ATTN_CHILDREN
        and all(hasattr(attn, a) for a in ("q_proj", "k_proj", "v_proj", "o_proj", "head_dim"))
        and (hasattr(attn, "q_norm") == hasattr(attn, "k_norm"))
        and getattr(sys.modules[type(attn).__module__], "apply_rotary_pos_emb", None) is not None
    )


def _close(a, b) -> bool:
    if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)) or a.shape != b.shape:
        return False
    tol = 1e-4 if b.dtype in (torch.float32, torch.float64) else 3e-2
    return bool(((a.float() - b.float()).abs().max() <= tol * b.float().abs().max().clamp_min(1e-6)).item())


@torch.no_grad()
def _probe(model: nn.Module, layers: list[nn.Module]) -> list[dict]:
    """One forward of ``_PROBE_TOKENS`` tokens through the decoder body, each layer and its children as written,
    their inputs and outputs recorded; then, per layer, ``mode`` (``split`` where :func:`_chunked_forward` over
    ``_PROBE_CHUNK``-token slices gives the layer's own output) and, for whole-mode layers, ``mlp``: the name of
    the largest child that is position-wise (called with one (B, T, H) tensor; over two slices it gives its
    own output), or None. Also the hidden size and dtype of the layer inputs."""
    body = decoder_body(model)
    calls: dict[int, tuple] = {}
    hooks = []

    def record(module, args, kwargs, out):
        calls.setdefault(id(module), (args, kwargs, out))

    for layer in layers:
        hooks.append(layer.register_forward_hook(record, with_kwargs=True))
        for _, child in layer.named_children():
            hooks.append(child.register_forward_hook(record, with_kwargs=True))
    vocab = head(model).weight.shape[0]
    device = next(layer.parameters()).device
    ids = torch.arange(1, _PROBE_TOKENS + 1, device=device).remainder(vocab).unsqueeze(0)
    # dropout off (the probe compares layouts, not random masks), on the dropout and attention modules alone: a
    # whole model in eval mode would let bitsandbytes repack its 4-bit layers for CPU inference at this call
    modes = [m.training for m in model.modules()]
    for m in model.modules():
        if isinstance(m, nn.Dropout) or float(getattr(m, "attention_dropout", 0.0) or 0.0) > 0:
            m.training = False
    try:
        with layer_weight_cache():
            body(input_ids=ids, use_cache=False)
    finally:
        for h in hooks:
            h.remove()
        for m, mode in zip(model.modules(), modes):
            m.training = mode
    out = []
    for layer in layers:
        if id(layer) not in calls:
            raise AnatomyError(f"{type(layer).__name__}: the probe's forward did not reach this layer")
        args, kwargs, y = calls[id(layer)]
        if not isinstance(y, torch.Tensor):
            raise AnatomyError(
                f"{type(layer).__name__} returns {type(y).__name__}, not a tensor: offloaded "
                "checkpointing passes one tensor between layers"
            )
        x, named = _call_args(inspect.signature(layer.forward), args, kwargs)
        info = dict(mode="whole", mlp=None, hidden=x.shape[-1], dtype=x.dtype)
        if _split_layout(layer) and named.get("position_embeddings") is not None:
            attn_kwargs = {k: v for k, v in named.items() if k not in ("attention_mask", "position_embeddings")}
            try:
                mine = _chunked_forward(
                    layer,
                    x,
                    *named["position_embeddings"],
                    named.get("attention_mask"),
                    attn_kwargs,
                    _sliding_window(layer.self_attn),
                    _PROBE_CHUNK,
                )
            except Exception:  # noqa: BLE001 - any failure means: not this layout
                mine = None
            if _close(mine, y):
                info["mode"] = "split"
        if info["mode"] == "whole":
            info["mlp"] = _position_wise_child(layer, calls, x)
        out.append(info)
    return out


def _position_wise_child(layer: nn.Module, calls: dict, x: torch.Tensor) -> str | None:
    """The name of the layer's largest position-wise child, or None."""
    best, best_n = None, 2 * x.shape[-1]  # larger than any norm's weights
    for name, child in layer.named_children():
        rec = calls.get(id(child))
        if rec is None:
            continue
        args, kwargs, y = rec
        n = sum(p.numel() for p in child.parameters())
        if n <= best_n or kwargs or len(args) != 1 or not isinstance(args[0], torch.Tensor):
            continue
        if args[0].shape != x.shape or _mlp_out(y).shape != x.shape:
            continue
        try:
            sliced = _mlp_slices(child, args[0], max(1, args[0].shape[1] // 2))
        except Exception:  # noqa: BLE001 - any failure means: not position-wise as called
            continue
        same = isinstance(y, torch.Tensor) == isinstance(sliced, torch.Tensor) and _close(_mlp_out(sliced), _mlp_out(y))
        if same:
            best, best_n = name, n
    return best


# --------------------------------------------------------------------------- public API


def enable_offloaded_checkpointing(
    model: nn.Module,
    *,
    offload: bool = True,
    pin_memory: bool = True,
    min_bytes: int = 2 * 2**20,
    prefetch: bool = True,
    chunk_tokens: int | None = None,
    _offload_on_cpu: bool = False,
) -> nn.Module:
    """Turn on offloaded checkpointing for every decoder layer of ``model``.

    Args:
        model: a transformers ``*ForCausalLM`` of any family whose decoder layers pass one hidden-state tensor on
            (:func:`grpo_kit.model.anatomy.decoder_layers`), or a PEFT model wrapping one.
        offload: copy each layer input (B, T, H) to host RAM during forward (False: keep it on
            the GPU, still recompute and chunk).
        pin_memory: page-lock the host buffers (fast async copies); falls back to pageable
            memory with a warning when it cannot.
        min_bytes: inputs smaller than this stay on the GPU (a copy would cost more than it saves).
        prefetch: in backward, start bringing back the previous layer's input while this one
            recomputes (costs one more layer input of GPU memory).
        chunk_tokens: tokens (batch x sequence) per slice of per-token work (norms, projections,
            MLP). Smaller: lower peak, smaller matmuls. None: so that one (tokens x intermediate)
            activation is <= 2**26 elements (4096 for Llama-3.1-8B, 4096 for Qwen2.5-1.5B).
        _offload_on_cpu: testing only: "offload" CPU tensors too (into the host buffer pool), so
            the pool and prefetch logic run on machines without CUDA.

    Each layer's mode (``split`` or ``whole``, the module docstring) is chosen by a probe, one forward of a few
    tokens (:func:`_probe`); ``layer_modes(model)`` reports them. Calling it again updates the options (no double
    wrapping). HF's own gradient checkpointing flag is switched off on the wrapped layers (it would recompute
    twice) and restored by :func:`disable_offloaded_checkpointing`. Returns ``model``. A model whose layers cannot
    be wrapped raises :class:`grpo_kit.model.anatomy.AnatomyError` naming what was not found.
    """
    for name, val in (("offload", offload), ("pin_memory", pin_memory), ("prefetch", prefetch)):
        if not isinstance(val, bool):
            raise ValueError(f"{name} must be a bool, got {val!r}")
    if isinstance(min_bytes, bool) or not isinstance(min_bytes, int) or min_bytes < 0:
        raise ValueError(f"min_bytes must be an int >= 0, got {min_bytes!r}")
    if chunk_tokens is not None and (
        isinstance(chunk_tokens, bool) or not isinstance(chunk_tokens, int) or chunk_tokens < 1
    ):
        raise ValueError(f"chunk_tokens must be None or an int >= 1, got {chunk_tokens!r}")
    try:
        layers = decoder_layers(model)
    except AnatomyError as e:
        raise AnatomyError(f"enable_offloaded_checkpointing: {e}") from None
    opts = dict(
        offload=offload,
        pin_memory=pin_memory,
        min_bytes=min_bytes,
        prefetch=prefetch,
        chunk_tokens=chunk_tokens,
        offload_cpu=_offload_on_cpu,
    )
    existing = [l.__dict__[_STATE_ATTR]["offloader"] for l in layers if _STATE_ATTR in l.__dict__]
    if existing:
        offloader = existing[0]
        offloader.configure(**opts)
    else:
        offloader = _Offloader(**opts)
    new = [l for l in layers if _STATE_ATTR not in l.__dict__]
    probed = dict(zip(map(id, new), _probe(model, new))) if new else {}
    for i, layer in enumerate(layers):
        if _STATE_ATTR in layer.__dict__:
            layer.__dict__[_STATE_ATTR].update(offloader=offloader, index=i, is_last=i == len(layers) - 1)
            continue
        info = probed[id(layer)]
        had_instance_forward = "forward" in layer.__dict__
        mlp = (
            getattr(layer, "mlp", None)
            if info["mode"] == "split"
            else (getattr(layer, info["mlp"]) if info["mlp"] else None)
        )
        state = dict(
            offloader=offloader,
            index=i,
            is_last=i == len(layers) - 1,
            mode=info["mode"],
            hidden=info["hidden"],
            dtype=info["dtype"],
            signature=inspect.signature(layer.forward),
            orig_forward=layer.forward,
            instance_forward=layer.__dict__.get("forward") if had_instance_forward else None,
            had_instance_forward=had_instance_forward,
            sliding=_sliding_window(layer.self_attn) if info["mode"] == "split" else None,
            auto_chunk=_auto_chunk_tokens(mlp) if mlp is not None else 16384,
            hf_gc=getattr(layer, "gradient_checkpointing", None),
            mlp=info["mlp"],
        )
        layer.__dict__[_STATE_ATTR] = state
        if info["mlp"] is not None:
            _wrap_mlp(mlp, state, offloader)
        if getattr(layer, "gradient_checkpointing", False):
            layer.gradient_checkpointing = False
        layer.forward = types.MethodType(_wrapped_forward, layer)
    return model


def _wrap_mlp(mlp: nn.Module, layer_state: dict, offloader: _Offloader) -> None:
    """Run ``mlp`` (a whole-mode layer's position-wise child) over slices of tokens (:func:`_chunked_mlp_forward`)."""
    had = "forward" in mlp.__dict__
    mlp.__dict__[_MLP_ATTR] = dict(
        orig_forward=mlp.forward,
        had_instance_forward=had,
        instance_forward=mlp.__dict__.get("forward"),
        chunk=lambda: offloader.chunk_tokens or layer_state["auto_chunk"],
        dropout=any(isinstance(m, nn.Dropout) and m.p > 0 for m in mlp.modules()),
    )
    mlp.forward = types.MethodType(_chunked_mlp_forward, mlp)


def layer_modes(model: nn.Module) -> dict[str, int]:
    """``{mode: number of layers}`` of an enabled model, a whole-mode layer counted as ``whole+mlp`` where its
    MLP runs in slices."""
    counts: dict[str, int] = {}
    for layer in model.modules():
        st = layer.__dict__.get(_STATE_ATTR)
        if st is not None:
            key = st["mode"] + ("+mlp" if st["mode"] == "whole" and st["mlp"] else "")
            counts[key] = counts.get(key, 0) + 1
    return counts


def disable_offloaded_checkpointing(model: nn.Module) -> nn.Module:
    """Undo :func:`enable_offloaded_checkpointing`: each layer gets back its original forward
    (the class method, or the instance attribute it had before) and its HF checkpointing flag;
    the host buffers are released. A no-op on a model that was never enabled."""
    offloaders = set()
    for layer in model.modules():
        st = layer.__dict__.pop(_STATE_ATTR, None)
        if st is None:
            continue
        offloaders.add(id(st["offloader"]))
        st["offloader"].pool.clear()
        if st["mlp"] is not None:
            _restore_forward(getattr(layer, st["mlp"]), getattr(layer, st["mlp"]).__dict__.pop(_MLP_ATTR))
        _restore_forward(layer, st)
        if st["hf_gc"] is not None:
            layer.gradient_checkpointing = st["hf_gc"]
    return model


def _restore_forward(module: nn.Module, st: dict) -> None:
    """The module's forward as it was before wrapping: its instance attribute, or the class method."""
    if st["had_instance_forward"]:
        module.forward = st["instance_forward"]
    else:
        del module.forward


def keep_hf_checkpointing_off(model: nn.Module) -> int:
    """Switch HF's own per-layer checkpointing flag off again on the layers this module wraps, and return
    how many it was on for. HF ``Trainer.train()`` calls ``gradient_checkpointing_enable()`` when its
    arguments ask for checkpointing, after the trainer was built, and HF's checkpoint then wraps the wrapped
    layer. With ``use_reentrant=True`` that recomputes each layer once more per micro-batch (and offloads its
    input twice); with the default non-reentrant checkpoint it finds nothing saved to recompute."""
    n = 0
    for layer in model.modules():
        if _STATE_ATTR in layer.__dict__ and getattr(layer, "gradient_checkpointing", False):
            layer.gradient_checkpointing = False
            n += 1
    return n


def offload_stats(model: nn.Module) -> dict:
    """Host-buffer figures of an enabled model: bytes allocated (free + in use), of which
    page-locked, and free buffers in the pool. Zeros when not enabled."""
    for layer in model.modules():
        st = layer.__dict__.get(_STATE_ATTR)
        if st is not None:
            pool = st["offloader"].pool
            return dict(host_bytes=pool.allocated_bytes, pinned_bytes=pool.pinned_bytes, free_buffers=len(pool.free))
    return dict(host_bytes=0, pinned_bytes=0, free_buffers=0)


def reserve_offload_buffers(model: nn.Module, batch_size: int, seq_len: int) -> int:
    """Allocate (and page-lock) the host buffers a (batch_size, seq_len) micro-batch will use,
    before training: page-locking is slow, and is otherwise paid inside the
    first step (and again whenever a longer micro-batch arrives). Returns bytes now pooled.

    Only when offloading applies (enabled with ``offload=True`` on CUDA); else returns 0.
    """
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be an int >= 1, got {batch_size!r}")
    if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 1:
        raise ValueError(f"seq_len must be an int >= 1, got {seq_len!r}")
    layers = [l for l in model.modules() if _STATE_ATTR in l.__dict__]
    if not layers:
        raise ValueError("reserve_offload_buffers: call enable_offloaded_checkpointing(model) first")
    off: _Offloader = layers[0].__dict__[_STATE_ATTR]["offloader"]
    param = next(layers[0].parameters())
    on_cuda = param.is_cuda
    if not off.offload or not (on_cuda or off.offload_cpu):
        return 0
    st = layers[0].__dict__[_STATE_ATTR]
    hidden, dtype = st["hidden"], st["dtype"]
    nbytes = batch_size * seq_len * hidden * torch.empty((), dtype=dtype).element_size()
    if nbytes < off.min_bytes:
        return 0
    stream = off.side_stream(param.device)
    # the last layer keeps its input on the device; take them all, then give them all back
    taken = [off.pool.acquire(nbytes, stream) for _ in range(len(layers) - 1)]
    for b in taken:
        off.pool.release(b)
    return sum(b.nbytes for b in off.pool.free)
