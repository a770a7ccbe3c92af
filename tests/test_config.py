import pytest

from grpo_kit.config import ConfigError, GRPOKitConfig


def test_defaults_validate_and_every_field_has_help():
    GRPOKitConfig().validate()
    assert all(len(h) > 10 for h in GRPOKitConfig.field_help().values())


def test_yaml_and_overrides(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("model: tiny-qwen2\nmax_steps: 3\nlevels: [1]\n")
    cfg = GRPOKitConfig.from_yaml(p, ["beta=0", "loss_type=dapo", "levels=[1,2,3]", "use_lora=false"])
    assert (cfg.model, cfg.max_steps, cfg.beta, cfg.loss_type, cfg.levels, cfg.use_lora) == \
        ("tiny-qwen2", 3, 0.0, "dapo", [1, 2, 3], False)
    cfg.validate()
    cfg.save(tmp_path / "out.yaml")
    assert GRPOKitConfig.from_yaml(tmp_path / "out.yaml") == cfg


@pytest.mark.parametrize("overrides,match", [
    (["num_generations=1"], "num_generations=1 must be at least 2"),
    (["per_device_train_batch_size=6"], "must be a multiple of num_generations=8"),
    (["loss_type=ppo"], r"loss_type='ppo' is not allowed; choose one of \['grpo', 'bnpo', 'dr_grpo', 'dapo'\]"),
    (["model=llama-9000"], "Built-in names: smollm2-135m-instruct"),
    (["temperature=0"], "temperature=0.0 must be > 0"),
    (["reward_funcs=[vibes]"], "reward_funcs"),
    (["task=gsm8k", "dataset_path=/nonexistent.jsonl"], "does not exist"),
])
def test_bad_values_are_named(overrides, match):
    cfg = GRPOKitConfig().apply_overrides(overrides)
    with pytest.raises(ConfigError, match=match):
        cfg.validate()


def test_unknown_key_and_wrong_type():
    with pytest.raises(ConfigError, match="unknown config key 'num_generation'. Did you mean num_generations"):
        GRPOKitConfig().apply_overrides(["num_generation=4"])
    with pytest.raises(ConfigError, match="max_steps='ten' has the wrong type: expected int"):
        GRPOKitConfig().apply_overrides(["max_steps=ten"])
    with pytest.raises(ConfigError, match="does not exist"):
        GRPOKitConfig.from_yaml("/nonexistent/config.yaml")


def test_several_problems_reported_together():
    cfg = GRPOKitConfig().apply_overrides(["num_generations=1", "temperature=-1"])
    with pytest.raises(ConfigError) as e:
        cfg.validate()
    assert "num_generations" in str(e.value) and "temperature" in str(e.value)


def test_gradient_checkpointing_auto_true_false():
    cfg = GRPOKitConfig().validate()
    assert cfg.gradient_checkpointing == "auto"  # on a GPU on, on the CPU off (it would only recompute)
    assert cfg.checkpointing_on("cuda") and not cfg.checkpointing_on("cpu")
    for raw, want in (("true", True), ("False", False), ("AUTO", "auto")):
        c = GRPOKitConfig().apply_overrides([f"gradient_checkpointing={raw}"]).validate()
        assert c.gradient_checkpointing == want
    assert GRPOKitConfig(gradient_checkpointing=True).checkpointing_on("cpu")
    assert not GRPOKitConfig(gradient_checkpointing=False).checkpointing_on("cuda")
    with pytest.raises(ConfigError, match="gradient_checkpointing='maybe' is not allowed: true, false or 'auto'"):
        GRPOKitConfig().apply_overrides(["gradient_checkpointing=maybe"])
    with pytest.raises(ConfigError, match="gradient_checkpointing=1 is not allowed"):
        GRPOKitConfig(gradient_checkpointing=1).validate()


def test_vllm_share_from_the_memory_plan():
    """On one card vLLM gets what the VRAM calculator's training estimate leaves (less 1 GiB)."""
    from grpo_kit.memory import estimate, total_gpu_bytes
    from grpo_kit.models import model_config
    from grpo_kit.trainer import vllm_memory_share

    cfg = GRPOKitConfig(model="llama-3.1-8b", max_completion_length=2048, num_generations=8,
                        per_device_train_batch_size=1, gradient_checkpointing=True, lora_rank=16)
    share, training = vllm_memory_share(cfg, model_config("llama-3.1-8b"), 80 * 2**30)
    want = total_gpu_bytes(estimate("llama-3.1-8b", num_generations=8, prompt_length=cfg.max_prompt_length,
                                    completion_length=2048, lora_rank=16, vllm=False, include_generation=False,
                                    micro_batch_size=1))
    assert training == pytest.approx(want) and 15 * 2**30 < training < 40 * 2**30
    assert share == pytest.approx(round((80 * 2**30 - training - 2**30) / (80 * 2**30), 3))
    with pytest.raises(ValueError, match="less than 5% is left for a colocated vLLM"):
        vllm_memory_share(cfg, model_config("llama-3.1-8b"), 16 * 2**30)  # a T4 cannot hold both
