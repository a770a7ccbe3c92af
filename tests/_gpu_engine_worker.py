"""One vLLM engine per process for ``tests/test_gpu_vllm.py`` (an engine with sleep mode owns vLLM's
memory pool for its process). ``python tests/_gpu_engine_worker.py fp8|copy``; prints ``RESULT {json}``.

* ``fp8``: FP8 KV cache + shared weights + standby: greedy output equal before and after standby.
* ``copy``: full fine-tuning keeps a separate engine copy: changed HF weights reach the engine by
  ``load_weights`` (greedy output follows the HF model); level-2 sleep drops the copy's weights and the next
  sync brings them back.
* ``merge``: shared weights with ``lora_sync="merge"`` (engine without LoRA, CUDA graphs): the adapter merged
  for each generation gives the trained HF model's log-probs, the engine's weights are bit-identical after
  every generation and after two trainer steps, and standby round-trips.
"""

import json
import sys
import time


def _prompts(tok):
    return [
        tok.apply_chat_template(
            [{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True, return_dict=True
        )["input_ids"]
        for q in ("What is 12+7?", "Say hello.")
    ]


LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def random_adapter(model):
    """``model`` with a PEFT LoRA adapter (r=16) on every projection, its B factors random (seeded), in eval mode."""
    import torch
    from peft import LoraConfig, get_peft_model

    pm = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, target_modules=LORA_TARGETS)).eval()
    g = torch.Generator(device="cuda").manual_seed(0)
    with torch.no_grad():
        for n, p in pm.named_parameters():
            if "lora_B" in n:
                p.copy_(torch.randn(p.shape, generator=g, device="cuda") * 0.03)
    return pm


def mean_logprob_diffs(res, model, sampling):
    """Per completion: mean |vLLM log-prob - HF log-prob| of vLLM's own tokens (HF teacher-forced), so a
    near-tie that sends the two greedy paths apart in bf16 does not hide a real difference."""
    from grpo_kit.generation.hf import sampling_logprobs_reference

    return [
        float((lp - sampling_logprobs_reference(model, p, ids, sampling)).abs().mean())
        for p, ids, lp in zip(res.prompt_ids, res.completion_ids, res.logprobs)
    ]


def _sync_log(trainer) -> list:
    from grpo_kit.trainer.channel import channel

    return channel(trainer).sync_log


