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
