"""Parity and behaviour tests for grpo_kit.loss.efficient (CPU, small sizes: V=257, H=48, odd T).

Oracles: an fp64 full-logits computation fed to ``grpo_loss_reference``; TRL 1.16's own
``GRPOTrainer._compute_loss`` on the same per-token log-probs; a TRL-style bf16 naive loss.
"""

import math
import types
from collections import defaultdict

import pytest
import torch
from _objective_settings import SETTINGS, loss_kwargs

from grpo_kit.loss.efficient import efficient_grpo_loss, per_token_logps
from grpo_kit.loss.objective import LOSS_TYPES
from grpo_kit.loss.reference import grpo_loss_reference

B, T, H, V = 3, 13, 48, 257
LENGTH_KW = dict(max_completion_length=17, num_items_in_batch=29)


def rel(a, b):
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp(min=1e-300))


def make_case(seed, dtype=torch.float32, masked_row=True, bias=True):
    g = torch.Generator().manual_seed(seed)
    h = (torch.randn(B, T, H, generator=g) * 1.5).to(dtype)
    W = (torch.randn(V, H, generator=g) * H**-0.5 * 2).to(dtype)
    b = (torch.randn(V, generator=g) * 0.3).to(dtype) if bias else None
    ids = torch.randint(0, V, (B, T), generator=g)
    mask = torch.rand(B, T, generator=g) > 0.3
    mask[0, 0] = True
    if masked_row:
        mask[1] = False  # a fully masked completion
    adv = torch.randn(B, generator=g)
    noise = torch.randn(2, B, T, generator=g) * 0.3
    return dict(h=h, W=W, b=b, ids=ids, mask=mask, adv=adv, noise=noise)


def fp64_logps(h, W, b, ids, temperature):
    z = h.double() @ W.double().t()
    if b is not None:
        z = z + b.double()
    return torch.log_softmax(z / temperature, -1).gather(-1, ids.unsqueeze(-1)).squeeze(-1)


def loss_scale(lp64, old, ref, c, kw, isw=None):
    """sum_t w_t |per-token loss_t| in fp64: the loss's magnitude before the terms of both signs
    cancel. Relative error is measured against it, since a sum that cancels to ~0 has no relative
    precision in any dtype."""
    from grpo_kit.loss.checks import objective_spec
    from grpo_kit.loss.objective import per_token_objective, token_weights

    opts = {
        k: v
        for k, v in kw.items()
        if k not in ("beta", "epsilon_low", "epsilon_high", "loss_type", "max_completion_length", "num_items_in_batch")
    }
    opts.pop("top_entropy_quantile", None)  # the magnitude over all tokens bounds the masked one
    spec = objective_spec(kw["loss_type"], kw["beta"], kw["epsilon_low"], kw["epsilon_high"], opts)
    m = c["mask"].double()
    lp = lp64.detach()

    def fill(x):
        return None if x is None else torch.where(c["mask"], x.double(), lp)

    isw = (
        None
        if isw is None
        else torch.where(c["mask"].any(-1, keepdim=True) if isw.shape[-1] == 1 else c["mask"], isw.double(), 1.0)
    )
    pt, _ = per_token_objective(lp, fill(old), fill(ref), c["adv"].double()[:, None], m, spec, importance_weights=isw)
    w = token_weights(
        c["mask"], kw["loss_type"], kw.get("max_completion_length"), kw.get("num_items_in_batch"), dtype=torch.float64
    )
    return float((w * pt.abs()).sum())


# ------------------------------------------------------------------------------------------------
# efficient vs fp64 naive full logits (fp32: 1e-5 relative)
# ------------------------------------------------------------------------------------------------
def fp64_entropy(h, W, b, temperature):
    z = h.double() @ W.double().t()
    if b is not None:
        z = z + b.double()
    lp = torch.log_softmax(z / temperature, -1)
    return -(lp.exp() * lp).sum(-1)


@pytest.mark.parametrize("setting", list(SETTINGS))
@pytest.mark.parametrize("with_old", [False, True])
def test_efficient_matches_fp64_naive_fp32(setting, with_old):
    """Every objective setting: loss, gradients w.r.t. hidden, head weight and bias, metrics."""
    c = make_case(list(SETTINGS).index(setting) * 2 + with_old)
    temperature = 0.7
    h64, W64, b64 = (x.double().requires_grad_() for x in (c["h"], c["W"], c["b"]))
    lp64 = fp64_logps(h64, W64, b64, c["ids"], temperature)
    ent64 = fp64_entropy(h64.detach(), W64.detach(), b64.detach(), temperature)
    old = (lp64.detach() + c["noise"][0]).float() if with_old else None
    ref = (lp64.detach() + c["noise"][1]).float()
    kw = dict(loss_kwargs(setting), **LENGTH_KW)
    l64, m64 = grpo_loss_reference(
        lp64, None if old is None else old.double(), ref.double(), c["adv"].double(), c["mask"], entropy=ent64, **kw
    )
    l64.backward()

    h, W, b = (x.clone().requires_grad_() for x in (c["h"], c["W"], c["b"]))
    loss, m = efficient_grpo_loss(
        h,
        W,
        c["ids"],
        c["mask"],
        c["adv"],
        old_logps=old,
        ref_logps=ref,
        temperature=temperature,
        chunk_size=5,
        lm_head_bias=b,
        compute_entropy=True,
        **kw,
    )
    loss.backward()
    assert loss.dtype == torch.float32 and loss.dim() == 0
    assert abs(loss.item() - l64.item()) <= 1e-5 * loss_scale(lp64, old, ref, c, kw)
    assert h64.grad.abs().max() > 0
    for got, want in ((h.grad, h64.grad), (W.grad, W64.grad), (b.grad, b64.grad)):
        assert rel(got, want) < 1e-5
    assert h.grad[1].abs().max() == 0  # fully masked completion: no gradient
    assert set(m) == set(m64)
    for k in m:
        assert abs(m[k].item() - m64[k].item()) < 1e-5 or (math.isnan(m[k].item()) and math.isnan(m64[k].item())), k


