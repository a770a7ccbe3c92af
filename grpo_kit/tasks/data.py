"""Verifiable tasks: seeded arithmetic and word problems, and GSM8K-format jsonl.

Every example is a dict ``{"question": str, "answer": str}`` (the answer a plain
number). ``to_prompt_dataset`` turns examples into TRL's conversational format: a
``prompt`` list of messages (system + user), rendered later with the model's chat
template, plus the ``answer`` column that reward functions receive.

Held-out problems are drawn from their own fixed seed and removed from every training
draw, so no evaluation question is ever trained on.
"""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from grpo_kit.readers.bounded import parse_json, read_lines
from grpo_kit.tasks.answers import single_number
from grpo_kit.tasks.long_document import LONG_DOCUMENT_SYSTEM_PROMPT, LONG_DOCUMENT_TOKENS, long_document_problem

# A GSM8K row is a question and a worked answer, a few KiB; the whole of GSM8K is a few MiB.
MAX_DATA_LINE_BYTES = 1 << 20
MAX_DATA_FILE_BYTES = 1 << 30

# Short on purpose: on a 2-core CPU every prompt token is paid for in every generation.
DEFAULT_SYSTEM_PROMPT = "Solve the problem. Think briefly, then end with the line: Answer: <number>"
# Bare arithmetic needs no reasoning; a 135M model that reasons first runs out of tokens before answering.
ARITHMETIC_SYSTEM_PROMPT = "Give only the final answer, in the form: Answer: <number>"


# With tools: a worked example, since a 135M model that has never seen the call format does not produce it.
TOOL_SYSTEM_PROMPT = (
    "Use the calculator tool for arithmetic, then give the final answer in the form: "
    "Answer: <number>\nExample. User: What is 12 × 34?\nAssistant: <tool_call>\n"
    '{"name": "calculator", "arguments": {"expression": "12 * 34"}}\n</tool_call>\n'
    "Tool: 408\nAssistant: Answer: 408"
)


# Tasks whose questions are one bare arithmetic expression: answer-only prompts, and the tool warm-up's transcripts.
ARITHMETIC_TASKS = ("arithmetic", "multiplication")


def default_system_prompt(task: str, tools: bool = False) -> str:
    """The kit's system prompt for a task: with tools, how to call one (a worked example); else answer-only for
    arithmetic and multiplication, brief reasoning otherwise."""
    if tools:
        return TOOL_SYSTEM_PROMPT
    if task == "long_document":
        return LONG_DOCUMENT_SYSTEM_PROMPT
    return ARITHMETIC_SYSTEM_PROMPT if task in ARITHMETIC_TASKS else DEFAULT_SYSTEM_PROMPT


HELDOUT_SEED = 1_000_003  # fixed: the held-out set is the same whatever the training seed

LEVELS = {
    1: "one-digit addition and subtraction",
    2: "two-digit plus or minus one-digit",
    3: "two-digit addition and subtraction",
    4: "two-digit times one-digit, three-digit addition and subtraction",
}
# Distinct questions arithmetic_problem can produce at each level (its operand ranges counted; a difference's
# operands ordered); the levels share none. tests/test_hardening.py draws them to hold the counts.
ARITHMETIC_PROBLEMS = {1: 100 + 55, 2: 810 + 810, 3: 8100 + 4095, 4: 720 + 810_000 + 405_450}


def max_distinct_problems(task: str, levels) -> int | None:
    """How many distinct problems ``task`` can generate at ``levels``; None where that is more than a run takes."""
    return sum(ARITHMETIC_PROBLEMS[lv] for lv in set(levels)) if task == "arithmetic" else None


