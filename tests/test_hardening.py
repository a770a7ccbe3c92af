"""Issue 39 items 4-6: bad config refused before the model loads (one `error:` line, no folder left), run
folders that refuse system places, a full disk, an atomic lock takeover, and a graceful stop on SIGTERM/SIGINT."""

import errno
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from grpo_kit.app import run as run_mod
from grpo_kit.app.cli import main
from grpo_kit.app.config import ConfigError, GRPOKitConfig
from grpo_kit.app.run_folder import LOCK_FILE, RunFolderError, claim_run_folder, unsafe_run_folder
from grpo_kit.trainer import checkpoints
from grpo_kit.trainer.checkpoints import DiskFullError, list_checkpoints, verify_checkpoint, write_checkpoint

WORKER = Path(__file__).resolve().parent / "_resume_worker.py"
TINY = dict(
    model="tiny-llama",
    max_steps=2,
    save_steps=1,
    num_train_samples=8,
    num_eval_samples=0,
    max_completion_length=4,
    num_generations=2,
    per_device_train_batch_size=2,
    seed=1,
)


def _sets(values: dict) -> list[str]:
    return [x for k, v in values.items() for x in ("--set", f"{k}={v}")]


def _one_error_line(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "Traceback" not in err, err[-2000:]
    return err


# --- item 4: config ----------------------------------------------------------------------------------
def test_yaml_alias_bomb_and_deep_nesting_are_refused_fast(tmp_path, capsys, no_model):
    bomb = tmp_path / "bomb.yaml"
    lines = ["a0: &a0 [1, 1, 1, 1, 1, 1, 1, 1, 1]"]
    lines += [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 9)}]" for i in range(1, 10)]
    bomb.write_text("\n".join(lines).replace("a9: &a9", "levels:") + "\n")
    deep = tmp_path / "deep.yaml"
    deep.write_text("levels: " + "[" * 3000 + "]" * 3000 + "\n")
    big = tmp_path / "big.yaml"
    big.write_text("system_prompt: '" + "x" * (3 << 20) + "'\n")
    for path, match in ((bomb, "alias"), (deep, "nested"), (big, "MiB")):
        t0 = time.perf_counter()
        assert main(["train", "--config", str(path), "--output-dir", str(tmp_path / "run")]) == 2
        assert time.perf_counter() - t0 < 10
        assert match in _one_error_line(capsys)
    for value in ("[" * 3000 + "]" * 3000, "&a [1, *a]"):
        t0 = time.perf_counter()
        assert main(["train", "--set", f"levels={value}", "--output-dir", str(tmp_path / "run")]) == 2
        assert time.perf_counter() - t0 < 10
        _one_error_line(capsys)
    nested = [1]
    for _ in range(3000):  # from Python (a notebook's parameters): no RecursionError either
        nested = [nested]
    with pytest.raises(ConfigError, match="levels="):
        GRPOKitConfig(levels=nested).validate()
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(
    "override, match",
    [
        (
            "reward_time_limit_s=1e10",
            r"reward_time_limit_s=10000000000.0 must be at most 3600 \(0: no limit; at most an hour\)",
        ),
        ("reward_time_limit_s=.inf", "reward_time_limit_s=inf must be at least 0 and finite"),
        ("max_prompt_length=1000000000000", "max_prompt_length=1000000000000 must be at most 1048576"),
        ("num_generations=1000000", "num_generations=1000000 must be at most 65536"),
        ("per_device_train_batch_size=1000000", "per_device_train_batch_size=1000000 must be at most 65536"),
        ("lora_rank=1000000", "lora_rank=1000000 must be at most 65536"),
        ("num_train_samples=1000000000", "num_train_samples=1000000000 must be at most 1000000"),
        ("max_steps=1000000000000000", "max_steps=1000000000000000 must be at most 10000000"),
    ],
)
def test_every_size_has_an_upper_bound(override, match):
    with pytest.raises(ConfigError, match=match) as info:
        GRPOKitConfig().apply_overrides([override]).validate()
    assert "-9999" not in str(info.value)


