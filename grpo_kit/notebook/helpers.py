"""Helpers the notebooks call: parameter validation, hardware-dependent setup choice,
and the small formulas notebook 01 demonstrates (KL estimators; the group advantage is
:func:`grpo_kit.loss.advantage.group_advantages`).

Nothing here trains; the notebooks call ``grpo_kit.app.run.train`` for that.
"""

from __future__ import annotations

import importlib.util
import io
import socket
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from grpo_kit.app.config import GRPOKitConfig
from grpo_kit.app.console import quiet_console
from grpo_kit.generation import vllm_install_advice
from grpo_kit.loss.objective import k3_kl
from grpo_kit.model.devices import unusable_gpu
from grpo_kit.readers.bounded import parse_json, read_json

SETUP_CHOICES = ("auto", "full", "fallback")  # a notebook's `setup` parameter
_EXTRA_TYPES = {int: "int", float: "float", str: "str", bool: "bool", list: "list"}


def in_colab() -> bool:
    """True when running inside Google Colab (Colab imports ``google.colab`` into every kernel)."""
    return "google.colab" in sys.modules


def online(host: str = "huggingface.co", port: int = 443, timeout: float = 2.0) -> bool:
    """Whether ``host:port`` accepts a TCP connection within ``timeout`` seconds."""
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


def validate_params(config: dict, extras: dict | None = None, extra_types: dict | None = None) -> GRPOKitConfig:
    """Build and validate the run's ``GRPOKitConfig`` from a notebook's parameters cell.

    config: field -> value for ``GRPOKitConfig`` (wrong types, unknown fields, unknown
    models raise ``ConfigError``, a ``ValueError``, naming the field and what is allowed).
    extras / extra_types: the notebook's own parameters (not config fields) and the type each
    must have, e.g. ``{"dashboard": "auto"}`` / ``{"dashboard": str}``; a wrong type raises
    ``ValueError`` naming the parameter.
    """
    extras, extra_types = extras or {}, extra_types or {}
    for name, value in extras.items():
        if name not in extra_types:
            raise ValueError(f"parameter {name!r} has no declared type; declared: {sorted(extra_types)}")
        want = extra_types[name]
        ok = isinstance(value, want) and not (want in (int, float) and isinstance(value, bool))
        if want is float and isinstance(value, int) and not isinstance(value, bool):
            ok = True
        if not ok:
            raise ValueError(f"parameter {name}={value!r} has the wrong type: expected {_EXTRA_TYPES.get(want, want)}")
    return GRPOKitConfig.from_dict(dict(config)).validate()


def _setup_choice(choice: str, need_packages: tuple, param: str) -> tuple[str, list[str]]:
    """``"full"`` or ``"fallback"`` for a notebook's ``choice`` (``"auto"``, ``"full"`` or ``"fallback"``, the
    parameter named ``param`` in the error), and why ``"auto"`` fell back (:func:`full_setup_blockers`; [] else)."""
    if choice not in SETUP_CHOICES:
        raise ValueError(f"{param}={choice!r} is not allowed; choose one of {list(SETUP_CHOICES)}")
    blockers = full_setup_blockers(need_packages) if choice == "auto" else []
    return ("fallback" if choice == "fallback" or blockers else "full"), blockers


@dataclass(frozen=True)
class NotebookSetup:
    """What :func:`notebook_setup` chose: ``name`` ``"full"`` or ``"fallback"``, the validated ``config``, the
    ``device`` (``"cuda"`` / ``"cpu"``) and ``dtype`` it trains in, and ``reason``, why the fallback ("" if none)."""

    name: str
    config: GRPOKitConfig
    device: str
    dtype: torch.dtype
    reason: str = ""

    def line(self) -> str:
        """The one line the notebook prints: what runs where, and why the fallback."""
        c = self.config
        why = f" ({self.reason})" if self.reason else ""
        return (
            f"setup: {self.name}{why}: {c.model}, task {c.task}, {c.max_steps} steps of {c.num_generations} "
            f"completions up to {c.max_completion_length} tokens, on {self.device} in "
            f"{str(self.dtype).removeprefix('torch.')}"
        )


