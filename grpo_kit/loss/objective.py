"""The GRPO objective, once: per-token losses over per-token log-probs and their normalisation.

Every path of the kit computes the loss with these functions: :func:`grpo_kit.loss.reference.grpo_loss_reference`
(the oracle), the chunked :func:`grpo_kit.loss.efficient.efficient_grpo_loss` (which takes each chunk's
gradient coefficient dL/dlogp from autograd of :func:`per_token_objective`) and the metrics. Each loss type
is one function registered below (:mod:`grpo_kit.loss.registry`) with its normaliser and metrics. The
math follows TRL 1.16 ``GRPOTrainer._compute_loss`` term by term; papers:

* ratio, PPO clip, k3 KL ``exp(ref - logp) - (ref - logp) - 1``: DeepSeekMath (arXiv 2402.03300, GRPO);
  k3 from Schulman, "Approximating KL divergence" (2020).
* ``epsilon_high`` (clip-higher) and the token-level ``dapo`` normaliser: DAPO (arXiv 2503.14476).
* ``dr_grpo`` normaliser (constant ``B * max_completion_length``): Dr. GRPO (arXiv 2503.20783).
* ``importance_sampling_level="sequence"``, s_i = exp(mean_t log r_it): GSPO (arXiv 2507.18071).
* ``cispo``: REINFORCE weighted by the detached ratio clipped at ``epsilon_high``: MiniMax-M1
  (arXiv 2506.13585); ScaleRL (arXiv 2510.13786) recommends ``epsilon_high=5``.
* ``sapo``: a sigmoid gate 4/tau * sigmoid(tau (r - 1)) in place of the hard clip: SAPO (arXiv 2511.20347).
* ``vespo``: a detached gamma weight phi(w) of the sequence ratio on -A * logp: VESPO (arXiv 2602.10693).
* ``luspo``: per-sequence sums averaged over sequences (length-unbiased GSPO): LUSPO (arXiv 2602.05261).
* ``delta``: two-sided clipping, the unclipped ratio capped at delta: INTELLECT-2 (arXiv 2505.07291).
* ``use_bias_correction_kl``: the k3 term times the ratio, the unbiased reverse-KL gradient off-policy:
  DeepSeek-V3.2 (arXiv 2512.02556).
* ``off_policy_mask_threshold``: drop negative-advantage sequences whose mean KL(sampler || policy)
  exceeds it: DeepSeek-V3.2's off-policy sequence mask (arXiv 2512.02556).
* ``top_entropy_quantile``: policy loss on the top-rho tokens by entropy only: "Beyond the 80/20 Rule"
  (arXiv 2506.01939).
* the engine's importance-sampling correction (samples from vLLM, another numerical policy): the ratio
  pi_old / pi_sampler per token or per sequence, truncated or masked outside [C_min, C_max]: truncated
  importance sampling, Yao et al., "Your efficient RL framework secretly brings you off-policy RL training"
  (2025); TRL 1.16's ``vllm_importance_sampling_mode``.

Shapes: B sequences, T completion tokens; log-probs (B, T) float; advantages (B, 1) or (B, T);
mask (B, T). Sequence-level quantities are (B, 1) and broadcast over T.
"""

from __future__ import annotations

import dataclasses
import math
import numbers

import torch

from grpo_kit.loss.registry import LossMetrics, PolicyInputs, get_loss_type, register_loss, registered_loss_types

IMPORTANCE_SAMPLING_LEVELS = ("token", "sequence")  # GRPOConfig.importance_sampling_level
# GRPOConfig.vllm_importance_sampling_mode: the engine's importance-sampling correction
ENGINE_IS_MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")
ENGINE_IS_DEFAULT = "sequence_mask"  # TRL 1.16's default mode
ENGINE_IS_TOKEN_MODES = ENGINE_IS_MODES[:2]  # one ratio per token (what VESPO's own weighting needs)
# TRL 1.16's names of the engine correction's metrics (:func:`engine_importance_metrics`)
ENGINE_IS_METRICS = (
    "sampling/sampling_logp_difference/mean",
    "sampling/sampling_logp_difference/max",
    "sampling/importance_sampling_ratio/min",
    "sampling/importance_sampling_ratio/mean",
    "sampling/importance_sampling_ratio/max",
)

