"""Offloaded checkpointing: gradients equal to no checkpointing and to HF's standard
(non-reentrant) checkpointing, on tiny Llama / Qwen2 / Mistral, with and without LoRA,
over 2 accumulated micro-batches; lifecycle (enable twice, disable, no_grad, eval/train).
Every other family (whole-layer mode, chunked MLP): tests/test_families.py.

The CPU has no CUDA streams, so the offload copies are exercised with ``_offload_on_cpu``
(the same pool / prefetch code, CPU -> CPU copies)."""

import gc
import weakref

import pytest
import torch
from torch import nn

from grpo_kit.model import offload as ck
from grpo_kit.model.offload import (
    disable_offloaded_checkpointing,
    enable_offloaded_checkpointing,
    offload_stats,
    reserve_offload_buffers,
)

peft = pytest.importorskip("peft")


def _tiny(name: str, layers: int = 3, dtype=torch.float32):
    from transformers import AutoConfig, MistralConfig

    from grpo_kit.model.loading import BUILTIN_MODELS, build_random_model

    if name == "tiny-mistral":
        cfg = MistralConfig(
            vocab_size=128,
            hidden_size=32,
            intermediate_size=80,
            num_hidden_layers=layers,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=8,
            sliding_window=None,
            max_position_embeddings=256,
        )
    else:
        spec = BUILTIN_MODELS[name]
        # vocab 128 keeps the logits small; the layers are what is under test
        kw = dict(spec.config, vocab_size=128, num_hidden_layers=layers)
        cfg = AutoConfig.for_model(spec.model_type, **kw)
    cfg._attn_implementation = "sdpa"
    cfg.use_cache = False
    return build_random_model(cfg, dtype=dtype, seed=0)


ALL_LINEARS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _lora(model, dropout=0.0, targets=ALL_LINEARS):
    torch.manual_seed(1)
    conf = peft.LoraConfig(
        r=4, lora_alpha=8, lora_dropout=dropout, init_lora_weights=False, target_modules=list(targets)
    )
    return peft.get_peft_model(model, conf)


def _batches(vocab=128, B=2, T=13, pad=False):
    g = torch.Generator().manual_seed(2)
    out = []
    for _ in range(2):
        ids = torch.randint(3, vocab, (B, T), generator=g)
        mask = torch.ones(B, T, dtype=torch.long)
        if pad:
            mask[0, :4] = 0  # left padding on one row: a real 4D mask reaches attention
        out.append((ids, mask))
    return out


def _grads(model, mode, batches, *, seed=3, **kw):
    """Train-mode gradients of every trainable parameter after 2 accumulated micro-batches."""
    model.train()
    if mode == "hf":
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    elif mode == "ours":
        enable_offloaded_checkpointing(model, **kw)
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    for ids, mask in batches:
        labels = ids.masked_fill(mask == 0, -100)
        loss = model(input_ids=ids, attention_mask=mask, labels=labels, use_cache=False).loss / len(batches)
        loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    if mode == "hf":
        model.gradient_checkpointing_disable()
    elif mode == "ours":
        disable_offloaded_checkpointing(model)
    return grads


def _assert_close(ref, got, tol):
    assert ref.keys() == got.keys() and len(ref) > 0
    for n in ref:
        r, g = ref[n].double(), got[n].double()
        assert torch.isfinite(g).all(), n
        denom = r.norm().clamp_min(1e-30)
        assert r.norm() > 0, f"{n}: zero reference gradient, the check would be empty"
        rel = ((r - g).norm() / denom).item()
        assert rel <= tol, f"{n}: relative error {rel:.3g} > {tol}"


