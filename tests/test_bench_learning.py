"""bench/learning.py's pieces that need no training run: the --variant parser and the per-variant summary row."""

import argparse
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))

from learning import gain_row, parse_variant  # noqa: E402


def test_parse_variant_splits_outside_brackets_only():
    assert parse_variant("tool:") == ("tool", [])
    assert parse_variant("no_tool:tools=[]") == ("no_tool", ["tools=[]"])
    assert parse_variant("b:levels=[1,2],seed=3,x={a: 1, b: 2}") == ("b", ["levels=[1,2]", "seed=3", "x={a: 1, b: 2}"])
    for bad, needle in (
        ("notool", "want NAME:KEY=VALUE"),
        ("1x:seed=1", "want NAME:KEY=VALUE"),
        ("a:seed", "'seed' is not KEY=VALUE"),
    ):
        with pytest.raises(argparse.ArgumentTypeError, match=needle):
            parse_variant(bad)


def test_gain_row_mean_spread_and_tool_share():
    rows = [
        {"accuracy_before": 0.1, "accuracy_after": 0.5, "tool_use_share_after": 0.5},
        {"accuracy_before": 0.1, "accuracy_after": 0.7, "tool_use_share_after": 1.0},
    ]
    g = gain_row("tool", rows)
    assert g["row"] == "tool (all seeds)" and g["seeds_run"] == 2
    assert g["mean_after"] == pytest.approx(0.6) and g["mean_gain"] == pytest.approx(0.5)
    assert g["after_std"] == pytest.approx(0.1) and g["learns"] is True  # 0.5 > 2 x 0.1
    assert g["mean_tool_use_share_after"] == pytest.approx(0.75)
    flat = gain_row("no_tool", [{"accuracy_before": 0.2, "accuracy_after": 0.2}])
    assert flat["mean_gain"] == 0 and flat["learns"] is False and "mean_tool_use_share_after" not in flat


def test_engine_gap_figures_from_metrics_rows():
    from engine_gap import GAP, GAP_MAX, RATIO_MEAN, RATIO_MIN, gap_figures

    def row(gap, top, lo, mean):
        return {GAP: str(gap), GAP_MAX: str(top), RATIO_MIN: str(lo), RATIO_MEAN: str(mean), "step": "1"}

    rows = [row(0.12, 1.3, 0.0, 0.65), {"step": "2", GAP: ""}, row(0.10, 2.0, 0.2, 0.8), row(0.04, 0.5, 0.0, 1.1)]
    f = gap_figures(rows)
    assert f["steps_with_gap"] == 3 and f["gap_step1"] == 0.12 and f["gap_median"] == 0.10
    assert f["gap_max_token"] == 2.0 and f["ratio_mean_median"] == 0.8 and f["steps_with_a_dropped_sequence"] == 2
    with pytest.raises(ValueError, match="did not generate with vLLM"):
        gap_figures([{"step": "1"}])


def test_fp8_amplification_scores_completion_tokens_and_sees_only_real_differences():
    """bench/fp8_amplification's pieces on a tiny random Llama: one log-prob per completion token, exactly no gap
    when the same attention scores twice, a gap under W8A8 between eager and sdpa attention."""
    import copy

    import torch
    from fp8_amplification import gap_stats, token_logps

    from grpo_kit.model.fp8 import quantize_model_fp8
    from grpo_kit.model.loading import build_random_model

    model = build_random_model("tiny-llama", dtype=torch.bfloat16).eval()
    g = torch.Generator().manual_seed(0)
    seqs = [(torch.randint(0, model.config.vocab_size, (n,), generator=g), start) for n, start in ((20, 7), (13, 5))]
    a = token_logps(model, seqs, "eager", 0.7)
    assert a.shape == (20 - 7 + 13 - 5,) and bool((a <= 0).all())
    assert gap_stats(a, token_logps(model, seqs, "eager", 0.7))["max"] == 0.0
    w8a8 = copy.deepcopy(model)
    quantize_model_fp8(w8a8, activations="fp8")
    s = gap_stats(token_logps(w8a8, seqs, "eager", 0.7), token_logps(w8a8, seqs, "sdpa", 0.7))
    assert s["tokens"] == a.numel() and s["max"] > 0 and s["mean"] <= s["max"]
