"""GRPO's group-relative advantage: each completion's reward against the other completions of its prompt.

DeepSeekMath (arXiv 2402.03300): A_i = (r_i - mean(r_group)) / std(r_group); Dr. GRPO (arXiv 2503.20783) drops
the std; the batch std is TRL's ``scale_rewards="batch"``. The objective (:mod:`grpo_kit.loss.objective`) takes
these advantages per sequence.
"""

from __future__ import annotations

import torch

SCALE_REWARDS = ("group", "batch", "none")  # GRPOConfig.scale_rewards, as strings


def group_advantages(rewards: torch.Tensor, num_generations: int, scale: str = "group") -> torch.Tensor:
    """GRPO advantages: reward minus its group's mean, divided by a std (as TRL 1.16 does).

    rewards: (N,) float, N a multiple of ``num_generations`` (consecutive groups). scale:
    ``"group"`` (each group's std), ``"batch"`` (the whole batch's std) or ``"none"``.
    Returns (N,) float; std + 1e-4 in the denominator, so a group of equal rewards gives 0.
    """
    if rewards.ndim != 1 or num_generations < 1 or rewards.numel() % num_generations:
        raise ValueError(
            f"rewards must be 1-D with a length divisible by num_generations={num_generations}, "
            f"got shape {tuple(rewards.shape)}"
        )
    if scale not in SCALE_REWARDS:
        raise ValueError(f"scale={scale!r} is not allowed; choose one of {list(SCALE_REWARDS)}")
    g = rewards.view(-1, num_generations)
    adv = (g - g.mean(dim=1, keepdim=True)).view(-1)
    if scale == "group":
        adv = adv / (g.std(dim=1).repeat_interleave(num_generations) + 1e-4)
    elif scale == "batch":
        adv = adv / (rewards.std() + 1e-4)
    return adv
