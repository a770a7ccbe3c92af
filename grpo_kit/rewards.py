"""Reward functions and verifiers with TRL's signature ``fn(prompts, completions, **columns)``.

Completions come either as plain strings or, for conversational datasets, as a list of
messages (``[{"role": "assistant", "content": "..."}]``); both are accepted. Every
function returns one float per completion.

The examples below run as tests (``pytest --doctest-modules grpo_kit/rewards.py``).
"""

from __future__ import annotations

import logging
import math
import re
from fractions import Fraction

from .names import REWARD_ERRORS

_log = logging.getLogger("grpo_kit.rewards")

ANSWER_PREFIX = "Answer:"

# A number as people write it: optional sign (ASCII or Unicode minus), optional $,
# thousands separators, decimals, an optional fraction; "1234." keeps its trailing dot
# out of the match. The look-behind stops matching digits glued to letters (e.g. "x2").
_NUM = re.compile(
    r"(?<![\w.])(?P<sign>[-−])?\s?\$?\s?(?P<int>\d{1,3}(?:,\d{3})+|\d+)(?P<frac>\.\d+)?"
    r"(?:\s?/\s?(?P<den>\d+)(?![\d.]))?")
_GSM8K_MARK = re.compile(r"####\s*")
_ANSWER_MARK = re.compile(r"(?:answer\s*(?:is|:|=)|\\boxed\{)", re.IGNORECASE)
_STRICT = re.compile(r"^\s*Answer:\s*[-−]?\$?\s?[\d,]+(?:\.\d+)?(?:\s?/\s?\d+)?\s*\.?\s*$")


def completion_text(completion) -> str:
    """The text of one completion, plain or conversational.

    >>> completion_text([{"role": "assistant", "content": "Answer: 4"}])
    'Answer: 4'
    >>> completion_text("12")
    '12'
    """
    if isinstance(completion, str):
        return completion
    if isinstance(completion, list):
        return "".join(_content_text(m.get("content")) for m in completion if isinstance(m, dict))
    if isinstance(completion, dict):
        return _content_text(completion.get("content"))
    raise CompletionFormatError(f"completion must be a str or a list of messages, got {type(completion).__name__}")


class CompletionFormatError(ValueError, TypeError):
    """A completion that is neither text nor a list of chat messages (a ValueError; also a TypeError)."""


