import pytest

from grpo_kit.app.config import ConfigError, GRPOKitConfig


def test_defaults_validate_and_every_field_has_help():
    GRPOKitConfig().validate()
    assert all(len(h) > 10 for h in GRPOKitConfig.field_help().values())


def test_yaml_and_overrides(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("model: tiny-qwen2\nmax_steps: 3\nlevels: [1]\n")
    cfg = GRPOKitConfig.from_yaml(p, ["beta=0", "loss_type=dapo", "levels=[1,2,3]", "use_lora=false"])
    assert (cfg.model, cfg.max_steps, cfg.beta, cfg.loss_type, cfg.levels, cfg.use_lora) == (
        "tiny-qwen2",
        3,
        0.0,
        "dapo",
        [1, 2, 3],
        False,
    )
    cfg.validate()
    cfg.save(tmp_path / "out.yaml")
    assert GRPOKitConfig.from_yaml(tmp_path / "out.yaml") == cfg


@pytest.mark.parametrize(
    "overrides,match",
    [
        (["num_generations=1"], "num_generations=1 must be at least 2"),
        (["per_device_train_batch_size=6"], "must be a multiple of num_generations=8"),
        # TRL's types first; a type another test registered may follow them
        (
            ["loss_type=ppo"],
            r"loss_type='ppo' is not allowed; choose one of \['grpo', 'bnpo', 'dr_grpo', 'dapo', 'cispo', 'sapo', 'vespo', 'luspo'[\],]",
        ),
        (["model=llama-9000"], "Built-in names: smollm2-135m-instruct"),
        (["temperature=0"], "temperature=0.0 must be > 0"),
        (["reward_funcs=[vibes]"], "reward_funcs"),
        (["task=gsm8k", "dataset_path=/nonexistent.jsonl"], "does not exist"),
    ],
)
def test_bad_values_are_named(overrides, match):
    cfg = GRPOKitConfig().apply_overrides(overrides)
    with pytest.raises(ConfigError, match=match):
        cfg.validate()


def test_floats_in_exponent_notation(tmp_path):
    """YAML 1.1 (PyYAML) reads 5e-5 as a string; YAML files and --set accept it as a float."""
    p = tmp_path / "c.yaml"
    p.write_text("learning_rate: 5e-5\nbeta: 1e-6\nvllm_kv_cache_gib: 2E0\n")
    cfg = GRPOKitConfig.from_yaml(p, ["weight_decay=2e-4", "max_grad_norm=1.5"])
    assert (cfg.learning_rate, cfg.beta, cfg.vllm_kv_cache_gib, cfg.weight_decay, cfg.max_grad_norm) == (
        5e-5,
        1e-6,
        2.0,
        2e-4,
        1.5,
    )
    assert GRPOKitConfig().apply_overrides(["learning_rate=2e-4"]).validate().learning_rate == 2e-4
    with pytest.raises(ConfigError, match="learning_rate='2e-4x' has the wrong type: expected float"):
        GRPOKitConfig().apply_overrides(["learning_rate=2e-4x"])


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


def test_lora_dual_stream_applies_only_to_the_adapter_in_vllm_on_cuda():
    from grpo_kit.generation.plan import LORA_DUAL_STREAM_DEFAULT, lora_dual_stream

    auto, on, off = (GRPOKitConfig(vllm_lora_dual_stream=v, vllm_lora_sync="adapter") for v in (None, True, False))
    assert lora_dual_stream(auto, device="cuda") is LORA_DUAL_STREAM_DEFAULT
    assert lora_dual_stream(on, device="cuda") and not lora_dual_stream(off, device="cuda")
    # merged LoRA (the default) runs no LoRA kernels; the CPU build has no second stream
    assert not lora_dual_stream(GRPOKitConfig(vllm_lora_dual_stream=True), device="cuda")
    assert not lora_dual_stream(on, device="cpu")
    for bad in ("yes", 1):  # 1 == True in Python: a bool is asked for, not a number
        with pytest.raises(ConfigError, match=f"vllm_lora_dual_stream={bad!r} is not allowed"):
            GRPOKitConfig(vllm_lora_dual_stream=bad).validate()
    with pytest.raises(ConfigError, match="vllm_lora_dual_stream=True only apply to vLLM generation"):
        GRPOKitConfig(vllm_lora_dual_stream=True, generation_backend="hf").validate()
    # HF generation samples from the training model itself: no engine correction to choose
    with pytest.raises(ConfigError, match="vllm_importance_sampling_mode='token_mask' only apply to vLLM generation"):
        GRPOKitConfig(vllm_importance_sampling_mode="token_mask", generation_backend="hf").validate()
    # VESPO takes per-token ratios: with vLLM it needs a token mode, said before anything starts (the trainer
    # would refuse it only once the engine runs)
    with pytest.raises(ConfigError, match="loss_type='vespo' with vLLM generation .* set it to 'token_truncate'"):
        GRPOKitConfig(loss_type="vespo", generation_backend="vllm").validate()
    GRPOKitConfig(loss_type="vespo", generation_backend="vllm", vllm_importance_sampling_mode="token_mask").validate()


def test_vllm_lora_sync_resolves_refuses_and_reaches_the_engine_plan(monkeypatch, tmp_path):
    import torch

    from grpo_kit.generation import plan as P
    from grpo_kit.model.loading import model_config

    auto, merge, adapter = (GRPOKitConfig(vllm_lora_sync=v) for v in (None, "merge", "adapter"))
    assert P.lora_sync_mode(auto) == "merge"  # measured faster than the LoRA kernels (plan.lora_sync_mode)
    assert P.lora_sync_mode(merge) == "merge" and P.lora_sync_mode(adapter) == "adapter"
    assert not P.lora_dual_stream(merge, device="cuda")  # merged: no LoRA kernels to overlap
    assert P.lora_dual_stream(adapter, device="cuda") is P.LORA_DUAL_STREAM_DEFAULT
    for bad, match in (
        (
            {"vllm_lora_sync": "merged"},
            r"vllm_lora_sync='merged' is not allowed; choose one of \['merge', "
            r"'adapter'\] or null",
        ),
        ({"vllm_lora_sync": "merge", "use_lora": False}, "needs use_lora=True"),
        ({"vllm_lora_sync": "merge", "vllm_lora_dual_stream": True}, "drop one of the two"),
        ({"vllm_lora_sync": "merge", "generation_backend": "hf"}, "only apply to vLLM generation"),
    ):
        with pytest.raises(ConfigError, match=match):
            GRPOKitConfig(**bad).validate()
    # The CUDA plan reads the model's config and the free memory only: checked here without a GPU.
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *a: (139 * 2**30, 140 * 2**30))
    monkeypatch.setattr("grpo_kit.generation.vllm_available", lambda: True)
    monkeypatch.setenv("GRPO_KIT_CACHE", str(tmp_path))
    for sync, want, stream in ((None, "merge", False), ("adapter", "adapter", P.LORA_DUAL_STREAM_DEFAULT)):
        cfg = GRPOKitConfig(model="llama-3.1-8b", vllm_lora_sync=sync, max_completion_length=1024).validate()
        plan = P.plan_generation(cfg, model_config=model_config("llama-3.1-8b"), device="cuda", dtype=torch.bfloat16)
        assert plan.backend == "vllm" and plan.share_weights
        assert plan.vllm_kwargs["lora_sync"] == want and plan.vllm_kwargs["lora_dual_stream"] is stream
        assert plan.vllm_kwargs["enforce_eager"] is None  # the generator's default: CUDA graphs on CUDA
    eager = GRPOKitConfig(model="llama-3.1-8b", vllm_enforce_eager=True, max_completion_length=1024).validate()
    assert (
        P.plan_generation(
            eager, model_config=model_config("llama-3.1-8b"), device="cuda", dtype=torch.bfloat16
        ).vllm_kwargs["enforce_eager"]
        is True
    )
    with pytest.raises(ConfigError, match="vllm_enforce_eager=True.*only apply to vLLM generation"):
        GRPOKitConfig(vllm_enforce_eager=True, generation_backend="hf").validate()
    casts = GRPOKitConfig(
        model="llama-3.1-8b", vllm_emulate_precision_casts=True, max_completion_length=1024
    ).validate()
    assert (
        P.plan_generation(
            casts, model_config=model_config("llama-3.1-8b"), device="cuda", dtype=torch.bfloat16
        ).vllm_kwargs["emulate_precision_casts"]
        is True
    )
    with pytest.raises(ConfigError, match="vllm_emulate_precision_casts=True.*only apply to vLLM generation"):
        GRPOKitConfig(vllm_emulate_precision_casts=True, generation_backend="hf").validate()
    # a 20K context: the engine's batch budget stays CUDA_BATCHED_TOKENS (chunked prefill, asked for), the workspace
    # the calculator prices is that budget's, and it is smaller than the context's would be
    cfg = GRPOKitConfig(model="llama-3.1-8b", max_completion_length=20480).validate()
    plan = P.plan_generation(cfg, model_config=model_config("llama-3.1-8b"), device="cuda", dtype=torch.bfloat16)
    assert plan.vllm_kwargs["llm_kwargs"] == {
        "max_num_batched_tokens": P.CUDA_BATCHED_TOKENS,
        "enable_chunked_prefill": True,
    }
    assert plan.vllm_kwargs["max_model_len"] == cfg.max_prompt_length + 20480 > P.CUDA_BATCHED_TOKENS
    priced = {
        n: P.memory_plan(
            cfg,
            model_config("llama-3.1-8b"),
            share_weights=True,
            free_bytes=139 * 2**30,
            total_bytes=140 * 2**30,
            batched_tokens=n,
        )["calculator_phases_gib"]["generation"]
        for n in (P.CUDA_BATCHED_TOKENS, cfg.max_prompt_length + 20480)
    }
    assert plan.memory["calculator_phases_gib"]["generation"] == priced[P.CUDA_BATCHED_TOKENS]
    assert priced[cfg.max_prompt_length + 20480] - priced[P.CUDA_BATCHED_TOKENS] > 1.5  # GiB of workspace saved
    # an explicit dual stream with nothing to run it on is refused, not dropped
    copy = GRPOKitConfig(
        model="llama-3.1-8b", vllm_share_weights=False, vllm_lora_dual_stream=True, max_completion_length=1024
    ).validate()
    shared = GRPOKitConfig(model="llama-3.1-8b", vllm_lora_dual_stream=True, max_completion_length=1024).validate()
    for cfg, how in ((copy, "a separate engine copy"), (shared, "shared weights")):
        with pytest.raises(ValueError, match=f"resolves to 'merge' with {how}.*vllm_lora_sync='adapter'"):
            P.plan_generation(cfg, model_config=model_config("llama-3.1-8b"), device="cuda", dtype=torch.bfloat16)


