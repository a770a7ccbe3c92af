"""LiveDashboard (grpo_kit.notebook.dashboard) and the notebook helpers (grpo_kit.notebook.helpers)."""

from __future__ import annotations

import json
import math
from types import SimpleNamespace

import matplotlib

matplotlib.use("Agg")
import pytest
import torch

from grpo_kit.app.config import ConfigError
from grpo_kit.loss.advantage import group_advantages
from grpo_kit.notebook.dashboard import PANELS, LiveDashboard, read_samples, samples_html, widget_frontend_available
from grpo_kit.notebook.helpers import exact_kl, in_colab, kl_estimates, notebook_setup, validate_params

TRL_LOG = {
    "loss": 0.5,
    "reward": 0.25,
    "reward_std": 0.1,
    "kl": 0.002,
    "completions/mean_length": 7.5,
    "learning_rate": 1e-4,
}


def _state(step):
    return SimpleNamespace(global_step=step, is_world_process_zero=True)


def test_on_log_records_trl_keys_and_memory(tmp_path):
    dash = LiveDashboard(mode="static", display=False)
    args = SimpleNamespace(output_dir=str(tmp_path))
    dash.on_train_begin(args, _state(0), None)
    dash.on_log(args, _state(1), None, logs=dict(TRL_LOG))
    dash.on_log(args, _state(2), None, logs=dict(TRL_LOG, reward=0.75))
    dash.on_log(args, _state(2), None, logs={"train_runtime": 3.0, "train_loss": 0.4})  # end summary: ignored
    assert [r["step"] for r in dash.history] == [1, 2]
    row = dash.history[1]
    assert row["reward_mean"] == 0.75 and row["reward_std"] == 0.1 and row["kl"] == 0.002
    assert row["completion_length"] == 7.5 and row["loss"] == 0.5
    assert row["cpu_rss_gib"] > 0
    assert dash.samples_path == tmp_path / "samples.jsonl"


def test_figure_has_one_panel_per_metric_with_the_data():
    dash = LiveDashboard(mode="static", display=False)
    for step, r in enumerate([0.0, 0.5, 1.0], start=1):
        dash.record(step, dict(TRL_LOG, reward=r))
    fig = dash.figure()
    assert len(fig.axes) == len(PANELS)
    ydata = list(fig.axes[0].lines[0].get_ydata())
    assert ydata == [0.0, 0.5, 1.0]
    assert fig.axes[-1].get_legend() is not None  # memory panel has the CPU RSS line
    matplotlib.pyplot.close(fig)


def test_missing_metric_is_nan_not_an_error():
    dash = LiveDashboard(mode="static", display=False)
    dash.record(1, {"reward": 0.5})  # beta = 0: TRL logs no kl
    fig = dash.figure()
    kl_axis = fig.axes[[k for k, _ in PANELS].index("kl")]
    assert math.isnan(kl_axis.lines[0].get_ydata()[0])
    matplotlib.pyplot.close(fig)


def test_samples_table_reads_the_last_records_and_escapes(tmp_path):
    p = tmp_path / "samples.jsonl"
    rows = [
        {"step": i, "prompt": f"q{i}", "completion": "<b>7</b>", "answer": "7", "correctness_reward": 1.0}
        for i in range(10)
    ]
    p.write_text("\n".join(json.dumps(r) for r in rows) + '\n{"step": 10, "pro')  # partial last line
    got = read_samples(p, 3)
    assert [r["step"] for r in got] == [8, 9]
    html = samples_html(got)
    assert "&lt;b&gt;7&lt;/b&gt;" in html and "<b>7</b>" not in html
    assert "correctness_reward" in html
    assert read_samples(tmp_path / "absent.jsonl") == []
    assert "no samples" in samples_html([])


def test_static_mode_shows_once_at_train_end(monkeypatch, tmp_path):
    shown = []
    monkeypatch.setattr("IPython.display.display", lambda obj: shown.append(type(obj).__name__))
    dash = LiveDashboard(mode="static")
    args = SimpleNamespace(output_dir=str(tmp_path))
    dash.on_train_begin(args, _state(0), None)
    dash.on_log(args, _state(1), None, logs=dict(TRL_LOG))
    assert shown == []
    dash.on_train_end(args, _state(1), None)
    assert shown == ["Figure", "HTML"]


def test_headless_has_no_widget_frontend(monkeypatch):
    monkeypatch.setenv("GRPO_KIT_STATIC_DASHBOARD", "1")
    assert widget_frontend_available() is False
    assert LiveDashboard(mode="auto").widgets is False


@pytest.mark.parametrize("kw, msg", [({"mode": "live"}, "mode='live'"), ({"num_samples": -1}, "num_samples")])
def test_dashboard_bad_arguments(kw, msg):
    with pytest.raises(ValueError, match=msg):
        LiveDashboard(**kw)


