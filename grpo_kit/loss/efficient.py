"""The GRPO loss: a readable reference and a chunked, memory-efficient twin with the same numbers.

Notation (shapes; dtypes): B completions, T completion tokens, H hidden size, V vocabulary. The
objective itself (ratio, clipping variants, importance weights, KL, entropy mask, ``loss_type``
normalisation) is written once, in :mod:`grpo_kit.loss.objective`; both functions here evaluate it.

* ``grpo_loss_reference(logps, ...)`` works on per-token log-probs (B, T): it fills padding,
  calls :func:`grpo_kit.loss.objective.per_token_objective` and sums it with
  :func:`grpo_kit.loss.objective.token_weights`. Options are TRL 1.16 ``GRPOConfig``'s
  (:class:`grpo_kit.loss.objective.ObjectiveSpec`).

* ``efficient_grpo_loss(hidden, lm_head_weight, ...)`` starts from the final hidden states
  (B, T, H) and never builds the (B, T, V) logits: it runs over chunks of token rows, computes
  one (rows, V) logits chunk in the input dtype, takes an fp32 log-softmax of it, and computes the
  gradient w.r.t. hidden (and the head weight/bias if they require grad) right there, in the
  forward. The chain rule needs one number per token, c = dL/dlogp: the gradient w.r.t. the
  chunk's logits is c * (onehot - softmax) / temperature, and row t of the hidden gradient is
  c_t * d logp_t / d hidden_t. So the loop stores d logp/d hidden per row; after it, c is autograd
  of the objective over all (B, T) log-probs (normalisers fixed from the mask; GSPO's sequence
  ratio, VESPO's sequence weight and the entropy quantile then known too) and each row is scaled
  by its c: one pass, exact, no per-chunk work beyond the head's GEMMs and the epilogue. A
  trainable head's weight/bias gradient sums over tokens, so it needs c inside the loop: with a
  token-local spec (``ObjectiveSpec.token_local``) c is then autograd of the objective over the
  chunk's (rows,) log-prob vector; with coupled tokens a second pass over the chunks adds it.
  Backward only scales the stored gradient by the incoming one; matmul work stays at the naive
  4*B*T*H*V FLOPs (6 with a trainable head).

* ``per_token_logps(hidden, lm_head_weight, ids)``: the same chunked log-probs, no grad, for the
  reference-model and old-policy passes.

``hidden[:, t]`` predicts ``completion_ids[:, t]`` (shift already applied by the caller).
"""

from __future__ import annotations

import dataclasses
import math
import numbers

import torch

from grpo_kit.kernels import grpo_epilogue as _epi

from grpo_kit.loss.objective import (MAX_LOG_GAP, ObjectiveSpec, check_engine_correction, check_normaliser_args,
                        engine_importance_metrics, engine_importance_weights, high_entropy_mask, objective_metrics,
                        per_token_objective, token_weights)

# Budget for one chunk of logits (plus the torch epilogue's fp32 temporaries when it is used).
_CHUNK_BUDGET_BYTES = 256 * 2**20
_SPEC_FIELDS = tuple(f.name for f in dataclasses.fields(ObjectiveSpec))


# ================================================================================================
# argument checks shared by both paths
# ================================================================================================
def objective_spec(loss_type, beta, epsilon_low, epsilon_high, options) -> ObjectiveSpec:
    """The :class:`ObjectiveSpec` of one call; ``options``: the remaining TRL-named keywords."""
    unknown = sorted(set(options) - set(_SPEC_FIELDS))
    if unknown:
        raise ValueError(f"unknown loss option(s) {unknown}; allowed: {list(_SPEC_FIELDS)}")
    return ObjectiveSpec(loss_type=loss_type, beta=beta, epsilon_low=epsilon_low, epsilon_high=epsilon_high,
                         **options)


