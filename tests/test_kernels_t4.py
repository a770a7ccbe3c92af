"""Every Triton kernel of the kit compiles for Colab's free T4 (Turing, sm_75: fp16, no bf16, 64 KiB of shared
memory per block), with each configuration the kit can launch there. Compiled on the CPU for that target (Triton
and its bundled ptxas need no GPU): a kernel using what Turing lacks fails here instead of in a user's notebook
(seen: a cast to float8e4nv compiles for sm_90 and fails for sm_75 in this harness). Not run on a T4 (none is lent here); the H200 runs these kernels for real in the GPU tier."""

from __future__ import annotations

import pytest

triton = pytest.importorskip("triton")

from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from grpo_kit.kernels import grpo_epilogue as E  # noqa: E402
from grpo_kit.kernels import lora_merge as L  # noqa: E402
from grpo_kit.kernels import nf4_dequant as N  # noqa: E402

T4 = GPUTarget("cuda", 75, 32)
T4_SHARED_BYTES = 64 * 1024  # per block on sm_75
VOCABS = (49152, 128256, 151936)  # SmolLM2, Llama 3, Qwen2.5

pytestmark = pytest.mark.skipif(E.interpreter_active(), reason="this process runs Triton's interpreter")


def _compile(fn, signature, constexprs, attrs=None, **options):
    kernel = triton.compile(
        ASTSource(fn, signature=signature, constexprs=constexprs, attrs=attrs), target=T4, options=options
    )
    assert kernel.metadata.shared <= T4_SHARED_BYTES, (fn, kernel.metadata.shared)
    return kernel


@pytest.mark.parametrize("dtype", ["fp16", "fp32"])
def test_loss_epilogue_compiles_for_the_t4_in_every_autotuner_tile(dtype):
    """Every tile of the autotuner (none is pruned at these vocabularies: all are <= 32768 wide), for each
    vocabulary (a constexpr, so its own binary) and both entropy settings."""
    lse, grad = triton.jit(E._lse_logp_kernel), triton.jit(E._softmax_grad_kernel)
    for block, warps in E._TUNE_CONFIGS:
        for vocab in VOCABS:
            for entropy in (True, False):
                _compile(
                    lse,
                    {
                        "Z": f"*{dtype}",
                        "stride_z": "i64",
                        "IDS": "*i64",
                        "LOGP": "*fp32",
                        "LSE": "*fp32",
                        "ENT": "*fp32",
                        "inv_temp": "fp32",
                        "n_cols": "constexpr",
                        "COMPUTE_ENT": "constexpr",
                        "BLOCK": "constexpr",
                    },
                    {"n_cols": vocab, "COMPUTE_ENT": entropy, "BLOCK": block},
                    num_warps=warps,
                )
            _compile(
                grad,
                {
                    "Z": f"*{dtype}",
                    "stride_z": "i64",
                    "IDS": "*i64",
                    "LSE": "*fp32",
                    "COEF": "*fp32",
                    "inv_temp": "fp32",
                    "n_cols": "constexpr",
                    "BLOCK": "constexpr",
                },
                {"n_cols": vocab, "BLOCK": block},
                num_warps=warps,
            )


@pytest.mark.parametrize("dtype", ["fp16", "fp32"])
def test_nf4_dequantisation_compiles_for_the_t4_without_fma(dtype):
    sig, const, attrs = N.compile_signature(dtype)
    kernel = _compile(N._kernel(), sig, const, attrs, num_warps=4, **N.LAUNCH_OPTIONS)
    assert "fma.rn.f32" not in kernel.asm["ptx"]  # bitsandbytes' rounding on Turing too


@pytest.mark.parametrize("k", [16, 64])
def test_lora_merge_compiles_for_the_t4_in_fp16(k):
    bm, bn, warps = L._TILE
    _compile(
        L._kernel(),
        {
            "W": "*fp16",
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
        },
        {"K": k, "PERIOD": L._WEIGHT_PERIOD, "BLOCK_M": bm, "BLOCK_N": bn},
        num_warps=warps,
    )
