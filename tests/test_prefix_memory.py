"""The VRAM calculator with prefix sharing (grpo_kit.memory.estimate, formulas; `vram --prefix-sharing`): the shared
prompt priced once in each training phase (and, by vLLM's prefix cache, once in generation either way), its keys and
values held through the loss and backward (held to what autograd keeps on the CPU), and the issue's question
answered: does 8 x (126,976 + 2,048) fit an 80 GB card, with and without sharing."""

import dataclasses

import pytest
import torch
from peft import LoraConfig, get_peft_model

from grpo_kit.app.config import GRPOKitConfig
from grpo_kit.memory import formulas as F
from grpo_kit.memory.cli import cli_main
from grpo_kit.memory.estimate import EstimateSpec, config_estimate_spec, estimate, resolve_arch
from grpo_kit.memory.fit import fit_verdict
from grpo_kit.model.loading import build_random_model
from grpo_kit.model.offload import enable_offloaded_checkpointing
from grpo_kit.model.prefix import shared_group_hidden

LLAMA = "llama-3.1-8b"
LONG = dict(
    num_generations=8, prompt_length=126_976, completion_length=2_048, lora_rank=16, micro_batch_size=8, standby=True
)  # the issue's row: 8 x (126,976 + 2,048), bf16 LoRA r = 16, vLLM in standby


def _gib(df, component):
    return float(df.loc[df["component"] == component, "GiB"].iloc[0])


def test_a_forward_runs_each_groups_prompt_once():
    assert F.shared_prefix_tokens(100, 10, rows=8, generations=8) == 100 + 8 * 10
    assert F.shared_prefix_tokens(100, 10, rows=16, generations=8) == 2 * 100 + 16 * 10
    assert F.shared_prefix_tokens(100, 10, rows=4, generations=8) == 100 + 4 * 10  # part of one group
    a = resolve_arch(LLAMA)
    assert F.prefix_kv_bytes(a, 1000, 2) == 2 * 32 * 1000 * 1024 * 2  # K and V, 32 layers, 8 KV heads of 128
    # the prompt's and the row's keys and values joined per row (8 KV heads of 128), then repeated to the 32 query
    # heads (transformers' SDPA path with a mask); with grad, each again as its gradient
    joined_and_repeated = 8 * 1024 * 2 * (1024 + 4096) * 2
    assert F.prefix_attention_bytes(a, 8, 1000, 24, 2, with_grad=False) == joined_and_repeated
    assert F.prefix_attention_bytes(a, 8, 1000, 24, 2, with_grad=True) == 2 * joined_and_repeated
    mha = dataclasses.replace(a, kv_heads=a.heads)  # no grouped heads: nothing to repeat
    assert F.prefix_attention_bytes(mha, 8, 1000, 24, 2, with_grad=False) == 8 * 1024 * 2 * 4096 * 2
    assert F.prefix_mask_bytes(8, 1000, 24, 2) == 24 * 1024 * (1 + 8 * 2)  # bool once, then bf16 additive per row


def test_the_training_phases_price_the_shared_prompt_once():
    a = resolve_arch(LLAMA)
    P, C, M, b = LONG["prompt_length"], LONG["completion_length"], LONG["micro_batch_size"], 2
    off, on = estimate(LLAMA, EstimateSpec(**LONG)), estimate(LLAMA, EstimateSpec(**LONG, prefix_sharing=True))
    assert on.attrs["prefix_sharing"] and not off.attrs["prefix_sharing"]
    tokens = P + M * C  # one prompt (the micro-batch is one group) and eight completions
    assert _gib(on, "saved activations (GPU)") * 2**30 == F.checkpoint_bytes(a, tokens, b, 1)
    assert _gib(on, "saved activations (CPU)") * 2**30 == F.checkpoint_bytes(a, tokens, b, a.layers - 1)
    assert _gib(off, "saved activations (CPU)") * 2**30 == F.checkpoint_bytes(a, M * (P + C), b, a.layers - 1)
    assert _gib(on, "prompt keys and values (prefix sharing)") * 2**30 == F.kv_cache_bytes(a, P, b)
    assert "prompt keys and values (prefix sharing)" not in set(off["component"])
    # generation: vLLM's prefix cache holds each prompt once with or without it
    assert _gib(on, "KV cache (generation)") == _gib(off, "KV cache (generation)")
    assert _gib(on, "recompute peak of one layer") < _gib(off, "recompute peak of one layer") / 2
    on_phases, off_phases = on.attrs["phase_bytes"], off.attrs["phase_bytes"]
    assert on_phases["backward"] < off_phases["backward"] / 1.5 and on_phases["loss"] < off_phases["loss"]


def test_the_issues_row_fits_an_80_gb_card_only_with_sharing():
    context = LONG["prompt_length"] + LONG["completion_length"]
    off = fit_verdict(LLAMA, 80, EstimateSpec(**LONG))
    on = fit_verdict(LLAMA, 80, EstimateSpec(**LONG, prefix_sharing=True))
    assert off.context == on.context == context
    assert not off.fits and off.peak_gib > 100
    # priced at well under the unshared step; the whole step measured past 80 GiB on an H100 (docs/long_context.md)
    assert on.peak_gib < off.peak_gib / 1.4 and on.fits == (on.peak_gib <= 80)


