"""LoRA merged into the shared base weights for generation, and their exact bits put back afterwards.

With one copy of the weights (:mod:`.shared_weights`) the engine's tensors are the training model's
frozen base weights W. vLLM can run the adapter in its LoRA kernels (``lora_sync="adapter"``), which
costs decode throughput on every token, or generate with dense merged weights, as a separate engine
copy does. Merging into the shared W is sound only if training gets W back bit for bit: ``W += dW``
then ``W -= dW`` in bf16 leaves rounding error in W at every step, and the reference model (the
base) would drift.

Per weight, in row blocks of at most ``CHUNK_ELEMENTS`` elements, with ``dW = scale * B @ A`` in
float32 (float64 for float32 weights):

    merge:    W' = round(W + dW)                  the weight the engine generates with
              R  = round(W' - dW)                 what the restore will compute
              E  = {i : bits(R_i) != bits(W_i)}   the elements R misses: where rounding W + dW
                                                  crossed into a coarser binade, W is tiny next to
                                                  dW, a signed zero or a NaN payload
              keep E's positions and original values (host RAM), and the exact int64 sum of W's bits
    restore:  W = round(W' - dW);  W[E] = the kept values;  the bit sum must match

dW is recomputed at restore from the same A and B (a version check refuses factors changed in
between) by the same kernels on the same shapes, so R is the same; the bit sum catches any
difference. Only E is kept: 0.32% of the elements on the embedded model's bf16 weights with the default
run's adapter, 2.5% with its B scaled by 16 (``bench/results/reversible_merge_cpu.md``).

The merge's temporaries (a few float32 row blocks, ~150 MiB) are freed before vLLM runs its forward passes,
so the generation phase's peak stays the engine's (weights, KV cache, workspace).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

CHUNK_ELEMENTS = 1 << 23  # per row block: float32 temporaries of 32 MiB each, ~140 MiB in all
_INT_VIEW = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32}


class RestoreError(RuntimeError):
    """The base weights could not be given back bit for bit (the message names the weight)."""


_SAME_SIZE_INT = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def bit_sum(t: torch.Tensor) -> int:
    """The int64 sum of ``t``'s bit patterns (any dtype, read as integers of its size): equal for equal bits,
    and any single changed element changes it."""
    return int(t.view(_SAME_SIZE_INT[t.element_size()]).sum(dtype=torch.int64))


def _wide(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float32 else torch.float32


def _delta(factors, r0: int, r1: int, dtype: torch.dtype) -> torch.Tensor:
    """Rows ``r0:r1`` of ``sum(scale * B @ A)`` in ``dtype``: (r1 - r0, in_features)."""
    out = None
    for a, b, scale in factors:
        d = (b[r0:r1].to(dtype) @ a.to(dtype)) * scale
        out = d if out is None else out + d
    return out


def _row_step(weight: torch.Tensor) -> int:
    return max(1, CHUNK_ELEMENTS // max(1, weight.shape[1]))


@dataclass
class MergedWeight:
    """What one merged weight needs to come back: E's flat positions and original values (host), its bit sum."""

    factors: list  # [(A, B, scale)]: the live LoRA parameters, and their versions below
    versions: list
    positions: torch.Tensor
    values: torch.Tensor
    bits: int


def merge_weight(weight: torch.Tensor, factors) -> MergedWeight:
    """``weight`` (out, in), bf16/fp16/fp32, becomes ``round(weight + sum(scale * B @ A))`` in place;
    returns what :func:`restore_weight` needs to give the exact original bits back. ``factors``:
    ``[(A (r, in), B (out, r), scale)]``."""
    if weight.dim() != 2 or not weight.is_contiguous():
        raise ValueError(f"merge_weight needs a contiguous (out, in) weight, got shape {tuple(weight.shape)}, "
                         f"strides {weight.stride()}")
    wide = _wide(weight.dtype)
    ints = _INT_VIEW[weight.dtype]
    pos_dtype = torch.int32 if weight.numel() < 2**31 else torch.int64  # kept in host RAM: half the bytes
    with torch.no_grad():
        bits = bit_sum(weight)
        positions, values = [], []
        step = _row_step(weight)
        for r0 in range(0, weight.shape[0], step):
            r1 = min(r0 + step, weight.shape[0])
            w = weight[r0:r1]
            d = _delta(factors, r0, r1, wide)
            merged = (w.to(wide) + d).to(weight.dtype)
            back = (merged.to(wide) - d).to(weight.dtype)
            miss = (back.view(ints) != w.view(ints)).reshape(-1).nonzero().squeeze(1)
            if miss.numel():
                positions.append((miss + r0 * weight.shape[1]).to("cpu", pos_dtype))
                values.append(w.reshape(-1)[miss].to("cpu"))
            w.copy_(merged)
    empty = torch.empty(0, dtype=pos_dtype), torch.empty(0, dtype=weight.dtype)
    return MergedWeight(factors=list(factors), versions=[(a._version, b._version) for a, b, _ in factors],
                        positions=torch.cat(positions) if positions else empty[0],
                        values=torch.cat(values) if values else empty[1], bits=bits)


