"""Tools a model may call during a GRPO rollout (TRL's ``tools=``), and the wrapper every tool runs under.

Ready tools, named in a config as ``tools: [calculator, python]`` (``READY_TOOLS``) or by their
``module:function`` path (``grpo_kit.tasks.tools:calculator``):

* :func:`calculator`: one arithmetic expression (``+ - * / // % **``, parentheses, numbers), evaluated on
  its syntax tree (no ``eval``); powers and operands bounded so no call runs away.
* :func:`python`: a Python program run in the kit's sandbox (:mod:`grpo_kit.tasks.sandbox`) under its time
  and memory limits (``PYTHON_TOOL_LIMITS``); what it prints comes back.

A tool is a plain function with type hints and a Google-style docstring (``Args:``): transformers builds the JSON
schema the chat template shows the model from them.

:func:`checked_tool` wraps each tool for the rollout: a tool that raises, runs past its time limit or returns
anything but a ``str`` raises one ``ToolError`` (a logged warning naming the tool), which TRL's tool loop counts
in ``tools/failure_frequency`` and hands back to the model as ``{"error": ...}``; the rollout goes on. A text
result longer than ``max_output_tokens`` tokens of the training tokenizer is cut there, with a marker.
"""

from __future__ import annotations

import ast
import functools
import importlib
import inspect
import logging
import operator

from grpo_kit.tasks.entries import resolve_entries, resolve_entry
from grpo_kit.tasks.sandbox import SandboxLimits, run_python
from grpo_kit.tasks.time_limit import TimeLimitExceeded, call_with_time_limit

logger = logging.getLogger(__name__)

# A tool's wall-clock limit in the rollout (the sandboxed python tool has its own, shorter one inside).
TOOL_TIME_LIMIT_S = 10.0
# Tokens of a tool's text result the model sees; the rest is cut (a tool result is prompt for every later turn).
TOOL_OUTPUT_TOKENS = 256
TRUNCATION_MARKER = " ...[truncated]"
# The python tool's sandbox: a short wall clock (a rollout waits for it), 256 MiB of address space.
PYTHON_TOOL_LIMITS = SandboxLimits(timeout_s=5.0, memory_mb=256)

_BINARY = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}
_MAX_EXPONENT = 64  # 10**64 is plenty for arithmetic; 9**9**9 would not finish
_MAX_OPERAND = 10**30


class ToolError(Exception):
    """A tool call that failed (raised, ran too long, returned non-text); TRL's loop counts it as a failure."""


def _evaluate(node):
    if isinstance(node, ast.Expression):
        return _evaluate(node.body)
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        if abs(node.value) > _MAX_OPERAND:
            raise ValueError(f"number too large: {node.value}")
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _evaluate(node.left), _evaluate(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > _MAX_EXPONENT:
            raise ValueError(f"exponent too large: {right}")
        return _BINARY[type(node.op)](left, right)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_evaluate(node.operand))
    raise ValueError(f"unsupported expression element: {type(node).__name__}")


