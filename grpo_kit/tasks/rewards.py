"""Reward functions and verifiers with TRL's signature ``fn(prompts, completions, **columns)``.

Completions come either as plain strings or, for conversational datasets, as a list of
messages (``[{"role": "assistant", "content": "..."}]``); both are accepted. Every
function returns one float per completion.

The examples below run as tests (``pytest --doctest-modules grpo_kit/tasks/rewards.py``).
"""

from __future__ import annotations

import logging
import math
import re
import time

from grpo_kit.tasks.answers import as_number, extract_answer, numbers_equal, single_number, to_float
from grpo_kit.tasks.entries import resolve_entries, resolve_entry
from grpo_kit.tasks.time_limit import TimeLimitExceeded, call_with_time_limit

REWARD_ERRORS = ("raise", "zero")  # what checked_reward_func does when a reward function raises


_log = logging.getLogger("grpo_kit.tasks.rewards")

ANSWER_PREFIX = "Answer:"
# Linear: each attempt starts at the literal "answer:", and the whitespace runs after two of them never overlap.
_SOFT_ANSWER = re.compile(r"answer:\s*[-−]?\$?\s?\d", re.IGNORECASE)


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


def final_answer_text(completion) -> str:
    """The text the model gave as its answer: a plain completion whole; of a conversation (a multi-turn rollout
    with tool calls and tool results), only the content of its last assistant message, so that a tool's result
    is never taken for the model's answer.

    >>> final_answer_text([{"role": "assistant", "content": "", "tool_calls": [{"type": "function"}]},
    ...                    {"role": "tool", "name": "calculator", "content": "408"},
    ...                    {"role": "assistant", "content": "Answer: 408"}])
    'Answer: 408'
    >>> final_answer_text([{"role": "assistant", "content": "Let me compute."}, {"role": "tool", "content": "408"}])
    'Let me compute.'
    """
    if isinstance(completion, list):
        messages = [m for m in completion if isinstance(m, dict)]
        answers = [m for m in messages if m.get("role", "assistant") == "assistant"]
        return _content_text(answers[-1].get("content")) if answers else ""
    return completion_text(completion)


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
    raise CompletionFormatError(f"message content must be a str, None or a list of parts, got {type(content).__name__}")


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
    return to_float(extract_answer(text))


def answer_matches(text: str, reference) -> bool:
    """Whether the final answer in ``text`` equals ``reference`` (a number, or text holding one).

    Exact for integers and fractions; a tolerance only for decimals (see :mod:`grpo_kit.tasks.answers`).

    >>> answer_matches("Answer: 20000019", "20000000"), answer_matches("Answer: 1/3", 1 / 3)
    (False, True)
    """
    return numbers_equal(extract_answer(text), as_number(reference))


def correctness_reward(prompts, completions, answer, **kwargs) -> list[float]:
    """1.0 when the completion's final number equals the reference answer, else 0.0.

    ``answer`` is the dataset column (a number or a string; GSM8K's ``#### N`` works). A conversation is judged
    on its last assistant message only (:func:`final_answer_text`): a tool's result is not the model's answer.

    >>> correctness_reward(None, ["I think 5 + 7 = 12.\\nAnswer: 12", "Answer: 13"], ["12", "12"])
    [1.0, 0.0]
    >>> correctness_reward(None, [[{"role": "assistant", "content": "#### 1,000"}]], ["1000"])
    [1.0]
    """
    if len(answer) != len(completions):
        raise ValueError(f"correctness_reward: {len(completions)} completions but {len(answer)} answers")
    return [1.0 if answer_matches(final_answer_text(c), a) else 0.0 for c, a in zip(completions, answer)]


def format_strict_reward(prompts, completions, **kwargs) -> list[float]:
    """1.0 when the last non-empty line of the answer (:func:`final_answer_text`) is exactly ``Answer: <number>``,
    else 0.0.

    >>> format_strict_reward(None, ["7 + 5 = 12\\nAnswer: 12", "Answer: 12 apples", "The answer is 12"])
    [1.0, 0.0, 0.0]
    """
    out = []
    for c in completions:
        lines = [ln for ln in final_answer_text(c).splitlines() if ln.strip()]
        out.append(1.0 if lines and _is_answer_line(lines[-1]) else 0.0)
    return out


def _is_answer_line(line: str) -> bool:
    """``Answer: <one number>`` with an optional final ``.``, checked without a regex (linear time)."""
    line = line.strip()
    if not line.startswith(ANSWER_PREFIX):
        return False
    rest = line[len(ANSWER_PREFIX) :].strip()
    return single_number(rest[:-1] if rest.endswith(".") else rest) is not None