def test_every_numeric_field_has_an_upper_bound():
    from grpo_kit.app.config_checks import NUMERIC_LIMITS, NUMERIC_RANGES

    assert [name for name, (_, high, *_) in NUMERIC_RANGES.items() if high is None and name not in NUMERIC_LIMITS] == []
    for name, limit in NUMERIC_LIMITS.items():
        with pytest.raises(ConfigError, match=f"{name}=.* must be at most {limit}"):
            GRPOKitConfig(**{name: limit * 2}).validate()


@pytest.mark.parametrize(
    "values, match",
    [
        (dict(lora_rank=1000), "lora_rank=1000 is more than the model's hidden size 64"),
        (
            dict(num_train_samples=5000, levels="[1]"),
            "num_train_samples=5000: task='arithmetic' at levels \\[1\\] has only 155 distinct problems",
        ),
        (dict(max_prompt_length=200_000), "max_prompt_length=200000 .*beyond the model's context \\(131072 tokens"),
        (
            dict(num_generations=1024, per_device_train_batch_size=65536, max_completion_length=8192),
            "does not fit .*calculator",
        ),
    ],
)
def test_checks_against_the_model_and_task_run_before_it_loads(tmp_path, capsys, no_model, values, match):
    run = tmp_path / "run"
    assert main(["train", *_sets({**TINY, **values}), "--output-dir", str(run)]) == 2
    assert __import__("re").search(match, _one_error_line(capsys))
    assert not run.exists()


def test_small_dataset_refused_before_the_model_loads_and_the_retry_is_accepted(tmp_path, capsys, no_model):
    data = tmp_path / "g.jsonl"
    data.write_text(
        "".join(json.dumps({"question": f"What is {i} + 1?", "answer": f"#### {i + 1}"}) + "\n" for i in range(5))
    )
    run = tmp_path / "run"
    gsm = {**TINY, "task": "gsm8k", "dataset_path": str(data)}
    assert main(["train", *_sets({**gsm, "num_eval_samples": 10}), "--output-dir", str(run)]) == 2
    err = _one_error_line(capsys)
    assert "num_eval_samples=10" in err and "5" in err
    assert not run.exists()
    run.mkdir()  # a folder that was there before the failed run is left as it was: empty
    assert main(["train", *_sets({**gsm, "num_eval_samples": 5}), "--output-dir", str(run)]) == 2
    assert "fewer training problems" in _one_error_line(capsys) and list(run.iterdir()) == []


def test_a_failure_before_training_leaves_no_folder_and_the_retry_is_accepted(tmp_path, monkeypatch):
    run = tmp_path / "run"

    def broken(*a, **k):
        raise ValueError("tokenizer broke")

    monkeypatch.setattr(run_mod, "load_tokenizer", broken)
    with pytest.raises(ValueError, match="tokenizer broke"):
        run_mod.train(GRPOKitConfig(**TINY, output_dir=str(run)), progress=False)
    assert not run.exists()
    run.mkdir()
    (run / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match="tokenizer broke"):
        run_mod.train(GRPOKitConfig(**TINY, output_dir=str(run)), progress=False)
    assert [p.name for p in run.iterdir()] == ["notes.txt"]  # what was there stays, what the run wrote is gone
    claim_run_folder(run).release()  # the next run accepts it


# --- item 5: run folders --------------------------------------------------------------------------------
def test_output_dir_refuses_root_home_system_folders_and_the_checkout(tmp_path, capsys, no_model):
    repo = Path(run_mod.__file__).resolve().parents[2]
    for bad in (
        "/",
        os.path.expanduser("~"),
        "/etc",
        "/usr",
        "/usr/lib/x",
        "/bin",
        "/var",
        "/proc",
        "/sys",
        "/dev",
        "/boot",
        "/lib",
        "/lib64",
        "/sbin",
        "/opt",
        str(repo),
        str(repo.parent),
        "/home",
    ):
        assert unsafe_run_folder(bad), bad
        with pytest.raises(ConfigError, match="output_dir="):
            GRPOKitConfig(output_dir=bad).validate()
        with pytest.raises(RunFolderError):
            claim_run_folder(bad)
    assert main(["train", "--output-dir", "/"]) == 2
    assert "output_dir='/'" in _one_error_line(capsys)
    for ok in (tmp_path / "run", repo / "runs" / "x", Path(os.path.expanduser("~")) / "runs" / "a"):
        assert unsafe_run_folder(ok) is None, ok