def _number_text(x) -> str:
    if isinstance(x, float) and x.is_integer() and abs(x) < 1e16:
        return str(int(x))
    return str(x)


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression and return the result.

    Args:
        expression: An arithmetic expression with numbers, + - * / // % ** and parentheses, e.g. "37 * 48".
    """
    try:
        tree = ast.parse(str(expression).replace("×", "*").replace("^", "**"), mode="eval")
    except SyntaxError as e:
        raise ValueError(f"not an arithmetic expression: {expression!r}") from e
    return _number_text(_evaluate(tree))


def python(code: str) -> str:
    """Run a Python program and return what it prints.

    Args:
        code: A complete Python program; print the values you need, e.g. "print(37 * 48)".
    """
    result = run_python(str(code), limits=PYTHON_TOOL_LIMITS)
    if not result.ok:
        raise ValueError(f"{result.reason}: {result.stderr.strip()[-500:]}")
    return result.stdout.rstrip("\n")


READY_TOOLS = {"calculator": calculator, "python": python}


def resolve_tool(spec):
    """One tool from a config entry: a ready tool's name (``READY_TOOLS``), a ``module:function`` string (dots
    allowed after the colon for a class attribute), or a callable, returned as is. A bad entry raises ``ValueError``
    naming it and what failed."""
    return resolve_entry(
        spec,
        "tool",
        READY_TOOLS,
        f"a ready tool ({', '.join(READY_TOOLS)}) or 'module:function' (an importable module)",
    )


def get_tools(specs) -> list:
    """Tools from config entries (see :func:`resolve_tool`); every bad entry in one error."""
    return resolve_entries(specs, resolve_tool)


def tool_spec(tool) -> str:
    """The config entry of a tool: its ready name, else ``module:qualname``."""
    for name, fn in READY_TOOLS.items():
        if tool is fn:
            return name
    return f"{tool.__module__}:{tool.__qualname__}"


def resolve_environment(spec):
    """An environment factory from ``module:Factory`` (a class or a callable returning one instance), or a
    callable as is. A bad entry raises ``ValueError`` naming it."""
    if callable(spec):
        return spec
    module_name, sep, attr = str(spec).partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"environment {spec!r}: expected 'module:Factory' (an importable module)")
    try:
        obj = importlib.import_module(module_name)
        for part in attr.split("."):
            obj = getattr(obj, part)
    except Exception as e:
        raise ValueError(f"environment {spec!r}: {type(e).__name__}: {e}") from None
    if not callable(obj):
        raise ValueError(f"environment {spec!r}: {attr!r} is a {type(obj).__name__}, not a callable")
    return obj


ENVIRONMENT_HOOKS = ("reset", "get_reward")  # an environment's methods TRL calls itself, never offered as tools


def environment_tools(instance) -> list:
    """The tools one environment instance offers, as TRL 1.16 takes them: the bound public methods its class
    defines (by name, as ``inspect.getmembers`` lists them), but :data:`ENVIRONMENT_HOOKS`."""
    return [
        getattr(instance, name)
        for name, _ in inspect.getmembers(type(instance), predicate=inspect.isfunction)
        if name not in ENVIRONMENT_HOOKS and not name.startswith("_")
    ]


def truncate_tokens(text: str, tokenizer, max_tokens: int | None) -> str:
    """``text`` cut to its first ``max_tokens`` tokens of ``tokenizer`` (plus ``TRUNCATION_MARKER``); unchanged
    when it is that short, or when either is None."""
    if tokenizer is None or max_tokens is None:
        return text
    ids = tokenizer.encode(text, add_special_tokens=False)
    if len(ids) <= max_tokens:
        return text
    return tokenizer.decode(ids[:max_tokens]) + TRUNCATION_MARKER


def checked_tool(
    fn,
    *,
    time_limit_s: float | None = TOOL_TIME_LIMIT_S,
    tokenizer=None,
    max_output_tokens: int | None = TOOL_OUTPUT_TOKENS,
):
    """``fn`` as the rollout calls it: its name, signature and docstring kept (the schema the model sees), any
    failure one :class:`ToolError` with a logged warning, a text result cut to ``max_output_tokens`` tokens."""
    if getattr(fn, "_grpo_kit_checked_tool", False):
        return fn
    name = getattr(fn, "__name__", repr(fn))

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            out = call_with_time_limit(time_limit_s, fn, *args, **kwargs)
        except TimeLimitExceeded as e:
            failure = f"tool {name!r} {e}"
        except Exception as e:  # the tool's own error: reported to the model, counted by TRL
            failure = f"tool {name!r} raised {type(e).__name__}: {e}"
        else:
            if isinstance(out, str):
                return truncate_tokens(out, tokenizer, max_output_tokens)
            failure = f"tool {name!r} returned {type(out).__name__}, not text (str)"
        logger.warning("grpo_kit: %s", failure)
        raise ToolError(failure)

    wrapper._grpo_kit_checked_tool = True
    return wrapper