def test_cuda_memory_plan_counts_weights_once_and_kv_for_one_generation_batch():
    """The KV cache is what one generation batch needs; the step peak must fit the free memory."""
    from grpo_kit.generation.plan import memory_plan
    from grpo_kit.memory import formulas as F
    from grpo_kit.memory import resolve_arch
    from grpo_kit.model.loading import model_config

    cfg = GRPOKitConfig(
        model="llama-3.1-8b",
        max_completion_length=2048,
        num_generations=8,
        per_device_train_batch_size=1,
        gradient_accumulation_steps=8,
        gradient_checkpointing=True,
    )
    mc, gib = model_config("llama-3.1-8b"), 2**30
    shared = memory_plan(cfg, mc, share_weights=True, free_bytes=139 * gib, total_bytes=140 * gib)
    kv = F.kv_cache_bytes(resolve_arch("llama-3.1-8b"), F.vllm_kv_tokens(256, 2048, 8, 1), 2)
    assert shared["kv_cache_memory_bytes"] == int(kv) and shared["generation_rows"] == 8
    assert shared["engine_weight_copy_gib"] == 0 and 14.9 < shared["weights_gib"] < 15.0
    phases = shared["calculator_phases_gib"]
    assert shared["calculator_peak_gib"] == max(phases.values())
    a = resolve_arch("llama-3.1-8b")
    lora = F.lora_state_bytes(F.lora_param_count(a, 16))
    assert phases["generation"] == pytest.approx(  # weights, LoRA + AdamW, KV cache, vLLM's workspace
        (F.weight_bytes(a, 2, None) + lora + kv + F.vllm_workspace_bytes(a, 4096, 8, 2)) / gib, abs=0.01
    )
    assert 0.1 < shared["vllm_share"] < 0.2  # weights + KV + workspace + 1 GiB of 140 GiB
    copy = memory_plan(cfg, mc, share_weights=False, free_bytes=139 * gib, total_bytes=140 * gib)
    assert copy["calculator_phases_gib"]["generation"] == pytest.approx(
        phases["generation"] + shared["weights_gib"], abs=0.02
    )
    fp8 = memory_plan(
        GRPOKitConfig(**{**cfg.to_dict(), "kv_cache_dtype": "fp8"}),
        mc,
        share_weights=True,
        free_bytes=139 * gib,
        total_bytes=140 * gib,
    )
    assert fp8["kv_cache_memory_bytes"] == int(kv // 2)
    budget = memory_plan(
        GRPOKitConfig(**{**cfg.to_dict(), "vllm_kv_cache_gib": 3.0}),
        mc,
        share_weights=True,
        free_bytes=139 * gib,
        total_bytes=140 * gib,
    )
    assert budget["kv_cache_memory_bytes"] == 3 * gib and budget["kv_source"] == "vllm_kv_cache_gib"
    # scoring_batch_size 'auto' resolved under this plan's pricing (vLLM's generation phase); a set number is kept
    from grpo_kit.memory import estimate_for_config

    for c in (cfg, GRPOKitConfig(**{**cfg.to_dict(), "max_completion_length": 4096})):
        priced = estimate_for_config(c, mc, vllm=True, standby=True, method="grpo_kit", vllm_batched_tokens=4096)
        got = memory_plan(c, mc, share_weights=True, free_bytes=139 * gib, total_bytes=140 * gib)
        assert got["scoring_batch_size"] == priced.attrs["scoring_batch"]
    # at 2K no scoring pass of 2 sequences stays within the backward's price; at 4K one of several does
    assert shared["scoring_batch_size"] is None and 1 < got["scoring_batch_size"] < 8
    assert (
        memory_plan(
            GRPOKitConfig(**{**cfg.to_dict(), "scoring_batch_size": 3}),
            mc,
            share_weights=True,
            free_bytes=139 * gib,
            total_bytes=140 * gib,
        )["scoring_batch_size"]
        == 3
    )
    with pytest.raises(
        ValueError,
        match=r"cannot fit beside training on this GPU.*15\.0 of 15\.0 GiB is free.*"
        r"kv_cache_dtype=fp8",
    ):
        memory_plan(cfg, mc, share_weights=True, free_bytes=15 * gib, total_bytes=15 * gib)  # a T4 cannot hold it


# --- issue 18: every numeric field finite and in range, list element types, names, bad paths ------------------------
@pytest.mark.parametrize(
    "override,match",
    [
        ("learning_rate=.inf", "learning_rate=inf must be > 0 and finite"),
        ("temperature=.inf", "temperature=inf must be > 0 and finite"),
        ("epsilon_high=.inf", r"epsilon_high=inf must be > 0 and finite \(or null for the same as epsilon\)"),
        ("epsilon_high=0", r"epsilon_high=0.0 must be > 0 and finite \(or null for the same as epsilon\)"),
        ("loss_chunk_size=0", r"loss_chunk_size=0 must be at least 1 \(or null for automatic\)"),
        ("vllm_gpu_memory_utilization=0", r"vllm_gpu_memory_utilization=0.0 must be in \(0, 1\] and finite"),
        ("max_grad_norm=-1", r"max_grad_norm=-1.0 must be at least 0 and finite \(0: no clipping\)"),
        ("max_grad_norm=.nan", "max_grad_norm=nan must be at least 0"),
        ("weight_decay=-5", "weight_decay=-5.0 must be at least 0"),
        ("lora_target_modules=[1, 2]", r"lora_target_modules=\[1, 2\]: .auto. or a list of module names"),
        ("reward_weights=[.nan, 1]", r"reward_weights=\[nan, 1\]: each must be a finite number, not nan"),
        ("reward_weights=[high, 1]", "reward_weights=.*each must be a finite number, not 'high'"),
        ("lr_scheduler_type=cosinus", r"lr_scheduler_type='cosinus' is not allowed; choose one of \['linear'"),
        ("reward_time_limit_s=-1", "reward_time_limit_s=-1.0 must be at least 0"),
        ("seed=-1", r"seed=-1 must be in \[0, 4294967295\]"),
        ("output_dir=", "output_dir='' must name a run folder"),
    ],
)
def test_non_finite_out_of_range_and_bad_names_are_refused_with_the_range(override, match):
    with pytest.raises(ConfigError, match=match):
        GRPOKitConfig().apply_overrides([override]).validate()


def test_every_numeric_field_has_a_range_and_refuses_nan_inf_and_bools():
    import dataclasses
    import math

    from grpo_kit.app.config import OBJECTIVE_FIELDS
    from grpo_kit.app.config_checks import CHOICES, NUMERIC_RANGES

    numeric = {f.name for f in dataclasses.fields(GRPOKitConfig) if str(f.type).split(" ")[0] in ("int", "float")}
    # the objective's options are checked by ObjectiveSpec, which owns them; a number from a fixed set (fp8_block)
    # by CHOICES
    assert numeric == set(NUMERIC_RANGES) | (numeric & set(OBJECTIVE_FIELDS)) | (numeric & set(CHOICES))
    for f in dataclasses.fields(GRPOKitConfig):
        if f.name not in numeric:
            continue
        low = [NUMERIC_RANGES[f.name][0] - 1] if f.name in NUMERIC_RANGES else []
        for bad in ([math.nan, math.inf, -math.inf] if str(f.type).startswith("float") else []) + [True, *low]:
            with pytest.raises(ConfigError, match=f"{f.name}="):  # set directly, as a notebook would
                dataclasses.replace(GRPOKitConfig(), **{f.name: bad}).validate()
    with pytest.raises(ConfigError, match="max_steps=inf must be an integer at least 1"):
        GRPOKitConfig().apply_overrides(["max_steps=.inf"])  # used to be an OverflowError traceback


def test_scheduler_names_are_transformers_own():
    from transformers.trainer_utils import SchedulerType

    from grpo_kit.app.config_checks import LR_SCHEDULER_TYPES

    assert set(LR_SCHEDULER_TYPES) == {s.value for s in SchedulerType}


def _bad_paths(tmp_path):
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    (model / "model.safetensors").write_bytes(
        (64).to_bytes(8, "little")
        + b'{"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}'.ljust(64)
        + b"\0" * 7
    )
    yaml_bad = tmp_path / "c.yaml"
    yaml_bad.write_bytes(b"max_steps: 3\nmodel: \xff\xfe\n")
    jsonl_bad = tmp_path / "bad.jsonl"
    jsonl_bad.write_bytes(b'{"question": "\xff", "answer": "#### 1"}\n')
    deep = tmp_path / "deep.jsonl"
    deep.write_text("[" * 100_000 + "]" * 100_000 + "\n")
    gsm = ["--set", "task=gsm8k", "--set", "num_eval_samples=0", "--set", "model=tiny-llama"]
    return [
        (["--output-dir", str(a_file)], f"{a_file}' exists and is not a folder"),
        (["--output-dir", str(a_file / "run")], "exists and is not a folder"),
        (["--set", "output_dir="], "output_dir='' must name a run folder"),
        (
            ["--set", f"model={model}"],
            "model.safetensors cannot be loaded: 79 bytes, but its header needs 88 (truncated)",
        ),
        (["--config", str(yaml_bad)], "is not UTF-8 text"),
        ([*gsm, "--set", f"dataset_path={jsonl_bad}"], "bad.jsonl:1: not UTF-8 text"),
        ([*gsm, "--set", f"dataset_path={deep}"], "deep.jsonl:1: JSON nested too deeply"),
        (["--set", "max_steps=.inf"], "max_steps=inf must be an integer"),
        (["--set", "learning_rate=.inf"], "learning_rate=inf must be > 0 and finite"),
    ]


def test_bad_paths_and_values_give_one_error_line_and_exit_code_2(tmp_path, capsys, monkeypatch):
    from grpo_kit.app.cli import main
    from grpo_kit.model import loading as models

    def no_model(*a, **k):
        raise AssertionError("a model was loaded: the bad input was not caught first")

    monkeypatch.setattr(models, "load_tokenizer", no_model)
    for args, match in _bad_paths(tmp_path):
        out = [] if "--output-dir" in args or "output_dir=" in args[-1] else ["--output-dir", str(tmp_path / "r")]
        assert main(["train", *args, *out]) == 2, args
        err = capsys.readouterr().err
        err = err[err.find("error: ") :]  # after the kit's notes on third-party warnings, if any (printed once)
        assert err.startswith("error: ") and match in err, (args, err)
        assert not (tmp_path / "r").exists()  # stopped before any work


def test_automatic_values_are_null_and_old_run_folders_with_0_resume(tmp_path):
    """epsilon_high, loss_chunk_size, vllm_gpu_memory_utilization: null means automatic, as in TRL (0 did before);
    min_p: null or 0 is off. A run folder saved when 0 meant automatic resumes with 0 read as null."""
    from grpo_kit.app.config import NULL_MEANS_AUTO
    from grpo_kit.app.resume_policy import resume_config

    cfg = GRPOKitConfig().validate()
    assert all(getattr(cfg, name) is None for name in (*NULL_MEANS_AUTO, "min_p"))
    cfg.apply_overrides(["epsilon_high=0.28", "loss_chunk_size=null", "min_p=0"])
    assert cfg.validate().epsilon_high == 0.28 and cfg.loss_chunk_size is None and cfg.min_p == 0.0
    old = GRPOKitConfig(output_dir=str(tmp_path)).to_dict()
    old.update(epsilon_high=0.0, loss_chunk_size=0, vllm_gpu_memory_utilization=0.0, min_p=0.0)
    import yaml

    (tmp_path / "config.yaml").write_text(yaml.safe_dump(old, sort_keys=False))
    resumed = resume_config(tmp_path)
    assert all(getattr(resumed, name) is None for name in NULL_MEANS_AUTO) and resumed.min_p == 0.0
    assert resume_config(tmp_path, ["loss_chunk_size=4096"]).loss_chunk_size == 4096


def test_full_fine_tuning_with_a_kl_term_needs_a_checkpoint_folder(tmp_path):
    """TRL loads the reference model for full fine-tuning from the policy's folder: a random built-in has none, so
    the config refuses it up front (with what to change) instead of failing inside from_pretrained."""
    with pytest.raises(
        ConfigError,
        match=r"use_lora=False with beta=0.04 needs a reference model.*'tiny-llama' is a "
        r"random-weight built-in.*Set beta=0, or use_lora=True",
    ):
        GRPOKitConfig(model="tiny-llama", use_lora=False).validate()
    GRPOKitConfig(model="tiny-llama", use_lora=False, beta=0).validate()
    GRPOKitConfig(model="tiny-llama").validate()  # LoRA: the reference is the adapter switched off
    GRPOKitConfig(use_lora=False).validate()  # the embedded model has its folder


def test_scoring_batch_size_is_checked():
    with pytest.raises(ConfigError, match=r"scoring_batch_size.*at least 1"):
        GRPOKitConfig(scoring_batch_size=0).validate()
    with pytest.raises(ConfigError, match=r"scoring_batch_size=4 needs trainer='grpo_kit'"):
        GRPOKitConfig(scoring_batch_size=4, trainer="trl").validate()
    GRPOKitConfig(scoring_batch_size=4).validate()
    assert GRPOKitConfig().scoring_batch_size == "auto"  # the calculator's choice, also with TRL's trainer (none)
    GRPOKitConfig(trainer="trl").validate()
    for raw, want in (("8", 8), ("auto", "auto"), ("AUTO", "auto"), ("null", None)):
        assert GRPOKitConfig().apply_overrides([f"scoring_batch_size={raw}"]).scoring_batch_size == want
    with pytest.raises(ConfigError, match=r"scoring_batch_size='most' is not allowed: an integer, 'auto' or null"):
        GRPOKitConfig().apply_overrides(["scoring_batch_size=most"])
    with pytest.raises(ConfigError, match=r"scoring_batch_size=2\.5 must be an integer at least 1 \(or 'auto'"):
        GRPOKitConfig().apply_overrides(["scoring_batch_size=2.5"])


def test_trl_named_fields_have_trl_defaults_unless_listed_and_reach_grpo_config():
    import dataclasses

    import torch
    from trl import GRPOConfig

    from grpo_kit.app.config import KIT_DEFAULTS_OVER_TRL, KIT_ONLY_TRL_NAMES
    from grpo_kit.app.run import grpo_args

    trl = {f.name: f for f in dataclasses.fields(GRPOConfig)}
    cfg = GRPOKitConfig()
    for name in {f.name for f in dataclasses.fields(cfg)} & set(trl):
        default = (
            trl[name].default_factory() if trl[name].default_factory is not dataclasses.MISSING else trl[name].default
        )
        if name in KIT_DEFAULTS_OVER_TRL:
            assert getattr(cfg, name) == KIT_DEFAULTS_OVER_TRL[name] != default, name
        else:
            assert getattr(cfg, name) == default, name
    assert set(KIT_DEFAULTS_OVER_TRL) <= set(trl)
    cfg.apply_overrides(
        [
            "loss_type=sapo",
            "sapo_temperature_neg=1.2",
            "importance_sampling_level=sequence",
            "delta=1.5",
            "top_entropy_quantile=0.5",
            "max_steps=7",
            "vllm_importance_sampling_mode=token_mask",
        ]
    )
    args = grpo_args(cfg.validate(), "cpu", torch.float32)
    assert (
        args.loss_type,
        args.sapo_temperature_neg,
        args.importance_sampling_level,
        args.delta,
        args.top_entropy_quantile,
        args.max_steps,
        args.use_bias_correction_kl,
        args.vllm_importance_sampling_mode,
    ) == ("sapo", 1.2, "sequence", 1.5, 0.5, 7, False, "token_mask")
    assert all(name in trl for name in KIT_ONLY_TRL_NAMES)


def test_every_objective_option_is_a_config_field_checked_by_the_objective():
    import dataclasses

    from grpo_kit.loss.objective import ObjectiveSpec

    names = {f.name for f in dataclasses.fields(GRPOKitConfig)}
    assert {f.name for f in dataclasses.fields(ObjectiveSpec)} - names == {"epsilon_low"}  # TRL's epsilon
    with pytest.raises(
        ConfigError,
        match=r"top_entropy_quantile=2\.0 is not allowed: top_entropy_quantile must be "
        r"in \[0, 1\]",
    ):
        GRPOKitConfig().apply_overrides(["top_entropy_quantile=2"]).validate()
    with pytest.raises(
        ConfigError,
        match=r"importance_sampling_level='word' is not allowed; choose one of "
        r"\['token', 'sequence'\]",
    ):
        GRPOKitConfig().apply_overrides(["importance_sampling_level=word"]).validate()


def test_help_config_prints_every_field(capsys):
    import dataclasses

    from grpo_kit.app.cli import main

    assert main(["train", "--help-config"]) == 0
    out = capsys.readouterr().out
    for f in dataclasses.fields(GRPOKitConfig):
        assert f"\n{f.name}: " in "\n" + out, f.name
    assert "loss_type: str = \"grpo\"  [one of ['grpo'" in out
    assert "bench/results" not in out


def _gpu(monkeypatch, name: str | None, capability=(9, 0)):
    """Make torch see one CUDA GPU ``name`` of ``capability`` (what fp8_support reads); None: no CUDA device."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: name is not None)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: capability)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: name)


@pytest.mark.parametrize(
    "name,cap,device,match",
    [
        (
            None,
            None,
            "cpu",
            r"base_weights='fp8': FP8 base weights need a CUDA GPU .*the device is cpu, which trains with "
            r"16-bit base weights only",
        ),
        (None, None, "auto", r"the device is cpu"),
        (
            "Tesla T4",
            (7, 5),
            "auto",
            r"the Tesla T4 \(compute capability 7.5\) has none .* use 16-bit base weights \(fp16\) "
            r"or load_in_4bit",
        ),
        ("Tesla V100-SXM2-16GB", (7, 0), "cuda", r"V100.*compute capability 7.0.*\(fp16\) or load_in_4bit"),
        ("NVIDIA A100-SXM4-80GB", (8, 0), "cuda", r"A100.*compute capability 8.0.*\(bf16\) or load_in_4bit"),
    ],
)
def test_fp8_base_weights_are_refused_where_the_device_has_no_fp8(monkeypatch, name, cap, device, match):
    _gpu(monkeypatch, name, cap)
    cfg = GRPOKitConfig().apply_overrides(["base_weights=fp8", f"device={device}"])
    with pytest.raises(ConfigError, match=match) as e:
        cfg.validate()
    assert str(e.value).count("base_weights") == 1  # one clear message


@pytest.mark.parametrize(
    "name,cap", [("NVIDIA H100 80GB HBM3", (9, 0)), ("NVIDIA L4", (8, 9)), ("NVIDIA B200", (10, 0))]
)
def test_fp8_base_weights_validate_on_gpus_with_fp8(monkeypatch, name, cap):
    _gpu(monkeypatch, name, cap)
    cfg = GRPOKitConfig().apply_overrides(["base_weights=fp8"]).validate()
    assert cfg.base_weights == "fp8"
    GRPOKitConfig(base_weights="fp8", device="cuda").validate()


def test_fp8_base_weights_plan_vllm_on_their_shared_codes_with_the_adapter_in_lora_kernels(monkeypatch, tmp_path):
    """On an FP8 GPU the plan starts vLLM's FP8 engine on shared weights (the one FP8 copy) with the adapter in its
    LoRA kernels (null vllm_lora_sync resolves to 'adapter'); without sharing it generates with HF."""
    import torch

    import grpo_kit.generation.plan as P
    from grpo_kit.model.loading import model_config

    _gpu(monkeypatch, "NVIDIA H100 80GB HBM3")
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *a: (79 * 2**30, 80 * 2**30))
    monkeypatch.setattr("grpo_kit.generation.vllm_available", lambda: True)
    monkeypatch.setenv("GRPO_KIT_CACHE", str(tmp_path))
    cfg = GRPOKitConfig(model="tiny-llama", base_weights="fp8", max_completion_length=64).validate()
    assert P.lora_sync_mode(cfg) == "adapter"
    plan = P.plan_generation(cfg, model_config=model_config("tiny-llama"), device="cuda", dtype=torch.bfloat16)
    assert plan.backend == "vllm" and plan.share_weights
    assert plan.vllm_kwargs["base_weights"] == "fp8" and plan.vllm_kwargs["lora_sync"] == "adapter"
    copy = GRPOKitConfig(
        model="tiny-llama", base_weights="fp8", vllm_share_weights=False, max_completion_length=64
    ).validate()
    plan = P.plan_generation(copy, model_config=model_config("tiny-llama"), device="cuda", dtype=torch.bfloat16)
    assert plan.backend == "hf" and "only on shared weights" in plan.reason


@pytest.mark.parametrize(
    "overrides,match",
    [
        (["use_lora=false", "beta=0"], r"base_weights='fp8' needs use_lora=True: the FP8 base weights are frozen"),
        (["load_in_4bit=true"], r"base_weights='fp8' and load_in_4bit=True .* choose one"),
        (["vllm_lora_sync=merge"], r"base_weights='fp8' with vllm_lora_sync='merge': a merge into the FP8 weights"),
        (["generation_backend=vllm", "vllm_share_weights=false"], r"needs vllm_share_weights 'auto' or true"),
        (["base_weights=fp16"], r"base_weights='fp16' is not allowed; choose one of \['16bit', 'fp8'\]"),
        (["fp8_block=64"], r"fp8_block=64 is not allowed; choose one of \[128\] or null"),
        (["base_weights=16bit", "fp8_block=128"], r"fp8_block=128 applies to base_weights='fp8' only"),
    ],
)
def test_fp8_base_weights_refuse_what_they_cannot_do(monkeypatch, overrides, match):
    _gpu(monkeypatch, "NVIDIA H100 80GB HBM3")
    with pytest.raises(ConfigError, match=match):
        GRPOKitConfig().apply_overrides(["base_weights=fp8", *overrides]).validate()


def test_every_field_is_declared_with_its_help_and_the_objectives_options_match_objective_spec():
    """The class body lists every field: the kit's own each with help text in config_help.FIELD_HELP (and no help
    for a field that is gone), the objective's further options exactly ObjectiveSpec's (name, type, default unless
    the kit's own), so YAML and --set reach each option of the objective."""
    import dataclasses

    from grpo_kit.app.config import KIT_DEFAULTS_OVER_TRL, OBJECTIVE_FIELDS, OBJECTIVE_RENAMES
    from grpo_kit.app.config_help import FIELD_HELP
    from grpo_kit.loss.objective import ObjectiveSpec

    fields = {f.name: f for f in dataclasses.fields(GRPOKitConfig)}
    assert set(FIELD_HELP) == set(fields) - set(OBJECTIVE_FIELDS)
    spec = {f.name: f for f in dataclasses.fields(ObjectiveSpec) if f.name not in OBJECTIVE_RENAMES}
    assert set(OBJECTIVE_FIELDS) == set(spec) - set(FIELD_HELP)
    for name in spec:
        assert str(fields[name].type) == str(spec[name].type), name
    for name in OBJECTIVE_FIELDS:
        assert fields[name].default == KIT_DEFAULTS_OVER_TRL.get(name, spec[name].default), name
