"""`vram` answers "does it fit": a verdict against --gpu-gib and the longest context that fits; hub ids read
their config.json from the local hub cache."""

import json

import pytest

from grpo_kit.memory import cli_main, estimate, total_gpu_bytes
from grpo_kit.memory.fit import FREE_T4_GIB, GIB, PRESET_ROUND, fit_verdict, free_t4_preset, longest_fitting_context

KW = dict(num_generations=8, lora_rank=16, method="grpo_kit")


def test_longest_context_is_the_boundary():
    budget = 15 * GIB
    n = longest_fitting_context("qwen2.5-1.5b", budget, prompt_length=256, **KW)
    assert n is not None and n > 1024

    def peak(ctx):
        return total_gpu_bytes(estimate("qwen2.5-1.5b", prompt_length=256, completion_length=ctx - 256, **KW))

    assert peak(n) <= budget < peak(n + 1)
    v = fit_verdict("qwen2.5-1.5b", 15, context=n + 1, prompt_length=256, num_generations=8, lora_rank=16)
    assert not v.fits and v.max_context == n and "does not fit" in v.text() and f"{n:,} tokens" in v.text()
    assert fit_verdict("llama-3.1-8b", 8, context=1024, num_generations=8, lora_rank=16).max_context is None
    with pytest.raises(ValueError, match="gpu_gib=0 must be > 0"):
        fit_verdict("qwen2.5-1.5b", 0, context=1024)


def test_free_t4_preset_is_the_longest_whole_step_in_4bit_fp16():
    p = free_t4_preset("llama-3.1-8b", num_generations=8, prompt_length=512, lora_rank=16)
    assert p["four_bit"] and p["dtype"] == "fp16" and p["generation_backend"] == "hf" and p["budget_gib"] == FREE_T4_GIB
    ctx = p["context_length"]
    assert ctx % PRESET_ROUND == 0 and p["estimate_gib"] <= FREE_T4_GIB

    def peak(c):  # the whole step: HF generate's fp16 KV cache of all 8 completions included
        return total_gpu_bytes(estimate("llama-3.1-8b", prompt_length=512, completion_length=c - 512, num_generations=8,
                                        lora_rank=16, quantization="4bit", dtype="fp16", micro_batch_size=1,
                                        vllm=False, include_generation=True)) / GIB

    assert peak(ctx) <= FREE_T4_GIB < peak(ctx + PRESET_ROUND)
    # generation's KV cache is what limits it: the training step alone fits far longer
    assert longest_fitting_context("llama-3.1-8b", FREE_T4_GIB * GIB, prompt_length=512, num_generations=8,
                                   lora_rank=16, quantization="4bit", dtype="fp16", micro_batch_size=1, vllm=False,
                                   include_generation=False) > 4 * ctx
    with pytest.raises(ValueError, match="does not fit"):
        free_t4_preset("llama-3.1-8b", num_generations=512)


def test_cli_verdict_per_method(capsys):
    assert cli_main(["--model", "qwen2.5-1.5b", "--context", "1024", "--lora-rank", "16", "--gpu-gib", "15"]) == 0
    out = capsys.readouterr().out
    assert "Does it fit in 15.00 GiB (--gpu-gib)?" in out
    lines = [line.strip() for line in out.splitlines() if "longest context that fits" in line]
    assert [line.split(":")[0] for line in lines] == ["trl", "unsloth", "grpo_kit"]
    ours = lines[-1]
    assert ours.startswith("grpo_kit: fits") and int(ours.rsplit(": ", 1)[1].split()[0].replace(",", "")) > 1024
    with pytest.raises(SystemExit):
        cli_main(["--model", "qwen2.5-1.5b", "--context", "1024", "--gpu-gib", "-1"])


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

    small = GRPOKitConfig(model="qwen2.5-1.5b", num_generations=8, per_device_train_batch_size=8,
                          max_prompt_length=256, max_completion_length=256, use_lora=True)
    verdict, source = config_fit(small, gpu_gib=15.0)
    assert verdict.fits and verdict.context == 512 and source == "gpu_gib parameter"
    assert require_fit(small, gpu_gib=15.0).fits and "fits" in capsys.readouterr().out
    # the same step with one sequence per micro-batch needs less: the config's micro-batch is what is priced
    lean = GRPOKitConfig(model="qwen2.5-1.5b", num_generations=8, per_device_train_batch_size=1,
                         gradient_accumulation_steps=8, max_prompt_length=256, max_completion_length=256, use_lora=True)
    assert config_fit(lean, gpu_gib=15.0)[0].peak_gib < verdict.peak_gib
    big = GRPOKitConfig(model="llama-3.1-8b", num_generations=8, per_device_train_batch_size=8, max_prompt_length=512,
                        max_completion_length=8192, use_lora=True)
    with pytest.raises(RuntimeError, match=r"does not fit, needs [\d.]+ GiB, the GPU has 15.00 GiB.*try "):
        require_fit(big, gpu_gib=15.0)
    with pytest.raises(ValueError, match="no CUDA GPU detected; pass gpu_gib"):
        config_fit(small)

