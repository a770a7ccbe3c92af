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
# # 04 · Llama-3.1-8B-Instruct, long completions (up to 20K context)
#
# On a GPU (how much memory: see the calculator below; the full run was not timed or run here) the run uses
# everything the kit has for long context: offloaded gradient checkpointing (each layer's input parked in CPU RAM), the
# efficient loss (no (B, T, V) logits), weights shared with vLLM; the calculator below also prices 4-bit
# weights and an FP8 KV cache. Offline or on a CPU it falls back by itself to the embedded model at a 2,048-token
# window (CI runs it with 2 steps × 4 generations at 72 tokens).
#
# **Runtime:** GPU (Colab: Runtime > Change runtime type > T4 GPU, which the notebook's metadata asks for;
# the calculator below says whether the chosen context fits). Measured: the outputs below are the CPU fallback with the
# parameters as they stand (the embedded model at a 2,048-token window, 5 steps × 8 completions, HF generation, 50
# held-out problems): 1,581 s for the whole notebook on a 2-core CPU that another job shared for part of the run
# (steps 1-3 took 21-41 s, steps 4-5 216-631 s). In 5 steps of one prompt no sampled group earned a reward, so
# the adapter did not move (notebook 03 shows the same model learning over 40 steps); the run is here for the
# memory at a long window, measured beside the calculator's. The full setup (Llama-3.2-1B architecture at 1.5K context, HF generation, 2 steps) 275 s on an H200
# (`bench/results/notebooks_gpu.md`). Not timed on a T4.
#
# **Free T4:** `preset = "free_t4"` sets 4-bit base weights (QLoRA), fp16, HF generation and the longest context
# whose whole step the calculator fits in 14 GiB (`grpo_kit.memory.fit.free_t4_preset`): 8,192 tokens for
# Llama-3.1-8B with 8 generations. What limits it is HF `generate`'s 16-bit KV cache of the 8 completions (8 GiB
# at 8K); the training step alone was measured on an H200 under a 15 GiB cap at 7.95 GiB for 8 x 4.6K tokens and
# 10.77 GiB for 8 x 21K, and the generation phase at 8,192 tokens (its KV cache at full size, then decoding) at
# 14.06 GiB allocated, 14.95 reserved (`bench/results/qlora_memory.md`): it fits, with no room to spare. The preset
# itself has not run on a T4. The reference pass scores all 8 completions per forward there
# (`scoring_batch_size: auto`: the calculator's 9.68 GiB at 8K, under the generation phase), which matters most in
# 4-bit, where each forward dequantises every weight: at 1K on an H100 the 4-bit step took 1.13x the 16-bit step's
# time so, against 1.44x scoring one completion at a time.

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
model = "meta-llama/Llama-3.1-8B-Instruct"
calculator_model = "llama-3.1-8b"  # built-in architecture used for the memory estimate
task = "gsm8k"
dataset_path = ""
context_length = 20480  # prompt + completion tokens
max_prompt_length = 512
max_steps = 50
num_generations = 8
num_train_samples = 1000
num_eval_samples = 50
lora_rank = 16
four_bit = False  # QLoRA: NF4 base weights in training (a 15 GiB T4); generation then uses HF generate
fp8_kv_cache = True  # vLLM's KV cache in FP8 (16-bit weights, shared with training)
# FP8 base weights (GPUs with FP8 tensor cores: L4, RTX 40/50, H100, H200): one FP8 copy, read by vLLM and training
# (its FP8 activations widen the engine-trainer log-prob gap: docs/quantization.md; prefer 16 bit for accuracy)
fp8_weights = False
# how the adapter reaches vLLM: "" the kit's default, "merge": merged into the shared weights for each generation,
# exact bits restored after (dense decoding; the faster on an H200); "adapter": run in vLLM's LoRA kernels
vllm_lora_sync = ""
gpu_gib = 80.0  # the card's memory, for the calculator's budget line
generation_backend = "vllm"  # full setup; "hf" generates with transformers (slow at long context, no FP8 KV)
fallback_model = "smollm2-135m-instruct"
fallback_max_prompt_length = 64
fallback_context_length = 2048  # the CPU run's window: prompt + completion tokens per sequence
fallback_max_steps = 5
setup = "auto"  # "auto" | "full" | "fallback"
preset = ""  # "free_t4": Colab's free T4 (15 GiB, fp16): 4-bit, HF generation, the longest context that fits
dashboard = "auto"
output_dir = "runs/04_llama3.1_long_context"
save_merged_weights = False  # merged 16-bit weights after training (an 8B needs its 16-bit copy on `device`)
hub_repo = ""  # e.g. "user/llama3.1-grpo": push the merged weights to the Hub
seed = 0
report_to = "none"  # trackers (TRL's report_to): "tensorboard", "wandb", "trackio", several: "tensorboard,wandb"
verbose = False  # True: vLLM's log and third-party warnings as the libraries print them (the CLI's --verbose)

