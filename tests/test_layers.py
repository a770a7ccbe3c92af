"""The package's layers are its folders: a module imports only from its own folder or a lower one (imports inside
functions count too), nothing imports in a circle, and the core imports no TRL.

The order of the folders is the one list kept here; which module sits in which layer is read from the tree."""

import ast
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[1] / "grpo_kit"
# Lowest first. Folders on one rank may not import each other.
LAYERS = (
    ("kernels", "readers"),
    ("loss",),
    ("model", "tasks"),
    ("memory",),
    ("generation",),
    ("trainer",),
    ("app",),
    ("notebook",),
)
CORE = ("kernels", "loss", "model", "tasks", "memory")  # imports no TRL
# The package's face: grpo_kit/__init__.py (lazy public names) and __main__.py may reach any layer.
FACE = ("grpo_kit", "grpo_kit.__main__")


def _modules(pkg: Path) -> dict[str, Path]:
    out = {}
    for p in pkg.rglob("*.py"):
        parts = p.relative_to(pkg.parent).with_suffix("").parts
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
            if target == "grpo_kit" and all(a.name == "__version__" for a in node.names):
                names = []  # the version: the one name any layer may take from the package's face
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        else:
            continue
        inner |= {n for n in names if n in known and n != name}
        outer |= {n.split(".")[0] for n in names if not n.startswith("grpo_kit")}
    return inner, outer


def _graph(pkg: Path):
    known = _modules(pkg)
    return {m: _imports(m, p, known) for m, p in known.items()}


def _folder(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and module not in FACE else None


def _rank(folder: str) -> int:
    for i, names in enumerate(LAYERS):
        if folder in names:
            return i
    raise AssertionError(f"grpo_kit/{folder}/ is in no layer: add it to LAYERS in tests/test_layers.py")


def _cycles(pkg: Path) -> list[str]:
    graph = {m: {d for d in deps if not d.startswith(m + ".")} for m, (deps, _) in _graph(pkg).items()}
    state, stack, cycles = {}, [], []

    def visit(u):
        state[u] = "open"
        stack.append(u)
        for v in sorted(graph[u]):
            if state.get(v) == "open":
                cycles.append(" -> ".join(stack[stack.index(v) :] + [v]))
            elif v not in state:
                visit(v)
        stack.pop()
        state[u] = "done"

    for m in sorted(graph):
        if m not in state:
            visit(m)
    return cycles


def _climbs(pkg: Path) -> list[str]:
    problems = []
    for m, (inner, outer) in sorted(_graph(pkg).items()):
        here = _folder(m)
        if here is None:
            continue
        for d in sorted(inner):
            there = _folder(d)
            if there is None and d not in FACE:
                problems.append(f"{m} imports {d}, a module outside every layer folder")
            elif there is not None and there != here and _rank(there) >= _rank(here):
                problems.append(
                    f"{m} ({here}) imports {d} ({there}): {'the same rank' if _rank(there) == _rank(here) else 'a higher layer'}"
                )
            elif d in FACE:
                problems.append(f"{m} imports the package's face {d}")
        if here in CORE and "trl" in outer:
            problems.append(f"{m} ({here}, core) imports trl")
    return problems


def test_every_module_sits_in_a_layer_folder():
    loose = [m for m in _modules(PKG) if _folder(m) is None and m not in FACE]
    assert not loose, f"modules outside the layer folders: {loose}"
    for folder in {_folder(m) for m in _modules(PKG)} - {None}:
        _rank(folder)


def test_no_import_cycle():
    cycles = _cycles(PKG)
    assert not cycles, "import cycles: " + "; ".join(cycles)


def test_no_import_runs_back_up_a_layer():
    problems = _climbs(PKG)
    assert not problems, "; ".join(problems)


def test_every_layer_folder_says_what_it_owns():
    for init in sorted(PKG.glob("*/__init__.py")):
        doc = ast.get_docstring(ast.parse(init.read_text(encoding="utf-8")))
        assert doc and "import" in doc, f"{init.parent.name}/__init__.py has no docstring saying what it may import"


def _fake_package(tmp_path, files: dict) -> Path:
    pkg = tmp_path / "grpo_kit"
    for rel, text in {"__init__.py": "", **files}.items():
        (pkg / rel).parent.mkdir(parents=True, exist_ok=True)
        (pkg / rel).write_text(text)
    return pkg


def test_the_checks_can_fail(tmp_path):
    """A circle inside functions, a climb from loss to app and TRL in the core are each reported."""
    pkg = _fake_package(
        tmp_path,
        {
            "loss/__init__.py": "",
            "loss/a.py": "def f():\n    from grpo_kit.loss.b import g\n",
            "loss/b.py": "from grpo_kit.loss import a\nimport trl\n",
            "app/__init__.py": "",
            "app/run.py": "",
            "loss/c.py": "def f():\n    from ..app import run\n",
        },
    )
    assert any("grpo_kit.loss.a -> grpo_kit.loss.b -> grpo_kit.loss.a" in c for c in _cycles(pkg))
    climbs = _climbs(pkg)
    assert any("grpo_kit.loss.c (loss) imports grpo_kit.app.run (app): a higher layer" in c for c in climbs), climbs
    assert any("grpo_kit.loss.b (loss, core) imports trl" in c for c in climbs), climbs
    with pytest.raises(AssertionError, match="in no layer"):
        _rank("extras")
