"""Issue 52 items 5-6: every input through the bounded readers (report_to re-read as YAML, data files line by line),
and run folders (an atomic --overwrite claim, system and package folders refused by rule, the second signal naming
the checkpoint, resume keeping a complete checkpoint it did not write)."""

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from grpo_kit.app import run as run_mod
from grpo_kit.app.cli import main
from grpo_kit.app.config import ConfigError, GRPOKitConfig

ROOT = Path(__file__).resolve().parent.parent
DEEP = "[" * 3000 + "]" * 3000
# Nine levels of nine aliases each: 9**9 values once expanded, a few hundred bytes as text.
BOMB = "[" + ", ".join([f"&a0 [{', '.join(['1'] * 9)}]"]
                        + [f"&a{i} [{', '.join([f'*a{i - 1}'] * 9)}]" for i in range(1, 9)]) + "]"


@pytest.fixture
def no_model(monkeypatch):
    def fail(*a, **k):
        raise AssertionError("a model was loaded: the bad input was not caught first")

    monkeypatch.setattr(run_mod, "load_tokenizer", fail)
    monkeypatch.setattr(run_mod, "load_model", fail)


def _one_error_line(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "Traceback" not in err and len(err.splitlines()) == 1, err[-2000:]
    assert len(err) < 2000, f"{len(err)} characters of error"
    return err


# --- item 5: report_to given as a quoted string ---------------------------------------------------------------
@pytest.mark.parametrize("text", [DEEP, BOMB], ids=["deep", "aliases"])
@pytest.mark.parametrize("route", ["set", "config", "resume"])
def test_report_to_as_a_quoted_string_is_read_within_the_limits(tmp_path, capsys, no_model, text, route):
    quoted = "'" + text + "'"  # YAML's single quotes: the value is this text as a string, read again as a list
    run = tmp_path / "run"
    if route == "set":
        argv = ["train", "--set", f"report_to={quoted}", "--output-dir", str(run)]
    elif route == "config":
        (tmp_path / "c.yaml").write_text(f"report_to: {quoted}\n")
        argv = ["train", "--config", str(tmp_path / "c.yaml"), "--output-dir", str(run)]
    else:  # a run folder someone hands you
        run.mkdir()
        GRPOKitConfig(output_dir=str(run)).save(run / "config.yaml")
        lines = [f"report_to: {quoted}" if line.startswith("report_to:") else line
                 for line in (run / "config.yaml").read_text().splitlines()]
        (run / "config.yaml").write_text("\n".join(lines) + "\n")
        argv = ["train", "--resume", str(run)]
    t0 = time.perf_counter()
    assert main(argv) == 2
    assert time.perf_counter() - t0 < 10
    assert "report_to" in _one_error_line(capsys)


def test_report_to_from_python_is_refused_in_a_short_message():
    for text in (DEEP, BOMB, "[" + "1, " * (3 << 20) + "1]"):
        with pytest.raises(ConfigError, match="report_to") as info:
            GRPOKitConfig(report_to=text).validate()
        assert len(str(info.value)) < 2000
        with pytest.raises(ConfigError, match="report_to") as info:
            GRPOKitConfig().set("report_to", text)
        assert len(str(info.value)) < 2000
    assert GRPOKitConfig().apply_overrides(["report_to='[none]'"]).report_to == "none"  # a list as text still reads


# --- item 5: data files line by line --------------------------------------------------------------------------
def _gsm8k_with_long_line(path: Path, line_bytes: int) -> Path:
    with open(path, "wb") as fh:
        fh.write(b'{"question": "What is 1 + 1?", "answer": "#### 2"}\n{"question": "')
        fh.truncate(fh.tell() + line_bytes)  # sparse: a long line of NUL bytes that takes no disk
    return path


def test_a_data_line_over_the_limit_is_one_error(tmp_path, capsys, no_model):
    from grpo_kit.tasks.data import MAX_DATA_LINE_BYTES, load_gsm8k_jsonl

    data = _gsm8k_with_long_line(tmp_path / "g.jsonl", 4 * MAX_DATA_LINE_BYTES)
    with pytest.raises(ValueError, match=rf"{data}:2: the line is longer than {MAX_DATA_LINE_BYTES >> 20} MiB"):
        load_gsm8k_jsonl(data)
    run = tmp_path / "run"
    sets = ["--set", "task=gsm8k", "--set", f"dataset_path={data}", "--set", "model=tiny-llama"]
    assert main(["train", *sets, "--output-dir", str(run)]) == 2
    assert f"{data}:2" in _one_error_line(capsys)
    assert not run.exists()


_LOAD_UNDER_2GB = """
import resource, sys
resource.setrlimit(resource.RLIMIT_AS, (2 << 30, 2 << 30))  # a loader that reads the line whole fails, not the host
from grpo_kit.tasks.data import load_gsm8k_jsonl
try:
    load_gsm8k_jsonl(sys.argv[1])
except ValueError as e:
    print(e)
"""


@pytest.mark.parametrize("gib", [6], ids=["6GiB-line"])
def test_a_line_of_gigabytes_is_refused_without_reading_it(tmp_path, gib):
    data = _gsm8k_with_long_line(tmp_path / "huge.jsonl", gib << 30)
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, "-c", _LOAD_UNDER_2GB, str(data)], capture_output=True, text=True,
                       timeout=120, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert r.returncode == 0 and "MemoryError" not in r.stderr, r.stderr[-2000:]
    assert f"{data}" in r.stdout and ("longer than" in r.stdout or "GiB" in r.stdout), r.stdout
    assert time.perf_counter() - t0 < 60


def test_the_bounded_json_reader_refuses_size_and_depth_in_one_line(tmp_path):
    from grpo_kit.readers.bounded import InputError, read_json

    (tmp_path / "deep.json").write_text(DEEP)
    (tmp_path / "big.json").write_text('"' + "x" * 2000 + '"')
    with pytest.raises(InputError, match="deep.json: JSON nested too deeply"):
        read_json(tmp_path / "deep.json")
    with pytest.raises(InputError, match="big.json: more than 1000 bytes of JSON"):
        read_json(tmp_path / "big.json", max_bytes=1000)
    assert read_json(tmp_path / "big.json") == "x" * 2000
