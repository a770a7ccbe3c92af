"""Tools and environments on the kit's path (issue 38): TRL 1.16's tool loop served by a kit generator, parity
with stock TRL on a fixed batch with tool calls, the checked tools, the tool chat template, bad input."""

import copy
import time
from types import SimpleNamespace

import pytest
import torch
from _objective_settings import SETTINGS
from datasets import Dataset
from test_trainer import _args, _assert_same_lora_grads, _lora, _setting_args
from trl import GRPOTrainer

from grpo_kit.generation.base import GenerationResult
from grpo_kit.model.loading import load_model
from grpo_kit.tasks.chat_template import check_tool_template, tool_template_problems, use_tool_template
from grpo_kit.tasks.data import make_prompt
from grpo_kit.tasks.rewards import correctness_reward, final_answer_text, format_soft_reward, format_strict_reward
from grpo_kit.tasks.tools import (
    TRUNCATION_MARKER,
    ToolError,
    calculator,
    checked_tool,
    get_tools,
    python,
    resolve_environment,
)
from grpo_kit.trainer.grpo_trainer import EfficientGRPOTrainer

CALL = '<tool_call>\n{{"name": "{name}", "arguments": {args}}}\n</tool_call><|im_end|>'
# The first turn of each row in a group of four: a good call, a plain answer, an unknown tool, two calls at once.
FIRST_TURN = (
    CALL.format(name="calculator", args='{"expression": "2 + 3"}'),
    "Answer: 7<|im_end|>",
    CALL.format(name="nope", args="{}"),
    CALL.format(name="calculator", args='{"expression": "2 + 3"}')[: -len("<|im_end|>")]
    + "\n"
    + CALL.format(name="calculator", args='{"expression": "4 * 4"}'),
)


def _script(tok, prompt_ids):
    """Completions for one generate call: the first turn by row, then an answer after a tool result."""
    out = []
    for i, ids in enumerate(prompt_ids):
        after_tool = "<tool_response>" in tok.decode(ids)
        text = ("Answer: 5 thanks<|im_end|>" if i % 2 else "Answer: 5<|im_end|>") if after_tool else FIRST_TURN[i % 4]
        out.append(tok(text, add_special_tokens=False)["input_ids"])
    # sampling log-probs near the tiny random model's (ln 49152 ~ 10.8), varied per token
    lps = [[-10.8 + 0.05 * ((i + 3 * j) % 7 - 3) for j in range(len(c))] for i, c in enumerate(out)]
    return out, lps


class ScriptedGenerator:
    """A kit generator that answers from the script; counts its calls (every turn must come here)."""

    name = "scripted"

    def __init__(self, tok):
        self.tok, self.calls, self.syncs, self.needs_sync = tok, [], 0, False

    def generate(self, prompts, num_generations=1, sampling=None):
        ids, lps = _script(self.tok, prompts)
        self.calls.append(len(prompts))
        return GenerationResult(
            prompt_ids=prompts,
            completion_ids=ids,
            texts=[self.tok.decode(c) for c in ids],
            logprobs=[torch.tensor(lp, dtype=torch.float32) for lp in lps],
            finish_reasons=["stop"] * len(ids),
            num_generations=1,
        )

    def sync_weights(self, model):
        self.syncs += 1
        return {}

    def sleep(self):
        return True


def _reward(prompts, completions, answer, **kw):
    return [float(c[-1]["content"].startswith(f"Answer: {a}")) + 0.1 * len(c) for c, a in zip(completions, answer)]


@pytest.fixture(scope="module")
def tiny():
    model, tok = load_model("tiny-llama")
    return model, use_tool_template(tok)


def _batch():
    ask = [{"role": "system", "content": "Use the calculator."}, {"role": "user", "content": "What is 2 + 3?"}]
    ask2 = [{"role": "system", "content": "Use the calculator."}, {"role": "user", "content": "What is 4 * 4?"}]
    return [{"prompt": ask, "answer": "5"}] * 2 + [{"prompt": ask2, "answer": "16"}] * 2


def _dataset():
    return Dataset.from_list(_batch())


