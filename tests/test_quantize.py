"""4-bit base weights (grpo_kit.model.quantize): NF4 layers, LoRA gradients against a dequantised reference, the
`auto` skip rule, a real quantised training step (bitsandbytes' CPU backend), and the config's refusals."""

import copy
import importlib.util

import pytest
import torch
from peft import LoraConfig, get_peft_model

from grpo_kit.app.config import ConfigError, GRPOKitConfig
from grpo_kit.kernels.nf4_dequant import NF4_BITS_PER_PARAM
from grpo_kit.model.loading import build_random_model, load_model
from grpo_kit.model.quantize import (
    auto_skip_modules,
    dequantized_weight,
    is_quantized,
    layer_errors,
    nf4_roundtrip,
    quantizable_linears,
    quantize_model,
)

bnb_missing = importlib.util.find_spec("bitsandbytes") is None
needs_bnb = pytest.mark.skipif(bnb_missing, reason="bitsandbytes is not installed")
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _ids(n=2, t=24, seed=0):
    return torch.randint(3, 1000, (n, t), generator=torch.Generator().manual_seed(seed))


@needs_bnb
@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen2"])
def test_quantize_replaces_the_linears_but_the_head_and_the_skipped(name):
    model = build_random_model(name)
    n_down = sum(1 for n in quantizable_linears(model) if n.endswith("down_proj"))
    weights = sum(model.get_submodule(n).weight.numel() for n in quantizable_linears(model, ["down_proj"]))
    report = quantize_model(model, compute_dtype=torch.float32, device="cpu", skip_modules=["down_proj"])
    assert report["quantized_layers"] == 7 * 2 - n_down
    assert sorted(report["kept_16bit"]) == sorted(["lm_head", *[f"model.layers.{i}.mlp.down_proj" for i in range(2)]])
    assert all(
        is_quantized(model.get_submodule(n)) for n in quantizable_linears(build_random_model(name), ["down_proj"])
    )
    # the bytes held are NF4's 4 bits + double-quantised absmax (nf4_dequant.NF4_BITS_PER_PARAM) per weight, plus
    # each tensor's 256-entry fp32 code of the second quantisation (1 KiB: noise beside an 8B's weights)
    n = report["quantized_layers"]
    assert report["quantized_weight_bytes"] == pytest.approx(weights * NF4_BITS_PER_PARAM / 8 + n * 1024, rel=0.02)
    assert torch.isfinite(model(input_ids=_ids()).logits).all()


@needs_bnb
def test_nf4_roundtrip_is_what_the_layer_multiplies_with():
    model = build_random_model("tiny-llama")
    w = model.model.layers[0].mlp.up_proj.weight.detach().clone()
    quantize_model(model, compute_dtype=torch.float32, device="cpu")
    assert torch.equal(dequantized_weight(model.model.layers[0].mlp.up_proj), nf4_roundtrip(w))
    err = (nf4_roundtrip(w) - w).abs().mean() / w.abs().mean()
    assert 0.01 < err < 0.2  # NF4 really rounds (16 levels per block), and not wildly


def _dense_twin(qmodel):
    """The quantised model with each Linear4bit replaced by a plain fp32 Linear holding its dequantised weight."""
    ref = copy.deepcopy(qmodel)
    for name, m in list(ref.named_modules()):
        if is_quantized(m):
            lin = torch.nn.Linear(m.in_features, m.out_features, bias=m.bias is not None)
            lin.weight.data = dequantized_weight(m).float().clone()
            if m.bias is not None:
                lin.bias.data = m.bias.data.float().clone()
            parent, _, child = name.rpartition(".")
            setattr(ref.get_submodule(parent), child, lin)
    return ref


