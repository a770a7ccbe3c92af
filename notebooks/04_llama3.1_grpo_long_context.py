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
# weights and an FP8 KV cache. Offline or on a CPU it falls back by itself to long documents at a CPU's size: the
# embedded model finds a five-digit code in a ~1K-token generated document (`long_document` level 0), 8 completions
# a step sharing the document as their prompt, which prefix sharing scores once per group; the long-context parts
# on a CPU are the calculator's, the committed GPU measurements', and the long-document section, which scores a
# 1K-token document with and without prefix sharing on this machine (CI runs it all with 2 steps of 8 completions
# of 8 tokens).
#
# **Runtime:** GPU (Colab: Runtime > Change runtime type > T4 GPU, which the notebook's metadata asks for; the
# calculator below says whether the chosen context fits). Measured: the outputs below are the CPU fallback with the
# parameters as they stand: long documents at level 0 (988-token prompts), 20 steps of 8 completions up to 32 tokens,
# vLLM's CPU engine, the prompt scored once per group: 552 s for the whole notebook on a 2-core CPU (load average
# 1.9), the train cell 497 s of it: 281 s training (13.9 s a step), the rest loading, vLLM's start and the two
# held-out evaluations (24 documents, HF generate over ~1K-token prompts); held-out accuracy 0.250 -> 0.333 (6 -> 8 of 24). With one document a step the reward
# per step is noisy: its mean is 0.06 over steps 1-10
# and 0.21 over steps 11-20, and the completions shorten from ~28 to ~19 tokens (the trained model stops after the
# code it names). The long-document section scored its group in 16.9 s with every row's prompt and 3.0 s with the
# prompt once. The full setup (Llama-3.2-1B architecture at 1.5K context, HF generation, 2 steps) 275 s on an H200 (`bench/results/notebooks_gpu.md`). Not timed on a T4.
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
# the CPU fallback trains on long documents: level 0 (about 1K tokens), 8 completions a step sharing the prompt
fallback_max_prompt_length = 1280
fallback_context_length = 1312  # prompt + completion tokens: the answer takes ~20 tokens
fallback_max_steps = 20
fallback_num_eval_samples = 24
fallback_learning_rate = 1e-4
fallback_generation_backend = "auto"  # vLLM's CPU engine where installed, else HF generate
# the long-document section: a level-0 document (about 1K tokens) scored by the embedded model with and without sharing
doc_generations = 8
doc_completion_tokens = 64
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
from grpo_kit.notebook.helpers import quiet_console

quiet_console(verbose)  # the kit's own lines from here on, before the imports below can warn (verbose: all of them)

from grpo_kit.memory.fit import free_t4_preset
from grpo_kit.model.loading import check_model_name
from grpo_kit.notebook.helpers import notebook_setup, validate_params

# the notebook's own parameters by their types first, so the comparisons below are safe
extras = dict(calculator_model=calculator_model, context_length=context_length, four_bit=four_bit,
              fp8_weights=fp8_weights, fp8_kv_cache=fp8_kv_cache, gpu_gib=gpu_gib,
              fallback_context_length=fallback_context_length, fallback_max_prompt_length=fallback_max_prompt_length,
              setup=setup, dashboard=dashboard, save_merged_weights=save_merged_weights, hub_repo=hub_repo,
              preset=preset, verbose=verbose, doc_generations=doc_generations,
              doc_completion_tokens=doc_completion_tokens)
types = dict(calculator_model=str, context_length=int, four_bit=bool, fp8_weights=bool, fp8_kv_cache=bool,
             gpu_gib=float, fallback_context_length=int, fallback_max_prompt_length=int, setup=str, dashboard=str,
             save_merged_weights=bool, hub_repo=str, preset=str, verbose=bool, doc_generations=int,
             doc_completion_tokens=int)
validate_params({}, extras, types)
check_model_name(calculator_model)  # the architecture the calculator prices
for name, ctx, prompt in (("context_length", context_length, max_prompt_length),
                          ("fallback_context_length", fallback_context_length, fallback_max_prompt_length)):
    if ctx <= prompt:
        raise ValueError(f"{name}={ctx} must be larger than its prompt length {prompt}")

