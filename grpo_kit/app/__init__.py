"""The application (layer: app; may import every layer below it; not ``notebook``).

The one config object, ``train()``, the run folder, the command line, what a run prints, the pre-flight check,
held-out evaluation and export.
"""
