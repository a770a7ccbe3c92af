"""The policy model and what makes it cheap (layer: model; may import ``kernels``, ``readers`` and
``loss``; no TRL).

Loading (the embedded SmolLM2, tiny random and config-only architectures), 4-bit base weights and their matmul,
the pad-free causal layout, activation offload (each layer's input parked in host RAM until backward), prefix-shared
scoring (a group's shared prompt run once), and where and in which dtype a run trains.
"""
