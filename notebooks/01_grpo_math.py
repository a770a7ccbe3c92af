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
# # 01 · The GRPO objective, step by step
#
# GRPO (DeepSeekMath, Shao et al. 2024) samples a *group* of G completions per prompt, scores each with a
# reward, and uses the reward relative to the group as the advantage: no value network.
#
# $$\mathcal{L} = -\frac{1}{G}\sum_i \frac{1}{|o_i|}\sum_t \Big[\min\big(r_{i,t}\hat A_i,\ \mathrm{clip}(r_{i,t},1-\varepsilon,1+\varepsilon)\hat A_i\big) - \beta\, \mathbb{D}_{KL}\Big],\quad r_{i,t}=\frac{\pi_\theta(o_{i,t})}{\pi_{\theta_{old}}(o_{i,t})}$$
#
# Every formula below is computed by `grpo_kit` (`grpo_kit.loss.efficient`, `grpo_kit.notebook.helpers`); the notebook
# only calls it and prints. Cells whose printed output is checked in CI are tagged `nbval-check-output`.
#
# **Runtime:** CPU (Colab: Runtime > Change runtime type > CPU). Measured: 8 s for the whole notebook
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
model = "tiny-llama"  # any built-in or hub model; its final hidden states feed the gradient check
num_generations = 4  # group size G
completion_length = 6  # tokens per completion in the experiments
seed = 0

# %%
from grpo_kit.notebook.helpers import validate_params

cfg = validate_params(dict(model=model, num_generations=num_generations, max_completion_length=completion_length,
                           per_device_train_batch_size=num_generations, seed=seed))
print(f"model={cfg.model}  G={cfg.num_generations}  T={cfg.max_completion_length}")

# %% [markdown]
# ## 1. Group advantages
# Each reward minus its group's mean, divided by the group's std (+1e-4, so an all-equal group gives 0 and
# contributes no gradient: the "loss is 0 at the start" effect when every completion is wrong).

# %% tags=["nbval-check-output"]
import torch

from grpo_kit.loss.advantage import group_advantages

rewards = torch.tensor([1.0, 0.0, 0.0, 0.0,   1.0, 1.0, 0.0, 0.0,   0.0, 0.0, 0.0, 0.0])
for scale in ("group", "batch", "none"):
    print(f"{scale:>5}:", [round(a, 3) for a in group_advantages(rewards, 4, scale).tolist()])

# %% [markdown]
# ## 2. Why `exp(logp − logp.detach())`
# On-policy (one optimisation pass) the old policy *is* the current one, so the ratio is exactly 1 in value.
# Its gradient is still `ratio · ∇logp = ∇logp`, so the policy term's gradient is `−A · ∇logp`: REINFORCE
# with group advantages. Drop the detach (use `logp` itself as the old log-prob) and the ratio is the constant
# `exp(0)`: the policy gradient vanishes.

# %% tags=["nbval-check-output"]
from grpo_kit.loss.reference import grpo_loss_reference

torch.manual_seed(seed)
G, T = num_generations, completion_length
logp = (-torch.rand(G, T, dtype=torch.float64) * 3).requires_grad_()
adv = group_advantages(torch.tensor([1.0, 0.0, 0.0, 1.0][:G] + [0.0] * max(0, G - 4), dtype=torch.float64), G)
mask = torch.ones(G, T)
kw = dict(beta=0.0, epsilon_low=0.2, epsilon_high=0.2, loss_type="grpo")

loss_detached, _ = grpo_loss_reference(logp, None, None, adv, mask, **kw)  # old = logp.detach()
g_detached, = torch.autograd.grad(loss_detached, logp)
loss_no_detach, _ = grpo_loss_reference(logp, logp, None, adv, mask, **kw)  # old = logp, not detached
g_no_detach, = torch.autograd.grad(loss_no_detach, logp)
expected = -adv[:, None] * mask / (G * T)  # -A / (G * |o|) per token for loss_type="grpo"
print("loss value with / without detach:", round(loss_detached.item(), 6), round(loss_no_detach.item(), 6))
print("gradient with detach == -A/(G|o|):", torch.allclose(g_detached, expected))
print("max |gradient| without detach:", g_no_detach.abs().max().item())

# %% [markdown]
# ## 3. The KL term: k3, reverse vs forward
# GRPO penalises KL(π_θ ‖ π_ref) (reverse KL: mode-seeking, measured under the policy's own samples) with
# Schulman's k3 estimator `r − 1 − log r`, `r = π_ref/π_θ` at the sampled token: unbiased, and never negative
# per token (k1 = −log r is unbiased but noisy and can be negative). The estimators below are averaged over
# samples from π_θ and compared with the exact KLs of two random categorical distributions.

# %% tags=["nbval-check-output"]
from grpo_kit.notebook.helpers import exact_kl, kl_estimates

