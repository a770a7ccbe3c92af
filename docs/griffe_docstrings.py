"""A Griffe extension for the API pages: the kit's docstrings are reStructuredText-flavoured plain text, and
the site renders them as Markdown. Doctest examples become code blocks (their ``[...]`` outputs are not links),
Sphinx roles (:func:`x`) become code, and a bracket pair in prose (``[0 ... 0][1 ... 1]``) is not read as a
Markdown reference link."""

from __future__ import annotations

import re

import griffe

ROLE = re.compile(r":(?:func|mod|class|meth|attr|data|obj|exc|const):`~?([^`]+)`")
CODE = re.compile(r"(``.*?``|`[^`]*`)")  # inline code, left as it is


def _prose(line: str) -> str:
    parts = CODE.split(ROLE.sub(r"`\1`", line))
    return "".join(p if i % 2 else p.replace("][", "]\\[") for i, p in enumerate(parts))


def markdown_docstring(text: str) -> str:
    out, in_doctest, in_fence = [], False, False
    for line in text.split("\n"):
        stripped = line.strip()
        if stripped.startswith("```"):
            in_fence = not in_fence
        if not in_fence and stripped.startswith(">>>") and not in_doctest:
            out.append("```python")
            in_doctest = True
        elif in_doctest and not stripped:
            out.append("```")
            in_doctest = False
        if not in_doctest and not in_fence:
            line = _prose(line)
        out.append(line)
    if in_doctest:
        out.append("```")
    return "\n".join(out)


class MarkdownDocstrings(griffe.Extension):
    def on_object(self, *, obj, **kwargs):
        if obj.docstring is not None:
            obj.docstring.value = markdown_docstring(obj.docstring.value)
