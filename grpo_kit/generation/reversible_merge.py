"""LoRA merged into the shared base weights for generation, and their exact bits put back afterwards.

With one copy of the weights (:mod:`.shared_weights`) the engine's tensors are the training model's
frozen base weights W. vLLM can run the adapter in its LoRA kernels (``lora_sync="adapter"``), which
costs decode throughput on every token, or generate with dense merged weights, as a separate engine
copy does. Merging into the shared W is sound only if training gets W back bit for bit: ``W += dW``
then ``W -= dW`` in bf16 leaves rounding error in W at every step, and the reference model (the
base) would drift.

Per weight, in row blocks of at most ``CHUNK_ELEMENTS`` elements, with ``dW = scale * B @ A`` in
float32 (float64 for float32 weights; float32 matmuls at full precision, no TF32):

    merge:    W' = round(W + dW)                  the weight the engine generates with
              R  = round(W' - dW)                 what the restore will compute
              E  = {i : bits(R_i) != bits(W_i)}   the elements R misses: where rounding W + dW
                                                  crossed into a coarser binade, W is tiny next to
                                                  dW, a signed zero or a NaN payload
              keep E's positions and original values (host RAM), a position-weighted checksum of
              W's bits, and checksums of A and B
    restore:  W = round(W' - dW);  W[E] = the kept values;  the checksums must match

dW is recomputed at restore from the same A and B (their checksums refuse factors changed in between)
by the same kernels on the same block shapes, so R is the same; W's checksum catches any difference.
Only E is kept: 0.32% of the elements on the embedded model's bf16 weights with the default run's
adapter, 2.5% with its B scaled by 16 (``bench/results/reversible_merge_cpu.md``); a merge that would keep
more than ``MAX_KEPT_SHARE`` of a weight, or whose delta is not finite, is refused and undone.

Failures leave nothing half done: a merge that fails part way through a weight undoes the blocks it
wrote; a restore records its progress per block, so after a failure (out of memory, say) another
:meth:`ReversibleLoraMerge.restore` continues where it stopped.

The temporaries (a few float32 row blocks, ~150 MiB) are freed before vLLM runs its forward passes,
so the generation phase's peak stays the engine's (weights, KV cache, workspace).
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

CHUNK_ELEMENTS = 1 << 23  # per row block: float32 temporaries of 32 MiB each, ~150 MiB in all
MAX_KEPT_SHARE = 0.25  # a merge keeping more of a weight than this is refused (seen: 0.3%-2.5%)
_INT_VIEW = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32}
_SAME_SIZE_INT = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_WEIGHTS_CACHE: dict = {}  # the checksum's position weights per device (errors that cancel in a plain sum do not)


class RestoreError(RuntimeError):
    """The base weights could not be given back bit for bit (the message names the weight)."""


def _position_weights(n: int, device) -> torch.Tensor:
    """1..32768 by position within a block of ``CHUNK_ELEMENTS`` (int32), made once per device."""
    key = (str(device), CHUNK_ELEMENTS)
    if key not in _WEIGHTS_CACHE:
        _WEIGHTS_CACHE[key] = (torch.arange(CHUNK_ELEMENTS, dtype=torch.int32, device=device) & 32767) + 1
    return _WEIGHTS_CACHE[key][:n]


def bit_sum(t: torch.Tensor) -> int:
    """A checksum of ``t``'s bit patterns (any dtype, read as integers of its size), each weighted by its
    position (1..32768), summed in int64 per block: equal for equal bits; a single changed element, or two
    that change by opposite amounts, change it. 16-bit patterns times the weights fit int32 (half the bytes
    of int64 arithmetic; 2.6x faster on the CPU)."""
    flat = t.detach().reshape(-1).view(_SAME_SIZE_INT[t.element_size()])
    wide = torch.int32 if t.element_size() <= 2 else torch.int64  # wider patterns wrap in int64: still exact
    total = 0
    for s in range(0, flat.numel(), CHUNK_ELEMENTS):
        x = flat[s:s + CHUNK_ELEMENTS]
        total += int((x.to(wide) * _position_weights(x.numel(), x.device).to(wide)).sum(dtype=torch.int64))
    return total


@contextmanager
def _full_precision():
    """float32 matmuls at full precision (no TF32) while the delta is formed, whatever the caller set: the
    merge and the restore must compute it the same way."""
    old = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(old)


def _wide(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float32 else torch.float32


def _delta(factors, r0: int, r1: int, dtype: torch.dtype) -> torch.Tensor:
    """Rows ``r0:r1`` of ``sum(scale * B @ A)`` in ``dtype``: (r1 - r0, in_features)."""
    out = None
    for a, b, scale in factors:
        d = (b[r0:r1].to(dtype) @ a.to(dtype)) * scale
        out = d if out is None else out + d
    return out


@dataclass
class MergedWeight:
    """What one merged weight needs to come back: per row block, E's flat positions and original values
    (host RAM); the checksums of the weight and of its factors; how many rows a restore has given back."""

    factors: list  # [(A, B, scale)]: the live LoRA parameters
    factor_sums: list
    rows_per_block: int
    blocks: list = field(default_factory=list)  # [(first row, positions, values)]
    bits: int = 0
    restored_rows: int = 0

    @property
    def kept(self) -> int:
        return sum(p.numel() for _, p, _ in self.blocks)

    @property
    def kept_bytes(self) -> int:
        return sum(p.numel() * p.element_size() + v.numel() * v.element_size() for _, p, v in self.blocks)


def _factor_sums(factors) -> list:
    return [(bit_sum(a), bit_sum(b)) for a, b, _ in factors]


def _restore_rows(weight: torch.Tensor, saved: MergedWeight, end: int) -> None:
    """Give rows ``saved.restored_rows:end`` back (block by block, progress recorded after each)."""
    wide = _wide(weight.dtype)
    flat = weight.view(-1)
    step = saved.rows_per_block
    kept = {r0: (p, v) for r0, p, v in saved.blocks}
    with torch.no_grad(), _full_precision():
        for r0 in range(saved.restored_rows, end, step):
            r1 = min(r0 + step, end)
            w = weight[r0:r1]
            w.copy_((w.to(wide) - _delta(saved.factors, r0, r1, wide)).to(weight.dtype))
            if r0 in kept:
                positions, values = kept[r0]
                flat[positions.to(weight.device, torch.int64)] = values.to(weight.device)
            saved.restored_rows = r1


def merge_weight(weight: torch.Tensor, factors, name: str = "weight") -> MergedWeight:
    """``weight`` (out, in), bf16/fp16/fp32, becomes ``round(weight + sum(scale * B @ A))`` in place;
    returns what :func:`restore_weight` needs to give the exact original bits back. ``factors``:
    ``[(A (r, in), B (out, r), scale)]``. A failure part way (out of memory, a delta that is not finite,
    too many elements to keep) gives the rows already merged back before it raises."""
    if weight.dim() != 2 or not weight.is_contiguous():
        raise ValueError(f"{name}: merge_weight needs a contiguous (out, in) weight, got shape "
                         f"{tuple(weight.shape)}, strides {weight.stride()}")
    wide = _wide(weight.dtype)
    ints = _INT_VIEW[weight.dtype]
    pos_dtype = torch.int32 if weight.numel() < 2**31 else torch.int64  # kept in host RAM: half the bytes
    saved = MergedWeight(factors=list(factors), factor_sums=_factor_sums(factors), bits=bit_sum(weight),
                         rows_per_block=max(1, CHUNK_ELEMENTS // max(1, weight.shape[1])))
    step, limit, kept = saved.rows_per_block, MAX_KEPT_SHARE * weight.numel(), 0
    done = 0
    try:
        with torch.no_grad(), _full_precision():
            for r0 in range(0, weight.shape[0], step):
                r1 = min(r0 + step, weight.shape[0])
                w = weight[r0:r1]
                d = _delta(factors, r0, r1, wide)
                if not bool(torch.isfinite(d).all()):
                    raise ValueError(f"{name}: the LoRA delta is not finite (NaN or inf in the adapter)")
                merged = (w.to(wide) + d).to(weight.dtype)
                back = (merged.to(wide) - d).to(weight.dtype)
                miss = (back.view(ints) != w.view(ints)).reshape(-1).nonzero().squeeze(1)
                kept += miss.numel()
                if kept > limit:
                    raise ValueError(f"{name}: the merge would keep more than {MAX_KEPT_SHARE:.0%} of the weight's "
                                     "elements to restore it (an adapter far larger than the weights); use "
                                     "vllm_lora_sync='adapter'")
                if miss.numel():
                    saved.blocks.append((r0, (miss + r0 * weight.shape[1]).to("cpu", pos_dtype),
                                         w.reshape(-1)[miss].to("cpu")))
                w.copy_(merged)
                done = r1
    except BaseException:
        _restore_rows(weight, saved, done)  # the blocks already written; nothing merged is left behind
        raise
    return saved


def restore_weight(weight: torch.Tensor, saved: MergedWeight, name: str = "weight") -> None:
    """Undo :func:`merge_weight` exactly; :class:`RestoreError` when the bits cannot come back. Continues a
    restore that stopped part way (``saved.restored_rows``)."""
    if _factor_sums(saved.factors) != saved.factor_sums:
        raise RestoreError(f"{name}: its LoRA factors changed while merged (an optimiser step between merge and "
                           "restore?); the base weight cannot be given back exactly")
    _restore_rows(weight, saved, weight.shape[0])
    if bit_sum(weight) != saved.bits:
        raise RestoreError(f"{name}: the restored base weight differs from the original (checksums differ): "
                           "the LoRA delta was not recomputed identically")


def lora_targets(model) -> list[tuple[str, object]]:
    """``[(name, PEFT LoRA Linear layer)]`` of ``model``'s adapted linear layers, or ValueError naming what
    cannot be merged and restored this way: LoRA variants (DoRA, ...), LoRA biases, fan_in_fan_out, a
    non-Linear base layer, an adapter PEFT already merged, a base weight tied to another parameter (a tied
    head would move the embedding too), modules_to_save or trainable tokens (trained copies the engine does
    not have)."""
    from peft.tuners.lora import LoraLayer

    problems = []
    peft_config = getattr(model, "peft_config", {}).get(getattr(model, "active_adapter", None))
    for what in ("modules_to_save", "trainable_token_indices"):
        if getattr(peft_config, what, None):
            problems.append(f"{what}={getattr(peft_config, what)!r}")
    owners: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        owners.setdefault(p.data_ptr(), []).append(name)
    out = []
    for name, module in model.named_modules():
        if not isinstance(module, LoraLayer):
            continue
        base = module.get_base_layer()
        adapters = [a for a in module.active_adapters if a in module.lora_A]
        tied = [n for n in owners.get(base.weight.data_ptr(), []) if not n.startswith(f"{name}.")] \
            if isinstance(base, torch.nn.Linear) else []
        why = ("its base layer is not nn.Linear" if not isinstance(base, torch.nn.Linear)
               else "PEFT already merged it" if module.merged
               else "fan_in_fan_out" if getattr(module, "fan_in_fan_out", False)
               else "a LoRA variant (DoRA, ...)" if any(module.use_dora.get(a, False)
                                                        or getattr(module, "lora_variant", {}).get(a) for a in adapters)
               else "a LoRA bias" if any(getattr(module, "lora_bias", {}).get(a, False) for a in adapters)
               else f"its weight is tied to {tied[:2]}" if tied else "")
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
    :meth:`merge` gives back what it had merged before raising; a failed :meth:`restore` keeps what is
    still merged, and calling it again continues.
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
        self._saved = {}
        try:
            for name, module in self.targets:
                factors = self._factors(module)
                if factors:
                    self._saved[name] = merge_weight(module.get_base_layer().weight, factors, name)
        except BaseException:
            self.restore()
            raise
        return self._report(self._saved, start)

    def restore(self) -> dict:
        """Give every merged weight back; :class:`RestoreError` naming those that could not be (they stay
        recorded, so a later call tries them again)."""
        if self._saved is None:
            return {"weights": 0, "exceptions": 0, "exception_bytes": 0, "seconds": 0.0}
        start = time.perf_counter()
        done, failed = dict(self._saved), []
        modules = dict(self.targets)
        for name, entry in list(self._saved.items()):
            try:
                restore_weight(modules[name].get_base_layer().weight, entry, name)
                del self._saved[name]
            except Exception as e:  # try every weight; say all that failed
                failed.append((name, e))
        if failed:
            raise RestoreError(f"{len(failed)} base weights could not be given back ({[n for n, _ in failed][:3]}): "
                               f"{type(failed[0][1]).__name__}: {failed[0][1]}") from failed[0][1]
        self._saved = None
        return self._report(done, start)

    @staticmethod
    def _report(saved: dict, start: float) -> dict:
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        return {"weights": len(saved), "exceptions": sum(e.kept for e in saved.values()),
                "exception_bytes": sum(e.kept_bytes for e in saved.values()), "seconds": time.perf_counter() - start}
