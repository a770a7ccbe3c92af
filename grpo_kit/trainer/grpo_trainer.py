"""``EfficientGRPOTrainer``: TRL's ``GRPOTrainer`` with the kit's memory-efficient loss.

It keeps TRL's API (``GRPOConfig``, reward functions, datasets, callbacks, logging)
and overrides two methods, the smallest set that decides how memory is spent, and a third that saves a pass:

* ``_get_per_token_logps_and_entropies`` (the no-grad reference and old-policy passes,
  and TRL's own helper wherever it calls it): final hidden states from the model, then
  chunked log-probs, :func:`grpo_kit.loss.efficient.per_token_logps`; no (B, T, V) logits.
* ``_compute_loss`` (the policy pass): the same hidden states into
  :func:`grpo_kit.loss.efficient.efficient_grpo_loss`, which computes the gradient with respect to
  the hidden states chunk by chunk inside the forward, with the objective options of the
  ``GRPOConfig`` (every ``loss_type`` of TRL 1.16, ``importance_sampling_level``, ``delta``,
  ``use_bias_correction_kl``, ``top_entropy_quantile`` through TRL's own
  ``get_high_entropy_mask``, ``off_policy_mask_threshold``, sapo_* / vespo_*). When TRL's
  importance-sampling correction is on (``self.use_vllm and
  self.vllm_importance_sampling_correction``, as TRL 1.16 tests it)
  ``inputs["importance_sampling_ratio"]`` weights the policy term (VESPO: its gamma weight),
  exactly as TRL's own ``_compute_loss`` does. Refused, with the reason, at construction:
  see ``UNSUPPORTED``.
* ``_generate_and_score_completions``, only when generation is aligned with the optimiser step (TRL's
  own condition) and the engine's correction is on: TRL's no-grad old-policy pass is skipped, since
  those log-probs are the current policy's, and the loss forms the same importance ratio from the
  log-probs it computes anyway (``engine_correction``; TRL's ``sampling/*`` metrics logged from it).

Generation goes through :class:`grpo_kit.trainer.generation_hook.KitGenerationMixin`
(``generator=``, a kit generator; None keeps TRL's own generation): ``make_trainer``
builds it from the config's ``generation_backend``.

With PEFT LoRA, TRL already uses the base model with the adapter disabled as the
reference (no second copy of the weights); that path goes through the first override.
On a GPU, offloaded gradient checkpointing (:mod:`grpo_kit.model.offload`) is turned on
by default. ``tests/test_trainer.py`` fails loudly when the pinned TRL changes a method
signature or attribute this class relies on.

Hidden states are captured with a forward hook on the decoder body (its ``last_hidden_state``, the final norm
applied) while the model is called through its own (possibly DDP-wrapped) forward with ``logits_to_keep=1``, so
distributed gradient hooks still fire and the full-vocabulary head runs on one position. The head and how the
model forms its logits (a scale, a soft-cap) are found from the model (:mod:`grpo_kit.model.anatomy`), held
against its own logits once at construction, and applied inside the chunked loss: any supported family, no code
per model class. An MoE model's router load-balancing loss is added as TRL adds it (``router_aux_loss_coef``), but
under offloaded checkpointing, where it is off with a warning (:data:`AUX_LOSS_OFF_REASON`).
"""

from __future__ import annotations

import contextlib
import inspect
import warnings

import torch
from trl import GRPOTrainer

