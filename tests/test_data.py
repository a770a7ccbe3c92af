import json

import pytest

from grpo_kit.tasks import data
from grpo_kit.tasks.rewards import extract_number


def test_generator_is_deterministic_and_split_disjoint():
    a_train, a_held = data.train_heldout_split("arithmetic", 300, 200, levels=(1, 2, 3, 4), seed=7)
    b_train, b_held = data.train_heldout_split("arithmetic", 300, 200, levels=(1, 2, 3, 4), seed=7)
    assert a_train == b_train and a_held == b_held
    c_train, c_held = data.train_heldout_split("arithmetic", 300, 200, levels=(1, 2, 3, 4), seed=8)
    assert c_held == a_held and c_train != a_train  # held-out set does not depend on the training seed
    assert not {e["question"] for e in a_train} & {e["question"] for e in a_held}
    assert len({e["question"] for e in a_train}) == 300


@pytest.mark.parametrize("task", ["arithmetic", "word_problems"])
@pytest.mark.parametrize("level", [1, 2, 3, 4])
def test_generated_answers_are_correct(task, level):
    for ex in data.generate_tasks(task, 30, levels=(level,), seed=1):
        assert ex["level"] == level
        if task == "arithmetic":
            expr = ex["question"].removeprefix("What is ").removesuffix("?").replace("×", "*")
            assert float(ex["answer"]) == eval(expr)  # noqa: S307 - our own generated expression
        assert extract_number(ex["answer"]) == float(ex["answer"])


def test_committed_heldout_set_is_reproduced(repo_root):
    rows = [json.loads(line) for line in (repo_root / "data" / "arithmetic_heldout.jsonl").read_text().splitlines()]
    _, held = data.train_heldout_split("arithmetic", 0, 200, levels=(1, 2))
    assert rows == held


def test_gsm8k_loader_reads_real_file(repo_root):
    rows = data.load_gsm8k_jsonl(repo_root / "data" / "gsm8k_sample.jsonl")
    assert len(rows) == 200
    assert rows[0]["answer"] == "72" and "Natalia" in rows[0]["question"]


def test_gsm8k_loader_errors(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        data.load_gsm8k_jsonl(tmp_path / "missing.jsonl")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question": "q", "answer": "#### 3"}\n{not json}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2: not valid JSON"):
        data.load_gsm8k_jsonl(bad)
    bad.write_text('{"question": "q", "answer": "three"}\n')
    with pytest.raises(ValueError, match=r":1: answer has no '#### N'"):
        data.load_gsm8k_jsonl(bad)
    bad.write_text('{"question": 5, "answer": "#### 3"}\n')
    with pytest.raises(ValueError, match="string fields"):
        data.load_gsm8k_jsonl(bad)


def test_prompts_use_chat_roles():
    ds = data.to_prompt_dataset(data.generate_tasks("arithmetic", 4, seed=0))
    assert ds.column_names == ["prompt", "answer"]
    assert [m["role"] for m in ds[0]["prompt"]] == ["system", "user"]
    assert "Answer: <number>" in ds[0]["prompt"][0]["content"]
    with pytest.raises(ValueError, match="empty"):
        data.to_prompt_dataset([])


def test_bad_levels_and_tasks():
    with pytest.raises(ValueError, match="levels"):
        data.generate_tasks("arithmetic", 3, levels=(9,))
    with pytest.raises(ValueError, match="task"):
        data.generate_tasks("chess", 3)


def test_gsm8k_heldout_comes_from_the_test_split(tmp_path, repo_root, monkeypatch):
    from grpo_kit.app.config import ConfigError, GRPOKitConfig

    sample = (repo_root / "data" / "gsm8k_sample.jsonl").read_text().splitlines()
    train_file, test_file = tmp_path / "train.jsonl", tmp_path / "test.jsonl"
    train_file.write_text("\n".join(sample[:150]) + "\n")
    test_file.write_text("\n".join(sample[140:170]) + "\n")  # 10 problems overlap the training file
    cfg = GRPOKitConfig(
        task="gsm8k",
        dataset_path=str(train_file),
        eval_dataset_path=str(test_file),
        num_train_samples=150,
        num_eval_samples=20,
    ).validate()
    train, heldout = data.build_datasets(cfg)
    test_qs = [e["question"] for e in data.load_gsm8k_jsonl(test_file)]
    assert [e["question"] for e in heldout] == test_qs[:20]  # the test file's first 20, in order
    assert not {e["question"] for e in train} & set(test_qs[:20]) and len(train) == 140
    # no files at all: the hub's train split to train on, its test split held out
    calls = []
    monkeypatch.setattr(
        data,
        "load_gsm8k",
        lambda path=None, *, split="train", limit=None: calls.append((path, split, limit))
        or data.load_gsm8k_jsonl(train_file, limit),
    )
    data.build_datasets(GRPOKitConfig(task="gsm8k", num_train_samples=30, num_eval_samples=5))
    assert calls == [(None, "test", 5), (None, "train", 30)]
    # only a training file: held-out problems drawn from it, disjoint from the training ones (as before)
    train, heldout = data.build_datasets(
        GRPOKitConfig(task="gsm8k", dataset_path=str(train_file), num_train_samples=100, num_eval_samples=20)
    )
    assert len(heldout) == 20 and not {e["question"] for e in train} & {e["question"] for e in heldout}
    with pytest.raises(ConfigError, match="eval_dataset_path=.* does not exist"):
        GRPOKitConfig(task="gsm8k", eval_dataset_path=str(tmp_path / "nope.jsonl")).validate()
    with pytest.raises(ConfigError, match="applies to task='gsm8k' only"):
        GRPOKitConfig(eval_dataset_path=str(test_file)).validate()
