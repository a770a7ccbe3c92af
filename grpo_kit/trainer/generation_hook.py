"""``KitGenerationMixin``: route TRL ``GRPOTrainer`` generation through a kit generator.

Use it before ``GRPOTrainer`` in the bases and pass ``generator=``::

    class EfficientGRPOTrainer(KitGenerationMixin, GRPOTrainer): ...
    trainer = EfficientGRPOTrainer(model=..., args=GRPOConfig(use_vllm=False, ...), ...,
                                   generator=make_generator("vllm", model_dir=..., tokenizer=tok))

It overrides one TRL method, ``_generate_single_turn(prompt_ids, images,
multimodal_fields, num_generations, has_tool_images)``, which in TRL 1.16 receives one
prompt per *row*, each prompt already repeated ``num_generations`` times by the sampler,
and returns ``(completion_ids, logprobs)``. So the mixin asks the generator for one
completion per row. Before generating it syncs the weights once per optimiser step
(``self.state.global_step`` changed, as TRL does for its own vLLM), so gradient
accumulation and ``num_iterations`` do not sync twice; then it puts the engine to sleep
(CUDA sleep mode; a no-op elsewhere).

Importance-sampling correction: TRL applies it only when ``self.use_vllm`` is true
(``old_per_token_logps`` are then always computed, the ratio
``exp(old - sampling)`` is truncated/masked per ``vllm_importance_sampling_mode`` and
``_compute_loss`` multiplies the per-token loss by it). ``use_vllm`` has no other effect on
the TRL code paths this mixin allows (TRL's own vLLM object is never built: ``args.use_vllm``
stays False), so with ``importance_sampling_correction`` on (default: the value of
``args.vllm_importance_sampling_correction``, True in TRL) the mixin sets
``self.use_vllm = True`` after TRL's constructor, and TRL's correction runs on the
generator's log-probs. A trainer that overrides ``_compute_loss`` must apply
``inputs["importance_sampling_ratio"]`` itself (``EfficientGRPOTrainer`` does, or, when generation is
aligned with the optimiser step, skips TRL's old-policy pass and forms the ratio in its loss).

Tools and environments (TRL's ``tools=``, ``environment_factory=``): TRL's ``_tool_call_loop`` calls
``_generate_single_turn`` again after each round of tool results, one row per rollout that called a tool, so
every turn is served by the kit's engine (same shared weights, sync and standby). Each tool runs under
:func:`grpo_kit.tasks.tools.checked_tool` (``tool_time_limit_s``, ``tool_output_tokens``): a tool that raises,
hangs or returns non-text is a counted, logged failure and the rollout goes on. ``rollout_func=``: TRL calls
it with the trainer; it generates through :meth:`KitGenerationMixin.kit_generate` (the engine, synced), and TRL's
own vLLM sync is skipped (there is none).

A generator failure (:class:`GenerationEngineError`) saves the model and trainer state to
``<output_dir>/crash-step-<N>`` before the error propagates.

``max_prompt_length``: the first turn's prompts (as TRL tokenized them, an environment's ``reset`` text
included, which no check before the run can see) longer than this stop the run with a ``ValueError`` naming the
length, after the same save: the engine's context and the memory plan are sized for it, and a longer prompt would
silently shorten the completions (vLLM) or outgrow the plan (HF ``generate``). Later turns of a tool loop carry
the conversation so far and are not held to it.
"""

from __future__ import annotations

import os
import time

from trl.extras.profiling import profiling_context

from grpo_kit.generation.base import GenerationEngineError, SamplingConfig
from grpo_kit.tasks.tools import TOOL_OUTPUT_TOKENS, TOOL_TIME_LIMIT_S, checked_tool
from grpo_kit.trainer.channel import channel


