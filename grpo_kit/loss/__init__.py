"""The GRPO objective and its efficient loss (layer: loss; may import ``kernels`` only; no TRL).

``objective``: the per-token objective once, as the papers write it, with its variants; ``efficient``: the
chunked, memory-efficient loss that never holds the logits, held equal to its plain-torch reference by tests.
"""