# fp64: any real difference shows; fp32: the slices sum the weight gradients in another
# order, and the fp32 reference itself sits ~2e-6 (relative) from the fp64 result on these
# models (measured), so 1e-6 against it would test rounding, not correctness.
TOL = {torch.float64: 1e-12, torch.float32: 5e-6}
OURS = dict(_offload_on_cpu=True, min_bytes=0, chunk_tokens=6)  # 6 tokens / 2 rows -> 5 slices of 13


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen2", "tiny-mistral"])
@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_gradients_match_none_and_hf(name, lora, dtype):
    if dtype == torch.float32 and not lora and name != "tiny-llama":
        pytest.skip("fp32 full fine-tuning: covered by tiny-llama; fp64 covers every architecture (CI time)")
    model = _tiny(name, dtype=dtype)
    if lora:
        model = _lora(model).to(dtype)
    batches = _batches(pad=(name == "tiny-qwen2"))
    ref = _grads(model, "none", batches)
    hf = _grads(model, "hf", batches)
    ours = _grads(model, "ours", batches, **OURS)
    _assert_close(ref, hf, 1e-6 if dtype == torch.float32 else TOL[dtype])
    _assert_close(ref, ours, TOL[dtype])
    if lora:
        assert all("lora_" in n for n in ours)


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen2"])
@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_fp32_unsliced_within_1e6(name, lora):
    """The issue's fp32 bound, 1e-6 relative, holds for the offloaded wrapper itself (offload copies
    and recompute) when each sequence is recomputed in one slice; only slicing (above) reorders sums."""
    model = _tiny(name)
    if lora:
        model = _lora(model)
    batches = _batches(pad=(name == "tiny-qwen2"))
    ref = _grads(model, "none", batches)
    _assert_close(ref, _grads(model, "ours", batches, _offload_on_cpu=True, min_bytes=0, chunk_tokens=100000), 1e-6)


@pytest.mark.parametrize("kw", [dict(offload=False), dict(prefetch=False, **OURS), dict(chunk_tokens=100000)])
def test_gradients_other_options(kw):
    model = _lora(_tiny("tiny-llama"))
    batches = _batches()
    _assert_close(_grads(model, "none", batches), _grads(model, "ours", batches, **kw), TOL[torch.float32])


@pytest.mark.parametrize("targets", [["q_proj", "v_proj"], ["k_proj"], ["o_proj"], ["gate_proj", "down_proj"]])
def test_lora_on_some_linears_only(targets):
    """LoRA on part of the layer: in the first layer (frozen embeddings, no input gradient) the projections without
    an adapter have no graph; the recompute leaves them out instead of failing ("does not require grad")."""
    model = _lora(_tiny("tiny-llama"), targets=targets)
    batches = _batches()
    ours = _grads(model, "ours", batches, **OURS)
    _assert_close(_grads(model, "none", batches), ours, TOL[torch.float32])
    assert {n.split(".")[-4] for n in ours} == set(targets)  # ...q_proj.lora_A.default.weight


def test_lora_dropout_recomputes_with_same_masks():
    # Active dropout: whole-layer recompute with the forward's RNG state restored.
    model = _lora(_tiny("tiny-llama"), dropout=0.3)
    batches = _batches()
    ref = _grads(model, "none", batches)
    _assert_close(ref, _grads(model, "hf", batches), 1e-6)
    _assert_close(ref, _grads(model, "ours", batches, **OURS), TOL[torch.float32])


def test_eval_train_switch_and_no_grad_output():
    model = _lora(_tiny("tiny-qwen2"))
    ids, mask = _batches()[0]
    model.eval()
    with torch.no_grad():
        want = model(input_ids=ids, attention_mask=mask).logits
    enable_offloaded_checkpointing(model, **OURS)
    with torch.no_grad():
        got = model(input_ids=ids, attention_mask=mask).logits
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    # eval with grad, then train with grad: both give the plain gradients
    disable_offloaded_checkpointing(model)
    batches = _batches()
    ref = _grads(model, "none", batches)
    enable_offloaded_checkpointing(model, **OURS)
    model.eval()
    model.zero_grad(set_to_none=True)
    for b_ids, b_mask in batches:
        (model(input_ids=b_ids, attention_mask=b_mask, labels=b_ids).loss / 2).backward()
    _assert_close(ref, {n: p.grad for n, p in model.named_parameters() if p.requires_grad}, TOL[torch.float32])
    disable_offloaded_checkpointing(model)


