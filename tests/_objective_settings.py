"""The objective settings the parity tests run (tests/test_loss.py, tests/test_trainer.py): every
loss type of TRL 1.16 and every option that changes the per-token math. Names as GRPOConfig's."""

SETTINGS = {
    "grpo": dict(loss_type="grpo", beta=0.04),
    "bnpo": dict(loss_type="bnpo", beta=0.04),
    "dr_grpo": dict(loss_type="dr_grpo", beta=0.04),
    "dapo": dict(loss_type="dapo", beta=0.04),
    "cispo": dict(loss_type="cispo", beta=0.04, epsilon_high=1.1),  # epsilon_high caps CISPO's ratio
    "sapo": dict(loss_type="sapo", beta=0.04),
    "vespo": dict(loss_type="vespo", beta=0.04),
    "luspo": dict(loss_type="luspo", beta=0.04, importance_sampling_level="sequence"),
    "gspo": dict(loss_type="grpo", beta=0.04, importance_sampling_level="sequence"),
    "gspo_dapo": dict(loss_type="dapo", beta=0.0, importance_sampling_level="sequence"),
    "delta": dict(loss_type="grpo", beta=0.0, delta=1.15),
    "bias_kl": dict(loss_type="bnpo", beta=0.04, use_bias_correction_kl=True),
    "bias_kl_gspo": dict(
        loss_type="grpo", beta=0.04, use_bias_correction_kl=True, importance_sampling_level="sequence"
    ),
    "off_policy_mask": dict(loss_type="grpo", beta=0.04, off_policy_mask_threshold=0.01),
    # (1 - q)(n - 1) not an integer: the quantile falls between two entropies, no tie at the threshold
    "top_entropy": dict(loss_type="grpo", beta=0.04, top_entropy_quantile=0.37),
    # TRL 1.16's GRPOConfig defaults, unchanged (beta 0 there; with a KL term too)
    "trl_default": dict(loss_type="dapo", beta=0.0, epsilon_high=None, use_bias_correction_kl=True),
    "trl_default_kl": dict(loss_type="dapo", beta=0.04, epsilon_high=None, use_bias_correction_kl=True),
}


def loss_kwargs(name):
    """Keyword arguments of grpo_loss_reference / efficient_grpo_loss for a setting."""
    kw = dict(SETTINGS[name])
    kw.setdefault("epsilon_low", 0.2)
    kw.setdefault("epsilon_high", 0.28)
    return kw
