"""The code verifier: a TRL reward that runs each completion's Python block in :mod:`grpo_kit.tasks.sandbox`.

:func:`extract_code` finds the block (linear time); :func:`make_python_code_reward` builds the reward;
``python_code_reward`` is one with the default limits. What the sandbox guarantees, and what the
``tests`` and ``answer`` modes count, is in :mod:`grpo_kit.tasks.sandbox`'s docstring.
"""

from __future__ import annotations

from grpo_kit.tasks.answers import as_number, numbers_equal, single_number
from grpo_kit.tasks.rewards import completion_text
from grpo_kit.tasks.sandbox import SandboxLimits, logger, run_many

_FENCE = "```"
_PYTHON_TAGS = ("python3", "python", "py")


def _fence_body_start(text: str, i: int) -> tuple[int, bool] | None:
    """Where the body of an opening fence at ``text[i]`` starts, and whether it is tagged Python; None if it
    is not an opening fence (three backticks, spaces, an optional ``python``/``python3``/``py`` tag, spaces,
    a newline). Reads only to the end of that line."""
    n = len(text)
    j = i + len(_FENCE)
    while j < n and text[j] in " \t":
        j += 1
    for tag in _PYTHON_TAGS:
        if text[j : j + len(tag)].lower() == tag:
            k = j + len(tag)
            while k < n and text[k] in " \t":
                k += 1
            k += k < n and text[k] == "\r"
            if k < n and text[k] == "\n":
                return k + 1, True
    k = j + (j < n and text[j] == "\r")
    return (k + 1, False) if k < n and text[k] == "\n" else None


def extract_code(text: str) -> str | None:
    """The last fenced code block (```` ```python ```` preferred, else any ```` ``` ````), or ``None``.

    Found with ``str.find`` (linear time, no backtracking regex: completions are adversarial).

    >>> extract_code("Here:\\n```python\\nprint(1 + 1)\\n```\\nDone.")
    'print(1 + 1)\\n'
    >>> extract_code("no code") is None
    True
    """
    if not isinstance(text, str):
        return None
    last_any = last_python = None
    i = text.find(_FENCE)
    while i >= 0:
        opened = _fence_body_start(text, i)
        if opened is None:
            i = text.find(_FENCE, i + 1)
            continue
        body, python = opened
        end = text.find(_FENCE, body)
        if end < 0:
            break  # no closing fence anywhere after: no later block can close either
        last_any = text[body:end]
        last_python = last_any if python else last_python
        i = text.find(_FENCE, end + len(_FENCE))
    chosen = last_python if last_python is not None else last_any
    return chosen if chosen is not None and chosen.strip() else None


def _column(kwargs: dict, name: str, n: int):
    value = kwargs.get(name)
    if value is None:
        return [None] * n
    if not isinstance(value, (list, tuple)) or len(value) != n:
        raise ValueError(f"python_code_reward: column {name!r} must be a list with one entry per completion ({n})")
    return list(value)


def make_python_code_reward(
    limits: SandboxLimits | None = None, *, max_workers: int | None = None, name: str = "python_code_reward"
):
    """A TRL reward function that runs the completion's Python code in the sandbox.

    Per sample, the dataset columns decide what "right" means (the first one present wins):

    * ``tests``: Python code (a string, or a list of strings) run after the program against its top-level
      names, e.g. ``assert add(2, 3) == 5``; the tests run in the judge, a process that runs no model code,
      with the judge's builtins and modules whatever the program defines, and call into the program with
      values only, compared as in plain Python (integers of any size, fractions, decimals, generators, the
      program's objects with each other by its own ``__eq__``); 1.0 only when the judge ran the last test to
      its end (exiting early, ``atexit`` tricks, a faked exit status or report do not count, and an object of
      the program's own never equals a plain value by its own say-so: that is a ``judge error``, logged);
    * ``expected_output``: 1.0 when the program exits 0 and its stdout, stripped, equals it (``stdin``
      column optional, fed to the program);
    * ``answer``: 1.0 when the program exits 0 and its final-answer line, the last non-empty line of
      stdout, is exactly one number equal to it (:mod:`grpo_kit.tasks.answers`: exact for integers and
      fractions); printing many numbers, or a number inside a sentence, scores 0.

    No code block, a failing test, a wrong answer, a timeout, a crash or a refused network call
    all score 0.0; anything other than a plain wrong result is logged at WARNING with its reason.
    The latest batch's :class:`SandboxResult` objects are kept on ``fn.last_results``.
    """
    lim = limits or SandboxLimits()

    def reward(prompts, completions, **kwargs) -> list[float]:
        n = len(completions)
        tests, expected = _column(kwargs, "tests", n), _column(kwargs, "expected_output", n)
        answers, stdins = _column(kwargs, "answer", n), _column(kwargs, "stdin", n)
        programs, idx, suites = [], [], []
        for i, c in enumerate(completions):
            code = extract_code(completion_text(c) if isinstance(c, (str, list, dict)) else "")
            if code is None:
                continue
            if tests[i] is not None:
                suites.append(tests[i] if isinstance(tests[i], str) else "\n".join(map(str, tests[i])))
            elif expected[i] is None and answers[i] is None:
                raise ValueError(f"{name}: sample {i} has none of the columns 'tests', 'expected_output', 'answer'")
            else:
                suites.append(None)
            programs.append(code)
            idx.append(i)
        results = run_many(
            programs, stdins=[str(stdins[i] or "") for i in idx], tests=suites, limits=lim, max_workers=max_workers
        )
        scores = [0.0] * n
        reward.last_results = [None] * n
        for i, res in zip(idx, results):
            reward.last_results[i] = res
            if tests[i] is not None:
                right = res.tests_completed
            elif not res.ok:
                right = False
            elif expected[i] is not None:
                right = res.stdout.strip() == str(expected[i]).strip()
            else:
                lines = [ln for ln in res.stdout.splitlines() if ln.strip()]
                right = bool(lines) and numbers_equal(single_number(lines[-1]), as_number(answers[i]))
            scores[i] = 1.0 if right else 0.0
            if right or res.ok:
                continue
            if not res.reason.startswith("exit code") or "MemoryError" in res.stderr[-2000:]:
                logger.warning("%s: sample %d scored 0: %s (%.2f s)", name, i, res.reason, res.duration_s)
            else:
                logger.info("%s: sample %d scored 0: %s", name, i, res.reason)
        return scores

    reward.__name__ = name
    reward.last_results = []
    return reward


python_code_reward = make_python_code_reward()
python_code_reward.__doc__ = make_python_code_reward.__doc__