def _check_token_tensor(name, x, shape, *, allow_none=True, mask=None):
    """(B, T) floating tensor, finite where ``mask`` is non-zero (padding may hold anything)."""
    if x is None:
        if allow_none:
            return
        raise ValueError(f"{name} is required here")
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        raise ValueError(f"{name} must be a floating tensor, got {type(x).__name__} {getattr(x, 'dtype', '')}")
    if tuple(x.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {tuple(shape)}, got {tuple(x.shape)}")
    bad = ~torch.isfinite(x)
    if mask is not None:
        bad = bad & (mask != 0)
    if bool(bad.any()):
        raise ValueError(f"{name} holds NaN or inf at unmasked positions")


def _check_importance_weights(weights, batch, length, mask):
    """None, or a floating (B, T) / (B, 1) / (B,) tensor, finite and >= 0 where ``mask`` is
    non-zero; returned as (B, T) or (B, 1)."""
    if weights is None:
        return None
    if not isinstance(weights, torch.Tensor) or not weights.is_floating_point():
        raise ValueError("importance_weights must be None or a floating tensor of shape (B, T), (B, 1) or (B,), got "
                         f"{type(weights).__name__} {getattr(weights, 'dtype', '')}")
    if tuple(weights.shape) not in ((batch,), (batch, 1), (batch, length)):
        raise ValueError(f"importance_weights must have shape ({batch}, {length}), ({batch}, 1) or ({batch},), got "
                         f"{tuple(weights.shape)}")
    weights = weights.view(batch, 1) if weights.dim() == 1 else weights
    bad = ~torch.isfinite(weights) | (weights < 0)
    if weights.shape[1] == length:
        bad = bad & (mask != 0)
    else:
        bad = bad & (mask != 0).any(-1, keepdim=True)
    if bool(bad.any()):
        raise ValueError("importance_weights hold NaN, inf or a negative value at unmasked positions")
    return weights


def _check_advantages(advantages, batch, length):
    if not isinstance(advantages, torch.Tensor) or not advantages.is_floating_point():
        raise ValueError("advantages must be a floating tensor of shape (B,), (B, 1) or (B, T)")
    if tuple(advantages.shape) not in ((batch,), (batch, 1), (batch, length)):
        raise ValueError(
            f"advantages must have shape ({batch},), ({batch}, 1) or ({batch}, {length}), got {tuple(advantages.shape)}"
        )
    if not bool(torch.isfinite(advantages).all()):
        raise ValueError("advantages hold NaN or inf")
    return advantages.view(batch, 1) if advantages.dim() == 1 else advantages


def _check_mask(mask, shape):
    if not isinstance(mask, torch.Tensor):
        raise ValueError("completion_mask must be a tensor")
    if tuple(mask.shape) != tuple(shape):
        raise ValueError(f"completion_mask must have shape {tuple(shape)}, got {tuple(mask.shape)}")
    if mask.is_floating_point() and not bool(torch.isfinite(mask).all()):
        raise ValueError("completion_mask holds NaN or inf")


def _check_inputs(spec, B, T, mask, advantages, old_logps, ref_logps, importance_weights, max_completion_length,
                  num_items_in_batch, engine_correction=None, sampling_logps=None):
    """Checks both paths share; returns advantages as (B, 1) / (B, T), the importance weights
    as None / (B, 1) / (B, T) and the engine correction as None / (mode, clip_min, clip_max)."""
    check_normaliser_args(spec.loss_type, max_completion_length, num_items_in_batch)
    _check_mask(mask, (B, T))
    advantages = _check_advantages(advantages, B, T)
    _check_token_tensor("old_logps", old_logps, (B, T), mask=mask)
    _check_token_tensor("ref_logps", ref_logps, (B, T), mask=mask)
    if spec.beta != 0 and ref_logps is None:
        raise ValueError("ref_logps is required when beta != 0")
    engine = check_engine_correction(engine_correction)
    if engine is not None:
        if importance_weights is not None:
            raise ValueError("engine_correction forms the importance weights itself: pass importance_weights=None")
        if spec.loss_type == "vespo":
            raise ValueError("engine_correction does not apply to loss_type='vespo' (its gamma weight takes the "
                             "importance weights): pass them as importance_weights")
        if not isinstance(sampling_logps, torch.Tensor) or tuple(sampling_logps.shape) != (B, T):
            raise ValueError(f"engine_correction needs the sampler's log-probs: sampling_logps of shape ({B}, {T})")
    return advantages, _check_importance_weights(importance_weights, B, T, mask), engine


def _fill_padding(logp, active, old, ref, isw):
    """Padding may hold anything: there old and ref become logp (ratio 1, KL 0) and the importance
    weight 1, so an extreme padded value cannot overflow exp() into inf * 0 = NaN. (B, T) in, and
    the weights (B, 1) or (B, T); in logp's dtype. old / ref keep their autograd history, as in
    TRL (an old that is logp itself, not detached, gives no policy gradient: notebook 01); the
    weights are detached."""
    lp = logp.detach()
    old = None if old is None else torch.where(active, old.to(lp.dtype), lp)
    ref = None if ref is None else torch.where(active, ref.to(lp.dtype), lp)
    if isw is not None:
        keep = active if isw.shape[-1] == active.shape[-1] else active.any(-1, keepdim=True)
        isw = torch.where(keep, isw.detach().to(lp.dtype), torch.ones((), dtype=lp.dtype, device=lp.device))
    return old, ref, isw


def _entropy_mask(spec, entropy, mask, entropy_mask_fn):
    """None, or the (B, T) 0/1 mask of the tokens in the top ``top_entropy_quantile`` by entropy."""
    if spec.top_entropy_quantile >= 1.0:
        return None
    if entropy is None:
        raise ValueError("top_entropy_quantile < 1 needs the per-token entropy (B, T)")
    if entropy_mask_fn is None:
        return high_entropy_mask(entropy, mask, spec.top_entropy_quantile)
    return entropy_mask_fn(entropy, mask)


def _objective(logp, spec, mask, adv, old, ref, isw, entropy, entropy_mask_fn, weights, sampling, engine=None):
    """sum(weights * per-token objective) over (B, T) log-probs with padding filled: (loss, parts).
    ``engine``: None or (mode, clip_min, clip_max): the importance weights are the engine correction of the
    old log-probs (``old``, or the current ones detached) against ``sampling``; ``parts["engine_ratio"]``
    keeps them for the metrics."""
    engine_ratio = None
    if engine is not None:
        isw = engine_ratio = engine_importance_weights(logp.detach() if old is None else old.detach(), sampling,
                                                       mask, *engine)
    active = mask != 0
    old, ref, isw = _fill_padding(logp, active, old, ref, isw)
    ent_mask = _entropy_mask(spec, entropy, mask, entropy_mask_fn)
    per_tok, parts = per_token_objective(logp, old, ref, adv, mask, spec, importance_weights=isw,
                                         entropy_mask=None if ent_mask is None else ent_mask.to(logp.dtype),
                                         sampling_logp=None if sampling is None else sampling.to(logp.dtype))
    if engine_ratio is not None:
        parts["engine_ratio"] = engine_ratio
    return (weights * per_tok).sum(), parts


def _engine_metrics(logp, old, sampling, mask, parts) -> dict:
    """The ``sampling/*`` metrics of the engine correction :func:`_objective` formed (empty without one)."""
    if "engine_ratio" not in parts:
        return {}
    return engine_importance_metrics(logp.detach() if old is None else old.detach(), sampling, mask,
                                     parts["engine_ratio"])


# ================================================================================================
# reference: plain math on per-token log-probs
# ================================================================================================
def grpo_loss_reference(
    logps,
    old_logps,
    ref_logps,
    advantages,
    mask,
    *,
    beta,
    epsilon_low,
    epsilon_high,
    loss_type,
    max_completion_length=None,
    num_items_in_batch=None,
    importance_weights=None,
    entropy=None,
    entropy_mask_fn=None,
    sampling_logps=None,
    engine_correction=None,
    **options,
):
    """GRPO loss on per-token log-probs; the oracle for :func:`efficient_grpo_loss`.

    logps: (B, T) float (requires grad); old_logps: (B, T) or None (then logps.detach(): ratio 1,
    gradient A * grad(logp)); ref_logps: (B, T), needed when beta != 0; advantages: (B,), (B, 1) or
    (B, T); mask: (B, T) bool/int/float; importance_weights: None or (B, T) / (B, 1) / (B,), no
    gradient (TRL's ``importance_sampling_ratio``); entropy: (B, T), needed when
    ``top_entropy_quantile < 1``; ``entropy_mask_fn(entropy, mask) -> (B, T) bool`` replaces the
    one-process quantile (the trainer passes TRL's, which gathers across processes);
    sampling_logps: (B, T) or None (then old), the sampler's log-probs read by
    ``off_policy_mask_threshold``. ``engine_correction``: None, or ``(mode, clip_min, clip_max)``: the
    importance weights are then TRL's engine correction (:func:`grpo_kit.loss.objective.engine_importance_weights`)
    of old_logps, or of the current log-probs detached when old_logps is None (the policy has not moved
    since the engine sampled: TRL's old-policy pass would give the same numbers), against sampling_logps,
    and the metrics gain TRL's ``sampling/*``. ``options``: the other
    :class:`grpo_kit.loss.objective.ObjectiveSpec` fields (``delta``, ``importance_sampling_level``,
    ``use_bias_correction_kl``, ``top_entropy_quantile``, ``off_policy_mask_threshold``, sapo_*, vespo_*).
    Returns (loss 0-d, metrics dict of detached 0-d tensors).
    """
    spec = objective_spec(loss_type, beta, epsilon_low, epsilon_high, options)
    if not isinstance(logps, torch.Tensor) or not logps.is_floating_point() or logps.dim() != 2:
        raise ValueError(f"logps must be a floating (B, T) tensor, got {type(logps).__name__} "
                         f"{getattr(logps, 'dtype', '')} of shape {tuple(getattr(logps, 'shape', ()))}")
    B, T = logps.shape
    adv, isw, engine = _check_inputs(spec, B, T, mask, advantages, old_logps, ref_logps, importance_weights,
                                     max_completion_length, num_items_in_batch, engine_correction, sampling_logps)
    maskf = mask.to(logps.dtype)
    w = token_weights(mask, loss_type, max_completion_length, num_items_in_batch, dtype=logps.dtype)
    loss, parts = _objective(logps, spec, maskf, adv, old_logps, ref_logps, isw, entropy, entropy_mask_fn, w,
                             sampling_logps, engine)
    metrics = objective_metrics(parts, adv, maskf, spec, entropy)
    return loss, {**metrics, **_engine_metrics(logps, old_logps, sampling_logps, maskf, parts)}


# ================================================================================================
# efficient path
# ================================================================================================
def _auto_chunk_rows(vocab, dtype, device, backend, n_tokens=0):
    """Rows per chunk so that one logits chunk (plus epilogue temporaries) and the per-token fp32/int64
    vectors (~48 bytes a token: weights, advantages, old/ref/log-probs, ids) fit in ~0.25 GiB."""
    per_row = vocab * torch.empty((), dtype=dtype).element_size()
    if backend == "torch":
        per_row += vocab * 4 * 3  # fp32 copies made by the torch epilogue
    budget = max(_CHUNK_BUDGET_BYTES - 48 * n_tokens, _CHUNK_BUDGET_BYTES // 4)
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        budget = min(budget, free // 4)
    rows = max(1, budget // per_row)
    # Whole 256-row GEMM tiles: on an H200 a 896-row chunk took 1942 ms at Llama 64K where 768 rows took
    # 1845 ms (bench/results/loss_chunk/); a partly filled last tile wastes more than the extra launches cost.
    for step in (256, 64):
        if rows >= 2 * step:
            return int(rows // step * step)
    return int(rows)


def _check_head(hidden, lm_head_weight, lm_head_bias, ids, ids_name):
    if not isinstance(hidden, torch.Tensor) or hidden.dim() != 3 or not hidden.is_floating_point():
        raise ValueError(f"hidden must be a floating tensor (B, T, H), got {getattr(hidden, 'shape', type(hidden))}")
    B, T, H = hidden.shape
    if not isinstance(lm_head_weight, torch.Tensor) or lm_head_weight.dim() != 2 or lm_head_weight.shape[1] != H:
        raise ValueError(
            f"lm_head_weight must be (V, H={H}), got {tuple(getattr(lm_head_weight, 'shape', ()))}"
        )
    if lm_head_weight.dtype != hidden.dtype:
        raise ValueError(f"lm_head_weight dtype {lm_head_weight.dtype} must equal hidden dtype {hidden.dtype}")
    if lm_head_weight.device != hidden.device:
        raise ValueError(f"lm_head_weight is on {lm_head_weight.device}, hidden on {hidden.device}")
    V = lm_head_weight.shape[0]
    if lm_head_bias is not None:
        if lm_head_bias.shape != (V,) or lm_head_bias.dtype != hidden.dtype:
            raise ValueError(f"lm_head_bias must be ({V},) {hidden.dtype}, got {tuple(lm_head_bias.shape)} {lm_head_bias.dtype}")
    if not isinstance(ids, torch.Tensor) or ids.dtype.is_floating_point or ids.dtype == torch.bool or ids.is_complex():
        raise ValueError(f"{ids_name} must be an integer tensor")
    if tuple(ids.shape) != (B, T):
        raise ValueError(f"{ids_name} must have shape ({B}, {T}), got {tuple(ids.shape)}")
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= V):
        raise ValueError(f"{ids_name} must lie in [0, {V}), got range [{int(ids.min())}, {int(ids.max())}]")
    return B, T, H, V


def _check_temperature_chunk(temperature, chunk_size):
    if not isinstance(temperature, numbers.Real) or not math.isfinite(temperature) or temperature <= 0:
        raise ValueError(f"temperature must be a finite number > 0, got {temperature!r}")
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


class _EfficientGRPOFn(torch.autograd.Function):
    """Forward computes loss, log-probs and the (pre-scaled) gradients; backward rescales them."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, ids, tok, opts):
        # hidden (B,T,H); weight (V,H); bias (V,) or None; ids (N,) int64; tok: the per-token inputs
        # flattened to N = B*T, fp32 (N,) or None: w (normaliser weights), adv, old, ref, isw;
        # opts: options, and opts["objective"](logp (N,), entropy (N,) or None, need_grad) ->
        # (loss, dL/dlogp (N,) or None, parts), the objective over all tokens.
        B, T, H = hidden.shape
        N = B * T
        V = weight.shape[0]
        dev = hidden.device
        spec = opts["spec"]
        need_h, need_w, need_b = opts["needs_grad"]
        any_grad = need_h or need_w or need_b
        # Coefficients in the loop only where a head gradient needs them and the spec allows it: the
        # autograd call per chunk is ~45 small kernels (on a CPU 0.2-0.5 ms a chunk, the hand-derived
        # derivative it replaced 0.07-0.15 ms), while scaling stored rows after the loop is one pass.
        in_loop = opts["token_local"] and (need_w or need_b)

        active = tok["w"] != 0
        n_act = int(active.sum())
        rows = None if n_act == N else active.nonzero().squeeze(1)  # skip padding rows entirely

        def sel(x):
            return None if x is None else (x if rows is None else x.index_select(0, rows))

        ids_a = sel(ids)
        w_a, adv_a, old_a, ref_a, isw_a = (sel(tok[k]) for k in ("w", "adv", "old", "ref", "isw"))
        # In the loop: each row's coefficient, scaled so the largest weight is O(1); else the loop stores
        # d logp/d hidden per row (coefficient 1) and the rows are scaled afterwards.
        scale = _pow2_scale(float(w_a.max()) if n_act else 0.0) if in_loop else 1.0

        grad_h = None
        if need_h:
            grad_h = (torch.empty if rows is None else torch.zeros)(N, H, dtype=hidden.dtype, device=dev)
        grad_w = torch.zeros(V, H, dtype=torch.float32, device=dev) if need_w else None
        grad_b = torch.zeros(V, dtype=torch.float32, device=dev) if need_b else None

        def accumulate(s, e, h_c, z, lse_c, coef, write_h, write_wb):
            # dL/dz = c * (onehot - softmax) / temp; the kernel writes coef * (softmax - onehot) / temp
            dz = _epi.softmax_grad_(z, ids_a[s:e], lse_c, coef, inv_temp, backend)
            if write_h:
                if rows is None:
                    torch.mm(dz, weight, out=grad_h[s:e])
                else:
                    grad_h.index_copy_(0, rows[s:e], torch.mm(dz, weight))
            if write_wb and need_w:
                grad_w.add_(torch.mm(dz.t(), h_c))
            if write_wb and need_b:
                grad_b.add_(dz.float().sum(0))

        logp_a = torch.empty(n_act, dtype=torch.float32, device=dev)
        ent_a = torch.empty(n_act, dtype=torch.float32, device=dev) if opts["compute_entropy"] else None
        inv_temp = 1.0 / opts["temperature"]
        backend = opts["backend"]
        chunk = opts["chunk_size"]
        minus_one = torch.full((min(chunk, n_act),), -1.0, dtype=torch.float32, device=dev)
        for s in range(0, n_act, chunk):
            e = min(s + chunk, n_act)
            h_c = _row_gather(hidden, rows, s, e)
            z = _logits(h_c, weight, bias)
            logp_c, lse_c, ent_c = _epi.lse_logp(z, ids_a[s:e], inv_temp, ent_a is not None, backend)
            logp_a[s:e] = logp_c
            if ent_a is not None:
                ent_a[s:e] = ent_c
            if not (need_h or in_loop):
                continue
            if in_loop:
                coef = -_chunk_coefficient(spec, logp_c, w_a[s:e], adv_a[s:e], *(
                    None if x is None else x[s:e] for x in (old_a, ref_a, isw_a))) * scale
            else:
                coef = minus_one[:e - s]  # dz = d logp / dz
            accumulate(s, e, h_c, z, lse_c, coef, need_h, in_loop)
            del z

        logp = torch.zeros(N, dtype=torch.float32, device=dev)
        ent = torch.zeros(N, dtype=torch.float32, device=dev) if ent_a is not None else None
        for full, part in ((logp, logp_a), (ent, ent_a)):
            if full is None:
                continue
            if rows is None:
                full.copy_(part)
            else:
                full.index_copy_(0, rows, part)
        loss, grad_logp, opts["parts"] = opts["objective"](logp, ent, any_grad and not in_loop)

        if grad_logp is not None:  # the coefficients of the rows stored above
            c = sel(grad_logp)
            scale = _pow2_scale(float(c.abs().max()) if n_act else 0.0)
            c = c * scale
            for s in range(0, n_act, chunk):
                e = min(s + chunk, n_act)
                if need_h:  # rows hold d logp / d hidden: scale each by its coefficient, in fp32
                    if rows is None:
                        grad_h[s:e].copy_(grad_h[s:e].float().mul_(c[s:e, None]))
                    else:
                        idx = rows[s:e]
                        grad_h.index_copy_(0, idx, grad_h.index_select(0, idx).float().mul_(c[s:e, None]).to(
                            grad_h.dtype))
                if need_w or need_b:  # coupled tokens and a trainable head: one more pass over the chunks
                    h_c = _row_gather(hidden, rows, s, e)
                    z = _logits(h_c, weight, bias)
                    lse_c = _epi.lse_logp(z, ids_a[s:e], inv_temp, False, backend)[1]
                    accumulate(s, e, h_c, z, lse_c, -c[s:e], False, True)
                    del z

        ctx.grads = (grad_h, grad_w, grad_b)
        ctx.meta = (scale, (B, T, H), weight.dtype)
        outs = (loss, logp) if ent is None else (loss, logp, ent)
        ctx.mark_non_differentiable(*outs[1:])
        return outs

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_loss, *_):
        grad_h, grad_w, grad_b = ctx.grads
        if grad_h is None and grad_w is None and grad_b is None:
            raise RuntimeError("efficient_grpo_loss: backward ran twice on one forward; compute the loss again")
        ctx.grads = (None, None, None)  # stored gradients are rescaled in place: one backward only
        scale, shape, wdtype = ctx.meta
        factor = grad_loss.float() / scale
        if grad_h is not None:
            grad_h = grad_h.mul_(factor).view(shape)  # in place: no second hidden-sized buffer
        if grad_w is not None:
            grad_w = grad_w.mul_(factor).to(wdtype)
        if grad_b is not None:
            grad_b = grad_b.mul_(factor).to(wdtype)
        return grad_h, grad_w, grad_b, None, None, None


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
    **options,
):
    """GRPO loss from final hidden states without materialising (B, T, V) logits.

    hidden: (B, T, H) bf16/fp16/fp32, ``hidden[:, t]`` predicts ``completion_ids[:, t]``;
    lm_head_weight: (V, H), same dtype; completion_ids: (B, T) int in [0, V);
    completion_mask: (B, T) bool/int/float; advantages: (B,), (B, 1) or (B, T) float;
    old_logps / ref_logps: (B, T) float or None (ref needed when beta != 0).
    ``importance_weights``: None or (B, T) / (B, 1) / (B,) float, no gradient (TRL's
    ``importance_sampling_ratio``). ``entropy_mask_fn``, ``sampling_logps``, ``engine_correction`` and
    ``options``: as in :func:`grpo_loss_reference`; the entropy of the same chunk pass feeds the entropy mask.
    ``chunk_size``: token rows per logits chunk (None: from free memory, ~0.25 GiB of logits).
    ``epilogue``: 'auto' (Triton on CUDA), 'triton' or 'torch'.

    Returns (loss: 0-d fp32, metrics: dict of detached 0-d fp32 tensors, same keys as
    :func:`grpo_loss_reference` plus ``entropy`` when ``compute_entropy``). Gradients reach
    ``hidden`` and, only if they require grad, ``lm_head_weight`` / ``lm_head_bias``. The stored
    gradient allows one backward per call.
    """
    spec = objective_spec(loss_type, beta, epsilon_low, epsilon_high, options)
    _check_temperature_chunk(temperature, chunk_size)
    B, T, H, V = _check_head(hidden, lm_head_weight, lm_head_bias, completion_ids, "completion_ids")
    adv, isw, engine = _check_inputs(spec, B, T, completion_mask, advantages, old_logps, ref_logps,
                                     importance_weights, max_completion_length, num_items_in_batch, engine_correction,
                                     sampling_logps)
    backend = _epi.resolve_backend(epilogue, hidden.device)
    if chunk_size is None:
        chunk_size = _auto_chunk_rows(V, hidden.dtype, hidden.device, backend, n_tokens=B * T)

    N = B * T
    mask = completion_mask.float()
    w = token_weights(completion_mask, loss_type, max_completion_length, num_items_in_batch)
    adv = adv.detach().float()
    old = None if old_logps is None else old_logps.detach().float()
    ref = None if (ref_logps is None or spec.beta == 0) else ref_logps.detach().float()
    isw = None if isw is None else isw.detach().float()
    sampling = None if sampling_logps is None else sampling_logps.detach().float()

    def flat(x):
        return None if x is None else x.expand(B, T).reshape(N)

    tok = {"w": w.reshape(N), "adv": flat(adv), "old": flat(old), "ref": flat(ref), "isw": flat(isw)}

    def objective(logp_n, ent_n, need_grad):
        x = logp_n.view(B, T).detach().requires_grad_(need_grad)
        ent_bt = None if ent_n is None else ent_n.view(B, T)
        with torch.enable_grad() if need_grad else torch.no_grad():
            loss, parts = _objective(x, spec, mask, adv, old, ref, isw, ent_bt, entropy_mask_fn, w, sampling, engine)
            grad = torch.autograd.grad(loss, x)[0].reshape(N) if need_grad else None
        return loss.detach(), grad, parts

    grad_on = torch.is_grad_enabled()
    opts = dict(
        spec=spec, objective=objective, temperature=float(temperature), chunk_size=int(chunk_size), backend=backend,
        token_local=spec.token_local and engine is None,  # the engine's weights may couple a sequence's tokens
        compute_entropy=bool(compute_entropy) or spec.top_entropy_quantile < 1.0,
        needs_grad=(
            grad_on and hidden.requires_grad,
            grad_on and lm_head_weight.requires_grad,
            grad_on and lm_head_bias is not None and lm_head_bias.requires_grad,
        ),
    )
    outs = _EfficientGRPOFn.apply(hidden, lm_head_weight, lm_head_bias, completion_ids.reshape(N).long(), tok, opts)
    loss, logp = outs[0], outs[1]
    if not bool(torch.isfinite(logp).all()):
        # one sync; checked on the outputs so that the inputs need no extra full pass
        raise ValueError("the GRPO loss is not finite: hidden or lm_head_weight (or lm_head_bias) hold NaN/inf")
    if not bool(torch.isfinite(loss)):  # gaps are clamped (MAX_LOG_GAP): only astronomic advantages get here
        raise ValueError(f"the GRPO loss overflowed fp32: advantages up to {float(adv.abs().max()):.3g} times a "
                         f"ratio up to e^{MAX_LOG_GAP:.0f}; check the rewards' scale")
    ent = outs[2].view(B, T) if len(outs) > 2 and compute_entropy else None
    metrics = objective_metrics(opts["parts"], adv, mask, spec, ent)
    return loss, {**metrics, **_engine_metrics(logp.view(B, T), old, sampling, mask, opts["parts"])}


def per_token_logps(hidden, lm_head_weight, ids, *, temperature=1.0, chunk_size=None, lm_head_bias=None, epilogue="auto"):
    """Chunked log p(ids[:, t] | hidden[:, t]) without grad, for reference / old-policy passes.

    hidden: (B, T, H); lm_head_weight: (V, H) same dtype; ids: (B, T) int in [0, V).
    Returns (B, T) fp32. Only one (chunk_size, V) logits chunk exists at a time.
    """
    _check_temperature_chunk(temperature, chunk_size)
    B, T, H, V = _check_head(hidden, lm_head_weight, lm_head_bias, ids, "ids")
    backend = _epi.resolve_backend(epilogue, hidden.device)
    if chunk_size is None:
        chunk_size = _auto_chunk_rows(V, hidden.dtype, hidden.device, backend)
    N = B * T
    ids_n = ids.reshape(N).long()
    out = torch.empty(N, dtype=torch.float32, device=hidden.device)
    for s in range(0, N, chunk_size):
        e = min(s + chunk_size, N)
        z = _logits(_row_gather(hidden, None, s, e), lm_head_weight, lm_head_bias)
        out[s:e] = _epi.lse_logp(z, ids_n[s:e], 1.0 / temperature, False, backend)[0]
    if not bool(torch.isfinite(out).all()):
        raise ValueError("per_token_logps: non-finite log-probs; hidden or lm_head_weight (or bias) hold NaN/inf")
    return out.view(B, T)