def notebook_setup(
    full: dict,
    fallback: dict | None = None,
    *,
    setup: str = "auto",
    need_packages: tuple = (),
    verbose: bool = False,
    extras: dict | None = None,
    extra_types: dict | None = None,
    full_on_gpu: dict | None = None,
    show: bool = True,
) -> NotebookSetup:
    """A training notebook's setup in one call: the kit's quiet console first (so no third-party warning of the
    imports that follow reaches the notebook; ``verbose`` brings them back), both settings validated before
    anything loads (``full`` / ``fallback``: ``GRPOKitConfig`` fields; ``extras`` / ``extra_types``: the
    notebook's own parameters, see :func:`validate_params`), then the full setup where it can run here (a GPU
    torch can use, ``need_packages`` importable, the hub reachable) or else the fallback; ``setup`` ``"full"`` /
    ``"fallback"`` forces one. The device and dtype are the run's (bf16 where the GPU has it, fp16 on a T4, fp32
    on the CPU). ``full_on_gpu``: fields the full setup adds that ask this machine for a GPU (4-bit or FP8 base
    weights); they join ``full`` and are checked only where the full setup is chosen, since a CPU machine that
    falls back cannot answer for them. Prints :meth:`NotebookSetup.line` unless ``show`` is False."""
    quiet_console(verbose)
    from grpo_kit.app.run import resolve_device, resolve_dtype  # lazy: it imports peft, which warns: console first

    configs = {
        "full": validate_params(full, extras, extra_types),
        "fallback": None if fallback is None else validate_params(fallback),
    }
    # with no fallback, auto has nothing to fall back to
    name, blockers = _setup_choice("full" if fallback is None and setup == "auto" else setup, need_packages, "setup")
    if name == "fallback" and fallback is None:
        raise ValueError("setup='fallback' needs the fallback settings")
    cfg = configs[name]
    if name == "full" and full_on_gpu:
        cfg = validate_params({**full, **full_on_gpu})
    device = resolve_device(cfg)
    chosen = NotebookSetup(name, cfg, device, resolve_dtype(cfg, device), "; ".join(blockers))
    if show:
        print(chosen.line())
    return chosen


def full_setup_blockers(need_packages: tuple = ()) -> list[str]:
    """Why a notebook's full setup cannot run here, in words ([] when it can): no GPU that torch can use (with the
    driver's reason where that is why), a package of ``need_packages`` missing (for vLLM: how to get it, or why it
    cannot run on this driver), the model hub unreachable (checked last: it waits up to 2 s)."""

    blockers = []
    if not torch.cuda.is_available():
        why = unusable_gpu()
        blockers.append(f"torch sees no CUDA GPU{f' ({why})' if why else ''}")
    for package in need_packages:
        if importlib.util.find_spec(package) is None:
            if package == "vllm":
                blockers.append(f"vllm is not installed ({vllm_install_advice()})")
            else:
                blockers.append(f"{package} is not installed")
    if not blockers and not online():
        blockers.append("the model hub is not reachable (no network)")
    return blockers


def kl_estimates(logp: torch.Tensor, ref_logp: torch.Tensor) -> dict:
    """Per-token KL estimators at sampled tokens, with r = pi_ref / pi_theta = exp(ref_logp - logp).

    logp, ref_logp: (...) float log-probs of the sampled tokens under the policy and the reference.
    Returns ``k1 = -log r`` (unbiased, can be negative), ``k2 = (log r)^2 / 2`` and
    ``k3 = r - 1 - log r`` (unbiased for KL(pi_theta || pi_ref), always >= 0; the GRPO paper's).
    """
    log_r = ref_logp - logp
    return {"k1": -log_r, "k2": log_r**2 / 2, "k3": k3_kl(logp, ref_logp)}


def exact_kl(p_logits: torch.Tensor, q_logits: torch.Tensor) -> torch.Tensor:
    """Exact KL(p || q) over the last dimension from logits (any float shape (..., V))."""
    lp, lq = torch.log_softmax(p_logits, -1), torch.log_softmax(q_logits, -1)
    return (lp.exp() * (lp - lq)).sum(-1)


def show_figure(fig, dpi: int = 100) -> None:
    """Display a matplotlib ``Figure`` in the notebook as a PNG, whatever the backend: a bare Figure (as
    ``grpo_kit.memory.plot_components`` returns) has no pyplot manager, so ``plt.show()`` never draws it and
    ``display(fig)`` shows only its text form unless the inline backend registered a formatter."""

    from IPython.display import Image, display  # lazy: IPython is there only inside a notebook kernel

    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi, bbox_inches="tight")
    display(Image(data=buf.getvalue()))


