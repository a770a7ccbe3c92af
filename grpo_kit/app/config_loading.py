"""Reading a config: YAML files and ``--set key=value`` strings within a config's limits (a flat mapping of short
values; an alias bomb or a deep nesting is refused while it is read), and each value coerced to its field's type
with one clear ``ConfigError`` (:func:`coerce`)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import yaml

from grpo_kit.app.config_checks import NUMERIC_RANGES, ConfigError, numeric_problem, plain_list_problem, short
from grpo_kit.readers.bounded import InputError, parse_json

# What a YAML config (file or --set value) may hold: a config is a flat mapping of short values, so anything
# larger is refused before it is built (an alias bomb expands to billions of entries from a few lines).
MAX_YAML_BYTES = 1 << 20
MAX_YAML_DEPTH = 16
MAX_YAML_ALIASES = 100
MAX_YAML_NODES = 100_000  # after aliases are expanded


def _report_to(key: str, value):
    """report_to from YAML, ``--set`` or a notebook: null, 'none', 'all', a name, a comma string or a list; a
    list of names, or 'none' / 'all' alone (names are checked by validate())."""
    if isinstance(value, str) and value.strip().startswith("["):  # a YAML/JSON list given as text
        if len(value) > MAX_YAML_BYTES:
            raise ConfigError(f"{key}: the value is {len(value)} characters; at most {MAX_YAML_BYTES}")
        try:
            value = load_yaml(value, f"{key}=...")  # within the config's limits, wherever the text came from
        except yaml.YAMLError:
            raise ConfigError(f"{key}={short(value)} is not a valid list") from None
    if value is None:
        return "none"
    if isinstance(value, str):
        names = [v.strip() for v in value.split(",") if v.strip()]
    elif isinstance(value, (list, tuple)):
        names = list(dict.fromkeys(value)) if all(isinstance(v, str) for v in value) else list(value)
    else:
        raise ConfigError(f"{key}={value!r} has the wrong type: expected 'none', 'all', a tracker name or a list")
    return "none" if names in ([], ["none"]) else "all" if names == ["all"] else names


class _LimitedLoader(yaml.SafeLoader):
    """PyYAML's safe loader that refuses, while it reads, nesting deeper than ``MAX_YAML_DEPTH`` and more than
    ``MAX_YAML_ALIASES`` aliases (each a ``_TooBig``)."""

    def __init__(self, stream):
        super().__init__(stream)
        self.kit_depth, self.kit_aliases = 0, 0

    def compose_node(self, parent, index):
        if self.check_event(yaml.AliasEvent):
            self.kit_aliases += 1
            if self.kit_aliases > MAX_YAML_ALIASES:
                raise _TooBig(f"uses more than {MAX_YAML_ALIASES} aliases (*name)")
            return super().compose_node(parent, index)
        self.kit_depth += 1
        try:
            if self.kit_depth > MAX_YAML_DEPTH:
                raise _TooBig(f"is nested more than {MAX_YAML_DEPTH} levels deep")
            return super().compose_node(parent, index)
        finally:
            self.kit_depth -= 1


class _TooBig(Exception):
    """A YAML text beyond the limits of a config (its message says which)."""


def _expanded_nodes(root) -> int:
    """Nodes of a composed YAML tree with every alias expanded, counted without expanding them (each node's count
    once); ``_TooBig`` beyond ``MAX_YAML_NODES`` or for a node that contains itself. Iterative: no recursion."""
    counts: dict[int, int] = {}
    stack, on_path = [(root, False)], set()
    while stack:
        node, children_done = stack.pop()
        children = (
            [c for item in node.value for c in (item if isinstance(item, tuple) else (item,))]
            if isinstance(node.value, list)
            else []
        )
        if children_done:
            on_path.discard(id(node))
            counts[id(node)] = min(MAX_YAML_NODES + 1, 1 + sum(counts[id(c)] for c in children))
            if counts[id(node)] > MAX_YAML_NODES:
                raise _TooBig(f"expands (aliases included) to more than {MAX_YAML_NODES} values")
            continue
        if id(node) in counts:
            continue
        if id(node) in on_path:
            raise _TooBig("holds an alias that refers to itself")
        on_path.add(id(node))
        stack.append((node, True))
        stack.extend((c, False) for c in children if id(c) not in counts)
    return counts[id(root)]


def load_yaml(text: str, what: str):
    """``yaml.safe_load`` within the limits of a config (``MAX_YAML_*``); a text beyond them is a ``ConfigError``
    naming ``what`` (the file or the --set value) and the limit, raised before any value is built. YAML syntax
    errors stay ``yaml.YAMLError``."""
    loader = _LimitedLoader(text)
    try:
        root = loader.get_single_node()
        if root is None:
            return None
        _expanded_nodes(root)
        return loader.construct_document(root)
    except _TooBig as e:
        raise ConfigError(f"{what} {e}; a config is a mapping of short values") from None
    finally:
        loader.dispose()


def coerce(key: str, value, annotation):
    """Coerce YAML/CLI/papermill values to the field's type, or raise a clear error."""
    typ = {"int": int, "float": float, "bool": bool, "str": str, "list": list}.get(
        annotation if isinstance(annotation, str) else getattr(annotation, "__name__", ""), None
    )
    err = ConfigError(f"{key}={short(value)} has the wrong type: expected {getattr(typ, '__name__', annotation)}")
    if isinstance(annotation, str) and annotation.endswith(" | None"):  # null, or a value of the type
        if value is None or (isinstance(value, str) and value.strip().lower() in ("null", "none", "~")):
            return None
        return coerce(key, value, annotation.removesuffix(" | None"))
    if annotation == "str | list":  # report_to: TRL's 'none' / 'all', a name, several as a list or a comma string
        return _report_to(key, value)
    if annotation == "int | str":  # "auto", or an int
        if isinstance(value, str) and value.strip().lower() == "auto":
            return "auto"
        if isinstance(value, str):
            raise ConfigError(f"{key}={value!r} is not allowed: an integer, 'auto' or null")
        return coerce(key, value, "int")
    if annotation == "list | str":  # "auto", or a list
        if isinstance(value, str) and value.strip().lower() == "auto":
            return "auto"
        return coerce(key, value, "list")
    if annotation == "bool | str":  # true / false / "auto"
        if isinstance(value, str) and value.strip().lower() == "auto":
            return "auto"
        try:
            return coerce(key, value, "bool")
        except ConfigError:
            raise ConfigError(f"{key}={value!r} is not allowed: true, false or 'auto'") from None
    if typ is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false", "1", "0", "yes", "no"):
            return value.lower() in ("true", "1", "yes")
        raise err
    if typ is int:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise err
        if isinstance(value, float) and not value.is_integer():  # 2.5, inf, nan: the range, no int() traceback
            raise ConfigError(numeric_problem(key, value, "int") if key in NUMERIC_RANGES else str(err))
        return int(value)
    if typ is float:
        if isinstance(value, str):  # YAML 1.1 reads exponents without a dot (2e-4, 5e-5, 1e-6) as strings
            try:
                return float(value.strip())
            except ValueError:
                raise err from None
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise err
        return float(value)
    if typ is str:
        if not isinstance(value, str):
            raise err
        return value
    if typ is list:
        if isinstance(value, str):
            try:
                value = parse_json(value, f"{key}=...", max_bytes=MAX_YAML_BYTES)
            except InputError as e:
                raise ConfigError(f"{e}; expected a list of values") from None
            except json.JSONDecodeError:
                value = [v.strip() for v in value.split(",") if v.strip()]
        if not isinstance(value, (list, tuple)):
            raise err
        problem = plain_list_problem(key, list(value))
        if problem:
            raise ConfigError(problem)
        return list(value)
    return value


