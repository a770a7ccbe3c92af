"""grpo_kit.memory: the published table, formulas against autograd, monotonicity, bad input, profiler, CLI."""

from __future__ import annotations

import contextlib
import dataclasses
import math
import mmap
import re
import time

import pandas as pd
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from grpo_kit.loss.efficient import auto_chunk_rows
from grpo_kit.memory import (
    METHODS,
    EstimateSpec,
    Profiler,
    compare,
    estimate,
    phase,
    profile,
    published_table,
    resolve_arch,
    total_gpu_bytes,
)
from grpo_kit.memory import formulas as F
from grpo_kit.memory.cli import cli_main
from grpo_kit.model.loading import BUILTIN_MODELS, build_random_model, model_config

LLAMA = "llama-3.1-8b"
PUB = dict(num_generations=8, prompt_length=0, completion_length=20480)


# ----------------------------------------------------------------------------- published table


def test_published_table_reproduced_to_the_decimal_shown():
    t = published_table().set_index("component")
    # derived from the config numbers, rounded as published
    assert t.at["GRPO loss (logits)", "trl_derived"] == 78.3
    assert t.at["GRPO loss (logits)", "unsloth_derived"] == 9.8
    assert t.at["KV cache (20K)", "trl_derived"] == 2.5 and t.at["KV cache (20K)", "unsloth_derived"] == 2.5
    assert t.at["inference weights", "trl_derived"] == 16 and t.at["inference weights", "unsloth_derived"] == 0
    for comp in ("GRPO loss (logits)", "KV cache (20K)", "inference weights"):
        assert t.at[comp, "trl_status"] == "exact" and t.at[comp, "unsloth_status"] == "exact"
    # 414 has no derivation: shown as published and flagged, never fitted
    assert t.at["training memory", "trl_status"] == "published, not derived"
    assert t.at["training memory", "trl_derived"] == 414
    # 42: one bf16 checkpoint per layer = 42.9 GB; flagged approximate, not forced to 42
    assert t.at["training memory", "unsloth_derived"] == 42.9
    assert t.at["training memory", "unsloth_status"] == "approx"
    # the published totals are the sums of the rows as shown
    assert round(t.loc[t.index != "total", "trl_published"].sum(), 1) == t.at["total", "trl_published"] == 510.8
    assert round(t.loc[t.index != "total", "unsloth_published"].sum(), 1) == t.at["total", "unsloth_published"] == 54.3
    assert t.at["total", "trl_derived"] == 510.8 and t.at["total", "trl_status"] == "exact"
    assert t.at["total", "unsloth_derived"] == 55.2 and t.at["total", "unsloth_status"] == "approx"


def test_estimate_shows_published_figures_only_for_the_published_setup():
    trl = estimate(LLAMA, EstimateSpec(method="trl", **PUB)).set_index("component")
    assert trl.at["logits for the loss", "published"] == 78.3
    assert round(trl.at["logits for the loss", "GiB"], 1) == 78.3  # same formula as the table
    assert trl.at["inference copy (vLLM)", "published"] == 16.0
    assert round(trl.at["inference copy (vLLM)", "GB"]) == 16
    assert trl.at["total GPU (peak)", "published"] == 510.8
    assert "no published derivation" in trl.at["saved activations (GPU)", "note"]
    uns = estimate(LLAMA, EstimateSpec(method="unsloth", **PUB)).set_index("component")
    assert round(uns.at["logits for the loss", "GiB"], 1) == 9.8
    assert uns.at["saved activations (CPU)", "published"] == 42.0
    other = estimate(LLAMA, EstimateSpec(method="trl", num_generations=4, prompt_length=0, completion_length=20480))
    assert other["published"].isna().all()


# ----------------------------------------------------------------------------- formulas vs reality


@pytest.mark.parametrize("name", [n for n, s in BUILTIN_MODELS.items() if s.kind != "embedded"])
def test_param_count_matches_a_meta_model(name):
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        m = AutoModelForCausalLM.from_config(model_config(name))
    assert F.param_counts(resolve_arch(name))["total"] == sum(p.numel() for p in m.parameters())


def _autograd_saved_bytes_per_token(name, dtype, lora_rank, lora_dropout=0.0):
    """Bytes of the distinct activation storages one decoder layer's forward saves for backward
    (parameters and the layer input excluded), per token; the layer in training mode."""
    cfg = model_config(name)
    cfg._attn_implementation = "sdpa"
    m = build_random_model(cfg, dtype=dtype)
    if lora_rank:
        import peft

        m = peft.get_peft_model(
            m,
            peft.LoraConfig(
                r=lora_rank,
                lora_dropout=lora_dropout,
                target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
            ),
        )
        m = m.get_base_model()
    m.train()
    params = {p.untyped_storage().data_ptr() for p in m.parameters()}
    B, T = 3, 40
    x = torch.randn(B, T, cfg.hidden_size, dtype=dtype, requires_grad=True)
    pos = m.model.rotary_emb(x, torch.arange(T)[None].expand(B, T))
    seen = {}

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in params and ptr != x.untyped_storage().data_ptr():
            seen[ptr] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        m.model.layers[0](x, position_embeddings=pos, attention_mask=None)
    return sum(seen.values()) / (B * T)


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen2"])
@pytest.mark.parametrize("dtype,b", [(torch.bfloat16, 2), (torch.float32, 4)])
@pytest.mark.parametrize("lora_rank", [None, 8])
def test_layer_saved_bytes_match_autograd(name, dtype, b, lora_rank):
    attn, mlp = F.layer_saved_bytes_per_token(resolve_arch(name), b, lora_rank)
    assert attn + mlp == _autograd_saved_bytes_per_token(name, dtype, lora_rank)


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen2"])
@pytest.mark.parametrize("dtype,b", [(torch.bfloat16, 2), (torch.float32, 4)])
def test_layer_saved_bytes_with_lora_dropout_match_autograd(name, dtype, b):
    """LoRA dropout: each adapted linear saves its own dropped fp32 input and the dropout its mask. On the CPU the
    mask is the fp32 noise (4 B per element); CUDA's fused dropout keeps a bool mask, the calculator's default."""
    attn, mlp = F.layer_saved_bytes_per_token(resolve_arch(name), b, 8, lora_dropout=True, mask_bytes=4)
    assert attn + mlp == _autograd_saved_bytes_per_token(name, dtype, 8, lora_dropout=0.1)
    cuda = sum(F.layer_saved_bytes_per_token(resolve_arch(name), b, 8, lora_dropout=True))
    assert cuda < attn + mlp and F.DROPOUT_MASK_BYTES == 1


@pytest.mark.parametrize("inter", [160, 1536, 8960, 14336, 18944, 100_000])
def test_auto_chunk_tokens_matches_checkpointing(inter):
    from grpo_kit.model.offload import _auto_chunk_tokens

    mlp = torch.nn.Sequential(torch.nn.Linear(64, inter, device="meta"), torch.nn.Linear(inter, 64, device="meta"))
    a = F.Arch("x", "llama", 1000, 64, inter, 2, 4, 2, 16, False)
    assert F.auto_chunk_tokens(a) == _auto_chunk_tokens(mlp)


def test_config_json_path_and_config_object_match_the_builtin(tmp_path):
    cfg = model_config("qwen2.5-1.5b")
    cfg.to_json_file(tmp_path / "config.json")
    kw = dict(num_generations=4, prompt_length=128, completion_length=1024, lora_rank=16)
    ref = estimate("qwen2.5-1.5b", EstimateSpec(**kw))
    for model in (str(tmp_path / "config.json"), str(tmp_path), cfg):
        pd.testing.assert_series_equal(estimate(model, EstimateSpec(**kw))["GB"], ref["GB"])


