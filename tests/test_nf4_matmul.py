"""The kit's 4-bit matmul (grpo_kit.model.nf4_matmul) on bitsandbytes' CPU backend: the same logits and LoRA gradients
as bitsandbytes' own Linear4bit (Llama, and Qwen2 with its q/k/v biases), with and without offloaded
checkpointing; each weight dequantised once per decoder-layer call under the kit's checkpointing, however many
token slices the layer runs in; no dequantised weight kept for backward outside it, and inside it only the cached
one; and the config's option."""

import importlib.util

import pytest
import torch
from peft import LoraConfig, get_peft_model

from grpo_kit.app.config import ConfigError, GRPOKitConfig
from grpo_kit.model import nf4_matmul as NM
from grpo_kit.model.loading import load_model
from grpo_kit.model.offload import enable_offloaded_checkpointing
from grpo_kit.model.quantize import is_quantized

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("bitsandbytes") is None, reason="bitsandbytes is not installed"
)
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
IDS = torch.randint(3, 1000, (2, 40), generator=torch.Generator().manual_seed(0))


def _step(name, impl, checkpointing, chunk_tokens=30, dtype=torch.float32):
    """Dequantisations and results of a reference pass (adapter off, no grad) and a policy forward/backward."""
    model, _ = load_model(name, load_in_4bit=True, device="cpu", nf4_matmul=impl, dtype=dtype)
    assert model.grpo_kit_quantization["nf4_matmul"] == impl
    g = torch.Generator().manual_seed(3)
    for m in model.modules():  # Qwen2's q/k/v biases start at zero: give them values the matmul must add
        if is_quantized(m) and m.bias is not None:
            m.bias.data = (torch.randn(m.bias.shape, generator=g) * 0.1).to(m.bias.dtype)
    torch.manual_seed(0)
    pm = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS, init_lora_weights=False))
    # train mode, as in training: in eval mode bitsandbytes repacks a layer for AVX512-BF16 CPUs at its first
    # no-grad call, after which only its own forward reads it (the counts below would depend on the CPU)
    pm.train()
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
    assert NM._open_cache() is None  # every layer's weights released
    grads = {n: p.grad for n, p in pm.named_parameters() if p.requires_grad}
    return counts, ref, out.logits.detach(), grads


@pytest.mark.parametrize(
    "name,dtype",
    [("tiny-llama", torch.float32), ("tiny-qwen2", torch.float32), ("tiny-qwen2", torch.bfloat16)],
    ids=str,
)
@pytest.mark.parametrize("checkpointing", [False, True])
def test_the_kit_matmul_gives_bitsandbytes_results(name, dtype, checkpointing):
    _, ref_b, logits_b, grads_b = _step(name, "bitsandbytes", checkpointing, dtype=dtype)
    counts, ref_k, logits_k, grads_k = _step(name, "kit", checkpointing, dtype=dtype)
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


def test_inside_a_layer_call_autograd_saves_the_cached_weight():
    """Within a layer cache (the kit's checkpointing) the matmul is a plain ``F.linear`` on the cached weight:
    what autograd saves of the weight's size is that very tensor (nothing more held), its backward is autograd's
    own rather than the Function's Python one, and the gradient is the Function's to the bit."""
    layer = _layer(torch.float32)
    layer = NM.with_nf4_matmul(layer, "kit")
    x = torch.randn(3, 5, 70, generator=torch.Generator().manual_seed(8))
    xc, saved = x.clone().requires_grad_(), []
    with NM.layer_weight_cache():
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
            y = layer(xc)
        cached = NM._open_cache()[layer]
        assert not isinstance(y.grad_fn, NM._NF4Matmul._backward_cls)
        weights = [t for t in saved if t.numel() == cached.numel()]  # the weight or its transposed view
        assert weights and all(t.data_ptr() == cached.data_ptr() for t in weights)
        y.square().sum().backward()
    xo = x.clone().requires_grad_()
    yo = layer(xo)  # no cache: the Function, which saves no weight
    assert isinstance(yo.grad_fn, NM._NF4Matmul._backward_cls)
    yo.square().sum().backward()
    assert torch.equal(y.detach(), yo.detach()) and torch.equal(xc.grad, xo.grad)


