"""The long-document task (grpo_kit/tasks/long_document.py): deterministic documents of about 4K to 128K tokens, the
fact asked for placed once among distractor facts, the kit's verifier paying its code and no distractor's, and
configs/long_document.yaml a valid run whose prompts fit its budget."""

import random
import re
from pathlib import Path

import pytest

from grpo_kit.app.config import GRPOKitConfig
from grpo_kit.model.loading import load_tokenizer
from grpo_kit.tasks.data import default_system_prompt, generate_tasks, train_heldout_split
from grpo_kit.tasks.long_document import LONG_DOCUMENT_SYSTEM_PROMPT, LONG_DOCUMENT_TOKENS, long_document_problem
from grpo_kit.tasks.prompts import check_prompt_lengths, prompt_ids
from grpo_kit.tasks.rewards import correctness_reward

CONFIG = Path(__file__).resolve().parents[1] / "configs" / "long_document.yaml"
CODE = re.compile(r"The access code of the (\w[\w ]*?) in ([\w ]+?) is (\d{5})\.")


def test_a_seed_gives_the_same_documents_and_another_seed_others():
    a = generate_tasks("long_document", 3, levels=(1,), seed=7)
    assert a == generate_tasks("long_document", 3, levels=(1,), seed=7)
    assert [e["question"] for e in a] != [
        e["question"] for e in generate_tasks("long_document", 3, levels=(1,), seed=8)
    ]
    train, heldout = train_heldout_split("long_document", 4, 2, levels=(1,), seed=0)
    assert not {e["question"] for e in train} & {e["question"] for e in heldout}
    assert default_system_prompt("long_document") == LONG_DOCUMENT_SYSTEM_PROMPT


@pytest.mark.parametrize("level", sorted(LONG_DOCUMENT_TOKENS))
def test_the_fact_is_there_once_among_distractors_at_the_levels_size(level):
    tok = load_tokenizer("smollm2-135m-instruct")
    ex = long_document_problem(random.Random(level), level)
    target = re.search(r"archive in ([\w ]+)\?$", ex["question"]).group(1)
    facts = CODE.findall(ex["question"])
    asked = [code for building, town, code in facts if building == "archive" and town == target]
    assert asked == [ex["answer"]]  # the fact, once
    others = {code for building, town, code in facts if (building, town) != ("archive", target)}
    assert len(others) >= 4 + LONG_DOCUMENT_TOKENS[level] // 2048 and ex["answer"] not in others
    assert any(town == target for building, town, _ in facts if building != "archive")  # same town, other building
    n = len(tok(ex["question"])["input_ids"])
    assert 0.9 * LONG_DOCUMENT_TOKENS[level] <= n <= LONG_DOCUMENT_TOKENS[level]
    assert 0 <= ex["depth"] <= 1


def test_the_verifier_pays_the_code_and_not_a_distractor():
    ex = long_document_problem(random.Random(3), 1)
    distractor = next(code for _, _, code in CODE.findall(ex["question"]) if code != ex["answer"])
    completions = [
        f"The archive's code is given in the document.\nAnswer: {ex['answer']}",
        f"Answer: {distractor}",
        f"I found {distractor} first, but the archive's is {ex['answer']}.\nAnswer: {ex['answer']}",
        "Answer: unknown",
    ]
    rewards = correctness_reward([ex["question"]] * 4, completions, [ex["answer"]] * 4)
    assert rewards == [1.0, 0.0, 1.0, 0.0]


def test_the_config_is_a_valid_run_whose_prompts_fit():
    cfg = GRPOKitConfig.from_yaml(CONFIG).validate()
    assert cfg.task == "long_document" and cfg.prefix_sharing is True
    tok = load_tokenizer(cfg.model)
    examples = generate_tasks(cfg.task, 4, levels=tuple(cfg.levels), seed=cfg.seed)
    system = default_system_prompt(cfg.task)
    check_prompt_lengths(tok, examples, system, max_prompt_length=cfg.max_prompt_length)
    assert max(len(prompt_ids(tok, e["question"], system)) for e in examples) > 0.85 * cfg.max_prompt_length


def test_each_task_takes_its_own_levels():
    """The long-document task's level 0 (a 1K-token document) passes the config and the generator; the other tasks
    keep 1-4, and a level a task lacks is refused naming the task's own."""
    from grpo_kit.app.config import ConfigError
    from grpo_kit.tasks.data import task_levels

    assert task_levels("long_document") == tuple(sorted(LONG_DOCUMENT_TOKENS)) and task_levels("arithmetic") == (
        1,
        2,
        3,
        4,
    )
    cfg = GRPOKitConfig(task="long_document", levels=[0], max_prompt_length=1280).validate()
    assert [e["level"] for e in generate_tasks("long_document", 2, levels=tuple(cfg.levels))] == [0, 0]
    with pytest.raises(ConfigError, match=r"levels=\[0\]: each must be one of \[1, 2, 3, 4\] for task='arithmetic'"):
        GRPOKitConfig(task="arithmetic", levels=[0]).validate()
    with pytest.raises(ValueError, match=r"each must be one of \[1, 2, 3, 4\]"):
        generate_tasks("arithmetic", 1, levels=(0,))
