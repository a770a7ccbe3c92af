"""Kernels behind the optimised paths; each has a torch twin with the same numbers (layer: kernels, the lowest;
imports nothing of the kit, and no TRL).

``grpo_epilogue``: the per-chunk epilogue of ``grpo_kit.loss.efficient.efficient_grpo_loss``
(row logsumexp + target log-prob, and the in-place softmax-minus-one-hot gradient).

``lora_merge``: the scan, merge and restore passes of
``grpo_kit.generation.reversible_merge`` (the LoRA adapter merged into shared weights and their exact
bits put back), one Triton kernel on CUDA and torch row blocks elsewhere.

``fp8_rows``: FP8 e4m3 per-row scaling for ``grpo_kit.model.fp8``: activations quantised row by row (the W8A8
forward's other operand, and the FP8 backward's gradient) and per-channel FP8 weights back to 16 bit.

``nf4_dequant``: bitsandbytes' NF4 weights (double quantisation) back to 16 bit in one launch, for the
4-bit matmul of ``grpo_kit.model.nf4_matmul``; bitsandbytes' own dequantisation elsewhere.
"""
