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
# the loss. This notebook writes a tool and an environment, checks before training that the start carries a
# learning signal (groups with reward spread, tool-call rate), trains the embedded SmolLM2-135M-Instruct on
# multi-digit multiplication with the kit's calculator (`configs/tools.yaml` is the same run from the CLI),
# with the dashboard's tool-call panel, and shows the same held-out questions before and after.
#
# **Runtime:** CPU (Colab: Runtime > Change runtime type > CPU), HF generation. Measured: the outputs below are a run with
# the parameters as they stand (3 steps × 4 rollouts, 4 held-out questions): 115 s for the whole notebook on a
# 2-core CPU (`python tests/test_notebooks.py --refresh 06_multi_turn_tools`). What they show: the untrained 135M
# model does not call the tool (no call in the pre-flight, in training or on the held-out questions, before or
# after), so no group has a reward spread and GRPO has nothing to learn from; the pre-flight says so before the
# run. A model that calls tools, or a supervised warm-up first, is what this task needs: with
# `tool_warmup_steps = 30` (worked calculator transcripts of the training questions) the same model answered all
# 32 held-out questions of `configs/tools.yaml`'s run through the calculator (0.000 -> 1.000) before GRPO began,
# which then found no reward spread left to learn from (`bench learning`, 2-core CPU).

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
max_steps = 3
num_generations = 4
per_device_train_batch_size = 4  # 1 prompt x 4 generations per step
max_completion_length = 96  # all turns together, tool results included (TRL's budget)
max_prompt_length = 512  # the tools' schema and the worked example are in the prompt
max_tool_calling_iterations = 2
# supervised steps on worked calculator transcripts before GRPO (0: none; configs/tools.yaml takes 30)
tool_warmup_steps = 0
num_train_samples = 64
num_eval_samples = 4
preflight_prompts = 1  # prompts the pre-flight samples (num_generations rollouts each)
dashboard = "auto"  # "auto" | "widgets" | "static"
output_dir = "runs/06_multi_turn_tools"
seed = 0
verbose = False  # True: vLLM's log and third-party warnings as the libraries print them (the CLI's --verbose)

# %%
from grpo_kit.notebook.helpers import validate_params

cfg = validate_params(dict(model=model, task="multiplication", levels=levels, tools=["calculator"],
                           max_steps=max_steps, num_generations=num_generations,
                           per_device_train_batch_size=per_device_train_batch_size,
                           max_completion_length=max_completion_length, max_prompt_length=max_prompt_length,
                           max_tool_calling_iterations=max_tool_calling_iterations, tool_warmup_steps=tool_warmup_steps,
                           num_train_samples=num_train_samples, num_eval_samples=num_eval_samples,
                           reward_funcs=["correctness", "format_soft"], generation_backend="hf",
                           output_dir=output_dir, seed=seed, use_lora=True),
                      dict(preflight_prompts=preflight_prompts, dashboard=dashboard, verbose=verbose),
                      dict(preflight_prompts=int, dashboard=str, verbose=bool))
print(f"model={cfg.model}  task={cfg.task} levels={cfg.levels}  tools={cfg.tools}  steps={cfg.max_steps}  "
      f"G={cfg.num_generations}  completion<={cfg.max_completion_length} tokens (all turns)")

# %% [markdown]
# ## 1. Writing a tool
# A tool is a plain function with type hints and a Google-style docstring: transformers builds the JSON schema the
# chat template shows the model from them. It returns text. In the rollout the kit runs every call under
# `checked_tool`: a call that raises, runs past `tool_time_limit_s` or returns anything but text is one logged
# failure (TRL's `tools/failure_frequency`), handed back to the model as `{"error": ...}`, and the rollout goes on.

# %%
import json

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
try:
    tool(a="thirty", b=2)
except ToolError as e:
    print("a failing call:", e)

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

from grpo_kit.app.run import resolve_device, resolve_dtype
from grpo_kit.model.loading import load_model
from grpo_kit.tasks.chat_template import check_tool_template, use_tool_template
from grpo_kit.tasks.data import build_datasets, default_system_prompt, make_prompt

torch.manual_seed(seed)
device = resolve_device(cfg)
policy, tokenizer = load_model(cfg.model, dtype=resolve_dtype(cfg, device), device=device, seed=seed)
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
from grpo_kit.app.evaluation import tool_preflight

check = tool_preflight(policy, tokenizer, train_examples[:preflight_prompts], [calculator],
                       num_generations=cfg.num_generations, system_prompt=system_prompt,
                       max_new_tokens=cfg.max_completion_length,
                       max_tool_calling_iterations=cfg.max_tool_calling_iterations, seed=seed)
print(f"groups with reward spread: {check['spread_share']:.0%} of {check['groups']}; tool calls per rollout: "
      f"{check['tool_call_rate']:.2f} ({check['tool_use_share']:.0%} of rollouts called it, "
      f"{check['tool_failure_rate']:.0%} of calls failed); sampled accuracy {check['accuracy']:.0%}")
del policy

# %% [markdown]
# ## 5. Train, with the dashboard
# The dashboard's last panel is TRL's tool metrics per step: calls per rollout and the failed share of calls.
# The held-out evaluation before and after runs the same tool loop, greedy.

# %%
from grpo_kit.app.run import train
from grpo_kit.notebook.dashboard import LiveDashboard

dash = LiveDashboard(mode=dashboard)
# overwrite=True: running this cell again moves the earlier run aside (RUN.replaced-<time>), never deletes it
summary = train(cfg, progress=True, callbacks=(dash,), overwrite=True, verbose=verbose)

# %% [markdown]
# ## 6. Before → after on the same questions

# %%
from pathlib import Path

from grpo_kit.tasks.rewards import final_answer_text

evals = json.loads((Path(summary["run_dir"]) / "eval.json").read_text())
for when in (w for w in ("before", "after_warmup", "after") if w in evals):  # after_warmup: tool_warmup_steps
    r = evals[when]
    print(f"{when:>6}: accuracy {r['accuracy']:.0%}, tool used in {r['tool_use_share']:.0%} of answers, "
          f"{r['tool_calls']} calls, {r['tool_failures']} failed (n={r['n']})")
for b, a in list(zip(evals["before"]["samples"], evals["after"]["samples"]))[:3]:
    print(f"\nQ: {b['question']}  (answer {b['answer']})")
    for when, s in (("before", b), ("after", a)):
        calls = sum(len(m.get("tool_calls") or []) for m in s["messages"])
        print(f"  {when}: {calls} tool call(s), final: {final_answer_text(s['messages'])!r}")
