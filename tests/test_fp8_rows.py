"""The FP8 row kernels (grpo_kit.kernels.fp8_rows) against their torch twins, and the FP8 input gradient
(grpo_kit.model.fp8.grad_input_*) against the exact product. The Triton kernels run in Triton's CPU interpreter
here (a fresh process); on a GPU the tier in tests/test_fp8.py compiles them."""

import os

import pytest
import torch
from _interpreter import run_in_triton_interpreter

from grpo_kit.kernels import fp8_rows as K
from grpo_kit.model import fp8 as M

# Values whose rounding to e4m3 is the hard part: ties between two codes (17 lies between 16 and 18, 232 between
# 224 and 240: nearest even), a carry into the next power of two (31.57 -> 32), subnormals and their ties
# (1.5 x 2^-9), the smallest normal, signed zeros, the end of the range.
SCRIPT = r"""
import torch
from grpo_kit.kernels import fp8_rows as K

def same(a, b):
    return K.same_bits(a[0], b[0]) and K.same_bits(a[1], b[1])

g = torch.Generator().manual_seed(0)
special = torch.tensor([17.0, 232.0, 31.57, 30.9, 15.5, 448.0, -448.0, 447.9, 0.0029296875, 0.0048828125, 0.015625,
                        0.0146, -0.0, 0.0, 1e-9, -17.0, 240.0, 1.0625, 1.1875, 3.0e-3, -3.0e-3, 100.0])
x = special[None, :] * torch.tensor([[1.0], [-1.0], [1.0]])
x[2] = 0
for dt in (torch.float32, torch.bfloat16, torch.float16):
    # the row maximum is 448: each value's code is the value's own rounding
    assert same(K.quantize_rows_triton(x.to(dt)), K.quantize_rows_reference(x.to(dt))), ("special", dt)
# NaN and infinities are kept as the twin keeps them (a NaN row: scale 1 and NaN codes where the NaNs are; an
# infinite maximum: scale inf, the infinity's code NaN, the rest signed zeros); a maximum below MIN_AMAX: scale 1
odd = torch.randn(5, 300, generator=g)
odd[0, 3], odd[1, 5], odd[2, 7] = float("nan"), float("inf"), -float("inf")
odd[3] *= 1e-40
odd[4] = 1e-30
for dt in (torch.float32, torch.bfloat16, torch.float16):
    for cols in (None, torch.rand(1, 300, generator=g) + 0.5):
        got, want = K.quantize_rows_triton(odd.to(dt), cols), K.quantize_rows_reference(odd.to(dt), cols)
        assert same(got, want), ("nan/inf", dt)
        assert got[0][0].float().isnan().sum() == 1 and got[1][0] == 1 and got[1][1] == float("inf")
codes, scale = K.quantize_rows_reference(torch.randn(4, 40, generator=g))
codes[1, 2] = float("nan")
for dt in (torch.float32, torch.bfloat16, torch.float16):
    got = K.dequantize_channels_triton(codes, scale, dt)
    assert K.same_bits(got, K.dequantize_channels_reference(codes, scale, dt)) and got[1, 2].isnan(), ("nan", dt)
for m, k in [(1, 1), (3, 17), (5, 1025), (7, 2049), (2, 3000), (0, 8)]:
    for dt in (torch.float32, torch.bfloat16, torch.float16):
        x = (torch.randn(m, k, generator=g) * torch.logspace(-5, 3, max(m, 1))[:m, None]).to(dt)
        if m > 1:
            x[1] = 0
        for cols in (None, torch.rand(1, k, generator=g) * 3):
            assert same(K.quantize_rows_triton(x, cols), K.quantize_rows_reference(x, cols)), (m, k, dt)
        if k > 1:  # rows of a wider tensor: the kernel reads them through the row stride
            assert same(K.quantize_rows_triton(x[:, : k - 1]), K.quantize_rows_reference(x[:, : k - 1])), ("rows", m, k)
        codes, scale = K.quantize_rows_reference(torch.randn(m, k, generator=g) * 50)
        assert torch.equal(K.dequantize_channels_triton(codes, scale, dt),
                           K.dequantize_channels_reference(codes, scale, dt)), ("dequantize", m, k, dt)
assert K.kernels_match("cpu") and K.use_triton(torch.zeros(1))
print("FP8-ROWS-INTERPRETER-OK")
"""


