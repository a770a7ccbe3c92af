"""Each supported family end to end on the CPU, as a user runs it: ``train`` on its tiny built-in (HF generation)
and from a model folder made elsewhere (vLLM's CPU engine where installed), the adapter saved, reloaded and merged;
the calculator prices it; ``doctor --model`` answers; what the kit cannot map is refused before anything loads."""

import importlib.util
import json

import pytest
import torch

from grpo_kit.app.config import ConfigError, GRPOKitConfig
from grpo_kit.model.families import FAMILIES, tiny_names
from grpo_kit.model.loading import build_random_model, load_tokenizer

TINY = [name for fam in FAMILIES for name in tiny_names(fam)]
NEW = [n for n in TINY if n not in ("tiny-llama", "tiny-qwen2", "tiny-mistral")]  # those three: test_run & co.
# a short run: 2 steps of one group of 4, 6 tokens each
SHORT = dict(
    max_steps=2,
    num_train_samples=8,
    num_eval_samples=2,
    max_completion_length=6,
    num_generations=4,
    per_device_train_batch_size=4,
    save_steps=0,
)


def _folder(tmp_path, name: str):
    """A model folder as another tool writes one: config.json, safetensors and a tokenizer."""
    folder = tmp_path / name
    build_random_model(name).save_pretrained(folder)
    load_tokenizer(name).save_pretrained(folder)
    return folder


@pytest.mark.parametrize("name", NEW)
def test_train_two_steps_then_the_adapter_reloads_and_merges(name, tmp_path):
    from peft import PeftModel

    from grpo_kit.app.run import train

    summary = train(GRPOKitConfig(model=name, output_dir=str(tmp_path / "run"), generation_backend="hf", **SHORT))
    assert summary["steps"] == 2
    plan = summary["generation"]["model"]
    assert plan["lora_targets"] and plan["layers"] == 2
    adapter = tmp_path / "run" / "adapter"
    base = build_random_model(name, seed=summary.get("seed", 0))
    reloaded = PeftModel.from_pretrained(base, adapter)
    ids = torch.arange(3, 19).unsqueeze(0)
    with torch.no_grad():
        want = reloaded(input_ids=ids).logits
        merged = reloaded.merge_and_unload()
        got = merged(input_ids=ids).logits
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert json.loads((adapter / "adapter_config.json").read_text())["target_modules"]


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM's CPU build is not installed")
@pytest.mark.parametrize("name", ["tiny-smollm3", "tiny-qwen3-moe"])
def test_a_folder_made_elsewhere_trains_with_vllms_cpu_engine(name, tmp_path):
    """SmolLM3: vLLM runs it through its Transformers backend, which used to decorate the class the training model
    is then built from (the engine's own config missing: a traceback). Qwen3-MoE: the engine's copy is synced in the
    checkpoint's layout (its fused experts split again)."""
    from grpo_kit.app.run import train

    summary = train(
        GRPOKitConfig(
            model=str(_folder(tmp_path, name)), output_dir=str(tmp_path / "run"), generation_backend="vllm", **SHORT
        )
    )
    assert summary["steps"] == 2 and summary["generation"]["backend"] == "vllm"


@pytest.mark.parametrize("name", ["qwen3-8b", "gemma-3-4b", "qwen3-30b-a3b", "gpt-oss-20b", "phi-4-mini"])
def test_vram_prices_every_family(name, capsys):
    from grpo_kit.app.cli import main

    assert main(["vram", "--model", name, "--context", "4096", "--gpu-gib", "80"]) == 0
    out = capsys.readouterr().out
    assert name in out and "GiB" in out


def test_moe_weights_are_all_experts_and_activations_the_active_ones():
    from grpo_kit.memory.estimate import resolve_arch
    from grpo_kit.memory.formulas import param_counts

    a = resolve_arch("qwen3-30b-a3b")
    assert (a.experts, a.active_experts, a.expert_intermediate, a.intermediate) == (128, 8, 768, 8 * 768)
    n = param_counts(a)
    assert 30.4e9 < n["total"] < 30.6e9 and n["experts"] > 0.9 * n["total"]  # the published 30.5B, mostly experts
    assert n["layer_linear"] == 48 * (2048 * 4096 + 2 * 2048 * 512 + 4096 * 2048)  # attention only: LoRA, 4-bit


def test_doctor_model_answers_for_a_family_and_refuses_what_it_cannot_map(tmp_path):
    from grpo_kit.app.models import doctor_model

    rows = dict(doctor_model("tiny-gemma3"))
    assert rows["family"] == "Gemma 3 (text)" and "soft-cap 30" in rows["logits"]
    assert rows["verdict"].startswith("supported")
    folder = tmp_path / "olmoe"
    folder.mkdir()
    from transformers import AutoConfig

    AutoConfig.for_model(
        "olmoe", hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64
    ).to_json_file(folder / "config.json")
    verdict = dict(doctor_model(str(folder)))["verdict"]
    assert verdict.startswith("refused: ") and "'olmoe'" in verdict and "trainer: trl" in verdict


def test_an_unproven_family_is_refused_before_anything_loads(tmp_path):
    from transformers import AutoConfig

    from grpo_kit.app.run import train

    folder = tmp_path / "olmoe"
    folder.mkdir()
    AutoConfig.for_model(
        "olmoe", hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64
    ).to_json_file(folder / "config.json")  # no weights: nothing may load
    load_tokenizer("tiny-llama").save_pretrained(folder)
    with pytest.raises(ConfigError, match=r"model_type 'olmoe' \(OlmoeForCausalLM\) is not among the families"):
        train(GRPOKitConfig(model=str(folder), output_dir=str(tmp_path / "run"), **SHORT))
    assert not (tmp_path / "run").exists() or not any((tmp_path / "run").iterdir())


def test_remote_code_is_refused_unless_trusted(tmp_path):
    from grpo_kit.app.run import train

    folder = _folder(tmp_path, "tiny-qwen3")
    config = json.loads((folder / "config.json").read_text())
    config["auto_map"] = {"AutoModelForCausalLM": "modeling_mine.MyModel"}
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match="ships its own modelling code .*trust_remote_code: true"):
        train(GRPOKitConfig(model=str(folder), output_dir=str(tmp_path / "run"), **SHORT))