def read_config_file(path: str | os.PathLike) -> dict:
    """The mapping a YAML config file holds (``{}`` for an empty file); ``ConfigError`` for a missing file, one
    beyond the limits, text that is not UTF-8 or not YAML."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file {str(path)!r} does not exist")
    if p.stat().st_size > MAX_YAML_BYTES:
        raise ConfigError(
            f"config file {str(path)!r} is {p.stat().st_size / 2**20:.1f} MiB; a config is at most "
            f"{MAX_YAML_BYTES / 2**20:.0f} MiB"
        )
    try:
        return load_yaml(p.read_text(encoding="utf-8"), f"config file {str(path)!r}") or {}
    except UnicodeDecodeError as e:
        raise ConfigError(f"config file {str(path)!r} is not UTF-8 text (byte {e.start})") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"config file {str(path)!r} is not valid YAML: {e}") from None
    except RecursionError:
        raise ConfigError(f"config file {str(path)!r} is nested too deeply to be a config") from None


def parse_override(item: str) -> tuple[str, object]:
    """``(key, value)`` of one ``key=value`` string as given to ``--set``: the value read as a YAML scalar (text
    that is no YAML stays text, ``key=`` is the empty string)."""
    if "=" not in item:
        raise ConfigError(f"--set expects key=value, got {item!r}")
    key, raw = item.split("=", 1)
    if len(raw) > MAX_YAML_BYTES:
        raise ConfigError(f"--set {key.strip()}=...: the value is {len(raw)} characters; at most {MAX_YAML_BYTES}")
    try:
        value = load_yaml(raw, f"--set {key.strip()}=...") if raw != "" else ""
    except yaml.YAMLError:
        value = raw
    return key.strip(), value
