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
# # 06 · Multi-turn GRPO with a tool
#
# The model may call a tool in its rollout: TRL 1.16's tool loop parses the call, runs the tool, appends the
# result and lets the model go on; the kit's generator serves every turn and the tool-result tokens are out of
# the loss. This notebook writes a tool and an environment, checks whether the untrained start carries a learning
# signal (groups with reward spread, tool-call rate), then trains the embedded SmolLM2-135M-Instruct on
# 2-digit × 2-digit multiplication with the kit's calculator (`configs/tools.yaml` is the same run from the CLI): a
# short supervised warm-up on worked calculator transcripts, then 20 GRPO steps with the dashboard's tool-call
# panel, and a table of the same 16 held-out questions before, after the warm-up and after GRPO, answered with the
# calculator and, by the same weights, without it.
#
# Why a *short* warm-up, and temperature 0.5 (measured on these 16 held-out questions, 2-core CPU,
# `.notes/tools_learning.md`): the untrained model calls the calculator in 2 of 16 answers and gets none right, so
# GRPO alone has no group with a reward spread. 4 warm-up steps already take it to 16 of 16 through the calculator
# (30 steps, `configs/tools.yaml`'s earlier setting, did the same on 32 questions), after which greedy answers
# leave nothing to learn. 3 steps leave it calling the calculator in 10 of 16 answers (0.625, every call right);
# sampled at 0.5 it then calls it in about 40% of rollouts and 62% of groups (8 training prompts x 4) have a reward
# spread (at 0.7: 28% and 38%). With the tool the operands' size does not matter; whether the model calls it does.
#
# **What the run below shows:** with the calculator, held-out accuracy 0% -> 62% after the warm-up -> 100% after
# the 20 GRPO steps, every answer calling it at the end; without the tool the same weights stay at 0% (four-digit
# products by heart are beyond a 135M model), so what GRPO raised is the use of the tool. With one prompt a step the
# reward per step is noisy (it depends on the question): its mean over steps 1-5 is 0.55, over 16-20 0.80. After
# GRPO the model's last turn repeats the tool's result in the tool-response tags rather than writing
# `Answer: <n>`: the correctness reward reads the number and pays; a format reward would be the way to ask for more.
#
# **Runtime:** CPU (Colab: Runtime > Change runtime type > CPU), HF generation, fp32. Measured: 601 s for the whole
# notebook on a 2-core CPU, load average 1.9 (`python tests/test_notebooks.py --refresh 06_multi_turn_tools`); the
# train cell 572 s of it, 22.2 s a GRPO step. An earlier run of the same code but the last cell's tables took 547 s
# (19.8 s a step), with the same rewards and accuracies.

# %%
# Colab: install the kit and what this notebook needs (pip's output hidden; the installed versions printed at
# the end; no vLLM: this notebook generates with HF generate).
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
model = "smollm2-135m-instruct"  # a built-in (the kit gives it a tool-calling template) or a tool-capable hub model
levels = [2]  # multiplication levels: operand digits grow with the level
max_steps = 20  # GRPO steps, after the warm-up
num_generations = 4
per_device_train_batch_size = 4  # 1 prompt x 4 generations per step
max_completion_length = 96  # all turns together, tool results included (TRL's budget)
max_prompt_length = 512  # the tools' schema and the worked example are in the prompt
max_tool_calling_iterations = 2
# supervised steps on worked calculator transcripts before GRPO (0: none): 3 leave the model calling the tool
# in about 60% of answers, so GRPO's groups still differ; 30 left nothing for GRPO to learn (first cell)
tool_warmup_steps = 3
# the rollouts' sampling temperature: after the short warm-up, 0.5 samples the calculator call in about 40% of
# rollouts (0.7: about 30%), so most groups differ (first cell)
temperature = 0.5
num_train_samples = 64
num_eval_samples = 16
preflight_prompts = 1  # prompts the pre-flight samples (num_generations rollouts each)
dashboard = "auto"  # "auto" | "widgets" | "static"
output_dir = "runs/06_multi_turn_tools"
seed = 0
verbose = False  # True: vLLM's log and third-party warnings as the libraries print them (the CLI's --verbose)

# %%
from grpo_kit.notebook.helpers import notebook_setup

