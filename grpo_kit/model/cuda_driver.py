"""The machine's NVIDIA driver, and whether it runs the CUDA builds the kit would install.

A wheel built for CUDA major ``M`` runs on a driver of branch ``MIN_DRIVER[M]`` or newer (NVIDIA's minor
version compatibility: CUDA 12.x needs >= 525, CUDA 13.x >= 580). The kit's vLLM pin for CUDA (vllm==0.26.0,
``requirements-vllm-cuda.txt``) and the torch 2.11.0 it brings are CUDA 13.0 wheels as PyPI serves them. On an
older driver, installing vLLM would replace a working CUDA torch (Colab's, say) with one that cannot see the
GPU, so ``install.sh`` and the notebooks' Colab cell leave vLLM out there and the kit generates with HF
``generate``; a torch that cannot use a GPU the driver shows is named, with the reason, instead of training
on the CPU unannounced.

Where vLLM is left out, torch is held to PyPI's CUDA 12 builds (``CUDA12_TORCH``) when the driver runs those,
so that a machine without torch, or with one too new for its driver, gets one that can use the GPU.

Standard library only: ``install.sh`` runs this file as a script before anything is installed
(``python3 grpo_kit/model/cuda_driver.py``: exit 0 and nothing printed when vLLM's CUDA build can run here or the
driver is unknown; exit ``BLOCKED_EXIT`` with the reason on the first line and the torch requirement to install
instead on the second, empty when there is none).
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys

MIN_DRIVER = {11: 450, 12: 525, 13: 580}  # CUDA major -> lowest driver branch that runs its wheels
VLLM_CUDA_MAJOR = 13  # the pinned vLLM (requirements-vllm-cuda.txt) and its torch, as PyPI serves them
CUDA12_TORCH = "torch>=2.6,<2.11"  # PyPI's torch 2.6-2.10 are CUDA 12 builds; 2.11 and later CUDA 13
BLOCKED_EXIT = 3


def _query(field: str) -> list[str]:
    """``nvidia-smi --query-gpu=FIELD`` per GPU; [] without a driver that answers."""
    if shutil.which("nvidia-smi") is None:
        return []
    try:
        r = subprocess.run(
            ["nvidia-smi", f"--query-gpu={field}", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            errors="replace",
            timeout=30,
        )
    except (OSError, subprocess.SubprocessError):
        return []
    return [line.strip() for line in r.stdout.strip().splitlines()] if r.returncode == 0 else []


def gpu_name() -> str | None:
    """The first GPU's name (from ``nvidia-smi``, not torch: installing vLLM may replace torch), or None."""
    names = _query("name")
    return names[0] if names and names[0] else None


def driver_version() -> str | None:
    """The driver version ``nvidia-smi`` reports (``"550.54.15"``), or None without a driver that answers."""
    versions = _query("driver_version")
    return versions[0] if versions and branch(versions[0]) is not None else None


def branch(version: str | None) -> int | None:
    """The driver branch: ``"550.54.15"`` -> 550; None for no or an unreadable version."""
    m = re.fullmatch(r"\s*(\d+)(\.\d+)*\s*", version or "")
    return int(m.group(1)) if m else None


def runs(cuda_major: int, version: str | None) -> bool | None:
    """Whether a driver of ``version`` runs wheels built for CUDA ``cuda_major``; None when either is unknown."""
    b, need = branch(version), MIN_DRIVER.get(cuda_major)
    return None if b is None or need is None else b >= need


def vllm_blocked(version: str | None) -> str | None:
    """Why vLLM's CUDA build (and the torch it brings) cannot run with this driver, or None (it can, or the
    driver is unknown)."""
    if runs(VLLM_CUDA_MAJOR, version) is not False:
        return None
    return (
        f"vLLM's CUDA build and the torch it brings are built for CUDA {VLLM_CUDA_MAJOR}, which needs an NVIDIA "
        f"driver >= {MIN_DRIVER[VLLM_CUDA_MAJOR]}; this machine's driver is {version}{_runs_up_to(version)}, "
        "so installing vLLM would replace the installed torch with one that cannot use the GPU (update the "
        "driver to get vLLM)"
    )


def torch_requirement(version: str | None) -> str | None:
    """The torch requirement to install beside the kit where vLLM's CUDA build is blocked and the driver runs
    CUDA 12 builds: ``CUDA12_TORCH`` (a torch already there that satisfies it stays); None otherwise."""
    return CUDA12_TORCH if vllm_blocked(version) and runs(12, version) else None


def torch_blocked(torch_cuda: str | None, version: str | None) -> str | None:
    """Why a torch built for CUDA ``torch_cuda`` (``torch.version.cuda``, e.g. ``"13.0"``) cannot use the GPU
    that a driver of ``version`` runs, or None (it can, or either is unknown)."""
    major = branch(torch_cuda)
    if major is None or runs(major, version) is not False:
        return None
    return (
        f"this torch is built for CUDA {torch_cuda}, which needs an NVIDIA driver >= {MIN_DRIVER[major]}; the "
        f"driver is {version}{_runs_up_to(version)}. Install a torch built for a CUDA the driver runs"
        + (f" (pip install '{CUDA12_TORCH}': PyPI's CUDA 12 builds)" if runs(12, version) else "")
        + ", or update the driver"
    )


def _runs_up_to(version: str | None) -> str:
    majors = [m for m in MIN_DRIVER if runs(m, version)]
    return f" (it runs CUDA {max(majors)} builds)" if majors else ""


def main() -> int:
    version = driver_version()
    why = vllm_blocked(version)
    if why:
        print(why)
        print(torch_requirement(version) or "")
    return BLOCKED_EXIT if why else 0


if __name__ == "__main__":
    sys.exit(main())
