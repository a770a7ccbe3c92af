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
# # 02 · Where GRPO's memory goes: the calculator, a measurement, the GPU benchmarks
#
# `grpo_kit.memory.estimate` prices one GRPO step component by component (weights, LoRA and optimizer state,
# layer checkpoints, the loss's logits, the vLLM KV cache) from the architecture alone; every byte count has
# its derivation in `grpo_kit/memory/formulas.py`.
#
# **Runtime:** CPU (Colab: Runtime > Change runtime type > CPU). The outputs below are a real run with the
# parameters as they stand: 59 s for the whole notebook on a 2-core CPU with no GPU, shared with other jobs (load average about 10)
# (`python tests/test_notebooks.py --refresh 02_vram_profiling`); the benchmark pictures read the committed GPU
# measurements, nothing of them runs here.

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
model = "llama-3.1-8b"  # built-in architecture (no weights are loaded)
context_length = 20480
num_generations = 8
lora_rank = 16
four_bit = False
fp8_kv_cache = False
measure_model = "tiny-llama"  # small model measured on this machine
measure_lengths = [64, 256]  # completion lengths for the measurement
dashboard = "auto"  # "auto": widgets when a front end is attached; "static": figures only

# %%
from grpo_kit.app.console import quiet_console

quiet_console()  # first: what the imports below would warn becomes the kit's one line, or nothing
from grpo_kit.notebook.dashboard import widget_frontend_available
from grpo_kit.model.loading import BUILTIN_MODELS
from grpo_kit.notebook.helpers import validate_params

validate_params(dict(model=model, num_generations=num_generations, per_device_train_batch_size=num_generations,
                     lora_rank=lora_rank),
                dict(context_length=context_length, four_bit=four_bit, fp8_kv_cache=fp8_kv_cache,
                     measure_model=measure_model, measure_lengths=measure_lengths, dashboard=dashboard),
                dict(context_length=int, four_bit=bool, fp8_kv_cache=bool, measure_model=str, measure_lengths=list,
                     dashboard=str))
validate_params(dict(model=measure_model))
if dashboard not in ("auto", "widgets", "static"):
    raise ValueError(f"dashboard={dashboard!r} is not allowed; choose one of ['auto', 'widgets', 'static']")
if not measure_lengths or not all(isinstance(n, int) and n > 0 for n in measure_lengths):
    raise ValueError(f"measure_lengths={measure_lengths!r} must be a non-empty list of positive ints")
use_widgets = dashboard == "widgets" or (dashboard == "auto" and widget_frontend_available())
print(f"model={model} context={context_length} G={num_generations} widgets={use_widgets}")

# %% [markdown]
# ## 1. The published table, reproduced
# Unsloth's published Llama-3.1-8B table at 20K context, 8 generations, beside the kit's derivation of each
# figure (`published_table`; `exact` = the derivation rounds to the published number).

# %% tags=["nbval-check-output"]
import pandas as pd

from grpo_kit.memory import published_table

pd.set_option("display.width", 200)
print(published_table("llama-3.1-8b").drop(columns=["derivation"]).to_string(index=False))

# %% [markdown]
# ## 2. The three designs at the chosen settings (GiB)
# `trl`: full logits, standard checkpointing, a second weight copy for vLLM; `unsloth`: one sequence of logits
# at a time, offloaded checkpoints, shared weights; `grpo_kit`: chunked loss, offloaded and chunked recompute.

# %% tags=["nbval-check-output"]
from grpo_kit.memory import EstimateSpec, compare

spec = EstimateSpec(num_generations=num_generations, prompt_length=0, completion_length=context_length,
                    lora_rank=lora_rank, quantization="4bit" if four_bit else None,
                    kv_cache_dtype="fp8" if fp8_kv_cache else None)
print(compare(model, spec, unit="GiB").round(2).to_string())

# %% [markdown]
# ## 3. Explore: model, context (log scale), generations, LoRA rank, 4-bit, FP8 KV
# With a widget front end the controls redraw the stacked bars; without one (papermill, CI) the chart for the
# parameters above is drawn once.

# %%
from dataclasses import replace

import matplotlib.pyplot as plt

from grpo_kit.memory import EstimateSpec, estimate, plot_components
from grpo_kit.notebook.helpers import show_figure


def draw(model, log2_context, num_generations, lora_rank, four_bit, fp8_kv):
    spec = EstimateSpec(num_generations=num_generations, prompt_length=0, completion_length=int(2 ** log2_context),
                        lora_rank=lora_rank, quantization="4bit" if four_bit else None,
                        kv_cache_dtype="fp8" if fp8_kv else None)
    fig = plot_components({m: estimate(model, replace(spec, method=m)) for m in ("trl", "unsloth", "grpo_kit")},
                          budget_gib=80,
                          title=f"Estimated GPU memory of one GRPO step: {model}, {int(2 ** log2_context)} tokens "
                                f"x {num_generations} generations")
    show_figure(fig)  # a bare matplotlib Figure: plt.show() would not draw it


config_only = [n for n, s in BUILTIN_MODELS.items() if s.kind == "config-only"]
if use_widgets:
    import math

    import ipywidgets as w

    w.interact(draw, model=w.Dropdown(options=config_only, value=model if model in config_only else config_only[0]),
               log2_context=w.FloatSlider(value=math.log2(context_length), min=10, max=17, step=0.25,
                                          description="log2 context"),
               num_generations=w.IntSlider(value=num_generations, min=2, max=16),
               lora_rank=w.IntSlider(value=lora_rank, min=4, max=128, step=4),
               four_bit=w.Checkbox(value=four_bit), fp8_kv=w.Checkbox(value=fp8_kv_cache))
