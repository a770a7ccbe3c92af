"""Names shared by several modules, defined once (no torch, no TRL: the config imports it).

``LOSS_TYPES``: TRL 1.16's ``GRPOConfig.loss_type`` values, all computed by
:mod:`grpo_kit.loss.objective`. ``IMPORTANCE_SAMPLING_LEVELS``: ``GRPOConfig.importance_sampling_level``.
``GENERATION_BACKENDS``: :func:`grpo_kit.generation.make_generator`'s ``backend``.
``REWARD_ERRORS``: what :func:`grpo_kit.tasks.rewards.checked_reward_func` does when a reward function raises.
``ENGINE_IS_MODES``: ``GRPOConfig.vllm_importance_sampling_mode`` (the engine's importance-sampling correction).
``LORA_SYNC_MODES``: how a LoRA adapter reaches a vLLM engine (``VLLMGenerator(lora_sync=...)``, the config's
``vllm_lora_sync``).
``NF4_MATMULS``: how a 4-bit layer multiplies (:func:`grpo_kit.model.nf4_matmul.use_nf4_matmul`, the config's
``load_in_4bit_matmul``).
"""

LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "vespo", "luspo")
IMPORTANCE_SAMPLING_LEVELS = ("token", "sequence")
GENERATION_BACKENDS = ("auto", "hf", "vllm")
REWARD_ERRORS = ("raise", "zero")
ENGINE_IS_MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")
LORA_SYNC_MODES = ("merge", "adapter")
NF4_MATMULS = ("kit", "bitsandbytes")
