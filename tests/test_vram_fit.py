"""`vram` answers "does it fit" for the kit's own run (the defaults of `python -m grpo_kit train`) or, with
--published-setting, for the published table's: a verdict against --gpu-gib naming what does not fit, and the longest
context that fits; hub ids read their config.json from the local hub cache."""

import dataclasses
import json
import re

import pytest

from grpo_kit.app.config import GRPOKitConfig
from grpo_kit.memory.cli import build_parser, cli_main
from grpo_kit.memory.estimate import EstimateSpec, config_estimate_spec, estimate, estimate_for_config, total_gpu_bytes
from grpo_kit.memory.fit import FREE_T4_GIB, GIB, PRESET_ROUND, fit_verdict, free_t4_preset, longest_fitting_context

KW = dict(num_generations=8, lora_rank=16, method="grpo_kit")


def _spec(context: int, prompt_length: int = 0, **kw) -> EstimateSpec:
    """The step at ``context`` tokens, ``prompt_length`` of them prompt."""
    return EstimateSpec(prompt_length=prompt_length, completion_length=context - prompt_length, **kw)


def test_longest_context_is_the_boundary():
    budget = 15 * GIB
    n = longest_fitting_context("qwen2.5-1.5b", budget, _spec(1024, 256, **KW))
    assert n is not None and n > 1024

    def peak(ctx):
        return total_gpu_bytes(estimate("qwen2.5-1.5b", _spec(ctx, 256, **KW)))

    assert peak(n) <= budget < peak(n + 1)
    v = fit_verdict("qwen2.5-1.5b", 15, _spec(n + 1, 256, num_generations=8, lora_rank=16))
    assert not v.fits and v.max_context == n and "does not fit" in v.text() and f"{n:,} tokens" in v.text()
    heavy = fit_verdict("llama-3.1-8b", 8, _spec(1024, num_generations=8, lora_rank=16))
    assert heavy.max_context is None and "the weights alone take 14.96 GiB" in heavy.text()
    with pytest.raises(ValueError, match="gpu_gib=0 must be > 0"):
        fit_verdict("qwen2.5-1.5b", 0, _spec(1024, num_generations=8))


def test_free_t4_preset_is_the_longest_whole_step_in_4bit_fp16():
    p = free_t4_preset("llama-3.1-8b", num_generations=8, prompt_length=512, lora_rank=16)
    assert p["four_bit"] and p["dtype"] == "fp16" and p["generation_backend"] == "hf" and p["budget_gib"] == FREE_T4_GIB
    ctx = p["context_length"]
    assert ctx % PRESET_ROUND == 0 and p["estimate_gib"] <= FREE_T4_GIB

    t4 = dict(num_generations=8, lora_rank=16, quantization="4bit", dtype="fp16", micro_batch_size=1, vllm=False)

    def peak(c):  # the whole step: HF generate's fp16 KV cache of all 8 completions included
        return total_gpu_bytes(estimate("llama-3.1-8b", _spec(c, 512, include_generation=True, **t4))) / GIB

    assert peak(ctx) <= FREE_T4_GIB < peak(ctx + PRESET_ROUND)
    # generation's KV cache is what limits it: the training step alone fits far longer
    assert (
        longest_fitting_context("llama-3.1-8b", FREE_T4_GIB * GIB, _spec(ctx, 512, include_generation=False, **t4))
        > 4 * ctx
    )
    with pytest.raises(ValueError, match="does not fit"):
        free_t4_preset("llama-3.1-8b", num_generations=512)


def _vram(argv, capsys) -> str:
    """``python -m grpo_kit vram ARGV``'s output (the app layer hands in the kit's default config)."""
    assert cli_main(argv) == 0
    return capsys.readouterr().out


def _verdicts(out: str) -> dict[str, str]:
    """The verdict lines after "Does it fit", by method."""
    lines = out.split("Does it fit", 1)[1].splitlines()[1:]
    return {line.strip().split(":")[0]: line.strip() for line in lines if line.startswith("  ")}