def test_known_component_values():
    a = resolve_arch(LLAMA)
    df = estimate(LLAMA, EstimateSpec(method="grpo_kit", lora_rank=16, **PUB)).set_index("component")
    assert df.at["model weights", "GB"] == pytest.approx(8_030_261_248 * 2 / 1e9)
    assert df.at["inference copy (vLLM)", "GB"] == 0
    # 31 layer inputs on the CPU, the last one on the GPU
    assert df.at["saved activations (CPU)", "GiB"] == pytest.approx(31 * 8 * 20480 * 4096 * 2 / 2**30)
    assert df.at["saved activations (GPU)", "GiB"] == pytest.approx(1.25)
    # one logits chunk of the loss: ~0.25 GiB
    assert 0.2 < df.at["logits for the loss", "GiB"] <= 0.25
    # 8 concurrent sequences of 20,480 tokens in 16-token blocks, one block of slack each: 8 x 2.5 GiB + 8 blocks
    assert F.vllm_kv_tokens(0, 20480, 8, 1) == 8 * (1280 + 1) * 16
    assert df.at["KV cache (generation)", "GiB"] == pytest.approx(8 * 2.5 * 1281 / 1280)
    q4 = estimate(
        LLAMA, EstimateSpec(method="grpo_kit", lora_rank=16, quantization="4bit", kv_cache_dtype="fp8", **PUB)
    )
    q4 = q4.set_index("component")
    n = F.param_counts(a)
    assert q4.at["model weights", "GB"] * 1e9 == pytest.approx(n["layer_linear"] * 4.127 / 8 + n["other"] * 2, rel=1e-3)
    assert q4.at["KV cache (generation)", "GiB"] == pytest.approx(df.at["KV cache (generation)", "GiB"] / 2)
    # the kit's 4-bit matmul keeps the running layer's 7 projections dequantised (grpo_kit.model.nf4_matmul): 218M weights
    # of 2 B for the 8B; bitsandbytes (the other methods) one projection at a time, the largest
    assert q4.at["dequantised 4-bit weights of one layer", "GB"] * 1e9 == pytest.approx(
        (2 * 4096 * 4096 + 2 * 1024 * 4096 + 3 * 14336 * 4096) * 2
    )
    q4u = estimate(LLAMA, EstimateSpec(method="unsloth", lora_rank=16, quantization="4bit", **PUB))
    q4u = q4u.set_index("component")
    assert q4u.at["dequantised 4-bit weight (transient)", "GB"] * 1e9 == pytest.approx(14336 * 4096 * 2)
    full = estimate(LLAMA, EstimateSpec(method="trl", **PUB)).set_index("component")
    assert full.at["gradients", "GB"] == pytest.approx(n["total"] * 2 / 1e9)


def test_vllm_kv_slots_prefix_sharing_and_blocks():
    # a 20-token prompt: one full block shared, its 4-token tail copied into each completion's blocks
    assert F.vllm_kv_tokens(20, 12, 2, 1) == (1 + 2 * (1 + 1)) * 16
    assert F.vllm_kv_tokens(20, 13, 2, 3) == 3 * (1 + 2 * (2 + 1)) * 16
    assert F.vllm_kv_tokens(0, 1, 1, 1) == 2 * 16


def test_standby_keeps_the_kv_cache_out_of_the_training_peak():
    # one completion per forward/backward (8 micro-batches), as bench rl_step runs it
    kw = dict(
        method="grpo_kit",
        lora_rank=16,
        num_generations=8,
        prompt_length=512,
        completion_length=20480,
        kv_cache_dtype="fp8",
        micro_batch_size=1,
        generation_batch=8,
    )
    resident = estimate(LLAMA, EstimateSpec(**kw)).attrs["phase_bytes"]
    standby = estimate(LLAMA, EstimateSpec(standby=True, **kw))
    ph = standby.attrs["phase_bytes"]
    kv = standby.set_index("component").at["KV cache (generation)", "GB"] * 1e9
    assert ph["backward"] == pytest.approx(resident["backward"] - kv)
    assert ph["generation"] == pytest.approx(resident["generation"])
    assert standby.attrs["peak_phase"] == "generation"  # weights + 10 GiB of fp8 KV beat the training step
    # weights once (15 GiB), the fp8 KV cache of 512 + 8 x 20,480 tokens (10 GiB), vLLM's workspace
    assert 25 < total_gpu_bytes(standby) / 2**30 < 27
    given = estimate(LLAMA, EstimateSpec(standby=True, kv_cache_bytes=2.0 * 2**30, **kw)).set_index("component")
    assert given.at["KV cache (generation)", "GiB"] == pytest.approx(2.0)


def test_peak_rule_and_totals():
    df = estimate(LLAMA, EstimateSpec(method="trl", lora_rank=16, **PUB))
    gpu = df[(df["where"] == "GPU") & ~df["component"].str.startswith("total")]
    assert df["GB"].iloc[-2] == pytest.approx(gpu.loc[gpu["in_peak"], "GB"].sum())
    assert df.attrs["peak_phase"] == "loss"  # 78 GiB of logits beat one layer's recompute
    hf = estimate(
        LLAMA,
        EstimateSpec(
            method="grpo_kit", vllm=False, lora_rank=16, num_generations=8, prompt_length=100, completion_length=100
        ),
    )
    assert not hf.set_index("component").at["KV cache (generation)", "in_peak"]
    train_only = estimate(LLAMA, EstimateSpec(method="grpo_kit", lora_rank=16, include_generation=False, **PUB))
    assert train_only.set_index("component").at["KV cache (generation)", "GB"] == 0


# ----------------------------------------------------------------------------- monotonicity


@settings(max_examples=40, deadline=None)
@given(
    method=st.sampled_from(METHODS),
    c=st.integers(1, 200_000),
    dc=st.integers(1, 50_000),
    g=st.integers(1, 16),
    p=st.integers(0, 4096),
    lora=st.sampled_from([None, 8, 64]),
    vllm=st.booleans(),
    mb1=st.booleans(),
)
def test_more_context_or_generations_never_needs_less(method, c, dc, g, p, lora, vllm, mb1):
    spec = EstimateSpec(
        method=method,
        num_generations=g,
        prompt_length=p,
        completion_length=c,
        lora_rank=lora,
        vllm=vllm,
        micro_batch_size=1 if mb1 else None,
    )
    base = estimate("qwen2.5-1.5b", spec)
    longer = estimate("qwen2.5-1.5b", dataclasses.replace(spec, completion_length=c + dc))
    more = estimate("qwen2.5-1.5b", dataclasses.replace(spec, num_generations=g + 1))
    for bigger in (longer, more):
        assert (bigger["GB"].to_numpy() >= base["GB"].to_numpy() - 1e-12).all()
        assert total_gpu_bytes(bigger) >= total_gpu_bytes(base)


def test_ordering_of_methods_at_long_context():
    t = compare(LLAMA, EstimateSpec(lora_rank=16, **PUB), unit="GiB").loc["total GPU (peak)"]
    assert t["grpo_kit"] < t["unsloth"] < t["trl"]


# ----------------------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(model="llama-9000"), "Built-in names: .*llama-3.1-8b"),
        (dict(num_generations=0), "num_generations must be an int >= 1"),
        (dict(num_generations=2.5), "num_generations"),
        (dict(completion_length=0), "completion_length must be an int >= 1"),
        (dict(completion_length=-5), "completion_length"),
        (dict(prompt_length=-1), "prompt_length must be an int >= 0"),
        (dict(lora_rank=0), "lora_rank must be an int >= 1"),
        (dict(quantization="4bit"), "needs lora_rank"),
        (dict(quantization="3bit", lora_rank=8), r"quantization must be one of \[None, '4bit', 'fp8'\]"),
        (dict(method="deepspeed"), "method must be one of"),
        (dict(dtype="int8"), "dtype must be one of"),
        (dict(kv_cache_dtype="int4"), "kv_cache_dtype"),
        (dict(micro_batch_size=0), "micro_batch_size must be an int >= 1"),
        (dict(generation_batch=12), "generation_batch must be a multiple of num_generations=8"),
        (dict(standby=True, vllm=False), "standby=True describes a vLLM engine"),
        (dict(kv_cache_bytes=-1.0), "kv_cache_bytes must be None or a number of bytes > 0"),
        (dict(vllm="yes"), "vllm must be a bool"),
        (dict(method="trl", offload=True), "offload=True is not available with method='trl'"),
        (dict(method="grpo_kit", loss_fp32=True), "loss_fp32 applies to method='trl' only"),
        (dict(include_generation=1), "include_generation must be a bool"),
    ],
)
def test_bad_input_raises_one_clear_error(kwargs, match):
    kw = dict(model="qwen2.5-1.5b", num_generations=8, prompt_length=16, completion_length=64) | kwargs
    with pytest.raises(ValueError, match=match):
        estimate(kw.pop("model"), EstimateSpec(**kw))


def _vram(argv) -> int:
    """``python -m grpo_kit vram ARGV``: the kit's default run (``StepSpec()``, the config's defaults) is what it
    prices."""
    return cli_main(argv)


@pytest.mark.parametrize(
    "argv,match",
    [
        (["--model", "nope", "--context", "100"], "Built-in names"),
        (["--model", LLAMA, "--context", "0"], "must be >= 1"),
        (["--model", LLAMA, "--context", "100", "--generations", "0"], "must be >= 1"),
        (
            ["--model", LLAMA, "--context", "100", "--prompt-length", "100"],
            r"the prompt \(100 tokens\) must be shorter",
        ),
        (
            ["--model", LLAMA, "--context", "100"],
            r"the prompt \(256 tokens, the kit's max_prompt_length\) must be shorter",
        ),
        (["--model", LLAMA, "--context", "100", "--published-setting", "--quantization", "4bit"], "needs LoRA"),
        (["--model", LLAMA, "--context", "100", "--full-finetuning", "--quantization", "4bit"], "needs LoRA"),
        (["--model", LLAMA, "--context", "100", "--full-finetuning", "--lora-rank", "8"], "exclude each other"),
        (["--model", LLAMA, "--context", "100", "--method", "peft"], "invalid choice"),
        (["--model", LLAMA, "--context", "100", "--standby", "--no-vllm"], "--standby describes a vLLM engine"),
        (["--model", LLAMA, "--context", "100", "--published-setting", "--lora-dropout"], "--lora-dropout needs LoRA"),
    ],
)
def test_cli_bad_input(argv, match, capsys):
    with pytest.raises(SystemExit) as e:
        _vram(argv)
    assert e.value.code == 2
    assert re.search(match, capsys.readouterr().err)


