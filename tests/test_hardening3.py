"""Issue 52 items 5-6: every input through the bounded readers (report_to re-read as YAML, data files line by line),
and run folders (an atomic --overwrite claim, system and package folders refused by rule, the second signal naming
the checkpoint, resume keeping a complete checkpoint it did not write)."""

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from grpo_kit.app.cli import main
from grpo_kit.app.config import ConfigError, GRPOKitConfig

ROOT = Path(__file__).resolve().parent.parent
DEEP = "[" * 3000 + "]" * 3000
# Nine levels of nine aliases each: 9**9 values once expanded, a few hundred bytes as text.
BOMB = (
    "["
    + ", ".join([f"&a0 [{', '.join(['1'] * 9)}]"] + [f"&a{i} [{', '.join([f'*a{i - 1}'] * 9)}]" for i in range(1, 9)])
    + "]"
)


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
        lines = [
            f"report_to: {quoted}" if line.startswith("report_to:") else line
            for line in (run / "config.yaml").read_text().splitlines()
        ]
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
    r = subprocess.run(
        [sys.executable, "-c", _LOAD_UNDER_2GB, str(data)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
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


# --- item 6: run folders ------------------------------------------------------------------------------------
_OVERWRITER = """
import os, sys, time
import grpo_kit.app.run_folder as rf
aside = rf._aside_name
def slow(run_dir):  # widen the window between looking at the folder and moving it aside
    time.sleep(0.6)
    return aside(run_dir)
rf._aside_name = slow
while time.time() < float(sys.argv[2]):
    time.sleep(0.002)
try:
    lock = rf.claim_run_folder(sys.argv[1], overwrite=True)
except rf.RunFolderError as e:
    print("refused", flush=True)
    sys.exit(0)
time.sleep(1.5)  # the other claim, if it went through, has moved things by now
mine = os.fstat(lock._fd)
try:
    still = os.path.samestat(mine, os.stat(os.path.join(sys.argv[1], rf.LOCK_FILE)))
except FileNotFoundError:
    still = False
print("held" if still else "moved while held", flush=True)
lock.release()
"""


def test_two_overwrite_claims_of_one_folder_never_move_a_live_run(tmp_path):
    from grpo_kit.app.run_folder import LOCK_FILE

    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text("max_steps: 2\n")  # an old run, to be moved aside
    start = time.time() + 3
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _OVERWRITER, str(run), str(start + 0.15 * i)],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(2)
    ]
    outs = [p.communicate(timeout=60) for p in procs]
    assert sorted(o.strip() for o, _ in outs) in (["held", "refused"], ["held", "held"]), outs
    assert "moved while held" not in "".join(o for o, _ in outs), outs
    asides = sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("run.replaced-"))
    assert asides and (tmp_path / asides[0] / "config.yaml").is_file()  # the old run, whole
    assert not any((tmp_path / a / LOCK_FILE).exists() for a in asides)  # nothing left locked there


def _fake_python(root: Path, marker: str) -> Path:
    root.mkdir(parents=True)
    if marker == "conda":
        (root / "conda-meta").mkdir()
        (root / "lib" / "python3.11" / "site-packages").mkdir(parents=True)
    elif marker == "venv":
        (root / "pyvenv.cfg").write_text("home = /usr/bin\n")
    else:  # a package folder
        (root / "numpy-2.0.dist-info").mkdir()
    return root


def test_system_and_package_folders_are_refused_by_rule(tmp_path):
    import site

    from grpo_kit.app.run_folder import unsafe_run_folder

    bad = [
        _fake_python(tmp_path / "conda", "conda"),
        tmp_path / "conda" / "lib" / "x",
        _fake_python(tmp_path / "venv", "venv"),
        tmp_path / "venv" / "runs" / "a",
        _fake_python(tmp_path / "site-packages", "packages"),
        tmp_path / "site-packages" / "new",
        Path(sys.prefix),
        Path(site.getsitepackages()[0]),
        Path(site.getsitepackages()[0]) / "mine",
    ]
    bad += [
        Path(p)
        for p in ("/var/lib", "/var/log", "/opt/conda", "/lost+found", "/var/cache", "/usr/local")
        if os.path.isdir(p)
    ]
    (tmp_path / "project" / "data").mkdir(parents=True)  # an existing folder that keeps other folders, no run
    bad.append(tmp_path / "project")
    for path in bad:
        assert unsafe_run_folder(path), path
        with pytest.raises(ConfigError, match="output_dir="):
            GRPOKitConfig(output_dir=str(path)).validate()
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("a folder of one's own, with a note")
    (tmp_path / "old" / "checkpoints").mkdir(parents=True)
    (tmp_path / "old" / "config.yaml").write_text("max_steps: 2\n")
    for ok in (tmp_path / "new", tmp_path / "mine", tmp_path / "old", tmp_path / "project" / "run1"):
        assert unsafe_run_folder(ok) is None, ok


def test_resume_keeps_a_complete_checkpoint_it_did_not_write(tmp_path):
    from grpo_kit.trainer.checkpoints import find_resume_checkpoint, list_checkpoints, write_checkpoint

    run = tmp_path / "run"
    write_checkpoint(run, 2, lambda d: (d / "a.json").write_text('{"step": 2}'))
    root = run / "checkpoints"
    # another process was killed while saving step 2 again: between moving the complete one aside and renaming
    # its new one in
    os.rename(root / "checkpoint-2", root / ".old-checkpoint-2-99999")
    (root / ".tmp-checkpoint-2-99999").mkdir()
    ckpt = find_resume_checkpoint(run)
    assert ckpt == root / "checkpoint-2" and (ckpt / "a.json").read_text() == '{"step": 2}'
    assert [p.name for p in list_checkpoints(run)] == ["checkpoint-2"]
    assert sorted(p.name for p in root.iterdir()) == ["checkpoint-2"]
    # an .old- copy of a step whose checkpoint is there (the rename went through) is the stale one
    write_checkpoint(run, 3, lambda d: (d / "a.json").write_text('{"step": 3}'))
    write_checkpoint(tmp_path / "other", 3, lambda d: (d / "a.json").write_text('{"old": 3}'))
    os.rename(tmp_path / "other" / "checkpoints" / "checkpoint-3", root / ".old-checkpoint-3-99999")
    assert find_resume_checkpoint(run) == root / "checkpoint-3"
    assert (root / "checkpoint-3" / "a.json").read_text() == '{"step": 3}'
    assert sorted(p.name for p in root.iterdir()) == ["checkpoint-2", "checkpoint-3"]
