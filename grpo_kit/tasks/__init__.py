"""What the model is asked and how its answers are judged (layer: tasks; may import ``kernels``, ``readers``
and ``loss``; no TRL).

Verifiable tasks (arithmetic, word problems, multiplication, a fact in a long document) and GSM8K, reward functions
and answer parsing, the code verifier and its sandbox, time limits.
"""
