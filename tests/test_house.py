"""House rules read from the code: no function of the package over 80 lines of code (its signature and docstring
aside: the formatter lays a long signature out one parameter a line, which is layout, not logic), and an import
inside a function only where it is lazy on purpose, with its reason in a comment on the import's line."""

import ast
import re
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[1] / "grpo_kit"
MAX_LINES = 80


def _functions(tree):
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield node


def _code_start(f) -> int:
    """The line of a function's first statement after its docstring (past its end where it has none)."""
    body = f.body
    if (
        isinstance(body[0], ast.Expr)
        and isinstance(body[0].value, ast.Constant)
        and isinstance(body[0].value.value, str)
    ):
        return body[1].lineno if len(body) > 1 else f.end_lineno + 1
    return body[0].lineno


def long_functions(pkg: Path) -> list[str]:
    out = []
    for p in sorted(pkg.rglob("*.py")):
        for f in _functions(ast.parse(p.read_text(encoding="utf-8"))):
            n = f.end_lineno - _code_start(f) + 1
            if n > MAX_LINES:
                out.append(f"{p.relative_to(pkg.parent)}:{f.lineno} {f.name} ({n} lines)")
    return out


def unexplained_inner_imports(pkg: Path) -> list[str]:
    """Imports inside a function whose lines carry no ``# ...`` comment giving the reason."""
    out = []
    for p in sorted(pkg.rglob("*.py")):
        lines = p.read_text(encoding="utf-8").splitlines()
        seen = set()
        for f in _functions(ast.parse("\n".join(lines))):
            for node in ast.walk(f):
                if isinstance(node, (ast.Import, ast.ImportFrom)) and node.lineno not in seen:
                    seen.add(node.lineno)
                    text = lines[node.lineno - 1 : node.end_lineno]
                    if not any("#" in t and t.split("#", 1)[1].strip() for t in text):
                        out.append(f"{p.relative_to(pkg.parent)}:{node.lineno} {text[0].strip()}")
    return out


def test_no_function_over_80_lines():
    long = long_functions(PKG)
    assert not long, "functions over 80 lines of code: " + "; ".join(long)


def test_every_import_inside_a_function_says_why():
    bare = unexplained_inner_imports(PKG)
    assert not bare, f"{len(bare)} imports inside functions without a reason: " + "; ".join(bare)


def test_the_checks_can_fail(tmp_path):
    pkg = tmp_path / "grpo_kit"
    pkg.mkdir()
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_LINES + 1))
    at_limit = "\n".join(f"    y{i} = {i}" for i in range(MAX_LINES))
    (pkg / "a.py").write_text(
        f"def long():\n{body}\n\ndef short():\n    import json\n    import vllm  # lazy: optional\n"
        f'\ndef documented(\n    a,\n    b,\n):\n    """Docs."""\n{at_limit}\n'
    )
    assert long_functions(pkg) == [f"grpo_kit/a.py:1 long ({MAX_LINES + 1} lines)"]  # signature lines aside
    assert unexplained_inner_imports(pkg) == ["grpo_kit/a.py:" + str(MAX_LINES + 5) + " import json"]


@pytest.mark.parametrize("name", ["EfficientGRPOTrainer", "efficient_grpo_loss", "GRPOKitConfig", "estimate", "train"])
def test_public_names_without_importing_trl(name):
    """``import grpo_kit`` imports no TRL; each public name comes on first use."""
    import subprocess
    import sys

    code = (
        f"import sys, grpo_kit; assert 'trl' not in sys.modules, 'import grpo_kit imported trl'; "
        f"obj = grpo_kit.{name}; assert obj is not None; from grpo_kit import {name}"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]


_DIARY = re.compile(r"bench/results/[A-Za-z_]|\b20\d\d-\d\d-\d\d\b|\bsession \d+\b")