def _fmt(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else repr(float(x))


def arithmetic_problem(rng: random.Random, level: int) -> dict:
    """One arithmetic problem of a difficulty level (see ``LEVELS``)."""
    if level == 1:
        a, b, op = rng.randint(0, 9), rng.randint(0, 9), rng.choice("+-")
    elif level == 2:
        a, b, op = rng.randint(10, 99), rng.randint(1, 9), rng.choice("+-")
    elif level == 3:
        a, b, op = rng.randint(10, 99), rng.randint(10, 99), rng.choice("+-")
    elif level == 4:
        op = rng.choice("+-*")
        a, b = (rng.randint(10, 99), rng.randint(2, 9)) if op == "*" else (rng.randint(100, 999), rng.randint(100, 999))
    else:
        raise ValueError(f"level={level!r} is not allowed; choose one of {sorted(LEVELS)}")
    if op == "-" and b > a:  # keep results non-negative at the easy levels
        a, b = b, a
    result = {"+": a + b, "-": a - b, "*": a * b}[op]
    sym = {"+": "+", "-": "-", "*": "×"}[op]
    return {"question": f"What is {a} {sym} {b}?", "answer": _fmt(result), "level": level}


_NAMES = ["Ava", "Ben", "Chloe", "Dev", "Emma", "Farid", "Grace", "Hiro", "Ines", "Jamal", "Kira", "Liam"]
_ITEMS = ["apples", "stickers", "marbles", "books", "pencils", "cookies", "stamps", "shells"]


def word_problem(rng: random.Random, level: int) -> dict:
    """A GSM8K-style word problem built from templates; level 1-2 one step, 3-4 two steps."""
    name, other = rng.sample(_NAMES, 2)
    item = rng.choice(_ITEMS)
    hi = 20 if level <= 2 else 99
    a, b = rng.randint(2, hi), rng.randint(2, hi)
    k = rng.randint(2, 9)
    one_step = [
        (f"{name} has {a} {item}. {other} gives {name} {b} more. How many {item} does {name} have now?", a + b),
        (f"{name} had {a + b} {item} and gave {b} to {other}. How many {item} does {name} have left?", a),
        (f"{name} buys {k} bags with {a} {item} in each bag. How many {item} does {name} buy?", k * a),
        (f"{name} shares {k * a} {item} equally among {k} friends. How many {item} does each friend get?", a),
    ]
    two_step = [
        (
            f"{name} has {a} {item}, buys {k} packs of {b} {item}, then gives away {a // 2}. "
            f"How many {item} does {name} have?",
            a + k * b - a // 2,
        ),
        (f"{name} earns ${a} a day for {k} days and spends ${b}. How many dollars are left?", a * k - b),
        (f"{name} has {a} {item} and {other} has {k} times as many. How many {item} do they have together?", a + k * a),
    ]
    question, answer = rng.choice(one_step if level <= 2 else two_step)
    return {"question": question, "answer": _fmt(answer), "level": level}


# Multiplication operands by level: (digits of a, digits of b); hard for a 135M model by heart, easy with a tool.
MULTIPLICATION_DIGITS = {1: (2, 1), 2: (2, 2), 3: (3, 2), 4: (3, 3)}


def multiplication_problem(rng: random.Random, level: int) -> dict:
    """One multi-digit multiplication (operand digits by level: ``MULTIPLICATION_DIGITS``), the task to learn with
    a calculator tool."""
    if level not in MULTIPLICATION_DIGITS:
        raise ValueError(f"level={level!r} is not allowed; choose one of {sorted(MULTIPLICATION_DIGITS)}")
    a, b = (rng.randint(10 ** (d - 1) + 1, 10**d - 1) for d in MULTIPLICATION_DIGITS[level])
    return {"question": f"What is {a} × {b}?", "answer": str(a * b), "level": level}


TASK_GENERATORS = {
    "arithmetic": arithmetic_problem,
    "word_problems": word_problem,
    "multiplication": multiplication_problem,
    # a fact in a document of 1K-128K tokens by level (grpo_kit.tasks.long_document)
    "long_document": long_document_problem,
}
# Every task name: the generated ones, and GSM8K-format jsonl (load_gsm8k).
TASKS = (*TASK_GENERATORS, "gsm8k")


def task_levels(task: str) -> tuple[int, ...]:
    """The levels ``task`` generates (sorted): the long-document task's document sizes (0-4), the others' 1-4."""
    return tuple(sorted(LONG_DOCUMENT_TOKENS if task == "long_document" else LEVELS))


def generate_tasks(task: str, n: int, *, levels=(1, 2), seed: int = 0, exclude: set[str] | None = None) -> list[dict]:
    """``n`` distinct problems, deterministic for a seed; questions in ``exclude`` are skipped."""
    if task not in TASK_GENERATORS:
        raise ValueError(f"task={task!r} cannot be generated; choose one of {list(TASK_GENERATORS)}")
    allowed = task_levels(task)
    bad = [lv for lv in levels if lv not in allowed]
    if bad or not levels:
        raise ValueError(f"levels={list(levels)!r}: each must be one of {list(allowed)}")
    if n < 0:
        raise ValueError(f"n={n} must be >= 0")
    rng = random.Random(f"{task}:{seed}")
    exclude = exclude or set()
    seen: set[str] = set()
    out: list[dict] = []
    attempts = 0
    while len(out) < n:
        attempts += 1
        if attempts > 50 * n + 1000:
            raise ValueError(f"only {len(out)} distinct {task} problems exist at levels {list(levels)}; asked for {n}")
        ex = TASK_GENERATORS[task](rng, rng.choice(list(levels)))
        if ex["question"] in seen or ex["question"] in exclude:
            continue
        seen.add(ex["question"])
        out.append(ex)
    return out


def train_heldout_split(task: str, n_train: int, n_heldout: int, *, levels=(1, 2), seed: int = 0):
    """Training problems for ``seed`` and the fixed held-out set, disjoint by question."""
    heldout = generate_tasks(task, n_heldout, levels=levels, seed=HELDOUT_SEED)
    train = generate_tasks(task, n_train, levels=levels, seed=seed, exclude={e["question"] for e in heldout})
    return train, heldout


# --- GSM8K ---------------------------------------------------------------------------


def parse_gsm8k_answer(answer: str) -> str:
    """The number after ``####`` in a GSM8K answer, commas removed.

    >>> parse_gsm8k_answer("Natalia sold 48/2 = <<48/2=24>>24 clips in May.\\n#### 72")
    '72'
    >>> parse_gsm8k_answer("#### 1,000")
    '1000'
    """
    if "####" not in answer:
        raise ValueError("answer has no '#### N' final line")
    tail = answer.rsplit("####", 1)[1].strip()
    if not tail:
        raise ValueError("answer has an empty '####' line")
    number = single_number(tail)
    if number is None or number.exponent:
        raise ValueError(
            f"answer's '####' line is not a plain number: {tail[:80]!r} (expected digits, optionally "
            "with a sign, $, thousands commas, a decimal part or a /denominator)"
        )
    if number.exact and number.value.denominator == 1:
        return str(number.value.numerator)
    return "".join(c for c in tail.replace("\u2212", "-") if c not in "$, \u00a0\u202f\u2009")


def load_gsm8k_jsonl(path: str | Path, limit: int | None = None) -> list[dict]:
    """Read GSM8K-format jsonl (``question``, ``answer`` ending in ``#### N``).

    Read a line at a time: a missing file, a malformed line, a line over ``MAX_DATA_LINE_BYTES`` or a file over
    ``MAX_DATA_FILE_BYTES`` raises ``ValueError`` naming the file and line (an over-long line is never read whole).
    """
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"GSM8K file {str(path)!r} does not exist")
    out = []
    for lineno, raw in read_lines(p, max_line_bytes=MAX_DATA_LINE_BYTES, max_total_bytes=MAX_DATA_FILE_BYTES):
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise ValueError(f"{p}:{lineno}: not UTF-8 text (byte {e.start + 1} of the line)") from None
        if not line.strip():
            continue
        try:
            row = parse_json(line, f"{p}:{lineno}", max_bytes=MAX_DATA_LINE_BYTES)
        except json.JSONDecodeError as e:
            raise ValueError(f"{p}:{lineno}: not valid JSON ({e.msg})") from None
        if (
            not isinstance(row, dict)
            or not isinstance(row.get("question"), str)
            or not isinstance(row.get("answer"), str)
        ):
            raise ValueError(f"{p}:{lineno}: expected an object with string fields 'question' and 'answer'")
        try:
            number = parse_gsm8k_answer(row["answer"])
        except ValueError as e:
            raise ValueError(f"{p}:{lineno}: {e}") from None
        out.append({"question": row["question"], "answer": number, "solution": row["answer"]})
        if limit is not None and len(out) >= limit:
            break
    if not out:
        raise ValueError(f"GSM8K file {str(path)!r} has no examples")
    return out