def _layer(compute_dtype, bias=True, weight_dtype=torch.float32):
    import bitsandbytes as bnb

    g = torch.Generator().manual_seed(5)
    layer = bnb.nn.Linear4bit(70, 33, bias=bias, compute_dtype=compute_dtype, quant_type="nf4")
    layer.weight = bnb.nn.Params4bit(
        (torch.randn(33, 70, generator=g) * 0.05).to(weight_dtype),
        requires_grad=False,
        quant_type="nf4",
        compress_statistics=True,
    )
    if bias:
        layer.bias = torch.nn.Parameter(torch.randn(33, generator=g) * 0.1, requires_grad=False)
    return layer.to("cpu")


def _run(layer, impl, x, **autocast):
    import copy

    layer = copy.deepcopy(layer)
    layer = NM.with_nf4_matmul(layer, impl)
    x = x.clone().requires_grad_()
    with torch.autocast("cpu", **autocast) if autocast else torch.enable_grad():
        y = layer(x)
    y.float().square().sum().backward()
    return y.detach(), x.grad


@pytest.mark.parametrize(
    "compute_dtype,x_dtype",
    [(None, torch.bfloat16), (None, torch.float32), (torch.bfloat16, torch.float32), (torch.float32, torch.bfloat16)],
    ids=str,
)
def test_one_layer_follows_bitsandbytes_dtype_rules(compute_dtype, x_dtype):
    """Compute dtype set or not (bitsandbytes then takes the input's), input in another dtype, a bias, leading
    dimensions: the output and input gradient bitsandbytes' Linear4bit gives, in the input's dtype."""
    layer = _layer(compute_dtype)
    x = torch.randn(2, 5, 70, generator=torch.Generator().manual_seed(6)).to(x_dtype)
    (yb, gb), (yk, gk) = _run(layer, "bitsandbytes", x), _run(layer, "kit", x)
    assert yk.dtype == yb.dtype == x_dtype and torch.equal(yk, yb)
    assert torch.equal(gk, gb)


def test_autocast_forward_with_backward_outside_it():
    """An fp32 layer run under bf16 autocast, backward outside it: the gradient comes back in another dtype than
    the forward's, which bitsandbytes casts for (so does the kit); and a second backward with retain_graph."""
    layer = _layer(torch.float32)
    x = torch.randn(4, 70, generator=torch.Generator().manual_seed(7))
    (yb, gb), (yk, gk) = (_run(layer, impl, x, dtype=torch.bfloat16) for impl in ("bitsandbytes", "kit"))
    assert torch.allclose(yk.float(), yb.float(), rtol=2e-2, atol=1e-2) and torch.allclose(gk, gb, rtol=2e-2, atol=1e-2)
    layer = NM.with_nf4_matmul(layer, "kit")
    y = layer(x.clone().requires_grad_())
    y.sum().backward(retain_graph=True)
    y.sum().backward()


def test_a_model_with_the_kit_matmul_pickles(tmp_path):
    model, _ = load_model("tiny-llama", load_in_4bit=True, device="cpu")
    assert type(model.model.layers[0].mlp.up_proj).__name__ == "KitLinear4bit"
    torch.save(model, tmp_path / "m.pt")
    back = torch.load(tmp_path / "m.pt", weights_only=False)
    with torch.no_grad():
        assert torch.equal(back(input_ids=IDS).logits, model(input_ids=IDS).logits)


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
    import bitsandbytes as bnb

    assert (
        NM.use_nf4_matmul(model, "bitsandbytes") == 14 and type(model.model.layers[0].mlp.up_proj) is bnb.nn.Linear4bit
    )
    # bitsandbytes' subclasses keep their class under the kit's (isinstance holds) and get it back; a class with a
    # forward of its own is left alone
    nf4 = bnb.nn.LinearNF4(64, 32, compute_dtype=torch.float32)
    nf4.weight = bnb.nn.Params4bit(torch.randn(32, 64), requires_grad=False, quant_type="nf4")
    nf4 = torch.nn.Sequential(nf4.to("cpu"))
    assert NM.use_nf4_matmul(nf4, "kit") == 1 and type(nf4[0]).__name__ == "KitLinearNF4"
    assert isinstance(nf4[0], bnb.nn.LinearNF4) and NM.KitLinearNF4 is type(nf4[0])
    assert NM.use_nf4_matmul(nf4, "kit") == 1 and type(nf4[0]).__name__ == "KitLinearNF4"  # idempotent
    assert NM.use_nf4_matmul(nf4, "bitsandbytes") == 1 and type(nf4[0]) is bnb.nn.LinearNF4

    class Own(bnb.nn.Linear4bit):
        def forward(self, x):
            return super().forward(x)

    own = torch.nn.Sequential(Own(64, 32))
    assert NM.use_nf4_matmul(own, "kit") == 0 and type(own[0]) is Own
    with pytest.raises(
        ConfigError, match=r"load_in_4bit_matmul='fast' is not allowed; choose one of \['kit', 'bitsandbytes'\]"
    ):
        GRPOKitConfig(load_in_4bit_matmul="fast").validate()
    assert GRPOKitConfig.field_help()["load_in_4bit_matmul"]