def diary_lines(pkg: Path) -> list[str]:
    """Lines of the package that name a result file, a date or a work session: measurements live in
    bench/results/, not in the code. A citation of a peer's published source names its date on purpose
    (``*_SOURCE`` constants) and is left out."""
    out = []
    for p in sorted(pkg.rglob("*.py")):
        for i, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1):
            if _DIARY.search(line) and "_SOURCE = " not in line:
                out.append(f"{p.relative_to(pkg.parent)}:{i} {line.strip()[:100]}")
    return out


def test_no_result_paths_dates_or_sessions_in_the_package():
    lines = diary_lines(PKG)
    assert not lines, "; ".join(lines)


def test_the_diary_check_can_fail(tmp_path):
    pkg = tmp_path / "grpo_kit"
    pkg.mkdir()
    (pkg / "a.py").write_text(
        '"""Measured 0.3 s (bench/results/step.md) on 2026-12-05."""\nSRC_SOURCE = "blog (2025-02-20)"\n'
    )
    assert diary_lines(pkg) == ['grpo_kit/a.py:1 """Measured 0.3 s (bench/results/step.md) on 2026-12-05."""']


# Every YAML or JSON parse of the package goes through a bounded reader (a size limit, a depth limit, one clear
# error); these are they. The sandbox's two scripts run without the package, each with a bounded parse of its own.
BOUNDED_READERS = {
    "grpo_kit/readers/bounded.py": None,  # the whole module
    "grpo_kit/app/config_loading.py": {"_LimitedLoader", "load_yaml"},  # the config's YAML, in limits
    "grpo_kit/tasks/sandbox_child.py": {"_parse"},
    "grpo_kit/tasks/sandbox_program.py": {"_parse"},
}
_PARSERS = {
    "json": {"load", "loads", "JSONDecoder", "scanner"},
    "yaml": {
        "load",
        "safe_load",
        "full_load",
        "unsafe_load",
        "load_all",
        "safe_load_all",
        "full_load_all",
        "unsafe_load_all",
        "compose",
        "compose_all",
        "parse",
        "scan",
        "Loader",
        "SafeLoader",
        "FullLoader",
        "UnsafeLoader",
        "BaseLoader",
        "CLoader",
        "CSafeLoader",
    },
}


def unbounded_parses(pkg: Path) -> list[str]:
    """Uses of a YAML or JSON parser (``yaml.*load*``, ``json.load(s)``, their loaders and decoders, however
    imported) outside the bounded readers (the module, or the functions and classes named for it)."""
    out = []
    for p in sorted(pkg.rglob("*.py")):
        rel = str(p.relative_to(pkg.parent))
        allowed = BOUNDED_READERS.get(rel, set())
        if allowed is None:
            continue
        tree = ast.parse(p.read_text(encoding="utf-8"))
        aliases = {}  # local name -> (module, attribute or None)
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                aliases.update({a.asname or a.name: (a.name, None) for a in node.names if a.name in _PARSERS})
            elif isinstance(node, ast.ImportFrom) and node.module in _PARSERS:
                aliases.update({a.asname or a.name: (node.module, a.name) for a in node.names})
        owner = {}
        for f in ast.walk(tree):  # breadth first: the outermost function or class names each node
            if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                for node in ast.walk(f):
                    owner.setdefault(id(node), f.name)
        for node in ast.walk(tree):
            target = None
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases:
                module, attr = aliases[node.value.id]
                target = (module, node.attr) if attr is None else None
            elif isinstance(node, ast.Name) and node.id in aliases and aliases[node.id][1] is not None:
                target = aliases[node.id]
            if target and target[1] in _PARSERS[target[0]] and owner.get(id(node)) not in allowed:
                out.append(f"{rel}:{node.lineno} {target[0]}.{target[1]}")
    return out


def test_every_yaml_and_json_parse_goes_through_a_bounded_reader():
    found = unbounded_parses(PKG)
    assert not found, "YAML/JSON parsed outside the bounded readers (grpo_kit.readers.bounded): " + "; ".join(found)