if preset == "free_t4":  # the calculator picks the context: the whole step, HF generate's KV cache included
    t4 = free_t4_preset(calculator_model, num_generations=num_generations, prompt_length=max_prompt_length,
                        lora_rank=lora_rank)
    context_length, four_bit, generation_backend, gpu_gib = (t4["context_length"], True, t4["generation_backend"],
                                                             t4["budget_gib"])
    print(f"preset free_t4: context {context_length:,} tokens, 4-bit, fp16, HF generation; the calculator's "
          f"step: {t4['estimate_gib']:.2f} of {t4['budget_gib']} GiB")
elif preset:
    raise ValueError(f"preset={preset!r} is not allowed: '' (the parameters as set) or 'free_t4'")
common = dict(num_generations=num_generations, num_train_samples=num_train_samples, output_dir=output_dir, seed=seed,
              use_lora=True, lora_rank=lora_rank, lora_alpha=2 * lora_rank, report_to=report_to)
# the full setup trains one sequence per micro-batch (what the calculator below prices); 4-bit generates with HF
full = dict(common, model=model, per_device_train_batch_size=1, gradient_accumulation_steps=num_generations,
            gradient_checkpointing=True,
            max_prompt_length=max_prompt_length, task=task, dataset_path=dataset_path, max_steps=max_steps,
            max_completion_length=context_length - max_prompt_length, num_eval_samples=num_eval_samples,
            generation_backend="hf" if four_bit else generation_backend, learning_rate=2e-5,
            **({} if four_bit else dict(kv_cache_dtype="fp8" if fp8_kv_cache else "auto",
                                        vllm_lora_sync=vllm_lora_sync or None)))
# the CPU fallback: long documents at level 0, the group's prompt scored once, the whole group in one micro-batch;
# no checkpointing (a 1K window fits a CPU's memory, and recomputing costs time there)
fallback = dict(common, model=fallback_model, task="long_document", levels=[0], prefix_sharing=True,
                gradient_checkpointing=False,
                per_device_train_batch_size=num_generations, max_steps=fallback_max_steps,
                max_prompt_length=fallback_max_prompt_length,
                max_completion_length=fallback_context_length - fallback_max_prompt_length,
                num_eval_samples=fallback_num_eval_samples, learning_rate=fallback_learning_rate,
                generation_backend=fallback_generation_backend, reward_funcs=["correctness"])
# both checked before anything loads; 4-bit and FP8 weights only where the full setup runs (they need its GPU);
# vLLM is needed only where the full setup generates with it
run = notebook_setup(full, fallback, setup=setup, verbose=verbose,
                     need_packages=("vllm",) if generation_backend != "hf" and not four_bit else (),
                     full_on_gpu=dict(load_in_4bit=four_bit, base_weights="fp8" if fp8_weights else "16bit"))
cfg, device, dtype = run.config, run.device, run.dtype  # dtype: bf16 where supported, fp16 on a T4, fp32 on a CPU

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

# the full setup's step (prompt + completion: context_length tokens) with its base weights, on any machine
full_spec = config_estimate_spec(validate_params(full), quantization="4bit" if four_bit else "fp8" if fp8_weights else None)
for card, gib in (("T4 (15 GiB)", 15.0), ("L4 (24 GiB)", 24.0), ("A100 40GB", 40.0), ("H100 80GB", 80.0)):
    v = fit_verdict(calculator_model, gib, full_spec)
    print(f"{card:>12} at {context_length:,} tokens: {v.text()}")
t4 = free_t4_preset(calculator_model, num_generations=num_generations, prompt_length=max_prompt_length,
                    lora_rank=lora_rank)
print(f"on a T4 in 4-bit (preset='free_t4': fp16, HF generation): {t4['context_length']:,} tokens fit, "
      f"the step {t4['estimate_gib']:.2f} of {t4['budget_gib']} GiB")

