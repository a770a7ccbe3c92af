"""A supervised warm-up before GRPO with a calculator: worked tool transcripts of training questions.

GRPO learns only from groups whose rewards differ, so a model that never calls the tool gives it nothing to
reinforce (the embedded 135M model called the calculator in about 1 of 32 sampled rollouts, even with a worked
example in its system prompt). ``tool_warmup_steps`` first trains the adapter by plain cross-entropy on
transcripts of the run's own training questions, each: the question, the assistant's call of ``calculator`` on the
question's expression, the tool's result, the assistant's ``Answer: <result>``. The loss counts the assistant's
tokens only (the call and the answer, each turn's end marker included); the system prompt, question and tool
result are context. A transcript is made only where the question holds one arithmetic expression whose value the
calculator gives and equals the example's answer; the held-out questions are never used.
"""

from __future__ import annotations

import random
import re
import time

import torch
import torch.nn.functional as F

from grpo_kit.tasks.data import ARITHMETIC_TASKS
from grpo_kit.tasks.tools import ToolError, calculator

IGNORE = -100  # label of a token outside the assistant's turns (cross_entropy's ignore_index)
# numbers joined by arithmetic operators, the question's own signs (×, ÷, −) included
_EXPRESSION = re.compile(r"\d+(?:\.\d+)?(?:\s*[-+*/×÷−]\s*\d+(?:\.\d+)?)+")
_SIGNS = str.maketrans({"×": "*", "÷": "/", "−": "-"})


def question_expression(question: str) -> str | None:
    """The one arithmetic expression in ``question``, in the calculator's syntax (``12 × 34`` -> ``12 * 34``); None
    where it holds none or several."""
    found = _EXPRESSION.findall(question)
    return found[0].translate(_SIGNS) if len(found) == 1 else None


def tool_transcript(example: dict, system_prompt: str) -> list[dict] | None:
    """The chat messages of one worked calculator call for ``example`` (``question``, ``answer``), or None where its
    question has no expression the calculator evaluates to the answer."""
    expression = question_expression(example["question"])
    if expression is None:
        return None
    try:
        result = calculator(expression)
        if float(result) != float(example["answer"]):
            return None
    except (ToolError, ValueError):
        return None
    call = {"type": "function", "function": {"name": "calculator", "arguments": {"expression": expression}}}
    return [
        {"role": "system", "content": system_prompt},
        {"role": "user", "content": example["question"]},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "name": "calculator", "content": result},
        {"role": "assistant", "content": f"Answer: {result}"},
    ]


def encode_transcript(tokenizer, messages: list[dict], tools: list) -> tuple[list[int], list[int]]:
    """``(input_ids, labels)`` of ``messages`` rendered by the tokenizer's chat template with ``tools``: labels are
    the ids inside the assistant's turns, ``IGNORE`` elsewhere. The template must be prefix-preserving (a turn
    renders the same whatever follows it), as TRL's tool loop needs too."""

    def render(msgs, prompt=False) -> str:
        return tokenizer.apply_chat_template(msgs, tools=tools, tokenize=False, add_generation_prompt=prompt)

    text = render(messages)
    spans = [
        (len(render(messages[:i], prompt=True)), len(render(messages[: i + 1])))
        for i, m in enumerate(messages)
        if m["role"] == "assistant"
    ]
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids = list(enc["input_ids"])
    labels = [
        t if any(a <= start < b for a, b in spans) else IGNORE for t, (start, _) in zip(ids, enc["offset_mapping"])
    ]
    return ids, labels


def _batch(rows: list[tuple[list[int], list[int]]], pad_id: int, device) -> tuple[torch.Tensor, ...]:
    """Right-padded ``(input_ids, attention_mask, labels)``, each (B, T) int64 on ``device``."""
    width = max(len(ids) for ids, _ in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    labels = torch.full((len(rows), width), IGNORE, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for r, (i, lab) in enumerate(rows):
        ids[r, : len(i)], labels[r, : len(lab)], mask[r, : len(i)] = torch.tensor(i), torch.tensor(lab), 1
    return ids.to(device), mask.to(device), labels.to(device)


def tool_warmup(
    model,
    tokenizer,
    examples: list[dict],
    *,
    tools: list,
    system_prompt: str,
    steps: int,
    learning_rate: float,
    batch_size: int = 4,
    seed: int = 0,
) -> dict:
    """Train ``model``'s trainable parameters (the LoRA adapter) for ``steps`` AdamW steps on worked calculator
    transcripts of ``examples`` (module docstring), ``batch_size`` transcripts a step drawn with ``seed``.
    ValueError before any step when no example gives a transcript. Returns ``{"steps", "transcripts",
    "loss_first", "loss_last", "seconds"}`` (losses: mean cross-entropy per assistant token)."""
    rows = [
        encode_transcript(tokenizer, t, tools)
        for ex in examples
        if (t := tool_transcript(ex, system_prompt)) is not None
    ]
    if not rows:
        raise ValueError(
            "tool_warmup_steps: no training question holds an arithmetic expression the calculator "
            "evaluates to its answer (the warm-up writes calculator transcripts: task "
            f"{' or '.join(ARITHMETIC_TASKS)})"
        )
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=learning_rate)
    device = next(model.parameters()).device
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    rng, losses, start = random.Random(seed), [], time.perf_counter()
    model.train()
    for _ in range(steps):
        ids, mask, labels = _batch(rng.sample(rows, min(batch_size, len(rows))), pad, device)
        logits = model(input_ids=ids, attention_mask=mask).logits
        loss = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten(), ignore_index=IGNORE)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
    return {
        "steps": steps,
        "transcripts": len(rows),
        "loss_first": round(losses[0], 4) if losses else None,
        "loss_last": round(losses[-1], 4) if losses else None,
        "seconds": round(time.perf_counter() - start, 2),
    }
