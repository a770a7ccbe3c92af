"""The GRPO loss in plain torch on per-token log-probs: the oracle the chunked loss is held equal to.

The per-token objective and its normalisers are :mod:`grpo_kit.loss.objective`'s; this module fills padding,
applies the masks and importance weights TRL applies, and sums: loss = sum_t w_t * per_token_loss_t over (B, T).
:func:`grpo_kit.loss.efficient.efficient_grpo_loss` calls :func:`objective_loss` on the log-probs it computes
chunk by chunk, so both paths evaluate the same function.
"""

from __future__ import annotations

import torch

from grpo_kit.loss.checks import check_inputs, objective_spec
from grpo_kit.loss.objective import (
    engine_importance_metrics,
    engine_importance_weights,
    high_entropy_mask,
    objective_metrics,
    per_token_objective,
    token_weights,
)


def fill_padding(logp, active, old, ref, isw):
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


def select_entropy_mask(spec, entropy, mask, entropy_mask_fn):
    """None, or the (B, T) 0/1 mask of the tokens in the top ``top_entropy_quantile`` by entropy."""
    if spec.top_entropy_quantile >= 1.0:
        return None
    if entropy is None:
        raise ValueError("top_entropy_quantile < 1 needs the per-token entropy (B, T)")
    if entropy_mask_fn is None:
        return high_entropy_mask(entropy, mask, spec.top_entropy_quantile)
    return entropy_mask_fn(entropy, mask)


def objective_loss(logp, spec, mask, adv, old, ref, isw, entropy, entropy_mask_fn, weights, sampling, engine=None):
    """sum(weights * per-token objective) over (B, T) log-probs with padding filled: (loss, parts).
    ``engine``: None or (mode, clip_min, clip_max): the importance weights are the engine correction of the
    old log-probs (``old``, or the current ones detached) against ``sampling``; ``parts["engine_ratio"]``
    keeps them for the metrics."""
    engine_ratio = None
    if engine is not None:
        isw = engine_ratio = engine_importance_weights(
            logp.detach() if old is None else old.detach(), sampling, mask, *engine
        )
    active = mask != 0
    old, ref, isw = fill_padding(logp, active, old, ref, isw)
    ent_mask = select_entropy_mask(spec, entropy, mask, entropy_mask_fn)
    per_tok, parts = per_token_objective(
        logp,
        old,
        ref,
        adv,
        mask,
        spec,
        importance_weights=isw,
        entropy_mask=None if ent_mask is None else ent_mask.to(logp.dtype),
        sampling_logp=None if sampling is None else sampling.to(logp.dtype),
    )
    if engine_ratio is not None:
        parts["engine_ratio"] = engine_ratio
    return (weights * per_tok).sum(), parts


def engine_metrics(logp, old, sampling, mask, parts) -> dict:
    """The ``sampling/*`` metrics of the engine correction :func:`objective_loss` formed (empty without one)."""
    if "engine_ratio" not in parts:
        return {}
    return engine_importance_metrics(
        logp.detach() if old is None else old.detach(), sampling, mask, parts["engine_ratio"]
    )


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
    """GRPO loss on per-token log-probs; the oracle for :func:`grpo_kit.loss.efficient.efficient_grpo_loss`.

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
        raise ValueError(
            f"logps must be a floating (B, T) tensor, got {type(logps).__name__} "
            f"{getattr(logps, 'dtype', '')} of shape {tuple(getattr(logps, 'shape', ()))}"
        )
    B, T = logps.shape
    adv, isw, engine = check_inputs(
        spec,
        B,
        T,
        mask,
        advantages,
        old_logps,
        ref_logps,
        importance_weights,
        max_completion_length,
        num_items_in_batch,
        engine_correction,
        sampling_logps,
    )
    maskf = mask.to(logps.dtype)
    w = token_weights(mask, loss_type, max_completion_length, num_items_in_batch, dtype=logps.dtype)
    loss, parts = objective_loss(
        logps, spec, maskf, adv, old_logps, ref_logps, isw, entropy, entropy_mask_fn, w, sampling_logps, engine
    )
    metrics = objective_metrics(parts, adv, maskf, spec, entropy)
    return loss, {**metrics, **engine_metrics(logps, old_logps, sampling_logps, maskf, parts)}