def test_clipping_is_exercised():
    """The parity cases above must include clipped tokens, or the clip branch is untested."""
    c = make_case(3)
    lp = fp64_logps(c["h"], c["W"], c["b"], c["ids"], 1.0).float()
    _, m = grpo_loss_reference(
        lp,
        lp + c["noise"][0],
        None,
        c["adv"],
        c["mask"],
        beta=0.0,
        epsilon_low=0.2,
        epsilon_high=0.28,
        loss_type="grpo",
    )
    assert m["clip_ratio/low_mean"] > 0 and m["clip_ratio/high_mean"] > 0


def _sampling_logps(lp, c):
    """The sampler's log-probs of a case (what the off-policy mask reads)."""
    return lp + 0.5 * c["noise"][0].flip(0).abs()  # above the policy: a positive KL(sampler || policy) estimate


def test_off_policy_mask_is_exercised():
    """The off-policy setting must drop a sequence in the parity cases (with old log-probs), or it is untested."""
    from grpo_kit.loss.objective import off_policy_sequence_mask

    for seed, sampler in (
        (22, _sampling_logps),
        (list(SETTINGS).index("off_policy_mask") * 2 + 1, lambda lp, c: lp + c["noise"][0]),
    ):  # TRL case; fp64: old
        c = make_case(seed)
        lp = fp64_logps(c["h"], c["W"], c["b"], c["ids"], 1.0).float()
        keep = off_policy_sequence_mask(
            lp,
            sampler(lp, c),
            c["adv"][:, None],
            c["mask"].float(),
            SETTINGS["off_policy_mask"]["off_policy_mask_threshold"],
        )
        assert 0 < keep.sum() < B, (seed, keep)


def test_efficient_equals_reference_on_its_own_logps():
    """Same loss and metrics as the reference fed with per_token_logps (fp32, temperature != 1)."""
    c = make_case(11)
    lp = per_token_logps(c["h"], c["W"], c["ids"], temperature=1.3, chunk_size=4, lm_head_bias=c["b"])
    old, ref = lp + c["noise"][0], lp + c["noise"][1]
    kw = dict(beta=0.1, epsilon_low=0.2, epsilon_high=None, loss_type="bnpo")
    lr, mr = grpo_loss_reference(lp, old, ref, c["adv"], c["mask"], **kw)
    le, me = efficient_grpo_loss(
        c["h"],
        c["W"],
        c["ids"],
        c["mask"],
        c["adv"],
        old_logps=old,
        ref_logps=ref,
        temperature=1.3,
        lm_head_bias=c["b"],
        chunk_size=7,
        **kw,
    )
    assert abs(le.item() - lr.item()) < 1e-6 * max(1.0, abs(lr.item()))
    for k in mr:
        assert abs(me[k].item() - mr[k].item()) < 1e-6, k


@pytest.mark.parametrize("chunk_size", [1, 7, None])
def test_per_token_logps_matches_fp64(chunk_size):
    c = make_case(5)
    hv = torch.randn(B, T + 4, H)[:, 2:-2]  # non-contiguous view, as a slice of a longer sequence
    hv.copy_(c["h"])
    assert not hv.is_contiguous()
    lp = per_token_logps(hv, c["W"], c["ids"], temperature=0.9, chunk_size=chunk_size, lm_head_bias=c["b"])
    want = fp64_logps(c["h"], c["W"], c["b"], c["ids"], 0.9)
    assert lp.dtype == torch.float32 and lp.shape == (B, T) and not lp.requires_grad
    assert rel(lp, want) < 1e-6


def test_noncontiguous_hidden_and_frozen_head():
    c = make_case(6, bias=False)
    full = torch.randn(B, T + 1, H)
    full[:, :-1] = c["h"]
    full.requires_grad_()
    hv = full[:, :-1]  # the usual "hidden[:, :-1] predicts the next token" slice
    loss, _ = efficient_grpo_loss(hv, c["W"], c["ids"], c["mask"], c["adv"], chunk_size=4)
    loss.backward()
    h = c["h"].clone().requires_grad_()
    loss2, _ = efficient_grpo_loss(h, c["W"], c["ids"], c["mask"], c["adv"], chunk_size=64)
    loss2.backward()
    assert torch.allclose(loss, loss2, rtol=1e-6)
    assert rel(full.grad[:, :-1], h.grad) < 1e-6 and full.grad[:, -1].abs().max() == 0
    assert c["W"].grad is None  # a frozen head gets no gradient


def test_entropy_metric_matches_fp64():
    c = make_case(7)
    _, m = efficient_grpo_loss(
        c["h"],
        c["W"],
        c["ids"],
        c["mask"],
        c["adv"],
        temperature=0.8,
        lm_head_bias=c["b"],
        compute_entropy=True,
        chunk_size=6,
    )
    z = (c["h"].double() @ c["W"].double().t() + c["b"].double()) / 0.8
    p = torch.softmax(z, -1)
    ent = -(p * torch.log_softmax(z, -1)).sum(-1)
    mask = c["mask"].double()
    assert abs(m["entropy"].item() - ((ent * mask).sum() / mask.sum()).item()) < 1e-5