# exp() of a log-prob gap overflows fp32 beyond ~88 nats, and inf * 0 (a zero advantage, a clipped
# branch) is NaN. Gaps (logp - old for the ratio, ref - logp for the k3 KL) are clamped at 60 nats:
# e^60 ~ 1e26 stays finite even times large advantages, and such a token then gets no gradient from
# that term (as torch's clamp gives it). Real training never comes near: a ratio of e^60 is a policy
# that has left the trust region by 26 orders of magnitude.
MAX_LOG_GAP = 60.0


def _real(name, val, *, low=None, allow_none=False, positive=False):
    if val is None and allow_none:
        return None
    if isinstance(val, bool) or not isinstance(val, numbers.Real) or not math.isfinite(val):
        raise ValueError(f"{name} must be a finite number{' or None' if allow_none else ''}, got {val!r}")
    if positive and val <= 0:
        raise ValueError(f"{name} must be > 0, got {val!r}")
    if low is not None and val < low:
        raise ValueError(f"{name} must be >= {low}, got {val!r}")
    return float(val)


@dataclasses.dataclass(frozen=True)
class ObjectiveSpec:
    """The options of the per-token objective, validated once at construction (names as TRL's GRPOConfig).

    ``epsilon_high=None`` means ``epsilon_low`` (TRL). ``top_entropy_quantile`` in [0, 1]: 1 keeps
    every token, 0 only the highest-entropy one(s). The sapo / vespo parameters are read only by those loss types.
    """

    loss_type: str = "grpo"
    beta: float = 0.0
    epsilon_low: float = 0.2
    epsilon_high: float | None = None
    delta: float | None = None
    importance_sampling_level: str = "token"
    use_bias_correction_kl: bool = False
    top_entropy_quantile: float = 1.0
    off_policy_mask_threshold: float | None = None
    sapo_temperature_pos: float = 1.0
    sapo_temperature_neg: float = 1.05
    vespo_k_pos: float = 2.0
    vespo_lambda_pos: float = 3.0
    vespo_k_neg: float = 3.0
    vespo_lambda_neg: float = 2.0

    def __post_init__(self):
        get_loss_type(self.loss_type)  # refuses a name no loss type is registered under
        if self.importance_sampling_level not in IMPORTANCE_SAMPLING_LEVELS:
            raise ValueError(
                f"importance_sampling_level must be one of {IMPORTANCE_SAMPLING_LEVELS}, "
                f"got {self.importance_sampling_level!r}"
            )
        if not isinstance(self.use_bias_correction_kl, bool):
            raise ValueError(f"use_bias_correction_kl must be True or False, got {self.use_bias_correction_kl!r}")
        fix = {"beta": _real("beta", self.beta, low=0), "epsilon_low": _real("epsilon_low", self.epsilon_low, low=0)}
        fix["epsilon_high"] = (
            fix["epsilon_low"] if self.epsilon_high is None else _real("epsilon_high", self.epsilon_high, low=0)
        )
        fix["delta"] = _real("delta", self.delta, allow_none=True, positive=True)
        fix["off_policy_mask_threshold"] = _real(
            "off_policy_mask_threshold", self.off_policy_mask_threshold, allow_none=True
        )
        q = _real("top_entropy_quantile", self.top_entropy_quantile, low=0)
        if q > 1:
            raise ValueError(f"top_entropy_quantile must be in [0, 1], got {q!r}")
        fix["top_entropy_quantile"] = q
        for name in ("sapo_temperature_pos", "sapo_temperature_neg"):
            fix[name] = _real(name, getattr(self, name), positive=True)
        for name in ("vespo_k_pos", "vespo_lambda_pos", "vespo_k_neg", "vespo_lambda_neg"):
            fix[name] = _real(name, getattr(self, name))
        for k, v in fix.items():
            object.__setattr__(self, k, v)

    @property
    def token_local(self) -> bool:
        """True when each token's dL/dlogp depends on that token's own log-prob only (given the
        normaliser): then the chunked loss can get it inside the chunk loop (it does for a trainable
        head). A sequence ratio (GSPO), VESPO's sequence weight, the off-policy sequence mask and the
        entropy quantile (a batch threshold) couple the tokens, as does a loss type registered with
        ``token_local=False``."""
        return (
            self.importance_sampling_level == "token"
            and get_loss_type(self.loss_type).token_local
            and self.top_entropy_quantile >= 1.0
            and self.off_policy_mask_threshold is None
        )