# checked before anything loads; the kit's quiet console from here on; the line says what runs where
run = notebook_setup(dict(model=model, task="multiplication", levels=levels, tools=["calculator"],
                          max_steps=max_steps, num_generations=num_generations,
                          per_device_train_batch_size=per_device_train_batch_size,
                          max_completion_length=max_completion_length, max_prompt_length=max_prompt_length,
                          max_tool_calling_iterations=max_tool_calling_iterations,
                          tool_warmup_steps=tool_warmup_steps, temperature=temperature,
                          num_train_samples=num_train_samples, num_eval_samples=num_eval_samples,
                          reward_funcs=["correctness"], generation_backend="hf",
                          output_dir=output_dir, seed=seed, use_lora=True),
                     verbose=verbose, extras=dict(preflight_prompts=preflight_prompts, dashboard=dashboard, verbose=verbose),
                     extra_types=dict(preflight_prompts=int, dashboard=str, verbose=bool))
cfg = run.config

# %% [markdown]
# ## 1. Writing a tool
# A tool is a plain function with type hints and a Google-style docstring: transformers builds the JSON schema the
# chat template shows the model from them. It returns text. In the rollout the kit runs every call under
# `checked_tool`: a call that raises, runs past `tool_time_limit_s` or returns anything but text is one logged
# failure (TRL's `tools/failure_frequency`), handed back to the model as `{"error": ...}`, and the rollout goes on.

# %%
import json
import logging

from transformers.utils import get_json_schema

from grpo_kit.tasks.tools import ToolError, checked_tool


def multiply(a: int, b: int) -> str:
    """Multiply two integers.

    Args:
        a: The first factor.
        b: The second factor.
    """
    return str(int(a) * int(b))


print(json.dumps(get_json_schema(multiply), indent=1))
tool = checked_tool(multiply, time_limit_s=5.0)
print("multiply(37, 48) ->", tool(a=37, b=48))
logging.getLogger("grpo_kit.tasks.tools").setLevel(logging.ERROR)  # in a rollout a failure is a logged warning
try:
    tool(a="thirty", b=2)
except ToolError as e:
    print("a failing call:", e)  # what the model reads back, as {"error": ...}
finally:
    logging.getLogger("grpo_kit.tasks.tools").setLevel(logging.NOTSET)

# %% [markdown]
# ## 2. Writing an environment
# For state across a rollout (a game, a sandbox, a database), TRL 1.16 takes `environment_factory=`: a class
# whose instance is reset before each rollout with the row's columns (`reset(**row)`, its return value, if any,
# joins the prompt), and whose public methods are the tools. The kit passes `environment: module:Factory` from
# the config (here the ready calculator is enough, so the run below uses `tools`).

# %%
import inspect

from grpo_kit.tasks.tools import calculator


class CalculatorEnv:
    """One calculator per rollout that counts its calls (a reward function could read them)."""

    def reset(self, **row):
        self.calls = 0
        return None  # nothing to add to the prompt

    def calculator(self, expression: str) -> str:
        """Evaluate an arithmetic expression and return the result.

        Args:
            expression: An arithmetic expression, e.g. "37 * 48".
        """
        self.calls += 1
        return calculator(expression)


env = CalculatorEnv()
env.reset(question="What is 37 * 48?", answer="1776")
print(env.calculator("37 * 48"), "after", env.calls, "call")
# the tools TRL takes from it: its public methods but reset
print("tools:", [n for n, _ in inspect.getmembers(CalculatorEnv, inspect.isfunction) if n[0] != "_" and n != "reset"])

# %% [markdown]
# ## 3. The template and the prompt
# SmolLM2's own template drops tool calls; the kit gives its built-in models a ChatML template with Qwen2.5's tool
# conventions and the response parser TRL reads calls back with, and checks any other model's template before it
# loads (`check_tool_template`). The system prompt carries a worked example, since a model that has never seen the
# call format would not produce it; the untrained 135M model rarely does even with it (the pre-flight below).

# %%
import torch

from grpo_kit.model.loading import load_model
from grpo_kit.tasks.chat_template import check_tool_template, use_tool_template
from grpo_kit.tasks.data import build_datasets, default_system_prompt, make_prompt

torch.manual_seed(seed)
policy, tokenizer = load_model(cfg.model, dtype=run.dtype, device=run.device, seed=seed)
use_tool_template(tokenizer)
check_tool_template(tokenizer, cfg.model)
system_prompt = default_system_prompt(cfg.task, tools=True)
train_examples, heldout = build_datasets(cfg)
print(tokenizer.apply_chat_template(make_prompt(heldout[0]["question"], system_prompt), tools=[calculator],
                                    tokenize=False, add_generation_prompt=True))

# %% [markdown]
# ## 4. Pre-flight: will the start carry a learning signal?
# GRPO learns only from groups whose rewards differ, and with a tool only if the model ever calls it. A few
# training prompts, `num_generations` sampled rollouts each through training's tool loop: the share of groups
# with reward spread and the tool-call rate.

# %%
from grpo_kit.app.evaluation import evaluate_accuracy, tool_preflight

