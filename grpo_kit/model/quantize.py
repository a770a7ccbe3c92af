"""4-bit base weights for LoRA training (QLoRA) and the "dynamic" choice of what stays in 16 bit.

NF4 (Dettmers et al. 2023, *QLoRA*): each block of 64 weights is divided by its absolute maximum and
rounded to the nearest of 16 levels placed at the quantiles of a normal distribution; with double
quantisation the fp32 absmax constants are themselves stored in 8 bit (blocks of 256), 4.127 bits per
weight in all (``kernels.nf4_dequant.NF4_BITS_PER_PARAM``). bitsandbytes' ``Linear4bit`` dequantises its
weight to the compute dtype for each matmul, forward and backward; the weight never trains, LoRA on top
does (PEFT wraps ``Linear4bit`` like ``nn.Linear``).

Only ``nn.Linear`` modules are quantised: embeddings and norms are not linear layers, and ``lm_head``
always stays in 16 bit because the kit's efficient loss reads the head weight as a dense matrix, chunk by
chunk (``ALWAYS_16BIT``). ``skip_modules`` keeps more in 16 bit: names are matched as substrings of the
module's qualified name (``down_proj``, ``model.layers.0.``).

Dynamic 4-bit (:func:`auto_skip_modules`): the rule and why.
    For each candidate layer with weight W and the inputs X it sees on a short calibration pass,
        e(W) = ||X (W - Q(W))^T||_F / ||X W^T||_F,
    the relative error NF4 puts into that layer's output. It is measured on real activations rather than
    on the weights alone because that is where NF4 goes wrong: a few input channels carry activations
    orders of magnitude above the rest (Dettmers et al. 2022, *LLM.int8()*), so the rounding error of the
    weight columns they multiply dominates the output; a weight-only error cannot see that. Keeping a
    layer costs its extra bytes x(W) (16-bit size minus 4-bit size), so under a byte allowance the layers
    are taken in decreasing order of error per extra byte, e(W) / x(W) (the greedy rule for a knapsack),
    while they fit; a layer that does not fit is passed over for smaller ones further down the list.
    Ranking by e alone spends the allowance on a few large layers and leaves a larger log-prob error for the
    same bytes (the ``qlora_quality`` benchmark compares the two).

Everything here runs wherever bitsandbytes does (CUDA; its CPU backend too, which the tests use); the app
(``config`` / ``run``) accepts ``load_in_4bit`` on CUDA only.
"""

from __future__ import annotations

import importlib.util
import re
import sys

import torch
from torch import nn

from grpo_kit.kernels.nf4_dequant import NF4_BITS_PER_PARAM, NF4_BLOCK

__all__ = [
    "ALWAYS_16BIT",
    "NF4_BLOCK",
    "check_bitsandbytes",
    "quantizable_linears",
    "quantize_model",
    "nf4_load_config",
    "quantization_report",
    "nf4_roundtrip",
    "layer_errors",
    "auto_skip_modules",
    "is_quantized",
    "dequantized_weight",
]

ALWAYS_16BIT = ("lm_head",)
BNB_INSTALL = "python -m pip install bitsandbytes==0.50.2"


def check_bitsandbytes() -> None:
    """ImportError with the install command when bitsandbytes is missing."""
    if importlib.util.find_spec("bitsandbytes") is None:
        raise ImportError(f"4-bit weights need the bitsandbytes package, which is not installed: {BNB_INSTALL}")


def _skipped(name: str, skip_modules) -> bool:
    return any(s in name for s in (*ALWAYS_16BIT, *skip_modules))


def quantizable_linears(model: nn.Module, skip_modules=()) -> list[str]:
    """Qualified names of the ``nn.Linear`` modules :func:`quantize_model` would turn into NF4."""
    return [n for n, m in model.named_modules() if type(m) is nn.Linear and not _skipped(n, skip_modules)]


def is_quantized(module: nn.Module) -> bool:
    bnb = sys.modules.get("bitsandbytes")
    return bnb is not None and isinstance(module, bnb.nn.Linear4bit)


