"""Guards for long runs: non-finite loss or gradient, and CUDA out-of-memory.

:func:`with_reliability` returns a trainer class (TRL's ``GRPOTrainer`` or the kit's
``EfficientGRPOTrainer`` underneath) with :class:`GuardedTrainerMixin` and
:class:`grpo_kit.trainer.checkpoints.ResumableTrainerMixin` in front.

**Non-finite values.** Every training micro-batch's loss is checked; when it is NaN/inf the terms
that feed it are checked per sample (advantages, old/reference log-probs, the policy's own log-probs,
the ratio, the k3 KL, the rewards of the generation batch) and the completions involved are decoded.
Before the optimiser step the gradients are checked too (parameter names on a non-finite one). A bad
step skips the update: the gradients are dropped (``zero_grad(set_to_none=True)``, so AdamW changes
neither weights nor moments); the step still counts (data position, LR schedule). Each event goes to
stderr and to ``RUN_DIR/guard_events.jsonl``. After ``max_bad_steps`` bad steps in a row training
stops: a checkpoint is written and :class:`NonFiniteStop` is raised by the caller (``run.train``).

**Out of memory.** ``torch.cuda.OutOfMemoryError`` in a training micro-batch (loss, forward or
backward): the kit's trainer halves ``loss_chunk_size`` (rows per logits chunk), TRL's stock trainer
halves the micro-batch (two half batches whose losses are weighted to the same total), once per run,
and the same micro-batch is retried on the completions already generated. A second OOM saves the
state as it was at the start of the step and raises :class:`OutOfMemoryStop`, whose message names the
settings to change and the VRAM calculator's estimate for the config.
"""

from __future__ import annotations

import gc
import json
import math
import sys
import time
from pathlib import Path

import torch
from transformers import Trainer, TrainerCallback

from grpo_kit.kernels import grpo_epilogue as _epi
from grpo_kit.loss.efficient import auto_chunk_rows
from grpo_kit.loss.objective import k3_kl
from grpo_kit.loss.registry import get_loss_type
from grpo_kit.memory import estimate_for_config, total_gpu_bytes
from grpo_kit.memory.spec import StepSpec
from grpo_kit.trainer.channel import channel
from grpo_kit.trainer.checkpoints import ResumableTrainerMixin
from grpo_kit.trainer.spec import TrainerSpec


class TrainingStopped(RuntimeError):
    """Training stopped by a guard; the state was saved to a checkpoint first."""


class NonFiniteStop(TrainingStopped):
    pass


class OutOfMemoryStop(TrainingStopped):
    pass


def _rows_bad(t: torch.Tensor, mask: torch.Tensor | None = None) -> list[int]:
    """Sample indices (dim 0) with a non-finite value (where ``mask`` is set, for (B, T) tensors)."""
    bad = ~torch.isfinite(t.detach().float())
    if bad.dim() == 2 and mask is not None and mask.shape == bad.shape:
        bad = bad & mask.bool()
    if bad.dim() > 1:
        bad = bad.flatten(1).any(1)
    return bad.nonzero().flatten().tolist()