from grpo_kit.loss.efficient import efficient_grpo_loss, per_token_logps
from grpo_kit.loss.objective import ENGINE_IS_METRICS, ENGINE_IS_TOKEN_MODES, OBJECTIVE_OPTIONS, nanmax, nanmin
from grpo_kit.loss.registry import get_loss_type
from grpo_kit.memory.estimate import scoring_batch_for_config
from grpo_kit.model.anatomy import (
    attention_only,
    causal_lm,
    check_logit_form,
    decoder_body,
    decoder_layers,
    last_hidden,
    logit_form,
    router_balance_loss,
)
from grpo_kit.model.causal_layout import MASK_BUILDING_ATTENTION, completion_rows, roll_left_pads
from grpo_kit.model.offload import AUX_LOSS_OFF_REASON, enable_offloaded_checkpointing, keep_hf_checkpointing_off
from grpo_kit.model.prefix import (
    check_prefix_sharing,
    hf_checkpointing_drops_cache,
    hf_checkpointing_paused,
    plan_prefix_groups,
    prefix_shared_hidden,
)
from grpo_kit.tasks.rewards import REWARD_TIME_LIMIT_S, checked_reward_func, resolve_reward_func
from grpo_kit.tasks.tools import get_tools, resolve_environment
from grpo_kit.trainer.generation_hook import KitGenerationMixin
from grpo_kit.trainer.guards import with_reliability
from grpo_kit.trainer.sharding import check_sharding, full_head
from grpo_kit.trainer.spec import TrainerSpec

# GRPOConfig options the efficient loss does not compute: (test on the config, what to say, why).
UNSUPPORTED = (
    (
        lambda a: a.entropy_coef != 0.0 or a.use_adaptive_entropy,
        "an entropy bonus (entropy_coef, use_adaptive_entropy)",
        "its gradient w.r.t. the logits is not a multiple of d logp / d logits, which is all the chunked epilogue "
        "computes",
    ),
    (lambda a: a.use_vllm, "use_vllm", "TRL's own vLLM; use the kit's generation_backend instead"),
)
# TRL's metric names the kit logs for every loss type; each type's own (clip ratios, ...) come from the registry
# (grpo_kit.loss.registry.LossMetrics). Min/max ones are reduced over processes by min/max, the others averaged.
LOGGED_METRICS = ("kl", "entropy", *ENGINE_IS_METRICS)


def _checked(funcs, on_error: str = "raise", time_limit_s: float | None = REWARD_TIME_LIMIT_S, on_rewards=None):
    """The one place reward functions are wrapped: plain (synchronous, callable) ones with
    :func:`grpo_kit.tasks.rewards.checked_reward_func`; ``module:function`` strings are imported first (other
    strings stay TRL's reward-model ids, which hold no colon). ``on_rewards`` sees the first function's checked
    scores (the run folder's samples.jsonl)."""
    single = not isinstance(funcs, (list, tuple))
    funcs = [resolve_reward_func(f) if isinstance(f, str) and ":" in f else f for f in ([funcs] if single else funcs)]
    out = [
        checked_reward_func(f, on_error, time_limit_s, on_rewards=on_rewards if i == 0 else None)
        if callable(f) and not isinstance(f, torch.nn.Module) and not inspect.iscoroutinefunction(f)
        else f
        for i, f in enumerate(funcs)
    ]
    return out[0] if single else out


@contextlib.contextmanager
def _capture_output(module: torch.nn.Module):
    box: list[torch.Tensor] = []
    handle = module.register_forward_hook(lambda _m, _i, out: box.append(out))
    try:
        yield box
    finally:
        handle.remove()