def _layers(model):
    return ck.decoder_layers(model)


def _offloader(model):
    return _layers(model)[0].__dict__[ck._STATE_ATTR]["offloader"]


def test_enable_twice_and_disable_round_trip():
    model = _lora(_tiny("tiny-llama"))
    layers = _layers(model)
    sentinel = layers[1].forward  # an instance attribute already there must come back as is
    layers[1].forward = sentinel
    enable_offloaded_checkpointing(model)
    off = _offloader(model)
    enable_offloaded_checkpointing(model, chunk_tokens=4)  # harmless: same offloader, new options
    assert _offloader(model) is off and off.chunk_tokens == 4
    for layer in layers:
        assert layer.forward.__func__ is ck._wrapped_forward
        assert layer.__dict__[ck._STATE_ATTR]["orig_forward"].__func__ is type(layer).forward
    disable_offloaded_checkpointing(model)
    assert "forward" not in layers[0].__dict__ and layers[0].forward.__func__ is type(layers[0]).forward
    assert layers[1].__dict__["forward"] is sentinel
    assert all(ck._STATE_ATTR not in l.__dict__ for l in layers)
    disable_offloaded_checkpointing(model)  # second disable: no-op


def test_hf_flag_switched_off_and_restored():
    model = _tiny("tiny-llama")
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    enable_offloaded_checkpointing(model)
    assert not any(l.gradient_checkpointing for l in _layers(model))
    disable_offloaded_checkpointing(model)
    assert all(l.gradient_checkpointing for l in _layers(model))


def test_no_grad_pass_saves_nothing_and_takes_no_buffers():
    model = _lora(_tiny("tiny-llama"))
    enable_offloaded_checkpointing(model, **OURS)
    ids, mask = _batches()[0]
    off = _offloader(model)
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask).logits
    assert not out.requires_grad and out.grad_fn is None
    assert off._last is None and offload_stats(model)["host_bytes"] == 0
    disable_offloaded_checkpointing(model)


def test_dropped_graph_frees_saved_inputs_and_returns_buffers():
    model = _lora(_tiny("tiny-llama"))
    enable_offloaded_checkpointing(model, **OURS)
    ids, mask = _batches()[0]
    off = _offloader(model)
    out = model(input_ids=ids, attention_mask=mask).logits
    rec = off._last()
    assert rec is not None
    host = weakref.ref(rec.prev.host)  # the second-to-last layer's input was offloaded
    rec = None
    n_offloaded = len(_layers(model)) - 1  # the last layer keeps its input on the device
    assert offload_stats(model)["free_buffers"] == 0
    del out
    gc.collect()
    assert off._last() is None
    assert host() is not None  # a buffer outlives its record: it is back in the pool for reuse
    assert offload_stats(model)["free_buffers"] == n_offloaded
    # the next pass reuses them (no new host memory)
    before = offload_stats(model)["host_bytes"]
    model(input_ids=ids, attention_mask=mask).logits.sum().backward()
    assert offload_stats(model)["host_bytes"] == before
    disable_offloaded_checkpointing(model)
    gc.collect()
    assert host() is None  # disable releases the pool


def test_backward_frees_records():
    model = _lora(_tiny("tiny-llama"))
    enable_offloaded_checkpointing(model, **OURS)
    ids, mask = _batches()[0]
    off = _offloader(model)
    model(input_ids=ids, attention_mask=mask).logits.sum().backward()
    gc.collect()
    assert off._last() is None
    disable_offloaded_checkpointing(model)


def test_pageable_fallback_warns():
    if torch.cuda.is_available():
        pytest.skip("needs a machine where page-locking fails (CPU-only torch)")
    model = _lora(_tiny("tiny-llama"))
    enable_offloaded_checkpointing(model, pin_memory=True, _offload_on_cpu=True, min_bytes=0)
    ids, mask = _batches()[0]
    with pytest.warns(RuntimeWarning, match="pageable"):
        model(input_ids=ids, attention_mask=mask).logits.sum().backward()
    assert offload_stats(model)["pinned_bytes"] == 0 and offload_stats(model)["host_bytes"] > 0
    disable_offloaded_checkpointing(model)