def _values(module: nn.Module, name: str, materialize):
    """The tensor behind ``module.<name>`` (None if it has none); a meta parameter gets ``materialize``'s."""
    p = getattr(module, name)
    if p is None:
        return None
    return materialize(module, name, p) if p.is_meta else p.data


def quantize_model(model: nn.Module, *, compute_dtype: torch.dtype, device, skip_modules=(), materialize=None) -> dict:
    """Replace ``model``'s linear layers (but ``lm_head`` and ``skip_modules``) by NF4 ``Linear4bit``
    with double quantisation, in place, one layer at a time (peak: one 16-bit layer beside the rest).

    ``compute_dtype``: the dtype each matmul dequantises to (the training dtype: bf16, or fp16 on a T4).
    ``device``: where the quantised weights go (quantisation happens there). The layers left in 16 bit
    stay where they are; move the model to ``device`` afterwards. ``materialize(module, name, param)``:
    the values of a parameter on the meta device (a random model built straight on ``device``), created
    just before its layer is quantised. Returns a report: counts, the names kept in 16 bit, and the bytes
    the quantised weights hold (packed 4-bit data + absmax constants).
    """
    check_bitsandbytes()
    import bitsandbytes as bnb  # lazy: bitsandbytes is optional

    names = quantizable_linears(model, skip_modules)
    for name in names:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        lin = getattr(parent, child)
        q = bnb.nn.Linear4bit(
            lin.in_features,
            lin.out_features,
            bias=lin.bias is not None,
            compute_dtype=compute_dtype,
            compress_statistics=True,
            quant_type="nf4",
            device="meta",
        )
        weight, bias = _values(lin, "weight", materialize), _values(lin, "bias", materialize)
        q.weight = bnb.nn.Params4bit(
            weight.to(compute_dtype),
            requires_grad=False,
            quant_type="nf4",
            compress_statistics=True,
            blocksize=NF4_BLOCK,
        )
        del weight
        if bias is not None:
            q.bias = nn.Parameter(bias.to(compute_dtype), requires_grad=False)
        q = q.to(device)  # quantises the weight on that device
        setattr(parent, child, q)
        del lin
    return quantization_report(model, compute_dtype)


def quantization_report(model: nn.Module, compute_dtype: torch.dtype) -> dict:
    """What a quantised model holds: NF4 layer count, the linear layers kept in 16 bit, the bytes of the NF4
    weights (packed 4-bit data + absmax constants) and the compute dtype."""
    quantized = [m for m in model.modules() if is_quantized(m)]
    kept = [n for n, m in model.named_modules() if type(m) is nn.Linear]
    return {
        "quantized_layers": len(quantized),
        "kept_16bit": kept,
        "quantized_weight_bytes": sum(_quantized_bytes(m.weight) for m in quantized),
        "compute_dtype": str(compute_dtype).removeprefix("torch."),
    }


def nf4_load_config(compute_dtype: torch.dtype, keep_16bit):
    """transformers' ``BitsAndBytesConfig`` for the NF4 that :func:`quantize_model` makes (double
    quantisation, blocks of ``NF4_BLOCK``), for ``from_pretrained`` to quantise each weight as it loads.
    ``keep_16bit``: the exact qualified names of the linear layers to keep (transformers matches its skip
    list as regex prefixes and suffixes; escaped and anchored, each name matches only itself)."""
    check_bitsandbytes()
    from transformers import BitsAndBytesConfig  # lazy: transformers is slow to import

    return BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=compute_dtype,
        llm_int8_skip_modules=[re.escape(n) + "$" for n in keep_16bit],
    )


def _quantized_bytes(p) -> int:
    qs = p.quant_state
    n = p.numel() * p.element_size()
    if qs.nested:
        n += qs.absmax.numel() * qs.absmax.element_size() + qs.state2.absmax.numel() * 4 + 256 * 4
    else:
        n += qs.absmax.numel() * 4
    return int(n)