def restore_weight(weight: torch.Tensor, saved: MergedWeight, name: str = "weight") -> None:
    """Undo :func:`merge_weight` exactly; :class:`RestoreError` when the bits do not come back."""
    if [(a._version, b._version) for a, b, _ in saved.factors] != saved.versions:
        raise RestoreError(f"{name}: its LoRA factors changed while merged (an optimiser step between merge and "
                           "restore?); the base weight cannot be given back exactly")
    wide = _wide(weight.dtype)
    with torch.no_grad():
        step = _row_step(weight)
        for r0 in range(0, weight.shape[0], step):
            r1 = min(r0 + step, weight.shape[0])
            w = weight[r0:r1]
            w.copy_((w.to(wide) - _delta(saved.factors, r0, r1, wide)).to(weight.dtype))
        if saved.positions.numel():
            weight.view(-1)[saved.positions.to(weight.device, torch.int64)] = saved.values.to(weight.device)
        if bit_sum(weight) != saved.bits:
            raise RestoreError(f"{name}: the restored base weight differs from the original (bit sums differ): "
                               "the LoRA delta was not recomputed identically")


def lora_targets(model) -> list[tuple[str, object]]:
    """``[(name, PEFT LoRA Linear layer)]`` of ``model``'s adapted linear layers, or ValueError naming the
    adapter feature that cannot be merged and restored this way (DoRA, LoRA biases, fan_in_fan_out,
    a non-Linear base layer, an adapter PEFT already merged)."""
    from peft.tuners.lora import LoraLayer

    out, problems = [], []
    for name, module in model.named_modules():
        if not isinstance(module, LoraLayer):
            continue
        base = module.get_base_layer()
        adapters = [a for a in module.active_adapters if a in module.lora_A]
        why = ("its base layer is not nn.Linear" if not isinstance(base, torch.nn.Linear)
               else "PEFT already merged it" if module.merged
               else "fan_in_fan_out" if getattr(module, "fan_in_fan_out", False)
               else "DoRA" if any(module.use_dora.get(a, False) for a in adapters)
               else "a LoRA bias" if any(getattr(module, "lora_bias", {}).get(a, False) for a in adapters) else "")
        if why:
            problems.append(f"{name} ({why})")
        elif adapters:
            out.append((name, module))
    if problems:
        raise ValueError(f"the LoRA adapter cannot be merged into the shared weights and restored: {problems[:3]}; "
                         "use vllm_lora_sync='adapter'")
    if not out:
        raise ValueError("the model has no active LoRA layers to merge")
    return out


class ReversibleLoraMerge:
    """The active LoRA adapter of a PEFT ``model`` merged into its base weights in place, undone exactly.

    :meth:`merge` and :meth:`restore` return ``{"weights", "exceptions", "exception_bytes", "seconds"}``
    (``exceptions``: elements kept to restore, see the module docstring). A failure half way through
    :meth:`merge` restores what it had merged before raising.
    """

    def __init__(self, model):
        self.model = model
        self.targets = lora_targets(model)
        self._saved: dict[str, MergedWeight] | None = None

    @property
    def merged(self) -> bool:
        return self._saved is not None

    def _factors(self, module) -> list:
        if getattr(module, "disable_adapters", False):
            return []
        return [(module.lora_A[a].weight, module.lora_B[a].weight, float(module.scaling[a]))
                for a in module.active_adapters if a in module.lora_A]

    def merge(self) -> dict:
        if self._saved is not None:
            raise RuntimeError("the adapter is already merged; restore() first")
        start = time.perf_counter()
        saved: dict[str, MergedWeight] = {}
        try:
            for name, module in self.targets:
                factors = self._factors(module)
                if factors:
                    saved[name] = merge_weight(module.get_base_layer().weight, factors)
        except BaseException:
            self._saved = saved
            self.restore()
            raise
        self._saved = saved
        return self._report(saved, start)

    def restore(self) -> dict:
        if self._saved is None:
            return {"weights": 0, "exceptions": 0, "exception_bytes": 0, "seconds": 0.0}
        start = time.perf_counter()
        saved, self._saved = self._saved, None
        modules = dict(self.targets)
        for name, entry in saved.items():
            restore_weight(modules[name].get_base_layer().weight, entry, name)
        return self._report(saved, start)

    @staticmethod
    def _report(saved: dict, start: float) -> dict:
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        n = sum(e.positions.numel() for e in saved.values())
        nbytes = sum(e.positions.numel() * e.positions.element_size() + e.values.numel() * e.values.element_size()
                     for e in saved.values())
        return {"weights": len(saved), "exceptions": int(n), "exception_bytes": int(nbytes),
                "seconds": time.perf_counter() - start}
