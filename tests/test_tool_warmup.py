"""The supervised tool warm-up (grpo_kit.app.tool_warmup): transcripts, the assistant-only labels, the training
that lowers their loss on the adapter alone, the config's refusals and a run that warms up before GRPO."""

import json

import pytest
import torch
from peft import LoraConfig, get_peft_model

from grpo_kit.app.config import ConfigError, GRPOKitConfig
from grpo_kit.app.tool_warmup import IGNORE, encode_transcript, question_expression, tool_transcript, tool_warmup
from grpo_kit.model.loading import build_random_model, load_tokenizer
from grpo_kit.tasks.chat_template import use_tool_template
from grpo_kit.tasks.data import default_system_prompt, generate_tasks
from grpo_kit.tasks.tools import get_tools

SYSTEM = default_system_prompt("multiplication", tools=True)


@pytest.fixture(scope="module")
def tok():
    return use_tool_template(load_tokenizer("tiny-llama"))


@pytest.mark.parametrize(
    "question,want",
    [
        ("What is 41 × 26?", "41 * 26"),
        ("What is 52 - 33?", "52 - 33"),
        ("What is 7 ÷ 2?", "7 / 2"),
        ("What is 3.5 + 2?", "3.5 + 2"),
        ("Tom has 3 apples.", None),
        ("What is 2 + 3 and 4 + 5?", None),
    ],
)
def test_the_questions_expression_in_the_calculators_syntax(question, want):
    assert question_expression(question) == want


def test_a_transcript_calls_the_calculator_and_answers_with_its_result():
    msgs = tool_transcript({"question": "What is 41 × 26?", "answer": "1066"}, SYSTEM)
    assert [m["role"] for m in msgs] == ["system", "user", "assistant", "tool", "assistant"]
    assert msgs[2]["tool_calls"][0]["function"] == {"name": "calculator", "arguments": {"expression": "41 * 26"}}
    assert msgs[3]["content"] == "1066" and msgs[4]["content"] == "Answer: 1066"
    assert tool_transcript({"question": "What is 41 × 26?", "answer": "1067"}, SYSTEM) is None  # answer disagrees
    assert tool_transcript({"question": "Tom has 3 apples and eats one.", "answer": "2"}, SYSTEM) is None


def test_only_the_assistants_turns_are_labelled(tok):
    ids, labels = encode_transcript(
        tok, tool_transcript({"question": "What is 41 × 26?", "answer": "1066"}, SYSTEM), get_tools(["calculator"])
    )
    assert len(ids) == len(labels)
    taught = tok.decode([i for i, lab in zip(ids, labels) if lab != IGNORE])
    assert taught == (
        '<tool_call>\n{"name": "calculator", "arguments": {"expression": "41 * 26"}}\n</tool_call>'
        "<|im_end|>\nAnswer: 1066<|im_end|>\n"
    )
    context = tok.decode([i for i, lab in zip(ids, labels) if lab == IGNORE])
    assert "What is 41 × 26?" in context and "<tool_response>\n1066\n</tool_response>" in context


def test_the_warm_up_lowers_the_transcripts_loss_and_trains_the_adapter_only(tok):
    torch.manual_seed(0)
    # the head trained too: a random tiny model's frozen head (hidden size 64) cannot sharpen its logits
    model = get_peft_model(
        build_random_model("tiny-llama"),
        LoraConfig(r=8, target_modules=["q_proj", "v_proj"], modules_to_save=["lm_head"]),
    )
    frozen = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    examples = generate_tasks("multiplication", 16, levels=(2,), seed=0)
    info = tool_warmup(
        model,
        tok,
        examples,
        tools=get_tools(["calculator"]),
        system_prompt=SYSTEM,
        steps=6,
        learning_rate=2e-2,
        batch_size=2,
        seed=0,
    )
    assert info["steps"] == 6 and info["transcripts"] == 16
    assert info["loss_last"] < 0.5 * info["loss_first"]
    assert all(torch.equal(p, frozen[n]) for n, p in model.named_parameters() if not p.requires_grad)
    with pytest.raises(ValueError, match="no training question holds an arithmetic expression"):
        tool_warmup(
            model,
            tok,
            [{"question": "Name a colour.", "answer": "red"}],
            tools=get_tools(["calculator"]),
            system_prompt=SYSTEM,
            steps=1,
            learning_rate=1e-3,
        )


@pytest.mark.parametrize(
    "overrides,match",
    [
        (dict(tools=[]), r"tool_warmup_steps=5 writes calculator transcripts, but tools=\[\] has no 'calculator'"),
        (dict(task="word_problems"), r"needs questions holding one arithmetic expression .* task='word_problems'"),
        (dict(tool_warmup_steps=-1), r"tool_warmup_steps=-1"),
        (dict(tool_warmup_learning_rate=0), r"tool_warmup_learning_rate=0"),
    ],
)
def test_the_config_refuses_a_warm_up_it_cannot_write(overrides, match):
    cfg = dict(task="multiplication", tools=["calculator"], tool_warmup_steps=5) | overrides
    with pytest.raises(ConfigError, match=match):
        GRPOKitConfig(**cfg).validate()


def test_a_tool_run_warms_up_then_trains_and_reports_the_accuracy_after_it(tmp_path, capsys):
    from grpo_kit.app.run import train

    cfg = GRPOKitConfig(
        model="tiny-llama",
        task="multiplication",
        levels=[2],
        tools=["calculator"],
        tool_warmup_steps=2,
        max_steps=1,
        save_steps=0,
        num_train_samples=8,
        num_eval_samples=2,
        max_prompt_length=400,
        max_completion_length=8,
        max_tool_calling_iterations=1,
        num_generations=2,
        per_device_train_batch_size=2,
        generation_backend="hf",
        output_dir=str(tmp_path / "run"),
    )
    train(cfg, progress=False)
    out = capsys.readouterr().out
    assert "tool warm-up: 2 steps on 8 worked calculator transcripts, loss " in out
    assert "held-out accuracy after the tool warm-up: " in out
    evals = json.loads((tmp_path / "run" / "eval.json").read_text())
    assert evals["warmup"]["steps"] == 2 and {"before", "after_warmup", "after"} <= set(evals)
