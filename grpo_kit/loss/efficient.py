"""The GRPO loss from final hidden states, chunk by chunk, never holding the (B, T, V) logits.

Notation (shapes; dtypes): B completions, T completion tokens, H hidden size, V vocabulary. The objective
itself (ratio, the loss types of :mod:`grpo_kit.loss.registry`, importance weights, KL, entropy mask,
normalisation) is written once, in :mod:`grpo_kit.loss.objective`;
:func:`grpo_kit.loss.reference.grpo_loss_reference` sums it over per-token log-probs, and this module evaluates
the same sum (:func:`grpo_kit.loss.reference.objective_loss`) over the log-probs it computes itself.

* ``efficient_grpo_loss(hidden, lm_head_weight, ...)`` starts from the final hidden states (B, T, H): it runs over
  chunks of token rows, computes one (rows, V) logits chunk in the input dtype, takes an fp32 log-softmax of it,
  and computes the gradient w.r.t. hidden (and the head weight/bias if they require grad) right there, before any
  backward. The chain rule needs one number per token, c = dL/dlogp: the gradient w.r.t. the chunk's logits is
  c * (onehot - softmax) / temperature, and row t of the hidden gradient is c_t * d logp_t / d hidden_t. So the
  first pass stores d logp/d hidden per row; after it, c is autograd of the objective over all (B, T) log-probs
  (normalisers fixed from the mask; GSPO's sequence ratio, VESPO's sequence weight and the entropy quantile then
  known too) and each row is scaled by its c: exact, no per-chunk work beyond the head's GEMMs and the epilogue.
  A trainable head's weight/bias gradient sums over tokens, so it needs c inside the loop: with a token-local
  spec (``ObjectiveSpec.token_local``) c is then autograd of the objective over the chunk's (rows,) log-prob
  vector; with coupled tokens a second pass over the chunks recomputes the logits and adds it. Backward only
  scales the stored gradient by the incoming one. Matmul work: 4*B*T*H*V FLOPs (logits, hidden gradient);
  6 with a trainable head and a token-local objective; 8 with a trainable head and coupled tokens (the
  second pass's logits and head gradient).

* ``per_token_logps(hidden, lm_head_weight, ids)``: the same chunked log-probs, no grad, for the
  reference-model and old-policy passes.

``hidden[:, t]`` predicts ``completion_ids[:, t]`` (shift already applied by the caller).

Logit forms other than ``h @ W^T + b`` (``logit_scale``, ``logit_softcap``): the logits are ``z * scale``, then
``softcap * tanh(z * scale / softcap)`` where a soft-cap is set, before the temperature, as the model's own forward
forms them (Granite's ``1 / logits_scaling``, Gemma's ``final_logit_softcapping``). A scale alone folds into the
temperature; a soft-cap multiplies the chunk's logit gradient by its derivative ``scale * (1 - tanh^2)``, kept per
chunk beside the logits.
"""

from __future__ import annotations

import dataclasses
import math
import numbers

import torch

from grpo_kit.kernels import grpo_epilogue as _epi
from grpo_kit.loss.checks import check_inputs, objective_spec
from grpo_kit.loss.objective import MAX_LOG_GAP, objective_metrics, per_token_objective, token_weights
from grpo_kit.loss.reference import engine_metrics, objective_loss

# Budget for one chunk of logits (plus the torch epilogue's fp32 temporaries when it is used).
_CHUNK_BUDGET_BYTES = 256 * 2**20