# ---------------------------------------------------------------- notebook_utils
def test_validate_params_errors_name_the_parameter():
    cfg = validate_params({"model": "tiny-llama", "max_steps": 2})
    assert cfg.max_steps == 2
    with pytest.raises(ConfigError, match="max_steps='two' has the wrong type"):
        validate_params({"max_steps": "two"})
    with pytest.raises(ConfigError, match="model='nope' is not a built-in name"):
        validate_params({"model": "nope"})
    with pytest.raises(ValueError, match="context_length='20K' has the wrong type: expected int"):
        validate_params({}, {"context_length": "20K"}, {"context_length": int})
    with pytest.raises(ValueError, match="four_bit=1 has the wrong type: expected bool"):
        validate_params({}, {"four_bit": 1}, {"four_bit": bool})
    with pytest.raises(ValueError, match="no declared type"):
        validate_params({}, {"x": 1}, {})
    validate_params({}, {"gpu_gib": 80}, {"gpu_gib": float})  # an int is a fine float


def test_not_in_colab():
    assert in_colab() is False


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU's choice")
def test_notebook_setup_is_one_call_that_says_what_it_chose(capsys):
    from transformers.utils import logging as hf_logging

    full = dict(model="Qwen/Qwen2.5-1.5B-Instruct", task="gsm8k", max_steps=100)
    fallback = dict(model="smollm2-135m-instruct", task="arithmetic", max_steps=40, max_completion_length=24)
    hf_logging.enable_progress_bar()
    run = notebook_setup(full, fallback)
    assert (run.name, run.device, run.dtype, run.config.model) == (
        "fallback",
        "cpu",
        torch.float32,
        "smollm2-135m-instruct",
    )
    assert not hf_logging.is_progress_bar_enabled()  # the quiet console came first
    line = capsys.readouterr().out.strip()
    assert line == run.line() and line.startswith("setup: fallback (torch sees no CUDA GPU")
    assert (
        "smollm2-135m-instruct, task arithmetic, 40 steps of 8 completions up to 24 tokens, on cpu in float32" in line
    )
    forced = notebook_setup(full, fallback, setup="full", show=False)
    assert (forced.name, forced.reason, forced.config.task) == ("full", "", "gsm8k")
    assert capsys.readouterr().out == ""
    # both settings are checked before either is chosen, and the notebook's own parameters by their types
    with pytest.raises(ConfigError, match="max_steps"):
        notebook_setup(full, dict(fallback, max_steps="many"), setup="full")
    with pytest.raises(ValueError, match="dashboard=3 has the wrong type"):
        notebook_setup(full, fallback, extras={"dashboard": 3}, extra_types={"dashboard": str})
    with pytest.raises(ValueError, match="setup='gpu' is not allowed"):
        notebook_setup(full, fallback, setup="gpu")
    # what only a GPU can run joins the full setup where it is chosen, and is checked only there
    gpu_only = dict(load_in_4bit=True, generation_backend="hf")
    assert notebook_setup(full, fallback, full_on_gpu=gpu_only, show=False).name == "fallback"
    with pytest.raises(ConfigError, match="load_in_4bit=True needs a CUDA GPU"):
        notebook_setup(full, fallback, setup="full", full_on_gpu=gpu_only, show=False)