# %%
from grpo_kit.memory.fit import free_t4_preset
from grpo_kit.model.loading import check_model_name
from grpo_kit.generation.sync import LORA_SYNC_MODES
from grpo_kit.notebook.helpers import choose_setup, validate_params

if preset not in ("", "free_t4"):
    raise ValueError(f"preset={preset!r} is not allowed: '' (the parameters as set) or 'free_t4'")
if vllm_lora_sync not in ("", *LORA_SYNC_MODES):
    raise ValueError(f"vllm_lora_sync={vllm_lora_sync!r} is not allowed: '' (the kit's default) or one of "
                     f"{list(LORA_SYNC_MODES)}")
if preset == "free_t4":  # the calculator picks the context: the whole step, HF generate's KV cache included
    t4 = free_t4_preset(calculator_model, num_generations=num_generations, prompt_length=max_prompt_length,
                        lora_rank=lora_rank)
    context_length, four_bit, generation_backend, gpu_gib = (t4["context_length"], True, t4["generation_backend"],
                                                             t4["budget_gib"])
    print(f"preset free_t4: context {context_length:,} tokens, 4-bit, fp16, HF generation; the calculator's "
          f"step: {t4['estimate_gib']:.2f} of {t4['budget_gib']} GiB")
extras = dict(calculator_model=calculator_model, context_length=context_length, four_bit=four_bit, fp8_weights=fp8_weights,
              fp8_kv_cache=fp8_kv_cache, gpu_gib=gpu_gib, fallback_context_length=fallback_context_length,
              fallback_max_prompt_length=fallback_max_prompt_length, setup=setup, dashboard=dashboard,
              save_merged_weights=save_merged_weights, hub_repo=hub_repo, preset=preset, verbose=verbose)
types = dict(calculator_model=str, context_length=int, four_bit=bool, fp8_weights=bool, fp8_kv_cache=bool, gpu_gib=float,
             fallback_context_length=int, fallback_max_prompt_length=int, setup=str, dashboard=str,
             save_merged_weights=bool, hub_repo=str, preset=str, verbose=bool)
check_model_name(calculator_model)
validate_params({}, extras, types)  # types first, so the comparisons below are safe
for name, ctx, prompt in (("context_length", context_length, max_prompt_length),
                          ("fallback_context_length", fallback_context_length, fallback_max_prompt_length)):
    if ctx <= prompt:
        raise ValueError(f"{name}={ctx} must be larger than its prompt length {prompt}")
common = dict(num_generations=num_generations, num_train_samples=num_train_samples, num_eval_samples=num_eval_samples,
              output_dir=output_dir, seed=seed, use_lora=True, lora_rank=lora_rank, lora_alpha=2 * lora_rank,
              gradient_checkpointing=True, report_to=report_to)
# the full setup trains one sequence per micro-batch (what the calculator below prices); the tiny fallback all at once
full = dict(common, model=model, per_device_train_batch_size=1, gradient_accumulation_steps=num_generations,
            max_prompt_length=max_prompt_length, task=task, dataset_path=dataset_path, max_steps=max_steps,
            max_completion_length=context_length - max_prompt_length, generation_backend=generation_backend,
            learning_rate=2e-5)
fallback = dict(common, model=fallback_model, per_device_train_batch_size=num_generations, task="arithmetic",
                max_steps=fallback_max_steps,
                max_prompt_length=fallback_max_prompt_length,
                max_completion_length=fallback_context_length - fallback_max_prompt_length, generation_backend="hf")