def test_disk_full_while_saving_keeps_the_last_checkpoint(tmp_path):
    run = tmp_path / "run"
    write_checkpoint(run, 1, lambda d: (d / "a.json").write_text("{}"))

    def full(d):
        (d / "a.json").write_text("{}")
        raise OSError(errno.ENOSPC, "No space left on device")

    with pytest.raises(DiskFullError, match=rf"disk full .*{run}.* free"):
        write_checkpoint(run, 2, full)
    assert [p.name for p in list_checkpoints(run)] == ["checkpoint-1"]
    assert verify_checkpoint(run / "checkpoints" / "checkpoint-1") is None
    assert [p.name for p in (run / "checkpoints").iterdir()] == ["checkpoint-1"]  # no .tmp- folder


def test_disk_full_in_a_cli_run_is_one_error_line(tmp_path, capsys, monkeypatch):
    run = tmp_path / "run"
    manifest = checkpoints.write_manifest

    def full_at_2(folder):
        if folder.name.startswith(".tmp-checkpoint-2-"):
            raise OSError(errno.ENOSPC, "No space left on device")
        manifest(folder)

    monkeypatch.setattr(checkpoints, "write_manifest", full_at_2)
    assert main(["train", *_sets(TINY), "--output-dir", str(run)]) == 1
    out = capsys.readouterr().err  # the progress bar, then the error
    assert "Traceback" not in out and out.count("error: ") == 1
    err = out[out.index("error: ") :].strip().splitlines()
    assert len(err) == 1 and str(run) in err[0] and "free" in err[0] and "--resume" in err[0]
    assert [p.name for p in list_checkpoints(run)] == ["checkpoint-1"]
    assert verify_checkpoint(run / "checkpoints" / "checkpoint-1") is None
    assert not list((run / "checkpoints").glob(".tmp-*"))


_RACER = """
import sys, time
import grpo_kit.app.run_folder as rf
live = rf._live_owner
def slow(run_dir):  # widen the window between 'the owner is gone' and taking the lock
    out = live(run_dir)
    time.sleep(0.5)
    return out
rf._live_owner = slow
while time.time() < float(sys.argv[2]):
    time.sleep(0.005)
try:
    lock = rf.RunLock(sys.argv[1]).acquire()
except rf.RunFolderError:
    print("refused", flush=True)
    sys.exit(0)
time.sleep(2.0)
print("held", flush=True)
lock.release()
"""


def test_two_processes_racing_to_take_over_a_dead_lock(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    (run / LOCK_FILE).write_text(
        json.dumps({"pid": int(dead.stdout), "host": __import__("socket").gethostname(), "started": "then"})
    )
    start = time.time() + 4
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _RACER, str(run), str(start)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(3)
    ]
    outs = [p.communicate(timeout=60)[0].strip() for p in procs]
    assert sorted(outs) == ["held", "refused", "refused"], outs