def fp8() -> dict:
    import torch
    from transformers import AutoConfig

    from grpo_kit.generation import SamplingConfig
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
        kv_cache_dtype="fp8",
        kv_cache_memory_bytes=2**30,
        gpu_memory_utilization=0.1,
        max_num_seqs=8,
        enforce_eager=True,
    )
    model = gen.training_model(AutoConfig.from_pretrained(embedded_model_dir()), torch.bfloat16)
    greedy = SamplingConfig(temperature=0.0, max_tokens=16)
    first = gen.generate(_prompts(tok), 1, greedy).completion_ids
    gen.sleep()
    again = gen.generate(_prompts(tok), 1, greedy).completion_ids
    cfg = model.config
    per_token_bf16 = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * 2
    blocks = gen.llm.llm_engine.vllm_config.cache_config.num_gpu_blocks
    block = gen.llm.llm_engine.vllm_config.cache_config.block_size
    out = {
        "kv_cache_dtype": gen.options()["kv_cache_dtype"],
        "same_after_standby": first == again,
        "shared_other_params": gen.shared_report["other_params"],
        "kv_blocks": blocks,
        "kv_bytes_per_token": int(gen.kv_cache_bytes // (blocks * block)),
        "bf16_kv_bytes_per_token": per_token_bf16,
        "text": tok.decode(first[0]),
    }
    gen.close()
    return out


def copy() -> dict:
    import torch

    from grpo_kit.generation import SamplingConfig
    from grpo_kit.generation.vllm_backend import VLLMGenerator
    from grpo_kit.model.loading import embedded_model_dir, load_model

    model, tok = load_model(dtype=torch.bfloat16, device="cuda")
    gen = VLLMGenerator(
        embedded_model_dir(),
        tokenizer=tok,
        dtype="bfloat16",
        max_model_len=512,
        kv_cache_memory_bytes=2**30,
        gpu_memory_utilization=0.1,
        max_num_seqs=8,
        enforce_eager=True,
    )
    greedy = SamplingConfig(temperature=0.0, max_tokens=16)
    base = gen.generate(_prompts(tok), 1, greedy).completion_ids
    with torch.no_grad():
        for layer in model.model.layers[:10]:
            layer.mlp.down_proj.weight.mul_(1.5)
    info = gen.sync_weights(model)
    from grpo_kit.generation import HFGenerator

    synced = gen.generate(_prompts(tok), 1, greedy).completion_ids
    hf = HFGenerator(model, tok).generate(_prompts(tok), 1, greedy).completion_ids
    follows = all(a[:8] == b[:8] for a, b in zip(synced, hf)) and synced != base
    t = time.perf_counter()
    gen.sleep()  # level 2: the copy's weights are dropped, the next sync brings them
    sleep_s = time.perf_counter() - t
    try:
        gen.generate(_prompts(tok), 1, greedy)
        refused = False
    except RuntimeError as e:
        refused = "sync_weights" in str(e)
    needed = gen.needs_sync
    resync = gen.sync_weights(model)
    after = gen.generate(_prompts(tok), 1, greedy)
    out = {
        "sync_mode": info["mode"],
        "sync_s": info["seconds"],
        "follows_hf": follows,
        "refused_without_weights": refused,
        "needs_sync_after_sleep": needed,
        "sleep": gen.options()["sleep"],
        "same_after_sleep": after.completion_ids == synced,
        "sleep_s": sleep_s,
        "resync_s": resync["seconds"],
    }
    gen.close()
    return out


def merge() -> dict:
    import torch
    from peft import LoraConfig
    from transformers import AutoConfig
    from trl import GRPOConfig

    from grpo_kit.generation import SamplingConfig
    from grpo_kit.generation.vllm_backend import VLLMGenerator, _engine_model
    from grpo_kit.model.loading import embedded_model_dir, load_tokenizer
    from grpo_kit.tasks.data import generate_tasks, to_prompt_dataset
    from grpo_kit.trainer.grpo_trainer import EfficientGRPOTrainer

    tok = load_tokenizer()
    gen = VLLMGenerator(
        embedded_model_dir(),
        tokenizer=tok,
        dtype="bfloat16",
        max_model_len=512,
        share_weights=True,
        lora_sync="merge",
        kv_cache_memory_bytes=2**30,
        gpu_memory_utilization=0.1,
        max_num_seqs=16,
    )
    config = AutoConfig.from_pretrained(embedded_model_dir())
    model = gen.training_model(config, torch.bfloat16)
    engine = gen.llm.collective_rpc(_engine_model)[0]
    before = {n: p.data.clone() for n, p in engine.named_parameters()}  # 135M parameters: a copy to compare with

    def unchanged() -> bool:  # every bit of every engine tensor (integer views: NaN payloads and -0 count)
        return all(
            torch.equal(p.data.view(-1).view(torch.uint8), before[n].view(-1).view(torch.uint8))
            for n, p in engine.named_parameters()
        )

    greedy = SamplingConfig(temperature=0.0, max_tokens=16)
    base = gen.generate(_prompts(tok), 1, greedy)
    pm = random_adapter(model)
    info = gen.sync_weights(pm)
    res = gen.generate(_prompts(tok), 1, greedy)
    lora_diffs = mean_logprob_diffs(res, pm, greedy)
    with pm.disable_adapter():
        base_diffs = mean_logprob_diffs(res, pm, greedy)
    same_bits_after_generate = unchanged()
    gen.sleep()
    again = gen.generate(_prompts(tok), 1, greedy)
    gen.sleep()
    tok.padding_side = "left"
    import tempfile

    with tempfile.TemporaryDirectory() as out_dir:
        args = GRPOConfig(
            output_dir=out_dir,
            max_steps=2,
            per_device_train_batch_size=8,
            num_generations=4,
            max_completion_length=16,
            learning_rate=1e-3,
            logging_steps=1,
            report_to="none",
            bf16=True,
            beta=0.04,
            save_strategy="no",
            gradient_checkpointing=True,
        )
        trainer = EfficientGRPOTrainer(  # a second training model on the same engine tensors
            model=gen.training_model(config, torch.bfloat16),
            reward_funcs=[lambda prompts, completions, **kw: [len(str(c)) / 50.0 for c in completions]],
            args=args,
            processing_class=tok,
            train_dataset=to_prompt_dataset(generate_tasks("arithmetic", 16, seed=0)),
            peft_config=LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj", "down_proj"]),
            generator=gen,
        )
        trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    out = {
        "sync_mode": info["mode"],
        "merged_weights": res.timings.get("merge_s") is not None,
        "last_merge": gen.last_merge,
        "lora_logprob_mean_abs_diff": lora_diffs,
        "base_logprob_mean_abs_diff": base_diffs,
        "differs_from_base": res.completion_ids != base.completion_ids,
        "same_bits_after_generate": same_bits_after_generate,
        "same_after_standby": again.completion_ids == res.completion_ids,
        "trainer_sync_modes": [e["mode"] for e in _sync_log(trainer)],
        "losses": losses,
        "same_bits_after_training": unchanged(),
        "shared_other_params": gen.shared_report["other_params"],
        "lora_sync": gen.options()["lora_sync"],
        "timings": res.timings,
    }
    gen.close()
    return out


def family(name: str) -> dict:
    """One copy for a family's built-in (random weights, vLLM's dummy init): the training model built on the
    engine's tensors, every parameter a view of the engine's storage, and vLLM's greedy log-probs against the
    training model's own (teacher-forced on vLLM's tokens), base and with a random adapter in vLLM's LoRA kernels."""
    import torch

    from grpo_kit.generation import SamplingConfig
    from grpo_kit.generation.plan import generation_model_dir
    from grpo_kit.generation.shared_weights import UnshareableError
    from grpo_kit.generation.vllm_backend import VLLMGenerator
    from grpo_kit.model.anatomy import lora_targets
    from grpo_kit.model.loading import load_tokenizer, model_config

    folder, dummy = generation_model_dir(name, "cuda")
    tok = load_tokenizer(name)
    start = time.perf_counter()
    # the adapter in vLLM's LoRA kernels: on vLLM's random (dummy) weights every element would change in a merge,
    # which the reversible merge refuses (it keeps at most a quarter of a weight to restore; seen on an H100)
    gen = VLLMGenerator(
        folder,
        tokenizer=tok,
        dtype="bfloat16",
        max_model_len=512,
        share_weights=True,
        dummy_weights=dummy,
        lora_sync="adapter",
        max_lora_rank=16,
        max_num_seqs=8,
        kv_cache_memory_bytes=2**30,
        gpu_memory_utilization=0.3,
        enforce_eager=True,
    )
    out = {"model": name, "engine_start_s": round(time.perf_counter() - start, 1), "architecture": gen.architecture}
    try:
        model = gen.training_model(model_config(name), torch.bfloat16).eval()
    except UnshareableError as e:
        gen.close()
        return dict(out, shared=False, unshareable=str(e)[:300])
    greedy = SamplingConfig(temperature=0.0, max_tokens=16)
    base = gen.generate(_prompts(tok), 1, greedy)
    out.update(
        shared=True, shared_report=gen.shared_report, base_logprob_mean_abs_diff=mean_logprob_diffs(base, model, greedy)
    )
    from peft import LoraConfig, get_peft_model

    pm = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=lora_targets(model))).eval()
    g = torch.Generator(device="cuda").manual_seed(0)
    with torch.no_grad():
        for n, p in pm.named_parameters():
            if "lora_B" in n:
                p.copy_(torch.randn(p.shape, generator=g, device="cuda") * 0.03)
    gen.sync_weights(pm)
    lora = gen.generate(_prompts(tok), 1, greedy)
    out.update(
        lora_logprob_mean_abs_diff=mean_logprob_diffs(lora, pm, greedy),
        differs_from_base=lora.completion_ids != base.completion_ids,
    )
    gen.close()
    return out


if __name__ == "__main__":
    import os

    os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
    if sys.argv[1] == "family":
        result = family(sys.argv[2])
        print("RESULT " + json.dumps(result), flush=True)
        sys.exit(0)
    result = {"fp8": fp8, "copy": copy, "merge": merge}[sys.argv[1]]()
    print("RESULT " + json.dumps(result), flush=True)
