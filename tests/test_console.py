"""The quiet console (issue 36 item 2): what a run prints by default, the kit's line for each known third-party
warning, vLLM's false reload alarms dropped, the plan and closing table; and the CPU engine's KV cache from the
calculator (item 5). The end-to-end test runs the embedded model for 2 steps with vLLM on the CPU in a
subprocess and reads everything it printed."""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import re
import subprocess
import sys
import warnings
from collections import Counter

import pytest
import torch
from safetensors.torch import load_file

from grpo_kit.app import console
from grpo_kit.app.config import GRPOKitConfig
from grpo_kit.generation import vllm_backend
from grpo_kit.generation.plan import CPU_BLOCK_TOKENS, cpu_kv_cache
from grpo_kit.model.loading import embedded_model_dir, embedded_model_dir_as, model_config

needs_vllm = pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed")


@pytest.fixture
def quiet():
    """The console as a default run sets it; verbose off again after the test."""
    console.quiet_console(False)
    yield
    console.quiet_console(False)


def test_known_python_warning_becomes_the_kits_line_once(quiet, capsys):
    text = "TRL currently supports vLLM versions from 0.22.0 to 0.31.0. You have version 0.32.0 installed."
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        console.warn_once_per_message()
        for _ in range(3):
            warnings.warn(text, UserWarning)
    out, err = capsys.readouterr()
    assert "TRL currently supports" not in err + out
    # the kit's line on stdout with its other lines: a notebook shows no stderr box for it
    assert out.count("note: TRL says the installed vLLM") == 1 and console.VERBOSE_HINT in out and not err


def _record(logger: logging.Logger, text: str) -> logging.LogRecord:
    return logger.makeRecord(logger.name, logging.WARNING, __file__, 1, text, (), None)


def test_verbose_shows_the_original(recwarn):
    logger = logging.getLogger("transformers.training_args")
    known = "torch.distributed process group is initialized, but parallel_mode != ParallelMode.DISTRIBUTED."
    console.quiet_console(True)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            console.warn_once_per_message()  # inside: pytest records warnings around each test
            warnings.warn("`torch.distributed.reduce_op` is deprecated, verbose test", FutureWarning)
        assert logger.filter(_record(logger, known))  # passed on to the library's handler
    finally:
        console.quiet_console(False)
    assert any("verbose test" in str(w.message) for w in recwarn)  # handed on as it is, to pytest's recorder here


def test_known_log_line_becomes_the_kits_line(quiet, capsys):
    logger = logging.getLogger("transformers.training_args")
    known = "torch.distributed process group is initialized, but parallel_mode != ParallelMode.DISTRIBUTED. In order"
    assert not logger.filter(_record(logger, known)) and not logger.filter(_record(logger, known))
    assert logger.filter(_record(logger, "another transformers warning"))  # stays
    assert capsys.readouterr().out.count("note: transformers sees a torch.distributed group") <= 1


def test_irrelevant_warning_dropped_without_a_line(quiet, capsys):
    """bitsandbytes' missing CPU 4-bit kernel (said when peft is imported): the kit runs 4-bit on CUDA only."""
    logger = logging.getLogger("bitsandbytes.backends.cpu.ops")
    assert not logger.filter(_record(logger, "Failed to load CPU gemm_4bit_forward from kernels-community: x"))
    assert logger.filter(_record(logger, "another bitsandbytes warning"))
    assert capsys.readouterr() == ("", "")


def test_vllm_log_level_follows_verbose(monkeypatch):
    monkeypatch.delenv("VLLM_LOGGING_LEVEL", raising=False)
    monkeypatch.setitem(console._STATE, "set_vllm_env", False)
    console.quiet_console(False)
    assert logging.getLogger(vllm_backend.VLLM_LOGGER).getEffectiveLevel() == logging.ERROR
    console.quiet_console(True)
    assert logging.getLogger(vllm_backend.VLLM_LOGGER).getEffectiveLevel() == logging.INFO
    console.quiet_console(False)
    monkeypatch.setenv("VLLM_LOGGING_LEVEL", "DEBUG")  # the user's own setting stays
    monkeypatch.setitem(console._STATE, "set_vllm_env", False)
    console.quiet_console(False)
    assert os.environ["VLLM_LOGGING_LEVEL"] == "DEBUG"


def test_native_stderr_lines_dropped_others_kept(capfd):
    """vLLM's CPU worker prints its memory binding from C++ straight to fd 2 at every engine start, below any
    logger: held back and dropped there, while another native line, and Python's own stderr, still come out."""
    with vllm_backend.native_stderr_without(vllm_backend.ENGINE_START_NOISE):
        os.write(2, b"[W1207 utils.cpp:68] Warning: NUMA binding: Using MEMBIND policy for memory allocation\n")
        os.write(2, b"[W1207] Warning: a real native warning\n")
    with pytest.raises(RuntimeError), vllm_backend.native_stderr_without(("never",)):
        os.write(2, b"said before a failure\n")
        raise RuntimeError("engine start failed")
    err = capfd.readouterr().err
    assert "NUMA binding" not in err and "a real native warning" in err and "said before a failure" in err
    with vllm_backend.native_stderr_without(()):  # verbose: nothing held
        os.write(2, b"NUMA binding: Using MEMBIND policy\n")
    assert "NUMA binding" in capfd.readouterr().err


