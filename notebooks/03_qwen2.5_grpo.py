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
# # 03 · A full GRPO run: Qwen2.5-1.5B-Instruct on GSM8K
#
# Online with a GPU (Colab T4 or better): Qwen2.5-1.5B-Instruct, GSM8K from the hub, vLLM generation (HF generate
# where vLLM is not installed or the GPU's driver cannot run its CUDA build), LoRA,
# the kit's efficient loss (not run or timed here: no GPU). Otherwise (CPU, no network) the notebook falls back
# by itself to the embedded SmolLM2-135M-Instruct on the arithmetic tasks, as `python -m grpo_kit train`
# does (CI runs it with 2 steps × 4 generations × 8 tokens). `-p max_steps N` sets the full run's steps,
# `-p fallback_max_steps N` the fallback's. The dashboard redraws every step; the run folder keeps metrics.csv, samples.jsonl, eval.json and the
# adapter.
#
# **Runtime:** GPU, a T4 or better (Colab: Runtime > Change runtime type > T4 GPU; the notebook's metadata asks
# for it). Measured: the outputs below are the CPU fallback with the parameters as they stand
# (the embedded model, vLLM's CPU engine, 40 steps of 2 prompts × 8 completions of at most 24 tokens, 200
# held-out problems before and after): 388 s for the whole notebook on a 2-core CPU (load average 2.0), 294.0 s of it
# training, held-out 0.070 -> 0.700 (`python tests/test_notebooks.py --refresh`). The full setup (Qwen2.5-1.5B architecture, HF
# generation, 3 steps x 128 tokens) 88 s on an H200 (`bench/results/notebooks_gpu.md`). Not timed on a T4.

# %%
# Colab: install the kit and what this notebook needs (pip's output hidden; the installed versions printed at
# the end; vLLM only on a GPU runtime whose driver runs its CUDA 13 build, otherwise HF generate).
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

    install_runtime(generate=True)
elif importlib.util.find_spec("grpo_kit") is None:
    raise ModuleNotFoundError("grpo_kit is not installed in this kernel's Python: run `bash install.sh` in the "
                              "checkout (it installs the kit), or `pip install -e .` there")

# %% tags=["parameters"]
model = "Qwen/Qwen2.5-1.5B-Instruct"  # @param ["Qwen/Qwen2.5-1.5B-Instruct", "Qwen/Qwen3-1.7B", "google/gemma-3-1b-it"] {allow-input: true}
task = "gsm8k"
dataset_path = ""  # empty: the hub dataset openai/gsm8k
max_steps = 100
num_generations = 8
max_prompt_length = 256
max_completion_length = 256
num_train_samples = 1000
num_eval_samples = 100
learning_rate = 5e-5
generation_backend = "auto"  # vLLM where it is installed and can run, else HF generate (saying why)
# the offline fallback (CPU or no network): the embedded model on arithmetic
fallback_model = "smollm2-135m-instruct"
fallback_max_steps = 40
fallback_max_completion_length = 24
fallback_num_eval_samples = 200
fallback_generation_backend = "auto"  # as `python -m grpo_kit train`: vLLM on the CPU where installed
setup = "auto"  # "auto" | "full" | "fallback"
dashboard = "auto"  # "auto" | "widgets" | "static"
output_dir = "runs/03_qwen2.5_grpo"
save_merged_weights = True  # write merged 16-bit weights after training
hub_repo = ""  # e.g. "user/qwen2.5-grpo": push the merged weights to the Hub
seed = 0
report_to = "none"  # trackers (TRL's report_to): "tensorboard", "wandb", "trackio", several: "tensorboard,wandb"
verbose = False  # True: vLLM's log and third-party warnings as the libraries print them (the CLI's --verbose)
preflight_prompts = 4  # prompts the pre-flight check samples (num_generations completions each)

# %%
from grpo_kit.notebook.helpers import notebook_setup

common = dict(num_generations=num_generations, per_device_train_batch_size=num_generations,
              max_prompt_length=max_prompt_length, num_train_samples=num_train_samples,
              num_eval_samples=num_eval_samples, output_dir=output_dir, seed=seed, use_lora=True,
              report_to=report_to)
full = dict(common, model=model, task=task, dataset_path=dataset_path, max_steps=max_steps,
            max_completion_length=max_completion_length, learning_rate=learning_rate,
            generation_backend=generation_backend, reward_funcs=["correctness", "format_soft"])
# the fallback is `python -m grpo_kit train`'s default run: 2 prompts per step (with 1, the untrained embedded
# model's sparse rewards left most early steps without signal), the config's learning rate and rewards
fallback = dict(common, model=fallback_model, task="arithmetic", max_steps=fallback_max_steps,
                per_device_train_batch_size=2 * num_generations, num_eval_samples=fallback_num_eval_samples,
                max_completion_length=fallback_max_completion_length, generation_backend=fallback_generation_backend)
# both checked before anything loads; the full setup where this machine can run it (vLLM needed only when asked
# for by name), else the fallback; the kit's quiet console from here on
run = notebook_setup(full, fallback, setup=setup, verbose=verbose,
                     need_packages=("vllm",) if generation_backend == "vllm" else (),
                     extras=dict(dashboard=dashboard, save_merged_weights=save_merged_weights, hub_repo=hub_repo),
                     extra_types=dict(dashboard=str, save_merged_weights=bool, hub_repo=str))
