"""LoRA merged into the shared base weights for generation, and their exact bits put back afterwards.

With one copy of the weights (:mod:`.shared_weights`) the engine's tensors are the training model's
frozen base weights W. vLLM can run the adapter in its LoRA kernels (``lora_sync="adapter"``), which
costs decode throughput on every token, or generate with dense merged weights, as a separate engine
copy does. Merging into the shared W is sound only if training gets W back bit for bit: ``W += dW``
then ``W -= dW`` in bf16 leaves rounding error in W at every step, and the reference model (the
base) would drift.

Per weight, with ``dW = sum_i s_i B_i @ A_i`` in float32 (float64 for float32 weights; float32
matmuls at full precision, no TF32):

    scan:     W' = round(W + dW)                  the weight the engine generates with
              R  = round(W' - dW)                 what the restore will compute
              E  = {i : bits(R_i) != bits(W_i)}   the elements R misses: where rounding W + dW
                                                  crossed into a coarser binade, W is tiny next to
                                                  dW, a signed zero or a NaN payload
              keep E's positions and original values (host RAM), a checksum of W's bits and of the
              factors; refuse (nothing written yet) when E is over MAX_KEPT_SHARE of the weight
    merge:    W <- W'
    restore:  W <- round(W' - dW);  W[E] = the kept values;  the checksums must match

dW is recomputed at restore from the same factors (their checksums refuse factors changed in between)
by the same implementation on the same shapes, so R is the same; W's checksum catches any difference.
The passes are :mod:`grpo_kit.kernels.lora_merge`'s: one Triton kernel on CUDA (16-bit weights), torch
row blocks elsewhere. Only E is kept, a small share of the elements (the ``reversible_merge`` and ``rl_step``
benchmarks measure it).

Failures leave nothing half done: the scan writes nothing; a torch merge that fails part way gives
back the row blocks it wrote before raising; a torch restore records its progress per block, so after
a failure (out of memory, say) another :meth:`ReversibleLoraMerge.restore` continues where it stopped.

The temporaries (the scan's int8 mask of the largest weight, and on the torch path a few float32 row
blocks) are freed before vLLM runs its forward passes, so the generation phase's peak stays the
engine's (weights, KV cache, workspace).
"""

from __future__ import annotations

import math
import time
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from grpo_kit.kernels import lora_merge as K
from grpo_kit.kernels.lora_merge import bit_sum  # noqa: F401  (the checksum, part of this module's interface)
from grpo_kit.model.fp8 import FP8Linear

MAX_KEPT_SHARE = 0.25  # a merge keeping more of a weight than this is refused (seen: 0.3%-2.5%)


class RestoreError(RuntimeError):
    """The base weights could not be given back bit for bit (the message names the weight)."""


@contextmanager
def _full_precision():
    """float32 matmuls at full precision (no TF32) while dW is formed on the torch path, whatever the
    caller set: the merge and the restore must compute it the same way."""
    old = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(old)


@dataclass
class MergedWeight:
    """What one merged weight needs to come back: E's flat positions and original values (host RAM), the
    checksums of the weight and of its factors (0-dim int64 tensors on the weight's and the factors' devices:
    nothing waits for them until a restore compares them), the pass implementation, and the restore's
    progress."""

    factors: list  # [(A, B, scale)]: the live LoRA parameters
    factor_sum: torch.Tensor
    backend: str  # "triton" | "torch": the restore runs the merge's implementation
    positions: torch.Tensor
    values: torch.Tensor
    bits: torch.Tensor
    restored_rows: int = 0
    restored_bits: torch.Tensor | None = None  # checksum of R once every row is restored (before E is put back)
    difference: torch.Tensor | None = None  # restored checksum - original, once E is back (0: every bit back)

    @property
    def kept(self) -> int:
        return self.positions.numel()

    @property
    def kept_bytes(self) -> int:
        return self.positions.numel() * self.positions.element_size() + self.values.numel() * self.values.element_size()


