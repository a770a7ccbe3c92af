import json
import math
import time

import pytest

from grpo_kit.tasks import rewards
from grpo_kit.tasks.data import load_gsm8k_jsonl


@pytest.mark.parametrize(
    "text,expected",
    [
        ("$1,234.50", 1234.5),
        ("1234.", 1234.0),
        ("-7", -7.0),
        ("−7 degrees", -7.0),
        ("3/4", 0.75),
        ("It costs 18 dollars.", 18.0),
        ("#### 1,000", 1000.0),
        ("The answer is 42, not 41", 42.0),
        ("\\boxed{17}", 17.0),
        ("Answer: -3.5 m/s", -3.5),
        ("", None),
        ("none", None),
        ("x2 y3", None),
        ("1/0", None),
        ("9" * 400, None),
    ],
)
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
    with pytest.raises(
        rewards.RewardFunctionError, match=r"'nan_on_second' returned nan for sample 1 \(completion 'x marks'\)"
    ):
        rewards.checked_reward_func(nan_on_second)(None, comps)
    with pytest.raises(rewards.RewardFunctionError, match=r"'raises_on_x' raised ZeroDivisionError: .* on sample 1"):
        rewards.checked_reward_func(raises_on_x)(["p"] * 3, comps)
    with pytest.raises(rewards.RewardFunctionError, match="'wrong_len' returned 1 values for 3 completions"):
        rewards.checked_reward_func(wrong_len)(None, comps)
    with pytest.raises(rewards.RewardFunctionError, match="'not_numbers' returned 'high' for sample 0"):
        rewards.checked_reward_func(not_numbers)(None, comps)
    assert rewards.checked_reward_func(not_applicable)(None, comps) == [None, None, None]  # TRL: not applicable
    seen = []
    wrapped = rewards.checked_reward_func(rewards.correctness_reward, on_rewards=lambda *a: seen.append(a))
    assert wrapped.__name__ == "correctness_reward"
    assert wrapped(None, ["Answer: 3"], answer=["3"]) == [1.0]
    assert seen == [("correctness_reward", None, ["Answer: 3"], {"answer": ["3"]}, [1.0])]  # the checked scores


def test_reward_errors_zero_scores_raising_samples_zero_with_a_warning(caplog):
    from grpo_kit.app.config import ConfigError, GRPOKitConfig
    from grpo_kit.trainer.grpo_trainer import _checked

    def raises_on_x(prompts, completions, **kw):
        if any("x" in c for c in completions):
            raise KeyError("boom")
        return [float(len(c)) for c in completions]

    comps = ["ab", "x", "abc"]
    with caplog.at_level("WARNING", logger="grpo_kit.tasks.rewards"):
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


# --- issue 18: exact answers, linear time, overflow-safe values, a time limit per call -----------------------------
@pytest.mark.parametrize(
    "text,expected",
    [
        ("1e400", None),
        ("2.5e3 m", 2500.0),
        ("\\frac{1}{2}", 0.5),
        ("Answer: -\\dfrac{3}{4}", -0.75),
        ("1 000 000", 1e6),
        ("1\u202f000", 1000.0),
        ("1,23", None),
        ("#### 1_000", None),
        ("5,6,7", None),
        ("1.2.3", None),
        ("12/25/2023", None),
        ("The answer is 1/2.", 0.5),
        ("nan", None),
        ("5-3", 3.0),
        ("9" * 1001, None),
    ],
)
def test_extract_number_reads_or_refuses_without_misreading(text, expected):
    assert rewards.extract_number(text) == expected


def test_extract_answer_is_exact_beyond_float_range():
    from fractions import Fraction

    from grpo_kit.tasks.answers import extract_answer

    assert extract_answer("1e400").value == 10**400 and not extract_answer("1e400").exact
    assert extract_answer("Answer: " + "9" * 400).value == 10**400 - 1
    assert extract_answer("\\frac{2}{6}").value == Fraction(1, 3) and extract_answer("\\frac{2}{6}").exact


@pytest.mark.parametrize(
    "completion,answer,score",
    [
        ("Answer: 20000019", "20000000", 0.0),
        ("Answer: 1000001", 1000000, 0.0),
        ("Answer: 20000000.5", 20000000, 0.0),
        ("Answer: 1/3", "\\frac{2}{6}", 1.0),
        ("Answer: 0.30000000000000004", "0.3", 1.0),
        ("Answer: 2/4", 0.5, 1.0),
        ("Answer: " + str(10**30 + 1), 10**30, 0.0),
        ("Answer: " + str(10**30), 10**30, 1.0),
        ("Answer: 1e400", 10**400, 1.0),
        ("Answer: 0.333", "1/3", 0.0),
        ("Answer: 24.0", "24", 1.0),
    ],
)
def test_correctness_is_exact_for_integers_and_fractions(completion, answer, score):
    assert rewards.correctness_reward(None, [completion], [answer]) == [score]