def _content_text(content) -> str:
    """A message's content: a string, None, or a list of parts (``{"type": "text", "text": ...}``)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # multimodal / OpenAI-style parts: the text parts, in order
        return "".join(p["text"] for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
    raise CompletionFormatError(f"message content must be a str, None or a list of parts, got "
                                f"{type(content).__name__}")


def _to_number(m: re.Match) -> float | None:
    digits = m.group("int").replace(",", "") + (m.group("frac") or "")
    try:
        value = Fraction(digits)
        if m.group("den"):
            den = int(m.group("den"))
            if den == 0:
                return None
            value /= den
        out = float(value)
    except (ValueError, OverflowError, ZeroDivisionError):
        return None
    if not math.isfinite(out):
        return None
    return -out if m.group("sign") else out


def _first_number(text: str) -> float | None:
    for m in _NUM.finditer(text):
        value = _to_number(m)
        if value is not None:
            return value
    return None


def extract_number(text: str) -> float | None:
    """The final numeric answer in ``text``, or ``None``.

    Priority: the number after the last GSM8K ``####`` marker; else the first number
    after the last "answer:" / "answer is" / ``\\boxed{``; else the last number in the text.

    >>> extract_number("The total is $1,234.50 in all.")
    1234.5
    >>> extract_number("So she has 1234.")
    1234.0
    >>> extract_number("It drops to -7 degrees")
    -7.0
    >>> extract_number("3/4 of the cake")
    0.75
    >>> extract_number("He walks 12 km per day, so 84 km in a week")
    84.0
    >>> extract_number("Natalia sold 48/2 = 24 clips in May.\\n#### 72")
    72.0
    >>> extract_number("Answer: 15 apples, because 3 * 5 = 15 and 2 more")
    15.0
    >>> extract_number("no digits here") is None
    True
    """
    if not isinstance(text, str) or not text:
        return None
    marks = list(_GSM8K_MARK.finditer(text))
    if marks:
        return _first_number(text[marks[-1].end():])
    marks = list(_ANSWER_MARK.finditer(text))
    if marks:
        value = _first_number(text[marks[-1].end():])
        if value is not None:
            return value
    last = None
    for m in _NUM.finditer(text):
        value = _to_number(m)
        if value is not None:
            last = value
    return last


def numbers_equal(a: float | None, b: float | None, rel: float = 1e-6) -> bool:
    """Equality with a small relative tolerance (answers like 0.1 + 0.2).

    >>> numbers_equal(0.30000000000000004, 0.3), numbers_equal(None, 3.0), numbers_equal(2.0, 3.0)
    (True, False, False)
    """
    if a is None or b is None or not (math.isfinite(a) and math.isfinite(b)):
        return False  # an infinite reference used to equal every number (inf <= 1e-6 * inf)
    return abs(a - b) <= rel * max(1.0, abs(b))


def _reference(answer) -> float | None:
    if isinstance(answer, (int, float)) and not isinstance(answer, bool):
        try:
            return float(answer)
        except OverflowError:  # an int beyond float range cannot be compared
            return None
    return extract_number(str(answer))


def correctness_reward(prompts, completions, answer, **kwargs) -> list[float]:
    """1.0 when the completion's final number equals the reference answer, else 0.0.

    ``answer`` is the dataset column (a number or a string; GSM8K's ``#### N`` works).

    >>> correctness_reward(None, ["I think 5 + 7 = 12.\\nAnswer: 12", "Answer: 13"], ["12", "12"])
    [1.0, 0.0]
    >>> correctness_reward(None, [[{"role": "assistant", "content": "#### 1,000"}]], ["1000"])
    [1.0]
    """
    if len(answer) != len(completions):
        raise ValueError(f"correctness_reward: {len(completions)} completions but {len(answer)} answers")
    return [1.0 if numbers_equal(extract_number(completion_text(c)), _reference(a)) else 0.0
            for c, a in zip(completions, answer)]


def format_strict_reward(prompts, completions, **kwargs) -> list[float]:
    """1.0 when the last non-empty line is exactly ``Answer: <number>``, else 0.0.

    >>> format_strict_reward(None, ["7 + 5 = 12\\nAnswer: 12", "Answer: 12 apples", "The answer is 12"])
    [1.0, 0.0, 0.0]
    """
    out = []
    for c in completions:
        lines = [ln for ln in completion_text(c).splitlines() if ln.strip()]
        out.append(1.0 if lines and _STRICT.match(lines[-1]) else 0.0)
    return out


def format_soft_reward(prompts, completions, **kwargs) -> list[float]:
    """1.0 when ``Answer: <number>`` appears anywhere (any case), else 0.0.

    >>> format_soft_reward(None, ["so answer: 12 apples", "12"])
    [1.0, 0.0]
    """
    pattern = re.compile(r"answer:\s*[-−]?\$?\s?\d", re.IGNORECASE)
    return [1.0 if pattern.search(completion_text(c)) else 0.0 for c in completions]


REWARD_FUNCTIONS = {
    "correctness": correctness_reward,
    "format_strict": format_strict_reward,
    "format_soft": format_soft_reward,
}


def get_reward_funcs(names) -> list:
    """Reward functions by name (see ``REWARD_FUNCTIONS``)."""
    unknown = [n for n in names if n not in REWARD_FUNCTIONS]
    if unknown:
        raise ValueError(f"unknown reward function(s) {unknown}; known: {list(REWARD_FUNCTIONS)}")
    return [REWARD_FUNCTIONS[n] for n in names]

class RewardFunctionError(ValueError):
    """A reward function returned something unusable or raised; the message names it and the sample."""


def _excerpt(x, n: int = 80) -> str:
    text = completion_text(x) if isinstance(x, (str, list, dict)) else str(x)
    return repr(text[:n] + ("..." if len(text) > n else ""))




def checked_reward_func(fn, on_error: str = "raise"):
    """Wrap a reward function so bad output stops training with a message naming it and the sample.

    Allowed per sample: a finite number, or ``None`` (TRL's "not applicable to this sample").
    Wrong length, NaN/inf, a non-number, or an exception raise ``RewardFunctionError``; when the
    function raises on the batch, it is re-run sample by sample to name the first failing sample.
    ``on_error="zero"`` (config ``reward_errors: zero``): a function that raises instead scores
    0.0 for each sample it raises on (re-run one by one; the others keep their scores), with a
    warning naming the function, the sample and the exception. Bad return values still raise.

    >>> ok = checked_reward_func(correctness_reward)
    >>> ok(None, ["Answer: 3"], answer=["3"])
    [1.0]
    >>> checked_reward_func(lambda prompts, completions, **kw: [1.0])(None, ["a", "b"])
    Traceback (most recent call last):
    ...
    grpo_kit.rewards.RewardFunctionError: reward function '<lambda>' returned 1 values for 2 completions
    """
    if on_error not in REWARD_ERRORS:
        raise ValueError(f"on_error={on_error!r} is not allowed; choose one of {list(REWARD_ERRORS)}")
    name = getattr(fn, "__name__", type(fn).__name__)
    if getattr(fn, "_grpo_kit_checked", False):
        return fn

    def wrapper(prompts, completions, **kwargs):
        n = len(completions)
        try:
            out = fn(prompts, completions, **kwargs)
        except Exception as e:
            zeroed = []
            for i in range(n):  # find the sample that breaks it
                one = {k: (v[i:i + 1] if isinstance(v, list) and len(v) == n else v) for k, v in kwargs.items()}
                try:
                    r1 = fn(None if prompts is None else prompts[i:i + 1], completions[i:i + 1], **one)
                    zeroed.append(list(r1)[0] if isinstance(r1, (list, tuple)) and len(r1) == 1 else r1)
                except Exception as e1:
                    msg = (f"reward function {name!r} raised {type(e1).__name__}: {e1} on sample {i} "
                           f"(completion {_excerpt(completions[i])})")
                    if on_error == "raise":
                        raise RewardFunctionError(msg) from e1
                    _log.warning("%s; scored 0.0 (reward_errors='zero')", msg)
                    zeroed.append(0.0)
            if on_error == "raise":
                raise RewardFunctionError(f"reward function {name!r} raised {type(e).__name__}: {e} "
                                          f"on a batch of {n} completions") from e
            out = zeroed
        if not isinstance(out, (list, tuple)) and not hasattr(out, "__len__"):
            raise RewardFunctionError(f"reward function {name!r} returned {type(out).__name__}, expected a list "
                                      f"of {n} floats (or None)")
        out = list(out)
        if len(out) != n:
            raise RewardFunctionError(f"reward function {name!r} returned {len(out)} values for {n} completions")
        for i, r in enumerate(out):
            if r is None:
                continue
            if isinstance(r, bool) or not isinstance(r, (int, float)) and not hasattr(r, "__float__"):
                raise RewardFunctionError(f"reward function {name!r} returned {r!r} for sample {i}; expected a "
                                          "number or None")
            if not math.isfinite(float(r)):
                raise RewardFunctionError(f"reward function {name!r} returned {float(r)} for sample {i} "
                                          f"(completion {_excerpt(completions[i])}); rewards must be finite "
                                          "(None means 'not applicable')")
        return [None if r is None else float(r) for r in out]

    wrapper.__name__, wrapper.__doc__ = name, fn.__doc__
    wrapper._grpo_kit_checked = True
    return wrapper
