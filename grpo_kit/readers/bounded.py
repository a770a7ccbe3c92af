"""JSON within limits: a document of at most ``max_bytes``, nesting no deeper than Python's recursion allows, lines
read one at a time with a per-line and a total limit. What is beyond a limit raises :class:`InputError` (a
``ValueError``) naming the input and the limit, having read at most the limit plus one byte of it: a 6 GB line is
never held whole. Syntax errors stay ``json.JSONDecodeError`` (also a ``ValueError``).
"""

from __future__ import annotations

import json
import os

# A model's config, a checkpoint's manifest or state files, a run's summary: far under this.
MAX_JSON_BYTES = 64 << 20


class InputError(ValueError):
    """Input beyond a reader's limits; the message names the input and the limit."""


def size_text(n: int) -> str:
    """``n`` bytes for a message: "1 MiB", "6.2 GiB", "812 bytes"."""
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift:
            v = n / (1 << shift)
            return f"{v:.0f} {unit}" if v == int(v) else f"{v:.1f} {unit}"
    return f"{n} bytes"


def parse_json(data: str | bytes, what: str, *, max_bytes: int = MAX_JSON_BYTES):
    """``json.loads(data)`` for a text of at most ``max_bytes``; ``what`` names it in the error."""
    if len(data) > max_bytes:
        raise InputError(f"{what}: more than {size_text(max_bytes)} of JSON, the most that is read")
    try:
        return json.loads(data)
    except RecursionError:  # the C scanner's recursion guard: a bomb of nesting, not a document
        raise InputError(f"{what}: JSON nested too deeply to be read") from None


def read_json(path: str | os.PathLike, what: str | None = None, *, max_bytes: int = MAX_JSON_BYTES):
    """The JSON document in the file ``path`` (at most ``max_bytes`` are read)."""
    with open(path, "rb") as fh:
        data = fh.read(max_bytes + 1)
    return parse_json(data, what or str(path), max_bytes=max_bytes)


def read_lines(path: str | os.PathLike, *, max_line_bytes: int, max_total_bytes: int, what: str | None = None):
    """``(line number, bytes)`` for each line of the file ``path``, one read at a time: a line longer than
    ``max_line_bytes`` (its newline included) or a file past ``max_total_bytes`` raises :class:`InputError` after
    at most ``max_line_bytes + 1`` bytes of that line were read."""
    what = what or str(path)
    total = 0
    with open(path, "rb") as fh:
        size = os.fstat(fh.fileno()).st_size
        if size > max_total_bytes:
            raise InputError(f"{what} is {size_text(size)}; at most {size_text(max_total_bytes)} is read")
        lineno = 0
        while line := fh.readline(max_line_bytes + 1):
            lineno += 1
            if len(line) > max_line_bytes:
                raise InputError(f"{what}:{lineno}: the line is longer than {size_text(max_line_bytes)}")
            total += len(line)
            if total > max_total_bytes:
                raise InputError(f"{what}: more than {size_text(max_total_bytes)} (at line {lineno})")
            yield lineno, line
