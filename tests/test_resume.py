"""Resumable checkpoints: a run SIGKILLed mid-step and mid-save resumes to the same weights and metrics as
an uninterrupted run; torn checkpoints are skipped; bad --resume input gets one clear line; no pickle."""

import csv
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from grpo_kit.app.resume_policy import resume_config
from grpo_kit.trainer.checkpoints import (
    CheckpointError,
    find_resume_checkpoint,
    last_checkpoint,
    list_checkpoints,
    load_state,
    save_state,
    verify_checkpoint,
    write_checkpoint,
)

WORKER = Path(__file__).resolve().parent / "_resume_worker.py"
TINY = [
    "--set",
    "model=tiny-llama",
    "--set",
    "max_steps=6",
    "--set",
    "save_steps=2",
    "--set",
    "num_train_samples=16",
    "--set",
    "num_eval_samples=0",
    "--set",
    "max_completion_length=8",
    "--set",
    "num_generations=4",
    "--set",
    "per_device_train_batch_size=4",
    "--set",
    "learning_rate=0.01",
    "--set",
    "seed=3",
]
# Columns that are a function of the math only (step_time_s and peak_memory_gib are measurements).
EXACT_COLUMNS = [
    "step",
    "reward_mean",
    "reward_std",
    "loss",
    "kl",
    "completion_length",
    "learning_rate",
    "grad_norm",
    "clip_ratio",
    "frac_reward_zero_std",
]


def _worker(args, cwd, log, env=None):
    """The CLI in a subprocess, output to the file ``log`` (a pipe nobody reads could fill and block it)."""
    with open(log, "w") as fh:
        proc = subprocess.Popen(
            [sys.executable, str(WORKER), "train", *args],
            cwd=cwd,
            stdout=fh,
            stderr=subprocess.STDOUT,
            env={**os.environ, **(env or {})},
        )
    proc.log = Path(log)
    return proc


def _kill_when(proc, condition, timeout=240):
    """SIGKILL ``proc`` as soon as ``condition()`` holds; fails if the process ended first."""
    t0 = time.time()
    while not condition():
        assert proc.poll() is None, "the run ended before the kill point:\n" + proc.log.read_text()[-3000:]
        assert time.time() - t0 < timeout, "kill point never reached"
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL


def _finish(proc, timeout=300):
    proc.wait(timeout=timeout)
    out = proc.log.read_text()
    assert proc.returncode == 0, out[-4000:]
    return out


def _rows(run_dir):
    with (run_dir / "metrics.csv").open() as fh:
        return [{c: r[c] for c in EXACT_COLUMNS} for r in csv.DictReader(fh)]