def test_transformers_bars_follow_the_console():
    from transformers.utils import logging as hf_logging

    console.quiet_console(True)
    assert hf_logging.is_progress_bar_enabled()
    console.quiet_console(False)
    assert not hf_logging.is_progress_bar_enabled()  # its "Loading weights" bar is not the kit's line


@pytest.mark.parametrize("tied", [False, True])
def test_reload_false_alarms_dropped_real_ones_kept(tied):
    logger = logging.getLogger(vllm_backend._RELOAD_LOGGER)
    saved = list(logger.filters)
    logger.filters = []
    try:
        vllm_backend._drop_reload_false_alarms(tied)

        def record(layer):
            return logger.makeRecord(
                logger.name, logging.WARNING, __file__, 1, "%s: Failed to load weights", (layer,), None
            )

        assert not logger.filter(record("RotaryEmbedding"))
        assert logger.filter(record("ParallelLMHead")) is not tied  # the head is the embedding's only when tied
        assert logger.filter(record("QKVParallelLinear"))  # a real failure stays
    finally:
        logger.filters = saved


def test_plan_and_closing_lines(tmp_path):
    cfg = GRPOKitConfig()
    info = {
        "backend": "vllm",
        "weights": "separate copy (not on CUDA)",
        "memory_plan": {"kv_cache_gib": 0.176, "kv_cache_dtype": "auto", "kv_source": "calculator (16 sequences)"},
    }
    lines = console.plan_lines(cfg, device="cpu", dtype=torch.float32, info=info)
    assert lines[0].startswith(f"plan: {cfg.model} on cpu in float32, LoRA r={cfg.lora_rank}")
    assert "generation: vllm, weights separate copy" in lines[1]
    assert "KV cache 0.18 GiB" in lines[2] and "calculator" in lines[2]
    assert "--verbose" in lines[-1]
    (tmp_path / "metrics.csv").write_text("")
    (tmp_path / "adapter").mkdir()
    (tmp_path / "checkpoint-2").mkdir()
    summary = {
        "run_dir": str(tmp_path),
        "steps": 2,
        "accuracy_before": 0.07,
        "accuracy_after": 0.5,
        "train_seconds": 10.0,
        "mean_step_time_s": 5.0,
        "total_seconds": 30.0,
        "peak_memory_gib": 1.5,
        "device": "cpu",
    }
    table = "\n".join(console.closing_lines(summary))
    assert "held-out accuracy: 0.070 -> 0.500" in table and "steps: 2 (10.0 s training, 5.00 s/step" in table
    assert "peak memory: 1.50 GiB (process RSS)" in table
    assert "files: adapter/, metrics.csv, 1 checkpoint(s)" in table


def test_cpu_kv_cache_is_one_steps_sequences():
    """The default run: 16 sequences of up to 256 + 24 tokens, at the prompt length that takes the most 128-token
    blocks (one that leaves 122 tokens in its last block: 4 blocks with the slack one), K and V of 30 layers x
    3 KV heads x 64 in bf16. About 0.18 GiB where vLLM's CPU default took 4."""
    cfg = GRPOKitConfig()
    assert (
        cfg.per_device_train_batch_size * cfg.gradient_accumulation_steps,
        cfg.max_prompt_length,
        cfg.max_completion_length,
    ) == (16, 256, 24)
    kv = cpu_kv_cache(cfg, model_config(cfg.model)) if importlib.util.find_spec("vllm") else None
    if kv is None:
        pytest.skip("vllm is not installed (the engine's dtype is vLLM's choice)")
    assert kv["rows"] == 16 and kv["tokens"] == 16 * 4 * CPU_BLOCK_TOKENS
    assert kv["bytes"] == 2 * 30 * kv["tokens"] * 3 * 64 * 2 and kv["bytes"] < 0.2 * 2**30


def test_embedded_export_in_the_engines_dtype():
    bf16 = embedded_model_dir_as(torch.bfloat16)
    assert embedded_model_dir_as(torch.float32) == embedded_model_dir()
    assert '"dtype": "bfloat16"' in (bf16 / "config.json").read_text()
    assert (bf16 / "tokenizer.json").is_file()
    full, half = load_file(embedded_model_dir() / "model.safetensors"), load_file(bf16 / "model.safetensors")
    assert full.keys() == half.keys()
    assert all(half[k].dtype == torch.bfloat16 and torch.equal(half[k], full[k].to(torch.bfloat16)) for k in full)


