"""The application (layer: app; may import every layer below it; not ``notebook``).

The one config object (``config.py``: its fields; ``config_help.py``, ``config_checks.py``, ``config_loading.py``:
their help, their checks, reading YAML and ``--set``), each lower layer's spec of it (``specs.py``, the one place
the config is translated for the layers below), ``train()``, the run folder, the command line, what a run prints,
the pre-flight check, held-out evaluation and export.
"""