gen = torch.Generator().manual_seed(seed)
policy_logits = torch.randn(50, generator=gen, dtype=torch.float64)
ref_logits = policy_logits + 0.5 * torch.randn(50, generator=gen, dtype=torch.float64)
tokens = torch.multinomial(policy_logits.softmax(-1), 200_000, replacement=True, generator=gen)
est = kl_estimates(policy_logits.log_softmax(-1)[tokens], ref_logits.log_softmax(-1)[tokens])
print(f"exact reverse KL(pi||ref) = {exact_kl(policy_logits, ref_logits).item():.3f}")
print(f"exact forward KL(ref||pi) = {exact_kl(ref_logits, policy_logits).item():.3f}")
for name, v in est.items():
    print(f"{name}: mean {v.mean().item():.3f}  std {v.std().item():.3f}  min {v.min().item():+.3f}")

# %% [markdown]
# ## 4. Loss types and sequence length
# The per-token losses are summed with weights that depend on `loss_type` (`grpo_kit.loss.objective.token_weights`).
# Two completions, 2 and 6 tokens long: `grpo` averages within each sequence first (a short sequence's
# tokens weigh 3x more), `bnpo`/`dapo` average over all tokens of the batch, `dr_grpo` divides by the
# constant `G × max_completion_length` (no length bias).

# %% tags=["nbval-check-output"]
from grpo_kit.loss.objective import token_weights

mask2 = torch.tensor([[1, 1, 0, 0, 0, 0], [1, 1, 1, 1, 1, 1]])
for lt in ("grpo", "bnpo", "dr_grpo", "dapo"):
    w = token_weights(mask2, lt, max_completion_length=6, num_items_in_batch=int(mask2.sum()))
    print(f"{lt:>8}: per-token weight short={w[0, 0].item():.4f} long={w[1, 0].item():.4f}  "
          f"total short={w[0].sum().item():.3f} long={w[1].sum().item():.3f}")

# %% [markdown]
# ## 5. Gradient check: the efficient loss against the reference in fp64
# `efficient_grpo_loss` never builds the (B, T, V) logits; it computes the gradient w.r.t. the hidden states
# chunk by chunk inside its forward. Here hidden states from the model's body (fp64) go through both paths,
# with clipping active (old log-probs perturbed) and β > 0.

# %% tags=["nbval-check-output"]
from grpo_kit.loss.efficient import efficient_grpo_loss
from grpo_kit.model.loading import build_random_model, load_model, BUILTIN_MODELS

if BUILTIN_MODELS.get(cfg.model) is not None and BUILTIN_MODELS[cfg.model].kind in ("tiny", "config-only"):
    net = build_random_model(cfg.model, dtype=torch.float64, seed=seed)
else:
    net, _ = load_model(cfg.model, dtype=torch.float64)
torch.manual_seed(seed)
ids = torch.randint(0, net.config.vocab_size, (G, T + 1))
with torch.no_grad():
    hidden = net.model(input_ids=ids).last_hidden_state[:, :-1]  # position t predicts ids[:, t + 1]
targets, W = ids[:, 1:], net.lm_head.weight.detach()
cmask = torch.ones(G, T)
cmask[0, T // 2:] = 0  # one shorter completion
with torch.no_grad():
    full_logp = torch.log_softmax(hidden @ W.T, -1).gather(-1, targets[..., None])[..., 0]
old = full_logp + 0.3 * torch.randn(G, T, dtype=torch.float64)
ref = full_logp + 0.1 * torch.randn(G, T, dtype=torch.float64)
kw = dict(beta=0.04, epsilon_low=0.2, epsilon_high=0.28)

h_ref = hidden.clone().requires_grad_()
logp_ref = torch.log_softmax(h_ref @ W.T, -1).gather(-1, targets[..., None])[..., 0]
loss_ref, _ = grpo_loss_reference(logp_ref, old, ref, adv, cmask, loss_type="dapo",
                                  num_items_in_batch=int(cmask.sum()), **kw)
loss_ref.backward()
h_eff = hidden.clone().requires_grad_()
loss_eff, _ = efficient_grpo_loss(h_eff, W, targets, cmask, adv, old_logps=old, ref_logps=ref, loss_type="dapo",
                                  num_items_in_batch=int(cmask.sum()), chunk_size=5, **kw)
loss_eff.backward()
# The efficient path does its log-softmax in fp32 (as on the GPU), so agreement is to fp32 precision.
rel = lambda a, b: ((a.double() - b).abs().max() / b.abs().max()).item()
print("loss equal (rel 1e-5):", rel(loss_eff, loss_ref) < 1e-5)
print("hidden-state gradient equal (rel 1e-5 of its max):", rel(h_eff.grad, h_ref.grad) < 1e-5)
print("gradient is nonzero:", bool(h_ref.grad.abs().max() > 0))
