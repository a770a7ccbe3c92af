"""Argument checks both loss paths share (:mod:`grpo_kit.loss.reference` and :mod:`grpo_kit.loss.efficient`).

Shapes: B sequences, T completion tokens. Each check raises ValueError naming the argument and what it must be.
"""

from __future__ import annotations

import dataclasses

import torch

from grpo_kit.loss.objective import ObjectiveSpec, check_engine_correction, check_normaliser_args
from grpo_kit.loss.registry import get_loss_type

_SPEC_FIELDS = tuple(f.name for f in dataclasses.fields(ObjectiveSpec))


def objective_spec(loss_type, beta, epsilon_low, epsilon_high, options) -> ObjectiveSpec:
    """The :class:`ObjectiveSpec` of one call; ``options``: the remaining TRL-named keywords."""
    unknown = sorted(set(options) - set(_SPEC_FIELDS))
    if unknown:
        raise ValueError(f"unknown loss option(s) {unknown}; allowed: {list(_SPEC_FIELDS)}")
    return ObjectiveSpec(loss_type=loss_type, beta=beta, epsilon_low=epsilon_low, epsilon_high=epsilon_high, **options)


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
        raise ValueError(
            "importance_weights must be None or a floating tensor of shape (B, T), (B, 1) or (B,), got "
            f"{type(weights).__name__} {getattr(weights, 'dtype', '')}"
        )
    if tuple(weights.shape) not in ((batch,), (batch, 1), (batch, length)):
        raise ValueError(
            f"importance_weights must have shape ({batch}, {length}), ({batch}, 1) or ({batch},), got "
            f"{tuple(weights.shape)}"
        )
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


def check_inputs(
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
    engine_correction=None,
    sampling_logps=None,
):
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
        if get_loss_type(spec.loss_type).takes_importance_weights:
            raise ValueError(
                f"engine_correction does not apply to loss_type={spec.loss_type!r} (its policy term "
                "takes the importance weights itself): pass them as importance_weights"
            )
        if not isinstance(sampling_logps, torch.Tensor) or tuple(sampling_logps.shape) != (B, T):
            raise ValueError(f"engine_correction needs the sampler's log-probs: sampling_logps of shape ({B}, {T})")
    return advantages, _check_importance_weights(importance_weights, B, T, mask), engine