# %% [markdown]
# ## Long documents: a group's prompt scored once
# RL on long inputs is mostly long *prompts*: a document, a repository, a tool history, with a few thousand tokens of
# answer. The G completions of a group then share one long prompt, and a GRPO step scores that prompt G times in each
# of the policy, reference and old-policy passes, unless `prefix_sharing` (`auto` by default: where a group's prompts
# are equal and at least 1,024 tokens long) runs the prompt's forward once per group and lets the G completions
# attend to its keys and values (`grpo_kit.model.prefix`; the gradient of all G completions flows back into the one
# prompt forward). vLLM's prefix cache already holds the prompt's KV once in generation. The built-in task
# `long_document` (`configs/long_document.yaml`) asks for a five-digit code placed once in a generated document of
# 1K (level 0) to 128K tokens (level 4) among distractor codes.
#
# First the calculator: 8 completions of 2,048 tokens after a 126,976-token document, Llama-3.1-8B, LoRA r=16, the
# whole group in one micro-batch, with and without prefix sharing, against an 80 GiB card. Measured on an H100
# (`bench rl_step`, `bench/results/rl_step.md`): at half that document, 8 x (63,488 + 2,048), the shared step ran in
# 119 s at a 54.9 GiB peak; at 126,976 tokens the shared step ran out of memory in the policy's backward, where the
# completions' attention still copies the prompt's keys and values to every row and query head (docs/memory.md):
# the calculator's "fits" there is not borne out yet.

# %% tags=["nbval-check-output"]
from dataclasses import replace

from grpo_kit.memory import EstimateSpec
from grpo_kit.memory.fit import fit_verdict

long_doc = EstimateSpec(num_generations=8, prompt_length=126_976, completion_length=2048, lora_rank=lora_rank,
                        micro_batch_size=8, standby=True)  # the group in one micro-batch, vLLM sharing the weights
print(f"tokens per scoring pass: {8 * (126_976 + 2048):,} with every row's prompt, {126_976 + 8 * 2048:,} with the "
      "prompt once")
for sharing in (False, True):
    v = fit_verdict(calculator_model, gpu_gib, replace(long_doc, prefix_sharing=sharing))
    print(f"prefix sharing {'on: ' if sharing else 'off:'} {v.text()}")

# %% [markdown]
# Then on this machine: one level-0 problem (about 1K tokens) and 8 completions of 64 tokens scored by the embedded
# model both ways, no gradient: the G rows each with the whole prompt (as TRL 1.16 and Unsloth score them), and the
# prompt once with the 8 completions attending to it. The log-probs agree to float rounding; the times are this
# machine's.

# %%
import random
import time

import torch

from grpo_kit.model.anatomy import decoder_body, last_hidden
from grpo_kit.model.loading import load_model, load_tokenizer
from grpo_kit.model.prefix import shared_group_hidden
from grpo_kit.tasks.long_document import long_document_problem

problem = long_document_problem(random.Random(seed), level=0)
print(problem["question"][-400:], "\nanswer:", problem["answer"], " fact at depth", problem["depth"])
doc_tok = load_tokenizer(fallback_model)
doc_model = load_model(fallback_model, dtype=torch.float32, device=device)[0].eval()
prompt_ids = torch.tensor(doc_tok(problem["question"])["input_ids"], device=device)
G_doc, C_doc = doc_generations, doc_completion_tokens
completion_ids = torch.randint(0, len(doc_tok), (G_doc, C_doc), generator=torch.Generator().manual_seed(seed)).to(device)


def completion_logps(hidden):
    """(G, C) log-probs of the completion tokens from the (G, C, H) hidden states that predict them."""
    logits = doc_model.get_output_embeddings()(hidden).float()
    return torch.log_softmax(logits, -1).gather(-1, completion_ids.unsqueeze(-1)).squeeze(-1)


def timed(fn):
    if device == "cuda":
        torch.cuda.synchronize()
    t = time.perf_counter()
    out = fn()
    if device == "cuda":
        torch.cuda.synchronize()
    return out, time.perf_counter() - t


