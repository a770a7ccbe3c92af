# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#       format_version: '1.3'
#       jupytext_version: 1.19.6
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # 05 · Rewards and verifiers
#
# A GRPO reward is a plain function `fn(prompts, completions, **columns) -> list[float]` (TRL's signature):
# `completions` are strings or chat messages, `columns` are the dataset's other columns (here `answer`).
# This notebook tests the kit's verifier on tricky strings and on real GSM8K solutions, writes a new
# reward, shows what the kit does with a broken one, and how weights change the advantages.
#
# **Runtime:** CPU (Colab: Runtime > Change runtime type > CPU). Measured: 4 s for the whole notebook
# with the CI parameters on a 2-core CPU (`python tests/test_notebooks.py --refresh`, shared machine).

# %%
# Colab: install the kit and what this notebook needs (pip's output hidden; the installed versions printed at
# the end; no vLLM: this notebook generates nothing).
# Elsewhere it only checks that the kit is installed (`bash install.sh` in the checkout installs it).
import importlib.util, os, subprocess, sys

GRPO_KIT_REPO = ""  # @param {type:"string"} the kit's git URL; empty: the GRPO_KIT_REPO environment variable
if "google.colab" in sys.modules:  # Colab imports it into every kernel
    repo = GRPO_KIT_REPO or os.environ.get("GRPO_KIT_REPO", "")
    if not repo:
        raise ValueError("GRPO_KIT_REPO is not set: type the kit's git URL (https://github.com/<owner>/grpo_kit.git) "
                         "into the form field of this cell, or set the GRPO_KIT_REPO environment variable")
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", f"grpo_kit @ git+{repo}"], check=True)
    from grpo_kit.notebook.colab import install_runtime

    install_runtime(generate=False)
elif importlib.util.find_spec("grpo_kit") is None:
    raise ModuleNotFoundError("grpo_kit is not installed in this kernel's Python: run `bash install.sh` in the "
                              "checkout (it installs the kit), or `pip install -e .` there")

# %% tags=["parameters"]
gsm8k_path = ""  # GSM8K-format jsonl; empty: the checkout's data/gsm8k_sample.jsonl
num_problems = 50  # GSM8K problems to check the verifier on
reward_weights = [1.0, 0.2]  # correctness, format
num_generations = 4

# %%
from grpo_kit.notebook.helpers import repo_file, validate_params

validate_params(dict(num_generations=num_generations, per_device_train_batch_size=num_generations,
                     reward_funcs=["correctness", "format_soft"], reward_weights=reward_weights),
                dict(gsm8k_path=gsm8k_path, num_problems=num_problems),
                dict(gsm8k_path=str, num_problems=int))
if num_problems < 1:
    raise ValueError(f"num_problems={num_problems} must be >= 1")
path = gsm8k_path or repo_file("data/gsm8k_sample.jsonl")
print("GSM8K file:", "the checkout's data/gsm8k_sample.jsonl" if not gsm8k_path else path)

# %% [markdown]
# ## 1. Extracting the answer
# `extract_number` takes the number a completion commits to: after `####`, `Answer:` or `\boxed{}` when present,
# else the last number; it survives `$1,234.50`, trailing dots, fractions and units.

# %% tags=["nbval-check-output"]
from grpo_kit.tasks.rewards import extract_number

for text in ["#### 1,234", "Answer: $1,234.50", "so she pays 18 dollars.", "The answer is -7 apples",
             "x = 3/4", "Answer: 12. Then 5 more", "\\boxed{42}", "no number here"]:
    print(f"{text!r:32} -> {extract_number(text)}")

# %% [markdown]
# ## 2. The verifier on real GSM8K answers
# Every reference solution must score 1.0 against its own final answer; against another problem's answer it
# must (almost) never score.

# %% tags=["nbval-check-output"]
from grpo_kit.tasks.data import load_gsm8k, load_gsm8k_jsonl
from grpo_kit.tasks.rewards import correctness_reward

rows = load_gsm8k_jsonl(path, limit=num_problems) if path else load_gsm8k(limit=num_problems)
solutions = [r["solution"] if "solution" in r else r["answer"] for r in rows]
answers = [r["answer"] for r in rows]
own = correctness_reward(None, solutions, answer=answers)
shifted = correctness_reward(None, solutions, answer=answers[1:] + answers[:1])
print(f"{len(rows)} problems: own answer {sum(own):.0f}/{len(own)} correct, another's answer {sum(shifted):.0f} correct")

# %% [markdown]
# ## 3. Writing a reward function
# A reward for brevity: 1.0 up to 20 words, falling linearly to 0 at 60. Test it like any function.

# %%
from grpo_kit.tasks.rewards import completion_text


def brevity_reward(prompts, completions, **columns):
    words = [len(completion_text(c).split()) for c in completions]
    return [min(1.0, max(0.0, (60 - n) / 40)) for n in words]


# %% tags=["nbval-check-output"]
print(brevity_reward(None, ["Answer: 4", " ".join(["word"] * 40), [{"role": "assistant", "content": "x " * 80}]]))

# %% [markdown]
# ## 4. A broken reward fails loudly
# The trainer wraps every reward function (`checked_reward_func`): a wrong length, NaN, a non-number or an
# exception stops training with one message naming the function and the sample.

# %% tags=["nbval-check-output"]
from grpo_kit.tasks.rewards import checked_reward_func


def bad_reward(prompts, completions, **columns):
    return [float("nan")] + [1.0] * (len(completions) - 1)


try:
    checked_reward_func(bad_reward)([None] * 3, ["a", "b", "c"])
except ValueError as e:
    print(type(e).__name__, "-", e)

# %% [markdown]
# ## 5. Weighting rewards
# TRL sums the weighted rewards per completion *before* the group advantages, so a weight changes how much a
# criterion moves the policy relative to the others.

# %% tags=["nbval-check-output"]
import torch

from grpo_kit.loss.advantage import group_advantages
from grpo_kit.tasks.rewards import format_soft_reward

group = ["Answer: 7", "7", "I think it is 8. Answer: 8", "Answer: 7 because 3 + 4"][:num_generations]
cols = dict(answer=["7"] * len(group))
r_correct = torch.tensor(correctness_reward(None, group, **cols))
r_format = torch.tensor(format_soft_reward(None, group))
for w in ([1.0, 0.0], reward_weights, [1.0, 1.0]):
    total = w[0] * r_correct + w[1] * r_format
    print(f"weights {w}: reward {[round(x, 2) for x in total.tolist()]} -> advantage "
          f"{[round(x, 2) for x in group_advantages(total, len(group)).tolist()]}")
