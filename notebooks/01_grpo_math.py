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
# **Runtime:** CPU (Colab: Runtime > Change runtime type > CPU). The outputs below are a real run with the
# parameters as they stand: 31 s for the whole notebook on a 2-core CPU with no GPU, shared with other jobs (load average about 10)
# (`python tests/test_notebooks.py --refresh 01_grpo_math`).

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
# ### The detached ratio's value and gradient, as a picture
# Over a range of log π_θ, the ratio with the detach (`exp(logp − logp.detach())`) and without it (`exp(logp − logp)`):
# both have the value 1 everywhere; only the detached one has the gradient `r = 1`, the one REINFORCE needs.

# %%
import matplotlib.pyplot as plt

lps = torch.linspace(-6, 0, 61, dtype=torch.float64).requires_grad_()
ratio_detached = torch.exp(lps - lps.detach())
ratio_plain = torch.exp(lps - lps)
d_detached, = torch.autograd.grad(ratio_detached.sum(), lps)
d_plain, = torch.autograd.grad(ratio_plain.sum(), lps, allow_unused=True)
d_plain = torch.zeros_like(lps) if d_plain is None else d_plain
fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 3.4))
x = lps.detach()
a1.plot(x, ratio_detached.detach(), color="C0", linewidth=3, label="exp(logp − logp.detach())")
a1.plot(x, ratio_plain.detach(), color="C1", linestyle="--", label="exp(logp − logp)")
a1.set_title("Ratio value on-policy: 1 with or without the detach", fontsize=9)
a2.plot(x, d_detached, color="C0", linewidth=3, label="with detach: d r / d logp = r = 1")
a2.plot(x, d_plain, color="C1", linestyle="--", label="without: 0, no policy gradient")
a2.set_title("Ratio gradient w.r.t. log π_θ", fontsize=9)
for ax, ylabel in ((a1, "ratio r (unitless)"), (a2, "d r / d log π_θ (unitless)")):
    ax.set_xlabel("log π_θ of the sampled token (nats)")
    ax.set_ylabel(ylabel)
    ax.set_ylim(-0.2, 1.3)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
fig.tight_layout()
plt.show()

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
# ### k3 against the exact reverse KL, as a picture
# Left: each estimator per token as a function of log r = log π_ref − log π_θ (k3 is never negative, k1 is).
# Right: the exact KL(π_θ ‖ π_ref) of the two categoricals above as the reference moves further from the policy
# (its logits plus s × noise), against the sample mean of k3 and k1 over 20,000 tokens drawn from π_θ (±1 standard
# deviation of a single token's value shaded for k3).

# %%
import matplotlib.pyplot as plt

log_r = torch.linspace(-3, 3, 301, dtype=torch.float64)
per_token = kl_estimates(torch.zeros_like(log_r), log_r)
scales = torch.linspace(0.0, 2.0, 11, dtype=torch.float64)
noise = torch.randn(50, generator=gen, dtype=torch.float64)
exact, k3_mean, k3_std, k1_mean = [], [], [], []
for s in scales:
    ref_s = policy_logits + s * noise
    toks = torch.multinomial(policy_logits.softmax(-1), 20_000, replacement=True, generator=gen)
    e = kl_estimates(policy_logits.log_softmax(-1)[toks], ref_s.log_softmax(-1)[toks])
    exact.append(exact_kl(policy_logits, ref_s).item())
    k3_mean.append(e["k3"].mean().item())
    k3_std.append(e["k3"].std().item())
    k1_mean.append(e["k1"].mean().item())
fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 3.8))
for name, style in (("k1", ":"), ("k2", "--"), ("k3", "-")):
    a1.plot(log_r, per_token[name], linestyle=style, linewidth=2.5 if name == "k3" else 1.5, label=name)
a1.axhline(0, color="0.5", linewidth=0.8)
a1.set_title("Per-token KL estimators", fontsize=9)
a1.set_xlabel("log r = log π_ref − log π_θ (nats)")
a1.set_ylabel("estimate (nats)")
a2.plot(scales, exact, color="k", linewidth=2, label="exact reverse KL(π_θ ‖ π_ref)")
a2.plot(scales, k3_mean, "o", color="C2", label="k3, sample mean")
a2.fill_between(scales, [m - d for m, d in zip(k3_mean, k3_std)], [m + d for m, d in zip(k3_mean, k3_std)],
                color="C2", alpha=0.15, label="k3, ±1 std of one token")
a2.plot(scales, k1_mean, "x", color="C0", label="k1, sample mean")
a2.set_title("k3's mean against the exact reverse KL (50-token vocabulary)", fontsize=9)
a2.set_xlabel("reference's distance s (logit noise scale, unitless)")
a2.set_ylabel("KL (nats)")
for ax in (a1, a2):
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
fig.tight_layout()
plt.show()

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
# ### The clipped objective's regions, as a picture
# One token's objective `min(r·A, clip(r, 1−ε_low, 1+ε_high)·A)` against the ratio r, computed by
# `grpo_loss_reference` (its value, and its gradient with respect to log π_θ by autograd), for a positive and a negative
# advantage. In the shaded regions the clip is active: the value is flat and the gradient is exactly 0, so a token
# that already moved far enough in the advantage's direction stops pulling.

# %%
import matplotlib.pyplot as plt

eps_low, eps_high = 0.2, 0.28
r = torch.linspace(0.5, 1.6, 441, dtype=torch.float64)
fig, axes = plt.subplots(1, 2, figsize=(11, 3.8))
for ax, a in zip(axes, (1.0, -1.0)):
    lp = r.log()[:, None].clone().requires_grad_()  # log pi_theta; the old log-prob is 0, so r = exp(lp)
    loss, _ = grpo_loss_reference(lp, torch.zeros_like(lp), None, torch.full((len(r),), a, dtype=torch.float64),
                                  torch.ones_like(lp), beta=0.0, epsilon_low=eps_low, epsilon_high=eps_high,
                                  loss_type="grpo")
    grad, = torch.autograd.grad(loss, lp)
    slope = (-grad[:, 0] * len(r)).numpy()  # d objective / d log pi_theta per token (grpo: the mean over rows)
    ax.plot(r, [min(x * a, min(max(x, 1 - eps_low), 1 + eps_high) * a) for x in r.tolist()], color="C0",
            linewidth=2, label="objective value (per token)")
    ax.plot(r, slope, color="C3", linestyle="--", label="gradient w.r.t. log π_θ")
    flat = slope == 0
    ax.fill_between(r, 0, 1, where=flat, color="0.85", transform=ax.get_xaxis_transform(),
                    label="clipped: zero gradient")
    ax.axvline(1 - eps_low, color="0.5", linewidth=0.8)
    ax.axvline(1 + eps_high, color="0.5", linewidth=0.8)
    ax.set_title(f"Clipped surrogate, advantage A = {a:+.0f} (ε_low {eps_low}, ε_high {eps_high})", fontsize=9)
    ax.set_xlabel("ratio r = π_θ / π_old (unitless)")
    ax.set_ylabel("objective, gradient (unitless)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
fig.tight_layout()
plt.show()

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
