"""bench/results as data: every page is what bench/report.py makes from its data file, the index lists every
benchmark, every row has the required keys, and the folder stays small (at most 30 entries; a folder counts as
one)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
sys.path.insert(0, str(ROOT / "bench"))

import report  # noqa: E402
from _common import ROW_KEYS, read_rows, record  # noqa: E402

BENCHMARKS = sorted(p.stem for p in (RESULTS / "data").glob("*.jsonl"))


def test_there_are_benchmarks():
    assert len(BENCHMARKS) >= 10, BENCHMARKS


@pytest.mark.parametrize("name", [*(f"{b}.md" for b in BENCHMARKS), "README.md"])
def test_page_is_generated_from_its_data(name):
    made = report.pages(RESULTS)[name]
    assert (RESULTS / name).read_text() == made, f"{name} is stale: run python -m grpo_kit bench report"


def test_index_lists_every_benchmark():
    index = (RESULTS / "README.md").read_text()
    for b in BENCHMARKS:
        assert f"## [{b}]({b}.md)" in index, b


@pytest.mark.parametrize("name", BENCHMARKS)
def test_every_row_has_the_required_keys(name):
    rows = read_rows(RESULTS / "data" / f"{name}.jsonl")
    assert rows
    for r in rows:
        missing = [k for k in ROW_KEYS if k not in r]
        assert not missing, (name, r.get("row"), missing)
        assert r["benchmark"] == name and isinstance(r["figures"], dict) and r["date"], r.get("row")


def test_at_most_30_entries():
    entries = sorted(p.name for p in RESULTS.iterdir())
    assert len(entries) <= 30, entries
    assert not [p for p in RESULTS.iterdir() if p.suffix in (".json", ".png")]  # no loose result files


def test_record_appends_and_regenerates(tmp_path):
    meta = dict(command="python -m grpo_kit bench toy", hardware={"cpu": "test CPU"}, date="2026-01-01")
    record("toy", [dict(row="a", model="m", gens=2, ms=1.5), dict(row="b", model="m", gens=2, ms=2.0)], meta, tmp_path)
    record("toy", [dict(row="a", model="m", gens=2, ms=1.25)], dict(meta, date="2026-01-02"), tmp_path)
    rows = read_rows(tmp_path / "data" / "toy.jsonl")
    assert [r["row"] for r in rows] == ["a", "b", "a"] and rows[0]["shape"] == "gens=2"
    assert rows[0]["card"] == "CPU (test CPU)" and rows[0]["figures"] == {"ms": 1.5}
    current, old = report.split_current(rows)
    assert [r["figures"]["ms"] for r in current] == [2.0, 1.25] and old == [rows[0]]
    page = (tmp_path / "toy.md").read_text()
    assert "## Current rows (2)" in page and "## Superseded rows (1)" in page
    assert "[toy](toy.md)" in (tmp_path / "README.md").read_text()