def _factor_sum(factors) -> torch.Tensor:
    """One checksum over every factor's bits (0-dim int64): the factors flattened side by side."""
    return bit_sum(torch.cat([x.detach().reshape(-1) for a, b, _ in factors for x in (a, b)]))


def _read(scalars: list) -> list:
    """The values of 0-dim tensors (on any devices) as Python numbers, with one wait for all."""
    return torch.stack([t.to(scalars[0].device) for t in scalars]).tolist() if scalars else []


def _non_finite(factor_lists: list) -> list[bool]:
    """For each weight's ``[(A, B, scale)]``: whether a scale, or any factor element, is NaN or inf (one wait
    for all)."""
    finite = _read(
        [
            torch.stack([torch.isfinite(x).all() for a, b, _ in factors for x in (a, b)]).all()
            for factors in factor_lists
        ]
    )
    return [
        not (ok and all(math.isfinite(float(s)) for _, _, s in factors)) for ok, factors in zip(finite, factor_lists)
    ]


def _factors_changed(entries: list) -> list[bool]:
    """For each :class:`MergedWeight`: whether its factors changed since the merge (one wait for all)."""
    return [d != 0 for d in _read([_factor_sum(e.factors) - e.factor_sum for e in entries])]


def _folded(factors, weight):
    return K.fold_factors(factors, weight.device, K._wide(weight.dtype))


_PINNED_MAX_BYTES = 64 * 2**20  # larger kept sets are copied with a wait: page-locked memory is never given back


def _to_host(t: torch.Tensor) -> torch.Tensor:
    """A host copy of ``t``; from CUDA, when small, page-locked and asynchronous (ordered before what follows
    on the current stream: the restore, which runs on the same stream, copies it back after)."""
    if t.device.type != "cuda" or t.numel() * t.element_size() > _PINNED_MAX_BYTES:
        return t.to("cpu")
    out = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    return out.copy_(t, non_blocking=True)


def _put_back(weight: torch.Tensor, positions: torch.Tensor, values: torch.Tensor) -> None:
    if positions.numel():
        weight.view(-1)[positions.to(weight.device, torch.int64, non_blocking=True)] = values.to(
            weight.device, non_blocking=True
        )


def merge_weight(weight: torch.Tensor, factors, name: str = "weight", finite_checked: bool = False) -> MergedWeight:
    """``weight`` (out, in), bf16/fp16/fp32, becomes ``round(weight + sum(scale * B @ A))`` in place;
    returns what :func:`restore_weight` needs to give the exact original bits back. ``factors``:
    ``[(A (r, in), B (out, r), scale)]``. Factors that are not finite (unless the caller checked them:
    ``finite_checked``), or too many elements to keep, are refused before anything is written; a torch merge
    failing part way gives its rows back first. Waits on the GPU: the kept elements' count, the finite check
    unless ``finite_checked``, and the kernel's probe on its first use per (device, dtype, rank)."""
    if weight.dim() != 2 or not weight.is_contiguous():
        raise ValueError(
            f"{name}: merge_weight needs a contiguous (out, in) weight, got shape "
            f"{tuple(weight.shape)}, strides {weight.stride()}"
        )
    if not finite_checked and _non_finite([factors])[0]:
        raise ValueError(f"{name}: the LoRA factors are not finite (NaN or inf in the adapter)")
    with torch.no_grad(), _full_precision():
        b, a = _folded(factors, weight)
        usable = K.triton_usable(weight) and K.kernel_round_trips(str(weight.device), weight.dtype, b.shape[1])
        backend = "triton" if usable else "torch"
        miss, bits = K.run_triton(K.SCAN, weight, b, a) if backend == "triton" else K.scan_torch(weight, b, a)
        positions = miss.view(-1).nonzero().squeeze(1)  # the wait
        del miss
        if positions.numel() > MAX_KEPT_SHARE * weight.numel():
            raise ValueError(
                f"{name}: the merge would keep more than {MAX_KEPT_SHARE:.0%} of the weight's elements "
                "to restore it (an adapter far larger than the weights); use vllm_lora_sync='adapter'"
            )
        saved = MergedWeight(
            factors=list(factors),
            factor_sum=_factor_sum(factors),
            backend=backend,
            positions=_to_host(positions.to(torch.int32 if weight.numel() < 2**31 else torch.int64)),
            values=_to_host(weight.view(-1)[positions]),
            bits=bits,
        )
        if backend == "triton":
            K.run_triton(K.MERGE, weight, b, a)
            return saved
        done = 0
        try:
            for done in K.merge_rows_torch(weight, b, a, 0, weight.shape[0]):
                pass
        except BaseException:  # give the rows already written back, then raise
            for _ in K.restore_rows_torch(weight, b, a, 0, done):
                pass
            inside = positions < done * weight.shape[1]  # on the weight's device, as is the copy of the values
            _put_back(weight, positions[inside], saved.values.to(weight.device, non_blocking=True)[inside])
            raise
    return saved