# Where an installed package keeps the checkout's data folders (pyproject.toml's package-dir maps them).
# Notebook 03's model choices (hub ids) and the built-in architecture the calculator prices for each.
NOTEBOOK_MODELS = {
    "Qwen/Qwen2.5-1.5B-Instruct": "qwen2.5-1.5b",
    "Qwen/Qwen3-1.7B": "qwen3-1.7b",
    "google/gemma-3-1b-it": "gemma-3-1b",
}
RESULTS_DIR = "bench/results"  # the committed benchmark results, relative to the checkout
_PACKAGED_DIRS = {"data": "_data", RESULTS_DIR: "_results"}


def repo_file(relative: str):
    """``Path`` of a file of the kit's source checkout (``data/...``, ``bench/results/...``): the checkout's
    copy, else the one an installed package carries (pip from git on Colab: ``grpo_kit/_data``,
    ``grpo_kit/_results``), else None (a file that is not packaged, e.g. a PNG of ``bench/results``)."""

    package = Path(__file__).resolve().parents[1]
    p = package.parent / relative
    if p.exists():
        return p
    for folder, packaged in _PACKAGED_DIRS.items():
        if relative == folder or relative.startswith(folder + "/"):
            p = package / packaged / relative[len(folder) :].lstrip("/")
            return p if p.exists() else None
    return None


def run_report(summary: dict) -> str:
    """Text summary of a finished run (``grpo_kit.app.run.train``'s return): accuracy, time, saved files."""

    run_dir = Path(summary["run_dir"])
    evals = read_json(run_dir / "eval.json")
    lines = [
        f"held-out accuracy {when:>6}: {evals[when]['accuracy']:.3f}  (n={evals[when]['n']}, greedy)"
        for when in ("before", "after")
        if when in evals
    ]
    lines.append(
        f"{summary['steps']} steps in {summary['train_seconds']} s, peak memory {summary['peak_memory_gib']:.2f} GiB"
    )
    saved = run_dir / ("adapter" if (run_dir / "adapter").is_dir() else "model")
    lines.append(f"{saved.name} files: {sorted(p.name for p in saved.iterdir())}")
    return "\n".join(lines)


# What each benchmark row of the results' data files is, for a legend: the peers by name (their versions are in
# each row's `run`), the kit as grpo_kit.
PEER_LABELS = {
    "ours": "grpo_kit",
    "ours_offload": "grpo_kit (offloaded checkpoints)",
    "ours_torch": "grpo_kit (torch twin)",
    "ours_gspo": "grpo_kit GSPO",
    "ours_cispo": "grpo_kit CISPO",
    "naive": "naive fp32 logits",
    "trl": "TRL 1.16",
    "unsloth": "Unsloth",
    "cce": "Cut Cross-Entropy",
    "liger": "Liger-Kernel",
    "baseline": "TRL-style (HF checkpointing, full logits)",
    "grpo_kit_fp8": "grpo_kit (shared weights, FP8 KV)",
    "grpo_kit_bf16": "grpo_kit (shared weights, bf16 KV)",
    "grpo_kit_merge": "grpo_kit (shared weights, merged adapter)",
    "grpo_kit_copy": "grpo_kit (separate vLLM copy)",
}


def is_kit(row: str) -> bool:
    """Whether a benchmark row is one of the kit's (drawn distinct from the peers)."""
    return row.startswith("ours") or row.startswith("grpo_kit")


def bench_rows(benchmark: str):
    """The current rows of the checkout's result data ``<benchmark>.jsonl`` as a pandas DataFrame: the figures, ``row``,
    ``model``, ``card``, ``command``, ``date`` and the shape's ``key=value`` fields as ints (superseded rows left
    out); None when the file is not there (a kit installed without its checkout's results)."""
    import pandas as pd  # lazy: a second of import that only the benchmark cells need

    path = repo_file(f"{RESULTS_DIR}/data/{benchmark}.jsonl")
    if path is None:
        return None
    rows = []
    for line in path.read_text().splitlines():
        r = parse_json(line, str(path)) if line.strip() else {"superseded": True}
        if r.get("superseded"):
            continue
        shape = {k: int(v) for k, v in (kv.split("=") for kv in r["shape"].split())}
        rows.append(
            dict(
                r["figures"],
                row=r["row"],
                model=r["model"],
                card=r["card"],
                command=r["command"],
                date=r["date"],
                dtype=r.get("dtype", ""),
                **shape,
            )
        )
    return pd.DataFrame(rows)


def line_style(row: str) -> dict:
    """matplotlib keywords for a benchmark row's line: the kit's thick and solid with round markers, peers thin and
    dashed with square ones."""
    if is_kit(row):
        return dict(linewidth=2.6, linestyle="-", marker="o", zorder=3)
    return dict(linewidth=1.3, linestyle="--", marker="s", zorder=2)
