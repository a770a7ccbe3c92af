"""The README is a map and the documentation site builds: README.md at most 250 lines, every relative link in
README.md, CHANGELOG.md and docs/ points to an existing file, and ``mkdocs build --strict`` (no broken link or
anchor, no missing API reference) passes."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README_MAX_LINES = 250
# [text](target) and ![alt](target); a target with a scheme, an anchor alone or an absolute path is not a file link
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```.*?^```", re.S | re.M)


def _markdown_files():
    return [ROOT / "README.md", ROOT / "CHANGELOG.md", *sorted((ROOT / "docs").rglob("*.md"))]


def _relative_links(path):
    text = FENCE.sub("", path.read_text(encoding="utf-8"))  # code blocks hold no links
    for target in LINK.findall(text):
        if "://" in target or target.startswith(("#", "mailto:", "/")):
            continue
        yield target.split("#", 1)[0]


def test_readme_is_a_map():
    lines = (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines, at most {README_MAX_LINES}"


def test_readme_quick_start_is_what_ci_runs():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert "bash install.sh && python -m grpo_kit train" in readme
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    assert "bash install.sh --test && python3 -m pytest -q" in readme
    assert "bash install.sh --test && python3 -m pytest -q" in ci


def test_relative_links_point_to_files():
    missing = []
    for path in _markdown_files():
        for target in _relative_links(path):
            if target and not (path.parent / target).exists():
                missing.append(f"{path.relative_to(ROOT)}: {target}")
    assert not missing, "links to files that do not exist:\n" + "\n".join(missing)


def test_mkdocs_build_strict(tmp_path):
    pytest.importorskip("mkdocs", reason="documentation tools not installed (requirements-test.txt)")
    pytest.importorskip("mkdocs_jupyter", reason="documentation tools not installed (requirements-test.txt)")
    site = tmp_path / "site"
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}  # mkdocs-material's end-of-life notice on every build
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    warnings = [line for line in proc.stderr.splitlines() if line.startswith(("WARNING", "ERROR"))]
    assert proc.returncode == 0 and not warnings, proc.stdout[-3000:] + proc.stderr[-6000:]
    # the pages the site promises: each part, the generated configuration reference, the rendered notebooks
    assert "loss_type" in (site / "configuration" / "index.html").read_text(encoding="utf-8")
    for page in (
        "loss",
        "offload",
        "generation",
        "memory",
        "quantization",
        "reliability",
        "benchmarks",
        "api/loss",
        "api/app",
    ):
        assert (site / page / "index.html").is_file(), page
    notebooks = list((site / "notebooks").glob("*/index.html"))  # notebooks/index.html itself is docs/notebooks.md
    assert len(notebooks) == len(list((ROOT / "notebooks").glob("*.ipynb")))
    # each notebook's page shows every picture its committed run holds (a page of code without its figures is
    # what a reader would meet if the renderer dropped them)
    for nb in (ROOT / "notebooks").glob("*.ipynb"):
        pictures = nb.read_text(encoding="utf-8").count('"image/png"')
        shown = (site / "notebooks" / nb.stem / "index.html").read_text(encoding="utf-8").count("data:image/png")
        assert pictures >= 1 and shown >= pictures, f"{nb.stem}: {shown} pictures on its page, {pictures} in its run"