validate_params(full)
# vLLM is needed only where the full setup generates with it: not in 4-bit (the free-T4 preset), not with "hf"
uses_vllm = generation_backend != "hf" and not four_bit
chosen, settings = choose_setup(full, fallback, need_packages=("vllm",) if uses_vllm else (), force=setup)
if chosen == "full" and four_bit:  # checked by validate_params below: no bitsandbytes stops here, not mid-run
    settings.update(load_in_4bit=True, generation_backend="hf")  # vLLM cannot take 4-bit training weights yet
elif chosen == "full" and generation_backend != "hf":
    settings.update(kv_cache_dtype="fp8" if fp8_kv_cache else "auto", vllm_lora_sync=vllm_lora_sync or None)
if chosen == "full" and fp8_weights:  # a GPU without FP8 tensor cores is refused below, naming it
    settings.update(base_weights="fp8")
cfg = validate_params(settings)
print(f"setup: {chosen}  model={cfg.model}  context={cfg.max_prompt_length + cfg.max_completion_length}  "
      f"steps={cfg.max_steps}  G={cfg.num_generations}")

# %% [markdown]
# ## What the full run needs: the calculator
# One GRPO step of Llama-3.1-8B at the full context with 8 generations, TRL-style vs the kit (one sequence
# per micro-batch, offloaded checkpoints, chunked loss), with the 4-bit / FP8-KV choices above.

# %% tags=["nbval-check-output"]
import pandas as pd

from grpo_kit.memory import EstimateSpec, compare

pd.set_option("display.width", 160)
spec = EstimateSpec(num_generations=num_generations, prompt_length=max_prompt_length,
                    completion_length=context_length - max_prompt_length, lora_rank=lora_rank,
                    quantization="4bit" if four_bit else "fp8" if fp8_weights else None,  # 4-bit: HF generate, 16-bit KV
                    vllm=not four_bit, kv_cache_dtype="fp8" if fp8_kv_cache and not four_bit else None,
                    micro_batch_size=1)
table = compare(calculator_model, spec, methods=("trl", "grpo_kit"), unit="GiB")
print(table.round(2).to_string())

# %%
from dataclasses import replace

from grpo_kit.memory import estimate, plot_components
from grpo_kit.notebook.helpers import show_figure

fig = plot_components({m: estimate(calculator_model, replace(spec, method=m)) for m in ("trl", "grpo_kit")},
                      budget_gib=gpu_gib, title=f"{calculator_model}, {context_length} tokens, G={num_generations}")
show_figure(fig)  # a bare matplotlib Figure: plt.show() would not draw it

# %% [markdown]
# ## The long-context story, from the committed measurements
# Peak GPU memory of one training step (no generation) of Llama-3.1-8B, LoRA rank 16, one sequence per micro-batch,
# against the tokens per sequence. **Measured** points (solid, markers) are `bench/step.py`'s runs on an H200
# (`bench/results/data/step.jsonl`): the kit with offloaded checkpoints, the kit with checkpoints on the GPU, and the
# TRL-style baseline (HF gradient checkpointing, the full fp32 logits, as stock TRL 1.16 computes them). **Calculator**
# lines (dashed, no markers) are `grpo_kit.memory.estimate` for the same step with TRL 1.16's design, Unsloth's
# long-context components (one sequence of logits at a time, offloaded checkpoints) and the kit's, at the lengths
# that were not measured. Nothing here runs on this machine.

# %%
import matplotlib.pyplot as plt

from grpo_kit.memory import EstimateSpec, estimate
from grpo_kit.memory.estimate import total_gpu_bytes
from grpo_kit.notebook.helpers import PEER_LABELS, bench_rows, line_style

lengths = [20480, 32768, 65536, 131072, 262144]
fig, ax = plt.subplots(figsize=(8.5, 4.5))
step_df = bench_rows("step")
if step_df is not None:
    one = step_df[(step_df["model"] == "llama-3.1-8b") & (step_df["gens"] == 1) & (step_df["status"] == "ok")
                  & (step_df["dtype"] == "")]
    for row, g in one.groupby("row"):
        g = g.sort_values("seq_len").drop_duplicates("seq_len", keep="last")
        ax.plot(g["seq_len"], g["peak_allocated_gib"], label=f"{PEER_LABELS[row]} (measured, H200)", **line_style(row))