def test_auto_chunk_and_no_grad_give_same_loss():
    c = make_case(8)
    l1, _ = efficient_grpo_loss(c["h"], c["W"], c["ids"], c["mask"], c["adv"], chunk_size=3)
    l2, _ = efficient_grpo_loss(c["h"], c["W"], c["ids"], c["mask"], c["adv"])
    with torch.no_grad():
        l3, _ = efficient_grpo_loss(c["h"].requires_grad_(), c["W"], c["ids"], c["mask"], c["adv"])
    assert not l3.requires_grad
    assert abs(l1.item() - l2.item()) < 1e-6 and abs(l1.item() - l3.item()) < 1e-6


# ------------------------------------------------------------------------------------------------
# TRL 1.16's own _compute_loss on the same per-token log-probs
# ------------------------------------------------------------------------------------------------
def _bare_trl_trainer(loss_type, beta, eps_low, eps_high, max_len, logps, use_vllm=False, entropies=None, **options):
    """A GRPOTrainer without __init__: just the attributes TRL's real _compute_loss reads. The
    distributed helpers are identities (one process); the model call returns our log-probs (and
    ``entropies``, zeros when None). ``use_vllm``: TRL then multiplies the policy term by
    ``inputs["importance_sampling_ratio"]``. ``options``: GRPOConfig fields of the objective."""
    from trl import GRPOConfig
    from trl.trainer.grpo_trainer import GRPOTrainer

    tr = object.__new__(GRPOTrainer)
    identity = lambda x, **kw: x  # noqa: E731
    tr.accelerator = types.SimpleNamespace(
        num_processes=1, gather=identity, reduce=identity, gather_for_metrics=identity, pad_across_processes=identity
    )
    defaults = {
        f: GRPOConfig.__dataclass_fields__[f].default
        for f in (
            "use_bias_correction_kl",
            "delta",
            "sapo_temperature_pos",
            "sapo_temperature_neg",
            "vespo_k_pos",
            "vespo_lambda_pos",
            "vespo_k_neg",
            "vespo_lambda_neg",
        )
    }
    args = {**defaults, "use_bias_correction_kl": False, "steps_per_generation": 1}
    args.update({k: v for k, v in options.items() if k in args})
    tr.args = types.SimpleNamespace(**args)
    tr.model = types.SimpleNamespace(training=True)
    tr.current_gradient_accumulation_steps = 1
    tr.aux_loss_enabled = False
    tr.top_entropy_quantile = options.get("top_entropy_quantile", 1.0)
    tr.off_policy_mask_threshold = options.get("off_policy_mask_threshold")
    tr.importance_sampling_level = options.get("importance_sampling_level", "token")
    tr.use_vllm = use_vllm
    tr.vllm_importance_sampling_correction = use_vllm
    tr._entropy_bonus_enabled = False
    tr._metrics = {"train": defaultdict(list), "eval": defaultdict(list)}
    tr.loss_type, tr.beta, tr.epsilon_low = loss_type, beta, eps_low
    tr.epsilon_high = eps_low if eps_high is None else eps_high
    tr.max_completion_length = max_len
    ent = torch.zeros_like(logps) if entropies is None else entropies
    tr._get_per_token_logps_and_entropies = lambda *a, **k: (logps, ent, None)
    return tr


def _trl_kwargs(kw):
    """(loss_type, beta, epsilon_low, epsilon_high) and the other options of a setting's kwargs."""
    kw = dict(kw)
    return [kw.pop(k) for k in ("loss_type", "beta", "epsilon_low", "epsilon_high")], kw