def test_the_kernels_give_their_twins_bits_in_the_interpreter():
    pytest.importorskip("triton")
    run_in_triton_interpreter(SCRIPT, "FP8-ROWS-INTERPRETER-OK")


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="the interpreter runs the kernels on the CPU")
def test_the_kernels_stay_off_cpu_tensors_outside_the_interpreter():
    x = torch.randn(4, 33)
    assert not K.use_triton(x)
    assert all(K.same_bits(a, b) for a, b in zip(K.quantize_rows(x), K.quantize_rows_reference(x)))
    assert not K.same_bits(torch.zeros(3), torch.tensor([0.0, 0.0, -0.0]))  # the check tells -0 from +0
    assert K.same_bits(torch.tensor([float("nan"), 1.0]), torch.tensor([-float("nan"), 1.0]))  # any NaN is NaN


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_the_twin_quantises_each_row_against_float64(dtype):
    g = torch.Generator().manual_seed(1)
    x = (torch.randn(6, 301, generator=g) * torch.logspace(-3, 3, 6)[:, None]).to(dtype)
    cols = torch.rand(1, 301, generator=g) + 0.5
    codes, scale = K.quantize_rows_reference(x, cols)
    v = x.double() * cols.float().double()
    assert torch.allclose(scale.double()[:, 0], v.abs().amax(1) / K.FP8_MAX, rtol=1e-6)
    back = codes.double() * scale.double()
    # e4m3 keeps 3 mantissa bits: half a unit is 2^-4 of the value; below 2^-6 x scale, a step of 2^-9 x scale
    assert ((back - v).abs() <= torch.maximum(v.abs() * 2**-4, scale.double() * 2**-10) * (1 + 1e-6)).all()


def test_the_fp8_input_gradient_is_the_exact_product_within_e4m3s_rounding():
    g = torch.Generator().manual_seed(2)
    codes, scale = M.quantize_fp8(torch.randn(45, 70, generator=g) * 0.02)
    gy = torch.randn(9, 45, generator=g)
    got = M.grad_input_reference(gy, codes, scale).double()
    exact = gy.double() @ M.dequantize_fp8(codes, scale).double()
    # each term's gradient factor is off by at most 2^-4 of itself (or 2^-10 of its row's scale below e4m3's
    # normals), then fp32 sums
    a = (gy.double() * scale.double().T).abs()
    row_scale = a.amax(1, keepdim=True) / K.FP8_MAX
    bound = (torch.maximum(a * 2**-4, row_scale * 2**-10) @ codes.double().abs()) * (1 + 1e-5) + 1e-6
    assert ((got - exact).abs() <= bound).all()
    assert (got - exact).norm() / exact.norm() < 0.05


def test_an_fp8_layer_takes_the_input_gradient_its_grad_input_names():
    w = torch.randn(40, 24, generator=torch.Generator().manual_seed(3)) * 0.02
    x = torch.randn(5, 24, requires_grad=True)
    grads = {}
    for mode in M.FP8_GRAD_INPUT:
        layer = M.FP8Linear.from_weight(w)
        layer.grad_input = mode
        x.grad = None
        layer(x).backward(torch.ones(5, 40))
        grads[mode] = x.grad.clone()
    assert torch.equal(grads["fp8"], M.grad_input_reference(torch.ones(5, 40), layer.weight, layer.weight_scale))
    assert torch.allclose(grads["dequant"], torch.ones(5, 40) @ layer.dequantized_weight(), rtol=1e-6)
    assert not torch.equal(grads["fp8"], grads["dequant"])
    with pytest.raises(ValueError, match="grad_input 'int8' is not allowed: one of dequant, fp8"):
        M.FP8Linear(4, 4, bias=False, compute_dtype=torch.float32, grad_input="int8")


def test_block_scaled_layers_dequantise_whatever_grad_input_says():
    layer = M.FP8Linear.from_weight(torch.randn(40, 24) * 0.02, block=16)
    layer.grad_input = "fp8"
    x = torch.randn(5, 24, requires_grad=True)
    layer(x).backward(torch.ones(5, 40))
    assert torch.allclose(x.grad, torch.ones(5, 40) @ layer.dequantized_weight(), rtol=1e-6)