calc = {}
for method, label in (("trl", "TRL 1.16"), ("unsloth", "Unsloth's components"), ("grpo_kit", "grpo_kit")):
    calc[label] = [total_gpu_bytes(estimate(calculator_model, EstimateSpec(
        method=method, num_generations=1, prompt_length=512, completion_length=n - 512, lora_rank=lora_rank,
        micro_batch_size=1, include_generation=False))) / 2**30 for n in lengths]
    ax.plot(lengths, calc[label], linestyle=":", linewidth=2.6 if method == "grpo_kit" else 1.4,
            label=f"{label} (calculator)")
ax.axhline(80, color="0.4", linewidth=0.8)
ax.text(lengths[0], 82, "80 GiB card", fontsize=7)
ax.set_xscale("log", base=2)
ax.set_xlabel("tokens per sequence (prompt 512 + completion)")
ax.set_ylabel("peak GPU memory (GiB)")
ax.set_title("Training step peak memory against context, Llama-3.1-8B, LoRA r=16, bf16, 1 sequence", fontsize=9)
ax.grid(alpha=0.3)
ax.legend(fontsize=7)
fig.tight_layout()
plt.show()
print(pd.DataFrame(calc, index=pd.Index(lengths, name="tokens")).round(1).to_string())

# %% [markdown]
# The whole step with generation: 8 completions of 20K tokens (prompt 512) of Llama-3.1-8B with vLLM on an H100
# 80GB, one step each (`python -m grpo_kit bench rl_step`, `bench/results/data/rl_step.jsonl`): the kit's default
# (weights shared with vLLM, FP8 KV cache), the same with a bf16 KV cache, the kit with a separate vLLM copy of the
# weights, and stock TRL 1.16 with colocated vLLM.

# %%
rl = bench_rows("rl_step")
if rl is not None:
    rl = rl[(rl["model"] == "llama-3.1-8b") & (rl["completion_len"] == 20480) & rl["peak_gib"].notna()
            & rl["card"].str.contains("H100")].drop_duplicates("row", keep="last")
    order = [r for r in ("grpo_kit_fp8", "grpo_kit_bf16", "grpo_kit_copy", "trl") if r in set(rl["row"])]
    rl = rl.set_index("row").loc[order]
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 3.6))
    colors = ["k" if r.startswith("grpo_kit") else "C1" for r in order]
    names = [PEER_LABELS[r].replace(" (", "\n(") for r in order]
    a1.barh(names, rl["peak_gib"], color=colors, alpha=0.8)
    a1.set_xlabel("peak GPU memory (GiB)")
    a1.set_title("Whole GRPO step, 8 x 20K tokens, Llama-3.1-8B (H100 80GB)", fontsize=9)
    a2.barh(names, rl["step_s"], color=colors, alpha=0.8)
    a2.set_xlabel("step time (s)")
    a2.set_title("Same runs: one step's wall time", fontsize=9)
    for ax in (a1, a2):
        ax.invert_yaxis()
        ax.grid(alpha=0.3, axis="x")
        ax.tick_params(axis="y", labelsize=7)
    fig.tight_layout()
    plt.show()
    print(rl[["peak_gib", "step_s", "generation_s", "training_s"]].round(1).to_string())

# %% [markdown]
# ## Does the full run fit your card? The calculator for a T4, an L4, an A100 40GB and an H100
# The full setup's step as configured above (LoRA, one sequence per micro-batch, vLLM sharing the weights, FP8 KV
# cache unless 4-bit), priced against each card's memory: the verdict and the longest context that fits.

# %% tags=["nbval-check-output"]
from grpo_kit.memory import config_estimate_spec
from grpo_kit.memory.fit import fit_verdict

full_cfg = validate_params(dict(full, load_in_4bit=True, generation_backend="hf") if four_bit else
                           dict(full, kv_cache_dtype="fp8" if fp8_kv_cache else "auto"))
full_spec = config_estimate_spec(full_cfg)  # prompt + completion: context_length tokens
for card, gib in (("T4 (15 GiB)", 15.0), ("L4 (24 GiB)", 24.0), ("A100 40GB", 40.0), ("H100 80GB", 80.0)):
    v = fit_verdict(calculator_model, gib, full_spec)
    print(f"{card:>12} at {context_length:,} tokens: {v.text()}")
t4 = free_t4_preset(calculator_model, num_generations=num_generations, prompt_length=max_prompt_length,
                    lora_rank=lora_rank)
print(f"on a T4 in 4-bit (preset='free_t4': fp16, HF generation): {t4['context_length']:,} tokens fit, "
      f"the step {t4['estimate_gib']:.2f} of {t4['budget_gib']} GiB")

