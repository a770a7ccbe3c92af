"""The LoRA merge into the shared base weights and its exact undo (grpo_kit.generation.reversible_merge).

The merged weight is round(W + scale * B @ A) computed wide (checked against that formula's bits); the restore
gives every original bit back, including the elements the plain reverse rounding misses (signed zeros, NaNs,
tiny weights, binade crossings); changed factors or a delta that is not recomputed identically are refused
loudly; a PEFT model generates like PEFT's own merge while merged and is bit-identical to before after.
"""

import copy

import pytest
import torch

from grpo_kit.generation import reversible_merge as rm
from grpo_kit.kernels import lora_merge as K


def _bits(t):
    return t.view(K._SAME_SIZE_INT[t.element_size()]).clone()


def _factors(out_f, in_f, r, size, seed=0):
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(r, in_f, generator=g)
    b = torch.randn(out_f, r, generator=g) * size
    return [(a, b, 0.5)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("shape", [(37, 53), (8, 1), (129, 64)])
def test_merge_is_the_rounded_sum_and_restore_gives_every_bit_back(dtype, shape, monkeypatch):
    monkeypatch.setattr(K, "CHUNK_ELEMENTS", 500)  # several row blocks even for small shapes
    monkeypatch.setattr(rm, "MAX_KEPT_SHARE", 1.0)  # a delta far larger than the weights: exact all the same
    g = torch.Generator().manual_seed(1)
    w = (torch.randn(shape, generator=g) * 0.02).to(dtype)
    flat = w.view(-1)
    flat[0], flat[-1] = -0.0, float("nan")  # -0 + 0 rounds to +0; NaN payloads are not kept by arithmetic
    flat[1 % flat.numel()] = 1e-30 if dtype != torch.float16 else 1e-7  # tiny next to the delta
    original = _bits(w)
    factors = _factors(shape[0], shape[1], 4, 0.05)  # a large delta: many elements need the kept values
    b, a = K.fold_factors(factors, "cpu", K._wide(dtype))
    expect = (w.to(b.dtype) + b @ a).to(dtype)  # the whole matrix at once; the pass works in row blocks
    saved = rm.merge_weight(w, factors)
    differ = _bits(w) != _bits(expect)
    assert differ.float().mean() < 1e-2  # a block's matmul may round a last bit differently: rare ties only
    assert (
        (w.float() - expect.float()).abs()[differ & ~expect.isnan()]
        <= expect.float().abs()[differ & ~expect.isnan()] * 2**-7 + 1e-30
    ).all()
    assert saved.kept > 0 and saved.positions.device.type == "cpu" == saved.values.device.type
    rm.restore_weight(w, saved)
    assert torch.equal(_bits(w), original)


def test_small_deltas_keep_few_elements():
    g = torch.Generator().manual_seed(2)
    w = (torch.randn(512, 512, generator=g) * 0.02).to(torch.bfloat16)
    original = _bits(w)
    a = torch.randn(8, 512, generator=g) * 0.02
    b = torch.randn(512, 8, generator=g)
    d = b @ a
    b *= 1e-3 * 0.02 / d.abs().mean()  # a delta 1e-3 times the weights' mean size
    saved = rm.merge_weight(w, [(a, b, 1.0)])
    assert 0 < saved.kept < 0.01 * w.numel()  # seen: 0.26% (normal weights, std 0.02)
    assert saved.positions.dtype == torch.int32
    rm.restore_weight(w, saved)
    assert torch.equal(_bits(w), original)


def test_a_failure_inside_a_weight_gives_its_merged_rows_back(monkeypatch):
    monkeypatch.setattr(K, "CHUNK_ELEMENTS", 64)  # 8 rows per block
    w = (torch.randn(40, 8) * 0.02).to(torch.bfloat16)
    original = _bits(w)
    real, calls = K.merge_rows_torch, []

    def failing(weight, b, a, start, end):  # the third row block runs out of memory before it is written
        blocks = real(weight, b, a, start, end)
        while True:
            calls.append(1)
            if len(calls) == 3:
                raise torch.cuda.OutOfMemoryError("simulated")
            yield next(blocks)

    monkeypatch.setattr(K, "merge_rows_torch", failing)
    with pytest.raises(torch.cuda.OutOfMemoryError):
        rm.merge_weight(w, _factors(40, 8, 2, 3e-4))
    assert len(calls) == 3 and torch.equal(_bits(w), original)


def test_non_finite_factors_or_too_many_kept_elements_are_refused_before_any_write(monkeypatch):
    w = (torch.randn(40, 8) * 0.02).to(torch.bfloat16)
    original = _bits(w)
    factors = _factors(40, 8, 2, 3e-4)
    factors[0][1][30, 0] = float("nan")
    with pytest.raises(ValueError, match="not finite"):
        rm.merge_weight(w, factors, "q_proj")
    assert torch.equal(_bits(w), original)
    a, b, _ = _factors(40, 8, 2, 3e-4)[0]
    with pytest.raises(ValueError, match="not finite"):  # a NaN scale: the factors are finite, their product not
        rm.merge_weight(w, [(a, b, float("nan"))], "q_proj")
    assert torch.equal(_bits(w), original)
    monkeypatch.setattr(rm, "MAX_KEPT_SHARE", 1e-3)
    with pytest.raises(ValueError, match="would keep more than 0%.*vllm_lora_sync='adapter'"):
        rm.merge_weight(w, _factors(40, 8, 2, 5.0), "q_proj")
    assert torch.equal(_bits(w), original)


def test_rows_of_a_fused_tensor_merge_and_restore_without_touching_their_neighbours():
    fused = (torch.randn(48, 16) * 0.02).to(torch.bfloat16)  # as vLLM's qkv_proj: q, k, v row blocks
    original = _bits(fused)
    k = fused.narrow(0, 32, 8)
    saved = rm.merge_weight(k, _factors(8, 16, 2, 3e-4))
    assert torch.equal(_bits(fused)[:32], original[:32]) and torch.equal(_bits(fused)[40:], original[40:])
    assert not torch.equal(_bits(fused)[32:40], original[32:40])
    rm.restore_weight(k, saved)
    assert torch.equal(_bits(fused), original)


def test_checksum_sees_changes_that_cancel_in_a_plain_sum():
    w = (torch.randn(100) * 0.02).to(torch.bfloat16)
    v = w.clone()
    bits = v.view(torch.int16)
    bits[3] += 1
    bits[70] -= 1  # the int sum of the bit patterns is unchanged
    assert int(w.view(torch.int16).sum(dtype=torch.int64)) == int(bits.sum(dtype=torch.int64))
    assert rm.bit_sum(w) != rm.bit_sum(v)


def test_changed_factors_and_a_different_delta_are_refused():
    w = (torch.randn(16, 24) * 0.02).to(torch.bfloat16)
    factors = _factors(16, 24, 2, 0.01)
    saved = rm.merge_weight(w, factors)
    factors[0][1].add_(1.0)  # an optimiser step while merged
    with pytest.raises(rm.RestoreError, match="changed while merged"):
        rm.restore_weight(w, saved, "layer.q_proj")
    saved = rm.merge_weight(w := (torch.randn(16, 24) * 0.02).to(torch.bfloat16), factors := _factors(16, 24, 2, 0.01))
    factors[0][0].data.mul_(1.5)  # through .data (as a fused optimiser may): no version bump, the checksum sees it
    with pytest.raises(rm.RestoreError, match="changed while merged"):
        rm.restore_weight(w, saved, "layer.q_proj")

    w = (torch.randn(16, 24) * 0.02).to(torch.bfloat16)
    factors = _factors(16, 24, 2, 0.01)
    saved = rm.merge_weight(w, factors)
    saved.factors = [(factors[0][0], factors[0][1].clone() * 1.01, 0.5)]  # recomputed differently
    saved.factor_sum = rm._factor_sum(saved.factors)
    with pytest.raises(rm.RestoreError, match="checksums differ"):
        rm.restore_weight(w, saved, "layer.q_proj")


def test_a_restore_that_put_the_kept_values_back_succeeds_when_called_again():
    """A restore interrupted after a weight's kept values are back (before it was marked done) is retried: the
    weight no longer shows R at the kept positions, so the recorded checksum difference answers."""
    w = (torch.randn(64, 48) * 0.02).to(torch.bfloat16)
    original = _bits(w)
    saved = rm.merge_weight(w, _factors(64, 48, 4, 0.003))
    assert saved.kept > 0
    assert int(rm._restore(w, saved)) == 0 and torch.equal(_bits(w), original)
    rm.restore_weight(w, saved, "layer.q_proj")  # the retry
    assert torch.equal(_bits(w), original)


def test_non_contiguous_weight_is_refused():
    with pytest.raises(ValueError, match="contiguous"):
        rm.merge_weight(torch.zeros(8, 8, dtype=torch.bfloat16).t()[:, :4], _factors(8, 4, 2, 0.1))


def _peft_model(dtype, seed=0, **lora):
    from peft import LoraConfig, get_peft_model

    from grpo_kit.model.loading import build_random_model

    model = build_random_model("tiny-llama", dtype=dtype, seed=seed)
    cfg = LoraConfig(
        r=4,
        lora_alpha=8,
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        **lora,
    )
    pm = get_peft_model(model, cfg)
    with torch.no_grad():
        for n, p in pm.named_parameters():
            if "lora_B" in n:
                p.copy_(torch.randn(p.shape) * 0.005)  # a delta ~0.1 of the weights: a trained adapter's is ~0.001
    return pm.eval()


def _base_bits(pm):
    return {n: _bits(p.detach()) for n, p in pm.named_parameters() if "base_layer" in n}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_peft_model_merged_generates_like_peft_merge_and_comes_back_bit_identical(dtype):
    pm = _peft_model(dtype)
    before = _base_bits(pm)
    ids = torch.randint(0, 49152, (2, 11), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        lora_logits = pm(input_ids=ids).logits.float()
        reference = copy.deepcopy(pm).merge_and_unload()(input_ids=ids).logits.float()  # PEFT's own merge
    merge = rm.ReversibleLoraMerge(pm)
    info = merge.merge()
    assert merge.merged and info["weights"] == 14 and info["exceptions"] > 0 and info["exception_bytes"] > 0
    with torch.no_grad(), pm.disable_adapter():  # the base layers alone now hold W + B @ A
        merged_logits = pm(input_ids=ids).logits.float()
    tol = 1e-4 if dtype == torch.float32 else 0.1
    assert (merged_logits - reference).abs().max() < tol
    assert (merged_logits - lora_logits).abs().max() < tol
    assert any(not torch.equal(_bits(p.detach()), before[n]) for n, p in pm.named_parameters() if n in before)
    back = merge.restore()
    assert not merge.merged and back["weights"] == 14
    after = _base_bits(pm)
    assert all(torch.equal(after[n], before[n]) for n in before)
    assert merge.restore()["weights"] == 0  # nothing merged: a no-op


def test_a_failure_half_way_through_merge_restores_what_was_merged(monkeypatch):
    pm = _peft_model(torch.bfloat16)
    before = _base_bits(pm)
    real, calls = rm.merge_weight, []

    def failing(weight, factors, name, **kw):
        calls.append(1)
        if len(calls) == 5:
            raise torch.cuda.OutOfMemoryError("simulated")
        return real(weight, factors, name, **kw)

    monkeypatch.setattr(rm, "merge_weight", failing)
    merge = rm.ReversibleLoraMerge(pm)
    with pytest.raises(torch.cuda.OutOfMemoryError):
        merge.merge()
    assert not merge.merged
    after = _base_bits(pm)
    assert all(torch.equal(after[n], before[n]) for n in before)


def test_a_non_finite_adapter_is_refused_by_name_before_any_weight_is_merged():
    pm = _peft_model(torch.bfloat16)
    before = _base_bits(pm)
    name, p = next((n, p) for n, p in pm.named_parameters() if "layers.1.mlp.up_proj.lora_A" in n)
    with torch.no_grad():
        p[0, 3] = float("nan")
    merge = rm.ReversibleLoraMerge(pm)
    with pytest.raises(ValueError, match=r"layers\.1\.mlp\.up_proj.*not finite.*nothing was merged"):
        merge.merge()
    assert not merge.merged
    after = _base_bits(pm)
    assert all(torch.equal(after[n], before[n]) for n in before)


def test_rslora_and_two_active_adapters_merge_as_peft_computes_them():
    from peft import LoraConfig

    pm = _peft_model(torch.float32, use_rslora=True)
    pm.add_adapter("second", LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj", "down_proj"]))
    with torch.no_grad():
        for n, p in pm.named_parameters():
            if "lora_B.second" in n:
                p.copy_(torch.randn(p.shape) * 0.05)
    pm.base_model.set_adapter(["default", "second"])  # both active: PEFT adds both deltas
    before = _base_bits(pm)
    ids = torch.randint(0, 49152, (1, 9), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        lora_logits = pm(input_ids=ids).logits
    merge = rm.ReversibleLoraMerge(pm)
    merge.merge()
    with torch.no_grad(), pm.disable_adapter():
        merged_logits = pm(input_ids=ids).logits
    assert (merged_logits - lora_logits).abs().max() < 1e-4
    merge.restore()
    assert all(torch.equal(b, before[n]) for n, b in _base_bits(pm).items())


def test_adapters_that_cannot_be_merged_this_way_are_refused():
    from peft import LoraConfig, get_peft_model

    from grpo_kit.model.loading import build_random_model

    with pytest.raises(ValueError, match="LoRA variant.*vllm_lora_sync='adapter'"):
        rm.ReversibleLoraMerge(_peft_model(torch.float32, use_dora=True))
    with pytest.raises(ValueError, match="modules_to_save"):
        rm.ReversibleLoraMerge(_peft_model(torch.float32, modules_to_save=["lm_head"]))
    tied = get_peft_model(build_random_model("tiny-qwen2"), LoraConfig(r=2, target_modules=["q_proj", "lm_head"]))
    with pytest.raises(ValueError, match="lm_head.*tied to.*embed_tokens"):
        rm.ReversibleLoraMerge(tied)
    with pytest.raises(ValueError, match="no active LoRA layers"):
        from grpo_kit.model.loading import build_random_model

        rm.ReversibleLoraMerge(build_random_model("tiny-llama"))


class _FakeLLM:
    def __init__(self):
        self.prefix_resets = 0

    def reset_prefix_cache(self):
        self.prefix_resets += 1


def _merge_generator(pm):
    """A VLLMGenerator's merge path without an engine: shared weights are CUDA-only, so on the CPU the engine is
    a stand-in and ``_generate`` records what the weights were while it ran."""
    import weakref

    from grpo_kit.generation.sync import weight_manifest
    from grpo_kit.generation.vllm_backend import VLLMGenerator

    gen = object.__new__(VLLMGenerator)
    storages = [p.untyped_storage() for p in pm.parameters()]  # stand-ins for the engine's tensors
    gen.__dict__.update(
        llm=_FakeLLM(),
        share_weights=True,
        lora_sync="merge",
        _merge=None,
        last_merge=None,
        _lora_request=None,
        syncs=0,
        _closed=False,
        _sleeping=False,
        _tied=False,
        _checkpoint=weight_manifest(pm),
        _shared_params=[weakref.ref(p) for p in pm.parameters()],
        _engine_spans=[(s.data_ptr(), s.data_ptr() + s.nbytes()) for s in storages],
    )
    return gen


def test_generator_merges_only_inside_generate_and_restores_even_on_failure():
    from grpo_kit.generation.base import GenerationEngineError

    pm = _peft_model(torch.bfloat16)
    before = _base_bits(pm)
    gen = _merge_generator(pm)
    info = gen.sync_weights(pm)
    assert info["mode"] == "lora_merge_in_place" and info["weights"] == 14
    assert all(torch.equal(b, before[n]) for n, b in _base_bits(pm).items())  # a sync alone moves nothing
    seen = {}

    def generate(prompt_ids, num_generations, sampling, stop, timings):
        seen["merged"] = any(not torch.equal(b, before[n]) for n, b in _base_bits(pm).items())
        return "result"

    gen._generate = generate
    timings = {}
    assert gen._generate_merged([[1, 2]], 1, None, [2], timings) == "result"
    assert seen["merged"] and {"merge_s", "restore_s"} <= set(timings)
    assert all(torch.equal(b, before[n]) for n, b in _base_bits(pm).items())
    assert gen.llm.prefix_resets == 2 and gen.last_merge["weights"] == 14

    def crash(*args):
        raise GenerationEngineError("engine died")

    gen._generate = crash
    with pytest.raises(GenerationEngineError, match="engine died"):
        gen._generate_merged([[1, 2]], 1, None, [2], {})
    assert all(torch.equal(b, before[n]) for n, b in _base_bits(pm).items())  # restored on the way out

    def train_while_merged(*args):  # a restore that cannot give the bits back is an engine error
        with torch.no_grad():  # as an optimiser step writes a parameter
            next(p for n, p in pm.named_parameters() if "lora_B" in n).add_(1.0)

    gen._generate = train_while_merged
    with pytest.raises(GenerationEngineError, match="restore of the shared weights.*changed while merged"):
        gen._generate_merged([[1, 2]], 1, None, [2], {})
    assert gen._closed


def test_generator_merge_refuses_a_model_that_is_not_on_the_engines_tensors():
    pm = _peft_model(torch.float32)
    gen = _merge_generator(pm)
    gen._engine_spans = []  # as if pm had been loaded on its own, not built with training_model()
    with pytest.raises(ValueError, match="are not the engine's"):
        gen.sync_weights(pm)
    pm = _peft_model(torch.bfloat16)
    gen = _merge_generator(pm)
    gen.sync_weights(pm)
    pm.to(torch.float32)  # same Parameter objects, new storage: no longer the engine's tensors
    with pytest.raises(ValueError, match="do not move or cast it"):
        gen._generate_merged([[1, 2]], 1, None, [2], {})


def test_generator_restore_failing_part_way_is_an_engine_error_and_a_retry_finishes_it(monkeypatch):
    from grpo_kit.generation.base import GenerationEngineError

    pm = _peft_model(torch.bfloat16)
    before = _base_bits(pm)
    gen = _merge_generator(pm)
    gen.sync_weights(pm)
    real, calls = K.restore_rows_torch, []

    def flaky(weight, b, a, start, end):  # the restore of the third weight runs out of memory
        calls.append(1)
        if len(calls) == 3:
            raise torch.cuda.OutOfMemoryError("simulated")
        return real(weight, b, a, start, end)

    monkeypatch.setattr(K, "restore_rows_torch", flaky)
    gen._generate = lambda *a: "result"
    with pytest.raises(GenerationEngineError, match="restore of the shared weights.*OutOfMemoryError"):
        gen._generate_merged([[1, 2]], 1, None, [2], {})
    assert gen._closed and gen._merge is not None and gen._merge.merged  # what is still merged stays recorded
    changed = [n for n, b in _base_bits(pm).items() if not torch.equal(b, before[n])]
    assert 0 < len(changed) < 14
    gen._merge.restore()  # the retry continues where the restore stopped
    assert all(torch.equal(b, before[n]) for n, b in _base_bits(pm).items())