@needs_bnb
@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen2"])
def test_lora_gradients_under_nf4_equal_the_dequantised_reference(name):
    """LoRA's gradients with NF4 base weights equal those with the same weights dequantised to fp32:
    bitsandbytes dequantises for each matmul, so the only difference is the order of float operations
    (tolerance 1e-4 relative to each gradient's largest entry)."""
    q = build_random_model(name)
    quantize_model(q, compute_dtype=torch.float32, device="cpu")
    ref = _dense_twin(q)
    grads = []
    for m in (q, ref):
        torch.manual_seed(0)
        pm = get_peft_model(m, LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS, init_lora_weights=False))
        out = pm(input_ids=_ids(), labels=_ids())
        out.loss.backward()
        grads.append({n: p.grad for n, p in pm.named_parameters() if p.requires_grad})
    assert grads[0].keys() == grads[1].keys() and len(grads[0]) == 2 * 7 * 2
    for n in grads[0]:
        g, r = grads[0][n], grads[1][n]
        assert (g - r).abs().max() <= 1e-4 * r.abs().max(), n


@needs_bnb
def test_auto_keeps_the_layer_nf4_hurts_most_within_the_allowance():
    model = build_random_model("tiny-llama")
    # the last layer's down_proj: its output feeds no other candidate (boosting an earlier layer would also
    # give the layers after it outlier inputs, which the rule rightly counts against them)
    bad = "model.layers.1.mlp.down_proj"
    with torch.no_grad():  # one huge weight per 64-block: its absmax crushes the block's other weights to ~0
        w = model.get_submodule(bad).weight
        w.view(-1, 64)[:, 0] *= 200.0
    errors = layer_errors(model, [_ids()])
    assert max(errors, key=errors.get) == bad and errors[bad] > 3 * sorted(errors.values())[-2]
    extra = model.get_submodule(bad).weight.numel() * (4 - NF4_BITS_PER_PARAM / 8)  # fp32 minus NF4
    chosen, report = auto_skip_modules(model, [_ids()], allowance_bytes=extra, dtype_bytes=4)
    assert chosen == [bad] and report["extra_bytes"] <= extra
    chosen, _ = auto_skip_modules(model, [_ids()], allowance_bytes=0, dtype_bytes=4)
    assert chosen == []  # nothing fits a zero allowance
    roomy, report = auto_skip_modules(model, [_ids()], allowance_bytes=3 * extra, dtype_bytes=4)
    assert roomy[0] == bad and len(roomy) > 1 and report["extra_bytes"] <= 3 * extra


def test_auto_ranks_by_error_per_extra_byte(monkeypatch):
    """A big layer with the largest error loses to two small layers whose error per extra byte is higher
    and that together cost what it costs (ranking by error alone would keep the big one)."""
    import grpo_kit.model.quantize as Q

    model = build_random_model("tiny-llama")
    big, small = "model.layers.0.mlp.down_proj", ["model.layers.0.self_attn.k_proj", "model.layers.1.self_attn.v_proj"]
    errors = {n: 0.01 for n in quantizable_linears(model)}
    errors.update({big: 0.30, small[0]: 0.20, small[1]: 0.20})  # k/v: 32x64 weights, down_proj: 64x160 (5x)
    monkeypatch.setattr(Q, "layer_errors", lambda *a, **k: dict(errors))
    per_weight = 4 - NF4_BITS_PER_PARAM / 8
    allowance = model.get_submodule(big).weight.numel() * per_weight
    chosen, report = auto_skip_modules(model, [_ids()], allowance_bytes=allowance, dtype_bytes=4)
    assert set(small) <= set(chosen) and big not in chosen
    assert report["extra_bytes"] <= allowance and "per extra" in report["rule"]
    # with room for everything it keeps it too
    chosen, _ = auto_skip_modules(model, [_ids()], allowance_bytes=allowance * 3, dtype_bytes=4)
    assert big in chosen