def test_cli_prices_the_kits_run_without_the_apps_config(capsys):
    """The memory layer knows the kit's default run itself (StepSpec(), whose defaults the config takes)."""
    from grpo_kit.app.config import GRPOKitConfig
    from grpo_kit.memory.spec import StepSpec

    assert GRPOKitConfig().spec(StepSpec) == StepSpec()
    assert cli_main(["--model", LLAMA, "--context", "1024"]) == 0
    alone = capsys.readouterr().out
    assert cli_main(["--model", LLAMA, "--context", "1024"], run=GRPOKitConfig()) == 0
    assert capsys.readouterr().out == alone
    assert cli_main(["--model", LLAMA, "--context", "1024", "--published-setting", "--method", "grpo_kit"]) == 0


def test_cli_prints_the_table_and_plots(tmp_path, capsys):
    out_png = tmp_path / "vram.png"
    assert (
        _vram(
            [
                "--model",
                LLAMA,
                "--context",
                "20480",
                "--generations",
                "8",
                "--published-setting",
                "--plot",
                str(out_png),
            ]
        )
        == 0
    )
    text = capsys.readouterr().out
    for needle in ("78.3", "510.8", "54.3", "published, not derived", "method grpo_kit", "total GPU (peak)"):
        assert needle in text
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_standby_plans_the_shared_engine(capsys):
    argv = [
        "--model",
        LLAMA,
        "--context",
        "20992",
        "--prompt-length",
        "512",
        "--lora-rank",
        "16",
        "--kv-cache-dtype",
        "fp8",
        "--micro-batch",
        "16",
        "--method",
        "grpo_kit",
    ]  # a micro-batch above the group size is fine now
    assert _vram(argv + ["--standby"]) == 0
    assert "peak during the backward phase" in capsys.readouterr().out  # 16 x 21K tokens outweigh generation
    assert _vram(argv[:-4] + ["--micro-batch", "1", "--method", "grpo_kit", "--standby"]) == 0
    assert "peak during the generation phase" in capsys.readouterr().out


def test_plots_return_figures():
    from grpo_kit.memory import plot_components, plot_vs_context

    spec = EstimateSpec(num_generations=8, prompt_length=64, completion_length=1024, lora_rank=16)
    fig = plot_components(
        {m: estimate("qwen2.5-1.5b", dataclasses.replace(spec, method=m)) for m in METHODS}, budget_gib=15
    )
    assert len(fig.axes[0].patches) > 0
    fig = plot_vs_context(
        "qwen2.5-1.5b",
        [1024, 4096, 16384],
        dataclasses.replace(spec, prompt_length=0),
        measured={"bench": [(1024, 4.0), (4096, 5.0)]},
    )
    assert len(fig.axes[0].lines) == len(METHODS) + 1


# ----------------------------------------------------------------------------- profiler (CPU)


def test_cpu_profile_of_a_tiny_model_step():
    # In a fresh process: RSS readings depend on the process's history (freed memory an allocator keeps
    # resident is reused without raising RSS; in a full-suite run the forward once showed no rise at all).
    import subprocess
    import sys
    from pathlib import Path

    tests_dir = Path(__file__).resolve().parent
    code = f"import sys; sys.path.insert(0, {str(tests_dir)!r}); import test_memory; test_memory._cpu_profile_body()"
    r = subprocess.run([sys.executable, "-c", code], cwd=tests_dir.parent, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]


def _cpu_profile_body():
    torch.manual_seed(0)
    model = build_random_model("tiny-llama", dtype=torch.float32)
    ids = torch.randint(0, 49152, (4, 256))

    def step():
        with phase("forward"):
            logits = model(ids).logits  # (4, 256, 49152) fp32: 201 MB
            loss = torch.log_softmax(logits, -1).mean()
        with phase("backward"):
            loss.backward()
        return float(loss.detach())

    res = profile(step, device="cpu")
    t = res.table.set_index("phase")
    assert list(res.table["phase"]) == ["total", "forward", "backward"]
    assert math.isfinite(res.value)
    assert (t["peak_GiB"] >= t["start_GiB"]).all() and (t["peak_GiB"] >= t["end_GiB"]).all()
    # the forward holds the logits (0.19 GiB) and then the log-softmax beside them (0.37 GiB in all); RSS is
    # sampled, and on a loaded machine the sampler can miss the short moment both exist (seen: 0.1875)
    assert t.at["forward", "peak_over_start_GiB"] > 0.15
    assert t.at["total", "peak_GiB"] >= t[["peak_GiB"]].drop(index="total").max().iloc[0]
    assert t.at["total", "peak_GiB"] < 24  # the machine's RAM: a sane number
    assert (t["seconds"] > 0).all() and res.snapshot is None


def test_profiler_catches_a_transient_spike_and_nests():
    prof = Profiler(device="cpu", interval=0.001)
    with prof:
        with prof.phase("outer"):
            with prof.phase("spike") as ph:
                # 256 MB of fresh anonymous pages, freed before the phase ends: torch's allocator could reuse
                # memory an earlier test freed but kept resident, and the RSS would not move (seen in the suite)
                buf = mmap.mmap(-1, 256 * 2**20)
                x = torch.frombuffer(buf, dtype=torch.uint8)
                x.fill_(1)
                # Held until the sampler thread has seen it (at most 5 s): a spike shorter than the sampler's
                # scheduling delay can be missed (documented); a fixed 50 ms hold was, on a busy 2-core CI box.
                deadline = time.perf_counter() + 5.0
                while ph.peak - ph.start < 0.2 * 2**30 and time.perf_counter() < deadline:
                    time.sleep(0.005)
                del x
                buf.close()
    t = prof.table().set_index("phase")
    assert t.at["spike", "peak_over_start_GiB"] > 0.2
    assert t.at["outer", "peak_GiB"] >= t.at["spike", "peak_GiB"]
    assert t.at["spike", "end_GiB"] < t.at["spike", "peak_GiB"] - 0.1
    assert t.at["spike", "depth"] == 2 and t.at["outer", "depth"] == 1


def test_phase_is_a_noop_without_a_profiler_and_bad_profiler_args():
    with phase("nothing") as ph:
        assert ph is None
    with pytest.raises(ValueError, match="device must be"):
        Profiler(device="tpu")
    with pytest.raises(ValueError, match="interval"):
        Profiler(device="cpu", interval=0)
    with pytest.raises(ValueError, match="fn must be callable"):
        profile(42)
    with pytest.raises(ValueError, match="phase name"):
        with Profiler(device="cpu") as p:
            with p.phase(""):
                pass


def test_live_at_peak_replays_the_history_and_groups_by_line():
    from grpo_kit.memory import live_at_peak

    def frames(*where):  # innermost first, as torch records them
        return [{"filename": f, "line": ln, "name": fn} for f, ln, fn in where]

    torch_frame = ("/usr/lib/python3/site-packages/torch/nn/functional.py", 10, "linear")
    mlp = frames(torch_frame, ("/repo/grpo_kit/model/fp8.py", 210, "w8a8_scaled_mm"))
    attn = frames(("/usr/lib/python3/site-packages/transformers/integrations/sdpa_attention.py", 96, "sdpa"))
    mib = 2**20
    events = [
        {"action": "free_completed", "addr": 999, "size": 64 * mib},  # allocated before recording: ignored
        {"action": "alloc", "addr": 1, "size": 100 * mib, "frames": mlp},
        {"action": "alloc", "addr": 2, "size": 50 * mib, "frames": mlp},
        {"action": "alloc", "addr": 3, "size": 300 * mib, "frames": attn},
        {"action": "free_requested", "addr": 3, "size": 300 * mib},  # completion follows: not yet freed
        {"action": "free_completed", "addr": 3, "size": 300 * mib},
        {"action": "alloc", "addr": 3, "size": 200 * mib, "frames": attn},  # an address reused
        {"action": "free_completed", "addr": 1, "size": 100 * mib},
        {"action": "segment_alloc", "addr": 7, "size": 900 * mib},  # segments are not blocks
    ]
    got = live_at_peak({"device_traces": [events]})
    assert got["peak_gib"] == pytest.approx(450 / 1024, abs=1e-4) and got["event"] == 3 and got["events"] == 9
    assert got["allocations"] == [
        {"where": "transformers/integrations/sdpa_attention.py:96 (sdpa)", "blocks": 1, "gib": round(300 / 1024, 4)},
        {"where": "grpo_kit/model/fp8.py:210 (w8a8_scaled_mm)", "blocks": 2, "gib": round(150 / 1024, 4)},
    ]
    # without completions the requests free; the peak still at event 3, and with no free after the last alloc
    # of a history the blocks live at its end are the peak's
    requested = [e for e in events if e["action"] != "free_completed"]
    assert live_at_peak({"device_traces": [requested]})["peak_gib"] == pytest.approx(450 / 1024, abs=1e-4)
    grow = live_at_peak({"device_traces": [events[1:3]]}, top=1)
    assert grow["event"] == 1 and grow["allocations"] == [
        {"where": "grpo_kit/model/fp8.py:210 (w8a8_scaled_mm)", "blocks": 2, "gib": round(150 / 1024, 4)}
    ]
    assert live_at_peak({}) == {"peak_gib": 0, "event": 0, "events": 0, "absolute": False, "allocations": []}