def load_gsm8k(path: str | Path | None = None, *, split: str = "train", limit: int | None = None) -> list[dict]:
    """GSM8K from a local jsonl, or (``path=None``, online) the hub dataset ``openai/gsm8k``."""
    if path:
        return load_gsm8k_jsonl(path, limit)
    try:
        from datasets import load_dataset  # lazy: datasets imports pyarrow and pandas (seconds)

        ds = load_dataset("openai/gsm8k", "main", split=split)
    except Exception as e:  # offline, or the hub refuses
        raise ValueError(
            f"could not load openai/gsm8k from the hub ({type(e).__name__}: {e}); "
            "pass a local GSM8K-format jsonl as dataset_path"
        ) from None
    rows = ds if limit is None else ds.select(range(min(limit, len(ds))))
    return [
        {"question": r["question"], "answer": parse_gsm8k_answer(r["answer"]), "solution": r["answer"]} for r in rows
    ]


# --- prompts -------------------------------------------------------------------------


def make_prompt(question: str, system_prompt: str = "") -> list[dict]:
    """Conversational prompt (system + user); the trainer renders it with the chat template."""
    return [
        {"role": "system", "content": system_prompt or DEFAULT_SYSTEM_PROMPT},
        {"role": "user", "content": question},
    ]


def prompt_row(example: dict, system_prompt: str = "") -> dict:
    """One training row: ``prompt`` (messages) and ``answer``; what TRL hands an environment's ``reset(**row)``."""
    return {"prompt": make_prompt(example["question"], system_prompt), "answer": example["answer"]}