# The objective's options beside the loss type, beta and the clip range: the losses' keyword arguments, under
# GRPOConfig's names (the trainer passes each from TRL's config).
OBJECTIVE_OPTIONS = tuple(
    f.name
    for f in dataclasses.fields(ObjectiveSpec)
    if f.name not in ("loss_type", "beta", "epsilon_low", "epsilon_high")
)


def check_normaliser_args(loss_type, max_completion_length, num_items_in_batch):
    """The normaliser inputs a loss type needs (its normaliser's ``needs``): ``max_length`` (dr_grpo)
    max_completion_length; ``token_count`` (dapo, cispo, vespo) num_items_in_batch, a scalar number or
    0-d / 1-element tensor."""
    needs = get_loss_type(loss_type).normaliser.needs
    if "max_completion_length" in needs:
        if max_completion_length is None:
            raise ValueError(
                f"loss_type={loss_type!r} needs max_completion_length (it divides by B * max_completion_length)"
            )
        if not isinstance(max_completion_length, numbers.Integral) or max_completion_length <= 0:
            raise ValueError(f"max_completion_length must be a positive int, got {max_completion_length!r}")
    if "num_items_in_batch" in needs:
        if num_items_in_batch is None:
            raise ValueError(
                f"loss_type={loss_type!r} needs num_items_in_batch (active tokens of the whole accumulated batch)"
            )
        if isinstance(num_items_in_batch, torch.Tensor) and num_items_in_batch.numel() != 1:
            raise ValueError(f"num_items_in_batch must be a scalar, got shape {tuple(num_items_in_batch.shape)}")
        n = num_items_in_batch.item() if isinstance(num_items_in_batch, torch.Tensor) else num_items_in_batch
        if not isinstance(n, numbers.Real) or not math.isfinite(n) or n < 0:
            raise ValueError(f"num_items_in_batch must be a finite number >= 0, got {num_items_in_batch!r}")


def token_weights(mask, loss_type, max_completion_length=None, num_items_in_batch=None, dtype=torch.float32):
    """Per-token weight w of the ``loss_type`` normalisation: loss = sum(w * per_token_loss).

    mask: (B, T) any dtype. Returns (B, T) in ``dtype``, fixed by the mask alone (what lets the chunked
    loss know every token's weight before its chunk loop). With L_i the active tokens of sequence i, by
    the loss type's normaliser (:data:`grpo_kit.loss.registry.NORMALISERS`):

    ==================  ========================  ===========================================================
    ``sequence_mean``   ``grpo``, ``sapo``        1 / (B * L_i): mean over sequences of each one's token mean
    ``token_mean``      ``bnpo``                  1 / sum(L_i): token mean over the micro-batch
    ``max_length``      ``dr_grpo``               1 / (B * max_completion_length)
    ``token_count``     ``dapo``, ``cispo``,      1 / num_items_in_batch (active tokens of the whole
                        ``vespo``                 accumulated batch)
    ``sequence_sum``    ``luspo``                 1 / B: per-sequence sums, averaged over sequences
    ==================  ========================  ===========================================================
    """
    return get_loss_type(loss_type).normaliser.weights(mask.to(dtype), max_completion_length, num_items_in_batch)