# What the quiet console must not print: vLLM's own log lines (its INFO, and any of its records), vLLM's false
# reload alarms, a per-weight dtype cast warning.
_VLLM_LINE = re.compile(r"^\(\w+ pid=\d+\) (INFO|WARNING|DEBUG) |^INFO \d\d-\d\d ")
_WARNING_LINE = re.compile(r"warning|note:", re.IGNORECASE)


@needs_vllm
def test_default_run_console(repo_root, tmp_path):
    """2 steps of the embedded model with vLLM on the CPU (small eval): the plan, the held-out accuracy, the step
    lines and the closing table; no vLLM INFO line, no 'Failed to load weights', no warning printed twice. The same
    run checks what the default generation_backend=auto recorded (vLLM, its options in summary.json), with the FP8
    KV cache where this CPU's vLLM has one (its documented warning once); bad vLLM options are
    tests/test_generation.py's."""
    fp8 = vllm_backend.cpu_has_fp8_kv()
    cmd = [
        sys.executable,
        "-m",
        "grpo_kit",
        "train",
        "--set",
        "max_steps=2",
        "--set",
        "num_eval_samples=2",
        "--set",
        "max_completion_length=8",
        "--set",
        "num_generations=2",
        "--set",
        "per_device_train_batch_size=2",
        "--set",
        "num_train_samples=8",
        "--set",
        "save_steps=0",
        "--output-dir",
        str(tmp_path / "run"),
        *(["--set", "kv_cache_dtype=fp8"] if fp8 else []),
    ]
    env = {k: v for k, v in os.environ.items() if k != "VLLM_LOGGING_LEVEL"}  # the default, not this shell's
    r = subprocess.run(cmd, cwd=repo_root, capture_output=True, text=True, timeout=900, env=env)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-4000:]
    lines = [ln.strip() for ln in re.split(r"[\r\n]", out) if ln.strip()]
    assert not [ln for ln in lines if _VLLM_LINE.search(ln)], out[-4000:]
    assert "Failed to load weights" not in out and "Attempted to load weight" not in out
    assert "Reloading weights inplace" not in out and "Successfully reset prefix cache" not in out
    assert "NUMA binding" not in out and "Loading weights" not in out  # vLLM's C++ line, transformers' bar
    assert "note:" not in r.stderr  # the kit's notes are its lines, on stdout
    repeated = [ln for ln, n in Counter(ln for ln in lines if _WARNING_LINE.search(ln)).items() if n > 1]
    assert not repeated, repeated
    assert "plan: smollm2-135m-instruct on cpu in float32" in r.stdout and "generation: vllm" in r.stdout
    assert "memory: vLLM's KV cache" in r.stdout and "--verbose" in r.stdout
    assert "held-out accuracy before training" in r.stdout
    assert re.search(r"step 1/2 \|", out) and re.search(r"step 2/2 \|", out)
    for row in ("run folder:", "held-out accuracy:", "steps: 2 (", "peak memory:", "files:"):
        assert row in r.stdout, r.stdout[-3000:]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    # the default run's prompts are short: auto shares none, and the plan and summary say so
    assert "prefix sharing: auto" in r.stdout
    assert summary["prefix_sharing"]["setting"] == "auto" and summary["prefix_sharing"]["shared_rows"] == 0
    gen = summary["generation"]
    assert gen["requested"] == "auto" and gen["backend"] == "vllm" and gen["device"] == "cpu"
    assert gen["weight_syncs"] == 2 and gen["share_weights"] is False
    assert gen["kv_cache_dtype"] == ("fp8" if fp8 else "auto")
    assert out.count("kv_cache_dtype='fp8' on vLLM's CPU backend") == (1 if fp8 else 0)  # the documented warning


def test_the_kits_own_warnings_reach_stdout_not_stderr():
    """A fresh process with no logging set up (a notebook's kernel, the CLI): a tool call that failed in a rollout
    is the kit's line on stdout, so a notebook shows it in the cell's output, not in a stderr box; a process that
    configured logging keeps its handlers (the line goes there, once)."""
    fresh = (
        "import logging\n"
        "from grpo_kit.app.console import quiet_console\n"
        "quiet_console(False)\n"
        "logging.getLogger('grpo_kit.tasks.tools').warning('grpo_kit: tool %r raised ValueError: x', 'calculator')\n"
    )
    r = subprocess.run([sys.executable, "-c", fresh], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "grpo_kit: tool 'calculator' raised ValueError: x" in r.stdout and "raised" not in r.stderr
    configured = "import logging\nlogging.basicConfig(format='user: %(message)s')\n" + fresh
    r = subprocess.run([sys.executable, "-c", configured], capture_output=True, text=True, timeout=300)
    assert r.stderr.count("user: grpo_kit: tool 'calculator' raised") == 1 and "raised" not in r.stdout