def test_a_kernel_that_cannot_run_falls_back_to_bitsandbytes_once(monkeypatch):
    """Where the kernel's probe raises (no Triton backend for the GPU, say), the layer dequantises through
    bitsandbytes with one warning, and the probe is not tried again."""
    from grpo_kit.kernels import nf4_dequant as K

    calls = []

    def broken(device, dtype):
        calls.append(device)
        raise RuntimeError("no backend")

    monkeypatch.setattr(K, "triton_usable", lambda *a: True)
    monkeypatch.setattr(K, "kernel_matches_bitsandbytes", broken)
    monkeypatch.setattr(NM, "_warned", set())
    layer = _layer(torch.float32)
    layer = NM.with_nf4_matmul(layer, "kit")
    x = torch.randn(3, 70, requires_grad=True)
    with pytest.warns(UserWarning, match="could not run .RuntimeError: no backend.*through bitsandbytes"):
        y = layer(x)
    layer(x).sum().backward()
    assert len(calls) == 1 and torch.isfinite(y).all()


def test_a_subclass_of_the_kit_class_does_not_recurse():
    """Wrappers that subclass a layer's class after the swap (FSDP2, parametrisations) reach bitsandbytes' forward
    through the recorded base class, not super(type(self)), which would call the kit's forward again."""
    layer = _layer(torch.float32)
    layer = NM.with_nf4_matmul(layer, "kit")
    layer.__class__ = type("Wrapped", (type(layer),), {})  # as such a wrapper does (not the kit)
    with torch.no_grad():
        assert layer(torch.randn(2, 70)).shape == (2, 33)
    seq = torch.nn.Sequential(layer)
    assert NM.use_nf4_matmul(seq, "bitsandbytes") == 0 and seq[0] is layer  # someone else's class now: left alone
    assert NM.with_nf4_matmul(layer, "bitsandbytes") is layer


def test_no_object_changes_class():
    """Switching the matmul replaces each 4-bit layer in its parent (PEFT's LoRA layers included) by a new module
    holding the same parameter and quant-state objects; no live object's class changes, both ways."""
    import bitsandbytes as bnb

    model, _ = load_model("tiny-llama", load_in_4bit=True, device="cpu", nf4_matmul="bitsandbytes")
    pm = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS))
    for impl, cls in (("kit", NM.KitLinear4bit), ("bitsandbytes", bnb.nn.Linear4bit)):
        before = {
            name: (m, type(m), m.weight, m.weight.quant_state, m.bias)
            for name, m in pm.named_modules()
            if is_quantized(m)
        }
        types_before = [(m, type(m)) for m in pm.modules()]
        assert NM.use_nf4_matmul(pm, impl) == len(before) == 14
        assert all(type(m) is t for m, t in types_before)  # every object keeps its class
        after = {name: m for name, m in pm.named_modules() if is_quantized(m)}
        assert after.keys() == before.keys()
        for name, (old, _, weight, qs, bias) in before.items():
            new = after[name]
            assert new is not old and type(new) is cls
            assert new.weight is weight and new.weight.quant_state is qs and new.bias is bias  # nothing copied
            assert weight.module in (None, new)  # bitsandbytes' back-reference, where set, follows the layer
    layer = pm.base_model.model.model.layers[0].self_attn.q_proj
    assert type(layer.get_base_layer()) is bnb.nn.Linear4bit  # PEFT's LoRA layer holds the replacement
    assert NM.use_nf4_matmul(pm, "bitsandbytes") == 14  # already: nothing replaced
    assert layer.get_base_layer() is after["base_model.model.model.layers.0.self_attn.q_proj.base_layer"]