def high_entropy_mask(entropy, mask, quantile):
    """(B, T) bool: active tokens whose entropy is >= the (1 - quantile) quantile of the active
    tokens' entropies (TRL's ``get_high_entropy_mask`` on one process)."""
    active = mask.bool()
    local = entropy[active].float()
    if local.numel() == 0:
        return torch.zeros_like(active)
    return (entropy * mask.float() >= torch.quantile(local, 1 - quantile)) & active


@torch.no_grad()
def vespo_gamma_weights(log_ratio, mask, advantages, spec, importance_weights=None):
    """VESPO's detached sequence weight phi(w) = exp(lambda + k log w - lambda w), (B, 1), with
    w = exp(sum_t log r_t) times the engine importance ratios (k, lambda by the advantage's sign)."""
    lower = math.log(1e-8)  # TRL's clamp range, kept for identical numbers
    seq = (log_ratio.clamp(-20.0, 20.0) * mask).sum(-1, keepdim=True)
    if importance_weights is not None:
        seq = seq + importance_weights.log().clamp(lower, 20.0).sum(-1, keepdim=True)
    log_w = seq.clamp(lower, 20.0)
    nonneg = advantages >= 0
    k = torch.where(nonneg, spec.vespo_k_pos, spec.vespo_k_neg)
    lam = torch.where(nonneg, spec.vespo_lambda_pos, spec.vespo_lambda_neg).clamp(min=1e-4)
    return torch.exp(lam + k * log_w - lam * torch.exp(log_w)).nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)


def k3_kl(logp, ref_logp):
    """k3 estimator of KL(pi_theta || pi_ref) per sampled token, r - 1 - log r with
    r = pi_ref / pi_theta (unbiased, >= 0; DeepSeekMath's). Same shape as the inputs; the gap is
    clamped at MAX_LOG_GAP so it stays finite."""
    d = (ref_logp - logp).clamp(max=MAX_LOG_GAP)
    return torch.exp(d) - d - 1


@torch.no_grad()
def off_policy_sequence_mask(logp, sampling_logp, advantages, mask, threshold):
    """(B, 1) 0/1: keep a sequence unless its advantage is negative and its mean KL(sampler || policy)
    estimate, mean_t (sampling_logp - logp), exceeds ``threshold`` (NaN sampler log-probs count 0)."""
    kl = torch.nan_to_num(sampling_logp - logp.detach(), nan=0.0)
    seq_kl = (kl * mask).sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp(min=1.0)
    return ((advantages >= 0) | (seq_kl <= threshold)).to(mask.dtype)


@torch.no_grad()
def engine_importance_weights(old_logp, sampling_logp, mask, mode, clip_min=None, clip_max=3.0):
    """The engine's importance-sampling correction, as TRL 1.16 ``_generate_and_score_completions`` forms it.

    old_logp, sampling_logp: (B, T) float, the policy's and the sampler's log-probs of the sampled tokens
    (the sampler's may be NaN where the engine could not score a token: that token counts 0, ratio 1);
    mask: (B, T). ``mode`` (``ENGINE_IS_MODES``): ``token_*`` gives r_t = exp(old_t - sampling_t) (B, T),
    ``sequence_*`` one r = exp(sum_t of it) per sequence (B, 1); ``*_truncate`` clamps r to
    [clip_min, clip_max], ``*_mask`` sets r outside it to 0 (None: that side unbounded). No gradient.
    """
    diff = torch.nan_to_num((old_logp.float() - sampling_logp.float()) * mask, nan=0.0)
    if mode.startswith("sequence"):
        diff = diff.sum(-1, keepdim=True)
    ratio = torch.exp(diff)
    if mode.endswith("truncate"):
        return torch.clamp(ratio, min=clip_min, max=clip_max)
    low = -math.inf if clip_min is None else clip_min
    high = math.inf if clip_max is None else clip_max
    return ratio.masked_fill((ratio < low) | (ratio > high), 0.0)