def _pair(tiny, tmp_path, setting="grpo", engine_ratio=False, tools=(calculator,)):
    """Stock TRL (its single turn scripted) and the kit's trainer (a scripted kit generator), same LoRA."""
    model, tok = tiny
    tok.padding_side = "left"
    args = [_setting_args(tmp_path, setting) for _ in range(2)]
    for a in args:
        a.num_generations, a.max_completion_length = 2, 160
        a.vllm_importance_sampling_mode = "token_truncate"
    ds = _dataset()
    gen = ScriptedGenerator(tok)
    stock = GRPOTrainer(
        model=copy.deepcopy(model),
        reward_funcs=[_reward],
        args=args[0],
        train_dataset=ds,
        processing_class=tok,
        peft_config=_lora(),
        tools=list(tools),
    )
    ours = EfficientGRPOTrainer(
        model=copy.deepcopy(model),
        reward_funcs=[_reward],
        args=args[1],
        train_dataset=ds,
        processing_class=tok,
        peft_config=_lora(),
        tools=list(tools),
        generator=gen,
        importance_sampling_correction=engine_ratio,
    )
    stock._generate_single_turn = lambda ids, *a, **k: _script(tok, ids)
    if engine_ratio:
        stock.use_vllm = True  # TRL's correction on the scripted log-probs; its own vLLM is never called
        # but its tool loop reads the context ceiling from the colocated engine: the model's, as without vLLM
        ceiling = SimpleNamespace(max_model_len=stock.model.config.max_position_embeddings)
        stock.vllm_generation = SimpleNamespace(llm=SimpleNamespace(llm_engine=SimpleNamespace(model_config=ceiling)))
    g = torch.Generator().manual_seed(3)
    for (_, p1), (_, p2) in zip(stock.model.named_parameters(), ours.model.named_parameters()):
        if p1.requires_grad:
            v = torch.randn(p1.shape, generator=g) * 0.05
            p1.data.copy_(v), p2.data.copy_(v)
    for t in (stock, ours):
        t.model.train()
        t.current_gradient_accumulation_steps = 1
    return stock, ours, gen


# top_entropy left out: the rows of a group share their prompt and open alike, so their first tokens' entropies tie
# and any quantile of them falls on a tie, which float rounding breaks either way (tests/test_trainer.py holds it)
@pytest.mark.parametrize(
    "setting,engine_ratio",
    [(s, False) for s in SETTINGS if s != "top_entropy"] + [(s, True) for s in ("grpo", "gspo", "dapo", "trl_default")],
)
def test_tool_rollout_loss_grads_and_metrics_equal_stock_trl(tiny, tmp_path, setting, engine_ratio):
    """A fixed batch with tool calls (a good call, no call, an unknown tool, two calls in one turn): the rollout
    (ids, tool mask, advantages), the loss, LoRA gradients and every metric TRL logs are stock TRL's. engine_ratio:
    the kit's engine correction (formed in the loss over model tokens only) against TRL's old-policy pass."""
    stock, ours, gen = _pair(tiny, tmp_path, setting, engine_ratio)
    torch.manual_seed(0)
    out_stock = stock._generate_and_score_completions(_batch())
    torch.manual_seed(0)
    out_ours = ours._generate_and_score_completions(_batch())
    assert gen.calls == [4, 3], gen.calls  # both turns through the kit's engine: 3 rows called a tool
    for key in ("completion_ids", "completion_mask", "tool_mask", "advantages", "num_items_in_batch"):
        torch.testing.assert_close(out_ours[key], out_stock[key], msg=key)
    tm = out_ours["tool_mask"]
    assert (tm == 0).any() and (tm[1] == 1).all()  # row 1 answered without a tool
    loss_stock = stock._compute_loss(stock.model, out_stock)
    loss_ours = ours._compute_loss(ours.model, out_ours)
    torch.testing.assert_close(loss_ours, loss_stock, rtol=1e-5, atol=1e-7)
    _assert_same_lora_grads(stock, ours, loss_stock, loss_ours)
    logged = {k for k, v in stock._metrics["train"].items() if v}
    assert {"tools/call_frequency", "tools/failure_frequency", "completions/mean_length"} <= logged
    for k in logged:
        assert ours._metrics["train"][k][-1] == pytest.approx(
            stock._metrics["train"][k][-1], rel=1e-4, abs=1e-6, nan_ok=True
        ), k
    m = ours._metrics["train"]
    assert m["tools/call_frequency"][-1] == pytest.approx(4 / 4)  # 1 + 1 + 2 calls over 4 rollouts
    assert m["tools/failure_frequency"][-1] == pytest.approx(1 / 4)  # the unknown tool
    assert m["completions/mean_length"][-1] == pytest.approx(
        (tm * out_ours["completion_mask"]).sum().item() / 4
    )  # model tokens