@pytest.mark.parametrize("setting", list(SETTINGS))
@pytest.mark.parametrize("with_old", [False, True])
def test_reference_matches_trl_compute_loss(setting, with_old):
    """TRL 1.16's real _compute_loss on the same per-token log-probs: loss, gradient, every metric it logs."""
    pytest.importorskip("trl")
    c = make_case(21 + with_old)
    lp_base = fp64_logps(c["h"], c["W"], c["b"], c["ids"], 1.0).float()
    ent = fp64_entropy(c["h"], c["W"], c["b"], 1.0).float()
    old = lp_base + c["noise"][0] if with_old else None
    ref = lp_base + c["noise"][1]
    mask = c["mask"].long()
    n_items = int(mask.sum()) + 5  # a larger accumulated batch
    sampling = _sampling_logps(lp_base, c)
    kw = loss_kwargs(setting)
    (loss_type, beta, eps_low, eps_high), options = _trl_kwargs(kw)

    lp_trl = lp_base.clone().requires_grad_()
    tr = _bare_trl_trainer(
        loss_type, beta, eps_low, eps_high, LENGTH_KW["max_completion_length"], lp_trl, entropies=ent, **options
    )
    inputs = dict(
        prompt_ids=torch.zeros(B, 1, dtype=torch.long),
        prompt_mask=torch.ones(B, 1, dtype=torch.long),
        completion_ids=c["ids"],
        completion_mask=mask,
        advantages=c["adv"],
        ref_per_token_logps=ref,
        num_items_in_batch=torch.tensor(float(n_items)),
        sampling_per_token_logps=sampling,
    )
    if old is not None:
        inputs["old_per_token_logps"] = old
    loss_trl = tr._compute_loss(None, inputs)
    loss_trl.backward()

    lp_ours = lp_base.clone().requires_grad_()
    loss, m = grpo_loss_reference(
        lp_ours,
        old,
        ref,
        c["adv"],
        mask,
        max_completion_length=LENGTH_KW["max_completion_length"],
        num_items_in_batch=n_items,
        entropy=ent,
        sampling_logps=sampling,
        **kw,
    )
    loss.backward()
    assert torch.allclose(loss, loss_trl, rtol=1e-6, atol=1e-7)
    assert torch.allclose(lp_ours.grad, lp_trl.grad, rtol=1e-6, atol=1e-9)
    assert lp_trl.grad.abs().sum() > 0
    logged = tr._metrics["train"]
    assert set(logged) <= set(m), set(logged) - set(m)
    assert ("kl" in logged) == (beta != 0)
    for k in logged:
        assert abs(logged[k][-1] - m[k].item()) < 1e-6 or (math.isnan(logged[k][-1]) and math.isnan(m[k].item())), k

    # and the efficient loss gives the same gradient w.r.t. hidden as the chain rule through TRL's
    h64, W64, b64 = (x.double().requires_grad_() for x in (c["h"], c["W"], c["b"]))
    lp64 = fp64_logps(h64, W64, b64, c["ids"], 1.0)
    lp64.backward(lp_trl.grad.double())
    h = c["h"].clone().requires_grad_()
    loss_e, _ = efficient_grpo_loss(
        h,
        c["W"],
        c["ids"],
        mask,
        c["adv"],
        old_logps=old,
        ref_logps=ref,
        lm_head_bias=c["b"],
        max_completion_length=LENGTH_KW["max_completion_length"],
        num_items_in_batch=n_items,
        chunk_size=8,
        sampling_logps=sampling,
        **kw,
    )
    loss_e.backward()
    assert abs(loss_e.item() - loss_trl.item()) < 1e-5 * max(1e-2, abs(loss_trl.item()))
    assert rel(h.grad, h64.grad) < 1e-5


# ------------------------------------------------------------------------------------------------
# importance weights (TRL's importance_sampling_ratio for generations from another engine)
# ------------------------------------------------------------------------------------------------
def _isw(c, shape, seed=0):
    """Ratios as TRL makes them: exp of a log-prob difference, some masked to 0 (token_mask mode),
    garbage (NaN) at padding, which must not matter."""
    g = torch.Generator().manual_seed(seed)
    w = torch.exp(torch.randn(shape, generator=g) * 0.3)
    w[w > 1.4] = 0.0
    if shape == (B, T):
        w = w.masked_fill(~c["mask"], float("nan"))
    return w


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
@pytest.mark.parametrize("shape", [(B, T), (B, 1)], ids=["token", "sequence"])
@pytest.mark.parametrize("beta", [0.0, 0.04])
def test_importance_weights_efficient_matches_fp64(loss_type, shape, beta):
    c = make_case(40 + LOSS_TYPES.index(loss_type))
    isw = _isw(c, shape, seed=LOSS_TYPES.index(loss_type))
    h64, W64, b64 = (x.double().requires_grad_() for x in (c["h"], c["W"], c["b"]))
    lp64 = fp64_logps(h64, W64, b64, c["ids"], 0.8)
    old = (lp64.detach() + c["noise"][0]).float()
    ref = (lp64.detach() + c["noise"][1]).float()
    kw = dict(beta=beta, epsilon_low=0.2, epsilon_high=0.28, loss_type=loss_type, **LENGTH_KW)
    l64, m64 = grpo_loss_reference(
        lp64, old.double(), ref.double(), c["adv"].double(), c["mask"], importance_weights=isw.double(), **kw
    )
    l64.backward()
    h, W, b = (x.clone().requires_grad_() for x in (c["h"], c["W"], c["b"]))
    loss, m = efficient_grpo_loss(
        h,
        W,
        c["ids"],
        c["mask"],
        c["adv"],
        old_logps=old,
        ref_logps=ref,
        temperature=0.8,
        chunk_size=5,
        lm_head_bias=b,
        importance_weights=isw,
        **kw,
    )
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(h.grad).all()
    assert abs(loss.item() - l64.item()) <= 1e-5 * loss_scale(lp64, old, ref, c, kw)
    for got, want in ((h.grad, h64.grad), (W.grad, W64.grad), (b.grad, b64.grad)):
        assert rel(got, want) < 1e-5
    for k in m:  # the metrics are those of the unweighted ratio, as TRL logs them
        assert abs(m[k].item() - m64[k].item()) < 1e-5 or (math.isnan(m[k].item()) and math.isnan(m64[k].item())), k
    # the weights change the result (else the test would prove nothing), and weights of 1 change nothing
    l_plain, _ = grpo_loss_reference(lp64.detach(), old.double(), ref.double(), c["adv"].double(), c["mask"], **kw)
    assert abs(l_plain.item() - l64.item()) > 1e-4 * loss_scale(lp64, old, ref, c, kw)
    ones = torch.ones(shape)
    l_none = efficient_grpo_loss(
        c["h"],
        c["W"],
        c["ids"],
        c["mask"],
        c["adv"],
        old_logps=old,
        ref_logps=ref,
        temperature=0.8,
        chunk_size=5,
        lm_head_bias=c["b"],
        **kw,
    )[0]
    l_ones = efficient_grpo_loss(
        c["h"],
        c["W"],
        c["ids"],
        c["mask"],
        c["adv"],
        old_logps=old,
        ref_logps=ref,
        temperature=0.8,
        chunk_size=5,
        lm_head_bias=c["b"],
        importance_weights=ones,
        **kw,
    )[0]
    assert l_none.item() == l_ones.item()


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-12), (torch.float32, 1e-6)])
def test_importance_weights_reference_matches_trl_compute_loss(dtype, tol):
    """TRL 1.16's real _compute_loss with use_vllm: loss and gradient equal the reference's."""
    pytest.importorskip("trl")
    for loss_type in LOSS_TYPES:
        c = make_case(50 + LOSS_TYPES.index(loss_type))
        lp_base = fp64_logps(c["h"], c["W"], c["b"], c["ids"], 1.0).to(dtype)
        old, ref = lp_base + c["noise"][0].to(dtype), lp_base + c["noise"][1].to(dtype)
        isw = _isw(c, (B, T), seed=7).nan_to_num(1.0).to(dtype)  # TRL's ratio is exp(0) = 1 at padding
        mask = c["mask"].long()
        n_items = int(mask.sum()) + 3
        lp_trl = lp_base.clone().requires_grad_()
        tr = _bare_trl_trainer(loss_type, 0.04, 0.2, 0.28, LENGTH_KW["max_completion_length"], lp_trl, use_vllm=True)
        inputs = dict(
            prompt_ids=torch.zeros(B, 1, dtype=torch.long),
            prompt_mask=torch.ones(B, 1, dtype=torch.long),
            completion_ids=c["ids"],
            completion_mask=mask,
            advantages=c["adv"].to(dtype),
            ref_per_token_logps=ref,
            old_per_token_logps=old,
            importance_sampling_ratio=isw,
            num_items_in_batch=torch.tensor(float(n_items), dtype=dtype),
        )
        loss_trl = tr._compute_loss(None, inputs)
        loss_trl.backward()
        lp_ours = lp_base.clone().requires_grad_()
        loss, _ = grpo_loss_reference(
            lp_ours,
            old,
            ref,
            c["adv"].to(dtype),
            mask,
            beta=0.04,
            epsilon_low=0.2,
            epsilon_high=0.28,
            loss_type=loss_type,
            importance_weights=isw,
            max_completion_length=LENGTH_KW["max_completion_length"],
            num_items_in_batch=n_items,
        )
        loss.backward()
        assert abs(loss.item() - loss_trl.item()) <= tol * max(1e-2, abs(loss_trl.item())), loss_type
        assert rel(lp_ours.grad, lp_trl.grad) < tol, loss_type
        # without the ratio TRL's loss differs: the ratio really entered it
        l_plain, _ = grpo_loss_reference(
            lp_base,
            old,
            ref,
            c["adv"].to(dtype),
            mask,
            beta=0.04,
            epsilon_low=0.2,
            epsilon_high=0.28,
            loss_type=loss_type,
            max_completion_length=LENGTH_KW["max_completion_length"],
            num_items_in_batch=n_items,
        )
        assert abs(l_plain.item() - loss_trl.item()) > 1e3 * tol * max(1e-2, abs(loss_trl.item())), loss_type


