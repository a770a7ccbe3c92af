"""Numeric answers read out of free text in one linear pass, and compared exactly.

The scanner is hand-written (no backtracking regex), so any text costs time linear in its
length: model output is adversarial once a policy is rewarded on it. A numeral is

* an optional sign (``-`` or ``−``, directly before the digits or a ``$``) and ``$``;
* an integer: plain digits, or thousands groups (``1,234,567``; also with a space, a
  no-break or a thin space: ``1 000 000``);
* then optionally a decimal part (``.5``), an exponent (``1e400``) or a denominator (``3/4``);
* or a LaTeX fraction ``\\frac{a}{b}`` (also ``\\dfrac``, ``\\tfrac``).

A digit run glued to a letter, ``_`` or ``.`` on its left (``x2``, ``.5``) is not a number. A
numeral that is written but malformed (``1_000``, ``1,23``, ``1.2.3``, a zero denominator, more
than :data:`MAX_DIGITS` digits, an exponent beyond :data:`MAX_EXPONENT`) is read as *unreadable*
(``Number.value is None``), never as a different number.

Comparison (:func:`numbers_equal`): integers and fractions are exact rationals, compared
exactly; a tolerance (relative :data:`DECIMAL_REL_TOL`) applies only when one side is a decimal
written as such (a decimal point or an exponent), for answers like ``0.30000000000000004``.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from fractions import Fraction
from functools import cached_property

MAX_DIGITS = 1000  # digits in one numeral; longer is no answer, and int() on it stays cheap
MAX_EXPONENT = 1000  # |exponent| of 1e<exp>; 10**1000 is still a cheap exact integer
DECIMAL_REL_TOL = 1e-9  # relative, only for decimals: float printing errors are ~1e-16

_DIGITS = frozenset("0123456789")
_SIGNS = frozenset("-\u2212")
_GROUP_SEPARATORS = frozenset(",\u00a0\u202f\u2009 ")  # comma, no-break, narrow no-break, thin space, space
_LATEX_FRACS = ("\\frac", "\\dfrac", "\\tfrac")
# Each attempt starts at a literal word and the whitespace after two distinct marks never overlaps: linear.
_ANSWER_MARK = re.compile(r"answer[ \t]*(?:is|:|=)|\\boxed\{", re.IGNORECASE)
_GSM8K_MARK = "####"


@dataclass(frozen=True)
class Number:
    """One numeral found in a text (``text[start:end]``), or a reference answer given as a number.

    ``value``: the exact rational (a ``Fraction``), or None when the numeral is malformed; computed on
    first use, so scanning many numerals costs no arithmetic. ``exact``: an integer or a fraction
    (False: a decimal point or an exponent was written). ``exponent``: written as ``1e5``.
    """

    start: int
    end: int
    exact: bool
    exponent: bool = False
    readable: bool = True
    fixed: Fraction | None = None  # the value of a number not read from text
    source: str | None = field(default=None, repr=False, compare=False)
    at: int = 0  # where reading starts in ``source``: the first digit, or the backslash of \frac

    @cached_property
    def value(self) -> Fraction | None:
        if not self.readable:
            return None
        if self.source is None:
            return self.fixed
        return _read(self.source, self.at, evaluate=True)[1]


def _glued(text: str, i: int) -> bool:
    """Whether position ``i`` follows a letter, digit, ``_`` or ``.`` (so a numeral cannot start there)."""
    return i > 0 and (text[i - 1].isalnum() or text[i - 1] in "_.")


def _digit_run(text: str, i: int) -> int:
    n = len(text)
    while i < n and text[i] in _DIGITS:
        i += 1
    return i


def _is_group(text: str, j: int, sep: str) -> bool:
    """``text[j]`` is ``sep`` followed by exactly three digits (then no fourth)."""
    return (
        j + 4 <= len(text)
        and text[j] == sep
        and all(c in _DIGITS for c in text[j + 1 : j + 4])
        and (j + 4 == len(text) or text[j + 4] not in _DIGITS)
    )


def _unsigned(text: str, i: int, evaluate: bool):
    """The unsigned numeral (no denominator) from digit ``text[i]``: (ok, value or None, exact, exponent, end).

    ``value`` is computed only when ``evaluate``; ``ok`` says whether the numeral is well formed."""
    n = len(text)
    j = _digit_run(text, i)
    pieces = [(i, j)]
    ok = True
    if j - i <= 3 and j < n and text[j] in _GROUP_SEPARATORS and _is_group(text, j, text[j]):
        sep = text[j]
        while _is_group(text, j, sep):
            pieces.append((j + 1, j + 4))
            j += 4
    # A comma or underscore between digits that is no thousands group: written, but not one number.
    while j + 1 < n and text[j] in ",_" and text[j + 1] in _DIGITS:
        ok, j = False, _digit_run(text, j + 1)
    exact, exponent, frac = True, False, None
    if j + 1 < n and text[j] == "." and text[j + 1] in _DIGITS:
        k = _digit_run(text, j + 1)
        frac, exact, j = (j + 1, k), False, k
        while j + 1 < n and text[j] in ".," and text[j + 1] in _DIGITS:  # 1.2.3, 1.5,25
            ok, j = False, _digit_run(text, j + 1)
    exp = 0
    if j + 1 < n and text[j] in "eE":
        k = j + 1 + (text[j + 1] in "+-")
        if k < n and text[k] in _DIGITS:
            end = _digit_run(text, k)
            if end - k > len(str(MAX_EXPONENT)) or int(text[k:end]) > MAX_EXPONENT:
                ok = False
            else:
                exp = int(text[k:end]) * (-1 if text[j + 1] == "-" else 1)
            exact, exponent, j = False, True, end
    digits = sum(b - a for a, b in pieces) + (frac[1] - frac[0] if frac else 0)
    ok = ok and digits <= MAX_DIGITS
    if not (ok and evaluate):
        return ok, None, exact, exponent, j
    whole = int("".join(text[a:b] for a, b in pieces))
    value = Fraction(whole) + (Fraction(int(text[frac[0] : frac[1]]), 10 ** (frac[1] - frac[0])) if frac else 0)
    return ok, (value * Fraction(10) ** exp if exp else value), exact, exponent, j


def _negative(text: str, i: int) -> bool:
    """A sign directly before ``text[i]`` (or before a ``$`` there), not glued to a word on its left."""
    k = i - 1 if i > 0 and text[i - 1] == "$" else i
    return k > 0 and text[k - 1] in _SIGNS and not _glued(text, k - 1)


def _numeral(text: str, i: int, evaluate: bool):
    """The numeral whose first digit is ``text[i]``, with its denominator: (ok, value, exact, exponent, end)."""
    n = len(text)
    ok, value, exact, exponent, j = _unsigned(text, i, evaluate)
    k = j + (j < n and text[j] == " ")
    if k < n and text[k] == "/":
        k += 1 + (k + 1 < n and text[k + 1] == " ")
        if k < n and text[k] in _DIGITS:
            end = _digit_run(text, k)
            if end + 1 < n and text[end] == "/" and text[end + 1] in _DIGITS:  # 12/25/2023: a date, no number
                while end + 1 < n and text[end] == "/" and text[end + 1] in _DIGITS:
                    end = _digit_run(text, end + 1)
                return False, None, exact, exponent, end
            if end >= n or not (text[end] in ",_" or (text[end] == "." and end + 1 < n and text[end + 1] in _DIGITS)):
                ok = ok and end - k <= MAX_DIGITS and bool(text[k:end].strip("0"))  # no zero denominator
                value = value / int(text[k:end]) if ok and evaluate else None
                j = end
    if evaluate and value is not None and _negative(text, i):
        value = -value
    return ok, value, exact, exponent, j


def _latex_frac(text: str, i: int, evaluate: bool):
    """``\\frac{a}{b}`` at ``text[i]`` (``a`` maybe signed): (ok, value, exact, exponent, end), or None."""
    n = len(text)
    for name in _LATEX_FRACS:
        if text.startswith(name, i):
            break
    else:
        return None
    parts, j, ok, exact = [], i + len(name), True, True
    for _ in range(2):
        if j >= n or text[j] != "{":
            return None
        j += 1
        neg = j < n and text[j] in _SIGNS
        j += neg
        if j >= n or text[j] not in _DIGITS:
            return None
        ok1, value, exact1, _exp, j = _unsigned(text, j, evaluate)
        if j >= n or text[j] != "}":
            return None
        ok, exact = ok and ok1, exact and exact1
        parts.append(-value if neg and value is not None else value)
        j += 1
    if evaluate and ok:
        ok = parts[1] != 0
    value = parts[0] / parts[1] if evaluate and ok else None
    if value is not None and i > 0 and text[i - 1] in _SIGNS and not _glued(text, i - 1):
        value = -value
    return ok, value, exact, False, j


def _read(text: str, i: int, evaluate: bool = False):
    """The numeral read from ``text[i]`` (a digit or a backslash): (ok, value, exact, exponent, end) or None."""
    return _numeral(text, i, evaluate) if text[i] in _DIGITS else _latex_frac(text, i, evaluate)


def _number_at(text: str, i: int) -> Number | None:
    found = _read(text, i)
    if found is None:
        return None
    ok, _value, exact, exponent, end = found
    if text[i] in _DIGITS:
        start = i - 1 - (text[i - 1] == "$") if _negative(text, i) else i - (i > 0 and text[i - 1] == "$")
    else:
        start = i - 1 if i > 0 and text[i - 1] in _SIGNS and not _glued(text, i - 1) else i
        ok = ok and _read(text, i, evaluate=True)[1] is not None  # \frac{1}{0}
    return Number(start, end, exact, exponent, readable=ok, source=text, at=i)


def scan_numbers(text: str, start: int = 0):
    """Every numeral in ``text[start:]``, in order (an iterator of :class:`Number`); linear time.

    >>> [(float(x.value), x.exact) for x in scan_numbers("$1,234.50 and -7, then 3/4 or \\\\frac{1}{2}")]
    [(1234.5, False), (-7.0, True), (0.75, True), (0.5, True)]
    >>> [x.value for x in scan_numbers("1_000 x2 1,23")]
    [None, None]
    """
    if not isinstance(text, str):
        return
    i, n = start, len(text)
    while i < n:
        c = text[i]
        if c in _DIGITS:
            if _glued(text, i):  # x2, v1.5, .5: part of a word, not a number
                i = _digit_run(text, i)
                continue
            num = _number_at(text, i)
            yield num
            i = max(num.end, i + 1)
        elif c == "\\" and (num := _number_at(text, i)) is not None:
            yield num
            i = num.end
        else:
            i += 1


def single_number(text: str) -> Number | None:
    """The one readable numeral that ``text`` is, whitespace aside (``" -1,000 "``), else None.

    >>> single_number(" 3/4 ").value, single_number("3 apples"), single_number("1_000")
    (Fraction(3, 4), None, None)
    """
    if not isinstance(text, str):
        return None
    text = text.strip()
    found = scan_numbers(text)
    number, extra = next(found, None), next(found, None)
    ok = number is not None and extra is None and number.start == 0 and number.end == len(text)
    return number if ok and number.value is not None else None


def _first(text: str, start: int) -> Number | None:
    return next(scan_numbers(text, start), None)


def extract_answer(text: str) -> Number | None:
    """The final numeric answer in ``text`` as a :class:`Number`, or None when there is none.

    Priority: the first numeral after the last GSM8K ``####``; else the first numeral after the last
    "answer:" / "answer is" / "answer =" / ``\\boxed{``; else the last numeral in the text. The chosen
    numeral may be unreadable (``value`` None): then there is no answer, not an earlier number.

    >>> extract_answer("so 1/3 of it.\\nAnswer: \\\\frac{2}{6}").value
    Fraction(1, 3)
    """
    if not isinstance(text, str) or not text:
        return None
    mark = text.rfind(_GSM8K_MARK)
    if mark >= 0:
        return _first(text, mark + len(_GSM8K_MARK))
    last_mark = None
    for last_mark in _ANSWER_MARK.finditer(text):
        pass
    if last_mark is not None:
        found = _first(text, last_mark.end())
        if found is not None:
            return found
    last = None
    for last in scan_numbers(text):
        pass
    return last


def as_number(x) -> Number | None:
    """A reference answer (int, float, Fraction, str, or a :class:`Number`) as a Number; None if unusable."""
    if isinstance(x, Number) or x is None:
        return x
    if isinstance(x, bool):
        return None
    if isinstance(x, (int, Fraction)):
        return Number(0, 0, True, fixed=Fraction(x))
    if isinstance(x, float):
        return Number(0, 0, False, fixed=Fraction(x)) if math.isfinite(x) else None
    return extract_answer(str(x))


def numbers_equal(a, b, rel: float = DECIMAL_REL_TOL) -> bool:
    """Whether two answers are the same number: exact for integers and fractions, else within ``rel``.

    ``a``, ``b``: :class:`Number`, int, float, Fraction, str or None (None never equals anything). Floats
    count as decimals. The tolerance is relative to ``max(1, |b|)``, in exact rational arithmetic.

    >>> numbers_equal(0.30000000000000004, 0.3), numbers_equal(20000000, 20000019), numbers_equal("1/2", "0.5")
    (True, False, True)
    """
    a, b = as_number(a), as_number(b)
    if a is None or b is None or a.value is None or b.value is None:
        return False
    if a.exact and b.exact:
        return a.value == b.value
    return abs(a.value - b.value) <= Fraction(rel) * max(1, abs(b.value))


def to_float(number: Number | None) -> float | None:
    """A Number as a finite float, or None (unreadable, or beyond float range)."""
    if number is None or number.value is None:
        return None
    try:
        return float(number.value)
    except OverflowError:
        return None
