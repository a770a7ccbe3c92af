"""The kit's 4-bit matmul (grpo_kit.nf4_matmul) on bitsandbytes' CPU backend: the same logits and LoRA gradients
as bitsandbytes' own Linear4bit (Llama, and Qwen2 with its q/k/v biases), with and without offloaded
checkpointing; each weight dequantised once per decoder-layer call under the kit's checkpointing, however many
token slices the layer runs in; no dequantised weight kept for backward outside it; and the config's option."""

import importlib.util

import pytest
import torch
from peft import LoraConfig, get_peft_model

from grpo_kit import nf4_matmul as NM
from grpo_kit.checkpointing import enable_offloaded_checkpointing
from grpo_kit.config import ConfigError, GRPOKitConfig
from grpo_kit.models import load_model
from grpo_kit.quantize import is_quantized

pytestmark = pytest.mark.skipif(importlib.util.find_spec("bitsandbytes") is None,
                                reason="bitsandbytes is not installed")
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
IDS = torch.randint(3, 1000, (2, 40), generator=torch.Generator().manual_seed(0))


def _step(name, impl, checkpointing, chunk_tokens=30):
    """Dequantisations and results of a reference pass (adapter off, no grad) and a policy forward/backward."""
    model, _ = load_model(name, load_in_4bit=True, device="cpu", nf4_matmul=impl)
    assert model.grpo_kit_quantization["nf4_matmul"] == impl
    torch.manual_seed(0)
    pm = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS, init_lora_weights=False))
    if checkpointing:  # 2 x 40 tokens in slices of 30 // 2 = 15 tokens: three slices per layer
        enable_offloaded_checkpointing(pm, _offload_on_cpu=True, chunk_tokens=chunk_tokens)
    NM.reset_stats()
    with torch.no_grad(), pm.disable_adapter():
        ref = pm(input_ids=IDS, use_cache=False).logits  # as the trainer calls it
    counts = [NM.reset_stats()["dequantized"]]
    out = pm(input_ids=IDS, labels=IDS)
    counts.append(NM.reset_stats()["dequantized"])
    out.loss.backward()
    counts.append(NM.reset_stats()["dequantized"])
    assert NM._cache is None  # every layer's weights released
    grads = {n: p.grad for n, p in pm.named_parameters() if p.requires_grad}
    return counts, ref, out.logits.detach(), grads


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen2"])
@pytest.mark.parametrize("checkpointing", [False, True])
def test_the_kit_matmul_gives_bitsandbytes_results(name, checkpointing):
    _, ref_b, logits_b, grads_b = _step(name, "bitsandbytes", checkpointing)
    counts, ref_k, logits_k, grads_k = _step(name, "kit", checkpointing)
    assert torch.equal(ref_k, ref_b) and torch.equal(logits_k, logits_b)
    assert grads_k.keys() == grads_b.keys() and len(grads_k) == 2 * 7 * 2
    for n in grads_k:  # the same dequantised weight and the same matmuls: the same bits on this backend
        assert torch.equal(grads_k[n], grads_b[n]), n
    layers, linears = 2, 7
    if checkpointing:  # once per layer call: reference pass, forward, recompute + backward (three slices each)
        assert counts == [layers * linears] * 3
    else:  # no grad outside a layer call: bitsandbytes' own forward; with grad each matmul dequantises in
        # forward and backward, but layer 0's q/k/v, whose input needs no gradient (frozen embeddings and norm)
        assert counts == [0, layers * linears - 3, layers * linears - 3]


def test_no_dequantised_weight_is_kept_for_backward():
    """Outside a layer cache the matmul saves the input, not the 16-bit weight: autograd would otherwise hold
    the whole model in 16 bit until backward."""
    model, _ = load_model("tiny-llama", load_in_4bit=True, device="cpu")
    pm = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS))
    shapes = {tuple(m.weight.quant_state.shape) for m in pm.modules() if is_quantized(m)}
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(tuple(t.shape)) or t, lambda t: t):
        pm(input_ids=IDS, labels=IDS).loss.backward()
    assert shapes and saved and not shapes & set(saved)


def test_generation_uses_bitsandbytes_own_forward():
    """HF generate (no grad, outside the kit's layer calls): no dequantisation of the kit's; bitsandbytes
    multiplies the decoding step's few rows with the 4-bit weight directly. The same tokens either way."""
    tokens = {}
    for impl in ("kit", "bitsandbytes"):
        model, _ = load_model("tiny-llama", load_in_4bit=True, device="cpu", nf4_matmul=impl)
        NM.reset_stats()
        tokens[impl] = model.generate(IDS[:, :8], max_new_tokens=6, do_sample=False, pad_token_id=0)
        assert NM.reset_stats()["dequantized"] == 0
    assert torch.equal(tokens["kit"], tokens["bitsandbytes"])


def test_the_matmul_option_is_checked():
    model, _ = load_model("tiny-llama", load_in_4bit=True, device="cpu")
    with pytest.raises(ValueError, match=r"nf4 matmul 'fast' is not allowed: one of kit, bitsandbytes"):
        NM.use_nf4_matmul(model, "fast")
    with pytest.raises(ValueError, match=r"nf4_matmul='fast' is not allowed: one of kit, bitsandbytes"):
        load_model("tiny-llama", load_in_4bit=True, device="cpu", nf4_matmul="fast")
    assert NM.use_nf4_matmul(model, "bitsandbytes") == 14 and "forward" not in model.model.layers[0].mlp.up_proj.__dict__
    with pytest.raises(ConfigError, match=r"load_in_4bit_matmul='fast' is not allowed: one of \['kit', 'bitsandbytes'\]"):
        GRPOKitConfig(load_in_4bit_matmul="fast").validate()
    assert GRPOKitConfig.field_help()["load_in_4bit_matmul"]
