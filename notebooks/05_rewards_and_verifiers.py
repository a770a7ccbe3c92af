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
# **Runtime:** CPU (Colab: Runtime > Change runtime type > CPU). Measured: the outputs below are a run with the
# parameters as they stand (50 GSM8K problems; 4 questions × 4 sampled completions of at most 96 tokens from the
# embedded model): 45 s for the whole notebook on a 2-core CPU (`python tests/test_notebooks.py --refresh`).

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
sample_model = "smollm2-135m-instruct"  # the embedded model whose completions are scored in section 6
num_sample_questions = 4  # GSM8K questions the model answers (num_generations samples each)
sample_max_tokens = 96  # longest sampled completion (tokens)

# %%
from grpo_kit.notebook.helpers import repo_file, validate_params

validate_params(dict(num_generations=num_generations, per_device_train_batch_size=num_generations,
                     reward_funcs=["correctness", "format_soft"], reward_weights=reward_weights),
                dict(gsm8k_path=gsm8k_path, num_problems=num_problems, sample_model=sample_model,
                     num_sample_questions=num_sample_questions, sample_max_tokens=sample_max_tokens),
                dict(gsm8k_path=str, num_problems=int, sample_model=str, num_sample_questions=int,
                     sample_max_tokens=int))
validate_params(dict(model=sample_model))
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

# %% [markdown]
# ## 6. Reward distributions: real GSM8K answers against the model's samples
# The same two rewards on the reference solutions of section 2 (a human's worked answer, ending `#### N`) and on
# completions sampled from the embedded model (`sample_model`, temperature 1, the kit's GSM8K system prompt,
# `num_generations` per question, on this machine's CPU). The references score 1 on correctness and get partial
# format credit (they end with `#### N`, not `Answer: N`); the untrained small model rarely gets the number right:
# the sparse reward GRPO has to start from.

# %%
import matplotlib.pyplot as plt

from grpo_kit.model.loading import load_model
from grpo_kit.tasks.data import make_prompt

torch.manual_seed(0)
lm, tok = load_model(sample_model, dtype=torch.float32)
lm.eval()
questions, refs = [r["question"] for r in rows[:num_sample_questions]], answers[:num_sample_questions]
samples, sample_answers = [], []
for q, a in zip(questions, refs):
    ids = tok.apply_chat_template(make_prompt(q), add_generation_prompt=True, return_tensors="pt", return_dict=True)
    with torch.no_grad():
        out = lm.generate(**ids, do_sample=True, temperature=1.0, max_new_tokens=sample_max_tokens,
                          num_return_sequences=num_generations, pad_token_id=tok.eos_token_id)
    samples += tok.batch_decode(out[:, ids["input_ids"].shape[1]:], skip_special_tokens=True)
    sample_answers += [a] * num_generations
dist = {"GSM8K reference solutions": (solutions, answers),
        f"{sample_model} samples": (samples, sample_answers)}
fig, axes = plt.subplots(1, 2, figsize=(11, 3.6))
for ax, (title, fn) in zip(axes, (("correctness reward", correctness_reward),
                                  ("format_soft reward", format_soft_reward))):
    for i, (label, (texts, ans)) in enumerate(dist.items()):
        vals = fn(None, texts, answer=ans)
        ax.hist(vals, bins=[x / 10 for x in range(-1, 12)], alpha=0.6, color=f"C{i}", align="left", rwidth=0.8,
                weights=[1 / len(vals)] * len(vals), label=f"{label} (n={len(vals)}, mean {sum(vals) / len(vals):.2f})")
    ax.set_title(f"Distribution of the {title}", fontsize=9)
    ax.set_xlabel("reward (unitless)")
    ax.set_ylabel("share of completions")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
fig.tight_layout()
plt.show()
print("a sampled completion:", repr(samples[0][:200]))
