"""FP8 base weights for LoRA training: e4m3 weights with fp32 scales, a W8A8 matmul, and where FP8 can run.

The format. A frozen base weight W (out, in) is held as ``weight`` float8_e4m3fn (out, in) and ``weight_scale``
float32, with W ~= weight * scale:

* per output channel (the default): ``weight_scale`` (out, 1), scale[o] = max_k |W[o, k]| / ``FP8_MAX``, so each
  row uses e4m3's whole range (+-448); the layout of vLLM's channel-wise FP8 linear method and of Unsloth's FP8 RL;
* per block (``block=FP8_BLOCK``): ``weight_scale`` (ceil(out / 128), ceil(in / 128)), one scale per 128 x 128
  tile (DeepSeek-V3's and NeMo-RL's layout; edge tiles are smaller).

A row or tile of zeros gets scale 1 (its codes are zeros whatever the scale). The codes are ``W / scale`` in fp32
rounded to the nearest e4m3 value (ties to even): relative error at most 2^-4 (three mantissa bits) where
|W / scale| is a normal e4m3 number (>= 2^-6), absolute error at most 2^-10 x scale below that (subnormals).
Memory: 1 byte per weight plus 4 bytes per scale (per channel, 4 bytes per row of ``in`` weights).

The matmul (:class:`FP8Linear`), forward ``y = x W^T + b`` as W8A8: each row of x (the tokens) is quantised to e4m3
on the fly with its own scale (max |x_row| / 448), with block weights each ``block`` columns of a row with their own
(vLLM's block FP8 method quantises activations in those groups), the products are accumulated in fp32 and rescaled
by both scales. On a CUDA GPU with FP8 tensor cores (compute capability >= 8.9, ``FP8_MIN_CAPABILITY``) per-channel
weights go through ``torch._scaled_mm`` (row-wise scales); :func:`w8a8_reference` is its plain-torch twin and the
definition (both operands dequantised to fp32 and multiplied in fp32), used everywhere else (the CPU, block scales,
a GPU where ``_scaled_mm`` fails its probe). ``activations="16bit"`` multiplies the activations unquantised with the
dequantised weight instead (W8A16). The backward gives the input gradient only, ``dx = dy W`` with W dequantised to
dy's dtype (``grad_input="fp8"``: an FP8 GEMM instead, off by default; ``bench fp8_train`` compares the two); the
base weight gets no gradient (it is frozen) and the forward saves no tensor for the backward (no activation: there
is no weight gradient to compute from it). So the FP8 path needs no layer weight cache
(``grpo_kit.model.nf4_matmul.layer_weight_cache``): the forward reads the FP8 codes directly, and each backward
dequantises one weight once. On CUDA the activation quantiser and the per-channel dequantisation are Triton kernels
with these functions' bits (:mod:`grpo_kit.kernels.fp8_rows`).

:func:`quantize_model_fp8` replaces a model's ``nn.Linear`` layers (not ``lm_head``, never the embeddings: the
rule of :func:`grpo_kit.model.quantize.quantizable_linears`) by :class:`FP8Linear`, one layer at a time.
LoRA goes on top through PEFT: :func:`fp8_lora_config` registers the LoRA layer for ``FP8Linear`` in a
``LoraConfig`` (PEFT's custom-module mapping); the adapter runs in ``FP8Linear.compute_dtype``.
"""

from __future__ import annotations

import functools
import warnings

import torch
import torch.nn.functional as F
from torch import nn

from grpo_kit.kernels import fp8_rows
from grpo_kit.kernels.fp8_rows import FP8_DTYPE, FP8_MAX, safe_scale, to_fp8
from grpo_kit.model.quantize import quantizable_linears