@needs_bnb
def test_a_quantised_grpo_step_trains_lora_only(tmp_path):
    from trl import GRPOConfig

    from grpo_kit.tasks.data import generate_tasks, to_prompt_dataset
    from grpo_kit.tasks.rewards import completion_text
    from grpo_kit.trainer.grpo_trainer import EfficientGRPOTrainer

    model, tok = load_model(
        "tiny-llama",
        load_in_4bit=True,
        skip_modules="auto",
        device="cpu",
        calibration=[_ids(1, 16)],
        auto_allowance=0.05,
    )
    report = model.grpo_kit_quantization
    assert report["skip_modules"] == "auto" and report["auto"]["extra_bytes"] <= report["auto"]["allowance_bytes"]
    tok.padding_side = "left"
    args = GRPOConfig(
        output_dir=str(tmp_path / "out"),
        per_device_train_batch_size=4,
        num_generations=4,
        max_completion_length=6,
        beta=0.04,
        report_to="none",
        use_cpu=True,
        max_steps=2,
        use_bias_correction_kl=False,
        bf16=False,
        learning_rate=5e-3,
        logging_steps=1,
        save_strategy="no",
        disable_tqdm=True,
        seed=0,
    )
    trainer = EfficientGRPOTrainer(
        model=model,
        args=args,
        processing_class=tok,
        reward_funcs=[lambda prompts, completions, **kw: [len(completion_text(c)) % 5 / 4 for c in completions]],
        train_dataset=to_prompt_dataset(generate_tasks("arithmetic", 8, seed=0)),
        peft_config=LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS),
    )
    packed = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.dtype == torch.uint8}
    lora = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}
    trainer.train()
    params = dict(trainer.model.named_parameters())
    assert packed and all(torch.equal(params[n], v) for n, v in packed.items())  # NF4 data untouched
    assert lora and all(not torch.equal(params[n], v) for n, v in lora.items() if "lora_B" in n)
    assert all(torch.isfinite(torch.tensor(h["loss"])) for h in trainer.state.log_history if "loss" in h)


@needs_bnb
@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen2"])
def test_a_random_built_in_is_built_in_4bit_on_the_device_without_its_16_bit_model(name, monkeypatch):
    """Random built-ins with a fixed skip list start on the meta device and get each linear weight on the device
    just before it is quantised: the same layers quantised and kept as the host-RAM path's, the same
    parameter names, initialised as transformers initialises them (normal(0, 0.02), ones for norms, zeros for
    biases, the padding row zero), tied weights still tied, and a finite forward."""
    import grpo_kit.model.loading as M
    from grpo_kit.model.quantize import dequantized_weight, is_quantized, quantizable_linears

    monkeypatch.setattr(M, "build_random_model", None)  # the host-RAM build must not run
    model, _ = load_model(name, load_in_4bit=True, skip_modules=["down_proj"], device="cpu")
    ref = M.meta_model(M.model_config(name))
    quantized = sorted(n for n, m in model.named_modules() if is_quantized(m))
    assert quantized == sorted(quantizable_linears(ref, ["down_proj"])) and quantized
    assert model.grpo_kit_quantization["kept_16bit"][-1] == "lm_head"
    assert "random, built and quantised layer by layer" in model.grpo_kit_quantization["load"]
    assert sorted(n for n, _ in model.named_parameters()) == sorted(n for n, _ in ref.named_parameters())
    assert not any(p.is_meta for p in model.parameters()) and not any(b.is_meta for b in model.buffers())
    assert abs(dequantized_weight(model.get_submodule(quantized[0])).float().std().item() - 0.02) < 0.003
    assert torch.equal(model.model.norm.weight, torch.ones_like(model.model.norm.weight))
    emb = model.get_input_embeddings()
    assert abs(emb.weight.std().item() - 0.02) < 0.003
    if emb.padding_idx is not None:
        assert not emb.weight[emb.padding_idx].any()
    biases = [m.bias for m in model.modules() if getattr(m, "bias", None) is not None]
    assert all(not b.any() for b in biases) and (biases or name == "tiny-llama")  # Qwen2's q/k/v have biases
    assert (model.lm_head.weight is emb.weight) == bool(model.config.tie_word_embeddings)
    with torch.no_grad():
        assert torch.isfinite(model(input_ids=_ids(1, 12)).logits).all()


def _cfg(**kw):
    return GRPOKitConfig(**kw).validate()