def test_tool_mask_changes_the_loss(tiny, tmp_path):
    """The mask really takes the tool results out (else parity with TRL would prove nothing about it)."""
    _, ours, _ = _pair(tiny, tmp_path)
    out = ours._generate_and_score_completions(_batch())
    masked = ours._compute_loss(ours.model, out)
    unmasked = ours._compute_loss(ours.model, {k: v for k, v in out.items() if k != "tool_mask"})
    assert abs(masked.item() - unmasked.item()) > 1e-4 * abs(masked.item())


def _slow(expression: str) -> str:
    """Sleep.

    Args:
        expression: anything.
    """
    time.sleep(30)
    return "late"


def _number(expression: str) -> str:
    """Return a number, not text.

    Args:
        expression: anything.
    """
    return 5


def _boom(expression: str) -> str:
    """Raise.

    Args:
        expression: anything.
    """
    raise RuntimeError("boom")


@pytest.mark.parametrize("bad", [_slow, _number, _boom])
def test_a_bad_tool_is_a_logged_failure_and_the_rollout_goes_on(tiny, tmp_path, bad, caplog):
    """A tool that hangs, returns non-text or raises: a failure in tools/failure_frequency, a warning naming it,
    the model's next turn still generated."""
    bad.__name__ = "calculator"  # the scripted model calls "calculator"
    _, ours, gen = _pair(tiny, tmp_path, tools=(bad,))
    ours.tool_time_limit_s = 0.5
    t0 = time.perf_counter()
    with caplog.at_level("WARNING"):
        out = ours._generate_and_score_completions(_batch())
    assert time.perf_counter() - t0 < 15
    assert gen.calls == [4, 3]
    assert ours._metrics["train"]["tools/failure_frequency"][-1] == pytest.approx(1.0)
    assert "tool 'calculator'" in caplog.text
    assert out["tool_mask"].shape == out["completion_ids"].shape


def test_checked_tool_keeps_the_schema_and_truncates(tiny):
    from transformers.utils import get_json_schema

    _, tok = tiny
    wrapped = checked_tool(python, tokenizer=tok, max_output_tokens=5)
    assert get_json_schema(wrapped) == get_json_schema(python)
    assert wrapped.__name__ == "python"
    long = checked_tool(lambda code: "word " * 100, tokenizer=tok, max_output_tokens=5)
    cut = long(code="x")
    assert cut.endswith(TRUNCATION_MARKER) and len(tok.encode(cut.removesuffix(TRUNCATION_MARKER))) <= 6
    with pytest.raises(ToolError, match="raised ValueError"):
        checked_tool(calculator)(expression="import os")


def test_ready_tools():
    assert calculator("37 * 48") == "1776" and calculator("7 / 2") == "3.5" and calculator("2^10") == "1024"
    for bad in ("__import__('os')", "9 ** 9 ** 9", "1 +"):
        with pytest.raises(ValueError):
            calculator(bad)
    assert python("print(6 * 7)") == "42"
    with pytest.raises(ValueError, match="memory|MemoryError"):
        python("x = bytearray(1 << 30)")
    assert get_tools(["calculator", "grpo_kit.tasks.tools:python"]) == [calculator, python]
    with pytest.raises(ValueError, match="'nope'.*no_such_mod_x"):
        get_tools(["nope", "no_such_mod_x:f"])
    with pytest.raises(ValueError, match="environment"):
        resolve_environment("no_colon")


def test_chat_template_without_tools_named_with_what_it_lacks():
    _, tok = load_model("tiny-llama")
    assert tool_template_problems(tok)  # SmolLM2's own template: plain ChatML
    with pytest.raises(ValueError, match=r"'tiny-llama'.*tool_calls.*response parser"):
        check_tool_template(tok, "tiny-llama")
    check_tool_template(use_tool_template(tok), "tiny-llama")
    from trl.chat_template_utils import is_chat_template_prefix_preserving, supports_tool_calling

    assert supports_tool_calling(tok) and is_chat_template_prefix_preserving(tok)


class _Counter:
    def reset(self, **kwargs):
        self.n = 0

    def calculator(self, expression: str) -> str:
        """Count and evaluate.

        Args:
            expression: An arithmetic expression.
        """
        self.n += 1
        return calculator(expression)