def dequantized_weight(module: nn.Module) -> torch.Tensor:
    """The weight a ``Linear4bit`` multiplies with (its NF4 data dequantised), or a plain layer's weight."""
    if is_quantized(module):
        import bitsandbytes.functional as BF  # lazy: bitsandbytes is optional

        return BF.dequantize_4bit(module.weight.data, module.weight.quant_state)
    return module.weight


def nf4_roundtrip(weight: torch.Tensor) -> torch.Tensor:
    """``Q(W)``: ``weight`` (out, in) quantised to NF4 with double quantisation and dequantised, same dtype."""
    check_bitsandbytes()
    import bitsandbytes.functional as BF  # lazy: bitsandbytes is optional

    w = weight.detach()
    q, state = BF.quantize_4bit(w.contiguous(), blocksize=NF4_BLOCK, compress_statistics=True, quant_type="nf4")
    return BF.dequantize_4bit(q, state).to(w.dtype).view_as(w)


@torch.no_grad()
def layer_errors(model: nn.Module, batches, *, skip_modules=(), max_tokens: int = 4096) -> dict[str, float]:
    """``e(W)`` of the module docstring for every quantisable linear layer, from one forward pass of
    ``model`` (still 16-bit) over ``batches`` (an iterable of ``input_ids`` (B, T) long tensors, or dicts of
    model inputs); at most ``max_tokens`` input rows per layer are kept (the first ones)."""
    names = quantizable_linears(model, skip_modules)
    inputs: dict[str, list[torch.Tensor]] = {n: [] for n in names}
    seen = dict.fromkeys(names, 0)

    def hook(name):
        def fn(_module, args):
            if seen[name] < max_tokens:
                x = args[0].reshape(-1, args[0].shape[-1])[: max_tokens - seen[name]]
                inputs[name].append(x.detach())
                seen[name] += x.shape[0]

        return fn

    handles = [model.get_submodule(n).register_forward_pre_hook(hook(n)) for n in names]
    try:
        for batch in batches:
            model(**batch) if isinstance(batch, dict) else model(input_ids=batch)
    finally:
        for h in handles:
            h.remove()
    errors = {}
    for n in names:
        if not inputs[n]:
            continue
        w = model.get_submodule(n).weight
        x = torch.cat(inputs[n]).to(torch.float32)
        wf = w.detach().to(torch.float32)
        diff = wf - nf4_roundtrip(w).to(torch.float32)
        errors[n] = float(torch.linalg.norm(x @ diff.T) / torch.linalg.norm(x @ wf.T).clamp_min(1e-30))
    return errors


def auto_skip_modules(
    model: nn.Module, batches, *, allowance_bytes: float, skip_modules=(), dtype_bytes: int = 2
) -> tuple[list[str], dict]:
    """The layers ``load_in_4bit_skip_modules: auto`` keeps in 16 bit (rule: module docstring), beside the
    fixed ``skip_modules``. ``allowance_bytes``: the extra memory they may cost, each costing its 16-bit
    size (``dtype_bytes`` per weight) minus its NF4 size. Returns ``(names, report)``; the report holds
    every layer's error, the chosen ones and the bytes spent."""

    errors = layer_errors(model, batches, skip_modules=skip_modules)
    extra = {n: model.get_submodule(n).weight.numel() * (dtype_bytes - NF4_BITS_PER_PARAM / 8) for n in errors}
    chosen, spent = [], 0.0
    for name in sorted(errors, key=lambda n: errors[n] / extra[n], reverse=True):
        if spent + extra[name] <= allowance_bytes:
            chosen.append(name)
            spent += extra[name]
    report = {
        "rule": "relative NF4 output error on calibration activations per extra 16-bit byte, largest first, "
        "within the allowance",
        "allowance_bytes": int(allowance_bytes),
        "extra_bytes": int(spent),
        "chosen": chosen,
        "errors": {k: round(v, 6) for k, v in sorted(errors.items(), key=lambda kv: -kv[1])},
    }
    return chosen, report