def _restore(weight: torch.Tensor, saved: MergedWeight) -> torch.Tensor:
    """Undo the merge (continuing one that stopped part way: ``saved.restored_rows``) and put E back; returns
    the difference between the result's checksum and the original's (0-dim int64; 0 when every bit is back)
    without waiting for it. Once E is back the difference is recorded: a second call returns it (the weight no
    longer shows what R was at E)."""
    if saved.difference is not None:
        return saved.difference
    rows = weight.shape[0]
    with torch.no_grad(), _full_precision():
        if saved.restored_rows < rows:
            b, a = _folded(saved.factors, weight)
            if saved.backend == "triton":
                _, saved.restored_bits = K.run_triton(K.RESTORE, weight, b, a)
                saved.restored_rows = rows
            else:
                for end in K.restore_rows_torch(weight, b, a, saved.restored_rows, rows):
                    saved.restored_rows = end
        if saved.restored_bits is None:
            saved.restored_bits = bit_sum(weight)
        # W's checksum = R's + what putting E back changes: (bits(W_e) - bits(R_e)) x their position weights
        pos = saved.positions.to(weight.device, torch.int64, non_blocking=True)
        ints = K._SAME_SIZE_INT[weight.element_size()]
        values = saved.values.to(weight.device, non_blocking=True)
        r_e = weight.view(-1)[pos].view(ints).to(torch.int64)
        change = ((values.view(ints).to(torch.int64) - r_e) * (pos % K._WEIGHT_PERIOD + 1)).sum()
        difference = saved.restored_bits + change - saved.bits
        _put_back(weight, pos, values)
        saved.difference = difference
    return difference


_CHANGED = (
    "its LoRA factors changed while merged (an optimiser step between merge and restore?); the base weight "
    "cannot be given back exactly"
)
_DIFFERS = (
    "the restored base weight differs from the original (checksums differ): the LoRA delta was not "
    "recomputed identically"
)


def restore_weight(weight: torch.Tensor, saved: MergedWeight, name: str = "weight") -> None:
    """Undo :func:`merge_weight` exactly; :class:`RestoreError` when the bits cannot come back. Continues a
    restore that stopped part way (``saved.restored_rows``)."""
    if _factors_changed([saved])[0]:
        raise RestoreError(f"{name}: {_CHANGED}")
    if int(_restore(weight, saved)) != 0:
        raise RestoreError(f"{name}: {_DIFFERS}")