__all__ = [
    "BASE_WEIGHTS",
    "FP8_DTYPE",
    "FP8_MAX",
    "FP8_BLOCK",
    "FP8_MIN_CAPABILITY",
    "FP8_ACTIVATIONS",
    "FP8_GRAD_INPUT",
    "fp8_support",
    "quantize_fp8",
    "dequantize_fp8",
    "quantize_rows",
    "quantize_groups",
    "dequantize_groups",
    "w8a8_reference",
    "w8a8_scaled_mm",
    "fp8_matmul",
    "grad_input_reference",
    "grad_input_scaled_mm",
    "FP8Linear",
    "quantize_model_fp8",
    "fp8_report",
    "fp8_lora_config",
]

BASE_WEIGHTS = ("16bit", "fp8")  # how the frozen base linear weights are held (16bit: in the training dtype)
FP8_BLOCK = 128  # the optional block scales' tile side
FP8_MIN_CAPABILITY = (8, 9)  # Ada (L4, RTX 40) and newer: Hopper (H100, H200), Blackwell (B200, RTX 50)
FP8_ACTIVATIONS = ("fp8", "16bit")  # W8A8 (the default) or W8A16: how FP8Linear multiplies its input
# How FP8Linear's backward forms dx = dy W: W dequantised to dy's dtype (the default), or an FP8 GEMM of dy
# quantised per row against the codes (per-channel weights on FP8 tensor cores; elsewhere its twin)
FP8_GRAD_INPUT = ("dequant", "fp8")
_NO_FP8_GPUS = "T4, V100, A100"
_SCALED_MM_ALIGN = 16  # torch._scaled_mm needs the inner and output dims to be multiples of 16

_probed: dict = {}  # (device, dtype) -> whether torch._scaled_mm ran and matched the twin there


def fp8_support(device) -> str | None:
    """Why FP8 base weights cannot run on ``device`` (a ``torch.device`` or a string such as ``"cuda"``,
    ``"cuda:1"``, ``"cpu"``), naming the device and what it supports instead; None where they can."""
    device = torch.device(device)
    fits = f"compute capability {'.'.join(map(str, FP8_MIN_CAPABILITY))} or newer: L4, RTX 40/50, H100, H200, B200"
    if device.type != "cuda":
        return (
            f"FP8 base weights need a CUDA GPU with FP8 tensor cores ({fits}); the device is {device.type}, "
            "which trains with 16-bit base weights only"
        )
    if not torch.cuda.is_available():
        return f"FP8 base weights need a CUDA GPU with FP8 tensor cores ({fits}); torch sees no CUDA device"
    cap = torch.cuda.get_device_capability(device)
    if cap >= FP8_MIN_CAPABILITY:
        return None
    name = torch.cuda.get_device_name(device)
    dense = "bf16" if cap >= (8, 0) else "fp16"
    return (
        f"FP8 base weights need FP8 tensor cores ({fits}); the {name} (compute capability {cap[0]}.{cap[1]}) "
        f"has none (nor do the {_NO_FP8_GPUS}): use 16-bit base weights ({dense}) or load_in_4bit"
    )