def test_the_parse_check_can_fail(tmp_path):
    pkg = tmp_path / "grpo_kit"
    (pkg / "tasks").mkdir(parents=True)
    (pkg / "a.py").write_text(
        "import json, yaml as y\nfrom json import loads as L\n"
        "def f(t):\n    return json.loads(t), y.safe_load(t), L(t), json.dumps(t)\n"
    )
    (pkg / "tasks" / "sandbox_child.py").write_text(
        "import json\ndef _parse(t):\n    return json.loads(t)\ndef other(t):\n    return json.loads(t)\n"
    )
    assert unbounded_parses(pkg) == [
        "grpo_kit/a.py:4 json.loads",
        "grpo_kit/a.py:4 yaml.safe_load",
        "grpo_kit/a.py:4 json.loads",
        "grpo_kit/tasks/sandbox_child.py:5 json.loads",
    ]


def test_ruff_check_passes():
    """The tree as ruff lints it (pyproject.toml's ``[tool.ruff]``): a change that breaks a rule fails here."""
    import subprocess
    import sys

    r = subprocess.run(
        [sys.executable, "-m", "ruff", "check", "."], cwd=PKG.parent, capture_output=True, text=True, timeout=300
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]


def test_ruff_format_check_passes():
    """The tree as ruff formats it (``[tool.ruff.format]``): code laid out by hand differently fails here; run
    ``ruff format .`` to fix."""
    import subprocess
    import sys

    r = subprocess.run(
        [sys.executable, "-m", "ruff", "format", "--check", "."],
        cwd=PKG.parent,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]


def test_no_backslash_continuations():
    """Lines are joined by brackets, never by a trailing backslash (inside strings, backslashes are text)."""
    import io
    import tokenize

    found = []
    for path in sorted(
        [*PKG.rglob("*.py"), *(PKG.parent / "tests").glob("*.py"), *(PKG.parent / "bench").glob("*.py")]
    ):
        text = path.read_text()
        in_string = set()
        for tok in tokenize.generate_tokens(io.StringIO(text).readline):
            if tok.type == tokenize.STRING:
                in_string.update(range(tok.start[0], tok.end[0]))
        found += [
            f"{path.relative_to(PKG.parent)}:{n}"
            for n, line in enumerate(text.splitlines(), 1)
            if line.rstrip().endswith("\\") and not line.lstrip().startswith("#") and n not in in_string
        ]
    assert not found, found