def lora_targets(model) -> list[tuple[str, object]]:
    """``[(name, PEFT LoRA Linear layer)]`` of ``model``'s adapted linear layers, or ValueError naming what
    cannot be merged and restored this way: LoRA variants (DoRA, ...), LoRA biases, fan_in_fan_out, a
    non-Linear base layer, an adapter PEFT already merged, a base weight tied to another parameter (a tied
    head would move the embedding too), modules_to_save or trainable tokens (trained copies the engine does
    not have)."""
    from peft.tuners.lora import LoraLayer  # lazy: peft is slow to import (it pulls in bitsandbytes)

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
        tied = (
            [n for n in owners.get(base.weight.data_ptr(), []) if not n.startswith(f"{name}.")]
            if isinstance(base, torch.nn.Linear)
            else []
        )
        why = (
            "FP8 base weights: merging into them would round them again, so their exact bits could not be restored"
            if isinstance(base, FP8Linear)
            else "its base layer is not nn.Linear"
            if not isinstance(base, torch.nn.Linear)
            else "PEFT already merged it"
            if module.merged
            else "fan_in_fan_out"
            if getattr(module, "fan_in_fan_out", False)
            else "a LoRA variant (DoRA, ...)"
            if any(module.use_dora.get(a, False) or getattr(module, "lora_variant", {}).get(a) for a in adapters)
            else "a LoRA bias"
            if any(getattr(module, "lora_bias", {}).get(a, False) for a in adapters)
            else f"its weight is tied to {tied[:2]}"
            if tied
            else ""
        )
        if why:
            problems.append(f"{name} ({why})")
        elif adapters:
            out.append((name, module))
    if problems:
        raise ValueError(
            f"the LoRA adapter cannot be merged into the shared weights and restored: {problems[:3]}; "
            "use vllm_lora_sync='adapter'"
        )
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
        return [
            (module.lora_A[a].weight, module.lora_B[a].weight, float(module.scaling[a]))
            for a in module.active_adapters
            if a in module.lora_A
        ]

    def merge(self) -> dict:
        """Merge every adapted weight; ValueError (nothing merged) for factors that are not finite. The GPU
        is waited on once for all factors, then once per weight (its kept elements' count), then synchronised."""
        if self._saved is not None:
            raise RuntimeError("the adapter is already merged; restore() first")
        start = time.perf_counter()
        work = [
            (name, module.get_base_layer().weight, factors)
            for name, module in self.targets
            if (factors := self._factors(module))
        ]
        bad = [name for (name, _, _), nf in zip(work, _non_finite([f for _, _, f in work])) if nf]
        if bad:
            raise ValueError(
                f"the LoRA factors of {bad[:3]} are not finite (NaN or inf in the adapter); nothing was merged"
            )
        self._saved = {}
        try:
            for name, weight, factors in work:
                self._saved[name] = merge_weight(weight, factors, name, finite_checked=True)
        except BaseException:
            self.restore()
            raise
        return self._report(self._saved, start)

    def restore(self) -> dict:
        """Give every merged weight back; :class:`RestoreError` naming those that could not be (they stay
        recorded, so a later call tries them again). On one GPU it waits twice, plus the final synchronise:
        the factors' checksums before anything is written, the weights' after."""
        if self._saved is None:
            return {"weights": 0, "exceptions": 0, "exception_bytes": 0, "seconds": 0.0}
        start = time.perf_counter()
        done, failed, pending = dict(self._saved), [], []
        modules = dict(self.targets)
        entries = list(self._saved.items())
        try:
            changed = _factors_changed([e for _, e in entries])
        except Exception:  # e.g. out of memory for the batch: check weight by weight below
            changed = [None] * len(entries)
        for (name, entry), was_changed in zip(entries, changed):
            try:
                if was_changed if was_changed is not None else _factors_changed([entry])[0]:
                    raise RestoreError(f"{name}: {_CHANGED}")
                pending.append((name, _restore(modules[name].get_base_layer().weight, entry)))
            except Exception as e:  # try every weight; say all that failed
                failed.append((name, e))
        for (name, _), difference in zip(pending, _read([d for _, d in pending])):
            if difference:
                failed.append((name, RestoreError(f"{name}: {_DIFFERS}")))
            else:
                del self._saved[name]
        if failed:
            raise RestoreError(
                f"{len(failed)} base weights could not be given back ({[n for n, _ in failed][:3]}): "
                f"{type(failed[0][1]).__name__}: {failed[0][1]}"
            ) from failed[0][1]
        self._saved = None
        return self._report(done, start)

    @staticmethod
    def _report(saved: dict, start: float) -> dict:
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        return {
            "weights": len(saved),
            "exceptions": sum(e.kept for e in saved.values()),
            "exception_bytes": sum(e.kept_bytes for e in saved.values()),
            "seconds": time.perf_counter() - start,
        }