def test_unmappable_model_names_what_was_not_found():
    with pytest.raises(ValueError, match="enable_offloaded_checkpointing: Sequential: no decoder body"):
        enable_offloaded_checkpointing(nn.Sequential(nn.Linear(2, 2)))


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen2", "tiny-mistral"])
def test_the_three_first_families_keep_the_split_layers(name):
    """Their per-token work stays sliced (the long-context memory figures rest on it): the probe picks ``split``."""
    model = enable_offloaded_checkpointing(_lora(_tiny(name)), **OURS)
    assert ck.layer_modes(model) == {"split": 3}


@pytest.mark.parametrize("kw", [dict(chunk_tokens=0), dict(min_bytes=-1), dict(offload="yes"), dict(chunk_tokens=2.5)])
def test_bad_arguments(kw):
    with pytest.raises(ValueError, match=next(iter(kw))):
        enable_offloaded_checkpointing(_tiny("tiny-llama", layers=1), **kw)


@pytest.mark.parametrize(
    "T, B, c",
    [
        (13, 2, 6),
        (1, 4, 1),
        (100, 1, 100),
        (7, 3, 100),
        (4608, 1, 4096),
        (4097, 1, 4096),
        (20992, 1, 4096),
        (10000, 3, 4096),
        (300, 1, 100),
    ],
)
def test_slices_cover_sequence_in_fewest_bounded_slices(T, B, c):
    parts = ck._slices(T, B, c)
    seen = torch.zeros(T, dtype=torch.long)
    for s in parts:
        seen[s] += 1
    assert (seen == 1).all()
    t_max = max(1, c // B)
    lengths = [s.stop - s.start for s in parts]
    assert max(lengths) <= t_max and len(parts) == -(-T // t_max)  # memory bound kept, no extra slice
    assert all(n % ck._SLICE_ALIGN == 0 for n in lengths[:-1]) or max(lengths) == t_max


def test_slices_split_evenly_instead_of_leaving_a_small_tail():
    assert [s.stop - s.start for s in ck._slices(4608, 1, 4096)] == [2304, 2304]  # not 4096 + 512


def test_reserve_buffers_then_no_new_host_memory():
    model = _lora(_tiny("tiny-llama"))
    ids, mask = _batches()[0]
    with pytest.raises(ValueError, match="enable_offloaded_checkpointing"):
        reserve_offload_buffers(model, 2, 13)
    enable_offloaded_checkpointing(model, **OURS)
    with pytest.raises(ValueError, match="seq_len"):
        reserve_offload_buffers(model, 2, 0)
    reserved = reserve_offload_buffers(model, *ids.shape)
    assert reserved > 0 and offload_stats(model)["free_buffers"] == len(_layers(model)) - 1
    assert reserve_offload_buffers(model, *ids.shape) == reserved  # idempotent
    model(input_ids=ids, attention_mask=mask).logits.sum().backward()
    assert offload_stats(model)["host_bytes"] == reserved
    disable_offloaded_checkpointing(model)
    enable_offloaded_checkpointing(model, offload=False)
    assert reserve_offload_buffers(model, *ids.shape) == 0
    disable_offloaded_checkpointing(model)


def test_auto_chunk_size():
    from transformers import AutoModelForCausalLM

    from grpo_kit.model.loading import model_config

    for name, want in (("llama-3.1-8b", 4096), ("qwen2.5-1.5b", 4096), ("llama-3.2-1b", 8192)):
        cfg = model_config(name)
        cfg.num_hidden_layers = 1
        with torch.device("meta"):
            layer = AutoModelForCausalLM.from_config(cfg).model.layers[0]
        assert ck._auto_chunk_tokens(layer.mlp) == want, name