def test_live_at_peak_with_segments_counts_what_was_live_before_the_recording():
    """With the snapshot's ``segments`` (the blocks live when it was taken) the replay runs backwards, so blocks
    allocated before the recording (a ring buffer's lost start) count at the peak, their free included."""
    from grpo_kit.memory import live_at_peak

    mib = 2**20
    mlp = [{"filename": "/repo/grpo_kit/model/offload.py", "line": 333, "name": "_out_chunk"}]
    events = [
        {"action": "alloc", "addr": 1, "size": 100 * mib, "frames": mlp},
        {"action": "free_completed", "addr": 900, "size": 400 * mib},  # allocated before the recording
        {"action": "alloc", "addr": 2, "size": 50 * mib, "frames": mlp},
        {"action": "free_completed", "addr": 1, "size": 100 * mib},
    ]
    segments = [  # at the snapshot: block 2, a 1 GiB block from before the recording, one whose free waits on a
        # stream (torch's name for that state; live where completions are recorded); another device's block
        {
            "device": 0,
            "blocks": [
                {"address": 2, "size": 50 * mib, "state": "active_allocated", "frames": mlp},
                {"address": 800, "size": 1000 * mib, "state": "active_allocated", "frames": []},
                {"address": 801, "size": 24 * mib, "state": "active_pending_free", "frames": []},
                {"address": 3, "size": 8 * mib, "state": "inactive", "frames": []},
            ],
        },
        {"device": 1, "blocks": [{"address": 5, "size": 4096 * mib, "state": "active_allocated", "frames": []}]},
    ]
    got = live_at_peak({"device_traces": [events], "segments": segments})
    # after the first alloc: 1024 + 400 (not yet freed) + 100
    assert got["absolute"] is True and got["event"] == 0 and got["peak_gib"] == pytest.approx(1524 / 1024, abs=1e-4)
    assert got["allocations"] == [
        {"where": "(allocated before the recording)", "blocks": 3, "gib": round(1424 / 1024, 4)},
        {"where": "grpo_kit/model/offload.py:333 (_out_chunk)", "blocks": 1, "gib": round(100 / 1024, 4)},
    ]
    # a block allocated inside the window with no Python frame (the autograd engine's thread) is not "before"
    bare = [{"action": "alloc", "addr": 9, "size": 2048 * mib, "frames": []}]
    assert live_at_peak(
        {
            "device_traces": [bare],
            "segments": [
                {"device": 0, "blocks": [{"address": 9, "size": 2048 * mib, "state": "active_allocated", "frames": []}]}
            ],
        }
    )["allocations"] == [{"where": "(no Python frame outside torch)", "blocks": 1, "gib": 2.0}]
    forward = live_at_peak({"device_traces": [events]})  # the recorded allocations only: 150 MiB after event 2
    assert forward["absolute"] is False and forward["peak_gib"] == pytest.approx(150 / 1024, abs=1e-4)
    # a peak before the first event: the 400 MiB freed first, nothing bigger allocated after
    early = live_at_peak({"device_traces": [events[1:2]], "segments": segments[:1]})
    assert early["event"] == -1 and early["peak_gib"] == pytest.approx((1024 + 50 + 400) / 1024, abs=1e-4)
    # no events at all: the blocks live at the snapshot, a pending free as freed (no completions recorded)
    assert live_at_peak({"segments": segments[:1]})["peak_gib"] == pytest.approx(1050 / 1024, abs=1e-4)
    # equal peaks: the earliest (A, freed, then B of its size; a segment event after them changes nothing)
    equal = [
        {"action": "alloc", "addr": 11, "size": 100 * mib, "frames": mlp},
        {"action": "free_completed", "addr": 11, "size": 100 * mib},
        {"action": "alloc", "addr": 12, "size": 100 * mib, "frames": mlp},
        {"action": "segment_alloc", "addr": 99, "size": 200 * mib},
    ]
    got = live_at_peak(
        {
            "device_traces": [equal],
            "segments": [
                {
                    "device": 0,
                    "blocks": [{"address": 12, "size": 100 * mib, "state": "active_allocated", "frames": mlp}],
                }
            ],
        }
    )
    assert (got["event"], got["peak_gib"]) == (0, pytest.approx(100 / 1024, abs=1e-4))


def test_validation_script_on_a_small_results_file(tmp_path, monkeypatch):
    """bench/memory_validation.py end to end on a hand-written results file (numbers are inputs,
    not results): estimates, errors and the verdict come out as computed."""
    import json
    import runpy
    import sys
    from pathlib import Path

    rows = [
        dict(
            row="ours_offload",
            model="qwen2.5-1.5b",
            gens=1,
            seq_len=T,
            prompt_len=512,
            completion_len=T - 512,
            micro_batch=1,
            status="ok",
            peak_allocated_gib=g,
            phases={},
            weights_gib=2.9,
            budget_gib=None,
        )
        for T, g in ((1024, 3.4), (4096, 4.0), (16384, 9.9))
    ]
    src = tmp_path / "step.json"
    src.write_text(json.dumps(dict(results=rows, command="hand-written", hardware={})))
    out = tmp_path / "mv.md"
    argv = sys.argv
    bench = Path(__file__).parents[1] / "bench"
    monkeypatch.syspath_prepend(str(bench))  # the script imports its folder's _common, as when run by path
    try:
        sys.argv = [
            "bench/memory_validation.py",
            "--step-json",
            str(src),
            "--out",
            str(out),
            "--plot",
            "",
            "--out-dir",
            str(tmp_path / "results"),
        ]
        with pytest.raises(SystemExit) as e:
            runpy.run_path(str(bench / "memory_validation.py"), run_name="__main__")
    finally:
        sys.argv = argv
    assert e.value.code == 0
    data = tmp_path / "results" / "data" / "memory_validation.jsonl"
    got = [json.loads(line) for line in data.read_text().splitlines()]
    assert len(got) == 3
    for r, (T, g) in zip(got, ((1024, 3.4), (4096, 4.0), (16384, 9.9))):
        assert f"seq_len={T}" in r["shape"] and r["figures"]["measured_gib"] == g
        est = (
            total_gpu_bytes(
                estimate(
                    "qwen2.5-1.5b",
                    EstimateSpec(
                        num_generations=1,
                        prompt_length=512,
                        completion_length=T - 512,
                        micro_batch_size=1,
                        lora_rank=16,
                        vllm=False,
                        include_generation=False,
                    ),
                )
            )
            / 2**30
        )
        f = r["figures"]
        assert f["estimate_gib"] == pytest.approx(est) and f["error"] == pytest.approx(est / g - 1)
    text = out.read_text()
    assert "2/3 steps within" in text and "target NOT met" in text  # 9.9 GiB is far off the estimate