def test_no_private_name_is_imported_across_modules():
    """A module's ``_private`` names are its own: what another module needs is public, or stays where it is."""
    found = []
    for path in sorted(PKG.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("grpo_kit"):
                found += [
                    f"{path.relative_to(PKG.parent)}:{node.lineno} {node.module}.{a.name}"
                    for a in node.names
                    if a.name.startswith("_") and not a.name.startswith("__")
                ]
    assert not found, found


# The layers below the app take their own narrow spec (grpo_kit.app.specs), never the app's config.
BELOW_APP = ("kernels", "readers", "loss", "model", "tasks", "memory", "generation", "trainer")
CONFIG_PARAMETERS = {"cfg", "config", "run_config", "kit_config"}  # what a parameter holding the config is called
# TRL's TrainingArguments and TrainerState carry TRL's names (output_dir, max_steps, ...), which the config shares
TRL_OBJECTS = {"self", "args", "state"}


def config_reads(pkg: Path, config_fields: set[str], config_only: set[str]) -> list[str]:
    """Functions below the app that take or read the app's config: an annotation naming ``GRPOKitConfig``, a
    parameter named for a config (``CONFIG_PARAMETERS``) whose attributes read include a config field or method,
    or any parameter's read of a field only the config has (no layer spec or sampling/objective spec carries it)."""
    out = []
    for layer in BELOW_APP:
        for p in sorted((pkg / layer).rglob("*.py")):
            rel = p.relative_to(pkg.parent)
            for f in _functions(ast.parse(p.read_text(encoding="utf-8"))):
                args = [*f.args.posonlyargs, *f.args.args, *f.args.kwonlyargs, f.args.vararg, f.args.kwarg]
                args = [a for a in args if a is not None]
                notes = [a.annotation for a in args if a.annotation is not None] + [f.returns] * bool(f.returns)
                if any("GRPOKitConfig" in ast.unparse(n) for n in notes):
                    out.append(f"{rel}:{f.lineno} {f.name} is annotated with GRPOKitConfig")
                params = {a.arg for a in args}
                for node in ast.walk(f):
                    if not (
                        isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in params
                    ):
                        continue
                    name, attr = node.value.id, node.attr
                    if (name in CONFIG_PARAMETERS and attr in config_fields) or (
                        name not in TRL_OBJECTS and attr in config_only
                    ):
                        out.append(f"{rel}:{node.lineno} {f.name} reads {name}.{attr}")
    return out


def _config_names():
    import dataclasses

    from grpo_kit.app.config import GRPOKitConfig
    from grpo_kit.app.specs import LAYER_SPECS
    from grpo_kit.generation.base import SamplingConfig
    from grpo_kit.loss.objective import ObjectiveSpec

    fields = {f.name for f in dataclasses.fields(GRPOKitConfig)}
    methods = {n for n, v in vars(GRPOKitConfig).items() if callable(v) and not n.startswith("_")} - {"spec"}
    carried = {f.name for k in (*LAYER_SPECS, SamplingConfig, ObjectiveSpec) for f in dataclasses.fields(k)}
    return fields | methods, fields - carried


def test_no_function_below_the_app_takes_or_reads_its_config():
    found = config_reads(PKG, *_config_names())
    assert not found, f"{len(found)} reads of the app's config below the app: " + "; ".join(found[:40])


def test_the_config_check_can_fail(tmp_path):
    pkg = tmp_path / "grpo_kit"
    (pkg / "memory").mkdir(parents=True)
    (pkg / "memory" / "a.py").write_text(
        "def f(cfg):\n    return cfg.max_steps\n"
        "def g(run: 'GRPOKitConfig'):\n    return 1\n"
        "def h(spec, args):\n    return spec.report_to, args.report_to, spec.lora_rank\n"
    )
    assert config_reads(pkg, {"max_steps", "report_to", "lora_rank"}, {"report_to"}) == [
        "grpo_kit/memory/a.py:2 f reads cfg.max_steps",
        "grpo_kit/memory/a.py:3 g is annotated with GRPOKitConfig",
        "grpo_kit/memory/a.py:6 h reads spec.report_to",
    ]


def test_each_layer_spec_carries_config_fields_its_layer_reads():
    """A spec's field is a config field of the same name (the app fills it by name) that its layer reads (as an
    attribute, or by name in a string), and the calculator's defaults are the config's (the config takes them)."""
    import dataclasses
    import inspect

    from grpo_kit.app.config import GRPOKitConfig
    from grpo_kit.app.specs import LAYER_SPECS, layer_spec
    from grpo_kit.memory.spec import StepSpec

    fields = {f.name for f in dataclasses.fields(GRPOKitConfig)}
    unread = []
    for kind in LAYER_SPECS:
        layer = PKG / Path(inspect.getfile(kind)).relative_to(PKG).parts[0]
        text = "\n".join(p.read_text(encoding="utf-8") for p in layer.rglob("*.py"))
        for f in dataclasses.fields(kind):
            if f.name != "step":
                assert f.name in fields, f"{kind.__name__}.{f.name} is no GRPOKitConfig field"
            if not re.search(rf"\.{f.name}\b|[\"']{f.name}[\"']", text):
                unread.append(f"{kind.__name__}.{f.name} (grpo_kit/{layer.name})")
    assert not unread, f"spec fields their layer never reads: {unread}"
    assert layer_spec(GRPOKitConfig(), StepSpec) == StepSpec()
    with pytest.raises(TypeError, match="no layer spec"):
        layer_spec(GRPOKitConfig(), dict)