class _NoReset:
    def calculator(self, expression: str) -> str:
        """Evaluate.

        Args:
            expression: An arithmetic expression.
        """
        return calculator(expression)


def test_environment_factory_on_the_kit_generator(tiny, tmp_path):
    model, tok = tiny
    gen = ScriptedGenerator(tok)
    args = _args(tmp_path, "grpo", num_generations=2, max_completion_length=160)
    t = EfficientGRPOTrainer(
        model=copy.deepcopy(model),
        reward_funcs=[_reward],
        args=args,
        train_dataset=_dataset(),
        processing_class=tok,
        peft_config=_lora(),
        environment_factory=_Counter,
        generator=gen,
        importance_sampling_correction=False,
    )
    t.model.train()
    t._generate_and_score_completions(_batch())
    assert gen.calls == [4, 3]
    assert sum(e.n for e in t.environments) == 3  # rows 0 and 3 (two calls); row 2 asked for an unknown tool
    with pytest.raises(ValueError, match="must define a callable `reset`"):
        EfficientGRPOTrainer(
            model=copy.deepcopy(model),
            reward_funcs=[_reward],
            args=args,
            processing_class=tok,
            train_dataset=_dataset(),
            peft_config=_lora(),
            environment_factory=_NoReset,
            generator=gen,
        )


class _LongReset(_Counter):
    def reset(self, **kwargs):
        self.n = 0
        return " Here is a long briefing." * 40  # appended to the first turn's user message by TRL


def test_a_prompt_the_environments_reset_makes_too_long_stops_the_run_after_saving(tiny, tmp_path):
    """The run-start check cannot see what ``reset`` adds; the first turn can: a prompt over max_prompt_length
    stops with the length and the limit named, after the state is saved, and before the engine is asked. The same
    environment fits a larger limit, and the tool loop's later turns (the conversation so far) are not held to it."""
    model, tok = tiny
    args = _args(tmp_path, "grpo", num_generations=2, max_completion_length=160)

    def trainer(env, limit):
        gen = ScriptedGenerator(tok)
        t = EfficientGRPOTrainer(
            model=copy.deepcopy(model),
            reward_funcs=[_reward],
            args=args,
            train_dataset=_dataset(),
            processing_class=tok,
            peft_config=_lora(),
            environment_factory=env,
            generator=gen,
            importance_sampling_correction=False,
            max_prompt_length=limit,
        )
        t.model.train()
        return t, gen

    t, gen = trainer(_Counter, None)  # the first turn's prompts without the briefing: their length
    seen = []
    gen.generate = lambda prompts, *a, generate=gen.generate, **k: seen.append(prompts) or generate(prompts, *a, **k)
    t._generate_and_score_completions(_batch())
    short = max(len(ids) for ids in seen[0])
    t, gen = trainer(_LongReset, short + 20)
    with pytest.raises(
        ValueError,
        match=r"tokens with what the environment's reset\(\) added, over "
        rf"max_prompt_length={short + 20} .* Training state saved to",
    ):
        t._generate_and_score_completions(_batch())
    assert gen.calls == [] and (tmp_path / "out" / "crash-step-0").is_dir()
    t, gen = trainer(_LongReset, short + 400)  # the briefing fits; the second turn (tool results) runs longer
    t._generate_and_score_completions(_batch())
    assert gen.calls == [4, 3]


def test_rollout_func_generates_through_the_kit_engine(tiny, tmp_path):
    model, tok = tiny
    gen = ScriptedGenerator(tok)

    def rollout(prompts, trainer):
        ids = [
            tok.apply_chat_template(p, add_generation_prompt=True, tokenize=True, return_dict=False) for p in prompts
        ]
        completion_ids, logprobs = trainer.kit_generate(ids)
        return {"prompt_ids": ids, "completion_ids": completion_ids, "logprobs": logprobs}

    args = _args(tmp_path, "grpo", num_generations=2, max_completion_length=160)
    t = EfficientGRPOTrainer(
        model=copy.deepcopy(model),
        reward_funcs=[lambda prompts, completions, **k: [0.0, 1.0] * 2],
        args=args,
        train_dataset=_dataset(),
        processing_class=tok,
        peft_config=_lora(),
        rollout_func=rollout,
        generator=gen,
    )
    assert t.use_vllm  # the engine's correction is on: TRL would sync a vLLM it does not have
    t.model.train()
    out = t._generate_and_score_completions(_batch())
    assert gen.calls == [4] and gen.syncs == 1
    assert out["completion_ids"].shape[0] == 4