else:
    import math

    draw(model, math.log2(context_length), num_generations, lora_rank, four_bit, fp8_kv_cache)

# %% [markdown]
# ## 4. Measured on this device: the loss's extra memory, naive vs efficient
# The naive loss materialises the (B, T, V) logits in fp32 (TRL style); the kit's works one chunk of rows at a
# time. The estimate column is the naive logits' size from the calculator's own formula. CPU numbers are the
# process's resident-set growth (coarse); on a GPU, CUDA allocator peaks.

# %%
import torch

from grpo_kit.loss.efficient import efficient_grpo_loss
from grpo_kit.memory import profile
from grpo_kit.memory.formulas import logits_bytes
from grpo_kit.model.loading import build_random_model

device = "cuda" if torch.cuda.is_available() else "cpu"
net = build_random_model(measure_model, device=device)
W, V = net.lm_head.weight.detach(), net.config.vocab_size


def naive(h, ids, adv):
    logp = torch.log_softmax(h @ W.T, -1).gather(-1, ids[..., None])[..., 0]
    (-(adv[:, None] * logp).mean()).backward()


def efficient(h, ids, adv):
    loss, _ = efficient_grpo_loss(h, W, ids, torch.ones_like(ids), adv)
    loss.backward()


rows = []
for T in measure_lengths:
    h = torch.randn(num_generations, T, W.shape[1], device=device, requires_grad=True)
    ids = torch.randint(0, V, (num_generations, T), device=device)
    adv = torch.randn(num_generations, device=device)
    for name, fn in (("naive", naive), ("efficient", efficient)):
        res = profile(fn, h, ids, adv, device=device)
        rows.append(dict(tokens=T, loss=name, measured_extra_GiB=res.table["peak_over_start_GiB"].iloc[0],
                         naive_logits_estimate_GiB=logits_bytes(1, num_generations, T, V, 4) / 2**30))
print(pd.DataFrame(rows).round(4).to_string(index=False))

# %% [markdown]
# ## 5. The committed GPU benchmarks (`bench/results/`), the kit beside its peers
# The loss alone on an H200 (Llama-3.1-8B's head: hidden 4096, vocabulary 128,256; 8 sequences; bf16): time and
# extra memory against completion length for a naive fp32-logits loss, Liger-Kernel, Unsloth's fused log-probs,
# Cut Cross-Entropy and the kit's, in one run; TRL 1.16's own loss in a second run. Read from `data/loss.jsonl`
# (each row's `run` names the peers' versions); nothing is typed in here. A missing point is a peer that ran out of
# memory or was not run at that length.

# %%
import matplotlib.pyplot as plt

from grpo_kit.notebook.helpers import PEER_LABELS, bench_rows, line_style

loss_df = bench_rows("loss")
if loss_df is None:
    print("bench/results/data/loss.jsonl is not available (the kit was installed without its checkout)")
else:
    # a later run of a (row, length) replaces an earlier one
    ldf = loss_df.sort_values("date").drop_duplicates(["head", "row", "T"], keep="last")
    ldf = ldf[(ldf["head"] == "llama") & (ldf["status"] == "ok")
              & ldf["row"].isin(["naive", "liger", "unsloth", "cce", "trl", "ours"])]
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(12, 4.2))
    for row, g in ldf.groupby("row"):
        g = g.sort_values("T")
        a1.plot(g["T"], g["ms"], label=PEER_LABELS[row], **line_style(row))
        a2.plot(g["T"], g["extra_gib"], label=PEER_LABELS[row], **line_style(row))
    a1.set_title("Loss forward + backward time, Llama-3.1-8B head, 8 sequences (H200)", fontsize=9)
    a2.set_title("Loss extra GPU memory over its inputs, same runs (H200)", fontsize=9)
    for ax, ylabel in ((a1, "time per forward + backward (ms)"), (a2, "extra peak memory (GiB)")):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("completion length per sequence (tokens)")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    plt.show()
    print(ldf.assign(impl=ldf["row"].map(PEER_LABELS)).pivot_table(index="T", columns="impl",
                                                                    values="extra_gib").round(2).to_string())

# %% [markdown]
# The whole training step (no generation) for Llama-3.1-8B, LoRA rank 16, one sequence per micro-batch, on an
# H200: peak allocated GPU memory against tokens per sequence, from `data/step.jsonl`. The TRL-style row is
# `bench/step.py`'s baseline (HF gradient checkpointing, the full fp32 logits, as TRL 1.16 computes them).

# %%
step_df = bench_rows("step")
if step_df is not None:
    one = step_df[(step_df["model"] == "llama-3.1-8b") & (step_df["gens"] == 1) & (step_df["status"] == "ok")
                  & (step_df["dtype"] == "")]
    fig, ax = plt.subplots(figsize=(7.5, 4.2))
    for row, g in one.groupby("row"):
        g = g.sort_values("seq_len").drop_duplicates("seq_len", keep="last")
        ax.plot(g["seq_len"], g["peak_allocated_gib"], label=PEER_LABELS[row], **line_style(row))
    ax.set_xscale("log", base=2)
    ax.set_xlabel("tokens per sequence")
    ax.set_ylabel("peak allocated GPU memory (GiB)")
    ax.set_title("Training step peak memory, Llama-3.1-8B, LoRA r=16, bf16, 1 sequence (H200)", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    plt.show()
    print(one.assign(impl=one["row"].map(PEER_LABELS)).pivot_table(
        index="seq_len", columns="impl", values="peak_allocated_gib").round(2).to_string())