def test_config_refuses_4bit_where_it_cannot_train(monkeypatch):
    with pytest.raises(ConfigError, match="load_in_4bit=True needs use_lora=True: 4-bit weights are frozen"):
        _cfg(load_in_4bit=True, use_lora=False)
    with pytest.raises(ConfigError, match="load_in_4bit=True needs a CUDA GPU .* but device='cpu'"):
        _cfg(load_in_4bit=True, device="cpu")
    with pytest.raises(ConfigError, match="load_in_4bit=True generates with HF generate"):
        _cfg(load_in_4bit=True, generation_backend="vllm")
    with pytest.raises(ConfigError, match=r"load_in_4bit_skip_modules=\['', 'x'\] is not allowed"):
        _cfg(load_in_4bit_skip_modules=["", "x"])
    with pytest.raises(ConfigError, match=r"load_in_4bit_auto_allowance=-1 must be in \[0, 4\]"):
        _cfg(load_in_4bit_auto_allowance=-1)
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == "bitsandbytes" else real(n, *a))
    with pytest.raises(ConfigError, match=r"needs the bitsandbytes package, which is not installed: python -m pip"):
        _cfg(load_in_4bit=True)


def test_skip_modules_auto_parses_from_yaml_and_cli(tmp_path):
    cfg = GRPOKitConfig().apply_overrides(["load_in_4bit_skip_modules=auto"])
    assert cfg.load_in_4bit_skip_modules == "auto"
    cfg = GRPOKitConfig().apply_overrides(["load_in_4bit_skip_modules=lm_head,down_proj"])
    assert cfg.load_in_4bit_skip_modules == ["lm_head", "down_proj"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only refusal")
def test_4bit_on_a_cpu_only_machine_is_refused_in_validation_before_loading(tmp_path, monkeypatch):
    from grpo_kit.app import run
    from grpo_kit.model import loading as models

    monkeypatch.setattr(models, "load_model", lambda *a, **k: pytest.fail("a model was loaded"))
    cfg = GRPOKitConfig(load_in_4bit=True, output_dir=str(tmp_path / "run"), max_steps=1)
    with pytest.raises(ConfigError, match="load_in_4bit=True needs a CUDA GPU .* device='auto' finds none"):
        run.train(cfg)
    assert not (tmp_path / "run").exists()  # refused before the run folder was made


@needs_bnb
def test_a_checkpoint_loads_streamed_with_the_same_nf4_as_the_in_ram_path():
    """A checkpoint with a list of skip names loads through transformers' bitsandbytes quantisation (each weight
    quantised as it is read; host RAM never holds the 16-bit model): the same layers in NF4, the same kept
    ones under the kit's substring rule (a prefix, a suffix, a middle part), the same packed codes and absmax
    constants as quantising the 16-bit model in RAM."""
    import grpo_kit.model.loading as M

    skip = ["lm_head", "down_proj", "model.layers.0.", "self_attn.k"]
    streamed, _ = load_model(device="cpu", load_in_4bit=True, skip_modules=skip)
    in_ram, _ = M.load_model(device="cpu")
    M._quantize(in_ram, torch.float32, "cpu", skip, None, 0.1)
    a, b = streamed.grpo_kit_quantization, in_ram.grpo_kit_quantization
    assert a["load"] == "streamed" and b["load"].startswith("in host RAM")
    assert a["kept_16bit"] == b["kept_16bit"] and a["quantized_layers"] == b["quantized_layers"] > 0
    assert a["quantized_weight_bytes"] == b["quantized_weight_bytes"]
    kept = set(a["kept_16bit"])
    assert {
        "lm_head",
        "model.layers.3.mlp.down_proj",
        "model.layers.0.mlp.up_proj",
        "model.layers.5.self_attn.k_proj",
    } <= kept and "model.layers.5.self_attn.q_proj" not in kept
    mods_a, mods_b = dict(streamed.named_modules()), dict(in_ram.named_modules())
    for name, m in mods_b.items():
        if is_quantized(m):  # compared before any forward (bitsandbytes' CPU backend repacks at the first one)
            qa, qb = mods_a[name].weight, m.weight
            assert is_quantized(mods_a[name]) and torch.equal(qa.data.flatten(), qb.data.flatten()), name
            assert torch.equal(qa.quant_state.absmax, qb.quant_state.absmax), name
            assert torch.equal(qa.quant_state.state2.absmax, qb.quant_state.state2.absmax), name