def _rollout(final: str, tool_result: str = "408") -> list[dict]:
    """A multi-turn completion as TRL's tool loop hands it to the rewards: call, result, then the final turn."""
    call = {"type": "function", "function": {"name": "calculator", "arguments": {"expression": "12 * 34"}}}
    return [
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "name": "calculator", "content": tool_result},
        {"role": "assistant", "content": final},
    ]


def test_answer_rewards_judge_the_final_assistant_message_only():
    """A bare tool result is not the model's answer: with the final turn silent or wrong, nothing is credited."""
    completions = [
        _rollout("Answer: 408"),
        _rollout("I do not know."),
        _rollout(""),
        _rollout("Answer: 407"),
        _rollout("Answer: 408", tool_result="Answer: 1"),
    ]
    answers = ["408"] * len(completions)
    assert correctness_reward(None, completions, answers) == [1.0, 0.0, 0.0, 0.0, 1.0]
    assert format_soft_reward(None, completions) == [1.0, 0.0, 0.0, 1.0, 1.0]
    assert format_strict_reward(None, completions) == [1.0, 0.0, 0.0, 1.0, 1.0]
    # a rollout whose last turn was cut away ends on the tool result: only the model's own text counts
    assert correctness_reward(None, [_rollout("")[:2]], ["408"]) == [0.0]
    assert final_answer_text(_rollout("Answer: 408")) == "Answer: 408"
    assert final_answer_text("Answer: 3") == "Answer: 3"


class ScriptedModel(torch.nn.Module):
    """A model whose greedy ``generate`` answers from the script (left-padded batch in, padded continuations out)."""

    def __init__(self, tok):
        super().__init__()
        self.tok, self.weight, self.calls = tok, torch.nn.Parameter(torch.zeros(1)), []
        self.generation_config, self.prompts = None, []  # prompts: the first call's, as the model read them

    def generate(self, input_ids, attention_mask, max_new_tokens, pad_token_id, **kw):
        self.sampled = kw["do_sample"]
        rows = [ids[mask.bool()].tolist() for ids, mask in zip(input_ids, attention_mask)]
        self.calls.append(len(rows))
        self.prompts = self.prompts or [self.tok.decode(r) for r in rows]
        new, _ = _script(self.tok, rows)
        width = max(map(len, new))
        return torch.cat([input_ids, torch.tensor([c + [pad_token_id] * (width - len(c)) for c in new])], dim=1)


def test_tool_evaluation_is_the_training_rollout(tiny, tmp_path):
    """The held-out evaluation with tools walks TRL's tool loop: the same completion ids (tool results included)
    as stock TRL's rollout of the same turns, the same call and failure counts; accuracy on the final message."""
    from grpo_kit.app.evaluation import evaluate_with_tools

    stock, _, _ = _pair(tiny, tmp_path)
    out = stock._generate_and_score_completions(_batch())
    _, tok = tiny
    examples = [{"question": r["prompt"][1]["content"], "answer": r["answer"]} for r in _batch()]
    fake = ScriptedModel(tok)
    result = evaluate_with_tools(
        fake, tok, examples, [calculator], system_prompt="Use the calculator.", max_new_tokens=160
    )
    assert fake.calls == [4, 3] and fake.sampled is False  # greedy
    for i, sample in enumerate(result["samples"]):
        ids = out["completion_ids"][i][out["completion_mask"][i].bool()].tolist()
        assert sample["completion"] == tok.decode(ids), i
    m = stock._metrics["train"]
    assert result["tool_use_share"] == 3 / 4 and result["tool_calls"] == 4 and result["tool_failures"] == 1
    assert result["tool_calls"] / 4 == pytest.approx(m["tools/call_frequency"][-1])
    assert result["tool_failure_rate"] == pytest.approx(m["tools/failure_frequency"][-1])
    # row 0 answers 5 after its call; row 1 answers 7 without one; rows 2-3 (4 * 4) answer 5
    assert result["accuracy"] == 1 / 4 and [s["correct"] for s in result["samples"]] == [True, False, False, False]
    # a budget too small for the tool result: the rollout ends on its call, nothing is appended
    call = len(tok(FIRST_TURN[0], add_special_tokens=False)["input_ids"])
    short = evaluate_with_tools(
        ScriptedModel(tok),
        tok,
        examples[:1],
        [calculator],
        system_prompt="Use the calculator.",
        max_new_tokens=call + 2,
    )
    assert short["tool_calls"] == 1 and [m["role"] for m in short["samples"][0]["messages"]] == ["assistant"]
    assert short["accuracy"] == 0.0


