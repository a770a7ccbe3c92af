"""Held-out accuracy: greedy (or sampled) answers to problems, checked by the verifier; with tools or an
environment, greedy multi-turn answers through the same tool loop and template as training
(:func:`evaluate_with_tools`)."""

from __future__ import annotations

import torch
from tqdm.auto import tqdm

from grpo_kit.tasks.chat_template import tool_suffix_ids
from grpo_kit.tasks.data import make_prompt, prompt_row
from grpo_kit.tasks.rewards import answer_matches, final_answer_text
from grpo_kit.tasks.tools import TOOL_OUTPUT_TOKENS, TOOL_TIME_LIMIT_S, checked_tool, environment_tools


@torch.no_grad()
def evaluate_accuracy(
    model,
    tokenizer,
    examples: list[dict],
    *,
    system_prompt: str = "",
    max_new_tokens: int = 32,
    batch_size: int = 50,
    num_samples: int = 1,
    temperature: float = 0.0,
    seed: int = 0,
    progress: str | None = None,
) -> dict:
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
            batch = examples[start : start + batch_size]
            texts = [
                tokenizer.apply_chat_template(
                    make_prompt(e["question"], system_prompt), tokenize=False, add_generation_prompt=True
                )
                for e in batch
            ]
            enc = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False).to(device)
            kwargs = dict(max_new_tokens=max_new_tokens, pad_token_id=tokenizer.pad_token_id, **_decoding(temperature))
            if temperature > 0:
                torch.manual_seed(int(torch.randint(0, 2**31 - 1, (1,), generator=gen)))
                kwargs.update(num_return_sequences=num_samples)
            out = model.generate(**enc, **kwargs)
            completions = tokenizer.batch_decode(out[:, enc["input_ids"].shape[1] :], skip_special_tokens=True)
            reps = num_samples if temperature > 0 else 1
            for i, text in enumerate(completions):
                ex = batch[i // reps]
                ok = answer_matches(text, str(ex["answer"]))
                correct.append(float(ok))
                if len(samples) < 8:
                    samples.append(
                        {"question": ex["question"], "answer": ex["answer"], "completion": text, "correct": ok}
                    )
            bar.update(len(batch))
    finally:
        bar.close()
        tokenizer.padding_side = side
        model.train(was_training)
    result = {"accuracy": sum(correct) / max(1, len(correct)), "n": len(examples), "samples": samples}
    reps = num_samples if temperature > 0 else 1
    levels = _by_level([e for e in examples for _ in range(reps)], correct)  # a score per sample, in order
    if levels:
        result["by_level"] = levels
    return result


def _decoding(temperature: float) -> dict:
    """``generate``'s decoding arguments: greedy at ``temperature`` 0, else pure sampling (no top-k, no top-p)."""
    if temperature > 0:
        return dict(do_sample=True, temperature=temperature, top_k=0, top_p=1.0)
    return dict(do_sample=False, temperature=None, top_p=None, top_k=None)


def _by_level(examples: list[dict], correct: list[float]) -> dict | None:
    """Accuracy per ``level`` (one score per example), or None when the examples carry no level."""
    levels = sorted({e.get("level") for e in examples if e.get("level") is not None})
    if not levels:
        return None
    return {
        str(lv): sum(c for e, c in zip(examples, correct) if e.get("level") == lv)
        / max(1, sum(1 for e in examples if e.get("level") == lv))
        for lv in levels
    }


def _greedy_turn(
    model, tokenizer, seqs: list[list[int]], budgets: list[int], temperature: float = 0.0
) -> list[list[int]]:
    """One greedy turn (``temperature`` > 0: sampled) for each token sequence (left-padded into one batch): at most
    ``budgets[i]`` new tokens, up to and including the first EOS, as TRL's transformers path keeps them."""
    device = next(model.parameters()).device
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    width = max(len(s) for s in seqs)
    ids = torch.tensor([[pad] * (width - len(s)) + s for s in seqs], device=device)
    mask = torch.tensor([[0] * (width - len(s)) + [1] * len(s) for s in seqs], device=device)
    out = model.generate(
        input_ids=ids, attention_mask=mask, max_new_tokens=max(budgets), pad_token_id=pad, **_decoding(temperature)
    )
    eos = model.generation_config.eos_token_id if getattr(model, "generation_config", None) is not None else None
    stops = {tokenizer.eos_token_id, *(eos if isinstance(eos, list) else [eos])} - {None}
    turns = []
    for row, budget in zip(out[:, width:].tolist(), budgets):
        row = row[:budget]
        end = next((i for i, t in enumerate(row) if t in stops), None)
        turns.append(row if end is None else row[: end + 1])
    return turns


def _call_tools(calls: list[dict], tools: dict) -> tuple[list[dict], int]:
    """The tool messages for one turn's calls and how many failed (TRL's rule: an unknown tool, a call that raises
    or a call that is not a function is a failure, its error handed back to the model as ``{"error": ...}``)."""
    messages, failures = [], 0
    for call in calls:
        function = call.get("function") or {}
        name = function.get("name", call.get("name", "unknown"))
        try:
            if call.get("type") != "function":
                raise ValueError(f"Unsupported tool call type: {call.get('type')}")
            if name not in tools:
                raise ValueError(f"Tool {name} not found.")
            result = tools[name](**function.get("arguments", {}))
        except Exception as e:  # reported to the model and counted, as in training
            failures += 1
            result = {"error": str(e)}
        messages.append({"role": "tool", "name": name, "content": result if isinstance(result, list) else str(result)})
    return messages, failures


@torch.no_grad()
def evaluate_with_tools(
    model,
    tokenizer,
    examples: list[dict],
    tools: list,
    *,
    environment=None,
    system_prompt: str = "",
    max_new_tokens: int = 32,
    max_tool_calling_iterations: int | None = None,
    tool_time_limit_s: float | None = TOOL_TIME_LIMIT_S,
    tool_output_tokens: int | None = TOOL_OUTPUT_TOKENS,
    batch_size: int = 50,
    progress: str | None = None,
    temperature: float = 0.0,
) -> dict:
    """Greedy multi-turn accuracy of ``model`` with ``tools`` on ``examples`` (``question``/``answer`` dicts).

    The rollout is training's: the prompt rendered with the tools' schema, each call parsed by TRL's
    ``parse_response``, run under :func:`~grpo_kit.tasks.tools.checked_tool` (``tool_time_limit_s``,
    ``tool_output_tokens``), its result appended as TRL's tool loop appends it; ``max_new_tokens`` bounds all turns
    together, tool results included (TRL's ``max_completion_length``). ``environment``: an environment factory
    (TRL's ``environment_factory``, one callable) or None; as in training each example gets its own instance,
    reset with the example's training row (:func:`~grpo_kit.tasks.data.prompt_row`), a text ``reset`` returns
    appended to the user message, and the instance's public methods offered beside ``tools``. The answer is the
    last assistant message (:func:`~grpo_kit.tasks.rewards.final_answer_text`). Returns ``accuracy``,
    ``tool_use_share`` (answers that called a tool), ``tool_calls``, ``tool_failures``, ``tool_failure_rate`` (per
    call, as TRL's ``tools/failure_frequency``), ``n``, ``by_level`` when examples carry a level, per example
    ``correct`` and ``calls`` (lists) and the first few ``samples`` (messages, and the completion's text with the
    tool results as the model read them). ``temperature`` > 0 samples every turn instead (the pre-flight's
    rollouts).
    """
    from trl.chat_template_utils import parse_response  # lazy: imports TRL (the parser training reads calls with)

    def check(tool):
        return checked_tool(
            tool, time_limit_s=tool_time_limit_s, tokenizer=tokenizer, max_output_tokens=tool_output_tokens
        )

    checked = [check(t) for t in tools]
    was_training = model.training
    model.eval()
    rollouts = []
    bar = tqdm(total=len(examples), desc=progress, unit="problem", disable=progress is None, leave=False)
    try:
        for start in range(0, len(examples), batch_size):
            batch = examples[start : start + batch_size]
            setups = [_rollout_setup(e, system_prompt, checked, environment, check) for e in batch]
            rollouts += _tool_rollouts(
                model, tokenizer, setups, parse_response, max_new_tokens, max_tool_calling_iterations, temperature
            )
            bar.update(len(batch))
    finally:
        bar.close()
        model.train(was_training)
    return _tool_eval_result(examples, rollouts, tokenizer)


def _rollout_setup(example: dict, system_prompt: str, tools: list, environment, check) -> tuple[list[dict], list]:
    """``(messages, tools)`` one example's rollout starts from: its prompt and the checked tools; with an
    ``environment`` factory a fresh instance reset with the example's row (TRL's rule: a text it returns is
    appended to the last message), its methods after ``tools``."""
    messages = make_prompt(example["question"], system_prompt)
    if environment is None:
        return messages, tools
    instance = environment()
    observation = instance.reset(**prompt_row(example, system_prompt))
    if observation is not None:
        if not isinstance(observation, str):
            raise ValueError(
                f"{type(instance).__name__}.reset returned a {type(observation).__name__}; the held-out "
                "evaluation takes text (str) or None"
            )
        messages = messages[:-1] + [{**messages[-1], "content": messages[-1]["content"] + observation}]
    return messages, tools + [check(m) for m in environment_tools(instance)]


def _tool_rollouts(model, tokenizer, setups, parse, budget, max_iterations, temperature=0.0):
    """Each example's rollout (TRL 1.16's ``_tool_call_loop`` with greedy turns) from its ``(messages, tools)``
    setup: its messages, completion ids, tool calls and failures."""
    tools = [t for _, t in setups]
    by_name = [{t.__name__: t for t in ts} for ts in tools]
    prompts = [
        tokenizer.apply_chat_template(m, tools=ts or None, add_generation_prompt=True, tokenize=True, return_dict=False)
        for m, ts in setups
    ]
    completion_ids = _greedy_turn(model, tokenizer, prompts, [budget] * len(prompts), temperature)
    messages = [[parse(tokenizer, ids, prefix=p, tools=ts)] for p, ids, ts in zip(prompts, completion_ids, tools)]
    calls = [0] * len(setups)
    failures = [0] * len(setups)
    max_len = getattr(getattr(model, "config", None), "max_position_embeddings", None) or float("inf")
    active = [i for i, m in enumerate(messages) if m[-1].get("tool_calls")]
    iteration = 0
    while active and iteration < (max_iterations if max_iterations is not None else float("inf")):
        seqs, kept = [], []
        for i in active:
            results, failed = _call_tools(messages[i][-1]["tool_calls"], by_name[i])
            calls[i] += len(messages[i][-1]["tool_calls"])
            failures[i] += failed
            seq = prompts[i] + completion_ids[i] + tool_suffix_ids(tokenizer, results)
            if len(seq) - len(prompts[i]) > budget or len(seq) >= max_len:
                continue  # TRL drops results past the budget: the rollout ends with its completion as it is
            messages[i] += results
            seqs.append(seq)
            kept.append(i)
        if not kept:
            break
        turns = _greedy_turn(
            model, tokenizer, seqs, [budget - (len(s) - len(prompts[i])) for s, i in zip(seqs, kept)], temperature
        )
        active = []
        for i, seq, turn in zip(kept, seqs, turns):
            completion_ids[i] = seq[len(prompts[i]) :] + turn
            if turn:
                messages[i].append(parse(tokenizer, turn, prefix=seq, tools=tools[i]))
                if messages[i][-1].get("tool_calls"):
                    active.append(i)
        iteration += 1
    return [
        {"messages": m, "completion_ids": c, "tool_calls": n, "tool_failures": f}
        for m, c, n, f in zip(messages, completion_ids, calls, failures)
    ]


def _tool_eval_result(examples: list[dict], rollouts: list[dict], tokenizer) -> dict:
    """:func:`evaluate_with_tools`'s summary of the rollouts."""
    correct = [
        float(answer_matches(final_answer_text(r["messages"]), str(e["answer"]))) for e, r in zip(examples, rollouts)
    ]
    calls = sum(r["tool_calls"] for r in rollouts)
    failures = sum(r["tool_failures"] for r in rollouts)
    n = max(1, len(rollouts))
    result = {
        "accuracy": sum(correct) / n,
        "n": len(examples),
        "tool_use_share": sum(1 for r in rollouts if r["tool_calls"]) / n,
        "tool_calls": calls,
        "tool_failures": failures,
        "tool_failure_rate": failures / calls if calls else 0.0,
        "correct": correct,
        "calls": [r["tool_calls"] for r in rollouts],
        "samples": [
            {
                "question": e["question"],
                "answer": e["answer"],
                "messages": r["messages"],
                "completion": tokenizer.decode(r["completion_ids"]),
                "correct": bool(c),
            }
            for e, r, c in list(zip(examples, rollouts, correct))[:8]
        ],
    }
    levels = _by_level(examples, correct)
    if levels:
        result["by_level"] = levels
    return result


def tool_preflight(
    model,
    tokenizer,
    examples: list[dict],
    tools: list,
    *,
    num_generations: int,
    temperature: float = 1.0,
    seed: int = 0,
    **kwargs,
) -> dict:
    """Will a run with ``tools`` start with a learning signal? ``num_generations`` sampled rollouts of each example
    (training's tool loop, :func:`evaluate_with_tools`'s other arguments in ``kwargs``): the share of groups whose
    correctness differs (GRPO learns only from those), the tool-call rate (calls per rollout), the share of
    rollouts that called a tool, the failed share of calls, and the accuracy of the samples."""
    torch.manual_seed(seed)
    repeated = [e for e in examples for _ in range(num_generations)]
    result = evaluate_with_tools(model, tokenizer, repeated, tools, temperature=temperature, **kwargs)
    groups = [result["correct"][i : i + num_generations] for i in range(0, len(repeated), num_generations)]
    return {
        "groups": len(groups),
        "spread_share": sum(len(set(g)) > 1 for g in groups) / max(1, len(groups)),
        "tool_call_rate": result["tool_calls"] / max(1, len(repeated)),
        "tool_use_share": result["tool_use_share"],
        "tool_failure_rate": result["tool_failure_rate"],
        "accuracy": result["accuracy"],
    }
