"""Held-out accuracy: greedy (or sampled) answers to problems, checked by the verifier."""

from __future__ import annotations

import torch
from tqdm.auto import tqdm

from grpo_kit.tasks.data import make_prompt
from grpo_kit.tasks.rewards import answer_matches


@torch.no_grad()
def evaluate_accuracy(model, tokenizer, examples: list[dict], *, system_prompt: str = "", max_new_tokens: int = 32,
                      batch_size: int = 50, num_samples: int = 1, temperature: float = 0.0, seed: int = 0,
                      progress: str | None = None) -> dict:
    """Accuracy of ``model`` on ``examples`` (``question``/``answer`` dicts).

    ``temperature=0`` is greedy decoding; otherwise ``num_samples`` samples per problem
    are drawn and accuracy is the mean over all samples. Returns ``accuracy``,
    ``by_level`` (when examples carry a level), ``n`` and the first few ``samples``. ``progress``: the label
    of a tqdm bar over the problems (None: no bar).
    """
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    side = tokenizer.padding_side
    tokenizer.padding_side = "left"  # decoder-only batch generation needs left padding
    gen = torch.Generator(device="cpu").manual_seed(seed)
    correct: list[float] = []
    samples = []
    bar = tqdm(total=len(examples), desc=progress, unit="problem", disable=progress is None, leave=False)
    try:
        for start in range(0, len(examples), batch_size):
            batch = examples[start:start + batch_size]
            texts = [tokenizer.apply_chat_template(make_prompt(e["question"], system_prompt), tokenize=False,
                                                   add_generation_prompt=True) for e in batch]
            enc = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False).to(device)
            kwargs = dict(max_new_tokens=max_new_tokens, pad_token_id=tokenizer.pad_token_id)
            if temperature > 0:
                torch.manual_seed(int(torch.randint(0, 2**31 - 1, (1,), generator=gen)))
                kwargs.update(do_sample=True, temperature=temperature, top_k=0, top_p=1.0,
                              num_return_sequences=num_samples)
            else:
                kwargs.update(do_sample=False, temperature=None, top_p=None, top_k=None)
            out = model.generate(**enc, **kwargs)
            completions = tokenizer.batch_decode(out[:, enc["input_ids"].shape[1]:], skip_special_tokens=True)
            reps = num_samples if temperature > 0 else 1
            for i, text in enumerate(completions):
                ex = batch[i // reps]
                ok = answer_matches(text, str(ex["answer"]))
                correct.append(float(ok))
                if len(samples) < 8:
                    samples.append({"question": ex["question"], "answer": ex["answer"], "completion": text,
                                    "correct": ok})
            bar.update(len(batch))
    finally:
        bar.close()
        tokenizer.padding_side = side
        model.train(was_training)
    result = {"accuracy": sum(correct) / max(1, len(correct)), "n": len(examples), "samples": samples}
    levels = sorted({e.get("level") for e in examples if e.get("level") is not None})
    if levels:
        reps = num_samples if temperature > 0 else 1
        result["by_level"] = {
            str(lv): sum(c for i, c in enumerate(correct) if examples[i // reps].get("level") == lv)
            / max(1, sum(1 for i in range(len(correct)) if examples[i // reps].get("level") == lv))
            for lv in levels}
    return result
