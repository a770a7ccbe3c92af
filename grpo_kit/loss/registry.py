"""One registry for the objective's variants: each loss type is one decorated per-token function.

A loss type is its policy term per token plus what the rest of the kit needs to know about it, declared beside
it (verl's ``register_policy_loss`` is the model)::

    @register_loss("cispo", normaliser="token_count", metrics=CISPO_METRICS)
    def cispo(t, spec):
        return -t.ratio.clamp(max=spec.epsilon_high).detach() * t.advantages * t.logp

The function gets :class:`PolicyInputs` ``t`` and the :class:`grpo_kit.loss.objective.ObjectiveSpec` and returns
the policy term (B, T) (or broadcastable), or ``(term, parts)`` with ``parts`` a dict of detached terms for its
metrics (``"ratio"`` there replaces the logged ratio). The objective adds the rest around it
(:func:`grpo_kit.loss.objective.per_token_objective`): masks, importance weights, the KL term.

Everything that depends on the loss type reads its :class:`LossType`: the token weights and their input checks
(its :class:`Normaliser`), the metrics, ``guards.split_weights`` and the trainer's scaling over gradient
accumulation. The built-in types (TRL 1.16's) are registered in :mod:`grpo_kit.loss.objective`; a new one needs
only its decorated function (then train with the kit's trainer: TRL's own ``_compute_loss`` knows only its own).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import NamedTuple

import torch


class PolicyInputs(NamedTuple):
    """What a loss type's per-token function reads. (B, T) float unless said; sequence-level terms (B, 1).

    logp: the policy's log-probs (gradient flows through it); old: the old policy's (no gradient where TRL has
    none); ratio: exp(logp - old) per token, or GSPO's one length-normalised ratio per sequence (B, 1), clamped at
    ``MAX_LOG_GAP``; advantages: (B, 1) or (B, T); mask: (B, T) float, or None for a token-local chunk of (n,)
    vectors; importance_weights: None or (B, T) / (B, 1), no gradient (read only by a type that
    ``takes_importance_weights``; the others are multiplied by them afterwards).
    """

    logp: torch.Tensor
    old: torch.Tensor
    ratio: torch.Tensor
    advantages: torch.Tensor
    mask: torch.Tensor | None
    importance_weights: torch.Tensor | None


@dataclasses.dataclass(frozen=True)
class Normaliser:
    """How per-token losses are summed: loss = sum(w * per_token_loss), w from the mask alone.

    ``weights(m, max_completion_length, num_items_in_batch)``: m (B, T) float -> w (B, T), same dtype.
    ``needs``: the inputs it reads (checked by :func:`grpo_kit.loss.objective.check_normaliser_args`).
    ``share(part_mask, full_mask)``: the weight of a part of a micro-batch so that the parts' weighted losses
    sum to the whole's (``guards.split_weights``). ``global_count``: normalised by the active tokens of the
    whole accumulated batch (TRL's ``num_items_in_batch``), so the trainer does not divide by the accumulation
    steps.
    """

    name: str
    weights: Callable
    share: Callable
    needs: tuple[str, ...] = ()
    global_count: bool = False


def _sequence_share(part_mask, full_mask):
    return part_mask.size(0) / full_mask.size(0)


def _token_share(part_mask, full_mask):
    return float(part_mask.sum()) / float(full_mask.sum().clamp(min=1))


def _whole_share(part_mask, full_mask):
    return 1.0


def _token_count_weights(m, max_completion_length, num_items_in_batch):
    n = torch.as_tensor(num_items_in_batch, dtype=m.dtype, device=m.device).reshape(())
    return m / n.clamp(min=1.0)


NORMALISERS = {
    n.name: n
    for n in (
        # 1 / (B * L_i): mean over sequences of each sequence's token mean (L_i: active tokens of sequence i)
        Normaliser(
            "sequence_mean", lambda m, L, n: m / (m.shape[0] * m.sum(-1, keepdim=True).clamp(min=1.0)), _sequence_share
        ),
        # 1 / sum(L_i): token mean over the micro-batch
        Normaliser("token_mean", lambda m, L, n: m / m.sum().clamp(min=1.0), _token_share),
        # 1 / (B * max_completion_length): Dr. GRPO's constant
        Normaliser(
            "max_length", lambda m, L, n: m / float(m.shape[0] * L), _sequence_share, needs=("max_completion_length",)
        ),
        # 1 / B: per-sequence sums averaged over sequences (LUSPO)
        Normaliser("sequence_sum", lambda m, L, n: m / float(max(m.shape[0], 1)), _sequence_share),
        # 1 / num_items_in_batch: the active tokens of the whole accumulated batch (DAPO)
        Normaliser("token_count", _token_count_weights, _whole_share, needs=("num_items_in_batch",), global_count=True),
    )
}


@dataclasses.dataclass(frozen=True)
class LossMetrics:
    """A loss type's own metrics: their names (TRL's), and ``compute(parts, advantages, spec, mean, seq_mean)``
    returning {name: 0-d tensor}; ``mean(x)`` averages a (B, T) term over active tokens (a (B, 1) one over
    sequences), ``seq_mean(x)`` gives each sequence's mean (B,), NaN for an empty one. Names ending in ``min``
    / ``max`` are reduced across processes by min / max, the others averaged."""

    names: tuple[str, ...]
    compute: Callable


@dataclasses.dataclass(frozen=True)
class LossType:
    """One registered loss type. ``token_local``: each token's dL/dlogp depends on its own log-prob only
    (what lets the chunked loss take it inside the chunk loop); ``takes_importance_weights``: the function
    applies the importance weights itself (VESPO folds them into its sequence weight)."""

    name: str
    policy: Callable
    normaliser: Normaliser
    metrics: LossMetrics | None = None
    token_local: bool = True
    takes_importance_weights: bool = False


_REGISTRY: dict[str, LossType] = {}


def register_loss(
    name: str,
    *,
    normaliser: str,
    metrics: LossMetrics | None = None,
    token_local: bool = True,
    takes_importance_weights: bool = False,
):
    """Decorator: register ``fn(t: PolicyInputs, spec) -> term | (term, parts)`` as loss type ``name``.

    ``normaliser``: one of :data:`NORMALISERS`. Registering a name twice is refused (one definition each)."""
    if normaliser not in NORMALISERS:
        raise ValueError(f"normaliser must be one of {tuple(NORMALISERS)}, got {normaliser!r}")

    def decorate(fn):
        if name in _REGISTRY:
            raise ValueError(f"loss type {name!r} is already registered")
        _REGISTRY[name] = LossType(name, fn, NORMALISERS[normaliser], metrics, token_local, takes_importance_weights)
        return fn

    return decorate


def registered_loss_types() -> tuple[str, ...]:
    """The names of every loss type registered so far, in registration order."""
    return tuple(_REGISTRY)


def get_loss_type(name: str) -> LossType:
    """The registered :class:`LossType` called ``name``."""
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ValueError(f"loss_type must be one of {registered_loss_types()}, got {name!r}") from None
