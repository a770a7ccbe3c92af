"""The GRPO loss: a readable reference and a chunked, memory-efficient twin with the same numbers.

Notation (shapes; dtypes): B completions, T completion tokens, H hidden size, V vocabulary.

* ``grpo_loss_reference(logps, ...)`` works on per-token log-probs (B, T) and reads like the
  paper / TRL 1.16 ``GRPOTrainer._compute_loss``: ratio r = exp(logp - old_logp), per-token loss
  ``-min(r*A, clip(r, 1-eps_low, 1+eps_high)*A) + beta*(exp(ref-logp) - (ref-logp) - 1)``, then a
  ``loss_type`` normalisation. Optional ``importance_weights`` (B, T) or (B, 1), no gradient,
  multiply the policy term (not the KL term) per token, as TRL multiplies it by
  ``inputs["importance_sampling_ratio"]`` when generation came from another engine (vLLM):

  ===========  ==============================================================
  ``grpo``     mean over sequences of each sequence's masked token mean
  ``bnpo``     masked token mean over the micro-batch
  ``dr_grpo``  masked sum / (B * max_completion_length)
  ``dapo``     masked sum / num_items_in_batch (active tokens of the whole accumulated batch)
  ===========  ==============================================================

* ``efficient_grpo_loss(hidden, lm_head_weight, ...)`` starts from the final hidden states
  (B, T, H) and never builds the (B, T, V) logits: it runs over chunks of token rows, computes
  one (rows, V) logits chunk in the input dtype, takes an fp32 log-softmax of it, and computes the
  gradient w.r.t. hidden (and the head weight/bias if they require grad) right there, in the
  forward. Backward only scales the stored gradient by the incoming one. Every token's loss
  coefficient is known once the normalisers are fixed from the mask, which is what makes this
  one-pass scheme exact; matmul work stays at the naive 4*B*T*H*V FLOPs.

* ``per_token_logps(hidden, lm_head_weight, ids)``: the same chunked log-probs, no grad, for the
  reference-model and old-policy passes.

``hidden[:, t]`` predicts ``completion_ids[:, t]`` (shift already applied by the caller).
"""

from __future__ import annotations

import math
import numbers

import torch

from grpo_kit.kernels import grpo_epilogue as _epi

LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo")

# Budget for one chunk of logits (plus the torch epilogue's fp32 temporaries when it is used).
_CHUNK_BUDGET_BYTES = 256 * 2**20


# ================================================================================================
# argument checks shared by both paths
# ================================================================================================
def _check_loss_args(loss_type, beta, epsilon_low, epsilon_high, max_completion_length, num_items_in_batch):
    """Validate the scalar loss options; returns the resolved epsilon_high."""
    if loss_type not in LOSS_TYPES:
        raise ValueError(f"loss_type must be one of {LOSS_TYPES}, got {loss_type!r}")
    for name, val in (("beta", beta), ("epsilon_low", epsilon_low)):
        if not isinstance(val, numbers.Real) or not math.isfinite(val) or val < 0:
            raise ValueError(f"{name} must be a finite number >= 0, got {val!r}")
    if epsilon_high is None:  # TRL: epsilon_high defaults to epsilon
        epsilon_high = epsilon_low
    if not isinstance(epsilon_high, numbers.Real) or not math.isfinite(epsilon_high) or epsilon_high < 0:
        raise ValueError(f"epsilon_high must be a finite number >= 0 or None, got {epsilon_high!r}")
    if loss_type == "dr_grpo":
        if max_completion_length is None:
            raise ValueError("loss_type='dr_grpo' needs max_completion_length (it divides by B * max_completion_length)")
        if not isinstance(max_completion_length, numbers.Integral) or max_completion_length <= 0:
            raise ValueError(f"max_completion_length must be a positive int, got {max_completion_length!r}")
    if loss_type == "dapo":
        if num_items_in_batch is None:
            raise ValueError(
                "loss_type='dapo' needs num_items_in_batch (active tokens of the whole accumulated batch)"
            )
        n = num_items_in_batch.item() if isinstance(num_items_in_batch, torch.Tensor) else num_items_in_batch
        if isinstance(num_items_in_batch, torch.Tensor) and num_items_in_batch.numel() != 1:
            raise ValueError(f"num_items_in_batch must be a scalar, got shape {tuple(num_items_in_batch.shape)}")
        if not isinstance(n, numbers.Real) or not math.isfinite(n) or n < 0:
            raise ValueError(f"num_items_in_batch must be a finite number >= 0, got {num_items_in_batch!r}")
    return float(epsilon_high)


