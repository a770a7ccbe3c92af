import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # tests never reach a model hub


@pytest.fixture(scope="session")
def repo_root() -> Path:
    return ROOT


@pytest.fixture
def no_model(monkeypatch):
    """Any model or tokenizer load fails the test: the bad input must be caught first."""
    from grpo_kit.app import run as run_mod

    def fail(*a, **k):
        raise AssertionError("a model was loaded: the bad input was not caught first")

    monkeypatch.setattr(run_mod, "load_tokenizer", fail)
    monkeypatch.setattr(run_mod, "load_model", fail)
