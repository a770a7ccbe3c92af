"""The notebooks' Colab install (grpo_kit.notebook.colab.install_runtime) with pip and the machine faked: what it asks pip
for, what it prints, and the stop it makes when pip replaced a package the kernel had already imported."""

from __future__ import annotations

import importlib.metadata as md
import subprocess
import sys
import types

import pytest

from grpo_kit.notebook import colab


@pytest.fixture
def fake_machine(monkeypatch):
    """pip calls recorded (``calls``); installed versions in ``versions``, which a pip call may change
    (``upgrade``); two installed distributions: ``pandas`` 1.0 owning the module ``fakemod`` (one of the kit's
    libraries) and ``psutil`` 1.0 owning ``fakeplumbing`` (the kernel's plumbing)."""
    state = {"calls": [], "versions": {"pandas": "1.0", "psutil": "1.0"}, "upgrade": {}}

    def run(cmd, **kwargs):
        state["calls"].append(cmd)
        state["versions"].update(state["upgrade"])
        return subprocess.CompletedProcess(cmd, 0, "", "")

    def version(name):
        if name in state["versions"]:
            return state["versions"][name]
        raise md.PackageNotFoundError(name)

    monkeypatch.setattr(colab.subprocess, "run", run)
    monkeypatch.setattr(colab.md, "version", version)
    monkeypatch.setattr(
        colab.md,
        "packages_distributions",
        lambda: {"fakemod": ["pandas"], "fakeplumbing": ["psutil"], "unused": ["other"]},
    )
    monkeypatch.setattr(colab, "gpu_name", lambda: "Tesla T4")
    monkeypatch.setattr(colab, "driver_version", lambda: "550.54.15")
    return state


def test_install_on_an_old_driver_skips_vllm_and_reports(fake_machine, capsys):
    versions = colab.install_runtime(generate=True)
    out = capsys.readouterr().out
    assert "GPU Tesla T4, NVIDIA driver 550.54.15" in out and "vLLM not installed:" in out and "driver >= 580" in out
    assert "the kit generates with HF generate" in out
    main = fake_machine["calls"][0]
    assert main[:4] == [sys.executable, "-m", "pip", "install"]
    assert not any(a.startswith("vllm") for a in main) and any(a.startswith("bitsandbytes") for a in main)
    assert fake_machine["calls"][1][-3:-1] == ["--no-deps", "-r"] and versions == {}


def _module(name: str, file: str | None = "/site-packages/fakemod/__init__.py") -> types.ModuleType:
    module = types.ModuleType(name)
    module.__file__ = file
    return module


def test_a_replaced_package_already_imported_asks_for_a_restart(fake_machine, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "fakemod", _module("fakemod"))
    fake_machine["upgrade"] = {"pandas": "2.0"}
    with pytest.raises(RuntimeError, match=r"already imported \(pandas 1.0 -> 2.0\): restart the session"):
        colab.install_runtime(generate=True)
    assert "vLLM not installed:" in capsys.readouterr().out  # the old driver's line came first


def test_an_imported_package_left_alone_or_one_not_imported_is_fine(fake_machine, monkeypatch):
    monkeypatch.setitem(sys.modules, "fakemod", _module("fakemod"))
    colab.install_runtime(generate=False)  # pip did not touch pandas
    monkeypatch.delitem(sys.modules, "fakemod")
    fake_machine["upgrade"] = {"pandas": "2.0"}
    colab.install_runtime(generate=False)  # replaced, but never imported in this kernel


def test_the_kernels_plumbing_replaced_does_not_ask_for_a_restart(fake_machine, monkeypatch):
    """ipykernel imports psutil at start; the kit's pin replaces Colab's copy, whose old code serves as well."""
    monkeypatch.setitem(sys.modules, "fakeplumbing", _module("fakeplumbing"))
    fake_machine["upgrade"] = {"psutil": "2.0"}
    colab.install_runtime(generate=False)


def test_a_namespace_package_does_not_count_as_imported(fake_machine, monkeypatch):
    """``google`` is always imported on Colab and shared by many distributions (protobuf, google-auth, ...): an
    upgrade of one of them must not ask for a restart."""
    monkeypatch.setitem(sys.modules, "fakemod", _module("fakemod", file=None))
    fake_machine["upgrade"] = {"pandas": "2.0"}
    colab.install_runtime(generate=False)
