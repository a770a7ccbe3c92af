"""Experiment tracking as TRL users have it: ``report_to`` from YAML, ``--set`` and notebook parameters reaches
TRL; a 2-step run writes TensorBoard event files into the run folder with TRL's and the kit's own metrics; a
tracker that is not installed is refused at the edge with its install command."""

import csv
import importlib.util
import os
import subprocess
import sys

import pytest
import torch

from grpo_kit.app import config_checks as config_module
from grpo_kit.app.config import ConfigError, GRPOKitConfig


@pytest.mark.parametrize(
    "override,expected",
    [
        ("report_to=[tensorboard,wandb]", ["tensorboard", "wandb"]),
        ("report_to=tensorboard, wandb", ["tensorboard", "wandb"]),
        ('report_to=["trackio"]', ["trackio"]),
        ("report_to=tensorboard", ["tensorboard"]),
        ("report_to=[tensorboard,tensorboard]", ["tensorboard"]),
        ("report_to=none", "none"),
        ("report_to=null", "none"),
        ("report_to=", "none"),
        ("report_to=[none]", "none"),
        ("report_to=all", "all"),
    ],
)
def test_set_parses_report_to(override, expected):
    assert GRPOKitConfig().apply_overrides([override]).report_to == expected


def test_yaml_notebook_and_saved_config_keep_the_list(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("report_to:\n  - tensorboard\n  - trackio\nrun_name: first-try\n")
    cfg = GRPOKitConfig.from_yaml(path)
    assert (cfg.report_to, cfg.run_name) == (["tensorboard", "trackio"], "first-try")
    cfg.save(tmp_path / "saved.yaml")
    assert GRPOKitConfig.from_yaml(tmp_path / "saved.yaml").report_to == ["tensorboard", "trackio"]
    # a notebook's parameters cell (papermill injects strings as they are)
    assert GRPOKitConfig.from_dict({"report_to": "tensorboard,wandb"}).report_to == ["tensorboard", "wandb"]
    assert GRPOKitConfig().report_to == "none"  # TRL's default: no tracker


def test_report_to_reaches_trl():
    from grpo_kit.app.run import grpo_args

    cfg = GRPOKitConfig().apply_overrides(["report_to=tensorboard", "run_name=r1"]).validate()
    args = grpo_args(cfg, "cpu", torch.float32)
    assert (args.report_to, args.run_name) == (["tensorboard"], "r1")
    assert grpo_args(GRPOKitConfig(), "cpu", torch.float32).report_to == []  # "none", as TRL reads it


@pytest.mark.parametrize(
    "value,match",
    [
        ("mlflow", r"'mlflow' is not a tracker the kit passes on; choose from \['tensorboard', 'wandb', 'trackio'\]"),
        ("[none,tensorboard]", r"'none' is not a tracker the kit passes on.*'none' or 'all' alone"),
        ("[1,2]", r"report_to=\[1, 2\] is not allowed"),
    ],
)
def test_unknown_trackers_are_refused(value, match):
    with pytest.raises(ConfigError, match=match):
        GRPOKitConfig().apply_overrides([f"report_to={value}"]).validate()


def test_a_missing_tracker_is_refused_with_its_install_command(monkeypatch, tmp_path):
    from grpo_kit.app.run import train

    monkeypatch.setattr(config_module, "tracker_installed", lambda name: name != "tensorboard")
    cfg = GRPOKitConfig(model="tiny-llama", output_dir=str(tmp_path / "run")).apply_overrides(
        ["report_to=[wandb,tensorboard]"]
    )
    with pytest.raises(ConfigError) as e:
        train(cfg)  # refused by validate(), before the run folder or any model
    assert str(e.value).count("\n  - ") == 1, e.value  # one message, for the one missing tracker
    assert "tensorboard is not installed; install it with `python -m pip install tensorboard`" in str(e.value)
    assert not (tmp_path / "run").exists()


def test_the_availability_check_follows_transformers():
    from transformers.integrations import is_tensorboard_available, is_trackio_available

    assert config_module.tracker_installed("tensorboard") == is_tensorboard_available()
    assert config_module.tracker_installed("trackio") == is_trackio_available()
    assert config_module.tracker_installed("wandb") == (importlib.util.find_spec("wandb") is not None)


@pytest.mark.skipif(importlib.util.find_spec("wandb") is not None, reason="wandb is installed here")
def test_cli_refuses_a_missing_tracker_before_loading(tmp_path, repo_root):
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "grpo_kit",
            "train",
            "--set",
            "model=tiny-llama",
            "--set",
            "report_to=wandb",
            "--output-dir",
            str(tmp_path / "run"),
        ],
        cwd=repo_root,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode != 0
    assert "wandb is not installed; install it with `python -m pip install wandb`" in r.stdout + r.stderr
    assert "held-out accuracy" not in r.stdout and not (tmp_path / "run").exists()