class EfficientGRPOTrainer(KitGenerationMixin, GRPOTrainer):
    """Drop-in ``GRPOTrainer`` that never builds full logits. Extra keyword arguments:

    ``loss_chunk_size`` (rows per logits chunk; None: chosen from free memory),
    ``scoring_batch_size`` (sequences per no-grad scoring forward, the reference log-probs; None: TRL's
    ``per_device_train_batch_size``),
    ``offload_checkpointing`` (None: on when the model is on CUDA and the config asks for
    gradient checkpointing; True/False to force),
    ``prefix_sharing`` (``"auto"``, True or False: the G completions of a group score their shared prompt's
    forward once, in the policy, reference and old-policy passes, :mod:`grpo_kit.model.prefix`; ``auto`` where the
    prompt is long enough to pay; what it did is counted in ``prefix_sharing_stats``),
    ``reward_errors``, ``reward_time_limit_s`` and ``on_rewards`` (how each reward function is checked:
    :func:`grpo_kit.tasks.rewards.checked_reward_func`), and those of :class:`KitGenerationMixin`:
    ``generator`` (a kit generator, e.g. ``make_generator("vllm", ...)``; None: TRL's own
    generation) and ``importance_sampling_correction``.
    """

    def __init__(
        self,
        *args,
        loss_chunk_size: int | None = None,
        offload_checkpointing: bool | None = None,
        reward_errors: str = "raise",
        scoring_batch_size: int | None = None,
        reward_time_limit_s: float | None = REWARD_TIME_LIMIT_S,
        on_rewards=None,
        prefix_sharing=False,
        **kwargs,
    ):
        prefix_sharing = check_prefix_sharing(prefix_sharing)
        training_args = kwargs.get("args")
        if training_args is not None:
            self._check_supported(training_args)
            # an unproven sharding mode stops here, before the Trainer prepares the model
            check_sharding(training_args, offload_checkpointing=offload_checkpointing)
        # Bad reward output names the function and the sample; reward_errors="zero": a function that
        # raises scores 0.0 on that sample with a warning instead of stopping training.
        if "reward_funcs" in kwargs:
            kwargs["reward_funcs"] = _checked(kwargs["reward_funcs"], reward_errors, reward_time_limit_s, on_rewards)
        super().__init__(*args, **kwargs)
        self._check_vespo_importance_sampling()
        self.loss_chunk_size = loss_chunk_size
        self.scoring_batch_size = scoring_batch_size
        # an unmappable layout, or logits formed some way the loss does not know, stop here, not at the first step
        decoder_layers(self.model)
        self.logit_form = logit_form(causal_lm(self.model).config)
        check_logit_form(self.model, self.logit_form)
        on_cuda = next(self.model.parameters()).is_cuda
        if offload_checkpointing is None:
            offload_checkpointing = on_cuda and bool(self.args.gradient_checkpointing)
        if offload_checkpointing:
            enable_offloaded_checkpointing(self.model, offload=on_cuda)
            if self.aux_loss_enabled:
                warnings.warn(AUX_LOSS_OFF_REASON, stacklevel=2)
                self.aux_loss_enabled = False
        self._offloaded_checkpointing = bool(offload_checkpointing)
        if prefix_sharing is True and self.accelerator.num_processes > 1:
            raise ValueError(
                "prefix_sharing: true is proven on one process only (its two forwards per micro-batch "
                "are not proven under DDP or FSDP); use auto (off there) or false"
            )
        self.prefix_sharing = prefix_sharing
        self.prefix_sharing_stats = dict(
            passes=0, groups=0, shared_rows=0, alone_rows=0, short_rows=0, layout_rows=0, prompt_tokens_saved=0
        )
        self._prefix_said: set = set()

    @staticmethod
    def _check_supported(args) -> None:
        problems = [f"{what} ({why})" for refused, what, why in UNSUPPORTED if refused(args)]
        if problems:
            raise ValueError(
                "EfficientGRPOTrainer does not support: "
                + "; ".join(problems)
                + ". Use trainer='trl' (TRL's GRPOTrainer) for these settings."
            )

    def _check_vespo_importance_sampling(self) -> None:
        """TRL refuses VESPO with a sequence-level engine ratio, but only when ``use_vllm`` is set at its
        construction; the kit's generation mixin sets it afterwards, so the same check runs here."""
        if (
            self.loss_type == "vespo"
            and self.use_vllm
            and self.vllm_importance_sampling_correction
            and self.vllm_importance_sampling_mode not in ENGINE_IS_TOKEN_MODES
        ):
            raise ValueError(
                "loss_type='vespo' with the importance-sampling correction needs "
                f"vllm_importance_sampling_mode {' or '.join(map(repr, ENGINE_IS_TOKEN_MODES))}, got "
                f"{self.vllm_importance_sampling_mode!r}"
            )

    # -- hidden states ------------------------------------------------------------------
    def _completion_hidden(self, model, input_ids, attention_mask, logits_to_keep, aux=False):
        """``(hidden, aux)``: final hidden states (B, logits_to_keep, H) whose row t predicts completion token t, of
        ``model`` (the policy, or TRL's separate reference model with full fine-tuning and beta > 0), and with
        ``aux`` the MoE router load-balancing loss of the same forward (else None)."""
        body = decoder_body(model)
        if self._offloaded_checkpointing:
            # Trainer.train() and TRL's generation switch HF's per-layer checkpointing back on; on top of the
            # kit's own recompute, a reentrant one would run every layer's forward once more per micro-batch
            keep_hf_checkpointing_off(self.model)
        # Padding as TRL lays it out: pads rolled to the end of each row, so attention needs no (B, 1, T, T) mask.
        # Flash attention unpads a 2-D mask itself (no T x T tensor), and without one would attend over the pads.
        # A hybrid with linear-attention layers keeps TRL's layout: its chunked recurrence would sum in another order.
        lead = None  # each row's leading pads, where the rows were rolled
        tokens = attention_mask  # which positions the router loss counts, in the layout the model sees
        config = causal_lm(model).config
        if getattr(config, "_attn_implementation", None) in MASK_BUILDING_ATTENTION and attention_only(config):
            rolled = roll_left_pads(input_ids, attention_mask, input_ids.size(1) - logits_to_keep)
            if rolled is not None:
                input_ids, lead, moved = rolled
                if moved:
                    pos = torch.arange(input_ids.size(1), device=input_ids.device)
                    tokens = attention_mask.gather(1, (pos[None] + lead[:, None]) % input_ids.size(1))
                attention_mask, lead = None, lead if moved else None
        extra = {"output_router_logits": True} if aux else {}
        with _capture_output(body) as box, self.accelerator.autocast():
            out = model(input_ids=input_ids, attention_mask=attention_mask, logits_to_keep=1, use_cache=False, **extra)
        hidden = last_hidden(box[-1])
        aux_loss = router_balance_loss(out.router_logits, causal_lm(model).config, tokens) if aux else None
        if lead is not None:
            return completion_rows(hidden, lead, logits_to_keep), aux_loss
        return hidden[:, -logits_to_keep - 1 : -1, :], aux_loss

    def _scored_hidden(self, model, input_ids, attention_mask, logits_to_keep, aux=False):
        """:meth:`_completion_hidden`'s ``(hidden, aux)``, with the prompts that rows share run once per group where
        prefix sharing is on for this pass (:meth:`_prefix_plan`); the other rows the usual way."""
        plan = self._prefix_plan(model, input_ids, attention_mask, logits_to_keep, aux)
        if plan is None or not plan.groups:
            return self._completion_hidden(model, input_ids, attention_mask, logits_to_keep, aux=aux)

        def unshared(rows):
            return self._completion_hidden(model, input_ids[rows], attention_mask[rows], logits_to_keep)[0]

        paused = hf_checkpointing_paused(model) if not torch.is_grad_enabled() else contextlib.nullcontext()
        with self.accelerator.autocast(), paused:
            return prefix_shared_hidden(model, plan, input_ids[:, -logits_to_keep:], unshared), None

    def _prefix_plan(self, model, input_ids, attention_mask, logits_to_keep, aux):
        """The :class:`grpo_kit.model.prefix.PrefixPlan` of a pass, or None where it does not share: sharing off;
        an MoE router loss asked for (it counts the prompt's tokens once per row); several processes (not proven
        there: ``auto`` is off, ``true`` refused at construction); or, in a training pass, HF's own checkpointing,
        which drops the KV cache (said once)."""
        if self.prefix_sharing is False or aux or self.accelerator.num_processes > 1:
            return None
        P = input_ids.size(1) - logits_to_keep
        plan = plan_prefix_groups(
            input_ids[:, :P], attention_mask[:, :P], attention_mask[:, P:], mode=self.prefix_sharing
        )
        if plan.groups and torch.is_grad_enabled():
            if self._offloaded_checkpointing:
                keep_hf_checkpointing_off(self.model)
            if hf_checkpointing_drops_cache(model):
                self._say_once(
                    "hf_checkpointing",
                    "prefix sharing is off in the training pass: HF's gradient "
                    "checkpointing drops the KV cache the completions read (the kit's offloaded "
                    "checkpointing keeps it); the reference and old-policy passes still share",
                )
                return None
        stats = self.prefix_sharing_stats
        for key, value in (
            ("passes", 1),
            ("groups", len(plan.groups)),
            ("shared_rows", plan.shared_rows),
            ("alone_rows", plan.alone),
            ("short_rows", plan.short),
            ("layout_rows", plan.layout),
            ("prompt_tokens_saved", plan.tokens_saved),
        ):
            stats[key] += value
        if plan.alone:
            self._say_once(
                "alone",
                f"prefix sharing: {plan.alone} of {input_ids.size(0)} rows have a prompt no other "
                "row of their batch shares (a group whose prompts differ, or one that TRL's shuffle split "
                "across micro-batches) and are scored unshared; counted in prefix_sharing_stats",
            )
        return plan

    def _say_once(self, key: str, message: str) -> None:
        if key not in self._prefix_said:
            self._prefix_said.add(key)
            warnings.warn(message, stacklevel=3)

    def _head(self, model=None):
        """(weight, bias) of the output head of ``model`` (default: the policy), gathered where FSDP2 shards it."""
        return full_head(causal_lm(self.model if model is None else model))

    def _logit_kwargs(self) -> dict:
        return dict(logit_scale=self.logit_form.scale, logit_softcap=self.logit_form.softcap)

    # -- override 1: log-probs without logits ----------------------------------------------
    def _get_per_token_logps_and_entropies(
        self,
        model,
        input_ids,
        attention_mask,
        logits_to_keep,
        batch_size=None,
        compute_entropy=False,
        compute_aux_loss=False,
        **multimodal,
    ):
        if any(v is not None for v in multimodal.values()):
            raise ValueError("EfficientGRPOTrainer supports text-only models (no images)")
        # Only TRL's no-grad scoring passes come here (the loss is _compute_loss's): TRL chunks them by
        # per_device_train_batch_size; scoring_batch_size, where set, by that many sequences instead.
        batch_size = self.scoring_batch_size or batch_size or input_ids.size(0)
        weight, bias = self._head(model)
        out, aux = [], []
        for start in range(0, input_ids.size(0), batch_size):
            sl = slice(start, start + batch_size)
            with torch.no_grad():
                hidden, aux_loss = self._scored_hidden(
                    model, input_ids[sl], attention_mask[sl], logits_to_keep, aux=compute_aux_loss
                )
                out.append(
                    per_token_logps(
                        hidden.to(weight.dtype),
                        weight,
                        input_ids[sl, -logits_to_keep:],
                        temperature=self.temperature,
                        chunk_size=self.loss_chunk_size,
                        lm_head_bias=bias,
                        **self._logit_kwargs(),
                    )
                )
                aux.append(aux_loss)
        # Entropy needs the full distribution per token: the loss pass reports it instead.
        return torch.cat(out, 0), None, torch.stack(aux).mean() if compute_aux_loss else None

    # -- override 2: the loss ------------------------------------------------------------
    def _compute_loss(self, model, inputs):
        prompt_ids, prompt_mask = inputs["prompt_ids"], inputs["prompt_mask"]
        completion_ids, completion_mask = inputs["completion_ids"], inputs["completion_mask"]
        input_ids = torch.cat([prompt_ids, completion_ids], dim=1)
        attention_mask = torch.cat([prompt_mask, completion_mask], dim=1)
        logits_to_keep = completion_ids.size(1)
        mask = completion_mask if "tool_mask" not in inputs else completion_mask * inputs["tool_mask"]

        hidden, aux_loss = self._scored_hidden(
            model, input_ids, attention_mask, logits_to_keep, aux=self.aux_loss_enabled
        )
        weight, bias = self._head(model)
        mode = "train" if self.model.training else "eval"
        accum = self.current_gradient_accumulation_steps if mode == "train" else 1.0
        num_items = None
        normaliser = get_loss_type(self.loss_type).normaliser
        if normaliser.global_count:  # TRL's normaliser: the window's active tokens per process
            num_items = inputs["num_items_in_batch"].clamp(min=1.0) / self.accelerator.num_processes
            if mode == "train":
                num_items = num_items * self.current_gradient_accumulation_steps / self.args.steps_per_generation
        loss, metrics = efficient_grpo_loss(
            hidden.to(weight.dtype),
            weight,
            completion_ids,
            mask,
            inputs["advantages"],
            old_logps=inputs.get("old_per_token_logps"),
            ref_logps=inputs.get("ref_per_token_logps"),
            beta=self.beta,
            epsilon_low=self.epsilon_low,
            epsilon_high=self.epsilon_high,
            loss_type=self.loss_type,
            temperature=self.temperature,
            max_completion_length=self.max_completion_length,
            num_items_in_batch=num_items,
            chunk_size=self.loss_chunk_size,
            lm_head_bias=bias,
            compute_entropy=True,
            importance_weights=self._importance_weights(inputs),
            engine_correction=self._engine_correction(inputs),
            # TRL's own mask: its quantile is taken over every process's tokens
            entropy_mask_fn=lambda ent, m: self.get_high_entropy_mask(ent, m, 1 - self.top_entropy_quantile),
            sampling_logps=inputs.get("sampling_per_token_logps"),  # off-policy mask; None: the old log-probs
            **self._logit_kwargs(),
            **{name: getattr(self.args, name) for name in OBJECTIVE_OPTIONS},
        )
        if not normaliser.global_count:
            loss = loss / accum
        if aux_loss is not None:  # as TRL 1.16 adds it: scaled for gradient accumulation like the policy loss
            loss = loss + self.router_aux_loss_coef * aux_loss / (accum if mode == "train" else 1.0)
            self._metrics[mode]["aux_loss"].append(self.accelerator.gather_for_metrics(aux_loss.detach()).mean().item())
        self._log_loss_metrics(mode, metrics)
        return loss

    def _importance_weights(self, inputs):
        """TRL's per-token (or per-sequence) importance-sampling ratio, when TRL's ``_compute_loss``
        would apply it (same condition) and TRL formed it (else the loss does: :meth:`_engine_correction`)."""
        if self.use_vllm and self.vllm_importance_sampling_correction and "importance_sampling_ratio" in inputs:
            return inputs["importance_sampling_ratio"]
        return None

    def _engine_ratio_in_loss(self) -> bool:
        """Whether the loss forms the engine's importance ratio instead of TRL. TRL runs a no-grad forward of
        every generation for the old policy's log-probs when the engine's correction is on, also when the
        policy cannot have moved since the engine sampled (generation aligned with the optimiser steps: its
        own condition for skipping that pass otherwise). Those log-probs are then the ones the loss computes
        anyway, so the pass is skipped and the loss forms the same ratio from them (equal up to
        floating-point noise, and dropout when the adapter has it). VESPO (a loss type that takes the importance
        weights itself) keeps TRL's path."""
        generate_every = self.args.steps_per_generation * self.num_iterations
        return bool(
            self.use_vllm
            and self.vllm_importance_sampling_correction
            and not get_loss_type(self.loss_type).takes_importance_weights
            and self.args.gradient_accumulation_steps % generate_every == 0
        )

    def _engine_correction(self, inputs):
        """``(mode, clip_min, clip_max)`` for the loss when TRL left the ratio to it, else None."""
        if "importance_sampling_ratio" in inputs or not self._engine_ratio_in_loss():
            return None
        return (
            self.vllm_importance_sampling_mode,
            self.vllm_importance_sampling_clip_min,
            self.vllm_importance_sampling_clip_max,
        )

    # -- override 3: no old-policy pass when the policy has not moved ----------------------------------------
    def _generate_and_score_completions(self, inputs):
        if not self._engine_ratio_in_loss():
            return super()._generate_and_score_completions(inputs)
        self.vllm_importance_sampling_correction = False  # TRL then skips the old-policy pass and its ratio
        try:
            return super()._generate_and_score_completions(inputs)
        finally:
            self.vllm_importance_sampling_correction = True

    def _log_loss_metrics(self, mode: str, metrics: dict) -> None:
        """Same metric names as TRL: means averaged over processes, per-sequence extremes their min / max."""
        own = get_loss_type(self.loss_type).metrics
        for name in LOGGED_METRICS + (own.names if own is not None else ()):
            value = metrics.get(name)
            if value is None:
                continue
            gathered = self.accelerator.gather(value.detach().reshape(1))
            reduce = nanmin if name.endswith("min") else nanmax if name.endswith("max") else torch.nanmean
            self._metrics[mode][name].append(reduce(gathered).item())