def to_prompt_dataset(examples: list[dict], system_prompt: str = ""):
    """A ``datasets.Dataset`` of :func:`prompt_row` rows, as TRL expects."""
    from datasets import Dataset  # lazy: datasets imports pyarrow and pandas (seconds)

    if not examples:
        raise ValueError("the dataset is empty: no examples to train on")
    return Dataset.from_list([prompt_row(e, system_prompt) for e in examples])


@dataclass(frozen=True)
class DataSpec:
    """What a run trains and is evaluated on (names and meanings as in the app's config, which builds it): the
    task, its ``levels``, the GSM8K files (``""``: the hub's splits), how many training and held-out problems, and
    the seed the generated tasks are drawn with."""

    task: str
    levels: Sequence[int]
    dataset_path: str
    eval_dataset_path: str
    num_train_samples: int
    num_eval_samples: int
    seed: int

    @classmethod
    def of(cls, source) -> DataSpec:
        """``source`` itself, or the spec it makes: an object with ``spec(kind)``, such as the app's config
        (``GRPOKitConfig.spec``), so that a notebook may hand its config to :func:`build_datasets`."""
        return source if isinstance(source, cls) else source.spec(cls)


def build_datasets(data: DataSpec) -> tuple[list[dict], list[dict]]:
    """Training and held-out examples (lists of ``{"question", "answer"}``) for a run's data (a :class:`DataSpec`
    of a validated config, or an object that makes one: :meth:`DataSpec.of`)."""
    d = DataSpec.of(data)
    if d.task == "gsm8k":
        if d.eval_dataset_path or not d.dataset_path:  # GSM8K's test split: the given file, or the hub's
            heldout = (
                load_gsm8k(d.eval_dataset_path or None, split="test", limit=d.num_eval_samples)
                if d.num_eval_samples
                else []
            )
            train = load_gsm8k(d.dataset_path or None, split="train", limit=d.num_train_samples)
            asked = {e["question"] for e in heldout}
            return [e for e in train if e["question"] not in asked], heldout
        # only a training file: the held-out problems are drawn from it, and never trained on
        rows = load_gsm8k(d.dataset_path, limit=d.num_train_samples + d.num_eval_samples)
        rng = random.Random(HELDOUT_SEED)
        rng.shuffle(rows)
        heldout, train = rows[: d.num_eval_samples], rows[d.num_eval_samples :]
        return train[: d.num_train_samples], heldout
    return train_heldout_split(d.task, d.num_train_samples, d.num_eval_samples, levels=tuple(d.levels), seed=d.seed)