def format_soft_reward(prompts, completions, **kwargs) -> list[float]:
    """1.0 when ``Answer: <number>`` appears anywhere in the answer (:func:`final_answer_text`; any case), else 0.0.

    >>> format_soft_reward(None, ["so answer: 12 apples", "12"])
    [1.0, 0.0]
    """
    return [1.0 if _SOFT_ANSWER.search(final_answer_text(c)) else 0.0 for c in completions]


REWARD_FUNCTIONS = {
    "correctness": correctness_reward,
    "format_strict": format_strict_reward,
    "format_soft": format_soft_reward,
}


def resolve_reward_func(spec):
    """One reward function from a config entry: a built-in name (``REWARD_FUNCTIONS``), a ``module:function``
    string (the module is imported; dots allowed on both sides, e.g. ``my_rewards:Scorer.score``), or a
    callable, returned as is. A bad entry raises ``ValueError`` naming it and what failed.

    >>> resolve_reward_func("correctness") is correctness_reward
    True
    >>> resolve_reward_func("grpo_kit.tasks.rewards:format_soft_reward") is format_soft_reward
    True
    >>> resolve_reward_func("no_such_module_xyz:fn")
    Traceback (most recent call last):
    ...
    ValueError: reward function 'no_such_module_xyz:fn': cannot import module 'no_such_module_xyz' (ModuleNotFoundError: No module named 'no_such_module_xyz')
    """
    return resolve_entry(
        spec,
        "reward function",
        REWARD_FUNCTIONS,
        f"a built-in name ({', '.join(REWARD_FUNCTIONS)}), 'module:function' (an importable module) "
        "or, from Python, a callable",
    )


def get_reward_funcs(specs) -> list:
    """Reward functions from config entries (see :func:`resolve_reward_func`); every bad entry in one error."""
    return resolve_entries(specs, resolve_reward_func)


def reward_func_spec(spec) -> str:
    """How a config entry is written to ``config.yaml``: names and strings as they are, a callable as
    ``module:qualname`` (a notebook's function reads ``__main__:name``)."""
    if isinstance(spec, str):
        return spec
    builtin = next((name for name, fn in REWARD_FUNCTIONS.items() if fn is spec), None)
    return builtin or f"{getattr(spec, '__module__', None) or '?'}:{getattr(spec, '__qualname__', type(spec).__name__)}"


class RewardFunctionError(ValueError):
    """A reward function returned something unusable or raised; the message names it and the sample."""


def _excerpt(x, n: int = 80) -> str:
    text = completion_text(x) if isinstance(x, (str, list, dict)) else str(x)
    return repr(text[:n] + ("..." if len(text) > n else ""))


# Wall-clock seconds one reward call may take (config reward_time_limit_s); a slow call scores 0 instead.
REWARD_TIME_LIMIT_S = 60.0


def checked_reward_func(fn, on_error: str = "raise", time_limit_s: float | None = REWARD_TIME_LIMIT_S, on_rewards=None):
    """Wrap a reward function so bad output stops training with a message naming it and the sample.

    Allowed per sample: a finite number that fits a float, or ``None`` (TRL's "not applicable to this
    sample"). Wrong length, NaN/inf, ``10**400``, a non-number, or an exception raise
    ``RewardFunctionError``; when the function raises on the batch, it is re-run sample by sample to
    name the first failing sample. ``on_error="zero"`` (config ``reward_errors: zero``): a function
    that raises instead scores 0.0 for each sample it raises on (re-run one by one; the others keep
    their scores), with a warning naming the function, the sample and the exception. Bad return
    values still raise.

    ``time_limit_s`` (config ``reward_time_limit_s``; None or 0: none): a call on the batch that runs
    longer is stopped (:mod:`grpo_kit.tasks.time_limit`), and the samples are re-run one by one within one
    more ``time_limit_s`` (each gets an equal share of what is left); a sample that runs out of its share
    scores 0.0 with a warning naming the function and the sample, whatever ``on_error`` says. A call
    thus takes at most about ``2 * time_limit_s``.

    ``on_rewards(name, prompts, completions, columns, rewards)``: called with each checked batch (the run
    folder's samples.jsonl is written this way).

    >>> ok = checked_reward_func(correctness_reward)
    >>> ok(None, ["Answer: 3"], answer=["3"])
    [1.0]
    >>> checked_reward_func(lambda prompts, completions, **kw: [1.0])(None, ["a", "b"])
    Traceback (most recent call last):
    ...
    grpo_kit.tasks.rewards.RewardFunctionError: reward function '<lambda>' returned 1 values for 2 completions
    """
    if on_error not in REWARD_ERRORS:
        raise ValueError(f"on_error={on_error!r} is not allowed; choose one of {list(REWARD_ERRORS)}")
    if time_limit_s is not None and not (
        isinstance(time_limit_s, (int, float)) and math.isfinite(time_limit_s) and time_limit_s >= 0
    ):
        raise ValueError(f"time_limit_s={time_limit_s!r} must be a finite number of seconds >= 0 (0: no limit)")
    name = getattr(fn, "__name__", type(fn).__name__)

    def wrapper(prompts, completions, **kwargs):
        try:
            out = call_with_time_limit(time_limit_s, fn, prompts, completions, **kwargs)
        except TimeLimitExceeded:
            _log.warning(
                "reward function %r ran past its time limit (reward_time_limit_s=%g) on a batch of %d "
                "completions; re-running them one by one",
                name,
                time_limit_s,
                len(completions),
            )
            out = _one_by_one(fn, name, on_error, time_limit_s, prompts, completions, kwargs, None)
        except Exception as e:
            out = _one_by_one(fn, name, on_error, time_limit_s, prompts, completions, kwargs, e)
        values = _checked_values(name, out, completions)
        if on_rewards is not None:
            on_rewards(name, prompts, completions, kwargs, values)
        return values

    wrapper.__name__, wrapper.__doc__ = name, fn.__doc__
    return wrapper


