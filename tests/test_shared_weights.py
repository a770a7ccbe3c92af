"""The training model on an engine's tensors (:mod:`grpo_kit.generation.shared_weights`), on the CPU.

vLLM's CPU build repacks its linear weights, so a real engine cannot be shared here (the GPU tier,
``tests/test_gpu_vllm.py``, does that with vLLM on CUDA). These tests build vLLM's layout from a
real HF model the way vLLM's loader does (``q/k/v`` rows stacked into ``qkv_proj``, ``gate/up`` into
``gate_up_proj``, the vocabulary padded to a multiple of 64, LoRA wrappers keeping ``base_layer``),
then check that the shared model aliases those tensors and computes what the original computes.
"""

import pytest
import torch
from torch import nn

from grpo_kit.generation.shared_weights import UnshareableError, build_shared_model, engine_views, shared_storage
from grpo_kit.model.loading import build_random_model, model_config

PACKED = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}


class Fused(nn.Module):
    def __init__(self, parts: list[nn.Linear]):
        super().__init__()
        self.output_sizes = [p.out_features for p in parts]
        self.weight = nn.Parameter(torch.cat([p.weight.detach() for p in parts]).clone(), requires_grad=False)
        if parts[0].bias is not None:
            self.bias = nn.Parameter(torch.cat([p.bias.detach() for p in parts]).clone(), requires_grad=False)


class Plain(nn.Module):
    def __init__(self, weight: torch.Tensor, pad_rows: int = 0):
        super().__init__()
        w = torch.cat([weight.detach(), torch.full((pad_rows, weight.shape[1]), float("nan"))]) if pad_rows else weight
        self.weight = nn.Parameter(w.detach().clone(), requires_grad=False)


class LoRAWrapper(nn.Module):  # what vLLM's *WithLoRA layers look like from outside
    def __init__(self, base):
        super().__init__()
        self.base_layer = base


def engine_like(hf, *, lora_wrappers: bool, pad: int = 64) -> nn.Module:
    """vLLM's module tree for HF Llama/Qwen2 model ``hf``, holding copies of its weights."""
    eng = nn.Module()
    eng.packed_modules_mapping = PACKED
    eng.model = nn.Module()
    vocab = hf.config.vocab_size
    extra = -vocab % pad
    wrap = LoRAWrapper if lora_wrappers else (lambda m: m)
    eng.model.embed_tokens = wrap(Plain(hf.model.embed_tokens.weight, extra))
    eng.model.norm = Plain(hf.model.norm.weight)
    eng.model.layers = nn.ModuleList()
    for layer in hf.model.layers:
        e = nn.Module()
        e.self_attn, e.mlp = nn.Module(), nn.Module()
        at, mlp = layer.self_attn, layer.mlp
        e.self_attn.qkv_proj = wrap(Fused([at.q_proj, at.k_proj, at.v_proj]))
        e.self_attn.o_proj = wrap(Plain(at.o_proj.weight))
        e.mlp.gate_up_proj = wrap(Fused([mlp.gate_proj, mlp.up_proj]))
        e.mlp.down_proj = wrap(Plain(mlp.down_proj.weight))
        e.input_layernorm = Plain(layer.input_layernorm.weight)
        e.post_attention_layernorm = Plain(layer.post_attention_layernorm.weight)
        eng.model.layers.append(e)
    eng.lm_head = eng.model.embed_tokens if hf.config.tie_word_embeddings else wrap(Plain(hf.lm_head.weight, extra))
    return eng


@pytest.mark.parametrize("name,wrappers", [("tiny-llama", False), ("tiny-llama", True), ("tiny-qwen2", True)])
def test_shared_model_aliases_the_engine_and_computes_the_same(name, wrappers):
    hf = build_random_model(name, dtype=torch.float32, seed=3).eval()
    eng = engine_like(hf, lora_wrappers=wrappers)
    shared = build_shared_model(eng, model_config(name), torch.float32).eval()
    report = shared_storage(shared, eng)
    assert report["other_params"] == 0 and report["shared_params"] == len(list(shared.parameters()))
    assert not any(p.requires_grad for p in shared.parameters()) and shared.grpo_kit_shared_weights
    first = eng.model.layers[0]
    q, k = shared.model.layers[0].self_attn.q_proj.weight, shared.model.layers[0].self_attn.k_proj.weight
    qkv = getattr(first.self_attn.qkv_proj, "base_layer", first.self_attn.qkv_proj).weight
    assert q.data_ptr() == qkv.data_ptr() and k.data_ptr() == qkv.data_ptr() + q.numel() * q.element_size()
    if hf.config.tie_word_embeddings:  # one tensor: the head is the embedding
        assert shared.lm_head.weight is shared.model.embed_tokens.weight
    ids = torch.randint(0, hf.config.vocab_size, (2, 11))
    with torch.no_grad():
        assert torch.equal(shared(input_ids=ids).logits, hf(input_ids=ids).logits)
    with torch.no_grad():  # a write through the engine is seen by the training model: one copy
        qkv.mul_(0.5)
    with torch.no_grad():
        assert not torch.equal(shared(input_ids=ids).logits, hf(input_ids=ids).logits)


def test_lora_on_the_shared_model_trains_adapters_only():
    from peft import LoraConfig, get_peft_model

    hf = build_random_model("tiny-llama", dtype=torch.float32, seed=1)
    eng = engine_like(hf, lora_wrappers=True)
    before = {n: p.detach().clone() for n, p in eng.named_parameters()}
    model = get_peft_model(
        build_shared_model(eng, model_config("tiny-llama"), torch.float32),
        LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"]),
    )
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    for _ in range(2):
        loss = model(input_ids=torch.randint(0, 1000, (2, 9)), labels=torch.randint(0, 1000, (2, 9))).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
    assert all(torch.equal(before[n], p) for n, p in eng.named_parameters())  # engine weights untouched
    assert any("lora_B" in n and p.abs().sum() > 0 for n, p in model.named_parameters())


def test_layouts_that_cannot_be_shared_say_which_weight_and_why():
    hf = build_random_model("tiny-llama", dtype=torch.float32)
    params = {n: (tuple(p.shape), p.dtype) for n, p in hf.named_parameters()}
    eng = engine_like(hf, lora_wrappers=False)
    with pytest.raises(
        UnshareableError,
        match=r"model.embed_tokens.weight: engine dtype torch.float32, "
        r"training dtype torch.bfloat16",
    ):
        engine_views(eng, {n: (s, torch.bfloat16) for n, (s, _) in params.items()})
    eng.packed_modules_mapping = {}
    with pytest.raises(UnshareableError, match=r"q_proj.weight: no engine module model.layers.0.self_attn.q_proj"):
        engine_views(eng, params)
    eng = engine_like(hf, lora_wrappers=False)
    eng.model.layers[1].mlp.down_proj.weight = nn.Parameter(torch.zeros(3, 3), requires_grad=False)
    with pytest.raises(UnshareableError, match=r"layers.1.mlp.down_proj.weight: engine shape \(3, 3\)"):
        engine_views(eng, params)
    eng = engine_like(hf, lora_wrappers=False)
    eng.model.layers[0].mlp.gate_up_proj.output_sizes = [160]
    with pytest.raises(UnshareableError, match=r"fused gate_up_proj does not split into \['gate_proj', 'up_proj'\]"):
        engine_views(eng, params)