@pytest.mark.parametrize(
    "model,completion,quant,gen,dtype,vllm",
    [
        ("llama-3.1-8b", 1024, "4bit", True, "fp16", False),
        ("llama-3.1-8b", 1024, "4bit", False, "fp16", False),
        ("llama-3.1-8b", 20480, "4bit", True, "fp16", False),
        ("llama-3.1-8b", 4096, None, False, "bf16", False),
        ("qwen2.5-1.5b", 1024, None, True, "bf16", False),
        ("qwen2.5-1.5b", 30000, None, False, "bf16", False),
        ("llama-3.1-8b", 20480, "fp8", True, "bf16", True),
        ("llama-3.1-8b", 4096, "fp8", True, "bf16", True),
        ("llama-3.1-8b", 20480, None, True, "bf16", True),
    ],
)
def test_auto_scoring_batch_is_the_largest_that_keeps_the_peak(model, completion, quant, gen, dtype, vllm):
    """``scoring_batch='auto'``: of every scoring batch from the micro-batch up to one generation batch, the
    largest whose ``scoring`` phase stays within the step's other phases (a scan, against the bisection), with
    vLLM the training phases only (its KV cache is in the engine's pool); the table is the estimate at that
    batch, so the peak is the one without a scoring batch."""
    kw = dict(
        num_generations=8,
        prompt_length=512,
        completion_length=completion,
        dtype=dtype,
        lora_rank=16,
        quantization=quant,
        micro_batch_size=1,
        generation_batch=16,
        vllm=vllm,
        include_generation=gen,
    )
    if vllm:
        kw.update(standby=True, kv_cache_dtype="fp8")

    def bound(ph):
        return max(v for k, v in ph.items() if k not in ("scoring", "generation" if vllm else ""))

    auto = estimate(model, EstimateSpec(scoring_batch="auto", **kw))
    fits = [
        s
        for s in range(2, 17)
        if (ph := estimate(model, EstimateSpec(scoring_batch=s, **kw)).attrs["phase_bytes"])["scoring"] <= bound(ph)
    ]
    want = max(fits) if fits else None
    assert auto.attrs["scoring_batch"] == want and auto.attrs["scoring_batch_auto"] is True
    plain = estimate(model, EstimateSpec(**kw))
    assert total_gpu_bytes(auto) == pytest.approx(total_gpu_bytes(plain), rel=1e-12)  # the peak is untouched
    if want is not None:
        assert auto.attrs["phase_bytes"] == estimate(model, EstimateSpec(scoring_batch=want, **kw)).attrs["phase_bytes"]
    if want is not None and want < 16:  # one more sequence would have raised the bound
        ph = estimate(model, EstimateSpec(scoring_batch=want + 1, **kw)).attrs["phase_bytes"]
        assert ph["scoring"] > bound(ph)
    if vllm:  # the cases measured on the GPU: a scoring phase under the generation phase, above the training side's
        assert want is not None and 1 < want < 16
        ph = estimate(model, EstimateSpec(scoring_batch=want + 1, **kw)).attrs["phase_bytes"]
        assert ph["scoring"] <= ph["generation"], "the case does not tell the two bounds apart"


def test_auto_scoring_batch_outside_the_kit_and_at_a_full_micro_batch():
    kw = dict(num_generations=8, prompt_length=512, completion_length=1024, dtype="bf16", lora_rank=16, vllm=False)
    for method in ("trl", "unsloth"):  # they score by micro-batch: no choice to make
        assert (
            estimate("llama-3.1-8b", EstimateSpec(method=method, micro_batch_size=1, scoring_batch="auto", **kw)).attrs[
                "scoring_batch"
            ]
            is None
        )
    # a micro-batch of the whole generation batch already scores it in one forward
    full = estimate("llama-3.1-8b", EstimateSpec(micro_batch_size=8, scoring_batch="auto", **kw))
    assert full.attrs["scoring_batch"] is None
    with pytest.raises(ValueError, match="scoring_batch must be None, 'auto' or an integer >= 1, got 'max'"):
        estimate("llama-3.1-8b", EstimateSpec(scoring_batch="max", **kw))


def test_scoring_batch_for_config_resolves_auto_and_keeps_a_set_number():
    from grpo_kit.app.config import GRPOKitConfig
    from grpo_kit.memory import estimate_for_config, scoring_batch_for_config

    cfg = GRPOKitConfig(
        model="llama-3.1-8b",
        max_completion_length=1024,
        per_device_train_batch_size=1,
        gradient_accumulation_steps=8,
        load_in_4bit=True,
        dtype="fp16",
    )
    assert scoring_batch_for_config(cfg) == estimate_for_config(cfg).attrs["scoring_batch"] == 8
    for set_to in (None, 3):
        assert scoring_batch_for_config(GRPOKitConfig(**{**cfg.to_dict(), "scoring_batch_size": set_to})) == set_to
    assert scoring_batch_for_config(GRPOKitConfig(**{**cfg.to_dict(), "trainer": "trl", "load_in_4bit": False})) is None
    from transformers import GPT2Config

    with pytest.warns(UserWarning, match="cannot price this model.*GPT2Config lacks"):  # scores as TRL does
        assert scoring_batch_for_config(cfg, GPT2Config()) is None