@pytest.mark.parametrize(
    "bad,match",
    [
        (torch.ones(B, T + 1), "importance_weights must have shape"),
        (torch.ones(B, T, dtype=torch.long), "importance_weights must be None or a floating tensor"),
        (torch.full((B, T), float("inf")), "importance_weights hold NaN, inf or a negative"),
        (-torch.ones(B, 1), "importance_weights hold NaN, inf or a negative"),
    ],
)
def test_importance_weights_bad_input(bad, match):
    c = make_case(60)
    with pytest.raises(ValueError, match=match):
        efficient_grpo_loss(c["h"], c["W"], c["ids"], c["mask"], c["adv"], importance_weights=bad)
    lp = fp64_logps(c["h"], c["W"], c["b"], c["ids"], 1.0).float()
    with pytest.raises(ValueError, match=match):
        grpo_loss_reference(
            lp,
            None,
            None,
            c["adv"],
            c["mask"],
            beta=0.0,
            epsilon_low=0.2,
            epsilon_high=0.2,
            loss_type="grpo",
            importance_weights=bad,
        )


# ------------------------------------------------------------------------------------------------
# where detach is essential
# ------------------------------------------------------------------------------------------------
def _trl_engine_ratio(old, sampling, mask, mode, clip_min, clip_max):
    """TRL 1.16's own lines (GRPOTrainer._generate_and_score_completions), copied as the oracle."""
    diff = torch.nan_to_num((old - sampling) * mask, nan=0.0)
    ratio = torch.exp(diff.sum(dim=-1, keepdim=True) if mode.startswith("sequence") else diff)
    if mode.endswith("truncate"):
        return torch.clamp(ratio, min=clip_min, max=clip_max)
    lo, hi = (-math.inf if clip_min is None else clip_min), (math.inf if clip_max is None else clip_max)
    return ratio.masked_fill((ratio < lo) | (ratio > hi), 0.0)