# exp() of a log-prob gap overflows fp32 beyond ~88 nats, and inf * 0 (a zero advantage, a clipped
# branch) is NaN. Gaps (logp - old for the ratio, ref - logp for the k3 KL) are clamped at 60 nats:
# e^60 ~ 1e26 stays finite even times large advantages, and such a token then gets no gradient from
# that term (as torch's clamp gives the reference). Real training never comes near: a ratio of e^60
# is a policy that has left the trust region by 26 orders of magnitude.
MAX_LOG_GAP = 60.0


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


# ================================================================================================
# metrics (shared: both paths log the same numbers as TRL's _compute_loss)
# ================================================================================================
def _nanmin(x):
    x = x[~torch.isnan(x)]
    return x.min() if x.numel() else torch.tensor(float("nan"), device=x.device)


def _nanmax(x):
    x = x[~torch.isnan(x)]
    return x.max() if x.numel() else torch.tensor(float("nan"), device=x.device)


@torch.no_grad()
def grpo_metrics(ratio, advantages, mask, epsilon_low, epsilon_high, kl=None, entropy=None):
    """Detached logging metrics, as TRL 1.16 logs them (masked means over all tokens).

    ratio, mask, kl, entropy: (B, T); advantages: (B, 1) or (B, T). Returns a dict of 0-d fp32
    tensors: ``ratio_mean``, ``clip_ratio/{low_mean,high_mean,region_mean,low_min,high_max}``, and
    ``kl`` / ``entropy`` when given.
    """
    mask = mask.float()
    denom = mask.sum().clamp(min=1.0)

    def mmean(x):
        return (x.float() * mask).sum() / denom

    low = (ratio < 1 - epsilon_low) & (advantages < 0)
    high = (ratio > 1 + epsilon_high) & (advantages > 0)
    out = {
        "ratio_mean": mmean(ratio),
        "clip_ratio/low_mean": mmean(low),
        "clip_ratio/high_mean": mmean(high),
        "clip_ratio/region_mean": mmean(low | high),
        # per-sequence clip fractions (NaN for empty sequences, skipped like TRL's nanmin/nanmax)
        "clip_ratio/low_min": _nanmin((low.float() * mask).sum(-1) / mask.sum(-1)),
        "clip_ratio/high_max": _nanmax((high.float() * mask).sum(-1) / mask.sum(-1)),
    }
    if kl is not None:
        out["kl"] = mmean(kl)
    if entropy is not None:
        out["entropy"] = mmean(entropy)
    return {k: v.detach().float() for k, v in out.items()}


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
):
    """GRPO loss on per-token log-probs; the oracle for :func:`efficient_grpo_loss`.

    logps: (B, T) float (requires grad); old_logps: (B, T) or None (then logps.detach(): ratio 1,
    gradient A * grad(logp)); ref_logps: (B, T), needed when beta != 0; advantages: (B,), (B, 1) or
    (B, T); mask: (B, T) bool/int/float; importance_weights: None or (B, T) / (B, 1) / (B,), no
    gradient, multiplying the policy term per token before the KL term is added (TRL's
    ``importance_sampling_ratio``). Returns (loss 0-d, metrics dict of detached 0-d tensors).
    """
    epsilon_high = _check_loss_args(loss_type, beta, epsilon_low, epsilon_high, max_completion_length, num_items_in_batch)
    if beta != 0 and ref_logps is None:
        raise ValueError("ref_logps is required when beta != 0")
    if not isinstance(logps, torch.Tensor) or not logps.is_floating_point() or logps.dim() != 2:
        raise ValueError(f"logps must be a floating (B, T) tensor, got {type(logps).__name__} "
                         f"{getattr(logps, 'dtype', '')} of shape {tuple(getattr(logps, 'shape', ()))}")
    B, T = logps.shape
    _check_mask(mask, (B, T))
    advantages = _check_advantages(advantages, B, T)
    _check_token_tensor("old_logps", old_logps, (B, T), mask=mask)
    _check_token_tensor("ref_logps", ref_logps, (B, T), mask=mask)
    importance_weights = _check_importance_weights(importance_weights, B, T, mask)
    mask = mask.to(logps.dtype)

    # The detach is essential: the ratio's value is 1 but its gradient must be A * grad(logp).
    old = logps.detach() if old_logps is None else old_logps
    # Padding may hold anything: there old/ref equal logp (ratio 1, KL 0), so an extreme padded value
    # cannot overflow exp() into inf * 0 = NaN (the efficient loss does the same).
    active = mask != 0
    old = torch.where(active, old, logps.detach())
    if ref_logps is not None:
        ref_logps = torch.where(active, ref_logps, logps.detach())
    ratio = torch.exp((logps - old).clamp(max=MAX_LOG_GAP))
    clipped_ratio = torch.clamp(ratio, 1 - epsilon_low, 1 + epsilon_high)
    per_token_loss = -torch.min(ratio * advantages, clipped_ratio * advantages)
    if importance_weights is not None:  # TRL: after clipping, before the KL term
        w = importance_weights.detach().to(per_token_loss.dtype)
        if w.shape[1] == T:
            w = torch.where(mask != 0, w, torch.ones_like(w))  # padding may hold anything
        per_token_loss = per_token_loss * w
    kl = None
    if beta != 0:
        # k3 estimator of KL(pi_theta || pi_ref)
        d = (ref_logps - logps).clamp(max=MAX_LOG_GAP)
        kl = torch.exp(d) - d - 1
        per_token_loss = per_token_loss + beta * kl

    if loss_type == "grpo":
        loss = ((per_token_loss * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()
    elif loss_type == "bnpo":
        loss = (per_token_loss * mask).sum() / mask.sum().clamp(min=1.0)
    elif loss_type == "dr_grpo":
        loss = (per_token_loss * mask).sum() / (B * max_completion_length)
    else:  # dapo
        n = torch.as_tensor(num_items_in_batch, dtype=per_token_loss.dtype, device=logps.device)
        loss = (per_token_loss * mask).sum() / n.clamp(min=1.0)

    metrics = grpo_metrics(ratio.detach(), advantages, mask, epsilon_low, epsilon_high,
                           kl=None if kl is None else kl.detach())
    return loss, metrics


# ================================================================================================
# efficient path
# ================================================================================================
def token_weights(mask, loss_type, max_completion_length=None, num_items_in_batch=None):
    """Per-token weight w such that the loss is sum(w * per_token_loss).

    mask: (B, T) any dtype. Returns (B, T) fp32. Fixing these from the mask alone is what lets the
    efficient path know every token's gradient coefficient inside its forward.
    """
    m = mask.float()
    B = m.shape[0]
    if loss_type == "grpo":
        return m / (B * m.sum(-1, keepdim=True).clamp(min=1.0))
    if loss_type == "bnpo":
        return m / m.sum().clamp(min=1.0)
    if loss_type == "dr_grpo":
        return m / float(B * max_completion_length)
    n = torch.as_tensor(num_items_in_batch, dtype=torch.float32, device=m.device)
    return m / n.clamp(min=1.0)


def per_token_loss(logp, old_logp, ref_logp, adv, beta, epsilon_low, epsilon_high, weight=None):
    """Per-token GRPO loss, elementwise, fp32: -w * min(r*A, clip(r)*A) + beta * k3(ref, logp).

    logp, adv: (n,) fp32; old_logp, ref_logp: (n,) fp32 or None (None old: on-policy, ratio 1);
    weight: (n,) fp32 importance weight of the policy term, or None (1).
    """
    ratio = torch.ones_like(logp) if old_logp is None else torch.exp((logp - old_logp).clamp(max=MAX_LOG_GAP))
    loss = -torch.minimum(ratio * adv, ratio.clamp(1 - epsilon_low, 1 + epsilon_high) * adv)
    if weight is not None:
        loss = loss * weight
    if beta != 0:
        d = (ref_logp - logp).clamp(max=MAX_LOG_GAP)
        loss = loss + beta * (torch.exp(d) - d - 1)
    return loss


def per_token_dloss(logp, old_logp, ref_logp, adv, beta, epsilon_low, epsilon_high, weight=None):
    """d(per_token_loss)/d(logp), elementwise, fp32 (same arguments as :func:`per_token_loss`).

    The clip is inactive (gradient -A*r flows) unless A > 0 and r > 1+eps_high, or A < 0 and
    r < 1-eps_low: exactly the subgradient torch's min/clamp give the reference. The k3 term
    contributes beta * (1 - exp(ref - logp)).
    """
    if old_logp is None:
        ratio, frozen = torch.ones_like(logp), torch.zeros_like(logp, dtype=torch.bool)
    else:
        lr = logp - old_logp
        ratio, frozen = torch.exp(lr.clamp(max=MAX_LOG_GAP)), lr > MAX_LOG_GAP
    clipped = ((adv > 0) & (ratio > 1 + epsilon_high)) | ((adv < 0) & (ratio < 1 - epsilon_low))
    dloss = torch.where(clipped | frozen, 0.0, -adv * ratio)
    if weight is not None:
        dloss = dloss * weight
    if beta != 0:
        d = ref_logp - logp
        dloss = dloss + torch.where(d > MAX_LOG_GAP, 0.0, beta * (1 - torch.exp(d.clamp(max=MAX_LOG_GAP))))
    return dloss


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


class _EfficientGRPOFn(torch.autograd.Function):
    """Forward computes loss, log-probs and the (pre-scaled) gradients; backward rescales them."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, ids, w, adv, old, ref, isw, opts):
        # hidden (B,T,H); weight (V,H); bias (V,) or None; ids (N,) int64; w, adv (N,) fp32;
        # old, ref, isw (importance weights of the policy term) (N,) fp32 or None; all per-token
        # tensors already flattened to N = B*T.
        B, T, H = hidden.shape
        N = B * T
        V = weight.shape[0]
        dev = hidden.device
        need_h, need_w, need_b = opts["needs_grad"]
        any_grad = need_h or need_w or need_b

        active = w != 0
        n_act = int(active.sum())
        rows = None if n_act == N else active.nonzero().squeeze(1)  # skip padding rows entirely

        def sel(x):
            return None if x is None else (x if rows is None else x.index_select(0, rows))

        ids_a, w_a, adv_a, old_a, ref_a, isw_a = sel(ids), sel(w), sel(adv), sel(old), sel(ref), sel(isw)

        # Scale the in-forward gradient by a power of two so its largest per-token coefficient is
        # O(1): otherwise fp16 chunks underflow (the normaliser w can be ~1/(B*T)). Exact in binary,
        # undone in backward together with grad_output (which carries a GradScaler's scale).
        w_max = float(w_a.max()) if n_act else 0.0
        scale = 2.0 ** (-math.floor(math.log2(w_max))) if w_max > 0 else 1.0

        grad_h = None
        if need_h:
            grad_h = (torch.empty if rows is None else torch.zeros)(N, H, dtype=hidden.dtype, device=dev)
        grad_w = torch.zeros(V, H, dtype=torch.float32, device=dev) if need_w else None
        grad_b = torch.zeros(V, dtype=torch.float32, device=dev) if need_b else None

        logp_a = torch.empty(n_act, dtype=torch.float32, device=dev)
        ent_a = torch.empty(n_act, dtype=torch.float32, device=dev) if opts["compute_entropy"] else None
        inv_temp = 1.0 / opts["temperature"]
        backend = opts["backend"]
        chunk = opts["chunk_size"]
        for s in range(0, n_act, chunk):
            e = min(s + chunk, n_act)
            h_c = _row_gather(hidden, rows, s, e)
            z = _logits(h_c, weight, bias)
            logp_c, lse_c, ent_c = _epi.lse_logp(z, ids_a[s:e], inv_temp, ent_a is not None, backend)
            logp_a[s:e] = logp_c
            if ent_a is not None:
                ent_a[s:e] = ent_c
            if not any_grad:
                continue
            dloss = per_token_dloss(
                logp_c, None if old_a is None else old_a[s:e], None if ref_a is None else ref_a[s:e],
                adv_a[s:e], opts["beta"], opts["epsilon_low"], opts["epsilon_high"],
                None if isw_a is None else isw_a[s:e],
            )
            # dL/dz = w * dloss * (onehot - softmax) / temp; the kernel writes coef * (softmax - onehot) / temp
            coef = -(w_a[s:e] * dloss) * scale
            dz = _epi.softmax_grad_(z, ids_a[s:e], lse_c, coef, inv_temp, backend)
            if need_h:
                if rows is None:
                    torch.mm(dz, weight, out=grad_h[s:e])
                else:
                    grad_h.index_copy_(0, rows[s:e], torch.mm(dz, weight))
            if need_w:
                grad_w.add_(torch.mm(dz.t(), h_c))
            if need_b:
                grad_b.add_(dz.float().sum(0))
            del z, dz

        ctx.grads = (grad_h, grad_w, grad_b)
        ctx.meta = (scale, (B, T, H), weight.dtype)
        logp = torch.zeros(N, dtype=torch.float32, device=dev)
        ent = torch.zeros(N, dtype=torch.float32, device=dev) if ent_a is not None else None
        if rows is None:
            logp.copy_(logp_a)
            if ent is not None:
                ent.copy_(ent_a)
        else:
            logp.index_copy_(0, rows, logp_a)
            if ent is not None:
                ent.index_copy_(0, rows, ent_a)

        loss_tok = per_token_loss(
            logp, old if old is None else torch.where(active, old, logp), None if ref is None else torch.where(active, ref, logp),
            adv, opts["beta"], opts["epsilon_low"], opts["epsilon_high"],
            None if isw is None else torch.where(active, isw, torch.ones_like(isw)),
        )
        loss = (w * loss_tok).sum()
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
        return grad_h, grad_w, grad_b, None, None, None, None, None, None, None


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
):
    """GRPO loss from final hidden states without materialising (B, T, V) logits.

    hidden: (B, T, H) bf16/fp16/fp32, ``hidden[:, t]`` predicts ``completion_ids[:, t]``;
    lm_head_weight: (V, H), same dtype; completion_ids: (B, T) int in [0, V);
    completion_mask: (B, T) bool/int/float; advantages: (B,), (B, 1) or (B, T) float;
    old_logps / ref_logps: (B, T) float or None (ref needed when beta != 0).
    ``importance_weights``: None or (B, T) / (B, 1) / (B,) float, no gradient: multiplies the
    policy term of each token (not the KL term), as TRL applies ``importance_sampling_ratio``; the
    per-token gradient coefficient handed to the epilogue (torch or Triton) carries it.
    ``chunk_size``: token rows per logits chunk (None: from free memory, ~0.25 GiB of logits).
    ``epilogue``: 'auto' (Triton on CUDA), 'triton' or 'torch'.

    Returns (loss: 0-d fp32, metrics: dict of detached 0-d fp32 tensors, same keys as
    :func:`grpo_loss_reference` plus ``entropy`` when ``compute_entropy``). Gradients reach
    ``hidden`` and, only if they require grad, ``lm_head_weight`` / ``lm_head_bias``. The stored
    gradient allows one backward per call.
    """
    epsilon_high = _check_loss_args(loss_type, beta, epsilon_low, epsilon_high, max_completion_length, num_items_in_batch)
    _check_temperature_chunk(temperature, chunk_size)
    B, T, H, V = _check_head(hidden, lm_head_weight, lm_head_bias, completion_ids, "completion_ids")
    _check_mask(completion_mask, (B, T))
    adv = _check_advantages(advantages, B, T)
    _check_token_tensor("old_logps", old_logps, (B, T), mask=completion_mask)
    _check_token_tensor("ref_logps", ref_logps, (B, T), mask=completion_mask)
    isw = _check_importance_weights(importance_weights, B, T, completion_mask)
    if beta != 0 and ref_logps is None:
        raise ValueError("ref_logps is required when beta != 0")
    backend = _epi.resolve_backend(epilogue, hidden.device)
    if chunk_size is None:
        chunk_size = _auto_chunk_rows(V, hidden.dtype, hidden.device, backend, n_tokens=B * T)

    N = B * T
    w = token_weights(completion_mask, loss_type, max_completion_length, num_items_in_batch).reshape(N)
    adv_n = adv.float().expand(B, T).reshape(N)
    old_n = None if old_logps is None else old_logps.detach().float().reshape(N)
    ref_n = None if (ref_logps is None or beta == 0) else ref_logps.detach().float().reshape(N)
    isw_n = None if isw is None else isw.detach().float().expand(B, T).reshape(N)
    grad_on = torch.is_grad_enabled()
    opts = dict(
        beta=float(beta), epsilon_low=float(epsilon_low), epsilon_high=epsilon_high,
        temperature=float(temperature), chunk_size=int(chunk_size), backend=backend,
        compute_entropy=bool(compute_entropy),
        needs_grad=(
            grad_on and hidden.requires_grad,
            grad_on and lm_head_weight.requires_grad,
            grad_on and lm_head_bias is not None and lm_head_bias.requires_grad,
        ),
    )
    outs = _EfficientGRPOFn.apply(
        hidden, lm_head_weight, lm_head_bias, completion_ids.reshape(N).long(), w, adv_n, old_n, ref_n, isw_n, opts
    )
    loss, logp = outs[0], outs[1]
    if not bool(torch.isfinite(logp).all()):
        # one sync; checked on the outputs so that the inputs need no extra full pass
        raise ValueError("the GRPO loss is not finite: hidden or lm_head_weight (or lm_head_bias) hold NaN/inf")
    if not bool(torch.isfinite(loss)):  # gaps are clamped (MAX_LOG_GAP): only astronomic advantages get here
        raise ValueError(f"the GRPO loss overflowed fp32: advantages up to {float(adv.abs().max()):.3g} times a "
                         f"ratio up to e^{MAX_LOG_GAP:.0f}; check the rewards' scale")

    mask = completion_mask.float()
    active = mask != 0
    logp = logp.view(B, T)
    old_full = logp if old_logps is None else torch.where(active, old_logps.detach().float(), logp)
    ratio = torch.exp((logp - old_full).clamp(max=MAX_LOG_GAP))
    kl = None
    if beta != 0:
        d = (torch.where(active, ref_logps.detach().float(), logp) - logp).clamp(max=MAX_LOG_GAP)
        kl = torch.exp(d) - d - 1
    ent = outs[2].view(B, T) if compute_entropy else None
    metrics = grpo_metrics(ratio, adv, mask, float(epsilon_low), epsilon_high, kl=kl, entropy=ent)
    return loss, metrics


@torch.no_grad()
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