def _no_grad_mlp_peak_per_token(dtype, dropout, adapters, h=128, inter=2048, tokens=2048):
    """Peak bytes of live tensors during one no-grad LlamaMLP forward under PEFT LoRA (fp32 adapters on all three
    projections), from the profiler's memory timeline, per token; the input and the weights excluded."""
    import peft
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaMLP

    class Wrap(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.mlp = LlamaMLP(LlamaConfig(hidden_size=h, intermediate_size=inter))

        def forward(self, x):
            return self.mlp(x)

    torch.manual_seed(0)
    m = peft.get_peft_model(
        Wrap().to(dtype),
        peft.LoraConfig(
            r=16, lora_alpha=32, lora_dropout=dropout, target_modules=["gate_proj", "up_proj", "down_proj"]
        ),
    )
    for name, prm in m.named_parameters():
        if "lora_" in name:
            prm.data = prm.data.float()  # the kit's adapters: fp32 beside 16-bit base weights
    m.train()
    x = torch.randn(1, tokens, h, dtype=dtype)

    def run():
        with torch.no_grad(), contextlib.nullcontext() if adapters else m.disable_adapter():
            y = m(x)
            del y

    return _live_peak(run) / tokens


def _live_peak(fn) -> int:
    """Peak bytes of the tensors created while ``fn()`` runs on the CPU, from the profiler's memory timeline."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    with torch_profile(
        activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True, with_stack=True
    ) as prof:
        fn()
    live = peak = 0
    for _, action, _, nbytes in sorted((e for e in prof._memory_profile().timeline if e[0] >= 0), key=lambda e: e[0]):
        live += nbytes if action.name == "CREATE" else -nbytes if action.name == "DESTROY" else 0
        peak = max(peak, live)
    return peak


@pytest.mark.parametrize("dtype,b", [(torch.bfloat16, 2), (torch.float32, 4)])
@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_no_grad_mlp_moment_with_and_without_adapters(dtype, b, dropout):
    """The scoring pass's MLP moment: 3 b*I per token for the reference pass (adapters off), and with the adapters
    on (TRL's old-policy pass) ADAPTER_FP32_TEMPS fp32 I-wide tensors: PEFT's fp32 adapter path. Held within 3% (the
    h-wide tensors, h = I / 16, are not in the formula)."""
    inter = 2048
    a = F.Arch("mlp", "llama", 1000, 128, inter, 1, 4, 4, 32, False)
    for adapters in (False, True):
        measured = _no_grad_mlp_peak_per_token(dtype, dropout, adapters, inter=inter)
        # one token's scoring peak less the embeddings, a layer's input and output: the MLP's moment (larger than
        # attention's at this width)
        formula = F.scoring_forward_peak(a, 1, 1, b, None, 0, adapters) - 3 * b * a.hidden
        assert measured == pytest.approx(formula, rel=0.03), (adapters, measured / inter)


def test_the_chunked_reference_forward_stays_within_its_formula():
    """The whole no-grad reference forward as the trainer runs it, 8 sequences at once: the kit's chunked decoder
    layers (offloaded checkpointing on), no mask (pads rolled away), grouped-query attention in SDPA, the logits of
    one position. Its live tensors on the CPU peak under the calculator's scoring-pass figure and within 15% of it
    (the figure also counts a transient the CPU's kernels may not make: attention's contiguous output copy)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from grpo_kit.memory.estimate import arch_from_config
    from grpo_kit.model.offload import enable_offloaded_checkpointing

    B, T, chunk = 8, 1024, 1024  # 8 slices of 128 tokens per sequence, as the 8B's 4,096-token slices cut 20K
    cfg = LlamaConfig(
        hidden_size=512,
        intermediate_size=1792,
        num_attention_heads=8,
        num_key_value_heads=2,
        num_hidden_layers=2,
        vocab_size=1000,
    )
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    m = enable_offloaded_checkpointing(
        LlamaForCausalLM(cfg).to(torch.bfloat16).eval(), offload=False, chunk_tokens=chunk
    )
    ids = torch.randint(0, cfg.vocab_size, (B, T))

    def run():
        with torch.no_grad():
            m(input_ids=ids, logits_to_keep=1, use_cache=False)

    run()  # warm-up: one-off allocations are not the pass's
    formula = F.scoring_forward_peak(arch_from_config(cfg), B, T, 2, chunk, 0)
    assert 0.85 * formula <= _live_peak(run) <= formula


def test_the_old_policy_pass_prices_the_adapters():
    """With vLLM (the kit's importance-sampling correction) or num_iterations > 1 the scoring phase is the
    old-policy pass's, adapters on; with HF generation and one iteration the reference pass's."""
    from grpo_kit.app.config import GRPOKitConfig
    from grpo_kit.memory import estimate_for_config

    kw = dict(
        num_generations=8,
        prompt_length=512,
        completion_length=20480,
        dtype="bf16",
        lora_rank=16,
        micro_batch_size=1,
        include_generation=False,
        scoring_batch=8,
        lora_dropout=True,
    )
    rows = lambda df: df.set_index("component")["GB"] * F.GB  # noqa: E731
    hf = estimate("llama-3.1-8b", EstimateSpec(vllm=False, **kw))
    vllm = estimate("llama-3.1-8b", EstimateSpec(vllm=True, **kw))
    forced = estimate("llama-3.1-8b", EstimateSpec(vllm=False, old_policy_pass=True, **kw))
    a, T = resolve_arch("llama-3.1-8b"), 20992
    extra = 8 * T * (F.ADAPTER_FP32_TEMPS * F.FP32 - 3 * 2) * a.intermediate  # whole MLPs (dropout: unsliced)
    assert rows(vllm)["scoring pass (no grad)"] - rows(hf)["scoring pass (no grad)"] == pytest.approx(extra, rel=1e-9)
    assert rows(forced)["scoring pass (no grad)"] == rows(vllm)["scoring pass (no grad)"]
    assert (hf.attrs["old_policy_pass"], vllm.attrs["old_policy_pass"]) == (False, True)
    full = estimate("llama-3.1-8b", EstimateSpec(**{**kw, "lora_rank": None, "lora_dropout": False}, vllm=True))
    assert full.attrs["old_policy_pass"] is False  # full fine-tuning: the same pass either way
    cfg = dict(model="llama-3.1-8b", per_device_train_batch_size=1, gradient_accumulation_steps=8)
    assert estimate_for_config(GRPOKitConfig(**cfg, num_iterations=2)).attrs["old_policy_pass"] is True
    assert estimate_for_config(GRPOKitConfig(**cfg)).attrs["old_policy_pass"] is False  # HF pricing, one iteration
    with pytest.raises(ValueError, match="old_policy_pass must be None or a bool"):
        estimate("llama-3.1-8b", EstimateSpec(old_policy_pass="yes", **kw))


def test_lora_dropout_makes_the_kits_layers_run_whole(capsys):
    """With LoRA dropout the kit's checkpointing recomputes each layer whole and scores unsliced (the random masks
    cannot be split): its backward is the whole-layer recompute with the dropout's tensors, its scoring pass holds a
    whole MLP, and the config's lora_dropout reaches the estimate."""
    from grpo_kit.app.config import GRPOKitConfig
    from grpo_kit.memory import estimate_for_config

    a = resolve_arch("llama-3.1-8b")
    kw = dict(
        num_generations=8,
        prompt_length=512,
        completion_length=4096,
        dtype="bf16",
        lora_rank=16,
        micro_batch_size=1,
        vllm=False,
        include_generation=False,
        scoring_batch=8,
    )
    plain = estimate("llama-3.1-8b", EstimateSpec(**kw))
    drop = estimate("llama-3.1-8b", EstimateSpec(lora_dropout=True, **kw))
    rows = lambda df: df.set_index("component")["GB"] * F.GB  # noqa: E731
    T = 4608
    assert rows(drop)["recompute peak of one layer"] == pytest.approx(
        F.full_recompute_peak(a, T, 2, 16, 1, lora_dropout=True), rel=1e-12
    )
    assert rows(plain)["recompute peak of one layer"] < rows(drop)["recompute peak of one layer"]
    attention = 8 * T * 2 * (3 * a.q_dim + 2 * a.kv_dim)  # the whole MLP instead of one slice, where larger
    whole, one_slice = (max(attention, n * 3 * 2 * a.intermediate) for n in (8 * T, F.auto_chunk_tokens(a)))
    assert (
        rows(drop)["scoring pass (no grad)"] - rows(plain)["scoring pass (no grad)"]
        == pytest.approx(whole - one_slice, rel=1e-9)
        and whole > one_slice
    )
    assert drop.attrs["lora_dropout"] is True
    cfg = GRPOKitConfig(model="llama-3.1-8b", lora_dropout=0.05)
    assert estimate_for_config(cfg).attrs["lora_dropout"] is True
    assert estimate_for_config(GRPOKitConfig(model="llama-3.1-8b")).attrs["lora_dropout"] is False
    argv = [
        "--model",
        "llama-3.1-8b",
        "--context",
        str(T),
        "--prompt-length",
        "512",
        "--lora-rank",
        "16",
        "--micro-batch",
        "1",
        "--method",
        "grpo_kit",
        "--training-only",
    ]
    assert _vram(argv + ["--lora-dropout"]) == 0 and "masks cannot be split" in capsys.readouterr().out
    with pytest.raises(ValueError, match="lora_dropout=True needs lora_rank"):
        estimate("llama-3.1-8b", EstimateSpec(**{**kw, "lora_rank": None, "scoring_batch": None}, lora_dropout=True))


def test_a_scoring_batch_above_the_micro_batch_is_its_own_phase():
    """The reference pass at the micro-batch is smaller than training and not counted; scoring more sequences per
    forward adds a ``scoring`` phase: the persistent rows, one layer's dequantised 4-bit weights and the pass's own
    activations, which grow with the scoring batch and can become the peak."""
    kw = dict(
        num_generations=8,
        prompt_length=512,
        completion_length=1024,
        dtype="fp16",
        lora_rank=16,
        quantization="4bit",
        micro_batch_size=1,
        vllm=False,
        include_generation=False,
    )
    plain = estimate("llama-3.1-8b", EstimateSpec(**kw))
    for same in (None, 1):
        df = estimate("llama-3.1-8b", EstimateSpec(scoring_batch=same, **kw))
        assert df.attrs["phase_bytes"] == plain.attrs["phase_bytes"] and "scoring pass (no grad)" not in set(
            df.component
        )
    phases = {}
    for s in (2, 8):
        df = estimate("llama-3.1-8b", EstimateSpec(scoring_batch=s, **kw))
        rows = df.set_index("component")["GB"] * F.GB
        persistent = sum(rows[c] for c in ("model weights", "inference copy (vLLM)", "LoRA + optimiser states"))
        expect = persistent + rows["dequantised 4-bit weights of one layer"] + rows["scoring pass (no grad)"]
        phases[s] = df.attrs["phase_bytes"]["scoring"]
        assert phases[s] == pytest.approx(expect, rel=1e-9)
    assert phases[2] < phases[8] and df.attrs["peak_phase"] == "scoring"
    # TRL scores one generation batch (8 here) at a time: a larger number prices no more than that
    capped = estimate("llama-3.1-8b", EstimateSpec(scoring_batch=64, **kw))
    assert capped.attrs["phase_bytes"] == df.attrs["phase_bytes"]
    with pytest.raises(ValueError, match="scoring_batch applies to method='grpo_kit'"):
        estimate("llama-3.1-8b", EstimateSpec(scoring_batch=8, **{**kw, "method": "trl", "quantization": None}))
    with pytest.raises(ValueError, match="scoring_batch must be an int >= 1"):
        estimate("llama-3.1-8b", EstimateSpec(scoring_batch=0, **kw))


# ----------------------------------------------------------------------------- pinned estimates

QWEN = "qwen2.5-1.5b"
PINNED_SETTINGS = {
    "llama_kit_published": (LLAMA, dict(num_generations=8, prompt_length=0, completion_length=20480, lora_rank=16)),
    "llama_trl_published": (LLAMA, dict(num_generations=8, prompt_length=0, completion_length=20480, method="trl")),
    "llama_unsloth_4bit": (
        LLAMA,
        dict(
            num_generations=8,
            prompt_length=512,
            completion_length=4096,
            lora_rank=16,
            quantization="4bit",
            method="unsloth",
        ),
    ),
    "qwen_kit_4bit_standby_auto": (
        QWEN,
        dict(
            num_generations=8,
            prompt_length=256,
            completion_length=4096,
            lora_rank=16,
            quantization="4bit",
            kv_cache_dtype="fp8",
            micro_batch_size=2,
            generation_batch=16,
            standby=True,
            scoring_batch="auto",
        ),
    ),
    "qwen_trl_fp32_hf": (
        QWEN,
        dict(
            num_generations=4,
            prompt_length=128,
            completion_length=512,
            method="trl",
            lora_rank=8,
            loss_fp32=True,
            vllm=False,
            include_generation=False,
        ),
    ),
    "qwen_kit_full_fp32_torch": (
        QWEN,
        dict(
            num_generations=4,
            prompt_length=128,
            completion_length=512,
            dtype="fp32",
            offload=False,
            loss_epilogue="torch",
            vllm=False,
        ),
    ),
    "llama_kit_dropout_old_policy": (
        LLAMA,
        dict(
            num_generations=8,
            prompt_length=512,
            completion_length=8192,
            lora_rank=16,
            lora_dropout=True,
            old_policy_pass=True,
            micro_batch_size=1,
            scoring_batch=4,
        ),
    ),
    "qwen_kit_fp16_given_kv": (
        QWEN,
        dict(
            num_generations=16,
            prompt_length=64,
            completion_length=2048,
            dtype="fp16",
            lora_rank=32,
            kv_cache_bytes=2.0 * 2**30,
            chunk_tokens=1024,
            prefetch=False,
            vllm_batched_tokens=8192,
            micro_batch_size=4,
        ),
    ),
}
# estimate() for each setting above, computed before its split into one function per phase: (peak phase, scoring
# batch, bytes per component). Qwen's loss chunk since follows the loss's own rule, 768 rows instead of 832
# (whole 256-row tiles): 19,447,808 B less for that row, and a scoring batch of 8 instead of 7 under 'auto'.
PINNED = {
    "llama_kit_published": (
        "backward",
        None,
        {
            "model weights": 16060522496,
            "inference copy (vLLM)": 0,
            "LoRA + optimiser states": 503316480,
            "gradients": 167772160,
            "saved activations (GPU)": 1342177280,
            "saved activations (CPU)": 41607495680,
            "recompute peak of one layer": 16127098880,
            "logits for the loss": 262668288,
            "final norm + hidden states (loss)": 5369364480,
            "KV cache (generation)": 21491613696,
            "vLLM workspace (generation)": 515629056,
            "total GPU (peak)": 55692500992,
            "total CPU": 41607495680,
        },
    ),
    "llama_trl_published": (
        "loss",
        None,
        {
            "model weights": 16060522496,
            "inference copy (vLLM)": 16060522496,
            "LoRA + optimiser states": 32121044992,
            "gradients": 16060522496,
            "saved activations (GPU)": 42949672960,
            "saved activations (CPU)": 0,
            "recompute peak of one layer": 49766727680,
            "logits for the loss": 84053852160,
            "final norm + hidden states (loss)": 4027187200,
            "KV cache (generation)": 21491613696,
            "vLLM workspace (generation)": 515629056,
            "total GPU (peak)": 232824938496,
            "total CPU": 0,
        },
    ),
    "llama_unsloth_4bit": (
        "backward",
        None,
        {
            "model weights": 5702295552,
            "inference copy (vLLM)": 0,
            "LoRA + optimiser states": 503316480,
            "gradients": 167772160,
            "saved activations (GPU)": 301989888,
            "saved activations (CPU)": 9361686528,
            "recompute peak of one layer": 16800841728,
            "dequantised 4-bit weight (transient)": 117440512,
            "logits for the loss": 2101346304,
            "final norm + hidden states (loss)": 1174552576,
            "KV cache (generation)": 4378853376,
            "vLLM workspace (generation)": 515629056,
            "total GPU (peak)": 27972509696,
            "total CPU": 9361686528,
        },
    ),
    "qwen_kit_4bit_standby_auto": (
        "generation",
        7,
        {
            "model weights": 1142926720,
            "inference copy (vLLM)": 0,
            "LoRA + optimiser states": 221577216,
            "gradients": 73859072,
            "saved activations (GPU)": 26738688,
            "saved activations (CPU)": 721944576,
            "recompute peak of one layer": 1030660096,
            "dequantised 4-bit weights of one layer": 93585408,
            "logits for the loss": 233373696,
            "final norm + hidden states (loss)": 105416704,
            "scoring pass (no grad)": 1101332480,
            "KV cache (generation)": 950534144,
            "vLLM workspace (generation)": 303898624,
            "total GPU (peak)": 2618936704,
            "total CPU": 721944576,
        },
    ),
    "qwen_trl_fp32_hf": (
        "loss",
        None,
        {
            "model weights": 3087428608,
            "inference copy (vLLM)": 0,
            "LoRA + optimiser states": 110788608,
            "gradients": 36929536,
            "saved activations (GPU)": 220200960,
            "saved activations (CPU)": 0,
            "recompute peak of one layer": 620687360,
            "logits for the loss": 3733979136,
            "final norm + hidden states (loss)": 15738880,
            "KV cache (generation)": 0,
            "total GPU (peak)": 7205065728,
            "total CPU": 0,
        },
    ),
    "qwen_kit_full_fp32_torch": (
        "backward",
        None,
        {
            "model weights": 6174857216,
            "inference copy (vLLM)": 0,
            "LoRA + optimiser states": 12349714432,
            "gradients": 6174857216,
            "saved activations (GPU)": 440401920,
            "saved activations (CPU)": 0,
            "recompute peak of one layer": 804915200,
            "logits for the loss": 200555520,
            "final norm + hidden states (loss)": 59779072,
            "KV cache (generation)": 146800640,
            "total GPU (peak)": 25944745984,
            "total CPU": 0,
        },
    ),
    "llama_kit_dropout_old_policy": (
        "scoring",
        4,
        {
            "model weights": 16060522496,
            "inference copy (vLLM)": 0,
            "LoRA + optimiser states": 503316480,
            "gradients": 167772160,
            "saved activations (GPU)": 71303168,
            "saved activations (CPU)": 2210398208,
            "recompute peak of one layer": 4376858624,
            "logits for the loss": 262668288,
            "final norm + hidden states (loss)": 281053184,
            "scoring pass (no grad)": 9104261120,
            "KV cache (generation)": 8673820672,
            "vLLM workspace (generation)": 515629056,
            "total GPU (peak)": 34341920768,
            "total CPU": 2210398208,
        },
    ),
    "qwen_kit_fp16_given_kv": (
        "generation",
        None,
        {
            "model weights": 3087428608,
            "inference copy (vLLM)": 0,
            "LoRA + optimiser states": 443154432,
            "gradients": 147718144,
            "saved activations (GPU)": 25952256,
            "saved activations (CPU)": 700710912,
            "recompute peak of one layer": 354304000,
            "logits for the loss": 233373696,
            "final norm + hidden states (loss)": 103056384,
            "KV cache (generation)": 2147483648,
            "vLLM workspace (generation)": 578625536,
            "total GPU (peak)": 6256692224,
            "total CPU": 700710912,
        },
    ),
}


@pytest.mark.parametrize("name", list(PINNED_SETTINGS))
def test_estimate_keeps_its_pinned_numbers(name):
    """Every component of a few full estimates, to the byte: a refactor of ``estimate`` changes none of them."""
    model, kw = PINNED_SETTINGS[name]
    peak_phase, scoring_batch, rows = PINNED[name]
    df = estimate(model, EstimateSpec(**kw))
    assert (df.attrs["peak_phase"], df.attrs["scoring_batch"]) == (peak_phase, scoring_batch)
    assert {c: round(gb * 1e9) for c, gb in zip(df["component"], df["GB"])} == rows
    assert sum(df.attrs["phase_bytes"].values()) > 0 and df.attrs["phase_bytes"][peak_phase] == pytest.approx(
        rows["total GPU (peak)"], abs=1
    )


# ----------------------------------------------------------------------------- the spec

SPEC = dict(num_generations=8, prompt_length=16, completion_length=64)


def test_estimate_spec_fields_are_the_former_keywords():
    assert [f.name for f in dataclasses.fields(EstimateSpec)] == [
        "num_generations",
        "prompt_length",
        "completion_length",
        "dtype",
        "lora_rank",
        "quantization",
        "method",
        "vllm",
        "kv_cache_dtype",
        "micro_batch_size",
        "chunk_tokens",
        "prefetch",
        "include_generation",
        "offload",
        "loss_fp32",
        "loss_epilogue",
        "generation_batch",
        "standby",
        "kv_cache_bytes",
        "vllm_batched_tokens",
        "scoring_batch",
        "lora_dropout",
        "old_policy_pass",
        "tool_turns",
        "tool_result_tokens",
        "prefix_sharing",
    ]
    with pytest.raises(TypeError):
        EstimateSpec(num_generations=8, prompt_length=16)  # the completion length has no default
    spec = EstimateSpec(**SPEC)
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.method = "trl"
    # "auto" is a scoring batch for any method (TRL and Unsloth: none chosen)
    assert EstimateSpec(**SPEC, method="trl", scoring_batch="auto").scoring_batch == "auto"


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(num_generations=0), r"^num_generations must be an int >= 1, got 0$"),
        (dict(method="x"), r"^method must be one of \['trl', 'unsloth', 'grpo_kit'\], got 'x'$"),
        (
            dict(method="trl", prefix_sharing=True),
            r"^prefix_sharing applies to method='grpo_kit' only \(TRL and Unsloth score every row's prompt\), "
            r"got method='trl'$",
        ),
        (dict(scoring_batch="max"), r"^scoring_batch must be None, 'auto' or an integer >= 1, got 'max'$"),
    ],
)
def test_estimate_spec_rejects_a_bad_value_when_made(kwargs, match):
    """The checks run when a spec is made, and again on ``dataclasses.replace``: one ValueError naming the value."""
    with pytest.raises(ValueError, match=match):
        EstimateSpec(**SPEC | kwargs)
    with pytest.raises(ValueError, match=match):
        dataclasses.replace(EstimateSpec(**SPEC), **kwargs)