# %% [markdown]
# ## Does it fit? The calculator against this GPU
# The calculator's estimate for the config as it will train (`grpo_kit.memory.fit.require_fit`) against the
# detected GPU's memory (`gpu_gib` without one): the full setup stops here with the numbers and what to change
# when it would not fit, instead of running out of memory later; `preset = "free_t4"` picks a context that fits.

# %%
from grpo_kit.memory.fit import config_fit, require_fit

if chosen == "full":  # the config as it will train; stops with the numbers when it would not fit
    require_fit(cfg, calculator_model=calculator_model, gpu_gib=gpu_gib)
else:
    verdict, source = config_fit(cfg, gpu_gib=gpu_gib)
    print(f"fallback, {source}: {verdict.text()}")

# %% [markdown]
# ## Train
# `gradient_checkpointing=True` is offloaded to CPU RAM on a GPU with the kit's trainer; the loss is always the
# efficient one. In the full setup `four_bit=True` becomes the config's `load_in_4bit` (QLoRA: the base linear
# weights in NF4, `lm_head` in 16 bit, LoRA on top; needs a CUDA GPU and bitsandbytes, which the Colab cell
# installs on a GPU runtime); it then generates with HF `generate`, since vLLM cannot take a 4-bit training
# model's weights yet; its 4-bit layers multiply with the kit's matmul (`load_in_4bit_matmul`: each weight
# dequantised once per layer call, not per matmul; the 8B's 1K step took 1.34x its 16-bit time on an H200).
# Without it, `fp8_kv_cache` becomes `kv_cache_dtype="fp8"` for vLLM, which shares the
# 16-bit weights with training (measured: the 20K step in 28.3 GiB on an H200, 28.6 on an H100, where TRL
# colocate took 54.7), and `vllm_lora_sync` becomes the
# config's field of that name. The fallback uses none of them: on the CPU it trains the embedded model with a
# 2,048-token window per sequence (prompt + completion); its completions end where the model stops (the
# dashboard's completion-length panel shows how long they were), so the window bounds the memory, it is
# not always filled. The measured memory printed after the run is not the calculator's quantity on the CPU: it is
# the process's peak RSS over the whole run (Python, torch, transformers and TRL take about 0.8 GiB once
# imported; the held-out evaluation generates its 50 answers in one batch, each up to the window, before
# training starts; the allocator keeps what it freed), where the calculator prices one training step. On a GPU
# the measured figure is the allocator's peak.

# %%
from grpo_kit.notebook.dashboard import LiveDashboard
from grpo_kit.app.run import resolve_device, resolve_dtype, train

device = resolve_device(cfg)
print("device:", device, " dtype:", resolve_dtype(cfg, device))
dash = LiveDashboard(mode=dashboard)
# overwrite=True: running this cell again moves the earlier run aside (RUN.replaced-<time>), never deletes it
summary = train(cfg, progress=True, callbacks=(dash,), overwrite=True, verbose=verbose)

# %%
from grpo_kit.memory.fit import config_fit
from grpo_kit.notebook.helpers import run_report

print(run_report(summary))
# the calculator prices the step at the full window; on the CPU the measured figure is the process's peak RSS
# (Python, torch and the tokenizer included), on a GPU the allocator's peak
verdict, _ = config_fit(cfg, gpu_gib=gpu_gib)
print(f"memory, measured: {summary['peak_memory_gib']:.2f} GiB ({device}); the calculator's step at "
      f"{cfg.max_prompt_length + cfg.max_completion_length:,} tokens: {verdict.peak_gib:.2f} GiB")

# %% [markdown]
# ## The same question before and after training
# The run folder keeps the config and the trained adapter (`adapter/`); `grpo_kit.app.export` loads them back. A
# LoRA run loads once: "before" is the same model with the adapter switched off.

# %%
from grpo_kit.tasks.data import build_datasets
from grpo_kit.app.export import before_after

questions = [e["question"] for e in build_datasets(cfg)[1][:2]]  # held-out problems the run never trained on
for row in before_after(summary["run_dir"], questions, device=device, dtype=resolve_dtype(cfg, device)):
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
    merged = save_merged(summary["run_dir"], f"{summary['run_dir']}-merged", dtype=resolve_dtype(cfg, device)
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