def _split_batch(inputs: dict, parts: int) -> list[dict]:
    B = inputs["completion_ids"].size(0)
    if B < parts:
        raise ValueError(f"cannot split a micro-batch of {B} sequences into {parts}")
    bounds = [(i * B) // parts for i in range(parts + 1)]
    out = []
    for s, e in zip(bounds[:-1], bounds[1:]):
        out.append(
            {
                k: (v[s:e] if isinstance(v, torch.Tensor) and v.dim() > 0 and v.size(0) == B else v)
                for k, v in inputs.items()
            }
        )
    return out


def split_weights(halves: list[dict], full: dict, loss_type: str) -> list[float]:
    """Weights that make the weighted sum of the halves' losses equal the whole micro-batch's loss: each
    half's share under the loss type's normaliser (:class:`grpo_kit.loss.registry.Normaliser`): a mean over
    sequences (grpo, sapo, dr_grpo, luspo) B_half / B; over active tokens (bnpo) tokens_half / tokens; the
    whole window's token count (dapo, cispo, vespo) 1. Exact for every objective option except
    ``top_entropy_quantile < 1``, whose threshold each half then takes over its own tokens.
    """
    share = get_loss_type(loss_type).normaliser.share
    return [share(h["completion_mask"], full["completion_mask"]) for h in halves]


def vram_estimate_text(step: StepSpec, model_config=None) -> str:
    """The VRAM calculator's peak for a run's step, as one phrase (never raises)."""
    try:
        df = estimate_for_config(step, model_config)
        gib = total_gpu_bytes(df) / 2**30
        return (
            f"the VRAM calculator estimates {gib:.1f} GiB peak for this config (prompt up to "
            f"{step.max_prompt_length} + completion {step.max_completion_length} tokens, micro-batch "
            f"{step.per_device_train_batch_size}; `python -m grpo_kit vram --help` to try others)"
        )
    except Exception as e:  # the estimate is advice; never hide the OOM behind it
        return f"no VRAM estimate for this model ({type(e).__name__}: {e})"


class GuardedTrainerMixin:
    """Put before a TRL ``GRPOTrainer`` (or subclass). Attributes the caller may set:

    ``max_bad_steps`` (consecutive non-finite steps before stopping), ``guard_log_path`` (jsonl;
    default ``output_dir/guard_events.jsonl``), ``oom_advice`` (callable returning a sentence with the
    VRAM estimate), ``guard_spec`` (names and values for the messages: the run's ``TrainerSpec`` or None).
    After ``train()`` returns, ``channel(trainer).stop_error`` (:mod:`grpo_kit.trainer.channel`) holds the
    :class:`TrainingStopped` to raise, if any.
    """

    max_bad_steps: int = 3
    guard_log_path = None
    oom_advice = None

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._guard_init()

    def _guard_init(self):
        channel(self).stop_error = None
        self.guard_counts = {"bad_steps": 0, "consecutive_bad": 0, "oom_retries": 0}
        self._guard_reports: list[dict] = []  # non-finite micro-batches in the current step
        self._guard_bad_grads: list[str] | None = None
        self._guard_checked = False
        self._guard_step_bad = False
        self._oom_shrunk = False
        self._split_parts = 1
        self._loss_weight = 1.0
        trainer = self

        class _Guard(TrainerCallback):
            def on_pre_optimizer_step(self, args, state, control, **kw):
                trainer._guard_before_update()

            def on_step_end(self, args, state, control, **kw):
                trainer._guard_after_step(control)

        self.add_callback(_Guard())

    # -- events --------------------------------------------------------------------------------
    def _guard_event(self, kind: str, message: str, **data) -> None:
        event = {"time": time.time(), "step": self.state.global_step + 1, "event": kind, "message": message, **data}
        print(f"[grpo_kit] step {event['step']}: {message}", file=sys.stderr, flush=True)
        if not self.args.should_save:
            return
        path = Path(self.guard_log_path or Path(self.args.output_dir) / "guard_events.jsonl")
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("a", encoding="utf-8") as fh:
            fh.write(json.dumps(event, default=str) + "\n")

    # -- non-finite loss --------------------------------------------------------------------------
    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        try:
            loss = super().compute_loss(
                model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch
            )
        except ValueError as err:
            # The kit's efficient loss refuses non-finite inputs (advantages, old/ref log-probs, hidden states)
            # with a ValueError instead of returning NaN. When the diagnosis finds such a term, this is a bad
            # step like any other (skipped, counted); any other ValueError is a real error and propagates.
            if not self.model.training:
                raise
            report = self._diagnose(model, inputs, None)
            if not report.pop("found"):
                raise
            report["error"] = str(err)[:300]
            self._guard_reports.append(report)
            return self._nan_loss(model)
        if self._loss_weight != 1.0:
            loss = loss * self._loss_weight
        if self.model.training and not bool(torch.isfinite(loss.detach()).all()):
            report = self._diagnose(model, inputs, loss)
            report.pop("found")
            self._guard_reports.append(report)
        return loss

    @staticmethod
    def _nan_loss(model) -> torch.Tensor:
        """A NaN loss (for the logs) whose backward gives zero gradients (the step is skipped anyway)."""
        zero = sum((p.reshape(-1)[:1] * 0).sum() for p in model.parameters() if p.requires_grad)
        if not isinstance(zero, torch.Tensor):  # nothing trainable
            zero = torch.zeros((), requires_grad=True)
        return zero + float("nan")

    @torch.no_grad()
    def _diagnose(self, model, inputs: dict, loss: torch.Tensor | None) -> dict:
        """Which term of the GRPO loss is non-finite, for which samples of the micro-batch.

        ``found``: whether any term was (False: every input term finite, e.g. the loss itself overflowed).
        """
        terms: dict[str, list[int]] = {}
        mask = inputs.get("completion_mask")

        def check(name, t):
            if isinstance(t, torch.Tensor):
                rows = _rows_bad(t, mask)
                if rows:
                    terms[name] = rows

        check("advantages", inputs.get("advantages"))
        check("old log-probs", inputs.get("old_per_token_logps"))
        check("reference log-probs", inputs.get("ref_per_token_logps"))
        check("importance weights", inputs.get("importance_sampling_ratio"))
        try:
            ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1)
            att = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1)
            logps = self._get_per_token_logps_and_entropies(model, ids, att, inputs["completion_ids"].size(1))[0]
            check("policy log-probs", logps)
            old = inputs.get("old_per_token_logps")
            old = logps if old is None else old
            check("ratio", torch.exp(logps - old))
            ref = inputs.get("ref_per_token_logps")
            if ref is not None and getattr(self, "beta", 0.0) != 0.0:
                check("KL", k3_kl(logps, ref))
        except Exception as e:  # diagnosis must not turn a skipped step into a crash
            terms[f"(policy pass failed: {type(e).__name__})"] = []
        rewards = (
            getattr(self, "_logs", {}).get("rewards", {}) if isinstance(getattr(self, "_logs", None), dict) else {}
        )
        for name, values in rewards.items():
            bad = [i for i, v in enumerate(list(values)) if isinstance(v, float) and not math.isfinite(v)]
            if bad:
                terms[f"reward {name} (indices in the generation batch)"] = bad
        found = any(not name.startswith("(") for name in terms)
        if not terms:
            terms["loss (every input term finite)"] = []
        samples = sorted({i for name, rows in terms.items() if not name.startswith("reward") for i in rows})[:4]
        texts = {}
        tok = getattr(self, "processing_class", None)
        for i in samples:
            try:
                ids_i = inputs["completion_ids"][i][inputs["completion_mask"][i].bool()]
                texts[i] = tok.decode(ids_i, skip_special_tokens=True)[:200] if tok is not None else ids_i.tolist()[:50]
            except Exception:
                pass
        return {
            "loss": float(loss.detach().float().reshape(-1)[0]) if loss is not None else float("nan"),
            "terms": terms,
            "samples": texts,
            "found": found,
        }

    def _guard_check_grads(self) -> None:
        if self._guard_checked:
            return
        self._guard_checked = True
        bad = [
            n for n, p in self.model.named_parameters() if p.grad is not None and not bool(torch.isfinite(p.grad).all())
        ]
        self._guard_bad_grads = bad

    def _clip_grad_norm(self, model):
        self._guard_check_grads()  # before clipping spreads one NaN to every gradient
        return super()._clip_grad_norm(model)

    def _guard_before_update(self) -> None:
        self._guard_check_grads()
        reports, bad_grads = self._guard_reports, self._guard_bad_grads or []
        self._guard_step_bad = bool(reports or bad_grads)
        if self._guard_step_bad:
            self.optimizer.zero_grad(set_to_none=True)  # AdamW skips parameters without a gradient
            self.guard_counts["bad_steps"] += 1
            parts = []
            for r in reports:
                parts.append("; ".join(f"{k}" + (f" (samples {v})" if v else "") for k, v in r["terms"].items()))
            if bad_grads:
                parts.append(f"gradient of {len(bad_grads)} parameter(s), e.g. {bad_grads[:3]}")
            n = self.guard_counts["consecutive_bad"] + 1
            limit = self.max_bad_steps
            self._guard_event(
                "nonfinite",
                f"non-finite loss or gradient, update skipped ({n} in a row, stop at {limit}): " + " | ".join(parts),
                reports=reports,
                bad_grads=bad_grads[:20],
                consecutive=n,
            )
        self._guard_reports, self._guard_bad_grads, self._guard_checked = [], None, False

    def _guard_after_step(self, control) -> None:
        if not self._guard_step_bad:
            self.guard_counts["consecutive_bad"] = 0
            return
        self._guard_step_bad = False
        self.guard_counts["consecutive_bad"] += 1
        n = self.guard_counts["consecutive_bad"]
        if self.max_bad_steps and n >= self.max_bad_steps:
            control.should_save = True
            control.should_training_stop = True
            ckpt = Path(self.args.output_dir) / "checkpoints" / f"checkpoint-{self.state.global_step}"
            channel(self).stop_error = NonFiniteStop(
                f"training stopped at step {self.state.global_step}: {n} steps in a row had a non-finite loss or "
                f"gradient (max_bad_steps={self.max_bad_steps}); each update was skipped, so the weights are those "
                f"of the last good step. State saved in {ckpt}; the terms and samples involved are in "
                f"{self.guard_log_path or Path(self.args.output_dir) / 'guard_events.jsonl'}. Lower learning_rate, "
                "check the reward functions' output, or raise max_bad_steps."
            )

    # -- out of memory ----------------------------------------------------------------------------
    def _free_memory(self) -> None:
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    def _current_chunk(self, inputs: dict) -> int:
        B, T = inputs["completion_ids"].shape
        if self.loss_chunk_size:
            return min(int(self.loss_chunk_size), B * T)
        weight = self._head()[0]
        backend = _epi.resolve_backend("auto", weight.device)
        return min(auto_chunk_rows(weight.size(0), weight.dtype, weight.device, backend, n_tokens=B * T), B * T)

    def training_step(self, model, inputs, num_items_in_batch=None):
        buffered_before = getattr(self, "_buffered_inputs", None)
        try:
            if self._split_parts > 1:
                return self._split_training_step(model, inputs, num_items_in_batch, reuse=False)
            return super().training_step(model, inputs, num_items_in_batch)
        except torch.cuda.OutOfMemoryError as err:
            error = err
        self._free_memory()
        if self._oom_shrunk:
            self._oom_stop(error)
        self._oom_shrunk = True
        self.guard_counts["oom_retries"] += 1
        # Completions generated in this call (or buffered from an earlier one) are reused for the retry.
        spg = self.args.steps_per_generation
        buffered = getattr(self, "_buffered_inputs", None)
        generate_every = spg * getattr(self, "num_iterations", 1)
        reuse = buffered is not None and (buffered is not buffered_before or self._step % generate_every != 0)
        batch = buffered[self._step % spg] if reuse else None
        try:
            if hasattr(self, "loss_chunk_size") and hasattr(self, "_head") and batch is not None:
                old = self._current_chunk(batch)
                self.loss_chunk_size = max(1, old // 2)
                self._guard_event(
                    "oom",
                    f"CUDA out of memory in a micro-batch; loss_chunk_size {old} -> "
                    f"{self.loss_chunk_size} rows, retrying the same micro-batch",
                    setting="loss_chunk_size",
                    old=old,
                    new=self.loss_chunk_size,
                    error=str(error)[:300],
                )
                with _replace_prepare_inputs(self, batch):
                    return super().training_step(model, inputs, num_items_in_batch)
            self._split_parts = 2
            B = self.args.per_device_train_batch_size
            self._guard_event(
                "oom",
                f"CUDA out of memory in a micro-batch; micro-batch {B} -> {B // 2} sequences "
                "(two halves per micro-batch from now on), retrying the same micro-batch",
                setting="per_device_train_batch_size",
                old=B,
                new=B // 2,
                error=str(error)[:300],
            )
            return self._split_training_step(model, inputs, num_items_in_batch, reuse=reuse)
        except torch.cuda.OutOfMemoryError as err:
            self._free_memory()
            self._oom_stop(err)

    def _split_training_step(self, model, inputs, num_items_in_batch, *, reuse: bool):
        """One micro-batch as ``_split_parts`` smaller ones (same total loss and gradient)."""
        full = (
            self._buffered_inputs[self._step % self.args.steps_per_generation]
            if reuse
            else self._prepare_inputs(inputs)
        )
        parts = _split_batch(full, self._split_parts)
        weights = split_weights(parts, full, getattr(self, "loss_type", "grpo"))
        total = None
        try:
            for part, w in zip(parts, weights):
                self._loss_weight = w
                with _replace_prepare_inputs(self, part):
                    loss = Trainer.training_step(self, model, part, num_items_in_batch)
                total = loss if total is None else total + loss
        finally:
            self._loss_weight = 1.0
        if hasattr(self, "_step"):
            self._step += 1  # what TRL's training_step does once per micro-batch
        return total

    def _oom_stop(self, error) -> None:
        ckpt = None
        try:
            ckpt = self._save_checkpoint(self.model_wrapped, None, mid_step=True)
        except Exception as e:  # report the OOM even if saving fails too
            print(f"[grpo_kit] could not save the state after the OOM: {type(e).__name__}: {e}", file=sys.stderr)
        spec = getattr(self, "guard_spec", None)
        if hasattr(self, "loss_chunk_size") and self._split_parts == 1:
            first = (
                f"loss_chunk_size (now {self.loss_chunk_size}; already halved once): set e.g. "
                f"loss_chunk_size={max(1, (self.loss_chunk_size or 2) // 2)}"
            )
        else:
            first = "per_device_train_batch_size (already halved once)"
        settings = [
            first,
            "per_device_train_batch_size (smaller, a multiple of num_generations, with more "
            "gradient_accumulation_steps)",
            "max_completion_length",
            "gradient_checkpointing=true",
        ]
        if getattr(self, "scoring_batch_size", None):  # the no-grad scoring pass may be what ran out
            chosen = ", chosen by 'auto'" if spec is not None and spec.step.scoring_batch_size == "auto" else ""
            settings.insert(
                1,
                f"scoring_batch_size (now {self.scoring_batch_size}{chosen}; null scores "
                "per_device_train_batch_size sequences per forward)",
            )
        advice = (
            self.oom_advice()
            if callable(self.oom_advice)
            else (vram_estimate_text(spec.step) if spec is not None else "no VRAM estimate (no kit config)")
        )
        where = f"state saved in {ckpt}" if ckpt else "the state could not be saved"
        channel(self).stop_error = OutOfMemoryStop(
            f"CUDA out of memory again at step {self.state.global_step + 1} after the automatic halving; {where}. "
            f"Change one of: {'; '.join(settings)}, then resume. {advice[:1].upper() + advice[1:]}. "
            f"Original error: {str(error).splitlines()[0][:200] if str(error) else type(error).__name__}"
        )
        raise channel(self).stop_error from error


class _replace_prepare_inputs:
    """Make ``trainer._prepare_inputs`` return a fixed, already prepared batch (no new generation)."""

    def __init__(self, trainer, batch):
        self.trainer, self.batch = trainer, batch

    def __enter__(self):
        self.trainer._prepare_inputs = lambda _inputs: self.batch

    def __exit__(self, *exc):
        del self.trainer._prepare_inputs
        return False


_CLASSES: dict[type, type] = {}


def with_reliability(base: type) -> type:
    """``base`` (a TRL ``GRPOTrainer`` class) with the NaN/OOM guards and atomic, resumable checkpoints."""
    if issubclass(base, GuardedTrainerMixin):
        return base
    if base not in _CLASSES:
        _CLASSES[base] = type(
            base.__name__,
            (GuardedTrainerMixin, ResumableTrainerMixin, base),
            {"__module__": base.__module__, "__doc__": base.__doc__, "__qualname__": base.__qualname__},
        )
    return _CLASSES[base]


def configure_reliability(trainer, spec: TrainerSpec | None = None, *, run_state_provider=None):
    """Set the guards' and checkpoints' options on a trainer built from a :func:`with_reliability` class.

    ``spec`` (the run's :class:`~grpo_kit.trainer.spec.TrainerSpec`, or an object that makes one):
    ``max_bad_steps``, ``keep_checkpoints`` and the OOM message's VRAM estimate come from it. ``run_state_provider``: see :class:`grpo_kit.trainer.checkpoints.ResumableTrainerMixin`.
    """
    if not isinstance(trainer, GuardedTrainerMixin):
        raise TypeError(
            f"{type(trainer).__name__} has no guards: build it from with_reliability(its class) "
            "(grpo_kit.trainer.grpo_trainer.make_trainer(..., reliable=True) does)"
        )
    if spec is not None:
        spec = TrainerSpec.of(spec)
        trainer.max_bad_steps = spec.max_bad_steps
        trainer.keep_checkpoints = spec.keep_checkpoints
        trainer.guard_spec = spec
        model_config = getattr(trainer.accelerator.unwrap_model(trainer.model), "config", None)
        trainer.oom_advice = lambda: vram_estimate_text(spec.step, model_config)
    trainer.run_state_provider = run_state_provider
    return trainer