check = tool_preflight(policy, tokenizer, train_examples[:preflight_prompts], [calculator],
                       num_generations=cfg.num_generations, system_prompt=system_prompt,
                       max_new_tokens=cfg.max_completion_length,
                       max_tool_calling_iterations=cfg.max_tool_calling_iterations,
                       temperature=cfg.temperature, seed=seed)
print(f"groups with reward spread: {check['spread_share']:.0%} of {check['groups']}; tool calls per rollout: "
      f"{check['tool_call_rate']:.2f} ({check['tool_use_share']:.0%} of rollouts called it, "
      f"{check['tool_failure_rate']:.0%} of calls failed); sampled accuracy {check['accuracy']:.0%}")


def without_tool(model) -> float:
    """Greedy held-out accuracy of ``model`` with no tool offered (the answer-only prompt): multiplication by heart."""
    return evaluate_accuracy(model, tokenizer, heldout, system_prompt=default_system_prompt(cfg.task),
                             max_new_tokens=32)["accuracy"]  # the prompt asks for the number alone


no_tool = {"before": without_tool(policy)}
print(f"held-out accuracy without the tool, before training: {no_tool['before']:.0%} (n={len(heldout)})")
del policy

# %% [markdown]
# ## 5. Warm up, train, with the dashboard
# `train` evaluates the held-out questions, runs the supervised warm-up (`tool_warmup_steps` steps on worked
# calculator transcripts of the training questions), evaluates again, then runs GRPO. The dashboard's last panel is
# TRL's tool metrics per GRPO step: calls per rollout and the failed share of calls. The held-out evaluations run
# the same tool loop, greedy; a callback asks the same weights without the tool as well.

# %%
from transformers import TrainerCallback

from grpo_kit.app.run import train
from grpo_kit.notebook.dashboard import LiveDashboard


class WithoutTool(TrainerCallback):
    """The same weights asked without the tool: when GRPO begins (after the warm-up) and after its last step."""

    def on_train_begin(self, args, state, control, model=None, **kw):
        no_tool["after_warmup"] = without_tool(model)

    def on_train_end(self, args, state, control, model=None, **kw):
        no_tool["after"] = without_tool(model)


dash = LiveDashboard(mode=dashboard)
# overwrite=True: running this cell again moves the earlier run aside (RUN.replaced-<time>), never deletes it
summary = train(cfg, progress=True, callbacks=(dash, WithoutTool()), overwrite=True, verbose=verbose)

# %% [markdown]
# ## 6. Before → after warm-up → after GRPO, on the same questions
# With the calculator: the run's greedy held-out evaluation through the tool loop (`eval.json`). Without it: the
# same weights with no tool offered and the answer-only prompt, i.e. multiplication by heart. Then the reward and
# the calls per rollout over the GRPO steps (`metrics.csv`), in blocks of steps.

# %%
from pathlib import Path

import pandas as pd
from IPython.display import display

from grpo_kit.tasks.rewards import final_answer_text

run_dir = Path(summary["run_dir"])
evals = json.loads((run_dir / "eval.json").read_text())
stages = {"before": "before", "after_warmup": f"after warm-up ({cfg.tool_warmup_steps} steps)",
          "after": f"after GRPO ({cfg.max_steps} steps)"}
table = pd.DataFrame([{"held-out": label, "with the calculator": f"{evals[w]['accuracy']:.0%}",
                       "answers calling it": f"{evals[w]['tool_use_share']:.0%}",
                       "failed calls": evals[w]["tool_failures"],
                       "without the tool": f"{no_tool[w]:.0%}" if w in no_tool else "-"}
                      for w, label in stages.items() if w in evals])
print(f"held-out accuracy, greedy, n={evals['before']['n']}:")
display(table.style.hide(axis="index"))

metrics = pd.read_csv(run_dir / "metrics.csv")
block = max(1, len(metrics) // 4)
by_block = metrics.groupby((metrics["step"] - 1) // block).agg(
    steps=("step", lambda s: f"{s.min()}-{s.max()}"), reward=("reward_mean", "mean"),
    calls_per_rollout=("tools/call_frequency", "mean"), no_spread=("frac_reward_zero_std", "mean"))
print(f"GRPO steps in blocks of {block} (means):")
display(by_block.round(3).style.hide(axis="index").format(precision=2))

for b, a in list(zip(evals["before"]["samples"], evals["after"]["samples"]))[:3]:
    print(f"\nQ: {b['question']}  (answer {b['answer']})")
    for when, s in (("before", b), ("after", a)):
        calls = sum(len(m.get("tool_calls") or []) for m in s["messages"])
        print(f"  {when}: {calls} tool call(s), final: {final_answer_text(s['messages'])!r}")