class _Seen:
    """An environment that records each reset's row and each call, and hands the model a note to read."""

    log: list = []

    def reset(self, **row):
        self.row = row
        _Seen.log.append(("reset", row["answer"]))
        return " (an environment note)"

    def calculator(self, expression: str) -> str:
        """Count and evaluate.

        Args:
            expression: An arithmetic expression.
        """
        _Seen.log.append(("call", self.row["answer"], expression))
        return calculator(expression)


def test_tool_evaluation_runs_an_environment_as_training_does(tiny):
    """With an environment factory and no tools, the held-out rollouts are training's: one instance per example,
    reset with the example's row, its text appended to the user message, its methods the tools (each call served
    by that example's own instance); the counts and the accuracy as with the same function as a plain tool."""
    from grpo_kit.app.evaluation import evaluate_with_tools

    _, tok = tiny
    examples = [{"question": r["prompt"][1]["content"], "answer": r["answer"]} for r in _batch()]
    fake = ScriptedModel(tok)
    _Seen.log = []
    result = evaluate_with_tools(
        fake, tok, examples, [], environment=_Seen, system_prompt="Use the calculator.", max_new_tokens=160
    )
    assert [e for e in _Seen.log if e[0] == "reset"] == [
        ("reset", "5"),
        ("reset", "5"),
        ("reset", "16"),
        ("reset", "16"),
    ]
    # rows 0 and 3 call the calculator (row 3 twice); row 2 names a tool the environment lacks
    assert [e[1:] for e in _Seen.log if e[0] == "call"] == [("5", "2 + 3"), ("16", "2 + 3"), ("16", "4 * 4")]
    assert result["tool_calls"] == 4 and result["tool_failures"] == 1 and result["accuracy"] == 1 / 4
    first = tok.decode(
        tok.apply_chat_template(
            [
                {"role": "system", "content": "Use the calculator."},
                {"role": "user", "content": examples[0]["question"] + " (an environment note)"},
            ],
            tools=[_Seen().calculator],
            add_generation_prompt=True,
            tokenize=True,
            return_dict=False,
        )
    )
    assert fake.prompts[0] == first


def test_prompt_length_check_counts_the_tool_schema(tiny):
    """With tools (or an environment's methods) the rendered prompt carries their JSON schema: the check counts it,
    as TRL renders the prompt."""
    from grpo_kit.app.config import GRPOKitConfig
    from grpo_kit.app.run import check_prompt_lengths
    from grpo_kit.tasks.prompts import prompt_ids

    _, tok = tiny
    examples = [{"question": "What is 123 * 456?", "answer": "56088"}]
    plain = len(prompt_ids(tok, examples[0]["question"], "Use the calculator."))
    rendered = tok.apply_chat_template(
        make_prompt(examples[0]["question"], "Use the calculator."),
        tools=[calculator],
        add_generation_prompt=True,
        tokenize=True,
        return_dict=False,
    )
    assert len(rendered) > plain + 50
    cfg = GRPOKitConfig(model="tiny-llama", task="multiplication", tools=["calculator"], max_prompt_length=plain + 10)
    with pytest.raises(ValueError, match=f"a prompt is {len(rendered)} tokens, over max_prompt_length={plain + 10}"):
        check_prompt_lengths(tok, examples, cfg, "Use the calculator.")
    cfg.max_prompt_length = len(rendered)
    assert check_prompt_lengths(tok, examples, cfg, "Use the calculator.") == len(rendered)
    cfg.tools = []
    assert check_prompt_lengths(tok, examples, cfg, "Use the calculator.") == plain
    cfg.environment, cfg.max_prompt_length = _Seen, 10**4  # an environment's methods are tools in the prompt too
    with_env = tok.apply_chat_template(
        make_prompt(examples[0]["question"], "Use the calculator."),
        tools=[_Seen().calculator],
        add_generation_prompt=True,
        tokenize=True,
        return_dict=False,
    )
    assert check_prompt_lengths(tok, examples, cfg, "Use the calculator.") == len(with_env) > plain + 50


