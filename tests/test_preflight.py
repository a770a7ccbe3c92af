"""Pre-flight check: the share of groups with no reward spread, truncation, histograms, advice."""

import subprocess
import sys

from grpo_kit.app.config import GRPOKitConfig
from grpo_kit.app.metrics import first_step_advice
from grpo_kit.app.preflight import advice, preflight

SMALL = dict(
    num_generations=4, per_device_train_batch_size=4, max_completion_length=8, num_train_samples=8, num_eval_samples=0
)


def test_embedded_model_reports_a_share_in_0_1():
    r = preflight(GRPOKitConfig(**{**SMALL, "max_completion_length": 6}), num_prompts=2)
    assert (r.num_prompts, r.num_generations) == (2, 4)
    assert 0.0 <= r.zero_spread_share <= 1.0 and (r.zero_spread_share * 2) % 1 == 0  # whole groups
    assert 0.0 <= r.truncation_rate <= 1.0
    assert set(r.histograms) == {"correctness"}  # the default reward set (format_soft never fired: issue 56)
    assert all(sum(h.values()) == 8 for h in r.histograms.values())
    assert "groups with no reward spread" in r.text()


def test_forced_no_signal_gives_advice(repo_root):
    """Random weights (tiny-llama) never answer: every group has zero spread, and the advice fires."""
    cmd = [
        sys.executable,
        "-m",
        "grpo_kit",
        "preflight",
        "--prompts",
        "2",
        "--set",
        "model=tiny-llama",
        *[a for k, v in SMALL.items() for a in ("--set", f"{k}={v}")],
    ]
    r = subprocess.run(cmd, cwd=repo_root, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "groups with no reward spread (no learning signal): 100%" in r.stdout
    assert "easier problems: --set levels=[1]" in r.stdout and "SFT warm-up" in r.stdout, r.stdout
    assert "earned no reward at all" in r.stdout


def test_advice_only_when_most_groups_carry_no_signal():
    cfg = GRPOKitConfig(reward_funcs=["correctness"], levels=[1])
    assert advice(cfg, 0.5, 0.9) == []
    tips = advice(cfg, 0.9, 0.9, {"correctness": 0.1})
    assert any("format_soft" in t for t in tips) and any("max_completion_length=48" in t for t in tips)
    assert not any("levels" in t for t in tips)
    line = first_step_advice(cfg, {"step": 1, "frac_reward_zero_std": 0.25, "rewards/correctness_reward/mean": 0.4})
    assert line == "pre-flight (step 1): 25% of groups had no reward spread: the start has a learning signal"
    assert "try: " in first_step_advice(cfg, {"step": 1, "frac_reward_zero_std": 1.0})


def test_a_reward_that_gives_every_sample_one_value_is_named():
    """A dead reward (the default run's format_soft paid 0.000 in all 40 steps): the step-1 line and the pre-flight
    name it; a reward with any spread is not named."""
    cfg = GRPOKitConfig(reward_funcs=["correctness", "format_soft"], levels=[1])
    row = {
        "step": 1,
        "frac_reward_zero_std": 0.25,
        "rewards/correctness_reward/mean": 0.4,
        "rewards/correctness_reward/std": 0.49,
        "rewards/format_soft_reward/mean": 0.0,
        "rewards/format_soft_reward/std": 0.0,
    }
    lines = first_step_advice(cfg, row).splitlines()
    assert len(lines) == 2 and lines[1].startswith("pre-flight (step 1): format_soft_reward gave 0.000 to every sample")
    assert "correctness" not in lines[1]
    r = preflight(
        GRPOKitConfig(
            **{
                **SMALL,
                "model": "tiny-llama",
                "max_completion_length": 4,
                "reward_funcs": ["correctness", "format_soft"],
            }
        ),
        num_prompts=2,
    )
    assert r.constant == {"correctness": 0.0, "format_soft": 0.0}  # random weights never answer
    assert "format_soft gave 0.000 to every sample" in r.text()
