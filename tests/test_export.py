"""grpo_kit.app.export: the trained model back from a run folder, merged 16-bit weights, clear errors."""

import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM

from grpo_kit.app.config import GRPOKitConfig
from grpo_kit.app.export import answer, before_after, load_trained, run_config, save_merged
from grpo_kit.model.loading import load_model


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """A run folder as train() leaves it: config.yaml and a (random, non-zero) LoRA adapter."""
    run = tmp_path_factory.mktemp("run")
    GRPOKitConfig(model="tiny-llama", output_dir=str(run)).save(run / "config.yaml")
    model, tok = load_model("tiny-llama")
    torch.manual_seed(0)
    pm = get_peft_model(
        model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"], init_lora_weights=False)
    )
    pm.save_pretrained(str(run / "adapter"))
    ids = torch.randint(3, 1000, (1, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        return run, ids, pm(input_ids=ids).logits


def test_the_trained_model_comes_back_and_merges_to_the_same_function(run_dir, tmp_path):
    run, ids, logits = run_dir
    model, tok = load_trained(run)
    with torch.no_grad():
        assert torch.allclose(model(input_ids=ids).logits, logits, atol=1e-5)
    out = save_merged(run, tmp_path / "merged", dtype=torch.float32, progress=False)
    merged = AutoModelForCausalLM.from_pretrained(str(out))
    assert not any("lora" in n for n, _ in merged.named_parameters())
    with torch.no_grad():
        assert torch.allclose(merged(input_ids=ids).logits, logits, atol=1e-4)
    assert isinstance(answer(model, tok, "What is 2 + 3?", max_new_tokens=4), str)
    pairs = before_after(run, ["What is 2 + 3?"], max_new_tokens=6)
    with model.disable_adapter():  # "before" is the base model: the adapter switched off
        base = answer(model, tok, "What is 2 + 3?", max_new_tokens=6)
    assert pairs[0]["before"] == base and pairs[0]["after"] == answer(model, tok, "What is 2 + 3?", max_new_tokens=6)


def test_existing_output_is_refused_or_moved_aside_never_deleted(run_dir, tmp_path):
    run, _, _ = run_dir
    out = tmp_path / "merged"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="already exists and is not empty; pass overwrite=True"):
        save_merged(run, out, progress=False)
    save_merged(run, out, dtype=torch.bfloat16, overwrite=True, progress=False)
    aside = [p for p in tmp_path.iterdir() if p.name.startswith("merged.replaced-")]
    assert len(aside) == 1 and (aside[0] / "keep.txt").read_text() == "mine"
    assert (out / "config.json").is_file()


def test_not_a_run_folder_is_one_clear_error(tmp_path):
    with pytest.raises(ValueError, match="is not a grpo_kit run folder: it has no config.yaml"):
        run_config(tmp_path)
    GRPOKitConfig(model="tiny-llama", output_dir=str(tmp_path)).save(tmp_path / "config.yaml")
    with pytest.raises(ValueError, match="holds no trained weights"):
        load_trained(tmp_path)