def test_two_step_run_writes_tensorboard_scalars(tmp_path):
    pytest.importorskip("tensorboard", reason="report_to=tensorboard needs it (requirements-test.txt pins it)")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from grpo_kit.app.metrics import KIT_LOGGED_METRICS
    from grpo_kit.app.run import train

    run = tmp_path / "run"
    cfg = GRPOKitConfig(
        model="tiny-llama",
        max_steps=2,
        num_train_samples=16,
        num_eval_samples=0,
        max_completion_length=6,
        num_generations=4,
        per_device_train_batch_size=4,
        save_steps=0,
        generation_backend="hf",
        output_dir=str(run),
    ).apply_overrides(["report_to=tensorboard"])
    train(cfg, progress=False)
    events = EventAccumulator(str(run / "tensorboard"))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    wanted = {
        "train/reward",
        "train/loss",
        "train/frac_reward_zero_std",
        "train/rewards/correctness_reward/mean",
        "train/generation/seconds",
        *(f"train/{k}" for k in KIT_LOGGED_METRICS),
    }
    assert wanted <= tags, sorted(tags)
    with (run / "metrics.csv").open() as fh:
        rows = list(csv.DictReader(fh))
    for key in ("peak_memory_gib", "step_time_s", "reward_mean"):  # the same numbers as metrics.csv
        tag = "train/reward" if key == "reward_mean" else f"train/{key}"
        scalars = events.Scalars(tag)
        assert [s.step for s in scalars] == [1, 2]
        assert [s.value for s in scalars] == pytest.approx([float(r[key]) for r in rows], rel=1e-6)
    # metrics.csv keeps its columns: the added keys are not repeated as TRL's
    assert list(rows[0]).count("peak_memory_gib") == 1 and list(rows[0]).count("step_time_s") == 1


def test_a_resumed_run_may_change_its_trackers(tmp_path):
    from grpo_kit.app.resume_policy import resume_config

    GRPOKitConfig(model="tiny-llama", output_dir=str(tmp_path)).save(tmp_path / "config.yaml")
    cfg = resume_config(tmp_path, ["report_to=tensorboard", "run_name=again"])
    assert (cfg.report_to, cfg.run_name) == (["tensorboard"], "again")


@pytest.mark.parametrize("name", ["03_qwen2.5_grpo", "04_llama3.1_grpo_long_context"])
def test_the_notebooks_pass_report_to(name, repo_root, tmp_path, monkeypatch):
    """A notebook's ``report_to`` parameter reaches the config: an unknown tracker stops its validation cell."""
    import papermill as pm

    monkeypatch.setenv("PYTHONPATH", str(repo_root) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    with pytest.raises(pm.PapermillExecutionError) as err:
        pm.execute_notebook(
            str(repo_root / "notebooks" / f"{name}.ipynb"),
            str(tmp_path / "out.ipynb"),
            parameters={"report_to": "mlflow", "setup": "fallback"},
            kernel_name="python3",
            progress_bar=False,
            cwd=str(tmp_path),
        )
    assert "'mlflow' is not a tracker the kit passes on" in str(err.value)