def test_estimate_takes_a_spec_only():
    with pytest.raises(TypeError, match="spec must be an EstimateSpec, got dict"):
        estimate("qwen2.5-1.5b", dict(SPEC))
    with pytest.raises(TypeError):
        estimate("qwen2.5-1.5b", **SPEC)


def test_a_spec_prices_what_the_keywords_did():
    """PINNED was computed with estimate's former keyword arguments: a spec holding the same values gives those
    bytes, through estimate and compare alike."""
    peak_phase, scoring_batch, rows = PINNED["qwen_kit_4bit_standby_auto"]
    spec = EstimateSpec(
        num_generations=8,
        prompt_length=256,
        completion_length=4096,
        lora_rank=16,
        quantization="4bit",
        kv_cache_dtype="fp8",
        micro_batch_size=2,
        generation_batch=16,
        standby=True,
        scoring_batch="auto",
    )
    df = estimate(QWEN, spec)
    assert (df.attrs["peak_phase"], df.attrs["scoring_batch"]) == (peak_phase, scoring_batch)
    assert {c: round(gb * 1e9) for c, gb in zip(df["component"], df["GB"])} == rows
    trl = compare(LLAMA, EstimateSpec(num_generations=8, prompt_length=0, completion_length=20480), methods=("trl",))
    assert {c: round(gb * 1e9) for c, gb in trl["trl"].items()} == PINNED["llama_trl_published"][2]


