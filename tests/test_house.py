"""House rules read from the code: no function of the package over 80 lines, and an import inside a function only
where it is lazy on purpose, with its reason in a comment on the import's line."""

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


def long_functions(pkg: Path) -> list[str]:
    out = []
    for p in sorted(pkg.rglob("*.py")):
        for f in _functions(ast.parse(p.read_text(encoding="utf-8"))):
            n = f.end_lineno - f.lineno + 1
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
                    text = lines[node.lineno - 1: node.end_lineno]
                    if not any("#" in t and t.split("#", 1)[1].strip() for t in text):
                        out.append(f"{p.relative_to(pkg.parent)}:{node.lineno} {text[0].strip()}")
    return out


def test_no_function_over_80_lines():
    long = long_functions(PKG)
    assert not long, "functions over 80 lines: " + "; ".join(long)


def test_every_import_inside_a_function_says_why():
    bare = unexplained_inner_imports(PKG)
    assert not bare, f"{len(bare)} imports inside functions without a reason: " + "; ".join(bare)


def test_the_checks_can_fail(tmp_path):
    pkg = tmp_path / "grpo_kit"
    pkg.mkdir()
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_LINES))
    (pkg / "a.py").write_text(f"def long():\n{body}\n\ndef short():\n    import json\n    import vllm  # lazy: optional\n")
    assert long_functions(pkg) == [f"grpo_kit/a.py:1 long ({MAX_LINES + 1} lines)"]
    assert unexplained_inner_imports(pkg) == ["grpo_kit/a.py:" + str(MAX_LINES + 4) + " import json"]


@pytest.mark.parametrize("name", ["EfficientGRPOTrainer", "efficient_grpo_loss", "GRPOKitConfig", "estimate", "train"])
def test_public_names_without_importing_trl(name):
    """``import grpo_kit`` imports no TRL; each public name comes on first use."""
    import subprocess
    import sys

    code = (f"import sys, grpo_kit; assert 'trl' not in sys.modules, 'import grpo_kit imported trl'; "
            f"obj = grpo_kit.{name}; assert obj is not None; from grpo_kit import {name}")
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
    (pkg / "a.py").write_text('"""Measured 0.3 s (bench/results/step.md) on 2026-12-05."""\nSRC_SOURCE = "blog (2025-02-20)"\n')
    assert diary_lines(pkg) == ['grpo_kit/a.py:1 """Measured 0.3 s (bench/results/step.md) on 2026-12-05."""']