def _tiles(t: torch.Tensor, block: int) -> torch.Tensor:
    """(out, in) -> (ceil(out / block), block, ceil(in / block), block), zero-padded at the far edges."""
    o, i = t.shape
    t = F.pad(t, (0, -i % block, 0, -o % block))
    return t.view(t.shape[0] // block, block, t.shape[1] // block, block)


def quantize_fp8(weight: torch.Tensor, block: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(codes, scale)`` of ``weight`` (out, in; any float dtype): codes float8_e4m3fn (out, in) on the weight's
    device; scale float32 (out, 1), or (ceil(out / block), ceil(in / block)) with ``block``. Computed in fp32
    (in torch: one transient fp32 copy of the weight; per channel on CUDA: the row kernel, none)."""
    if block is None:  # a weight's output channels are its rows: the row quantiser's arithmetic
        return fp8_rows.quantize_rows(weight.detach())
    w = weight.detach().float()
    tiles = _tiles(w, block)
    scale = safe_scale(tiles.abs().amax(dim=(1, 3)))
    codes = to_fp8(tiles / scale[:, None, :, None]).view(tiles.shape[0] * block, -1)
    return codes[: w.shape[0], : w.shape[1]].contiguous(), scale


def dequantize_fp8(
    codes: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32, block: int | None = None
) -> torch.Tensor:
    """W (out, in) in ``dtype`` from ``codes`` (float8_e4m3fn, out x in) and ``scale`` (float32: (out, 1), or
    per ``block`` x ``block`` tile): ``codes * scale`` in fp32, rounded once to ``dtype``."""
    expected = (codes.shape[0], 1) if block is None else tuple(-(-d // block) for d in codes.shape)
    if tuple(scale.shape) != expected:  # a layout mix-up would broadcast silently
        raise ValueError(f"scale {tuple(scale.shape)} does not fit codes {tuple(codes.shape)} with block={block}")
    if block is None:
        return fp8_rows.dequantize_channels(codes, scale, dtype)
    tiles = _tiles(codes.float(), block) * scale[:, None, :, None]
    w = tiles.view(tiles.shape[0] * block, -1)[: codes.shape[0], : codes.shape[1]]
    return w if dtype == torch.float32 else w.to(dtype)


def quantize_rows(x: torch.Tensor, col_scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(codes, scale)`` of activations x (M, K; any float dtype): codes float8_e4m3fn (M, K), scale float32
    (M, 1) = max_k |x[m, k]| / ``FP8_MAX`` (1 for a zero row). The activations' side of W8A8; ``col_scale``
    float32 (1, K): x's columns multiplied by it first (the FP8 backward). One Triton launch on CUDA
    (:mod:`grpo_kit.kernels.fp8_rows`, the same bits), torch elsewhere."""
    return fp8_rows.quantize_rows(x, col_scale)


def quantize_groups(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(codes, scale)`` of activations x (M, K) quantised per ``group`` consecutive columns of each row: codes
    float8_e4m3fn (M, K), scale float32 (M, ceil(K / group)), each group's max |x| / ``FP8_MAX`` (1 for a zero
    group; the last group may be shorter). The activations' side of W8A8 with block weights, as vLLM's block FP8
    method quantises them (per token and group)."""
    m, k = x.shape
    groups = -(-k // group)
    codes, scale = quantize_rows(F.pad(x, (0, groups * group - k)).reshape(m * groups, group))
    return codes.view(m, groups * group)[:, :k], scale.view(m, groups)


def dequantize_groups(codes: torch.Tensor, scale: torch.Tensor, group: int) -> torch.Tensor:
    """:func:`quantize_groups`' inverse in fp32: codes (M, K), scale (M, ceil(K / group)) -> (M, K) float32."""
    m, k = codes.shape
    full = F.pad(codes.float(), (0, scale.shape[1] * group - k)).view(m, scale.shape[1], group)
    return (full * scale[:, :, None]).view(m, -1)[:, :k]


def w8a8_reference(
    x: torch.Tensor,
    codes: torch.Tensor,
    scale: torch.Tensor,
    bias: torch.Tensor | None = None,
    block: int | None = None,
) -> torch.Tensor:
    """The W8A8 forward in plain torch (any device): x (M, K) quantised per row (:func:`quantize_rows`), or per
    row and ``block`` columns with block scales (:func:`quantize_groups`), both operands dequantised to fp32,
    multiplied in fp32, bias added in fp32, rounded once to x's dtype -> (M, N). ``codes`` float8_e4m3fn (N, K),
    ``scale`` per channel or per ``block``, ``bias`` (N,) or None."""
    with torch.autocast(x.device.type, enabled=False):  # fp32 means fp32, also inside an autocast region
        if block is None:
            qx, sx = quantize_rows(x)
            xd = qx.float() * sx
        else:
            xd = dequantize_groups(*quantize_groups(x, block), block)
        y = xd @ dequantize_fp8(codes, scale, block=block).T
        if bias is not None:
            y = y + bias.float()
    return y.to(x.dtype)


def _pad_to(t: torch.Tensor, rows: int, cols: int, value: float = 0.0) -> torch.Tensor:
    """``t`` (2-D) padded at the end to (rows, cols); float8 through its bytes (a zero byte is e4m3's +0)."""
    pr, pc = rows - t.shape[0], cols - t.shape[1]
    if not (pr or pc):
        return t
    if t.dtype == FP8_DTYPE:
        return F.pad(t.view(torch.uint8), (0, pc, 0, pr)).view(FP8_DTYPE)
    return F.pad(t, (0, pc, 0, pr), value=value)


def w8a8_scaled_mm(
    x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """:func:`w8a8_reference` on FP8 tensor cores (CUDA, compute capability >= 8.9): ``torch._scaled_mm`` with
    row-wise scales, fp32 accumulation, output in x's dtype. x (M, K) bf16/fp16/fp32, ``codes``
    float8_e4m3fn (N, K), ``scale`` float32 (N, 1) (per channel only), bias (N,) or None -> (M, N). Inner and
    output dims that are not multiples of 16 are zero-padded for the call (real models' are). The bias is added
    after the product is rounded to x's dtype (the twin rounds once, after it)."""
    n, k = codes.shape
    kp, np_ = -(-k // _SCALED_MM_ALIGN) * _SCALED_MM_ALIGN, -(-n // _SCALED_MM_ALIGN) * _SCALED_MM_ALIGN
    qx, sx = quantize_rows(_pad_to(x, x.shape[0], kp))
    w = _pad_to(codes, np_, kp)
    sw = _pad_to(scale, np_, 1, value=1.0).view(1, np_)
    y = torch._scaled_mm(qx, w.t(), scale_a=sx, scale_b=sw, out_dtype=x.dtype)[:, :n]
    return y if bias is None else y + bias.to(y.dtype)


def _scaled_mm_ok(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether ``device`` has FP8 tensor cores and ``torch._scaled_mm`` runs there for ``dtype`` activations and
    matches the twin on a probe (checked once; a failure is said once, and the twin serves there)."""
    key = (str(device), dtype)
    if key not in _probed and fp8_support(device) is not None:
        _probed[key] = False  # no FP8 tensor cores: the twin, silently (the config refuses FP8 there up front)
    if key not in _probed:
        g = torch.Generator(device=device).manual_seed(0)
        x = torch.randn(32, 64, device=device, generator=g).to(dtype)
        codes, scale = quantize_fp8(torch.randn(48, 64, device=device, generator=g))
        try:
            ref = w8a8_reference(x, codes, scale).float()
            err = (w8a8_scaled_mm(x, codes, scale).float() - ref).abs().max() / ref.abs().max()
            ok, why = bool(err < 2e-2), f"differed from its torch twin (max error {float(err):.3g} of the largest)"
        except (RuntimeError, TypeError) as e:  # e.g. an output dtype this torch's row-wise FP8 GEMM lacks
            ok, why = False, f"could not run ({type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''})"
        if not ok:
            warnings.warn(
                f"torch._scaled_mm {why} on {device} for {dtype} activations; the FP8 matmul runs "
                "its torch twin there instead (slower, same definition)",
                stacklevel=3,
            )
        _probed[key] = ok
    return _probed[key]


def fp8_matmul(
    x: torch.Tensor,
    codes: torch.Tensor,
    scale: torch.Tensor,
    bias: torch.Tensor | None = None,
    block: int | None = None,
    activations: str = "fp8",
) -> torch.Tensor:
    """``x W^T + b`` for FP8 weights, no autograd. x (M, K) in the compute dtype -> (M, N) in x's dtype.
    ``activations="fp8"``: W8A8 (``_scaled_mm`` where it applies, else :func:`w8a8_reference`); ``"16bit"``:
    the weight dequantised to x's dtype and ``F.linear``."""
    if activations == "16bit":
        return F.linear(x, dequantize_fp8(codes, scale, x.dtype, block), None if bias is None else bias.to(x.dtype))
    if x.is_cuda and block is None and _scaled_mm_ok(x.device, x.dtype):
        return w8a8_scaled_mm(x, codes, scale, bias)
    return w8a8_reference(x, codes, scale, bias, block)


def grad_input_reference(gy: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``dx = dy W`` from FP8 per-channel weights as an FP8 product, in plain torch: W = codes * scale, so
    dy W = (dy * scale^T) codes; ``dy * scale^T`` is quantised per row (:func:`quantize_rows` with the scales
    as column factors), both operands dequantised to fp32, multiplied in fp32, rounded once to dy's dtype.
    gy (M, N) float, ``codes`` float8_e4m3fn (N, K), ``scale`` float32 (N, 1) -> (M, K)."""
    with torch.autocast(gy.device.type, enabled=False):
        q, s = fp8_rows.quantize_rows_reference(gy, scale.reshape(1, -1))
        return ((q.float() * s) @ codes.float()).to(gy.dtype)


def grad_input_scaled_mm(gy: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """:func:`grad_input_reference` on FP8 tensor cores: ``torch._scaled_mm`` of the quantised gradient (row
    scales) against the codes, which it needs column-major (one transposed copy of the codes, 1 byte per weight,
    instead of the dequantised 16-bit weight). Dims that are not multiples of 16 are zero-padded for the call."""
    n, k = codes.shape
    np_, kp = -(-n // _SCALED_MM_ALIGN) * _SCALED_MM_ALIGN, -(-k // _SCALED_MM_ALIGN) * _SCALED_MM_ALIGN
    q, s = quantize_rows(_pad_to(gy, gy.shape[0], np_), _pad_to(scale.reshape(1, n), 1, np_, value=1.0))
    w = _pad_to(codes, np_, kp).t().contiguous().t()  # (N, K) column-major
    ones = torch.ones(1, kp, dtype=torch.float32, device=gy.device)
    return torch._scaled_mm(q, w, scale_a=s, scale_b=ones, out_dtype=gy.dtype)[:, :k]


def _grad_input(gy: torch.Tensor, m) -> torch.Tensor:
    """``dy W`` for :class:`FP8Linear` ``m`` as its ``grad_input`` says (module docstring); block scales and
    ``"dequant"``: W dequantised to dy's dtype."""
    if m.grad_input == "fp8" and m.block is None:
        if gy.is_cuda and _scaled_mm_ok(gy.device, gy.dtype):
            return grad_input_scaled_mm(gy, m.weight, m.weight_scale)
        return grad_input_reference(gy, m.weight, m.weight_scale)
    return gy @ dequantize_fp8(m.weight, m.weight_scale, gy.dtype, m.block)


class _FP8Matmul(torch.autograd.Function):
    """``x W^T + b`` through :func:`fp8_matmul`; backward ``dx = dy W`` (:func:`_grad_input`) and the bias
    gradient if asked; no weight gradient. Saves no tensor: the module gives the weight back in backward.
    x (M, K) in the compute dtype, bias (N,) or None -> (M, N)."""

    @staticmethod
    def forward(ctx, x, bias, module):
        ctx.module = module
        ctx.bias_dtype = None if bias is None else bias.dtype
        return fp8_matmul(x, module.weight, module.weight_scale, bias, module.block, module.activations)

    @staticmethod
    def backward(ctx, gy):
        gx = gb = None
        m = ctx.module
        if ctx.needs_input_grad[0]:  # under autocast gy may come back in another dtype than x
            gx = _grad_input(gy, m)
        if ctx.needs_input_grad[1]:
            gb = gy.sum(0, dtype=ctx.bias_dtype)
        return gx, gb, None


class FP8Linear(nn.Module):
    """A frozen linear layer with FP8 e4m3 weights (module docstring: the format and the matmul).

    ``weight`` float8_e4m3fn (out, in) and ``weight_scale`` float32 ((out, 1), or block scales) are frozen
    parameters; ``bias`` (out,) in ``compute_dtype`` or None. ``compute_dtype``: the dtype the layer computes and
    returns in (its input is cast to it, the output back to the input's dtype), and the dtype PEFT gives a LoRA
    adapter on top. ``activations``: ``FP8_ACTIVATIONS``; ``grad_input``: ``FP8_GRAD_INPUT`` (how the backward
    forms the input gradient; ``"fp8"`` applies to per-channel scales, blocks dequantise). ``model.to(dtype)``
    (and ``.half()``, ...) moves the codes and scales to the device only; the bias and ``compute_dtype`` take the
    new dtype."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        bias: bool,
        compute_dtype: torch.dtype,
        block: int | None = None,
        activations: str = "fp8",
        grad_input: str = "dequant",
        device=None,
    ):
        super().__init__()
        if activations not in FP8_ACTIVATIONS:
            raise ValueError(f"activations {activations!r} is not allowed: one of {', '.join(FP8_ACTIVATIONS)}")
        if grad_input not in FP8_GRAD_INPUT:
            raise ValueError(f"grad_input {grad_input!r} is not allowed: one of {', '.join(FP8_GRAD_INPUT)}")
        self.in_features, self.out_features, self.block = in_features, out_features, block
        self.compute_dtype, self.activations, self.grad_input = compute_dtype, activations, grad_input
        sshape = (out_features, 1) if block is None else (-(-out_features // block), -(-in_features // block))
        self.weight = nn.Parameter(
            torch.empty(out_features, in_features, dtype=FP8_DTYPE, device=device), requires_grad=False
        )
        self.weight_scale = nn.Parameter(torch.ones(sshape, device=device), requires_grad=False)
        self.bias = (
            nn.Parameter(torch.zeros(out_features, dtype=compute_dtype, device=device), requires_grad=False)
            if bias
            else None
        )

    @classmethod
    def from_weight(
        cls,
        weight: torch.Tensor,
        bias: torch.Tensor | None = None,
        *,
        block: int | None = None,
        compute_dtype: torch.dtype | None = None,
        activations: str = "fp8",
    ) -> FP8Linear:
        """The layer for ``weight`` (out, in) and ``bias`` (out,) or None, quantised on the weight's device;
        ``compute_dtype`` defaults to the weight's dtype."""
        dtype = compute_dtype or weight.dtype
        layer = cls(
            weight.shape[1],
            weight.shape[0],
            bias=bias is not None,
            compute_dtype=dtype,
            block=block,
            activations=activations,
            device="meta",
        )
        codes, scale = quantize_fp8(weight, block)
        layer.weight = nn.Parameter(codes, requires_grad=False)
        layer.weight_scale = nn.Parameter(scale, requires_grad=False)
        if bias is not None:
            layer.bias = nn.Parameter(bias.detach().to(device=codes.device, dtype=dtype), requires_grad=False)
        return layer

    def dequantized_weight(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """W (out, in) in ``dtype`` (default ``compute_dtype``)."""
        return dequantize_fp8(self.weight, self.weight_scale, dtype or self.compute_dtype, self.block)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x (..., in) -> (..., out) in x's dtype, computed in ``compute_dtype``."""
        inp_dtype, lead = x.dtype, x.shape[:-1]
        x2 = x.reshape(-1, self.in_features).to(self.compute_dtype)
        bias = None if self.bias is None else self.bias.to(x2.dtype)
        return _FP8Matmul.apply(x2, bias, self).view(*lead, self.out_features).to(inp_dtype)

    def _apply(self, fn, recurse=True):
        # nn.Module.to(dtype) casts every floating tensor, float8 included: the codes (and their fp32 scales) would
        # become plain numbers without their scales. They follow a device change only.
        fp8 = (self.weight, self.weight_scale)

        def keep_dtype(t):
            probe = fn(t.new_empty(0))
            if probe.dtype == t.dtype or not any(t is p for p in fp8):
                return fn(t)
            return t.to(probe.device)

        super()._apply(keep_dtype, recurse)
        self.compute_dtype = fn(torch.empty(0, dtype=self.compute_dtype)).dtype
        return self

    def extra_repr(self) -> str:
        scales = "per channel" if self.block is None else f"{self.block}x{self.block} blocks"
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
            f"fp8 e4m3 ({scales}), compute_dtype={str(self.compute_dtype).removeprefix('torch.')}, "
            f"activations={self.activations}, grad_input={self.grad_input}"
        )


def quantize_model_fp8(
    model: nn.Module,
    *,
    compute_dtype: torch.dtype | None = None,
    device=None,
    block: int | None = None,
    skip_modules=(),
    activations: str = "fp8",
    materialize=None,
) -> dict:
    """Replace ``model``'s linear layers (but ``lm_head`` and ``skip_modules``, substrings of qualified names) by
    :class:`FP8Linear`, in place, one layer at a time: each 16-bit weight goes to ``device`` (default: where it
    is), is quantised there and dropped before the next (peak: one layer in 16 bit and one in fp32 beside the
    FP8 ones). Each new module replaces the old one in its parent. ``compute_dtype``: default each layer's
    weight dtype. ``block``: None (per-channel scales) or ``FP8_BLOCK``. ``materialize(module, name, param)``:
    the values of a parameter on the meta device, made just before its layer is quantised. Returns
    :func:`fp8_report`. The layers left in 16 bit stay where they are."""
    for name in quantizable_linears(model, skip_modules):
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        lin = getattr(parent, child)
        weight, bias = (
            None if p is None else materialize(lin, n, p) if p.is_meta else p.data
            for n, p in (("weight", lin.weight), ("bias", lin.bias))
        )
        target = weight.device if device is None else device
        layer = FP8Linear.from_weight(
            weight.to(target),
            None if bias is None else bias.to(target),
            block=block,
            compute_dtype=compute_dtype or weight.dtype,
            activations=activations,
        )
        del weight, bias
        setattr(parent, child, layer)
        del lin
    return fp8_report(model)


def fp8_report(model: nn.Module) -> dict:
    """What an FP8-quantised model holds: the FP8 layer count, the linear layers kept in 16 bit, the bytes of the
    FP8 weights (1 per weight) and of their fp32 scales, and the scale layout."""
    layers = [m for m in model.modules() if isinstance(m, FP8Linear)]
    blocks = sorted({"per channel" if m.block is None else f"{m.block}x{m.block}" for m in layers})
    return {
        "fp8_layers": len(layers),
        "kept_16bit": [n for n, m in model.named_modules() if type(m) is nn.Linear],
        "fp8_weight_bytes": sum(m.weight.numel() * m.weight.element_size() for m in layers),
        "scale_bytes": sum(m.weight_scale.numel() * m.weight_scale.element_size() for m in layers),
        "scales": blocks,
    }


@functools.cache
def _lora_class() -> type:
    """PEFT's LoRA ``Linear`` over an :class:`FP8Linear` base (made on first use: peft is slow to import)."""
    from peft.tuners.lora import Linear  # lazy: peft at package import

    def _get_in_out_features(self, module):
        return module.in_features, module.out_features

    def merge(self, safe_merge=False, adapter_names=None):
        raise NotImplementedError(
            "a LoRA adapter cannot be merged into FP8 base weights without rounding them "
            "again (the merge would not restore exactly); serve the adapter unmerged"
        )

    return type(
        "FP8LoraLinear",
        (Linear,),
        {
            "_get_in_out_features": _get_in_out_features,
            "merge": merge,
            "__module__": __name__,
            "__doc__": "PEFT's LoRA Linear with an FP8Linear base layer (grpo_kit.model.fp8); the adapter in the base's "
            "compute dtype, the base's FP8 weights never merged",
        },
    )


def __getattr__(name):  # PEP 562: FP8LoraLinear exists once asked for (a pickled PEFT model finds it)
    if name == "FP8LoraLinear":
        return _lora_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def fp8_lora_config(config):
    """``config`` (a PEFT ``LoraConfig``) with the LoRA layer for :class:`FP8Linear` registered (PEFT's
    custom-module mapping), so ``get_peft_model`` (and TRL's ``peft_config``) wraps the FP8 layers it targets.
    Returns the same object."""
    config._register_custom_module({FP8Linear: _lora_class()})
    return config
