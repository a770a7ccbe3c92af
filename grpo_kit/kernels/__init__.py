"""Kernels behind the optimised paths; each has a torch twin with the same numbers.

``grpo_epilogue``: the per-chunk epilogue of ``grpo_kit.loss.efficient_grpo_loss``
(row logsumexp + target log-prob, and the in-place softmax-minus-one-hot gradient).
"""