cfg, device, dtype = run.config, run.device, run.dtype  # dtype: bf16 where supported, fp16 on a T4, fp32 on a CPU

# %% [markdown]
# ## Which model fits a free T4?
# `model` takes Qwen2.5, Qwen3 or Gemma 3 (any [supported family](../docs/models.md) works, a hub id or a folder).
# The calculator's verdict for each on a free Colab T4 (15 GiB, fp16), with the full setup's settings:

# %%
from grpo_kit.memory.fit import config_fit, require_fit
from grpo_kit.notebook.helpers import NOTEBOOK_MODELS, validate_params

full_cfg = validate_params(full)  # the full setup as configured, whichever runs here
for hub_id, built_in in NOTEBOOK_MODELS.items():
    verdict, _ = config_fit(full_cfg, calculator_model=built_in, gpu_gib=15.0, detect=False)
    print(f"{hub_id:28s} {verdict.text()}")

# %% [markdown]
# ## Does it fit? The calculator against this GPU
# The calculator's estimate for the config as it will train (`grpo_kit.memory.fit.require_fit`, the chosen
# model's architecture) against the detected GPU's memory (15 GiB, a T4, without one): the full setup
# stops here with the numbers and what to change when it would not fit, before any model loads.

# %%
if run.name == "full":
    require_fit(cfg, calculator_model=NOTEBOOK_MODELS.get(cfg.model, cfg.model), gpu_gib=15.0)
else:
    verdict, source = config_fit(cfg, gpu_gib=15.0)
    print(f"fallback, {source}: {verdict.text()}")

# %% [markdown]
# ## Rewards
# `correctness_reward` compares the last number of a completion (`extract_number`) with the reference answer;
# `format_soft_reward` gives partial credit for ending with `Answer: <number>`. Both follow TRL's signature
# `fn(prompts, completions, **columns) -> list[float]`.

# %% tags=["nbval-check-output"]
from grpo_kit.tasks.rewards import correctness_reward, format_soft_reward

completions = ["3 + 4 = 7. Answer: 7", "The answer is 12", "Answer: 7.0", "no idea"]
print("correctness:", correctness_reward(None, completions, answer=["7", "7", "7", "7"]))
print("format_soft:", format_soft_reward(None, completions))

# %% [markdown]
# ## Pre-flight: will the start carry a learning signal?
# GRPO learns only from groups whose rewards differ. A few prompts sampled from the untrained model show the
# share of groups with no reward spread, how many completions are cut, and what to change when most groups
# give nothing (`python -m grpo_kit preflight` is the same check).

# %%
from grpo_kit.app.preflight import preflight

print(preflight(cfg, num_prompts=preflight_prompts).text())

# %% [markdown]
# ## Train, with the live dashboard

# %%
from grpo_kit.notebook.dashboard import LiveDashboard
from grpo_kit.app.run import train

dash = LiveDashboard(mode=dashboard)
# overwrite=True: running this cell again moves the earlier run aside (RUN.replaced-<time>), never deletes it
summary = train(cfg, progress=True, callbacks=(dash,), overwrite=True, verbose=verbose)

# %% [markdown]
# ## Before / after and the saved adapter

# %%
from grpo_kit.notebook.helpers import run_report

print(run_report(summary))

# %%
from IPython.display import Image, display

display(Image(filename=f"{summary['run_dir']}/rewards.png"))  # the run folder's reward curve

# %% [markdown]
# ## The same question before and after training
# The run folder keeps the config and the trained adapter (`adapter/`); `grpo_kit.app.export` loads them back. A
# LoRA run loads once: "before" is the same model with the adapter switched off.

# %%
from grpo_kit.tasks.data import build_datasets
from grpo_kit.app.export import before_after

questions = [e["question"] for e in build_datasets(cfg)[1][:2]]  # held-out problems the run never trained on
for row in before_after(summary["run_dir"], questions, device=device, dtype=dtype):
    print(f"Q: {row['question']}\n  before: {row['before']!r}\n  after:  {row['after']!r}")

# %% [markdown]
# ## Merged 16-bit weights, and the Hub
# `save_merged` folds the adapter into the base weights and writes a plain `transformers` checkpoint (it refuses
# a non-empty folder unless `overwrite=True`, which moves the old one aside). Set `hub_repo` (`user/name`, with a
# token from `huggingface-cli login` or `HF_TOKEN`) to upload it.

# %%
from grpo_kit.app.export import push_to_hub, save_merged

import torch

if save_merged_weights:
    merged = save_merged(summary["run_dir"], f"{summary['run_dir']}-merged", dtype=dtype
                         if device == "cuda" else torch.float32, device=device, overwrite=True)
    print("merged weights:", merged)
    if hub_repo:
        print("pushed:", push_to_hub(merged, hub_repo))

# %% [markdown]
# ## After a Colab disconnect
# A Colab runtime loses `runs/` when it disconnects. Keep the run folder on Drive: mount it
# (`from google.colab import drive; drive.mount("/content/drive")`) and set `output_dir` to a folder under
# `/content/drive/MyDrive/`, or copy a finished one there (`!cp -r runs/NAME /content/drive/MyDrive/`). After a
# reconnect, run the install cell, then continue from the last checkpoint (written every `save_steps` steps):
# `from grpo_kit.app.run import resume; resume("/content/drive/MyDrive/NAME")`, or on the command line
# `python -m grpo_kit train --resume /content/drive/MyDrive/NAME` (`--set max_steps=N` to train longer).