def make_trainer(
    spec: TrainerSpec,
    *,
    model,
    tokenizer,
    reward_funcs,
    args,
    train_dataset,
    callbacks=(),
    peft_config=None,
    generator=None,
    reliable: bool = False,
    memory_plan: dict | None = None,
    on_rewards=None,
):
    """Build the trainer ``spec.step.trainer`` names (``grpo_kit`` or ``trl``) with TRL's constructor arguments.
    ``spec``: the run's :class:`~grpo_kit.trainer.spec.TrainerSpec`, or an object that makes one (the app's config).

    ``reliable``: its class composed with the NaN/OOM guards and the atomic, resumable checkpoints
    (:func:`grpo_kit.trainer.guards.with_reliability`, once per class); set their options with
    :func:`grpo_kit.trainer.guards.configure_reliability`.

    ``generator``: a kit generator (:func:`grpo_kit.generation.make_generator`, e.g. from
    :func:`grpo_kit.generation.plan.start_generation`) for the ``grpo_kit`` trainer; None: TRL's own generation. TRL's
    stock trainer always generates its own way. TRL's importance-sampling correction is on
    for a generator other than HF (vLLM: another engine, another dtype); ``HFGenerator``
    samples from the training model itself, so the ratio would be 1 and its extra
    old-policy pass is skipped.

    ``memory_plan``: the CUDA generation memory plan (:func:`grpo_kit.generation.plan.memory_plan`), whose
    calculator pricing resolves ``scoring_batch_size: auto``; without one the calculator prices the run's step as it
    stands (:func:`grpo_kit.memory.scoring_batch_for_config`).

    The reward functions are checked with the run's ``reward_errors`` and ``reward_time_limit_s``
    (:func:`_checked`, once); ``on_rewards`` sees the first one's checked scores. The run's ``tools`` and
    ``environment`` reach TRL as ``tools=`` and ``environment_factory=`` (the kit's trainer checks each call with
    ``tool_time_limit_s`` and ``tool_output_tokens``).
    """
    spec = TrainerSpec.of(spec)
    tokenizer.padding_side = "left"  # TRL requires left padding for generation
    kwargs = dict(
        model=model,
        reward_funcs=list(reward_funcs),
        args=args,
        train_dataset=train_dataset,
        processing_class=tokenizer,
        callbacks=list(callbacks),
        peft_config=peft_config,
    )
    if spec.tools:
        kwargs["tools"] = get_tools(spec.tools)
    if spec.environment is not None:
        kwargs["environment_factory"] = resolve_environment(spec.environment)
    checks = (spec.reward_errors, spec.reward_time_limit_s, on_rewards)
    if spec.step.trainer == "trl":
        if generator is not None:
            raise ValueError(
                "trainer='trl' (TRL's stock GRPOTrainer) generates with TRL's own HF path; "
                "a kit generator needs trainer='grpo_kit'"
            )
        kwargs["reward_funcs"] = _checked(kwargs["reward_funcs"], *checks)  # TRL's own class checks nothing
        return (with_reliability(GRPOTrainer) if reliable else GRPOTrainer)(**kwargs)
    if generator is not None:
        kwargs["importance_sampling_correction"] = getattr(generator, "name", None) != "hf"
    cls = with_reliability(EfficientGRPOTrainer) if reliable else EfficientGRPOTrainer
    scoring = (
        memory_plan["scoring_batch_size"]
        if memory_plan and spec.step.scoring_batch_size == "auto"
        else scoring_batch_for_config(spec.step, model.config)
    )
    return cls(
        **kwargs,
        loss_chunk_size=spec.loss_chunk_size,
        scoring_batch_size=scoring,
        generator=generator,
        reward_errors=checks[0],
        reward_time_limit_s=checks[1],
        on_rewards=checks[2],
        tool_time_limit_s=spec.tool_time_limit_s or None,
        tool_output_tokens=spec.tool_output_tokens,
        max_prompt_length=spec.step.max_prompt_length,
        prefix_sharing=spec.step.prefix_sharing,
    )
