"""Run folders (grpo_kit.app.run_folder, grpo_kit.app.run): a run is never trained over without being asked, one writer
at a time, and resuming a finished run, or one stopped during its final save or evaluation, trains no further."""

import json
import os
import subprocess
import sys

import pytest

from grpo_kit.app.run_folder import LOCK_FILE, RunFolderError, claim_run_folder, read_lock

TINY = dict(
    model="tiny-llama",
    max_steps=2,
    save_steps=2,
    num_train_samples=8,
    num_eval_samples=2,
    max_completion_length=4,
    num_generations=2,
    per_device_train_batch_size=2,
    seed=1,
)


def _old_run(tmp_path):
    run = tmp_path / "run"
    (run / "checkpoints" / "checkpoint-2").mkdir(parents=True)
    (run / "config.yaml").write_text("max_steps: 2\n")
    (run / "metrics.csv").write_text("step\n1\n2\n")
    (run / "notes.txt").write_text("mine")
    return run


def _tree(path):
    return {str(p.relative_to(path)): p.read_bytes() if p.is_file() else None for p in sorted(path.rglob("*"))}


def test_new_run_into_a_run_folder_is_refused_and_overwrite_moves_it_aside(tmp_path, capsys, monkeypatch):
    from grpo_kit.app import run as run_mod
    from grpo_kit.app.cli import main

    run = _old_run(tmp_path)
    before = _tree(run)
    with pytest.raises(
        RunFolderError,
        match=r"already holds a run \(config.yaml, metrics.csv, checkpoints\).*"
        r"--resume.*--overwrite",
    ):
        claim_run_folder(run)
    # the name train() calls (patching grpo_kit.model.loading's would reach run.py only on its first import)
    monkeypatch.setattr(run_mod, "load_tokenizer", lambda *a, **k: pytest.fail("a model was loaded"))
    args = [x for k, v in TINY.items() for x in ("--set", f"{k}={v}")]
    assert main(["train", *args, "--output-dir", str(run)]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]  # after the kit's notes on third-party warnings, if any
    assert err.startswith("error: run folder") and "--resume" in err and "--overwrite" in err
    assert _tree(run) == before  # nothing changed
    with pytest.raises(RunFolderError, match="choose one"):
        claim_run_folder(run, resume=True, overwrite=True)

    lock = claim_run_folder(run, overwrite=True)
    try:
        aside = [p for p in tmp_path.iterdir() if p.name.startswith("run.replaced-")]
        assert len(aside) == 1 and _tree(aside[0]) == before  # moved, whole, never deleted
        assert [p.name for p in run.iterdir()] == [LOCK_FILE]
        assert "moved the run that was in" in capsys.readouterr().err
    finally:
        lock.release()
    assert not (run / LOCK_FILE).exists()


def test_lock_refuses_a_second_writer_and_takes_over_a_dead_ones(tmp_path, capsys):
    run = tmp_path / "run"
    lock = claim_run_folder(run)
    info = read_lock(run)
    assert info["pid"] == os.getpid() and info["started"].endswith("UTC")
    with pytest.raises(RunFolderError, match=rf"in use by process {os.getpid()} on .* \(started {info['started']}\)"):
        claim_run_folder(run, resume=True)
    with pytest.raises(RunFolderError, match="in use by process"):  # checked before anything is moved aside
        claim_run_folder(run, overwrite=True)
    lock.release()

    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    try:
        (run / LOCK_FILE).write_text(json.dumps({**info, "pid": live.pid}))
        with pytest.raises(RunFolderError, match=f"in use by process {live.pid}"):
            claim_run_folder(run)
        (run / LOCK_FILE).write_text(json.dumps({**info, "pid": int(dead.stdout)}))
        claim_run_folder(run).release()  # its owner is gone: taken over
        assert "taking over the lock" in capsys.readouterr().err
    finally:
        live.kill()
        live.wait()


def test_resume_of_a_finished_run_or_one_stopped_in_its_final_evaluation(tmp_path, capsys):
    from grpo_kit.app.config import GRPOKitConfig
    from grpo_kit.app.run import resume, train
    from grpo_kit.trainer.checkpoints import list_checkpoints

    run = tmp_path / "run"
    train(GRPOKitConfig(**TINY, output_dir=str(run)), progress=False)
    assert [p.name for p in list_checkpoints(run)] == ["checkpoint-2"]
    metrics, samples = (run / "metrics.csv").read_text(), (run / "samples.jsonl").read_text()
    assert run.stat().st_mode & 0o777 == 0o700 and (run / "samples.jsonl").stat().st_mode & 0o777 == 0o600
    assert len(metrics.splitlines()) == 3
    # A kill during the final evaluation: checkpoint-2 (step 2 = max_steps) is complete, summary.json not written.
    (run / "summary.json").unlink()
    (run / "eval.json").unlink()
    summary = resume(run, progress=False)
    assert "finishing the final save and evaluation" in capsys.readouterr().out
    assert summary["steps"] == 2 and summary["accuracy_after"] is not None
    assert (run / "metrics.csv").read_text() == metrics and (run / "samples.jsonl").read_text() == samples
    assert [p.name for p in list_checkpoints(run)] == ["checkpoint-2"]  # no step 3
    assert set(json.loads((run / "eval.json").read_text())) == {"before", "after"}
    stamp = (run / "summary.json").stat().st_mtime_ns
    again = resume(run, progress=False)
    assert again["already_finished"] and "already finished" in capsys.readouterr().out
    assert (run / "summary.json").stat().st_mtime_ns == stamp and not (run / LOCK_FILE).exists()