def test_notebook_setup_quiets_the_console_before_its_imports_warn(repo_root):
    """In a fresh process (a notebook's kernel): importing the run's code imports peft, whose bitsandbytes says it
    has no CPU 4-bit kernel; the setup call quiets the console before that import, so nothing reaches stderr."""
    import subprocess
    import sys

    code = (
        "from grpo_kit.notebook.helpers import notebook_setup\n"
        "notebook_setup(dict(model='tiny-llama'), dict(model='tiny-llama'), setup='fallback')"
    )
    r = subprocess.run([sys.executable, "-c", code], cwd=repo_root, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.startswith("setup: fallback"), r.stderr[-2000:]
    assert "gemm_4bit" not in r.stderr + r.stdout and "note:" not in r.stdout, r.stderr[-2000:]


def test_notebook_setup_says_why_it_falls_back(monkeypatch, capsys):
    import grpo_kit.notebook.helpers as nu
    from grpo_kit.generation import vllm_backend
    from grpo_kit.model import cuda_driver

    # device cpu in both: the choice is under test here, not the device's dtype
    full = dict(model="Qwen/Qwen2.5-1.5B-Instruct", task="gsm8k", device="cpu")
    fallback = dict(model="smollm2-135m-instruct", task="arithmetic", device="cpu")
    # a T4 whose driver is too old for vLLM's CUDA build: no vLLM, so a setup that needs it falls back, saying why
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(nu.importlib.util, "find_spec", lambda name: None if name == "vllm" else object())
    monkeypatch.setattr(vllm_backend, "gpu_name", lambda: "Tesla T4")
    monkeypatch.setattr(vllm_backend, "driver_version", lambda: "550.54.15")
    monkeypatch.setattr(nu, "online", lambda: True)
    assert notebook_setup(full, fallback, need_packages=("vllm",)).name == "fallback"
    out = capsys.readouterr().out
    assert "setup: fallback (vllm is not installed (vLLM's CUDA build" in out and "550.54.15" in out
    # the same machine with a setup that generates with HF (notebook 04's free-T4 preset): the full setup
    assert notebook_setup(full, fallback, need_packages=(), show=False).name == "full"
    monkeypatch.setattr(nu, "online", lambda: False)
    assert notebook_setup(full, fallback).name == "fallback"
    assert "the model hub is not reachable" in capsys.readouterr().out
    # no GPU torch can use, and the driver is why
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.setattr(cuda_driver, "gpu_name", lambda: "Tesla T4")
    monkeypatch.setattr(cuda_driver, "driver_version", lambda: "550.54.15")
    assert nu.full_setup_blockers() == [
        "torch sees no CUDA GPU (the GPU Tesla T4 is present but this torch is built "
        "for CUDA 13.0, which needs an NVIDIA driver >= 580; the driver is 550.54.15 "
        "(it runs CUDA 12 builds). Install a torch built for a CUDA the driver runs "
        "(pip install 'torch>=2.6,<2.11': PyPI's CUDA 12 builds), or update the "
        "driver)"
    ]


def test_group_advantages_match_trl_formula():
    r = torch.tensor([1.0, 0.0, 0.0, 0.0, 2.0, 2.0, 2.0, 2.0])
    adv = group_advantages(r, 4)
    assert torch.allclose(adv[:4], torch.tensor([0.75, -0.25, -0.25, -0.25]) / (0.5 + 1e-4))
    assert torch.equal(adv[4:], torch.zeros(4))  # equal rewards: no signal
    assert torch.allclose(group_advantages(r, 4, "none")[:4], torch.tensor([0.75, -0.25, -0.25, -0.25]))
    assert torch.allclose(
        group_advantages(r, 4, "batch"), (r - r.view(2, 4).mean(1).repeat_interleave(4)) / (r.std() + 1e-4)
    )
    with pytest.raises(ValueError, match="divisible by num_generations=3"):
        group_advantages(r, 3)
    with pytest.raises(ValueError, match="scale='max'"):
        group_advantages(r, 4, "max")


def test_k3_is_nonnegative_and_unbiased_for_reverse_kl():
    g = torch.Generator().manual_seed(0)
    p, q = torch.randn(20, generator=g, dtype=torch.float64), torch.randn(20, generator=g, dtype=torch.float64)
    tokens = torch.multinomial(p.softmax(-1), 400_000, replacement=True, generator=g)
    est = kl_estimates(p.log_softmax(-1)[tokens], q.log_softmax(-1)[tokens])
    exact = exact_kl(p, q).item()
    assert est["k3"].min() >= 0 and est["k1"].min() < 0
    assert abs(est["k3"].mean().item() - exact) < 0.02 * exact + 0.01
    assert abs(est["k1"].mean().item() - exact) < 0.05 * exact + 0.01
    assert exact_kl(p, p).abs().item() < 1e-12


def test_widget_mode_redraws_every_step(monkeypatch, tmp_path):
    pytest.importorskip("ipywidgets")
    shown = []
    monkeypatch.setattr("IPython.display.display", lambda obj: shown.append(type(obj).__name__))
    (tmp_path / "samples.jsonl").write_text(
        json.dumps({"step": 0, "prompt": "1+1", "completion": "Answer: 2", "answer": "2", "correctness_reward": 1.0})
        + "\n"
    )
    dash = LiveDashboard(mode="widgets")
    args = SimpleNamespace(output_dir=str(tmp_path))
    dash.on_train_begin(args, _state(0), None)
    assert shown == ["VBox"]
    for step in (1, 2):
        dash.on_log(args, _state(step), None, logs=dict(TRL_LOG))
    assert shown.count("Figure") == 2  # one redraw per logged step, inside the Output widget
    assert "Answer: 2" in dash._table.value
    dash.on_train_end(args, _state(2), None)
    assert shown[-2:] == ["Figure", "HTML"]  # the final static record (what papermill keeps)


def test_two_rows_labelled_axes_per_reward_and_no_signal_panels():
    dash = LiveDashboard(mode="static", display=False)
    for step, z in enumerate([1.0, 0.5], start=1):
        dash.record(
            step,
            dict(
                TRL_LOG,
                frac_reward_zero_std=z,
                **{"rewards/correctness_reward/mean": 0.1 * step, "rewards/format_soft_reward/mean": 0.2},
            ),
        )
    fig = dash.figure()
    keys = [k for k, _ in PANELS]
    assert len({ax.get_subplotspec().rowspan.start for ax in fig.axes}) == 2
    assert all(ax.get_ylabel() for ax in fig.axes)
    per_reward = fig.axes[keys.index("rewards")]
    assert [t.get_text() for t in per_reward.get_legend().get_texts()] == ["correctness", "format_soft"]
    assert list(per_reward.lines[0].get_ydata()) == [0.1, 0.2]
    assert list(fig.axes[keys.index("frac_reward_zero_std")].lines[0].get_ydata()) == [1.0, 0.5]
    matplotlib.pyplot.close(fig)
