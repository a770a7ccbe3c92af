"""The package's layers: no import cycle between its modules (imports inside functions count too), and a core
that imports neither TRL nor the app layer."""

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parents[1] / "grpo_kit"
# The core (grpo_kit's README, "Layout"): the math, kernels, memory, data, rewards and the sandbox.
CORE = ("answers", "causal_layout", "checkpointing", "code_reward", "data", "kernels", "loss", "memory", "models",
        "names", "nf4_matmul", "objective", "quantize", "rewards", "sandbox", "time_limit")
# The TRL adapter and the app: what the core must not import.
ABOVE_CORE = ("cli", "colab", "config", "console", "dashboard", "evaluation", "export", "generation.trainer_hook",
              "guards", "notebook_utils", "preflight", "resume", "resume_policy", "run", "run_folder", "trainer")


def _modules() -> dict[str, Path]:
    out = {}
    for p in PKG.rglob("*.py"):
        parts = p.relative_to(PKG.parent).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = p
    return out


def _imports(name: str, path: Path, known: dict) -> tuple[set, set]:
    """(package modules, top-level external packages) that ``name`` imports anywhere in its source."""
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    inner, outer = set(), set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            names = [target] + [f"{target}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        else:
            continue
        inner |= {n for n in names if n in known and n != name}
        outer |= {n.split(".")[0] for n in names if not n.startswith("grpo_kit")}
    return inner, outer


def _graph():
    known = _modules()
    return {m: _imports(m, p, known) for m, p in known.items()}


def test_no_import_cycle():
    graph = {m: {d for d in deps if not d.startswith(m + ".")} for m, (deps, _) in _graph().items()}
    state, stack, cycles = {}, [], []

    def visit(u):
        state[u] = "open"
        stack.append(u)
        for v in sorted(graph[u]):
            if state.get(v) == "open":
                cycles.append(" -> ".join(stack[stack.index(v):] + [v]))
            elif v not in state:
                visit(v)
        stack.pop()
        state[u] = "done"

    for m in sorted(graph):
        if m not in state:
            visit(m)
    assert not cycles, "import cycles: " + "; ".join(cycles)


def test_the_cycle_check_finds_a_cycle(tmp_path, monkeypatch):
    """The check above can fail: two modules importing each other inside functions are reported."""
    pkg = tmp_path / "grpo_kit"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("def f():\n    from .b import g\n")
    (pkg / "b.py").write_text("from grpo_kit import a\n")
    monkeypatch.setattr(__import__(__name__), "PKG", pkg)
    try:
        test_no_import_cycle()
    except AssertionError as e:
        assert "grpo_kit.a -> grpo_kit.b -> grpo_kit.a" in str(e)
    else:
        raise AssertionError("the cycle between a and b was not found")


def test_core_imports_neither_trl_nor_the_app():
    graph = _graph()
    above = {f"grpo_kit.{n}" for n in ABOVE_CORE}
    problems = []
    for m, (inner, outer) in graph.items():
        if any(m == f"grpo_kit.{c}" or m.startswith(f"grpo_kit.{c}.") for c in CORE):
            problems += [f"{m} imports {d}" for d in sorted(inner & above)]
            problems += [f"{m} imports trl" for _ in ("trl",) if "trl" in outer]
    assert not problems, "; ".join(problems)
    assert all(f"grpo_kit.{n}" in graph for n in (*CORE, *ABOVE_CORE)), "a listed module no longer exists"