@pytest.mark.parametrize("method,vllm", [("grpo_kit", True), ("grpo_kit", False), ("trl", True)])
def test_calculator_prices_the_tool_turns_in_every_phase(method, vllm):
    """A multi-turn step: tool results join the rollout, so the KV cache (prompt plus all turns) and every forward,
    the loss's included, are priced over the model's tokens plus the tool tokens."""
    from grpo_kit.memory import EstimateSpec, estimate, total_gpu_bytes

    common = dict(num_generations=8, prompt_length=700, lora_rank=16, method=method, vllm=vllm, micro_batch_size=4)
    tools = estimate(
        "llama-3.1-8b", EstimateSpec(completion_length=1000, tool_turns=2, tool_result_tokens=300, **common)
    )
    longer = estimate("llama-3.1-8b", EstimateSpec(completion_length=1600, **common))
    plain = estimate("llama-3.1-8b", EstimateSpec(completion_length=1000, **common))
    assert list(tools["GB"]) == list(longer["GB"])
    assert total_gpu_bytes(tools) > total_gpu_bytes(plain)
    kv = tools.loc[tools["component"] == "KV cache (generation)"]
    assert kv["GB"].iloc[0] > plain.loc[plain["component"] == "KV cache (generation)", "GB"].iloc[0]
    assert tools.attrs["completion_length"] == 1000 and tools.attrs["tool_tokens"] == 600
    assert tools.attrs["sequence_length"] == 700 + 1000 + 600
    if vllm:
        assert "600 tokens of tool results" in kv["note"].iloc[0]
    for bad in (dict(tool_turns=-1), dict(tool_result_tokens=2.5)):
        with pytest.raises(ValueError, match=next(iter(bad))):
            estimate("llama-3.1-8b", EstimateSpec(completion_length=1000, **common, **bad))


def test_config_estimate_with_tools_is_priced_at_trls_bound():
    """The config's max_completion_length bounds model and tool tokens together in TRL's loop: same estimate."""
    from grpo_kit.app.config import GRPOKitConfig
    from grpo_kit.memory import config_estimate_spec

    plain = GRPOKitConfig(model="tiny-llama", task="multiplication")
    tools = GRPOKitConfig(model="tiny-llama", task="multiplication", tools=["calculator"])
    assert config_estimate_spec(tools) == config_estimate_spec(plain)
    assert config_estimate_spec(tools).tool_turns == 0


def test_dashboard_tool_panel():
    """TRL's tool metrics get their own panel (calls per rollout, failed share of calls); none without tools."""
    import matplotlib

    from grpo_kit.notebook.dashboard import PANELS, TOOL_PANEL, LiveDashboard

    log = {"reward": 0.5, "reward_std": 0.1, "loss": 0.0, "kl": 0.0, "completions/mean_length": 20.0}
    plain = LiveDashboard(mode="static", display=False)
    plain.record(1, log)
    assert plain.panels() == PANELS
    dash = LiveDashboard(mode="static", display=False)
    for step, (calls, failed) in enumerate([(0.25, 0.0), (1.0, 0.5)], start=1):
        dash.record(step, dict(log, **{"tools/call_frequency": calls, "tools/failure_frequency": failed}))
    assert dash.panels() == PANELS + (TOOL_PANEL,)
    fig = dash.figure()
    assert len(fig.axes) == len(PANELS) + 1
    tools = fig.axes[-1]
    assert tools.get_title() == "tool calls"
    assert [list(line.get_ydata()) for line in tools.lines] == [[0.25, 1.0], [0.0, 0.5]]
    matplotlib.pyplot.close(fig)


def test_tool_preflight_counts_spread_and_calls(tiny):
    """The pre-flight samples num_generations rollouts per prompt through the tool loop: groups with reward spread,
    calls per rollout."""
    from grpo_kit.app.evaluation import tool_preflight

    _, tok = tiny
    fake = ScriptedModel(tok)
    out = tool_preflight(
        fake,
        tok,
        [{"question": "What is 2 + 3?", "answer": "5"}],
        [calculator],
        num_generations=4,
        system_prompt="Use the calculator.",
        max_new_tokens=160,
    )
    assert fake.sampled is True and fake.calls == [4, 3]
    # rows: a call then 5, a plain 7, an unknown tool then 5, two calls then 5
    assert out == {
        "groups": 1,
        "spread_share": 1.0,
        "tool_call_rate": 1.0,
        "tool_use_share": 0.75,
        "tool_failure_rate": 0.25,
        "accuracy": 0.75,
    }