@torch.no_grad()
def engine_importance_metrics(old_logp, sampling_logp, mask, ratio):
    """TRL 1.16's ``sampling/*`` metrics (one process) of :func:`engine_importance_weights`' ``ratio``:
    mean and max |old - sampling| over the scored unmasked tokens, min / mean / max of the ratio over the
    unmasked tokens (token modes) or over the sequences (sequence modes). 0-d fp32 tensors."""
    keep = mask.bool()
    delta = (old_logp.float() - sampling_logp.float()).abs()
    delta = delta[keep & ~torch.isnan(delta)]
    flat = ratio.flatten() if ratio.shape[-1] == 1 else ratio[keep]
    zero = torch.zeros((), device=ratio.device)

    def pick(x, fn):
        return fn(x) if x.numel() else zero

    values = (
        pick(delta, torch.mean),
        pick(delta, torch.max),
        pick(flat, torch.min),
        pick(flat, torch.mean),
        pick(flat, torch.max),
    )
    return dict(zip(ENGINE_IS_METRICS, values))


def check_engine_correction(correction):
    """None, or ``(mode, clip_min, clip_max)`` of :func:`engine_importance_weights`; returned as a tuple."""
    if correction is None:
        return None
    if not isinstance(correction, (tuple, list)) or len(correction) != 3:
        raise ValueError(f"engine_correction must be None or (mode, clip_min, clip_max), got {correction!r}")
    mode, low, high = correction
    if mode not in ENGINE_IS_MODES:
        raise ValueError(f"engine_correction mode {mode!r} is not one of {ENGINE_IS_MODES}")
    low, high = _real("clip_min", low, allow_none=True), _real("clip_max", high, allow_none=True)
    if low is not None and high is not None and low > high:
        raise ValueError(f"engine_correction clip_min={low} is above clip_max={high}")
    return mode, low, high


# ================================================================================================
# the loss types: one registered function each, its policy term per token (TRL 1.16's eight)
# ================================================================================================
def _clip_metrics(parts, advantages, spec, mean, seq_mean):
    ratio = parts["ratio"]
    low = (ratio < 1 - spec.epsilon_low) & (advantages < 0)
    high = (ratio > 1 + spec.epsilon_high) & (advantages > 0)
    return {
        "clip_ratio/low_mean": mean(low),
        "clip_ratio/high_mean": mean(high),
        "clip_ratio/region_mean": mean(low | high),
        "clip_ratio/low_min": nanmin(seq_mean(low)),
        "clip_ratio/high_max": nanmax(seq_mean(high)),
    }


CLIP_METRICS = LossMetrics(
    (
        "clip_ratio/low_mean",
        "clip_ratio/high_mean",
        "clip_ratio/region_mean",
        "clip_ratio/low_min",
        "clip_ratio/high_max",
    ),
    _clip_metrics,
)
CISPO_METRICS = LossMetrics(
    ("cispo_clip_ratio",),
    lambda parts, advantages, spec, mean, seq_mean: {
        "cispo_clip_ratio": mean((parts["ratio"] > spec.epsilon_high) & (advantages > 0))
    },
)
VESPO_METRICS = LossMetrics(
    ("vespo/phi_seq_mean",), lambda parts, advantages, spec, mean, seq_mean: {"vespo/phi_seq_mean": mean(parts["phi"])}
)


def clipped_surrogate(t: PolicyInputs, spec):
    """PPO's clipped surrogate -min(r A, clip(r, 1 - eps_low, 1 + eps_high) A); with ``delta`` the
    unclipped branch is capped at delta too (two-sided, after the clipped one is taken)."""
    clipped = t.ratio.clamp(1 - spec.epsilon_low, 1 + spec.epsilon_high)
    ratio = t.ratio if spec.delta is None else t.ratio.clamp(max=spec.delta)
    return -torch.min(ratio * t.advantages, clipped * t.advantages), {"ratio": ratio}


