"""How sparse is the reward at the start? Base-model reward rates under the default sampling.

    python bench/start_rewards.py --backend vllm --dtype auto --n 100

Samples ``num_generations`` (8) completions for each of the first ``n`` training prompts of ``seed`` with the
untrained embedded model and reports the share correct, the share with ``Answer: <n>``
(format_soft) and the share of groups in which every reward is 0: such a group has zero
advantage and gives the update nothing. Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")


def main(argv=None) -> int:
    import torch

    from grpo_kit.app.config import GRPOKitConfig
    from grpo_kit.generation import SamplingConfig, make_generator
    from grpo_kit.model.loading import embedded_model_dir, load_model, load_tokenizer
    from grpo_kit.tasks.data import build_datasets, default_system_prompt, make_prompt
    from grpo_kit.tasks.rewards import correctness_reward, format_soft_reward

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--backend", choices=["hf", "vllm"], default="vllm")
    p.add_argument("--dtype", default="auto", help="vLLM dtype (HF generates in fp32)")
    p.add_argument("--n", type=int, default=100, help="training prompts")
    p.add_argument("--seed", type=int, default=2, help="training-data seed")
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--system-prompt", default="", help="empty: the task's default")
    a = p.parse_args(argv)

    cfg = GRPOKitConfig(seed=a.seed, temperature=a.temperature)
    train, _ = build_datasets(cfg)
    tok = load_tokenizer()
    ex = train[: a.n]
    system = a.system_prompt or default_system_prompt(cfg.task)
    prompts = [
        tok.apply_chat_template(make_prompt(e["question"], system), tokenize=False, add_generation_prompt=True)
        for e in ex
    ]
    model = load_model(dtype=torch.float32)[0]
    kw = dict(model_dir=embedded_model_dir(), dtype=a.dtype, max_model_len=512, seed=0) if a.backend == "vllm" else {}
    gen = make_generator(a.backend, model=model, tokenizer=tok, **kw)
    sampling = SamplingConfig.from_config(cfg, seed=123, stop_token_ids=[tok.eos_token_id])
    t = time.time()
    g = cfg.num_generations
    res = gen.generate(prompts, num_generations=g, sampling=sampling)
    answers = [e["answer"] for e in ex for _ in range(g)]
    corr = correctness_reward(None, res.texts, answers)
    fmt = format_soft_reward(None, res.texts)
    zero = sum(1 for i in range(a.n) if sum(corr[g * i : g * (i + 1)]) + sum(fmt[g * i : g * (i + 1)]) == 0)
    print(
        json.dumps(
            dict(
                backend=a.backend,
                dtype=a.dtype,
                n=a.n,
                temperature=a.temperature,
                system_prompt=system,
                seconds=round(time.time() - t, 1),
                correct=sum(corr) / len(corr),
                format_soft=sum(fmt) / len(fmt),
                zero_reward_groups=zero / a.n,
                samples=res.texts[:4],
            )
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
