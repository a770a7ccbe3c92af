"""The GRPO objective and its efficient loss (layer: loss; may import ``kernels`` only; no TRL).

``registry``: each loss type (grpo, dapo, cispo, ...) as one registered per-token function with its normaliser
and metrics; ``objective``: the per-token objective once, as the papers write it, and the built-in loss types;
``advantage``: the group-relative advantage; ``reference``: the loss in plain torch on per-token log-probs;
``efficient``: the chunked, memory-efficient loss that never holds the logits, held equal to the reference by
tests; ``checks``: the argument checks both share.
"""