@register_loss("grpo", normaliser="sequence_mean", metrics=CLIP_METRICS)
def grpo(t, spec):
    """GRPO (DeepSeekMath): the clipped surrogate, each sequence's token mean averaged over sequences."""
    return clipped_surrogate(t, spec)


@register_loss("bnpo", normaliser="token_mean", metrics=CLIP_METRICS)
def bnpo(t, spec):
    """The clipped surrogate, averaged over the micro-batch's active tokens."""
    return clipped_surrogate(t, spec)


@register_loss("dr_grpo", normaliser="max_length", metrics=CLIP_METRICS)
def dr_grpo(t, spec):
    """Dr. GRPO: the clipped surrogate over a constant B * max_completion_length (no length bias)."""
    return clipped_surrogate(t, spec)


@register_loss("dapo", normaliser="token_count", metrics=CLIP_METRICS)
def dapo(t, spec):
    """DAPO: the clipped surrogate over the whole accumulated batch's active tokens."""
    return clipped_surrogate(t, spec)


@register_loss("cispo", normaliser="token_count", metrics=CISPO_METRICS)
def cispo(t, spec):
    """CISPO (MiniMax-M1): REINFORCE weighted by the detached ratio clipped from above at epsilon_high."""
    return -t.ratio.clamp(max=spec.epsilon_high).detach() * t.advantages * t.logp


@register_loss("sapo", normaliser="sequence_mean")
def sapo(t, spec):
    """SAPO: a soft gate 4/tau sigmoid(tau (r - 1)) in place of the hard clip: slope 1 at r = 1, decaying
    smoothly away from it (tau by the advantage's sign)."""
    tau = torch.where(t.advantages > 0, spec.sapo_temperature_pos, spec.sapo_temperature_neg)
    return -torch.sigmoid(tau * (t.ratio - 1)) * 4 / tau * t.advantages


@register_loss(
    "vespo", normaliser="token_count", metrics=VESPO_METRICS, token_local=False, takes_importance_weights=True
)
def vespo(t, spec):
    """VESPO: -phi(w) A logp with phi a detached gamma weight of the sequence ratio w, into which the
    importance weights fold (so it couples a sequence's tokens)."""
    phi = vespo_gamma_weights(t.logp - t.old, t.mask, t.advantages, spec, t.importance_weights)
    return -phi * t.advantages * t.logp, {"phi": phi}


@register_loss("luspo", normaliser="sequence_sum", metrics=CLIP_METRICS)
def luspo(t, spec):
    """LUSPO: the clipped surrogate (of GSPO's sequence ratio) summed per sequence, averaged over sequences."""
    return clipped_surrogate(t, spec)


# The built-in loss types (TRL 1.16's GRPOConfig.loss_type); registered_loss_types() adds any registered later.
LOSS_TYPES = registered_loss_types()


