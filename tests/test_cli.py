import csv
import json
import math
import os
import subprocess
import sys

import pytest


def run_cli(*args, cwd, timeout=600):
    return subprocess.run(
        [sys.executable, "-m", "grpo_kit", *args], cwd=cwd, capture_output=True, text=True, timeout=timeout
    )


def test_train_tiny_two_steps_writes_run_folder(tmp_path, repo_root):
    out = tmp_path / "run"
    r = run_cli(
        "train",
        "--set",
        "model=tiny-llama",
        "--set",
        "max_steps=2",
        "--set",
        "num_train_samples=32",
        "--set",
        "num_eval_samples=4",
        "--set",
        "max_completion_length=8",
        "--set",
        "num_generations=4",
        "--set",
        "per_device_train_batch_size=4",
        "--output-dir",
        str(out),
        cwd=repo_root,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    for name in (
        "config.yaml",
        "metrics.csv",
        "rewards.png",
        "samples.jsonl",
        "eval.json",
        "summary.json",
        "adapter/adapter_model.safetensors",
        "adapter/adapter_config.json",
    ):
        assert (out / name).is_file(), name
    rows = list(csv.DictReader((out / "metrics.csv").open()))
    assert [int(r["step"]) for r in rows] == [1, 2]
    for row in rows:
        for key in ("reward_mean", "reward_std", "loss", "kl", "completion_length", "step_time_s", "peak_memory_gib"):
            assert math.isfinite(float(row[key])), (key, row)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 2 and summary["metrics_finite"]
    assert "scoring_batch_size" in summary and summary["scoring_batch_size"] != "auto"  # as resolved for the trainer
    evals = json.loads((out / "eval.json").read_text())
    assert set(evals) == {"before", "after"} and evals["before"]["n"] == 4
    samples = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    assert samples and {"prompt", "completion", "answer", "correctness_reward"} <= set(samples[0])


@pytest.mark.parametrize(
    "args,match",
    [
        (["--set", "model=gpt-17"], "model='gpt-17' is not a built-in name"),
        (["--set", "num_generations=1"], "num_generations=1 must be at least 2"),
        (["--set", "per_device_train_batch_size=5"], "must be a multiple of num_generations"),
        (["--set", "bogus_key=1"], "unknown config key 'bogus_key'"),
        (["--set", "task=gsm8k", "--set", "dataset_path=nope.jsonl"], "dataset_path='nope.jsonl' does not exist"),
        (["--config", "missing.yaml"], "config file 'missing.yaml' does not exist"),
    ],
)
def test_bad_input_one_clear_line(args, match, repo_root, tmp_path):
    r = run_cli("train", *args, "--output-dir", str(tmp_path / "r"), cwd=repo_root, timeout=60)
    assert r.returncode == 2
    assert match in r.stderr and "Traceback" not in r.stderr
    assert not (tmp_path / "r").exists()  # stopped before any work


def test_malformed_jsonl_stops_before_model_load(repo_root, tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question": "q", "answer": "#### 3"}\n{"question": "q2"\n')
    r = run_cli(
        "train",
        "--set",
        "task=gsm8k",
        "--set",
        f"dataset_path={bad}",
        "--set",
        "num_eval_samples=0",
        "--output-dir",
        str(tmp_path / "r"),
        cwd=repo_root,
        timeout=60,
    )
    assert r.returncode == 2 and "bad.jsonl:2: not valid JSON" in r.stderr
    assert not (tmp_path / "r").exists()


def test_doctor_and_unknown_bench(repo_root):
    r = run_cli("doctor", cwd=repo_root, timeout=120)
    assert r.returncode == 0 and "torch" in r.stdout and "generation" in r.stdout
    assert "(tested: 1.16.0)" in r.stdout  # TRL against the kit's window (grpo_kit.generation.versions)
    r = run_cli("bench", "no-such-bench", cwd=repo_root, timeout=60)
    assert r.returncode == 2 and "no benchmark named 'no-such-bench'" in r.stderr


def test_bench_runs_a_script_that_imports_its_siblings(repo_root, tmp_path):
    """`bench NAME` runs bench/NAME.py in its own process: bench/loss_chunk.py imports bench/loss.py and the kit
    with no sys.path edits, from any folder."""
    r = subprocess.run(
        [sys.executable, "-m", "grpo_kit", "bench", "loss_chunk", "--help"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": str(repo_root)},
    )
    assert r.returncode == 0 and "usage:" in r.stdout, r.stderr[-2000:]


def test_bench_step_until_ok_stops_at_the_first_length_that_runs(repo_root, tmp_path):
    """`bench step --until-ok` with lengths in descending order: the first that runs is the longest confirmed,
    and the shorter ones are not run (on the GPU each costs a model's step under the memory cap)."""
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "grpo_kit",
            "bench",
            "step",
            "--device",
            "cpu",
            "--model",
            "tiny-llama",
            "--seq-len",
            "48:1,32:1",
            "--prompt-len",
            "16",
            "--rows",
            "ours",
            "--until-ok",
            "--out-dir",
            str(tmp_path),
            "--tag",
            "untilok",
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": str(repo_root)},
    )
    assert r.returncode == 0, r.stderr[-2000:]
    rows = [json.loads(line) for line in (tmp_path / "data" / "step.jsonl").read_text().splitlines()]
    assert [(r["shape"].split()[1], r["figures"]["status"]) for r in rows] == [("seq_len=48", "ok")]


def test_resume_help_names_every_setting_a_resume_may_change():
    """`train --help` lists what `--resume` accepts with `--set`: the same names as the resume policy."""
    import re as _re

    from grpo_kit.app.cli import build_parser
    from grpo_kit.app.resume_policy import SAFE_RESUME_OVERRIDES

    train = build_parser()._subparsers._group_actions[0].choices["train"]
    text = " ".join(next(a.help for a in train._actions if "--resume" in a.option_strings).split())
    listed = _re.search(r"--set only for ([^)]*)\)", text).group(1).split(", ")
    assert listed == list(SAFE_RESUME_OVERRIDES)
