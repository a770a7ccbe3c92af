"""The Triton epilogue, run in Triton's CPU interpreter, against its torch twin.

TRITON_INTERPRET=1 must be set before Triton is imported (Triton wraps its standard library at
import), so the checks run in a fresh interpreter process; they exercise the same kernel source
the GPU compiles. Skipped only when Triton is not installed.
"""

import textwrap

import pytest
from _interpreter import run_in_triton_interpreter

SCRIPT = textwrap.dedent(
    """
    import torch
    from grpo_kit.kernels import grpo_epilogue as E
    from grpo_kit.loss.efficient import efficient_grpo_loss, per_token_logps
    assert E.interpreter_active()

    def ulp_close(a, b, dtype):
        # bf16/fp16 outputs may differ by one rounding step (fp32 op order differs)
        tol = {torch.float32: 1e-6, torch.bfloat16: 2 ** -7, torch.float16: 2 ** -10}[dtype]
        return bool(((a.float() - b.float()).abs() <= tol * (1 + b.float().abs())).all())

    g = torch.Generator().manual_seed(0)
    # V=257 is not a multiple of the interpreter's 128-wide tile: the masked last tile is covered
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        for n, V, inv_t, ent in ((5, 257, 1.0, True), (3, 130, 1 / 0.7, False), (1, 1, 2.0, True)):
            z = (torch.randn(n, V, generator=g) * 4).to(dtype)
            ids = torch.randint(0, V, (n,), generator=g)
            lp0, lse0, e0 = E.lse_logp_torch(z, ids, inv_t, ent)
            lp1, lse1, e1 = E.lse_logp_triton(z, ids, inv_t, ent)
            assert torch.allclose(lp1, lp0, rtol=1e-5, atol=1e-5), (dtype, n, V)
            assert torch.allclose(lse1, lse0, rtol=1e-5, atol=1e-5), (dtype, n, V)
            assert (e1 is None) == (not ent)
            if ent:
                assert torch.allclose(e1, e0, rtol=1e-5, atol=1e-5), (dtype, n, V)
            coef = torch.randn(n, generator=g)
            coef[0] = 0.0
            z0, z1 = z.clone(), z.clone()
            E.softmax_grad_torch_(z0, ids, lse0, coef, inv_t)
            E.softmax_grad_triton_(z1, ids, lse0, coef, inv_t)
            assert ulp_close(z1, z0, dtype), (dtype, n, V)
            assert not torch.equal(z1, z), "the chunk must be overwritten"
            # a row sums to coef * inv_t * (1 - 1) = 0: softmax minus one-hot
            assert z1.float().sum(-1).abs().max() < 1e-2

    # the whole loss through the Triton epilogue equals the torch epilogue
    B, T, H, V = 2, 9, 16, 257
    for dtype in (torch.float32, torch.bfloat16):
        h0 = torch.randn(B, T, H, generator=g).to(dtype)
        W = (torch.randn(V, H, generator=g) * 0.5).to(dtype)
        ids = torch.randint(0, V, (B, T), generator=g)
        mask = torch.rand(B, T, generator=g) > 0.3
        adv = torch.randn(B, generator=g)
        lp = per_token_logps(h0, W, ids, epilogue="torch")
        assert torch.allclose(per_token_logps(h0, W, ids, epilogue="triton"), lp, rtol=1e-5, atol=1e-5)
        old, ref = lp + 0.2 * torch.randn(B, T, generator=g), lp + 0.2 * torch.randn(B, T, generator=g)
        # importance weights (TRL's importance_sampling_ratio) enter the coefficient the kernel scales by
        for isw in (None, torch.rand(B, T, generator=g) * 2):
            out = {}
            for epi in ("torch", "triton"):
                h = h0.clone().requires_grad_()
                loss, m = efficient_grpo_loss(h, W, ids, mask, adv, old_logps=old, ref_logps=ref, beta=0.05,
                                              temperature=0.9, chunk_size=4, epilogue=epi, compute_entropy=True,
                                              importance_weights=isw)
                loss.backward()
                out[epi] = (loss, m, h.grad)
            (l0, m0, g0), (l1, m1, g1) = out["torch"], out["triton"]
            assert abs(l0.item() - l1.item()) <= 1e-5 * max(1.0, abs(l0.item())), dtype
            assert all(abs(m0[k].item() - m1[k].item()) < 1e-5 for k in m0), dtype
            rel = ((g1.float() - g0.float()).norm() / g0.float().norm()).item()
            # fp32: 1e-6 unweighted; the weights reweight the tokens' sums (seen 1.08e-6), so 2e-6 there
            assert rel < ((2e-6 if isw is not None else 1e-6) if dtype == torch.float32 else 1e-2), (dtype, rel)
    print("TRITON-INTERPRETER-OK")
    """
)


def test_triton_epilogue_in_interpreter_matches_torch():
    pytest.importorskip("triton")
    run_in_triton_interpreter(SCRIPT, "TRITON-INTERPRETER-OK", timeout=300)


def test_triton_backend_refuses_cpu_tensors_outside_the_interpreter():
    pytest.importorskip("triton")
    import torch

    from grpo_kit.kernels import grpo_epilogue as E

    if E.interpreter_active():
        pytest.skip("this process runs Triton's interpreter")
    with pytest.raises(ValueError, match="needs CUDA tensors"):
        E.lse_logp(torch.randn(2, 5), torch.zeros(2, dtype=torch.long), 1.0, False, "triton")


def test_auto_backend_is_torch_on_cpu():
    import torch

    from grpo_kit.kernels import grpo_epilogue as E

    assert E.resolve_backend("auto", torch.device("cpu")) == "torch"
    with pytest.raises(ValueError, match="epilogue backend"):
        E.resolve_backend("fast", torch.device("cpu"))
