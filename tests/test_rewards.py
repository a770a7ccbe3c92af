import math

import pytest

from grpo_kit import rewards
from grpo_kit.data import load_gsm8k_jsonl


@pytest.mark.parametrize("text,expected", [
    ("$1,234.50", 1234.5), ("1234.", 1234.0), ("-7", -7.0), ("−7 degrees", -7.0), ("3/4", 0.75),
    ("It costs 18 dollars.", 18.0), ("#### 1,000", 1000.0), ("The answer is 42, not 41", 42.0),
    ("\\boxed{17}", 17.0), ("Answer: -3.5 m/s", -3.5), ("", None), ("none", None), ("x2 y3", None),
    ("1/0", None), ("9" * 400, None),
])
def test_extract_number(text, expected):
    assert rewards.extract_number(text) == expected


def test_correctness_on_real_gsm8k_solutions(repo_root):
    """Every real GSM8K solution, scored as a completion against its own answer, is correct."""
    rows = load_gsm8k_jsonl(repo_root / "data" / "gsm8k_sample.jsonl")
    scores = rewards.correctness_reward(None, [r["solution"] for r in rows], [r["answer"] for r in rows])
    assert scores == [1.0] * len(rows)
    shifted = rewards.correctness_reward(None, [r["solution"] for r in rows[1:]], [r["answer"] for r in rows[:-1]])
    assert sum(shifted) < 0.1 * len(shifted)  # mismatched pairs are (almost all) wrong


def test_conversational_and_plain_agree():
    plain = ["Answer: 5", "so 6", "Answer: 7 cows"]
    conv = [[{"role": "assistant", "content": c}] for c in plain]
    for fn in rewards.REWARD_FUNCTIONS.values():
        assert fn(None, plain, answer=["5", "6", "7"]) == fn(None, conv, answer=["5", "6", "7"])


def test_format_rewards():
    comps = ["2 + 3 = 5\nAnswer: 5", "Answer: 5\nbecause", "answer: 5", "five"]
    assert rewards.format_strict_reward(None, comps) == [1.0, 0.0, 0.0, 0.0]
    assert rewards.format_soft_reward(None, comps) == [1.0, 1.0, 1.0, 0.0]


def test_bad_inputs():
    with pytest.raises(ValueError, match="2 completions but 1 answers"):
        rewards.correctness_reward(None, ["1", "2"], ["1"])
    with pytest.raises(ValueError, match="unknown reward"):
        rewards.get_reward_funcs(["correctness", "vibes"])
    with pytest.raises(TypeError, match="completion must be"):
        rewards.completion_text(3)
    huge = "9" * 100_000
    assert rewards.extract_number(huge) is None or math.isfinite(rewards.extract_number(huge))


def test_checked_reward_func_names_function_and_sample():
    def nan_on_second(prompts, completions, **kw):
        return [1.0, float("nan"), 0.0]

    def raises_on_x(prompts, completions, **kw):
        return [1.0 / (0 if "x" in rewards.completion_text(c) else 1) for c in completions]

    def wrong_len(prompts, completions, **kw):
        return [1.0]

    def not_numbers(prompts, completions, **kw):
        return ["high"] * len(completions)

    def not_applicable(prompts, completions, **kw):
        return [None] * len(completions)

    comps = ["a", "x marks", "c"]
    with pytest.raises(rewards.RewardFunctionError, match=r"'nan_on_second' returned nan for sample 1 \(completion 'x marks'\)"):
        rewards.checked_reward_func(nan_on_second)(None, comps)
    with pytest.raises(rewards.RewardFunctionError, match=r"'raises_on_x' raised ZeroDivisionError: .* on sample 1"):
        rewards.checked_reward_func(raises_on_x)(["p"] * 3, comps)
    with pytest.raises(rewards.RewardFunctionError, match="'wrong_len' returned 1 values for 3 completions"):
        rewards.checked_reward_func(wrong_len)(None, comps)
    with pytest.raises(rewards.RewardFunctionError, match="'not_numbers' returned 'high' for sample 0"):
        rewards.checked_reward_func(not_numbers)(None, comps)
    assert rewards.checked_reward_func(not_applicable)(None, comps) == [None, None, None]  # TRL: not applicable
    wrapped = rewards.checked_reward_func(rewards.correctness_reward)
    assert wrapped.__name__ == "correctness_reward" and rewards.checked_reward_func(wrapped) is wrapped


def test_reward_errors_zero_scores_raising_samples_zero_with_a_warning(caplog):
    from grpo_kit.config import ConfigError, GRPOKitConfig
    from grpo_kit.trainer import _checked

    def raises_on_x(prompts, completions, **kw):
        if any("x" in c for c in completions):
            raise KeyError("boom")
        return [float(len(c)) for c in completions]

    comps = ["ab", "x", "abc"]
    with caplog.at_level("WARNING", logger="grpo_kit.rewards"):
        assert rewards.checked_reward_func(raises_on_x, on_error="zero")(None, comps) == [2.0, 0.0, 3.0]
    assert "'raises_on_x' raised KeyError" in caplog.text and "sample 1" in caplog.text
    assert "scored 0.0" in caplog.text
    with pytest.raises(rewards.RewardFunctionError, match="sample 1"):  # the default still stops
        rewards.checked_reward_func(raises_on_x)(None, comps)
    assert _checked([raises_on_x], "zero")[0](None, comps) == [2.0, 0.0, 3.0]  # the trainer's wrapper
    with pytest.raises(rewards.RewardFunctionError, match="returned nan"):  # bad values are still errors
        rewards.checked_reward_func(lambda p, c, **k: [float("nan")] * len(c), on_error="zero")(None, comps)
    with pytest.raises(ValueError, match="on_error"):
        rewards.checked_reward_func(raises_on_x, on_error="ignore")
    assert GRPOKitConfig().reward_errors == "raise"
    GRPOKitConfig().apply_overrides(["reward_errors=zero"]).validate()
    with pytest.raises(ConfigError, match="reward_errors='skip'"):
        GRPOKitConfig().apply_overrides(["reward_errors=skip"]).validate()
