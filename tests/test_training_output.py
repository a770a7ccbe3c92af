"""What a run prints and keeps: one compact line per step (no raw TRL dict), TRL's full dict in metrics.csv,
rounded summary numbers; reward functions given as Python callables and as ``module:function`` strings."""

import csv
import json
import re
import subprocess
import sys

from grpo_kit.app.config import GRPOKitConfig
from grpo_kit.tasks.rewards import completion_text

CALLS: list[int] = []


def length_bonus(prompts, completions, **kwargs):
    """A user's reward: longer completions score more (a callable from the trainer API / a notebook)."""
    CALLS.append(len(completions))
    return [len(completion_text(c)) / 100 for c in completions]


def test_two_steps_compact_lines_callable_and_module_rewards(tmp_path, capsys):
    from grpo_kit.app.run import train

    cfg = GRPOKitConfig(
        model="tiny-llama",
        max_steps=2,
        num_train_samples=16,
        num_eval_samples=2,
        max_completion_length=6,
        num_generations=4,
        per_device_train_batch_size=4,
        save_steps=0,
        output_dir=str(tmp_path / "run"),
        reward_funcs=[length_bonus, "grpo_kit.tasks.rewards:format_strict_reward"],
    )
    summary = train(cfg)
    out = capsys.readouterr().out
    lines = [line for line in out.splitlines() if line.startswith("step ")]
    assert len(lines) == 2, out[-3000:]
    pattern = (
        r"step {n}/2 \| reward -?\d+\.\d{{3}}±\d+\.\d{{3}} \| length_bonus \d+\.\d{{3}} format_strict "
        r"\d+\.\d{{3}} \| no-signal groups \d+% \| kl -?\d+\.\d{{4}} \| len \d+\.\d \| \d+\.\d\d s/step \| "
        r"peak \d+\.\d\d GiB"
    )
    for n, line in enumerate(lines, 1):
        assert re.fullmatch(pattern.format(n=n), line), line
    assert "'loss'" not in out and "{'" not in out  # TRL's raw dict is not printed
    assert CALLS and all(n == 4 for n in CALLS)  # the callable scored every generation batch

    run = tmp_path / "run"
    with (run / "metrics.csv").open() as fh:
        rows = list(csv.DictReader(fh))
    assert [r["step"] for r in rows] == ["1", "2"]
    for key in (
        "rewards/length_bonus/mean",
        "rewards/format_strict_reward/std",
        "entropy",
        "completions/clipped_ratio",
        "num_tokens",
    ):  # TRL's full dict
        assert key in rows[0], key
    assert float(rows[0]["rewards/length_bonus/mean"]) > 0
    saved = json.loads((run / "summary.json").read_text())
    assert saved == summary
    # the kit's generation, timed per call (metrics.csv) and over the run (its share of the training time)
    gen = saved["generation"]
    assert all(float(r["generation/seconds"]) > 0 for r in rows)
    assert 0 < gen["generation_seconds"] <= saved["train_seconds"] and 0 < gen["generation_share_of_training"] < 1
    for key in ("mean_step_time_s", "peak_memory_gib"):
        assert len(repr(saved[key]).split(".")[1]) <= 4, saved[key]
    assert (
        "- test_training_output:length_bonus\n- grpo_kit.tasks.rewards:format_strict_reward"
        in (run / "config.yaml").read_text()
    )


def test_reward_import_errors_are_one_clear_line(repo_root, tmp_path):
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "grpo_kit",
            "train",
            "--set",
            "reward_funcs=[correctness,no_such_rewards_mod:score,grpo_kit.tasks.rewards:nothing_here]",
            "--output-dir",
            str(tmp_path / "r"),
        ],
        cwd=repo_root,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert "cannot import module 'no_such_rewards_mod' (ModuleNotFoundError" in r.stderr
    assert "module 'grpo_kit.tasks.rewards' has no attribute 'nothing_here'" in r.stderr
    assert not (tmp_path / "r").exists()


def test_the_recorded_reward_is_wrapped_once(tmp_path):
    """The trainer wraps each reward once (the config's reward_errors and time limit); the sample recorder sees
    the first function's checked scores through on_rewards instead of wrapping it again."""
    import json

    from grpo_kit.app.metrics import SampleRecorder
    from grpo_kit.tasks.rewards import correctness_reward, format_soft_reward
    from grpo_kit.trainer.grpo_trainer import _checked

    rec = SampleRecorder(tmp_path / "samples.jsonl")
    funcs = _checked([correctness_reward, format_soft_reward], "zero", on_rewards=rec.record)
    assert [f.__name__ for f in funcs] == ["correctness_reward", "format_soft_reward"]
    for f in funcs:
        f([[{"role": "user", "content": "1+2"}]], ["Answer: 3"], answer=["3"])
    rows = [json.loads(line) for line in (tmp_path / "samples.jsonl").read_text().splitlines()]
    assert rows == [{"step": 0, "prompt": "1+2", "completion": "Answer: 3", "answer": "3", "correctness_reward": 1.0}]
