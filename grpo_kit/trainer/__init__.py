"""The TRL adapter (layer: trainer; may import every core layer and ``generation``; not ``app`` or ``notebook``).

``EfficientGRPOTrainer`` subclasses TRL's ``GRPOTrainer`` once: the efficient loss in place of TRL's, the kit's
generation hook, guards for long runs, and checkpoints that survive a kill.
"""