ADVERSARIAL = [
    " " * 100_000,
    "Answer: 1" + " " * 100_000 + "x",
    "```" + " " * 100_000 + "x",
    "```\n" * 25_000,
    "```python\n" * 10_000,
    "`" * 100_000,
    "1," * 50_000,
    "1 " * 50_000,
    "1/" * 50_000,
    "\\frac{" * 15_000,
    "\\frac{1}{" * 10_000,
    "answer: " * 12_000,
    "answer:" + " " * 100_000,
    "Answer is " * 10_000,
    "9" * 100_000,
    "1e" * 50_000,
    "-" * 100_000,
    "$ " * 50_000,
    "#### " * 20_000,
    "1." * 50_000,
    "1.1," * 25_000,
    "\t\n " * 33_000 + "Answer: 1",
    ("x" * 1000 + "\n") * 100,
]


@pytest.mark.parametrize("k", range(len(ADVERSARIAL)))
def test_reward_extractors_take_linear_time_on_adversarial_text(k):
    from grpo_kit.tasks.code_reward import extract_code
    from grpo_kit.tasks.time_limit import call_with_time_limit

    text = ADVERSARIAL[k]
    calls = [
        lambda: rewards.extract_number(text),
        lambda: rewards.format_strict_reward(None, [text]),
        lambda: rewards.format_soft_reward(None, [text]),
        lambda: rewards.correctness_reward(None, [text], ["1"]),
        lambda: extract_code(text),
    ]
    for call in calls:  # each well under a second on a slow CI core; the old regexes took minutes
        t = time.perf_counter()
        call_with_time_limit(5.0, call)
        assert time.perf_counter() - t < 1.0, (k, call)


def test_reward_beyond_float_range_is_a_named_error():
    with pytest.raises(rewards.RewardFunctionError, match="'huge' returned a value that is no float for sample 1"):

        def huge(prompts, completions, **kw):
            return [1, 10**400]

        rewards.checked_reward_func(huge)(None, ["a", "b"])
    from fractions import Fraction

    assert rewards.checked_reward_func(lambda p, c, **k: [Fraction(1, 4)] * len(c))(None, ["a"]) == [0.25]


def _slow_on_marked(prompts, completions, **kw):
    out = []
    for c in completions:
        while "slow" in c:  # an `except Exception` inside cannot swallow the time limit
            try:
                time.sleep(0.01)
            except Exception:
                pass
        out.append(1.0)
    return out


@pytest.mark.parametrize("thread", [False, True])
def test_reward_call_time_limit_scores_zero_with_a_logged_reason(caplog, thread):
    import threading

    fn = rewards.checked_reward_func(_slow_on_marked, time_limit_s=0.3)
    box = {}
    t = time.perf_counter()
    with caplog.at_level("WARNING", logger="grpo_kit.tasks.rewards"):
        if thread:  # off the main thread the call is abandoned at the limit instead of interrupted
            worker = threading.Thread(target=lambda: box.update(out=fn(None, ["ok", "slow", "fine"])))
            worker.start()
            worker.join(10)
        else:
            box["out"] = fn(None, ["ok", "slow", "fine"])
    took = time.perf_counter() - t
    assert box["out"] == [1.0, 0.0, 1.0] and took < 2 * 0.3 + 0.5, took
    assert "'_slow_on_marked' ran past its time limit (reward_time_limit_s=0.3) on sample 1" in caplog.text
    assert "scored 0.0" in caplog.text


def test_reward_time_limit_interrupts_a_backtracking_regex():
    import re

    def catastrophic(prompts, completions, **kw):
        return [1.0 if re.match(r"^(a+)+$", c) else 0.0 for c in completions]

    t = time.perf_counter()
    out = rewards.checked_reward_func(catastrophic, time_limit_s=0.3)(None, ["aaa", "a" * 40 + "b"])
    assert out == [1.0, 0.0] and time.perf_counter() - t < 1.5
    with pytest.raises(ValueError, match="time_limit_s"):
        rewards.checked_reward_func(catastrophic, time_limit_s=float("inf"))


@pytest.mark.parametrize(
    "line",
    [
        "#### 1_000",
        "#### 1e400",
        "#### nan",
        "#### inf",
        "#### 1,23",
        "#### 5 apples",
        "#### 0x10",
        "#### " + "9" * 2000,
    ],
)
def test_gsm8k_answers_must_be_plain_numbers(line):
    from grpo_kit.tasks.data import parse_gsm8k_answer

    with pytest.raises(ValueError, match="not a plain number"):
        parse_gsm8k_answer("so\n" + line)


def test_gsm8k_loader_names_the_line_of_non_utf8_or_deeply_nested_json(tmp_path):
    from grpo_kit.tasks.data import parse_gsm8k_answer

    assert parse_gsm8k_answer("#### -$1,000") == "-1000" and parse_gsm8k_answer("#### 2.50") == "2.50"
    good = json.dumps({"question": "q", "answer": "#### 3"}) + "\n"
    (tmp_path / "a.jsonl").write_bytes(good.encode() + b'{"question": "\xff", "answer": "#### 3"}\n')
    with pytest.raises(ValueError, match=r"a.jsonl:2: not UTF-8"):
        load_gsm8k_jsonl(tmp_path / "a.jsonl")
    (tmp_path / "b.jsonl").write_text(good + "[" * 100_000 + "]" * 100_000 + "\n")
    with pytest.raises(ValueError, match=r"b.jsonl:2: JSON nested too deeply"):
        load_gsm8k_jsonl(tmp_path / "b.jsonl")