def test_sigkill_mid_step_and_mid_save_then_resume_is_bit_exact(tmp_path, repo_root):
    a, b = tmp_path / "A", tmp_path / "B"
    uninterrupted = _worker(
        [*TINY, "--output-dir", str(a)], repo_root, tmp_path / "a.log"
    )  # runs alongside B's first leg

    # Kill 1: in the middle of writing checkpoint-4 (its files in .tmp-checkpoint-4-*, no manifest, not
    # renamed); checkpoint-2 is complete, metrics.csv and samples.jsonl already hold steps 3 and 4.
    first = _worker(
        [*TINY, "--output-dir", str(b)], repo_root, tmp_path / "b1.log", env={"GRPO_KIT_TEST_PAUSE_AT_SAVE": "4"}
    )
    paused = b / "checkpoints" / "SAVE_PAUSED"
    _kill_when(first, paused.is_file)
    paused.unlink()
    tmp = next((b / "checkpoints").glob(".tmp-checkpoint-4-*"))
    assert (tmp / "optimizer.safetensors").is_file() and not (tmp / "manifest.json").exists()
    assert [p.name for p in list_checkpoints(b)] == ["checkpoint-2"]  # the torn one was never published
    assert [r["step"] for r in _rows(b)] == ["1", "2", "3", "4"]

    # Kill 2: resumed from checkpoint-2 (the temporary folder deleted), killed in the middle of step 5,
    # right after checkpoint-4 was published.
    second = _worker(["--resume", str(b)], repo_root, tmp_path / "b2.log")
    _kill_when(second, lambda: (b / "checkpoints" / "checkpoint-4").is_dir())
    assert "checkpoint-2" in second.log.read_text().split("resuming from", 1)[1].splitlines()[0]
    assert not tmp.exists()

    # Resume again, from checkpoint-4, to the end.
    out = _finish(_worker(["--resume", str(b)], repo_root, tmp_path / "b3.log"))
    assert "checkpoint-4" in out.split("resuming from", 1)[1].splitlines()[0]
    _finish(uninterrupted)

    rows_a, rows_b = _rows(a), _rows(b)
    assert [r["step"] for r in rows_a] == [str(s) for s in range(1, 7)]
    assert rows_b == rows_a  # no duplicate or missing rows; every logged number the same to the last digit
    wa = load_file(str(a / "adapter" / "adapter_model.safetensors"))
    wb = load_file(str(b / "adapter" / "adapter_model.safetensors"))
    assert wa.keys() == wb.keys() and len(wa) > 0
    for k in wa:
        assert torch.equal(wa[k], wb[k]), k
    assert any(("lora_B" in k) and wa[k].abs().sum() > 0 for k in wa)  # the adapter really trained
    # The final checkpoints agree too (weights, AdamW moments, scheduler).
    ca, cb = a / "checkpoints" / "checkpoint-6", b / "checkpoints" / "checkpoint-6"
    for name in ("optimizer", "scheduler"):
        ta, tb = load_file(str(ca / f"{name}.safetensors")), load_file(str(cb / f"{name}.safetensors"))
        assert ta.keys() == tb.keys() and all(torch.equal(ta[k], tb[k]) for k in ta), name
    samples_a = [json.loads(x) for x in (a / "samples.jsonl").read_text().splitlines()]
    samples_b = [json.loads(x) for x in (b / "samples.jsonl").read_text().splitlines()]
    assert samples_b == samples_a

    # (d) no pickle for model data: every checkpoint file is safetensors (loads as such), JSON or the
    # adapter's README; none is a torch.save zip or a pickle stream.
    for ckpt in list_checkpoints(b):
        assert verify_checkpoint(ckpt) is None
        files = [f for f in ckpt.rglob("*") if f.is_file()]
        assert (ckpt / "adapter" / "adapter_model.safetensors") in files
        for f in files:
            assert f.suffix in {".safetensors", ".json", ".md"}, f
            assert f.read_bytes()[:2] not in (b"PK", b"\x80\x02", b"\x80\x04", b"\x80\x05"), f
            if f.suffix == ".safetensors":
                load_file(str(f))
            elif f.suffix == ".json":
                json.loads(f.read_text())


# ---------------------------------------------------------------------------------------------------
# (b) atomic writes: a half-written or corrupted checkpoint is ignored, the previous one used.
def _fill(value):
    def fill(folder):
        save_state(
            {"w": torch.full((4,), float(value)), "step": value, "nested": ({"a": [1, 2.5]}, None)}, folder, "optimizer"
        )
        (folder / "kit_state.json").write_text(json.dumps({"run": {"metrics": [{"step": value}]}}))

    return fill


def test_state_codec_round_trip_without_pickle(tmp_path):
    import numpy as np

    state = {
        "t": torch.arange(6, dtype=torch.bfloat16).view(2, 3),
        3: (np.arange(4, dtype=np.uint32), "x"),
        "d": torch.float16,
        "n": [None, True, 1.5],
    }
    save_state(state, tmp_path, "s")
    back = load_state(tmp_path, "s")
    assert torch.equal(back["t"], state["t"]) and back["t"].dtype == torch.bfloat16
    assert back[3][1] == "x" and back[3][0].dtype == np.uint32 and (back[3][0] == np.arange(4)).all()
    assert back["d"] is torch.float16 and back["n"] == [None, True, 1.5]
    with pytest.raises(TypeError, match="no pickle"):
        save_state({"f": object()}, tmp_path, "bad")


def test_half_written_checkpoint_is_never_published(tmp_path):
    write_checkpoint(tmp_path, 2, _fill(2))

    def dies_midway(folder):  # the writer is killed while filling the folder
        _fill(4)(folder)
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        write_checkpoint(tmp_path, 4, dies_midway)
    root = tmp_path / "checkpoints"
    assert [p.name for p in list_checkpoints(tmp_path)] == ["checkpoint-2"]
    assert any(p.name.startswith(".tmp-checkpoint-4-") for p in root.iterdir())
    assert find_resume_checkpoint(tmp_path).name == "checkpoint-2"
    assert not any(p.name.startswith(".tmp-") for p in root.iterdir())  # cleaned up on resume


