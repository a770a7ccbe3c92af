"""MkDocs hooks: bring the repository's notebooks and benchmark results into the site, and generate the
configuration reference from the config's field metadata.

The pages under docs/ link to ``../notebooks/NAME.ipynb`` and ``../bench/results/NAME.md``, the files as they
lie in the repository (so the links also work when the Markdown is read on GitHub). The site mounts those two
folders at the same paths (``notebooks/``, ``bench/results/``) and these hooks rewrite such links to the mounted
copies, so ``mkdocs build --strict`` checks them like any other link.
"""

from __future__ import annotations

import dataclasses
import posixpath
import re
from pathlib import Path

from mkdocs.plugins import event_priority
from mkdocs.structure.files import File

REPO = Path(__file__).resolve().parent.parent
DOCS = "docs"
# repository folder -> which of its files the site carries (notebooks: the executed .ipynb, rendered by
# mkdocs-jupyter; results: the pages, their pictures and data)
MOUNTS = {"notebooks": (".ipynb",), "bench/results": (".md", ".png", ".json", ".csv", ".txt", ".yaml", ".jsonl")}
SINGLE = ("CHANGELOG.md",)  # repository files the site carries as pages
CONFIG_MARKER = "<!-- config-reference -->"
SUPPORTED_MARKER = "<!-- supported-models -->"  # grpo_kit.app.models.SUPPORTED_MARKER
VERSIONS_MARKER = "<!-- tested-versions -->"
# the package's layers, lowest first (grpo_kit/__init__.py); each gets an API page of its modules
LAYERS = ("kernels", "readers", "loss", "model", "tasks", "memory", "generation", "trainer", "app", "notebook")
LINK = re.compile(r"(!?\[[^\]]*\]\()([^)\s]+)(\))")


def _mounted(repo_path: str) -> bool:
    return repo_path in SINGLE or any(
        repo_path.startswith(folder + "/") and repo_path.endswith(exts) for folder, exts in MOUNTS.items()
    )


@event_priority(100)  # before mkdocs-jupyter's on_files, which turns the mounted notebooks into pages
def on_files(files, config):
    site = config["site_dir"]
    paths = [REPO / name for name in SINGLE]
    paths += [p for folder in MOUNTS for p in sorted((REPO / folder).rglob("*"))]
    for path in paths:
        rel = path.relative_to(REPO).as_posix()
        if path.is_file() and _mounted(rel) and files.get_file_from_path(rel) is None:
            files.append(File(rel, src_dir=str(REPO), dest_dir=site, use_directory_urls=config["use_directory_urls"]))
    for layer in LAYERS:
        files.append(File.generated(config, f"api/{layer}.md", content=api_page(layer)))
    return files


def api_page(layer: str) -> str:
    """One layer's API page: its package docstring, then every public module of the folder, rendered by
    mkdocstrings from the docstrings. Generated at build time, so a module added, moved or renamed needs no
    edit here."""
    folder = REPO / "grpo_kit" / layer
    modules = sorted(p.stem for p in folder.glob("*.py") if not p.stem.startswith("_"))
    lines = [
        f"# {layer}/",
        "",
        f"::: grpo_kit.{layer}",
        "    options:",
        "      members: false",
        "      show_root_heading: false",
        "",
    ]
    for module in modules:
        lines += [f"::: grpo_kit.{layer}.{module}", ""]
    return "\n".join(lines)


def _rewrite_links(markdown: str, src_uri: str, on_disk: str) -> str:
    """Point links at the mounted copies: a docs page's ``../bench/results/x.md`` becomes the site's
    ``bench/results/x.md``; a mounted result page's link out of the mounted folders (to a script, say) becomes
    code text, since the site carries the results, not the source."""

    def fix(m):
        target = m.group(2)
        if "://" in target or target.startswith(("#", "mailto:", "/")):
            return m.group(0)
        path, _, frag = target.partition("#")
        repo_path = posixpath.normpath(posixpath.join(posixpath.dirname(on_disk), path))
        if _mounted(repo_path):
            new = posixpath.relpath(repo_path, posixpath.dirname(src_uri) or ".")
            return m.group(1) + new + ("#" + frag if frag else "") + m.group(3)
        if repo_path.startswith(DOCS + "/"):  # a mounted page's link into the documentation
            new = posixpath.relpath(repo_path[len(DOCS) + 1 :], posixpath.dirname(src_uri) or ".")
            return m.group(1) + new + ("#" + frag if frag else "") + m.group(3)
        if on_disk != DOCS + "/" + src_uri:
            text = m.group(1)[m.group(1).index("[") + 1 : -2]
            return f"{text} (`{repo_path}`)"
        return m.group(0)

    return LINK.sub(fix, markdown)


def config_reference() -> str:
    """The configuration reference table: every field of ``GRPOKitConfig``, its default and its help text."""
    from grpo_kit.app.config import GRPOKitConfig  # lazy: only the build needs the kit (and torch)
    from grpo_kit.app.config_help import FIELD_HELP  # lazy: as above

    rows = ["| field | default | what it does |", "|---|---|---|"]
    for f in dataclasses.fields(GRPOKitConfig):
        if f.default is not dataclasses.MISSING:
            default = repr(f.default)
        elif f.default_factory is not dataclasses.MISSING:
            default = repr(f.default_factory())
        else:
            default = "required"
        text = " ".join(str(FIELD_HELP.get(f.name, "")).split()).replace("|", "\\|")
        rows.append(f"| `{f.name}` | `{default}` | {text} |")
    return "\n".join(rows)


def on_page_markdown(markdown, page, config, files):
    src_uri = page.file.src_uri
    if page.file.abs_src_path is None:  # a generated API page: no links of its own
        return markdown
    on_disk = Path(page.file.abs_src_path).resolve().relative_to(REPO).as_posix()
    if CONFIG_MARKER in markdown:
        markdown = markdown.replace(CONFIG_MARKER, config_reference())
    if VERSIONS_MARKER in markdown:
        from grpo_kit.generation.versions import TESTED_VERSIONS  # lazy: only the build needs the kit

        rows = ["| package | tested | outside the window |", "|---|---|---|"]
        rows += [
            f"| `{p}` | {lo if lo == hi else f'{lo} - {hi}'} | {risk} |"
            for p, (lo, hi, risk) in TESTED_VERSIONS.items()
        ]
        markdown = markdown.replace(VERSIONS_MARKER, "\n".join(rows))
    if SUPPORTED_MARKER in markdown:
        from grpo_kit.app.models import supported_models_page  # lazy: only the build needs the kit (and torch)

        markdown = markdown.replace(SUPPORTED_MARKER, supported_models_page())
    return _rewrite_links(markdown, src_uri, on_disk)