def test_the_scoring_pass_runs_one_group_at_a_time():
    a = resolve_arch(LLAMA)
    df = estimate(LLAMA, EstimateSpec(**LONG, scoring_batch=16, generation_batch=16, prefix_sharing=True))
    P, C = LONG["prompt_length"], LONG["completion_length"]
    chunk = F.auto_chunk_tokens(a)
    logits = _gib(df, "scoring pass (no grad)") * 2**30 - F.shared_scoring_peak(a, 8, P, C, 2, chunk, 0, True)
    assert 0 < logits < 2**30  # the rest is one logits chunk
    assert F.shared_scoring_peak(a, 8, P, C, 2, chunk, 0) == F.kv_cache_bytes(a, P, 2) + max(
        F.scoring_forward_peak(a, 1, P, 2, chunk, 0),
        F.scoring_forward_peak(a, 8, C, 2, chunk, 0)
        + F.prefix_attention_bytes(a, 8, P, C, 2, False)
        + F.prefix_mask_bytes(8, P, C, 2),
    )


def test_short_prompts_gain_nothing_and_auto_is_priced_unshared():
    short = dict(LONG, prompt_length=512, completion_length=4096)
    off, on = estimate(LLAMA, EstimateSpec(**short)), estimate(LLAMA, EstimateSpec(**short, prefix_sharing=True))
    assert on.attrs["phase_bytes"]["backward"] >= off.attrs["phase_bytes"]["backward"]  # why auto leaves it off
    assert config_estimate_spec(GRPOKitConfig()).prefix_sharing is False  # auto: its bound, unshared
    assert config_estimate_spec(GRPOKitConfig(prefix_sharing=True)).prefix_sharing is True
    with pytest.raises(ValueError, match="prefix_sharing applies to method='grpo_kit' only"):
        estimate(LLAMA, EstimateSpec(**LONG, method="trl", prefix_sharing=True))


def test_vram_answers_with_and_without_sharing(capsys):
    argv = [
        "--model",
        LLAMA,
        "--context",
        "129024",
        "--prompt-length",
        "126976",
        "--generations",
        "8",
        "--micro-batch",
        "8",
        "--lora-rank",
        "16",
        "--standby",
        "--gpu-gib",
        "80",
        "--prefix-sharing",
        "both",
    ]
    assert cli_main(argv) == 0
    out = capsys.readouterr().out
    assert "method grpo_kit + prefix sharing: peak during" in out and "prompt keys and values" in out
    verdicts = out.split("Does it fit in 80.00 GiB")[1].splitlines()
    assert verdicts[1].startswith("  grpo_kit: does not fit")
    assert verdicts[2].startswith("  grpo_kit + prefix sharing: fits")
    with pytest.raises(SystemExit):
        cli_main(argv[:-1] + ["on", "--method", "trl"])
    assert "describes the grpo_kit trainer" in capsys.readouterr().err


def test_the_training_pass_holds_the_prompts_keys_and_values_as_priced():
    """Under offloaded checkpointing the completions' layers keep the prompt's keys and values (what autograd saves
    of shape (1, kv heads, P, head dim)): the calculator's "prompt keys and values" row, byte for byte."""
    torch.manual_seed(0)
    model = get_peft_model(build_random_model("tiny-llama"), LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    enable_offloaded_checkpointing(model, min_bytes=0, pin_memory=False, _offload_on_cpu=True)
    model.train()
    P, G, C = 24, 4, 6
    held = {}

    def pack(t):
        if t.dim() == 4 and t.shape[0] == 1 and t.shape[2] == P:
            held[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        hidden = shared_group_hidden(model, torch.arange(3, 3 + P), torch.randint(3, 900, (G, C)))
    assert sum(held.values()) == F.prefix_kv_bytes(resolve_arch("tiny-llama"), P, 4)
    hidden.sum().backward()  # and the graph runs
    assert all(p.grad is not None for n, p in model.named_parameters() if p.requires_grad)


def test_the_completions_mask_is_one_c_by_p_plus_c_broadcast_over_rows():
    """What prefix_mask_bytes prices: transformers hands SDPA one boolean (C, P + C) mask, stride 0 over the rows
    (SDPA then makes it additive, one per row)."""
    model = build_random_model("tiny-llama")
    seen, layer = [], model.model.layers[0]
    forward = layer.forward

    def spy(*args, **kwargs):
        seen.append(kwargs.get("attention_mask"))
        return forward(*args, **kwargs)

    layer.forward = spy
    P, G, C = 37, 4, 6
    with torch.no_grad():
        shared_group_hidden(model, torch.arange(3, 3 + P), torch.randint(3, 900, (G, C)))
    assert seen[0] is None  # the prompt: causal, no mask
    mask = seen[1]
    assert mask.shape == (G, 1, C - 1, P + C - 1) and mask.stride(0) == 0 and mask.dtype == torch.bool
    assert mask.untyped_storage().nbytes() == F.prefix_mask_bytes(G, P, C - 1, 0)  # the bool mask, once