@pytest.mark.parametrize(
    "damage",
    [
        "truncate",
        "flip",
        "delete",
        "manifest",
        "no-manifest",
        "manifest-not-utf8",
        "manifest-a-list",
        "manifest-no-sizes",
        "manifest-outside",
        "state-not-utf8",
    ],
)
def test_corrupted_checkpoint_falls_back_to_previous(tmp_path, damage, capsys):
    write_checkpoint(tmp_path, 2, _fill(2), keep=0)
    newest = write_checkpoint(tmp_path, 4, _fill(4), keep=0)
    assert verify_checkpoint(newest) is None and last_checkpoint(tmp_path) == newest
    target = newest / "optimizer.safetensors"
    if damage == "truncate":
        target.write_bytes(target.read_bytes()[:-5])
    elif damage == "flip":  # same size, one byte different
        data = bytearray(target.read_bytes())
        data[-1] ^= 0xFF
        target.write_bytes(bytes(data))
    elif damage == "delete":
        target.unlink()
    elif damage == "manifest":
        (newest / "manifest.json").write_text('{"files": {')
    elif damage == "manifest-not-utf8":  # used to abort the resume with UnicodeDecodeError
        (newest / "manifest.json").write_bytes(b'{"files": {"\xff": 1}}')
    elif damage == "manifest-a-list":
        (newest / "manifest.json").write_text("[1, 2]")
    elif damage == "manifest-no-sizes":
        (newest / "manifest.json").write_text('{"files": {"optimizer.json": {}}}')
    elif damage == "manifest-outside":
        (newest / "manifest.json").write_text('{"files": {"../checkpoint-2/kit_state.json": {"bytes": 1}}}')
    elif damage == "state-not-utf8":  # consistent with its manifest, but unreadable
        from grpo_kit.trainer.checkpoints import write_manifest

        (newest / "kit_state.json").write_bytes(b'{"run": "\xff"}')
        write_manifest(newest)
    else:
        (newest / "manifest.json").unlink()
    assert verify_checkpoint(newest) is not None
    assert last_checkpoint(tmp_path).name == "checkpoint-2"
    assert "skipping checkpoint" in capsys.readouterr().err
    (tmp_path / "checkpoints" / "checkpoint-2" / "kit_state.json").write_text("{}")  # break the other one too
    assert last_checkpoint(tmp_path) is None
    with pytest.raises(CheckpointError, match="no complete checkpoint"):
        find_resume_checkpoint(tmp_path)


def test_keep_and_same_step_resave(tmp_path):
    for step in (2, 4, 6):
        write_checkpoint(tmp_path, step, _fill(step), keep=2)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["checkpoint-4", "checkpoint-6"]
    write_checkpoint(tmp_path, 6, _fill(7), keep=2)  # e.g. a guard's stop right after a periodic save
    assert load_state(tmp_path / "checkpoints" / "checkpoint-6", "optimizer")["step"] == 7
    assert [p.name for p in (tmp_path / "checkpoints").iterdir() if p.name.startswith(".")] == []


# ---------------------------------------------------------------------------------------------------
# (c) bad input to --resume
def _cli(*args, cwd):
    return subprocess.run(
        [sys.executable, "-m", "grpo_kit", "train", *args], cwd=cwd, capture_output=True, text=True, timeout=120
    )


def _run_folder(tmp_path, **fields):
    from grpo_kit.app.config import GRPOKitConfig

    run = tmp_path / "run"
    run.mkdir()
    cfg = GRPOKitConfig(model="tiny-llama", num_train_samples=16, num_eval_samples=0, output_dir=str(run), **fields)
    cfg.save(run / "config.yaml")
    return run


def test_resume_without_checkpoint_one_line_exit_1(tmp_path, repo_root):
    run = _run_folder(tmp_path)
    r = _cli("--resume", str(run), cwd=repo_root)
    assert r.returncode == 1, r.stderr[-2000:]
    assert "Traceback" not in r.stderr
    errors = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "no complete checkpoint" in errors[0] and str(run) in errors[0]


def test_resume_refuses_non_resumable_overrides(tmp_path, repo_root):
    run = _run_folder(tmp_path, learning_rate=0.01)
    r = _cli("--resume", str(run), "--set", "learning_rate=0.5", cwd=repo_root)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert "learning_rate: saved 0.01, given 0.5" in r.stderr and "max_steps" in r.stderr
    r = _cli("--resume", str(run), "--output-dir", str(tmp_path / "other"), cwd=repo_root)
    assert r.returncode == 2 and "writes to its own folder" in r.stderr
    r = _cli("--resume", str(tmp_path / "nothing-here"), cwd=repo_root)
    assert r.returncode == 2 and "no config.yaml" in r.stderr and "Traceback" not in r.stderr
    # The safe ones are accepted (checked in-process: no model load needed).
    cfg = resume_config(run, ["max_steps=80", "save_steps=5", "keep_checkpoints=0", "max_bad_steps=2"])
    assert (cfg.max_steps, cfg.save_steps, cfg.keep_checkpoints, cfg.max_bad_steps) == (80, 5, 0, 2)
    assert cfg.learning_rate == 0.01 and cfg.output_dir == str(run)
