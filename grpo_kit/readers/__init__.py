"""Reading untrusted input within limits (layer: readers, the lowest beside ``kernels``; imports nothing of the kit, and no TRL).

``bounded``: every JSON document and JSON-lines file the package parses goes through it, with a size limit, a
depth limit and one clear error naming the input and the limit (YAML: the config's own limited loader,
``grpo_kit.app.config_loading.load_yaml``).
"""