class KitGenerationMixin:
    """Mixin for TRL's ``GRPOTrainer``; extra keyword arguments ``generator`` (a
    :class:`grpo_kit.generation.Generator`; None keeps TRL's own generation) and
    ``importance_sampling_correction`` (None: ``args.vllm_importance_sampling_correction``), how each tool
    call is checked: ``tool_time_limit_s`` (wall seconds; None: no limit) and ``tool_output_tokens`` (tokens of a
    text result kept; None: all), and ``max_prompt_length`` (tokens of a first-turn prompt; None: unchecked)."""

    def __init__(
        self,
        *args,
        generator=None,
        importance_sampling_correction: bool | None = None,
        tool_time_limit_s: float | None = TOOL_TIME_LIMIT_S,
        tool_output_tokens: int | None = TOOL_OUTPUT_TOKENS,
        max_prompt_length: int | None = None,
        **kwargs,
    ):
        super().__init__(*args, **kwargs)
        self.tool_time_limit_s, self.tool_output_tokens = tool_time_limit_s, tool_output_tokens
        self.kit_max_prompt_length, self._kit_first_turn = max_prompt_length, False
        self.kit_generator = generator
        self._kit_synced_step = None
        channel(self)  # the sync log and generation seconds (grpo_kit.trainer.channel)
        if generator is None:
            return
        self._check_kit_generation_supported()
        self.kit_sampling = SamplingConfig(
            temperature=float(self.temperature),
            top_p=float(self.top_p if self.top_p is not None else 1.0),
            top_k=int(self.top_k or 0),
            min_p=float(self.min_p or 0.0),
            max_tokens=int(self.max_completion_length),
            stop_token_ids=tuple(int(t) for t in self.eos_token_ids),
        )
        if importance_sampling_correction is None:
            importance_sampling_correction = bool(getattr(self.args, "vllm_importance_sampling_correction", False))
        self.kit_importance_sampling = bool(importance_sampling_correction)
        if self.kit_importance_sampling:
            self.use_vllm = True  # switches on TRL's IS correction only; see the module docstring
            # not "colocate": TRL's tool loop would read its context ceiling from its own (never built) vLLM engine
            self.vllm_mode = "server"

    def _check_kit_generation_supported(self) -> None:
        problems = []
        if getattr(self.args, "use_vllm", False):
            problems.append("args.use_vllm=True (TRL's own vLLM; the kit generator replaces it)")
        if getattr(self, "use_transformers_continuous_batching", False):
            problems.append("use_transformers_continuous_batching")
        if getattr(self, "_is_vlm", False):
            problems.append("vision-language models")
        if getattr(self, "repetition_penalty", 1.0) not in (None, 1.0):
            problems.append(f"repetition_penalty={self.repetition_penalty}")
        if getattr(self.args, "generation_kwargs", None):  # user extras; TRL's own dict is built from args
            problems.append(f"args.generation_kwargs={self.args.generation_kwargs}")
        if problems:
            raise ValueError(
                "generator= (kit generation) does not support: "
                + "; ".join(problems)
                + ". Pass generator=None to use TRL's own generation."
            )

    def _generate_single_turn(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        if self._kit_first_turn:
            self._kit_first_turn = False
            self._check_prompt_lengths(prompt_ids)
        if self.kit_generator is None:
            return super()._generate_single_turn(
                prompt_ids, images, multimodal_fields, num_generations, has_tool_images
            )
        if images is not None or multimodal_fields:
            raise ValueError("kit generation is text-only: got images or multimodal fields")
        mode = "train" if self.model.training else "eval"
        t0 = time.perf_counter()
        try:
            if self.state.global_step != self._kit_synced_step or self.kit_generator.needs_sync:
                start = time.perf_counter()
                with profiling_context(self, "kit.sync_weights"):
                    info = self.kit_generator.sync_weights(self.accelerator.unwrap_model(self.model))
                self._kit_synced_step = self.state.global_step
                channel(self).sync_log.append({"step": self.state.global_step, **info})
                self._metrics[mode]["generation/sync_seconds"].append(time.perf_counter() - start)
            with profiling_context(self, f"kit.{self.kit_generator.name}.generate"):
                result = self.kit_generator.generate(
                    [list(p) for p in prompt_ids], num_generations=1, sampling=self.kit_sampling
                )
            for key in ("merge_s", "restore_s"):  # the adapter merged into shared weights for this call
                if key in result.timings:
                    self._metrics[mode][f"generation/{key.removesuffix('_s')}_seconds"].append(result.timings[key])
            self.kit_generator.sleep()
        except GenerationEngineError as e:
            path = self._kit_save_after_crash()
            raise GenerationEngineError(f"{e}\nTraining state saved to {path}") from e
        seconds = time.perf_counter() - t0
        channel(self).generation_seconds += seconds
        self._metrics[mode]["generation/seconds"].append(seconds)  # per call, sync included (metrics.csv)
        return result.completion_ids, result.logprobs_lists()

    def kit_generate(self, prompt_ids: list[list[int]]) -> tuple[list[list[int]], list[list[float]] | None]:
        """One completion per prompt (token ids, no padding) with the trainer's sampling, and its per-token
        sampling log-probs: for a ``rollout_func``. Through the kit's engine (weights synced once per optimiser
        step) when a generator is set, else TRL's own generation."""
        return self._generate_single_turn([list(p) for p in prompt_ids], None, {}, 1)

    def _check_prompt_lengths(self, prompt_ids) -> None:
        """ValueError (after saving the state) if a first-turn prompt is over ``max_prompt_length`` tokens."""
        longest = max((len(p) for p in prompt_ids), default=0)
        if self.kit_max_prompt_length is None or longest <= self.kit_max_prompt_length:
            return
        what = (
            "with what the environment's reset() added"
            if getattr(self, "environments", None)
            else "as rendered for generation"
        )
        path = self._kit_save_after_crash()
        raise ValueError(
            f"a prompt is {longest} tokens {what}, over max_prompt_length={self.kit_max_prompt_length} "
            "(the engine's context and the memory plan are sized for it): raise max_prompt_length or "
            f"shorten the prompt. Training state saved to {path}"
        )

    def _generate(self, prompts):
        if self.kit_generator is not None and self.rollout_func is not None:
            # TRL syncs its own vLLM before a rollout_func whenever use_vllm is set (here: only for its IS
            # correction); the kit's engine syncs in kit_generate instead
            self._last_loaded_step = self.state.global_step
        self._kit_first_turn = True  # the next _generate_single_turn gets this batch's prompts
        try:
            return super()._generate(prompts)
        finally:
            self._kit_first_turn = False

    def _tool_call_loop(self, *args, **kwargs):
        # TRL rebuilds the per-rollout tool tables every batch (environment methods are per instance): wrap them here
        for table in getattr(self, "_sync_tool_dicts", None) or ():
            for name, tool in table.items():
                table[name] = checked_tool(
                    tool,
                    time_limit_s=self.tool_time_limit_s,
                    tokenizer=self._tokenizer,
                    max_output_tokens=self.tool_output_tokens,
                )
        return super()._tool_call_loop(*args, **kwargs)

    def _kit_save_after_crash(self) -> str:
        path = os.path.join(self.args.output_dir, f"crash-step-{self.state.global_step}")
        self.save_model(path)
        self.state.save_to_json(os.path.join(path, "trainer_state.json"))
        return path