def _one_by_one(fn, name, on_error, time_limit_s, prompts, completions, kwargs, batch_error) -> list:
    """Each sample alone, within one shared time budget: the failing ones named, or scored 0.0."""
    n = len(completions)
    deadline = time.monotonic() + time_limit_s if time_limit_s else None
    scores = []
    for i in range(n):
        one = {k: (v[i : i + 1] if isinstance(v, list) and len(v) == n else v) for k, v in kwargs.items()}
        # An equal share of what is left, so one slow sample cannot starve the ones after it.
        left = None if deadline is None else (deadline - time.monotonic()) / (n - i)
        where = f"on sample {i} (completion {_excerpt(completions[i])})"
        try:
            if left is not None and left <= 0:
                raise TimeLimitExceeded("no time left")
            r1 = call_with_time_limit(
                left, fn, None if prompts is None else prompts[i : i + 1], completions[i : i + 1], **one
            )
            scores.append(list(r1)[0] if isinstance(r1, (list, tuple)) and len(r1) == 1 else r1)
        except TimeLimitExceeded:
            _log.warning(
                "reward function %r ran past its time limit (reward_time_limit_s=%g) %s; scored 0.0",
                name,
                time_limit_s,
                where,
            )
            scores.append(0.0)
        except Exception as e1:
            msg = f"reward function {name!r} raised {type(e1).__name__}: {e1} {where}"
            if on_error == "raise":
                raise RewardFunctionError(msg) from e1
            _log.warning("%s; scored 0.0 (reward_errors='zero')", msg)
            scores.append(0.0)
    if batch_error is not None and on_error == "raise":
        raise RewardFunctionError(
            f"reward function {name!r} raised {type(batch_error).__name__}: {batch_error} on a batch of {n} completions"
        ) from batch_error
    return scores


def _checked_values(name: str, out, completions) -> list:
    """A reward function's output as floats (or None), or a ``RewardFunctionError`` naming what is wrong."""
    n = len(completions)
    if not isinstance(out, (list, tuple)) and not hasattr(out, "__len__"):
        raise RewardFunctionError(
            f"reward function {name!r} returned {type(out).__name__}, expected a list of {n} floats (or None)"
        )
    out = list(out)
    if len(out) != n:
        raise RewardFunctionError(f"reward function {name!r} returned {len(out)} values for {n} completions")
    values = []
    for i, r in enumerate(out):
        if r is None:
            values.append(None)
            continue
        if isinstance(r, bool) or not isinstance(r, (int, float)) and not hasattr(r, "__float__"):
            raise RewardFunctionError(
                f"reward function {name!r} returned {r!r} for sample {i}; expected a number or None"
            )
        try:
            value = float(r)
        except (OverflowError, ValueError, TypeError) as e:  # 10**400, or a __float__ that fails
            raise RewardFunctionError(
                f"reward function {name!r} returned a value that is no float for sample "
                f"{i} ({type(e).__name__}: {e}; completion {_excerpt(completions[i])})"
            ) from None
        if not math.isfinite(value):
            raise RewardFunctionError(
                f"reward function {name!r} returned {value} for sample {i} "
                f"(completion {_excerpt(completions[i])}); rewards must be finite "
                "(None means 'not applicable')"
            )
        values.append(value)
    return values