@pytest.mark.parametrize("epilogue", ["triton", "torch"])
@pytest.mark.parametrize("dtype", ["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("model", ["llama-3.1-8b", "qwen2.5-1.5b", "mistral-7b", "smollm2-135m-instruct"])
def test_loss_chunk_rows_follow_the_loss_rule(model, dtype, epilogue):
    """The calculator's logits chunks are the loss's (``grpo_kit.loss.efficient.auto_chunk_rows``): the scoring
    pass takes per_token_logps' rows, clamped to its token rows; the loss row the same, which is never below what
    efficient_grpo_loss takes for its n_tokens = B*T and covers that chunk plus the loss's 48 B per token of
    per-token vectors within one 256-row tile."""
    vocab = resolve_arch(model).vocab
    tdtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[dtype]
    b = F.DTYPE_BYTES[dtype]
    per_row = vocab * (b + (3 * F.FP32 if epilogue == "torch" else 0))  # the bytes the rule budgets per row
    for G, M, C in ((4, 1, 8), (8, 2, 300), (16, 8, 4096), (16, 4, 16384), (16, 8, 65536)):
        df = estimate(
            model,
            EstimateSpec(
                method="grpo_kit",
                lora_rank=8,
                dtype=dtype,
                loss_epilogue=epilogue,
                num_generations=G,
                prompt_length=32,
                completion_length=C,
                micro_batch_size=M,
                scoring_batch=G,
            ),
        )
        notes = df.set_index("component")["note"]
        loss_rows = int(re.search(r"one chunk of (\d+) token rows", notes["logits for the loss"]).group(1))
        score_rows = int(re.search(r"one logits chunk of (\d+) rows", notes["scoring pass (no grad)"]).group(1))
        assert score_rows == min(auto_chunk_rows(vocab, tdtype, torch.device("cpu"), epilogue), G * C)
        n = M * C
        assert loss_rows == min(auto_chunk_rows(vocab, tdtype, torch.device("cpu"), epilogue), n)
        taken = min(auto_chunk_rows(vocab, tdtype, torch.device("cpu"), epilogue, n_tokens=n), n)
        assert taken <= loss_rows and taken * per_row + 48 * n <= (loss_rows + 256) * per_row
    # the stale rule priced 832 rows here (64-row multiples); the loss takes whole 256-row tiles
    qwen = estimate(
        "qwen2.5-1.5b", EstimateSpec(method="grpo_kit", num_generations=8, prompt_length=0, completion_length=4096)
    )
    assert qwen.set_index("component").at["logits for the loss", "GB"] * 1e9 == pytest.approx(768 * 151936 * 2)


# ---- FP8 base weights (base_weights='fp8', issue 37) --------------------------------------------------------------


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen2"])
def test_fp8_weight_bytes_are_what_an_fp8_model_holds(name):
    """1 byte per projection weight plus a 4-byte scale per output channel; the rest in the training dtype:
    the bytes of every parameter of a model quantised by grpo_kit.model.fp8."""
    from grpo_kit.model.fp8 import quantize_model_fp8

    model = build_random_model(name, dtype=torch.bfloat16)
    report = quantize_model_fp8(model)
    held = sum(p.numel() * p.element_size() for p in model.parameters())  # a tied head counted once
    a = resolve_arch(name)
    assert F.weight_bytes(a, 2, "fp8") == held
    assert report["fp8_weight_bytes"] == F.param_counts(a)["layer_linear"]
    assert report["scale_bytes"] == F.fp8_scale_count(a) * F.FP32


def test_fp8_weights_are_priced_in_every_phase_and_the_8x20k_step_within_the_issue_target():
    kw = dict(
        num_generations=8,
        prompt_length=512,
        completion_length=20480,
        lora_rank=16,
        kv_cache_dtype="fp8",
        micro_batch_size=1,
        standby=True,
    )
    bf16, fp8 = estimate(LLAMA, EstimateSpec(**kw)), estimate(LLAMA, EstimateSpec(quantization="fp8", **kw))
    weights = fp8.set_index("component").loc["model weights"]
    assert weights["GB"] * 1e9 == pytest.approx(F.weight_bytes(resolve_arch(LLAMA), 2, "fp8"))
    assert "FP8 e4m3" in weights["note"] and fp8.attrs["quantization"] == "fp8"
    transient = fp8.set_index("component").loc["FP8 matmul transient (one projection)"]
    assert transient["GB"] > 0 and "FP8 matmul transient (one projection)" not in set(bf16["component"])
    saved = (F.weight_bytes(resolve_arch(LLAMA), 2, None) - F.weight_bytes(resolve_arch(LLAMA), 2, "fp8")) / F.GiB
    for name in ("generation", "loss", "backward"):  # the weights are alive in every phase: each is that much lower
        drop = (fp8.attrs["phase_bytes"][name] - bf16.attrs["phase_bytes"][name]) / F.GiB
        assert drop < -0.9 * saved, name
    peak = total_gpu_bytes(fp8) / F.GiB
    assert peak <= 22  # the calculator's figure for the issue's target (a measurement must confirm it)
    with pytest.raises(ValueError, match="needs lora_rank: quantised weights are frozen"):
        estimate(LLAMA, EstimateSpec(**{**kw, "lora_rank": None}, quantization="fp8"))
    with pytest.raises(ValueError, match="quantization must be one of"):
        estimate(LLAMA, EstimateSpec(**kw, quantization="int8"))


def test_the_config_prices_fp8_weights_and_fit_knows_which_gpus_have_fp8(monkeypatch):
    from grpo_kit.app.config import GRPOKitConfig
    from grpo_kit.memory import config_estimate_spec
    from grpo_kit.memory.fit import GPU_CAPABILITY, base_weights_for, free_t4_preset, has_fp8

    assert config_estimate_spec(GRPOKitConfig(base_weights="fp8")).quantization == "fp8"
    assert config_estimate_spec(GRPOKitConfig()).quantization is None
    assert [g for g in GPU_CAPABILITY if has_fp8(g)] == ["L4", "RTX 4090", "L40S", "H100", "H200", "B200", "RTX 5090"]
    assert not any(has_fp8(g) for g in ("Tesla T4", "Tesla V100-SXM2-16GB", "NVIDIA A100-SXM4-80GB"))
    assert base_weights_for("NVIDIA H100 80GB HBM3") == {"base_weights": "fp8", "quantization": "fp8"}
    assert base_weights_for("T4") == {"base_weights": "16bit", "quantization": None}
    with pytest.raises(ValueError, match="unknown GPU"):
        has_fp8("Voodoo 2")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (8, 9))
    assert has_fp8() and base_weights_for()["base_weights"] == "fp8"  # the detected GPU: fp8_support's check
    assert free_t4_preset(LLAMA)["base_weights"] == "16bit"