# --- item 6: SIGTERM / SIGINT ---------------------------------------------------------------------------
def test_sigterm_saves_at_the_step_boundary_and_resume_continues(tmp_path, repo_root):
    run = tmp_path / "run"
    args = _sets({**TINY, "max_steps": 4, "save_steps": 2})
    log = tmp_path / "a.log"
    with open(log, "w") as fh:
        proc = subprocess.Popen(
            [sys.executable, str(WORKER), "train", *args, "--output-dir", str(run)],
            cwd=repo_root,
            stdout=fh,
            stderr=subprocess.STDOUT,
        )
    t0 = time.time()
    metrics = run / "metrics.csv"
    while not (metrics.is_file() and len(metrics.read_text().splitlines()) >= 2):
        assert proc.poll() is None, log.read_text()[-3000:]
        assert time.time() - t0 < 240
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=120)
    out = log.read_text()
    assert proc.returncode == 128 + signal.SIGTERM, out[-3000:]
    assert "SIGTERM" in out and f"--resume {run}" in out and "Traceback" not in out
    saved = list_checkpoints(run)
    assert saved and verify_checkpoint(saved[-1]) is None
    step = int(saved[-1].name.split("-")[1])
    assert 1 <= step < 4
    assert not list((run / "checkpoints").glob(".tmp-*")) and not (run / LOCK_FILE).exists()
    done = subprocess.run(
        [sys.executable, str(WORKER), "train", "--resume", str(run)],
        cwd=repo_root,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert f"resuming from {saved[-1]}" in done.stdout
    assert [line.split(",")[0] for line in metrics.read_text().splitlines()[1:]] == ["1", "2", "3", "4"]


def test_a_second_signal_exits_at_once_and_names_the_checkpoint_to_resume_from(tmp_path, repo_root):
    run = tmp_path / "run"
    log = tmp_path / "b.log"
    with open(log, "w") as fh:  # the save of checkpoint-2 pauses (120 s): the first SIGTERM waits for it
        proc = subprocess.Popen(
            [sys.executable, str(WORKER), "train", *_sets(TINY), "--output-dir", str(run)],
            cwd=repo_root,
            stdout=fh,
            stderr=subprocess.STDOUT,
            env={**os.environ, "GRPO_KIT_TEST_PAUSE_AT_SAVE": "2"},
        )
    paused = run / "checkpoints" / "SAVE_PAUSED"
    t0 = time.time()
    while not paused.is_file():
        assert proc.poll() is None, log.read_text()[-3000:]
        assert time.time() - t0 < 240
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    time.sleep(0.5)
    assert proc.poll() is None  # still saving
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=10)
    assert proc.returncode in (-signal.SIGTERM, 128 + signal.SIGTERM)
    out = log.read_text()
    ckpt = run / "checkpoints" / "checkpoint-1"
    assert f"resume from {ckpt}" in out and f"--resume {run}" in out, out[-3000:]  # the complete one, named
    assert verify_checkpoint(ckpt) is None


def test_notebook_interrupt_saves_and_names_resume(tmp_path):
    from transformers import TrainerCallback

    from grpo_kit.trainer.checkpoints import Interrupted

    run = tmp_path / "run"
    before = signal.getsignal(signal.SIGINT)

    class InterruptAfterFirstStep(TrainerCallback):
        def on_step_end(self, args, state, control, **kw):
            if state.global_step == 1:
                os.kill(os.getpid(), signal.SIGINT)  # what a kernel interrupt sends

    with pytest.raises(Interrupted, match=r"resume") as info:
        run_mod.train(
            GRPOKitConfig(**{**TINY, "max_steps": 3, "save_steps": 3}, output_dir=str(run)),
            progress=False,
            callbacks=(InterruptAfterFirstStep(),),
        )
    assert "grpo_kit.app.run.resume" in str(info.value)
    assert [p.name for p in list_checkpoints(run)] == ["checkpoint-1"]
    assert not list((run / "checkpoints").glob(".tmp-*")) and not (run / LOCK_FILE).exists()
    assert signal.getsignal(signal.SIGINT) is before  # the handler is put back
    summary = run_mod.resume(run, progress=False)
    assert summary["steps"] == 3


def test_arithmetic_problem_counts_are_what_the_generator_draws():
    import random

    from grpo_kit.tasks.data import ARITHMETIC_PROBLEMS, arithmetic_problem

    rng = random.Random(0)
    for level in (1, 2, 3):  # level 4's million is counted the same way
        seen = {arithmetic_problem(rng, level)["question"] for _ in range(40 * ARITHMETIC_PROBLEMS[level])}
        assert len(seen) == ARITHMETIC_PROBLEMS[level], level