def test_cli_verdict_per_method(capsys):
    out = _vram(["--model", "qwen2.5-1.5b", "--context", "1024", "--method", "all", "--gpu-gib", "15"], capsys)
    assert "Does it fit in 15.00 GiB (--gpu-gib)?" in out
    verdicts = _verdicts(out)
    assert list(verdicts) == ["trl", "unsloth", "grpo_kit"]
    ours = verdicts["grpo_kit"]
    assert ours.startswith("grpo_kit: fits")
    assert int(re.search(r"the longest context that fits is ([\d,]+) tokens", ours)[1].replace(",", "")) > 1024
    with pytest.raises(SystemExit):
        cli_main(["--model", "qwen2.5-1.5b", "--context", "1024", "--gpu-gib", "-1"])


ISSUE_COMMAND = ["--model", "llama-3.1-8b", "--context", "20480", "--generations", "8", "--gpu-gib", "24"]


def test_vram_prices_the_kits_default_run(capsys, monkeypatch):
    """The issue's command answers for `python -m grpo_kit train`'s defaults with that model and context: the same
    peak as estimate_for_config on that config, the same verdict as the run's own fit check (config_fit), and the
    longest context from the same step."""
    import grpo_kit.memory.fit as fit

    monkeypatch.setattr(fit, "detected_gpu_gib", lambda: None)  # the gpu_gib given is the budget on any machine
    out = _vram(ISSUE_COMMAND, capsys)
    default = GRPOKitConfig()
    cfg = dataclasses.replace(default, model="llama-3.1-8b", max_completion_length=20480 - default.max_prompt_length)
    peak = total_gpu_bytes(estimate_for_config(cfg)) / GIB
    line = _verdicts(out)["grpo_kit"]
    assert (f"{peak:.2f} GiB" in line) and (peak <= 24) == line.startswith("grpo_kit: fits")
    assert line == fit.config_fit(cfg, gpu_gib=24.0)[0].text()
    spec = config_estimate_spec(cfg)
    longest = longest_fitting_context("llama-3.1-8b", 24 * GIB, dataclasses.replace(spec, scoring_batch=None))
    assert f"the longest context that fits is {longest:,} tokens" in line
    assert "96.12" not in out and "prompt fits" not in out and "Published table reproduced" not in out
    assert spec.prompt_length == default.max_prompt_length
    assert (
        f"micro-batch {spec.micro_batch_size} sequences" in out
        and f"LoRA r={spec.lora_rank}" in out
        and f"prompt {default.max_prompt_length} + completion" in out
    )


def test_published_setting_gives_the_published_tables_figures(capsys):
    out = _vram(ISSUE_COMMAND + ["--published-setting"], capsys)
    verdicts = _verdicts(out)
    assert list(verdicts) == ["trl", "unsloth", "grpo_kit"]
    assert "(the step 96.12 GiB)" in verdicts["grpo_kit"] and "Published table reproduced" in out
    # full fine-tuning: the weights fit 24 GiB, their AdamW state beside them does not
    assert "the weights (14.96 GiB) and the optimiser state (29.92 GiB) alone take" in verdicts["grpo_kit"]
    assert "the weights and vLLM's copy of them alone take 29.92 GiB" in verdicts["trl"]


def test_a_verdict_names_what_does_not_fit(capsys):
    # the 8B's bf16 weights alone exceed the card
    line = _verdicts(_vram(["--model", "llama-3.1-8b", "--context", "1024", "--gpu-gib", "8"], capsys))["grpo_kit"]
    assert "does not fit on 8.00 GiB: the weights alone take 14.96 GiB" in line and line.endswith("no context fits")
    # the weights fit; the step's largest phase does not, and a shorter context does
    line = _verdicts(_vram(ISSUE_COMMAND, capsys))["grpo_kit"]
    assert re.search(r"does not fit on 24.00 GiB: the weights take 14.96 GiB and the step's \w+ phase [\d.]+ GiB", line)
    assert "the longest context that fits is" in line
    # the generation phase names the KV cache's share
    v = fit_verdict(
        "llama-3.1-8b",
        24,
        _spec(20480, 256, num_generations=8, lora_rank=16, micro_batch_size=1, generation_batch=16, vllm=False),
    )
    assert v.peak_phase == "generation" and f"{v.kv_cache_gib:.2f} GiB of it the KV cache" in v.text()
    # the weights and the adapters fit, not even the shortest step: said so, with the prompt's length
    weights = v.weights_gib + v.optimizer_gib
    tight = fit_verdict("llama-3.1-8b", weights + 0.01, _spec(1024, 256, num_generations=8, lora_rank=16))
    assert tight.max_context is None and "no context fits: at 257 tokens (the prompt and one more)" in tight.text()


