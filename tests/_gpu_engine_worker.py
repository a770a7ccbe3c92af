"""One vLLM engine per process for ``tests/test_gpu_vllm.py`` (an engine with sleep mode owns vLLM's
memory pool for its process). ``python tests/_gpu_engine_worker.py fp8|copy``; prints ``RESULT {json}``.

* ``fp8``: FP8 KV cache + shared weights + standby: greedy output equal before and after standby.
* ``copy``: full fine-tuning keeps a separate engine copy: changed HF weights reach the engine by
  ``load_weights`` (greedy output follows the HF model), and level-1 sleep/wake round-trips.
"""

import json
import sys
import time


def _prompts(tok):
    return [tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True,
                                    return_dict=True)["input_ids"] for q in ("What is 12+7?", "Say hello.")]


def fp8() -> dict:
    import torch
    from transformers import AutoConfig

    from grpo_kit.generation import SamplingConfig
    from grpo_kit.generation.vllm_backend import VLLMGenerator
    from grpo_kit.models import embedded_model_dir, load_tokenizer

    tok = load_tokenizer()
    gen = VLLMGenerator(embedded_model_dir(), tokenizer=tok, dtype="bfloat16", max_model_len=512, share_weights=True,
                        lora_sync="adapter", kv_cache_dtype="fp8", kv_cache_memory_bytes=2**30,
                        gpu_memory_utilization=0.1, max_num_seqs=8, enforce_eager=True)
    model = gen.training_model(AutoConfig.from_pretrained(embedded_model_dir()), torch.bfloat16)
    greedy = SamplingConfig(temperature=0.0, max_tokens=16)
    first = gen.generate(_prompts(tok), 1, greedy).completion_ids
    gen.sleep()
    again = gen.generate(_prompts(tok), 1, greedy).completion_ids
    cfg = model.config
    per_token_bf16 = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * 2
    blocks = gen.llm.llm_engine.vllm_config.cache_config.num_gpu_blocks
    block = gen.llm.llm_engine.vllm_config.cache_config.block_size
    out = {"kv_cache_dtype": gen.options()["kv_cache_dtype"], "same_after_standby": first == again,
           "shared_other_params": gen.shared_report["other_params"], "kv_blocks": blocks,
           "kv_bytes_per_token": int(gen.kv_cache_bytes // (blocks * block)), "bf16_kv_bytes_per_token": per_token_bf16,
           "text": tok.decode(first[0])}
    gen.close()
    return out


def copy() -> dict:
    import torch

    from grpo_kit.generation import SamplingConfig
    from grpo_kit.generation.vllm_backend import VLLMGenerator
    from grpo_kit.models import embedded_model_dir, load_model

    model, tok = load_model(dtype=torch.bfloat16, device="cuda")
    gen = VLLMGenerator(embedded_model_dir(), tokenizer=tok, dtype="bfloat16", max_model_len=512,
                        kv_cache_memory_bytes=2**30, gpu_memory_utilization=0.1, max_num_seqs=8, enforce_eager=True)
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
    out = {"sync_mode": info["mode"], "sync_s": info["seconds"], "follows_hf": follows,
           "refused_without_weights": refused, "needs_sync_after_sleep": needed, "sleep": gen.options()["sleep"],
           "same_after_sleep": after.completion_ids == synced, "sleep_s": sleep_s, "resync_s": resync["seconds"]}
    gen.close()
    return out


if __name__ == "__main__":
    import os

    os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
    result = {"fp8": fp8, "copy": copy}[sys.argv[1]]()
    print("RESULT " + json.dumps(result), flush=True)