@pytest.mark.parametrize("mode", ["token_truncate", "token_mask", "sequence_truncate", "sequence_mask"])
@pytest.mark.parametrize("with_old", [False, True])
@pytest.mark.parametrize("loss_type", ["grpo", "dapo", "cispo"])
def test_engine_correction_equals_trls_ratio_passed_in(mode, with_old, loss_type):
    """The engine correction formed inside the loss (from old_logps, or from the current log-probs when the policy
    has not moved) gives the loss, gradients and metrics of TRL's ratio computed outside and passed as
    importance_weights; the efficient path equals the reference; TRL's sampling/* metrics match."""
    c = make_case(70 + len(mode) + with_old)
    h64, W64, b64 = (x.double().requires_grad_() for x in (c["h"], c["W"], c["b"]))
    lp64 = fp64_logps(h64, W64, b64, c["ids"], 0.8)
    g = torch.Generator().manual_seed(5)
    # the sampler's log-probs: near the policy's, one token it could not score (NaN), two sequences far off
    sampling = (lp64.detach() + torch.randn(B, T, generator=g, dtype=torch.float64) * 0.15).float()
    sampling[0, 0] = float("nan")
    sampling[2] -= 0.4
    old = (lp64.detach() + c["noise"][0] * 0.1).float() if with_old else None
    ref = (lp64.detach() + c["noise"][1]).float()
    clip = (0.8, 1.3) if mode.endswith("truncate") else (None, 1.3)
    kw = dict(
        beta=0.04, epsilon_low=0.2, epsilon_high=5.0 if loss_type == "cispo" else 0.28, loss_type=loss_type, **LENGTH_KW
    )
    base = lp64.detach().float() if old is None else old
    want_w = _trl_engine_ratio(base, sampling, c["mask"].float(), mode, *clip)
    assert 0 < float((want_w == clip[1]).float().mean() + (want_w == 0).float().mean()), "bounds never hit"
    l_out, m_out = grpo_loss_reference(
        lp64,
        None if old is None else old.double(),
        ref.double(),
        c["adv"].double(),
        c["mask"],
        importance_weights=want_w.double(),
        **kw,
    )
    l_in, m_in = grpo_loss_reference(
        lp64,
        None if old is None else old.double(),
        ref.double(),
        c["adv"].double(),
        c["mask"],
        sampling_logps=sampling.double(),
        engine_correction=(mode, *clip),
        **kw,
    )
    assert abs(l_in.item() - l_out.item()) <= 1e-6 * loss_scale(lp64, old, ref, c, kw)
    l_in.backward()
    h, W, b = (x.clone().requires_grad_() for x in (c["h"], c["W"], c["b"]))
    loss, m = efficient_grpo_loss(
        h,
        W,
        c["ids"],
        c["mask"],
        c["adv"],
        old_logps=old,
        ref_logps=ref,
        temperature=0.8,
        chunk_size=5,
        lm_head_bias=b,
        sampling_logps=sampling,
        engine_correction=(mode, *clip),
        **kw,
    )
    loss.backward()
    assert abs(loss.item() - l_in.item()) <= 1e-5 * loss_scale(lp64, old, ref, c, kw)
    for got, ref_grad in ((h.grad, h64.grad), (W.grad, W64.grad), (b.grad, b64.grad)):
        assert rel(got, ref_grad) < 1e-5
    delta = (base - sampling).abs()[c["mask"] & ~torch.isnan(base - sampling)]
    flat = want_w.flatten() if want_w.shape[-1] == 1 else want_w[c["mask"]]
    trl_metrics = {
        "sampling/sampling_logp_difference/mean": delta.mean(),
        "sampling/sampling_logp_difference/max": delta.max(),
        "sampling/importance_sampling_ratio/min": flat.min(),
        "sampling/importance_sampling_ratio/mean": flat.mean(),
        "sampling/importance_sampling_ratio/max": flat.max(),
    }
    for name, value in trl_metrics.items():
        assert abs(m[name].item() - value.item()) < 1e-5 and abs(m_in[name].item() - value.item()) < 1e-5, name
    assert set(m_out) | set(trl_metrics) == set(m_in)


@pytest.mark.parametrize(
    "over,match",
    [
        (dict(engine_correction=("token_clip", None, 3.0)), "mode 'token_clip' is not one of"),
        (dict(engine_correction=("token_mask", 2.0, 1.0)), "clip_min=2.0 is above clip_max=1.0"),
        (dict(engine_correction="token_mask"), r"must be None or \(mode, clip_min, clip_max\)"),
        (dict(engine_correction=("token_mask", None, 3.0), sampling_logps=None), "needs the sampler's log-probs"),
        (
            dict(engine_correction=("token_mask", None, 3.0), importance_weights=torch.ones(B, T)),
            "importance_weights=None",
        ),
        (dict(engine_correction=("token_mask", None, 3.0), loss_type="vespo"), "does not apply to loss_type='vespo'"),
    ],
)
def test_engine_correction_bad_input(over, match):
    c = make_case(80)
    kw = {
        **dict(
            old_logps=None,
            ref_logps=None,
            beta=0.0,
            loss_type="grpo",
            sampling_logps=torch.zeros(B, T),
            num_items_in_batch=29,
        ),
        **over,
    }
    with pytest.raises(ValueError, match=match):
        efficient_grpo_loss(c["h"], c["W"], c["ids"], c["mask"], c["adv"], **kw)


def test_reference_on_policy_gradient_is_advantage_weighted():
    """old_logps=None means old = logps.detach(): ratio 1 but gradient -A*w. Without the detach
    the ratio would be the constant exp(0) and the policy gradient would vanish."""
    lp = torch.randn(2, 5, requires_grad=True)
    adv = torch.tensor([1.5, -0.5])
    mask = torch.ones(2, 5)
    loss, m = grpo_loss_reference(
        lp, None, None, adv, mask, beta=0.0, epsilon_low=0.2, epsilon_high=0.2, loss_type="bnpo"
    )
    loss.backward()
    assert torch.allclose(lp.grad, (-adv[:, None] / 10).expand(2, 5))
    assert m["ratio_mean"] == 1.0
    # old = logps itself, not detached (as TRL would take it): the gradient vanishes
    (g,) = torch.autograd.grad(
        grpo_loss_reference(lp, lp, None, adv, mask, beta=0.0, epsilon_low=0.2, epsilon_high=0.2, loss_type="bnpo")[0],
        lp,
    )
    assert g.abs().max() == 0


