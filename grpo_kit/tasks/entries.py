"""Config entries that name a callable: a built-in name, ``module:function`` (dots allowed after the colon for an
attribute of an attribute), or, from Python, the callable itself. Reward functions and tools are both given so."""

from __future__ import annotations

import importlib


def resolve_entry(spec, what: str, builtins: dict, usage: str):
    """The callable a config entry names. ``what``: the kind, for messages ("reward function", "tool");
    ``builtins``: name -> callable; ``usage``: what an unknown name should be instead. A bad entry raises
    ``ValueError`` naming it and what failed."""
    if callable(spec):
        return spec
    if not isinstance(spec, str):
        raise ValueError(f"{what} {spec!r}: expected {usage}, got {type(spec).__name__}")
    if spec in builtins:
        return builtins[spec]
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"unknown {what} {spec!r}; use {usage}")
    try:
        obj = importlib.import_module(module_name)
    except Exception as e:  # the module's own import errors too: name the entry, keep the cause
        raise ValueError(f"{what} {spec!r}: cannot import module {module_name!r} ({type(e).__name__}: {e})") from None
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ValueError(f"{what} {spec!r}: module {module_name!r} has no attribute {attr!r}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise ValueError(f"{what} {spec!r}: {attr!r} is a {type(obj).__name__}, not a callable")
    return obj


def resolve_entries(specs, resolve) -> list:
    """Every entry of ``specs`` through ``resolve``; every bad entry in one ``ValueError``."""
    out, errors = [], []
    for spec in specs or ():
        try:
            out.append(resolve(spec))
        except ValueError as e:
            errors.append(str(e))
    if errors:
        raise ValueError("; ".join(errors))
    return out