def auto_chunk_rows(vocab, dtype, device, backend, n_tokens=0, softcap=False):
    """Rows per chunk so that one logits chunk (plus epilogue temporaries, and a soft-cap's derivative and fp32
    tanh) and the per-token fp32/int64 vectors (~48 bytes a token: weights, advantages, old/ref/log-probs, ids)
    fit in ~0.25 GiB."""
    elt = torch.empty((), dtype=dtype).element_size()
    per_row = vocab * elt
    if backend == "torch":
        per_row += vocab * 4 * 3  # fp32 copies made by the torch epilogue
    if softcap:
        per_row += vocab * (elt + 4)
    budget = max(_CHUNK_BUDGET_BYTES - 48 * n_tokens, _CHUNK_BUDGET_BYTES // 4)
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        budget = min(budget, free // 4)
    rows = max(1, budget // per_row)
    # Whole 256-row GEMM tiles: a partly filled last tile wastes more than the extra launches cost.
    for step in (256, 64):
        if rows >= 2 * step:
            return int(rows // step * step)
    return int(rows)


def _check_head(hidden, lm_head_weight, lm_head_bias, ids, ids_name):
    if not isinstance(hidden, torch.Tensor) or hidden.dim() != 3 or not hidden.is_floating_point():
        raise ValueError(f"hidden must be a floating tensor (B, T, H), got {getattr(hidden, 'shape', type(hidden))}")
    B, T, H = hidden.shape
    if not isinstance(lm_head_weight, torch.Tensor) or lm_head_weight.dim() != 2 or lm_head_weight.shape[1] != H:
        raise ValueError(f"lm_head_weight must be (V, H={H}), got {tuple(getattr(lm_head_weight, 'shape', ()))}")
    if lm_head_weight.dtype != hidden.dtype:
        raise ValueError(f"lm_head_weight dtype {lm_head_weight.dtype} must equal hidden dtype {hidden.dtype}")
    if lm_head_weight.device != hidden.device:
        raise ValueError(f"lm_head_weight is on {lm_head_weight.device}, hidden on {hidden.device}")
    V = lm_head_weight.shape[0]
    if lm_head_bias is not None:
        if lm_head_bias.shape != (V,) or lm_head_bias.dtype != hidden.dtype:
            raise ValueError(
                f"lm_head_bias must be ({V},) {hidden.dtype}, got {tuple(lm_head_bias.shape)} {lm_head_bias.dtype}"
            )
    if not isinstance(ids, torch.Tensor) or ids.dtype.is_floating_point or ids.dtype == torch.bool or ids.is_complex():
        raise ValueError(f"{ids_name} must be an integer tensor")
    if tuple(ids.shape) != (B, T):
        raise ValueError(f"{ids_name} must have shape ({B}, {T}), got {tuple(ids.shape)}")
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= V):
        raise ValueError(f"{ids_name} must lie in [0, {V}), got range [{int(ids.min())}, {int(ids.max())}]")
    return B, T, H, V


def _check_temperature_chunk(temperature, chunk_size, logit_scale=1.0, logit_softcap=None):
    if not isinstance(temperature, numbers.Real) or not math.isfinite(temperature) or temperature <= 0:
        raise ValueError(f"temperature must be a finite number > 0, got {temperature!r}")
    if not isinstance(logit_scale, numbers.Real) or not math.isfinite(logit_scale) or logit_scale == 0:
        raise ValueError(f"logit_scale must be a finite non-zero number, got {logit_scale!r}")
    if logit_softcap is not None and (
        not isinstance(logit_softcap, numbers.Real) or not math.isfinite(logit_softcap) or logit_softcap <= 0
    ):
        raise ValueError(f"logit_softcap must be None or a finite number > 0, got {logit_softcap!r}")
    if chunk_size is not None and (not isinstance(chunk_size, numbers.Integral) or chunk_size <= 0):
        raise ValueError(f"chunk_size must be a positive int or None, got {chunk_size!r}")


def _row_gather(hidden, rows, s, e):
    """Rows [s, e) of the flattened (B*T, H) view, or the rows named by ``rows[s:e]``."""
    B, T, H = hidden.shape
    if rows is None and hidden.is_contiguous():
        return hidden.view(B * T, H)[s:e]
    idx = torch.arange(s, e, device=hidden.device) if rows is None else rows[s:e]
    if hidden.is_contiguous():
        return hidden.view(B * T, H).index_select(0, idx)
    return hidden[idx // T, idx % T]


def _logits(h_c, weight, bias):
    """(n, V) logits chunk in the input dtype (fp32 accumulation inside the matmul)."""
    return torch.mm(h_c, weight.t()) if bias is None else torch.addmm(bias, h_c, weight.t())


def _softcapped(z, scale, cap):
    """``(cap * tanh(z * scale / cap), its derivative w.r.t. z)``, both in z's dtype (tanh in fp32)."""
    t = torch.tanh(z.float().mul_(scale / cap))
    d = (1.0 - t * t).mul_(scale).to(z.dtype)
    return t.mul_(cap).to(z.dtype), d


def _chunk_coefficient(spec, logp, w, adv, old, ref, isw):
    """dL/dlogp of a chunk's (n,) token rows under a token-local spec: autograd of the objective over
    the chunk's log-prob vector (elementwise, so this is a few (n,) vector ops). w: the rows'
    normaliser weights; the others (n,) fp32 or None."""
    with torch.enable_grad():
        x = logp.detach().requires_grad_()
        per_tok, _ = per_token_objective(x, old, ref, adv, None, spec, importance_weights=isw)
        (grad,) = torch.autograd.grad((w * per_tok).sum(), x)
    return grad


def _pow2_scale(x_max):
    """A power of two that brings the largest per-token coefficient to O(1): otherwise fp16 chunks
    underflow (a normaliser can be ~1/(B*T)). Exact in binary, undone in backward."""
    return 2.0 ** (-math.floor(math.log2(x_max))) if x_max > 0 else 1.0


class _ChunkedHead:
    """The output head over a batch's active token rows, one (rows, V) logits chunk at a time, and the gradient
    buffers the chunks write: hidden (B*T, H) in the input dtype, head weight (V, H) and bias (V,) in fp32.

    hidden (B, T, H); weight (V, H); bias (V,) or None; ids (B*T,) int64; active (B*T,) bool (padding rows are
    skipped entirely); needs: whether hidden, weight, bias get a gradient; scale, softcap: the logit form (module
    docstring).
    """

    def __init__(
        self, hidden, weight, bias, ids, active, *, chunk_rows, temperature, backend, needs, scale=1.0, softcap=None
    ):
        B, T, H = hidden.shape
        self.hidden, self.weight, self.bias, self.n_total = hidden, weight, bias, B * T
        self.n_rows = int(active.sum())
        self.rows = None if self.n_rows == self.n_total else active.nonzero().squeeze(1)
        self.ids = self.select(ids)
        self.chunk_rows, self.backend = int(chunk_rows), backend
        # a scale alone folds into the temperature; under a soft-cap it goes inside the tanh
        self.scale, self.softcap = float(scale), softcap
        self.inv_temp = (1.0 if softcap is not None else self.scale) / temperature
        self._dcap = None  # the current chunk's soft-cap derivative
        need_hidden, need_weight, need_bias = needs
        dev = hidden.device
        self.grad_hidden = self.grad_weight = self.grad_bias = None
        if need_hidden:  # rows never written stay zero: padding
            alloc = torch.empty if self.rows is None else torch.zeros
            self.grad_hidden = alloc(self.n_total, H, dtype=hidden.dtype, device=dev)
        if need_weight:
            self.grad_weight = torch.zeros(weight.shape[0], H, dtype=torch.float32, device=dev)
        if need_bias:
            self.grad_bias = torch.zeros(weight.shape[0], dtype=torch.float32, device=dev)

    @property
    def trains_head(self) -> bool:
        return self.grad_weight is not None or self.grad_bias is not None

    def select(self, x):
        """(B*T,) -> the active rows' (n,); None stays None."""
        return x if x is None or self.rows is None else x.index_select(0, self.rows)

    def scatter(self, x):
        """The active rows' (n,) -> (B*T,), zero on padding; None stays None."""
        if x is None or self.rows is None:
            return x
        return torch.zeros(self.n_total, dtype=x.dtype, device=x.device).index_copy_(0, self.rows, x)

    def chunks(self):
        for start in range(0, self.n_rows, self.chunk_rows):
            yield start, min(start + self.chunk_rows, self.n_rows)

    def logits(self, start, end):
        """(rows of hidden, their logits chunk); a soft-cap applied, its derivative kept for :meth:`accumulate`."""
        h = _row_gather(self.hidden, self.rows, start, end)
        z = _logits(h, self.weight, self.bias)
        if self.softcap is not None:
            z, self._dcap = _softcapped(z, self.scale, self.softcap)
        return h, z

    def log_probs(self, logits, start, end, with_entropy):
        """(logp, logsumexp, entropy or None) of the chunk's tokens, (rows,) fp32."""
        return _epi.lse_logp(logits, self.ids[start:end], self.inv_temp, with_entropy, self.backend)

    def accumulate(self, start, end, h, logits, lse, coef, *, into_hidden, into_head):
        """Add the chunk's gradient for per-token coefficients ``coef`` (rows,): the epilogue turns the logits
        into dL/dz = coef * (softmax - onehot) / temperature in place, then the head's GEMMs."""
        dz = _epi.softmax_grad_(logits, self.ids[start:end], lse, coef, self.inv_temp, self.backend)
        if self._dcap is not None:  # through the soft-cap: d z' / d z
            dz.mul_(self._dcap)
        if into_hidden:
            if self.rows is None:
                torch.mm(dz, self.weight, out=self.grad_hidden[start:end])
            else:
                self.grad_hidden.index_copy_(0, self.rows[start:end], torch.mm(dz, self.weight))
        if into_head and self.grad_weight is not None:
            self.grad_weight.add_(torch.mm(dz.t(), h))
        if into_head and self.grad_bias is not None:
            self.grad_bias.add_(dz.float().sum(0))

    def scale_hidden_rows(self, start, end, coef):
        """Multiply stored rows (d logp / d hidden) by their coefficients (rows,), in fp32."""
        if self.rows is None:
            rows = self.grad_hidden[start:end]
            rows.copy_(rows.float().mul_(coef[:, None]))
        else:
            idx = self.rows[start:end]
            scaled = self.grad_hidden.index_select(0, idx).float().mul_(coef[:, None])
            self.grad_hidden.index_copy_(0, idx, scaled.to(self.grad_hidden.dtype))


def _first_pass(head, *, with_entropy, store_rows, coefficient=None):
    """Log-probs and entropies (None unless ``with_entropy``) of the active rows, (n,) fp32, in one pass over
    the chunks. ``coefficient(start, end, logp_chunk) -> (rows,)``: each row's final (scaled) coefficient,
    written to the hidden and head gradients in the same pass (token-local objective, trainable head); else,
    with ``store_rows``, each hidden-gradient row gets d logp / d hidden, to be scaled once c is known."""
    dev = head.hidden.device
    logp = torch.empty(head.n_rows, dtype=torch.float32, device=dev)
    entropy = torch.empty(head.n_rows, dtype=torch.float32, device=dev) if with_entropy else None
    minus_one = torch.full((min(head.chunk_rows, head.n_rows),), -1.0, dtype=torch.float32, device=dev)
    for start, end in head.chunks():
        h, z = head.logits(start, end)
        logp_chunk, lse, ent = head.log_probs(z, start, end, with_entropy)
        logp[start:end] = logp_chunk
        if entropy is not None:
            entropy[start:end] = ent
        if coefficient is not None:
            head.accumulate(
                start, end, h, z, lse, coefficient(start, end, logp_chunk), into_hidden=store_rows, into_head=True
            )
        elif store_rows:  # coefficient -1 gives dz = d logp / dz
            head.accumulate(start, end, h, z, lse, minus_one[: end - start], into_hidden=True, into_head=False)
        del z
    return logp, entropy


def _apply_coefficients(head, grad_logp):
    """Scale each stored hidden row by its c = dL/dlogp (``grad_logp`` (B*T,) fp32); a trainable head gets its
    gradient from a second pass over the chunks. Returns the power of two c was scaled by."""
    c = head.select(grad_logp)
    scale = _pow2_scale(float(c.abs().max()) if head.n_rows else 0.0)
    c = c * scale
    for start, end in head.chunks():
        if head.grad_hidden is not None:
            head.scale_hidden_rows(start, end, c[start:end])
        if head.trains_head:  # coupled tokens: the head's gradient needs c, known only now
            h, z = head.logits(start, end)
            lse = head.log_probs(z, start, end, False)[1]
            head.accumulate(start, end, h, z, lse, -c[start:end], into_hidden=False, into_head=True)
            del z
    return scale


class _StoredGradients(torch.autograd.Function):
    """Connects the loss to hidden / head weight / bias with their gradients computed before backward
    (``grads``: hidden (B*T, H), weight (V, H) fp32, bias (V,) fp32, each or None); backward rescales them in
    place by the incoming gradient over the power-of-two ``scale`` (so one backward only)."""

    @staticmethod
    def forward(ctx, loss, hidden, weight, bias, grads, scale):
        ctx.grads, ctx.scale, ctx.shape, ctx.wdtype = grads, scale, hidden.shape, weight.dtype
        return loss.clone()

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_loss):
        grad_h, grad_w, grad_b = ctx.grads
        if grad_h is None and grad_w is None and grad_b is None:
            raise RuntimeError("efficient_grpo_loss: backward ran twice on one forward; compute the loss again")
        ctx.grads = (None, None, None)  # stored gradients are rescaled in place: one backward only
        factor = grad_loss.float() / ctx.scale
        if grad_h is not None:
            grad_h = grad_h.mul_(factor).view(ctx.shape)  # in place: no second hidden-sized buffer
        if grad_w is not None:
            grad_w = grad_w.mul_(factor).to(ctx.wdtype)
        if grad_b is not None:
            grad_b = grad_b.mul_(factor).to(ctx.wdtype)
        return None, grad_h, grad_w, grad_b, None, None


@dataclasses.dataclass
class _Batch:
    """The objective's inputs as the chunked loss reads them: mask, normaliser weights (B, T) fp32; advantages
    (B, 1) / (B, T); old, ref, sampling (B, T) and importance weights (B, 1) / (B, T) fp32 or None; all
    detached. ``engine``: None or (mode, clip_min, clip_max)."""

    spec: object
    mask: torch.Tensor
    weights: torch.Tensor
    advantages: torch.Tensor
    old: torch.Tensor | None
    ref: torch.Tensor | None
    importance_weights: torch.Tensor | None
    sampling: torch.Tensor | None
    engine: tuple | None
    entropy_mask_fn: object

    def objective(self, logp, entropy, need_grad):
        """(loss 0-d, dL/dlogp (B*T,) or None, parts) of the objective over all tokens' log-probs (B*T,)."""
        B, T = self.mask.shape
        x = logp.view(B, T).detach().requires_grad_(need_grad)
        ent = None if entropy is None else entropy.view(B, T)
        with torch.enable_grad() if need_grad else torch.no_grad():
            loss, parts = objective_loss(
                x,
                self.spec,
                self.mask,
                self.advantages,
                self.old,
                self.ref,
                self.importance_weights,
                ent,
                self.entropy_mask_fn,
                self.weights,
                self.sampling,
                self.engine,
            )
            grad = torch.autograd.grad(loss, x)[0].reshape(B * T) if need_grad else None
        return loss.detach(), grad, parts

    def token_inputs(self, head):
        """Normaliser weights, advantages, old, ref, importance weights of the active rows: (n,) fp32 or None."""
        B, T = self.mask.shape
        return [
            None if x is None else head.select(x.expand(B, T).reshape(B * T))
            for x in (self.weights, self.advantages, self.old, self.ref, self.importance_weights)
        ]


def _in_loop_coefficient(batch, head):
    """``coefficient(start, end, logp_chunk)`` for :func:`_first_pass` under a token-local spec, and the
    power of two it scales by (the largest normaliser weight brought to O(1))."""
    weights, adv, old, ref, isw = batch.token_inputs(head)
    scale = _pow2_scale(float(weights.max()) if head.n_rows else 0.0)

    def coefficient(start, end, logp):
        rows = (None if x is None else x[start:end] for x in (old, ref, isw))
        return -_chunk_coefficient(batch.spec, logp, weights[start:end], adv[start:end], *rows) * scale

    return coefficient, scale


def efficient_grpo_loss(
    hidden,
    lm_head_weight,
    completion_ids,
    completion_mask,
    advantages,
    *,
    old_logps=None,
    ref_logps=None,
    beta=0.0,
    epsilon_low=0.2,
    epsilon_high=None,
    loss_type="grpo",
    temperature=1.0,
    max_completion_length=None,
    num_items_in_batch=None,
    chunk_size=None,
    lm_head_bias=None,
    compute_entropy=False,
    epilogue="auto",
    importance_weights=None,
    entropy_mask_fn=None,
    sampling_logps=None,
    engine_correction=None,
    logit_scale=1.0,
    logit_softcap=None,
    **options,
):
    """GRPO loss from final hidden states without materialising (B, T, V) logits.

    hidden: (B, T, H) bf16/fp16/fp32, ``hidden[:, t]`` predicts ``completion_ids[:, t]``;
    lm_head_weight: (V, H), same dtype; completion_ids: (B, T) int in [0, V);
    completion_mask: (B, T) bool/int/float; advantages: (B,), (B, 1) or (B, T) float;
    old_logps / ref_logps: (B, T) float or None (ref needed when beta != 0).
    ``importance_weights``: None or (B, T) / (B, 1) / (B,) float, no gradient (TRL's
    ``importance_sampling_ratio``). ``entropy_mask_fn``, ``sampling_logps``, ``engine_correction`` and
    ``options``: as in :func:`grpo_kit.loss.reference.grpo_loss_reference`; the entropy of the same chunk pass
    feeds the entropy mask. ``chunk_size``: token rows per logits chunk (None: from free memory, ~0.25 GiB of
    logits). ``epilogue``: 'auto' (Triton on CUDA), 'triton' or 'torch'. ``logit_scale``, ``logit_softcap``: the
    model's logit form (module docstring; :func:`grpo_kit.model.anatomy.logit_form` reads it from a config).

    Returns (loss: 0-d fp32, metrics: dict of detached 0-d fp32 tensors, same keys as
    :func:`grpo_kit.loss.reference.grpo_loss_reference` plus ``entropy`` when ``compute_entropy``). Gradients
    reach ``hidden`` and, only if they require grad, ``lm_head_weight`` / ``lm_head_bias``. The stored
    gradient allows one backward per call.
    """
    spec = objective_spec(loss_type, beta, epsilon_low, epsilon_high, options)
    _check_temperature_chunk(temperature, chunk_size, logit_scale, logit_softcap)
    B, T, H, V = _check_head(hidden, lm_head_weight, lm_head_bias, completion_ids, "completion_ids")
    adv, isw, engine = check_inputs(
        spec,
        B,
        T,
        completion_mask,
        advantages,
        old_logps,
        ref_logps,
        importance_weights,
        max_completion_length,
        num_items_in_batch,
        engine_correction,
        sampling_logps,
    )
    backend = _epi.resolve_backend(epilogue, hidden.device)
    if chunk_size is None:
        chunk_size = auto_chunk_rows(
            V, hidden.dtype, hidden.device, backend, n_tokens=B * T, softcap=logit_softcap is not None
        )
    batch = _Batch(
        spec,
        completion_mask.float(),
        token_weights(completion_mask, loss_type, max_completion_length, num_items_in_batch),
        adv.detach().float(),
        _fp32(old_logps),
        None if spec.beta == 0 else _fp32(ref_logps),
        _fp32(isw),
        _fp32(sampling_logps),
        engine,
        entropy_mask_fn,
    )
    grad_on = torch.is_grad_enabled()
    needs = (
        grad_on and hidden.requires_grad,
        grad_on and lm_head_weight.requires_grad,
        grad_on and lm_head_bias is not None and lm_head_bias.requires_grad,
    )
    head = _ChunkedHead(
        hidden,
        lm_head_weight,
        lm_head_bias,
        completion_ids.reshape(B * T).long(),
        batch.weights.reshape(B * T) != 0,
        chunk_rows=chunk_size,
        temperature=float(temperature),
        backend=backend,
        needs=needs,
        scale=logit_scale,
        softcap=logit_softcap,
    )
    with torch.no_grad():
        loss, logp, entropy, parts, scale = _loss_and_gradients(batch, head, bool(compute_entropy))
    if any(needs):
        grads = (head.grad_hidden, head.grad_weight, head.grad_bias)
        loss = _StoredGradients.apply(loss, hidden, lm_head_weight, lm_head_bias, grads, scale)
    if not bool(torch.isfinite(logp).all()):
        # one sync; checked on the outputs so that the inputs need no extra full pass
        raise ValueError("the GRPO loss is not finite: hidden or lm_head_weight (or lm_head_bias) hold NaN/inf")
    if not bool(torch.isfinite(loss)):  # gaps are clamped (MAX_LOG_GAP): only astronomic advantages get here
        raise ValueError(
            f"the GRPO loss overflowed fp32: advantages up to {float(adv.abs().max()):.3g} times a "
            f"ratio up to e^{MAX_LOG_GAP:.0f}; check the rewards' scale"
        )
    ent = entropy.view(B, T) if entropy is not None and compute_entropy else None
    metrics = objective_metrics(parts, batch.advantages, batch.mask, spec, ent)
    return loss, {**metrics, **engine_metrics(logp.view(B, T), batch.old, batch.sampling, batch.mask, parts)}


def _fp32(x):
    return None if x is None else x.detach().float()


def _loss_and_gradients(batch, head, compute_entropy):
    """The chunk passes and the objective: (loss 0-d, logp (B*T,), entropy (B*T,) or None, parts, scale), the
    gradients left in ``head``'s buffers, pre-multiplied by the power of two ``scale``."""
    need_hidden = head.grad_hidden is not None
    # Coefficients in the loop only where a head gradient needs them and the spec allows it (the engine's
    # weights may couple a sequence's tokens): the autograd call per chunk is ~45 small kernels, while
    # scaling stored rows after the loop is one pass.
    in_loop = batch.spec.token_local and batch.engine is None and head.trains_head
    coefficient, scale = _in_loop_coefficient(batch, head) if in_loop else (None, 1.0)
    with_entropy = compute_entropy or batch.spec.top_entropy_quantile < 1.0
    logp, entropy = _first_pass(head, with_entropy=with_entropy, store_rows=need_hidden, coefficient=coefficient)
    logp, entropy = head.scatter(logp), head.scatter(entropy)
    loss, grad_logp, parts = batch.objective(logp, entropy, (need_hidden or head.trains_head) and not in_loop)
    if grad_logp is not None:
        scale = _apply_coefficients(head, grad_logp)
    return loss, logp, entropy, parts, scale


def per_token_logps(
    hidden,
    lm_head_weight,
    ids,
    *,
    temperature=1.0,
    chunk_size=None,
    lm_head_bias=None,
    epilogue="auto",
    logit_scale=1.0,
    logit_softcap=None,
):
    """Chunked log p(ids[:, t] | hidden[:, t]) without grad, for reference / old-policy passes.

    hidden: (B, T, H); lm_head_weight: (V, H) same dtype; ids: (B, T) int in [0, V); ``logit_scale``,
    ``logit_softcap``: the model's logit form, as in :func:`efficient_grpo_loss`.
    Returns (B, T) fp32. Only one (chunk_size, V) logits chunk exists at a time.
    """
    _check_temperature_chunk(temperature, chunk_size, logit_scale, logit_softcap)
    B, T, H, V = _check_head(hidden, lm_head_weight, lm_head_bias, ids, "ids")
    backend = _epi.resolve_backend(epilogue, hidden.device)
    if chunk_size is None:
        chunk_size = auto_chunk_rows(V, hidden.dtype, hidden.device, backend, softcap=logit_softcap is not None)
    N = B * T
    ids_n = ids.reshape(N).long()
    inv_temp = (1.0 if logit_softcap is not None else float(logit_scale)) / temperature
    out = torch.empty(N, dtype=torch.float32, device=hidden.device)
    for s in range(0, N, chunk_size):
        e = min(s + chunk_size, N)
        z = _logits(_row_gather(hidden, None, s, e), lm_head_weight, lm_head_bias)
        if logit_softcap is not None:
            z = _softcapped(z, float(logit_scale), float(logit_softcap))[0]
        out[s:e] = _epi.lse_logp(z, ids_n[s:e], inv_temp, False, backend)[0]
    if not bool(torch.isfinite(out).all()):
        raise ValueError("per_token_logps: non-finite log-probs; hidden or lm_head_weight (or bias) hold NaN/inf")
    return out.view(B, T)