def test_old_and_ref_logps_receive_no_gradient():
    """old/ref log-probs are constants of the loss: the efficient path detaches them."""
    c = make_case(9, bias=False)
    lp = per_token_logps(c["h"], c["W"], c["ids"])
    old = (lp + c["noise"][0]).requires_grad_()
    ref = (lp + c["noise"][1]).requires_grad_()
    h = c["h"].clone().requires_grad_()
    loss, m = efficient_grpo_loss(h, c["W"], c["ids"], c["mask"], c["adv"], old_logps=old, ref_logps=ref, beta=0.1)
    loss.backward()
    assert old.grad is None and ref.grad is None and h.grad is not None
    assert all(not v.requires_grad for v in m.values())


def test_backward_twice_is_refused():
    c = make_case(10)
    h = c["h"].clone().requires_grad_()
    loss, _ = efficient_grpo_loss(h, c["W"], c["ids"], c["mask"], c["adv"])
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="backward ran twice"):
        loss.backward()


# ------------------------------------------------------------------------------------------------
# low precision
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("setting", list(SETTINGS))
def test_bf16_matches_trl_style_naive_bf16(setting):
    """bf16, every setting: same numbers as TRL's path (bf16 logits, fp32 log_softmax) within bf16
    tolerance, and both within bf16 distance of the fp64 truth."""
    c = make_case(12, dtype=torch.bfloat16, bias=False)
    lp32 = fp64_logps(c["h"], c["W"], None, c["ids"], 1.0).float()
    ent = fp64_entropy(c["h"], c["W"], None, 1.0)
    old, ref = lp32 + c["noise"][0], lp32 + c["noise"][1]
    kw = dict(loss_kwargs(setting), max_completion_length=20, num_items_in_batch=int(c["mask"].sum()))
    hn = c["h"].clone().requires_grad_()
    lpn = torch.log_softmax((hn @ c["W"].t()).float(), -1).gather(-1, c["ids"][..., None]).squeeze(-1)
    ln, _ = grpo_loss_reference(lpn, old, ref, c["adv"], c["mask"], entropy=ent.float(), **kw)
    ln.backward()
    h = c["h"].clone().requires_grad_()
    loss, _ = efficient_grpo_loss(
        h, c["W"], c["ids"], c["mask"], c["adv"], old_logps=old, ref_logps=ref, chunk_size=5, **kw
    )
    loss.backward()
    assert h.grad.dtype == torch.bfloat16
    assert abs(loss.item() - ln.item()) < 1e-3 * max(abs(ln.item()), 1e-2)
    assert rel(h.grad, hn.grad) < 2e-2
    # and both sit within bf16 distance of the fp64 truth
    h64 = c["h"].double().requires_grad_()
    l64, _ = grpo_loss_reference(
        fp64_logps(h64, c["W"], None, c["ids"], 1.0),
        old.double(),
        ref.double(),
        c["adv"].double(),
        c["mask"],
        entropy=ent,
        **kw,
    )
    l64.backward()
    assert rel(h.grad, h64.grad) < 0.1


def test_fp16_gradscaler_update_equals_fp32():
    """fp16 weights + GradScaler: the optimizer step equals the fp32 one. The loss normaliser is
    made tiny (dr_grpo, huge max length) so that unscaled fp16 gradients would flush to zero."""
    c = make_case(13, bias=False)
    kw = dict(beta=0.04, loss_type="dr_grpo", max_completion_length=2**16)
    lp = per_token_logps(c["h"], c["W"], c["ids"])
    old, ref = lp + 0.1 * c["noise"][0], lp + 0.1 * c["noise"][1]

    p32 = torch.nn.Parameter(c["h"].clone())
    loss32, _ = efficient_grpo_loss(p32, c["W"], c["ids"], c["mask"], c["adv"], old_logps=old, ref_logps=ref, **kw)
    loss32.backward()
    torch.optim.SGD([p32], lr=1e4).step()

    p16 = torch.nn.Parameter(c["h"].clone())  # fp32 master, fp16 compute, as under amp
    opt = torch.optim.SGD([p16], lr=1e4)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16)
    loss16, _ = efficient_grpo_loss(
        p16.half(), c["W"].half(), c["ids"], c["mask"], c["adv"], old_logps=old, ref_logps=ref, **kw
    )
    scaler.scale(loss16).backward()
    scaler.step(opt)
    scaler.update()
    assert scaler.get_scale() == 2.0**16  # no inf/nan found, so the step was taken
    g32 = c["h"] - p32.detach()
    g16 = c["h"] - p16.detach()
    assert g32.abs().max() > 0
    assert rel(g16, g32) < 5e-3
    assert abs(loss16.item() - loss32.item()) < 1e-3 * abs(loss32.item()) + 1e-9


# ------------------------------------------------------------------------------------------------
# bad input
# ------------------------------------------------------------------------------------------------
def _call(**over):
    c = make_case(14, bias=False)
    args = dict(
        hidden=c["h"], lm_head_weight=c["W"], completion_ids=c["ids"], completion_mask=c["mask"], advantages=c["adv"]
    )
    kw = {}
    for k, v in over.items():
        (args if k in args else kw)[k] = v
    return efficient_grpo_loss(
        args["hidden"],
        args["lm_head_weight"],
        args["completion_ids"],
        args["completion_mask"],
        args["advantages"],
        **kw,
    )