with torch.no_grad():
    shared_group_hidden(doc_model, prompt_ids[:64], completion_ids[:, :8])  # warm-up
    rows = torch.cat([prompt_ids.expand(G_doc, -1), completion_ids], dim=1)
    unshared, unshared_s = timed(lambda: last_hidden(decoder_body(doc_model)(input_ids=rows))[:, -C_doc - 1:-1])
    shared, shared_s = timed(lambda: shared_group_hidden(doc_model, prompt_ids, completion_ids))
    gap = (completion_logps(unshared) - completion_logps(shared)).abs().max().item()
P_doc = len(prompt_ids)
tokens = {"every row its prompt": G_doc * (P_doc + C_doc), "prompt once": P_doc + G_doc * C_doc}
seconds = {"every row its prompt": unshared_s, "prompt once": shared_s}
print(f"prompt {P_doc:,} tokens, {G_doc} completions of {C_doc}: tokens run {tokens['every row its prompt']:,} -> "
      f"{tokens['prompt once']:,}; {unshared_s:.2f} s -> {shared_s:.2f} s ({unshared_s / shared_s:.1f}x) on {device}; "
      f"largest |log-prob difference| {gap:.1e}")
fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 2.6))
for ax, values, label in ((a1, tokens, "tokens through the model"), (a2, seconds, f"seconds on {device}")):
    ax.barh(list(values), list(values.values()), color=["C1", "k"], alpha=0.8)
    ax.set_xlabel(label)
    ax.invert_yaxis()
    ax.grid(alpha=0.3, axis="x")
a1.set_title(f"One group's scoring pass: {G_doc} x ({P_doc:,} + {C_doc}) tokens, the embedded model", fontsize=9)
fig.tight_layout()
plt.show()

# %% [markdown]
# ## Does it fit? The calculator against this GPU
# The calculator's estimate for the config as it will train (`grpo_kit.memory.fit.require_fit`) against the
# detected GPU's memory (`gpu_gib` without one): the full setup stops here with the numbers and what to change
# when it would not fit, instead of running out of memory later; `preset = "free_t4"` picks a context that fits.

# %%
from grpo_kit.memory.fit import config_fit, require_fit

if run.name == "full":  # the config as it will train; stops with the numbers when it would not fit
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
# config's field of that name. The fallback uses none of them: on the CPU it trains the embedded model on level-0
# long documents (prompts up to 1,280 tokens, completions up to 32, no checkpointing, `prefix_sharing=True`: the
# run's summary counts the rows scored with their group's prompt once). The measured memory printed after the run is not the
# calculator's quantity on the CPU: it is the process's peak RSS over the whole run (Python, torch, transformers, TRL
# and, with vLLM's CPU engine, its KV cache), where the calculator prices one training step. On a GPU
# the measured figure is the allocator's peak.

# %%
from grpo_kit.notebook.dashboard import LiveDashboard
from grpo_kit.app.run import train

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
for row in before_after(summary["run_dir"], questions, device=device, dtype=dtype,
                        max_new_tokens=cfg.max_completion_length):  # the run's own completion budget
    question = row["question"] if len(row["question"]) < 400 else "..." + row["question"][-300:]  # a document's end
    print(f"Q: {question}\n  before: {row['before']!r}\n  after:  {row['after']!r}")

# %% [markdown]
# ## Merged 16-bit weights, and the Hub
# `save_merged` folds the adapter into the base weights and writes a plain `transformers` checkpoint (it refuses
# a non-empty folder unless `overwrite=True`, which moves the old one aside). Set `hub_repo` (`user/name`, with a
# token from `huggingface-cli login` or `HF_TOKEN`) to upload it.

# %%
from grpo_kit.app.export import push_to_hub, save_merged

if save_merged_weights:
    merged = save_merged(summary["run_dir"], f"{summary['run_dir']}-merged", dtype=dtype, device=device, overwrite=True)
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
