"""A task's prompts as the model sees them: rendered through the tokenizer's chat template (with the tools'
schemas where a run has tools), counted against the prompt budget, and the few a 4-bit calibration reads."""

from __future__ import annotations

import torch

from grpo_kit.tasks.data import make_prompt


def prompt_ids(tokenizer, question: str, system_prompt: str, tools: list | None = None) -> list[int]:
    """A question's token ids as the model sees them: system prompt and question in the chat template (with the
    ``tools``' schema when given, as TRL renders it)."""
    text = tokenizer.apply_chat_template(
        make_prompt(question, system_prompt), tools=tools or None, tokenize=False, add_generation_prompt=True
    )
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def check_prompt_lengths(
    tokenizer, examples: list[dict], system_prompt: str, *, max_prompt_length: int, tools: list | None = None
) -> int:
    """Longest rendered prompt in tokens (``tools``' schemas included); one over ``max_prompt_length`` is an error,
    not a silent cut. What an environment's ``reset`` adds is known only at generation, where the trainer checks it
    (:class:`grpo_kit.trainer.generation_hook.KitGenerationMixin`)."""
    longest, worst = 0, None
    for e in examples:
        n = len(prompt_ids(tokenizer, e["question"], system_prompt, tools))
        if n > longest:
            longest, worst = n, e["question"]
    if longest > max_prompt_length:
        raise ValueError(
            f"a prompt is {longest} tokens, over max_prompt_length={max_prompt_length}: "
            f"{worst[:80]!r}... Raise max_prompt_length or shorten the prompts."
        )
    return longest


def calibration_batches(tokenizer, examples: list[dict], system_prompt: str, n: int = 8) -> list[torch.Tensor]:
    """``input_ids`` (1, T) of the first ``n`` training prompts as the model sees them: the activations
    ``load_in_4bit_skip_modules: auto`` measures NF4's error on."""
    return [torch.tensor([prompt_ids(tokenizer, e["question"], system_prompt)]) for e in examples[:n]]