@pytest.mark.parametrize(
    "over,match",
    [
        (dict(hidden=torch.randn(B, T)), "hidden"),
        (dict(lm_head_weight=torch.randn(V, H + 1)), "lm_head_weight"),
        (dict(lm_head_weight=torch.randn(V, H).double()), "lm_head_weight dtype"),
        (dict(completion_ids=torch.randint(0, V, (B, T + 1))), "completion_ids"),
        (dict(completion_ids=torch.full((B, T), V)), r"completion_ids must lie in \[0, 257\)"),
        (dict(completion_ids=torch.full((B, T), -1)), "completion_ids must lie"),
        (dict(completion_ids=torch.zeros(B, T)), "completion_ids must be an integer"),
        (dict(completion_mask=torch.ones(B, T + 1)), "completion_mask"),
        (dict(advantages=torch.randn(B + 1)), "advantages"),
        (dict(advantages=torch.tensor([1.0, float("nan"), 0.0])), "advantages hold NaN"),
        (dict(old_logps=torch.randn(B, T + 1)), "old_logps"),
        (
            dict(ref_logps=torch.randn(B, T), beta=0.1, old_logps=torch.full((B, T), float("-inf"))),
            "old_logps holds NaN or inf",
        ),
        (dict(beta=0.1), "ref_logps is required"),
        (dict(loss_type="ppo"), "loss_type must be one of"),
        (dict(loss_type="dr_grpo"), "max_completion_length"),
        (dict(loss_type="dapo"), "num_items_in_batch"),
        (dict(temperature=0.0), "temperature"),
        (dict(chunk_size=0), "chunk_size"),
        (dict(epsilon_low=-0.1), "epsilon_low"),
        (dict(epilogue="cuda"), "epilogue backend"),
        (dict(lm_head_bias=torch.randn(V + 1)), "lm_head_bias"),
        (dict(loss_type="cispo"), "loss_type='cispo' needs num_items_in_batch"),
        (dict(importance_sampling_level="group"), r"importance_sampling_level must be one of \('token', 'sequence'\)"),
        (dict(delta=0.0), "delta must be > 0, got 0.0"),
        (dict(top_entropy_quantile=1.5), r"top_entropy_quantile must be in \[0, 1\], got 1.5"),
        (dict(use_bias_correction_kl=1), "use_bias_correction_kl must be True or False"),
        (dict(sapo_temperature_neg=-1.0), "sapo_temperature_neg must be > 0"),
        (dict(vespo_k_pos=float("nan")), "vespo_k_pos must be a finite number"),
        (dict(clip_range=0.2), r"unknown loss option\(s\) \['clip_range'\]; allowed: \['loss_type'"),
    ],
)
def test_bad_input_raises_clear_value_error(over, match):
    with pytest.raises(ValueError, match=match):
        _call(**over)


def test_nan_in_hidden_is_caught():
    c = make_case(15, bias=False)
    h = c["h"].clone()
    h[0, 0, 3] = float("nan")
    with pytest.raises(ValueError, match="not finite"):
        efficient_grpo_loss(h, c["W"], c["ids"], c["mask"], c["adv"])
    with pytest.raises(ValueError, match="non-finite"):
        per_token_logps(h, c["W"], c["ids"])


def test_padding_may_hold_garbage_and_empty_batch_is_zero():
    c = make_case(16, bias=False)
    old = per_token_logps(c["h"], c["W"], c["ids"])
    old_bad = old.masked_fill(~c["mask"], float("nan"))  # NaN only at padding: allowed, and ignored
    l1, m1 = efficient_grpo_loss(c["h"], c["W"], c["ids"], c["mask"], c["adv"], old_logps=old)
    l2, m2 = efficient_grpo_loss(c["h"], c["W"], c["ids"], c["mask"], c["adv"], old_logps=old_bad)
    assert torch.isfinite(l2) and abs(l1.item() - l2.item()) < 1e-7
    h = c["h"].clone().requires_grad_()
    loss, m = efficient_grpo_loss(h, c["W"], c["ids"], torch.zeros(B, T), c["adv"], loss_type="grpo")
    loss.backward()
    assert loss.item() == 0.0 and h.grad.abs().max() == 0
    assert all(not torch.isnan(v) for k, v in m.items() if not k.endswith(("_min", "_max")))


@pytest.mark.parametrize("n_tokens", [0, 8 * 4096, 8 * 65536])
@pytest.mark.parametrize("vocab", [128256, 151936])
def test_auto_chunk_fits_the_quarter_gib_budget(n_tokens, vocab):
    """The chunk plus the per-token vectors stays within 0.25 GiB (the memory target's allowance)."""
    from grpo_kit.loss.efficient import auto_chunk_rows

    rows = auto_chunk_rows(vocab, torch.bfloat16, torch.device("cpu"), "triton", n_tokens)
    assert rows >= 512 and rows % 256 == 0  # whole GEMM tiles (bench/results/loss_chunk.md)
    assert rows * vocab * 2 + 48 * n_tokens <= 2**28
    rows_t = auto_chunk_rows(vocab, torch.bfloat16, torch.device("cpu"), "torch", n_tokens)
    assert rows_t * vocab * (2 + 12) + 48 * n_tokens <= 2**28