def per_token_objective(
    logp, old_logp, ref_logp, advantages, mask, spec, *, importance_weights=None, entropy_mask=None, sampling_logp=None
):
    """Per-token GRPO loss before normalisation, as TRL 1.16 ``_compute_loss`` builds it.

    logp: (B, T) float, the policy's log-probs (gradient flows through it); old_logp, ref_logp:
    (B, T) or None (old None: ``logp.detach()``, on-policy, ratio 1 with gradient A; ref read only
    when ``spec.beta != 0``); advantages: (B, 1) or (B, T); mask: (B, T) float, read for the
    sequence-level terms only (so a token-local spec may pass None and (n,) vectors); padding must
    hold old = ref = logp (ratio 1, KL 0). importance_weights: None or (B, T) / (B, 1), no
    gradient (TRL's ``importance_sampling_ratio``); entropy_mask: None or (B, T) 0/1;
    sampling_logp: (B, T) or None (then old), the sampler's log-probs for the off-policy mask.

    Returns (per_token_loss (B, T) or broadcastable, parts) with ``parts`` the detached terms
    the metrics read: ``ratio`` (as TRL's ``coef_1``), ``kl`` (or None), and the loss type's own
    (vespo: ``phi``).
    """
    variant = get_loss_type(spec.loss_type)
    old = logp.detach() if old_logp is None else old_logp
    log_ratio = logp - old
    if spec.importance_sampling_level == "sequence":  # GSPO: one length-normalised ratio per sequence
        log_ratio = (log_ratio * mask).sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp(min=1.0)
    ratio = torch.exp(log_ratio.clamp(max=MAX_LOG_GAP))

    kl = None
    if spec.beta != 0:
        kl = k3_kl(logp, ref_logp)
        if spec.use_bias_correction_kl:  # importance-weighted: unbiased under off-policy samples
            kl = kl * ratio

    policy = variant.policy(PolicyInputs(logp, old, ratio, advantages, mask, importance_weights), spec)
    policy, own_parts = policy if isinstance(policy, tuple) else (policy, {})
    if spec.off_policy_mask_threshold is not None:
        policy = policy * off_policy_sequence_mask(
            logp, old if sampling_logp is None else sampling_logp, advantages, mask, spec.off_policy_mask_threshold
        )
    if entropy_mask is not None:
        policy = policy * entropy_mask
    if importance_weights is not None and not variant.takes_importance_weights:
        policy = policy * importance_weights
    loss = policy if kl is None else policy + spec.beta * kl
    parts = {"ratio": ratio.detach(), "kl": None if kl is None else kl.detach()}
    parts.update({name: value.detach() for name, value in own_parts.items()})
    return loss, parts


def nanmin(x):
    """Min over the non-NaN entries (NaN when there are none), as TRL's ``nanmin``."""
    x = x[~torch.isnan(x)]
    return x.min() if x.numel() else torch.tensor(float("nan"), device=x.device)


def nanmax(x):
    """Max over the non-NaN entries (NaN when there are none), as TRL's ``nanmax``."""
    x = x[~torch.isnan(x)]
    return x.max() if x.numel() else torch.tensor(float("nan"), device=x.device)


@torch.no_grad()
def objective_metrics(parts, advantages, mask, spec, entropy=None):
    """Detached logging metrics with TRL 1.16's names and means (one process).

    parts: from :func:`per_token_objective`; advantages (B, 1) or (B, T); mask, entropy (B, T).
    A (B, 1) term (sequence level) is averaged over sequences, as TRL does. Returns 0-d fp32
    tensors: ``ratio_mean``; the loss type's own (:class:`grpo_kit.loss.registry.LossMetrics`: for the clip
    family ``clip_ratio/{low_mean,high_mean,region_mean,low_min,high_max}``, ``cispo_clip_ratio``,
    ``vespo/phi_seq_mean``); ``kl``; ``entropy``.
    """
    mask = mask.float()

    def mean(x):
        x = x.float()
        if x.shape[-1] == 1:
            return x.mean()
        return (x * mask).sum() / mask.sum().clamp(min=1.0)

    def seq_mean(x):  # NaN for empty sequences, skipped by nanmin/nanmax like TRL's
        x = x.float()
        return x.squeeze(-1) if x.shape[-1] == 1 else (x * mask).sum(-1) / mask.sum(-1)

    out = {"ratio_mean": mean(parts["ratio"])}
    own = get_loss_type(spec.loss_type).metrics
    if own is not None:
        out.update(own.compute(parts, advantages, spec, mean, seq_mean))
    if parts["kl"] is not None:
        out["kl"] = mean(parts["kl"])
    if entropy is not None:
        out["entropy"] = mean(entropy)
    return {k: v.detach().float().reshape(()) for k, v in out.items()}
