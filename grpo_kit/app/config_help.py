"""The help text of each field of ``GRPOKitConfig``, by name: what ``train --help-config`` prints and the docs'
configuration reference shows (``GRPOKitConfig.field_help``). The objective's further options have none here:
theirs is TRL's (:func:`trl_field_help`)."""

from __future__ import annotations

import dataclasses

from grpo_kit.app.config_checks import DEVICES, DTYPES, KV_CACHE_DTYPES, TRACKERS, TRAINERS
from grpo_kit.generation.base import GENERATION_BACKENDS
from grpo_kit.generation.sync import LORA_SYNC_MODES
from grpo_kit.loss.advantage import SCALE_REWARDS
from grpo_kit.loss.objective import ENGINE_IS_MODES, LOSS_TYPES
from grpo_kit.model.fp8 import BASE_WEIGHTS
from grpo_kit.tasks.data import LEVELS, TASKS
from grpo_kit.tasks.long_document import LONG_DOCUMENT_LEVELS
from grpo_kit.tasks.rewards import REWARD_ERRORS, REWARD_FUNCTIONS
from grpo_kit.tasks.tools import READY_TOOLS

REWARD_FUNCS = tuple(REWARD_FUNCTIONS)

FIELD_HELP = {
    "model": (
        "Built-in name (see `grpo_kit.model.loading.BUILTIN_MODELS`), a local "
        "folder, or a hub id such as `Qwen/Qwen2.5-1.5B-Instruct`."
    ),
    "output_dir": "Run folder: metrics.csv, rewards.png, samples, adapter/weights.",
    "seed": "Seed for data, sampling and initialisation.",
    "max_steps": "Optimiser steps to run.",
    "save_steps": (
        "Write a resumable checkpoint (run folder's checkpoints/checkpoint-N: weights, "
        "optimiser, scheduler, RNG and data position, metrics so far) every N steps and at the end; "
        "0: none. A multiple of logging_steps. Resume with `train --resume RUN_DIR`."
    ),
    "keep_checkpoints": (
        "Complete checkpoints kept (the newest N; 0: all). Older ones are deleted only after a new one is complete."
    ),
    "max_bad_steps": (
        "Consecutive steps with a non-finite loss or gradient (each one skipped: no "
        "optimiser update) before training stops with the state saved."
    ),
    "logging_steps": "Log metrics every N steps.",
    "report_to": (
        "Experiment trackers that receive every logged step, as TRL's `report_to`: "
        f"`none`, one of {list(TRACKERS)}, several as a list (`[tensorboard, wandb]`, or "
        "the comma string `tensorboard,wandb`), or `all` (every integration transformers finds "
        "installed). They get TRL's metrics and the kit's own (step_time_s, peak_memory_gib). "
        "TensorBoard writes to the run folder's `tensorboard/`; W&B and Trackio log where "
        "their own settings say (WANDB_PROJECT, WANDB_DIR; Trackio's local store). A tracker "
        "that is not installed is refused with its install command."
    ),
    "run_name": ("The run's name in the trackers of report_to (TRL's `run_name`); null: each tracker names it."),
    "device": f"Where to train: one of {DEVICES}; `auto` picks CUDA when available.",
    "dtype": (
        f"Training dtype, one of {DTYPES}; `auto`: bf16 on GPUs that support it, else fp16 "
        "on GPU (with a GradScaler), fp32 on CPU."
    ),
    "trainer": (
        f"Which trainer runs the job, one of {TRAINERS}: `grpo_kit` is the kit's "
        "EfficientGRPOTrainer (no full logits), `trl` TRL's stock GRPOTrainer."
    ),
    "task": f"Training task, one of {TASKS}.",
    "levels": (
        "Difficulty levels of the generated tasks (arithmetic: "
        + "; ".join(f"{n}: {what}" for n, what in LEVELS.items())
        + "; long_document: "
        + "; ".join(f"{n}: {what}" for n, what in LONG_DOCUMENT_LEVELS.items())
        + ")."
    ),
    "dataset_path": (
        "GSM8K-format jsonl (`question`, `answer` with `#### N`) for task=gsm8k; empty: "
        "the hub dataset openai/gsm8k's train split (needs network)."
    ),
    "eval_dataset_path": (
        "task=gsm8k: the held-out problems, a GSM8K-format jsonl (GSM8K's test split); "
        "empty: the hub's test split when dataset_path is empty too, else the held-out "
        "problems are drawn from dataset_path's file (and never trained on)."
    ),
    "num_train_samples": "Training problems to generate (or to take from the jsonl).",
    "num_eval_samples": "Held-out problems for before/after accuracy (0: no evaluation).",
    "system_prompt": (
        "System prompt; empty: the kit's default for the task (arithmetic: the answer only, "
        "as `Answer: <number>`; word problems and GSM8K: brief reasoning, then that line)."
    ),
    "num_generations": "Completions sampled per prompt (the group size); at least 2.",
    "per_device_train_batch_size": (
        "Completions per micro-batch (one "
        "forward/backward); per_device_train_batch_size x "
        "gradient_accumulation_steps must be a multiple of num_generations. The "
        "default is 2 prompts per step: with 1 prompt most early steps of an "
        "untrained small model have no reward spread to learn from."
    ),
    "gradient_accumulation_steps": "Micro-batches per optimiser step.",
    "max_prompt_length": "Longest prompt in tokens; longer prompts are an error, not silently cut.",
    "max_completion_length": "Longest completion in tokens.",
    "temperature": "Sampling temperature (> 0).",
    "top_p": "Nucleus sampling threshold in (0, 1].",
    "top_k": "Top-k sampling (0: off).",
    "min_p": "Min-p sampling threshold in [0, 1) (null or 0: off).",
    "beta": ("KL coefficient (k3 estimator against the reference model); 0 skips the reference pass."),
    "epsilon": "Lower clipping range of the ratio.",
    "epsilon_high": "Upper clipping range (null: same as epsilon).",
    "loss_type": f"GRPO objective and normalisation (TRL's), one of {LOSS_TYPES}.",
    "scale_rewards": f"Advantage scaling, one of {SCALE_REWARDS}.",
    "num_iterations": "Optimisation passes per generated batch (mu in the paper).",
    "mask_truncated_completions": "Exclude completions that hit max_completion_length from the loss.",
    "reward_funcs": (
        f"Reward functions: built-in names from {REWARD_FUNCS}, "
        "`module:function` strings (an importable module, e.g. `my_rewards:length_penalty`) or, "
        "from Python (notebook, trainer API), callables `fn(prompts, completions, **columns)`."
    ),
    "reward_weights": "One weight per reward function (empty: all 1.0).",
    "reward_errors": (
        f"When a reward function raises, one of {REWARD_ERRORS}: `raise` stops training "
        "with an error naming the function and the sample; `zero` scores that sample 0.0 and "
        "logs a warning with the same details."
    ),
    "reward_time_limit_s": (
        "Wall-clock seconds one reward function call may take "
        "(0: no limit); a call that runs longer is stopped and its samples re-run one "
        "by one within one more such budget; a sample that runs out of it scores 0.0 "
        "with a warning naming the function and the sample."
    ),
    "sandbox_filesystem": (
        "What model code run by the code verifier and the python tool sees of "
        "the host's files: `minimal` (the interpreter, its standard library and packages "
        "read-only, a private /tmp; code execution is refused where no mount namespace can "
        "be built) or `host` (weaker: the host's file system, as far as the run's uid may "
        "read it; the plan line names it). See docs/reliability.md."
    ),
    "tools": (
        f"Tools the model may call in its rollout (TRL's multi-turn tool loop): ready tools from "
        f"{list(READY_TOOLS)}, `module:function` strings (a typed function with a Google-style "
        "docstring) or, from Python, callables. Needs a chat template that carries tool calls (the "
        "kit's for SmolLM2 and the tiny models)."
    ),
    "environment": (
        "An environment factory `module:Factory` (TRL's environment_factory): each "
        "rollout gets an instance; its reset(**row) starts it and its public methods are "
        "tools."
    ),
    "tool_time_limit_s": (
        "Wall-clock seconds one tool call may take (0: no limit); a "
        "call that runs longer is a tool failure and the rollout goes on."
    ),
    "tool_output_tokens": ("Tokens of a tool's text result the model sees; the rest is cut with a marker."),
    "max_tool_calling_iterations": ("Rounds of tool calls per rollout (null: until the model stops calling)."),
    "tool_warmup_steps": (
        "Supervised warm-up before GRPO (0: none): this many AdamW steps on the adapter "
        "over worked calculator transcripts of the training questions (the call, the tool's "
        "result, the answer; loss on the assistant's tokens), 4 a step, for a model that "
        "otherwise never calls the tool. Needs the `calculator` tool and questions holding "
        "one arithmetic expression (task arithmetic or multiplication); the held-out "
        "accuracy is measured after it too."
    ),
    "tool_warmup_learning_rate": "Learning rate of the tool warm-up's AdamW.",
    "learning_rate": "Peak learning rate (AdamW).",
    "lr_scheduler_type": "transformers scheduler name.",
    "warmup_steps": "Linear warm-up steps.",
    "weight_decay": "AdamW weight decay.",
    "max_grad_norm": "Gradient clipping norm.",
    "use_lora": (
        "Train a LoRA adapter (the reference model is then the base with it disabled). "
        "false: full fine-tuning; with beta > 0 TRL loads a reference copy from the model's "
        "checkpoint folder, so a random built-in then needs beta=0."
    ),
    "trust_remote_code": (
        "Let a checkpoint's own modelling code run (its config.json's `auto_map`). "
        "Off: such a checkpoint is refused before it loads."
    ),
    "lora_rank": "LoRA rank r.",
    "lora_alpha": "LoRA alpha.",
    "lora_dropout": (
        "LoRA dropout. Above 0 the kit's checkpointing recomputes each layer whole "
        "(the random masks cannot be split into token slices) and each adapter saves its own "
        "dropped input and mask; the VRAM calculator prices both."
    ),
    "lora_target_modules": (
        "Module names that get LoRA adapters, or `auto`: every linear "
        "projection of the model's decoder layers (attention, MLP, linear "
        "attention; routers and the head excluded), found from the model; MoE "
        "experts are fused parameters and not among them."
    ),
    "generation_backend": (
        f"Generation backend of the grpo_kit trainer, one of {GENERATION_BACKENDS}: "
        "`vllm` runs vLLM in the training process (weights synced every optimiser step; "
        "an error when vLLM is not installed, with the install command); `hf` is "
        "transformers `generate` on the training model; `auto` is vLLM where it is "
        "installed and can load the model (the embedded model, a local folder or a hub "
        "id; on CUDA also the random-weight built-ins, started with random weights), else HF (with a warning when vLLM is "
        "installed but cannot be used). trainer=trl always uses TRL's own HF generation."
    ),
    "vllm_gpu_memory_utilization": (
        "Share of GPU memory (CUDA) "
        "or of host RAM (vLLM's CPU backend) that vLLM reserves for its weights and KV cache, in (0, 1]; null: "
        "automatic (on CUDA what the VRAM calculator's training estimate leaves "
        "of the card, less 1 GiB; on the CPU a KV cache of a quarter of free "
        "RAM, at most 4 GiB). A value that cannot fit stops the run before "
        "training starts."
    ),
    "kv_cache_dtype": (
        f"vLLM KV cache dtype, one of {KV_CACHE_DTYPES}: `fp8` stores the KV cache in "
        "FP8 (half of bf16), on platforms whose vLLM supports it; needs the vLLM backend."
    ),
    "vllm_kv_cache_gib": (
        "vLLM's KV cache in GiB (CUDA); null: what one generation batch needs "
        "(prompts x (prompt + num_generations x completion) tokens, the VRAM "
        "calculator's KV row), so the engine holds no more than that. A budget that "
        "cannot fit beside training stops the run before any model loads, with the "
        "calculator's numbers."
    ),
    "vllm_lora_dual_stream": (
        "CUDA, vllm_lora_sync='adapter': run vLLM's LoRA "
        "kernels on a second CUDA stream beside each base matmul "
        "(VLLM_LORA_ENABLE_DUAL_STREAM) instead of after it. null: the kit's "
        "default (grpo_kit.generation.plan.LORA_DUAL_STREAM_DEFAULT)."
    ),
    "vllm_enforce_eager": (
        "vLLM without CUDA graphs and torch.compile (vLLM's enforce_eager): "
        "the engine starts in seconds instead of compiling and capturing graphs, and "
        "decodes slower; also a way to tell a compiled kernel's numerics from the "
        "eager ones. null: eager on the CPU, CUDA graphs on CUDA."
    ),
    "vllm_emulate_precision_casts": (
        "vLLM compiled (not enforce_eager): have torch.compile round each "
        "intermediate to the model's dtype where eager PyTorch does (Inductor's "
        "emulate_precision_casts). Off, a fused kernel keeps fp32 values the "
        "trainer rounds to bf16 first, such as a norm's output before FP8 "
        "activation quantisation: the engine's log-probs drift further from the "
        "trainer's. No effect with enforce_eager or on the CPU."
    ),
    "vllm_lora_sync": (
        f"How the LoRA adapter reaches vLLM each step, one of {LORA_SYNC_MODES} or "
        "null. With shared weights: `adapter` hands the adapter over in memory and vLLM "
        "runs it in its LoRA kernels on every token; `merge` merges it into the shared "
        "weights for each generation and restores their exact bits after it "
        "(grpo_kit.generation.reversible_merge), so vLLM decodes dense. With a "
        "separate engine copy: `merge` loads the merged weights into the copy, "
        "`adapter` runs the adapter in the copy's LoRA kernels. null: `merge`, so vLLM "
        "decodes dense (grpo_kit.generation.plan.lora_sync_mode)."
    ),
    "vllm_importance_sampling_mode": (
        f"vLLM generation: how the loss corrects for the gap "
        "between the engine's log-probs of the sampled tokens and the trainer's "
        f"(TRL's field), one of {ENGINE_IS_MODES}. `token_*` weights each token by "
        "its own ratio exp(trainer - engine), `sequence_*` each sequence by the "
        "product of its tokens' ratios; `*_truncate` clips the ratio to TRL's "
        "bounds (at most 3), `*_mask` sets it to 0 outside them. A per-token gap "
        "of one sign compounds over a sequence's length in the sequence modes "
        "(docs/generation.md)."
    ),
    "vllm_share_weights": (
        "One copy of the weights on CUDA: the training model's frozen base "
        "weights are views of the vLLM engine's tensors, LoRA reaches vLLM in "
        "memory each step, and the engine releases only its KV cache while "
        "training runs (standby). true, false (a separate engine copy, weights "
        "synced each step) or `auto` (shared on CUDA with LoRA and 16-bit or FP8 base "
        "weights; a layout vLLM cannot share falls back to a copy with a warning)."
    ),
    "base_weights": (
        f"How the frozen base linear weights are held, one of {BASE_WEIGHTS}: `16bit` in "
        "the training dtype; `fp8`: FP8 e4m3 with per-output-channel scales, quantised layer by "
        "layer on the GPU (grpo_kit.model.fp8), the forward as a W8A8 matmul, LoRA on top in the "
        "training dtype. `fp8` needs use_lora, a CUDA GPU with FP8 tensor cores (compute "
        "capability 8.9 or newer: L4, RTX 40/50, H100, H200, B200) and load_in_4bit off. With vLLM the "
        "engine serves these same codes and scales (one FP8 copy, shared weights) and runs the "
        "adapter in its LoRA kernels; without shared weights it generates with HF generate. "
        "Rounding activations to FP8 carries the engine's and the trainer's small kernel "
        "differences to FP8's scale, a wider log-prob gap between them (docs/quantization.md): "
        "prefer 16bit where accuracy matters and memory allows."
    ),
    "fp8_block": (
        "FP8 base weights' scales: null, one per output channel (vLLM's compressed-tensors "
        "W8A8 layout), or 128 (FP8_BLOCK): one per 128 x 128 tile (vLLM's block-FP8 layout, "
        "which needs every fused shard to start on a 128-row boundary; a model whose shards do "
        "not generates with HF generate). Applies with base_weights: fp8."
    ),
    "load_in_4bit": (
        "QLoRA: the training model's base linear weights in 4 bit (bitsandbytes NF4, "
        "double quantisation; matmuls in the training dtype), LoRA on top, except the layers "
        "in load_in_4bit_skip_modules. Needs use_lora, a CUDA GPU and bitsandbytes; generates "
        "with HF generate (vLLM cannot take a 4-bit training model's weights yet)."
    ),
    "load_in_4bit_skip_modules": (
        "Layers kept in 16 bit when load_in_4bit is on: a list "
        "of names (substrings of the module names, e.g. `down_proj`, "
        "`model.layers.0.`; lm_head always stays 16-bit) or `auto`: lm_head "
        "plus the layers whose NF4 error on a short calibration pass is "
        "largest, within load_in_4bit_auto_allowance (grpo_kit.model.quantize)."
    ),
    "load_in_4bit_auto_allowance": (
        "With load_in_4bit_skip_modules=auto: the extra memory the "
        "16-bit layers may cost, as a fraction of the 4-bit weights' bytes."
    ),
    "load_in_4bit_matmul": (
        "How a 4-bit layer multiplies when load_in_4bit is on: `kit` "
        "(grpo_kit.model.nf4_matmul: each weight dequantised once per decoder-layer call by one "
        "Triton kernel, bit-equal to bitsandbytes', and kept for that call; one layer's "
        "weights in 16 bit extra) or `bitsandbytes` (its own Linear4bit, which dequantises "
        "for every matmul, forward and backward, and for short inputs on some GPUs multiplies "
        "with its own fused kernel, which rounds differently)."
    ),
    "gradient_checkpointing": (
        "Gradient checkpointing: true, false "
        "or `auto` (on when training on a CUDA GPU, off on the CPU, where it "
        "would only recompute). With the grpo_kit trainer on a GPU the layer inputs are "
        "offloaded to CPU RAM (grpo_kit.model.offload)."
    ),
    "loss_chunk_size": ("Rows per logits chunk in the efficient loss (null: chosen from free memory)."),
    "scoring_batch_size": (
        "Completions per no-grad forward when the grpo_kit trainer "
        "scores a generation batch (the reference model's log-probs, and TRL's "
        "old-policy pass where it runs; verl's log_prob_micro_batch_size). "
        "Larger means fewer, fuller forwards (with 4-bit weights, fewer "
        "dequantisations) for the activations of that many sequences, which "
        "the VRAM calculator prices as its own phase. `auto`: the largest, up "
        "to one generation batch, that does not raise the calculator's peak "
        "of the step (with vLLM, of its training phases: the engine's KV "
        "cache is memory the scoring pass cannot use; the run folder's "
        "summary.json records the choice); null: "
        "per_device_train_batch_size, as TRL. Safe to change on resume."
    ),
    "prefix_sharing": (
        "With the grpo_kit trainer, score each group's shared prompt once: its forward runs once and the group's "
        "completions attend to its keys and values, in the policy, reference and old-policy passes "
        "(grpo_kit.model.prefix). `auto`: where the prompt is at least 1,024 tokens and as long as the group's mean "
        "completion; true: every group whose prompts are equal; false: never. Rows whose prompt no other row of "
        "their micro-batch shares are scored as usual (said once in the log)."
    ),
}


def trl_field_help() -> dict[str, str]:
    """TRL's help text of each ``GRPOConfig`` field (imports TRL)."""
    from trl import GRPOConfig  # lazy: TRL is slow to import; only help for the objective's options needs it

    return {f.name: f.metadata.get("help", "") for f in dataclasses.fields(GRPOConfig)}