def test_the_help_says_what_the_defaults_are():
    cfg = GRPOKitConfig()
    text = " ".join(build_parser(cfg).format_help().split())
    for needle in (
        f"num_generations, {cfg.num_generations}",
        f"max_prompt_length, {cfg.max_prompt_length}",
        f"lora_rank, {cfg.lora_rank}",
        f"per_device_train_batch_size, {cfg.per_device_train_batch_size}",
        f"kv_cache_dtype {cfg.kv_cache_dtype!r}",
        f"generation_backend {cfg.generation_backend!r}",
        "--published-setting",
        "python -m grpo_kit train",
    ):
        assert needle in text, needle


def test_hub_id_from_the_local_cache(tmp_path, monkeypatch):
    from grpo_kit.model.loading import model_config

    snap = tmp_path / "hub" / "models--someorg--tiny-qwen" / "snapshots" / ("a" * 40)
    snap.mkdir(parents=True)
    (snap.parents[1] / "refs").mkdir()
    (snap.parents[1] / "refs" / "main").write_text("a" * 40)
    (snap / "config.json").write_text(json.dumps({**model_config("tiny-qwen2").to_dict(), "model_type": "qwen2"}))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    import huggingface_hub.constants as c

    monkeypatch.setattr(c, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(c, "HF_HUB_OFFLINE", True)
    from grpo_kit.memory import resolve_arch

    a = resolve_arch("someorg/tiny-qwen")
    assert a.name == "someorg/tiny-qwen" and a.model_type == "qwen2" and a.layers == resolve_arch("tiny-qwen2").layers
    with pytest.raises(ValueError, match="neither in the local hub cache nor reachable"):
        resolve_arch("someorg/not-cached")


def test_require_fit_prices_the_config_and_stops_with_the_numbers(capsys, monkeypatch):
    import grpo_kit.memory.fit as fit
    from grpo_kit.app.config import GRPOKitConfig
    from grpo_kit.memory.fit import config_fit, require_fit

    monkeypatch.setattr(fit, "detected_gpu_gib", lambda: None)  # the gpu_gib given is the budget on any machine

    small = GRPOKitConfig(
        model="qwen2.5-1.5b",
        num_generations=8,
        per_device_train_batch_size=8,
        max_prompt_length=256,
        max_completion_length=256,
        use_lora=True,
    )
    verdict, source = config_fit(small, gpu_gib=15.0)
    assert verdict.fits and verdict.context == 512 and source == "gpu_gib parameter"
    assert require_fit(small, gpu_gib=15.0).fits and "fits" in capsys.readouterr().out
    # the same step with one sequence per micro-batch needs less: the config's micro-batch is what is priced
    lean = GRPOKitConfig(
        model="qwen2.5-1.5b",
        num_generations=8,
        per_device_train_batch_size=1,
        gradient_accumulation_steps=8,
        max_prompt_length=256,
        max_completion_length=256,
        use_lora=True,
    )
    assert config_fit(lean, gpu_gib=15.0)[0].peak_gib < verdict.peak_gib
    big = GRPOKitConfig(
        model="llama-3.1-8b",
        num_generations=8,
        per_device_train_batch_size=8,
        max_prompt_length=512,
        max_completion_length=8192,
        use_lora=True,
    )
    with pytest.raises(
        RuntimeError,
        match=r"does not fit on 15.00 GiB: the weights \(14.96 GiB\) and the LoRA adapters with their "
        r"optimiser state \([\d.]+ GiB\) alone take .*; no context fits; try ",
    ):
        require_fit(big, gpu_gib=15.0)
    with pytest.raises(ValueError, match="no CUDA GPU detected; pass gpu_gib"):
        config_fit(small)
