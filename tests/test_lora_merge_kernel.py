"""The reversible LoRA merge's Triton kernel (grpo_kit.kernels.lora_merge), run in Triton's CPU interpreter,
against its torch passes: the scan's checksum equals the torch checksum exactly; in fp16 its miss mask agrees and
the merged weight equals the torch pass's to the last bit but for rare ties (a tile's dot product may round its
last bit differently from a BLAS block's); the restore's checksum is the result's; and the whole reversible
merge through the kernel gives every bit back (odd shapes, masked edge tiles, ranks padded from 20 to 32 and from 40 to 64 (tl.arange's power of two), two
adapters side by side, signed zeros, NaN, bf16 and fp16). Triton's interpreter (3.6 and 3.7) converts float32 to bf16 by
truncation where the GPU rounds to nearest even, so in bf16 it checks the kernel against itself (the round
trip) only; the GPU tier (tests/test_gpu_core.py) compares the bf16 kernel with the torch pass on CUDA.

TRITON_INTERPRET=1 must be set before Triton is imported, so the checks run in a fresh process; they exercise
the kernel source the GPU compiles. Skipped only when Triton is not installed.
"""

import textwrap

import pytest
from _interpreter import run_in_triton_interpreter

SCRIPT = textwrap.dedent(
    """
    import torch
    from grpo_kit.generation import reversible_merge as rm
    from grpo_kit.kernels import lora_merge as K
    assert K.interpreter_active()
    rm.MAX_KEPT_SHARE = 1.0  # deltas far larger than a trained adapter's: many kept elements, exact all the same
    g = torch.Generator().manual_seed(0)
    ints = lambda t: t.view(torch.int16)  # noqa: E731

    def factors(m, n, ranks):
        return [(torch.randn(r, n, generator=g) * 0.02, torch.randn(m, r, generator=g) * 0.05, s)
                for r, s in zip(ranks, (0.5, 2.0))]

    for dtype in (torch.bfloat16, torch.float16):
        for m, n, ranks in ((37, 53, (4,)), (1, 17, (16,)), (70, 130, (20,)), (21, 70, (40,)), (33, 40, (8, 8))):
            w = (torch.randn(m, n, generator=g) * 0.02).to(dtype)
            flat = w.view(-1)
            flat[0], flat[-1] = -0.0, float("nan")
            f = factors(m, n, ranks)
            b, a = K.fold_factors(f, "cpu")
            k = b.shape[1]  # tl.arange takes only powers of two: 40 -> 64, not 48
            assert k >= 16 and k & (k - 1) == 0 and a.shape[0] == k
            miss_k, bits_k = K.run_triton(K.SCAN, w, b, a)
            miss_t, bits_t = K.scan_torch(w, b, a)
            assert int(bits_k) == int(bits_t) == int(K.bit_sum(w)), (dtype, m, n)
            w_k, w_t = w.clone(), w.clone()
            K.run_triton(K.MERGE, w_k, b, a)
            list(K.merge_rows_torch(w_t, b, a, 0, m))  # a generator: run every block
            assert not torch.equal(ints(w_k), ints(w)), "the merge must write the weight"
            if dtype == torch.float16:  # the interpreter truncates float32 -> bf16 (the GPU rounds to nearest)
                rare = max(1, 0.02 * w.numel())  # ties a tile's dot product rounds differently from BLAS
                assert (miss_k.bool() != miss_t).sum() <= rare and (ints(w_k) != ints(w_t)).sum() <= rare, (m, n)
            r = w_k.clone()
            _, rb = K.run_triton(K.RESTORE, r, b, a)
            assert int(rb) == int(K.bit_sum(r)), (dtype, m, n)
            original = w.clone()
            saved = rm.merge_weight(w, f, "w")
            assert saved.backend == "triton" and (saved.kept > 0 or w.numel() < 100)
            rm.restore_weight(w, saved, "w")
            assert torch.equal(ints(w), ints(original)), (dtype, m, n)
    print("LORA-MERGE-INTERPRETER-OK")
    """
)


def test_lora_merge_kernel_in_interpreter_matches_torch_and_restores_every_bit():
    pytest.importorskip("triton")
    run_in_triton_interpreter(SCRIPT, "LORA-MERGE-INTERPRETER-OK")


def test_the_kernel_takes_only_16_bit_cuda_weights_outside_the_interpreter():
    import torch

    from grpo_kit.kernels import lora_merge as K

    if K.interpreter_active():
        pytest.skip("this process runs Triton's interpreter")
    assert not K.triton_usable(torch.zeros(4, 4, dtype=torch.bfloat16))  # a CPU weight: the torch passes
    assert not K.triton_usable(torch.zeros(4, 4, dtype=torch.float32, device="meta"))


def test_the_compiled_kernel_adds_w_after_the_dot_never_into_its_accumulator():
    """On the H200 the first kernel's restores all failed: compiled per pass (MODE a constexpr), the merge-only
    binary had Triton fold ``dot(b, a) + w`` into ``dot(b, a, acc=w)``, a different rounding of W + dW from the
    scan's (seen in this compilation on the CPU: the old MERGE's TTIR dot took w as its accumulator). Compiled
    for CUDA here (no GPU needed), the one binary's dot must start from zero, for both 16-bit dtypes."""
    import re

    pytest.importorskip("triton")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from grpo_kit.kernels import lora_merge as K

    if K.interpreter_active():
        pytest.skip("this process runs Triton's interpreter")
    bm, bn, warps = K._TILE
    for dtype in ("bf16", "fp16"):
        sig = {
            "W": f"*{dtype}",
            "B": "*fp32",
            "A": "*fp32",
            "MISS": "*i8",
            "SUMS": "*i64",
            "M": "i32",
            "N": "i32",
            "MODE": "i32",
            "K": "constexpr",
            "PERIOD": "constexpr",
            "BLOCK_M": "constexpr",
            "BLOCK_N": "constexpr",
        }
        src = ASTSource(
            K._kernel(), signature=sig, constexprs={"K": 16, "PERIOD": K._WEIGHT_PERIOD, "BLOCK_M": bm, "BLOCK_N": bn}
        )
        ttir = (
            __import__("triton")
            .compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps})
            .asm["ttir"]
        )
        dots = re.findall(r"= tt\.dot %[\w.]+, %[\w.]+, (%[\w.]+)", ttir)
        assert len(dots) == 1, ttir
        assert re.search(rf"{re.escape(dots[0])} = arith\.constant dense<0\.0+e\+00> : tensor<{bm}x{bn}xf32>", ttir), (
            f"the dot's accumulator {dots[0]} is not zero: W is added inside the dot\n{ttir}"
        )
