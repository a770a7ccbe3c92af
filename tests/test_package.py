"""The kit as a package: the wheel builds, installs into a fresh virtual environment and works from a folder
outside the checkout (imports, data files, the `grpo-kit` command, a notebook run by papermill).

The venv sees the running environment's site-packages (the pinned dependencies are already there: no network) but
gets its own copy of grpo_kit from the wheel, and every command runs with the venv's Python in a temporary folder
without PYTHONPATH, so nothing of the checkout can leak in. Where the suite itself runs in a virtual environment,
``--system-site-packages`` alone would show the base interpreter's packages, not that environment's: a ``.pth``
file adds the running environment's site-packages after the venv's own.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

# What the wheel is built from: the files pyproject.toml reads (a copy, so the build leaves nothing behind).
SOURCES = (
    "pyproject.toml",
    "README.md",
    "requirements-kit.txt",
    "requirements-notebooks.txt",
    "requirements-test.txt",
    "requirements-vllm-cuda.txt",
    "requirements-4bit.txt",
    "grpo_kit",
    "data",
    "bench/results",
)


def _running_site_packages() -> list[str]:
    """The site-packages folders on the running Python's path (a venv's own where the suite runs in one)."""
    return [p for p in sys.path if Path(p).name in ("site-packages", "dist-packages") and Path(p).is_dir()]


def _run(cmd, cwd, env=None, timeout=600):
    r = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, f"{cmd} failed:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    return r


@pytest.fixture(scope="module")
def venv(tmp_path_factory, repo_root):
    tmp = tmp_path_factory.mktemp("pkg")
    src = tmp / "src"
    for name in SOURCES:
        target = src / name
        if (repo_root / name).is_dir():
            shutil.copytree(repo_root / name, target, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        else:
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(repo_root / name, target)
    # Without build isolation where setuptools is installed: the build then needs no index at all.
    isolation = [] if importlib.util.find_spec("setuptools") is None else ["--no-build-isolation"]
    _run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", *isolation, str(src), "-w", str(tmp / "dist")],
        cwd=tmp,
    )
    wheel = next((tmp / "dist").glob("grpo_kit-*.whl"))
    env_dir = tmp / "venv"
    _run([sys.executable, "-m", "venv", "--system-site-packages", str(env_dir)], cwd=tmp)
    py = env_dir / "bin" / "python"
    own_site = _run(
        [str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], cwd=tmp
    ).stdout.strip()
    Path(own_site, "_running_env.pth").write_text("\n".join(_running_site_packages()) + "\n")
    # --force-reinstall: a grpo_kit in the system's site-packages (install.sh's editable one) must not count.
    _run([str(py), "-m", "pip", "install", "-q", "--no-deps", "--no-index", "--force-reinstall", str(wheel)], cwd=tmp)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    env["PATH"] = f"{env_dir / 'bin'}{os.pathsep}{env['PATH']}"
    work = tmp / "elsewhere"
    work.mkdir()
    return {"wheel": wheel, "py": py, "env": env, "cwd": work, "dir": env_dir}


def test_wheel_carries_package_data_and_console_script(venv):
    with zipfile.ZipFile(venv["wheel"]) as z:
        names = set(z.namelist())
        entry_points = next(z.read(n).decode() for n in names if n.endswith("entry_points.txt"))
        metadata = next(z.read(n).decode() for n in names if n.endswith("METADATA"))
    for path in (
        "grpo_kit/_data/gsm8k_sample.jsonl",
        "grpo_kit/_data/arithmetic_heldout.jsonl",
        "grpo_kit/_results/data/loss.jsonl",
        "grpo_kit/requirements-nodeps.txt",
        "grpo_kit/memory/estimate.py",
        "grpo_kit/generation/base.py",
        "grpo_kit/kernels/grpo_epilogue.py",
    ):
        assert path in names, path
    assert "grpo-kit = grpo_kit.app.cli:main" in entry_points
    assert "Requires-Dist: trl==1.16.0" in metadata and 'vllm==0.26.0; extra == "vllm"' in metadata
    # no Triton pin of the kit's own: a CUDA torch brings its matching Triton (a pin would make pip swap the torch)
    assert "Requires-Dist: triton" not in metadata and "Requires-Dist: torch>=2.6" in metadata


def test_installed_package_imports_and_runs_outside_the_checkout(venv, repo_root):
    code = (
        "import json, grpo_kit, grpo_kit.app.run\n"
        "from grpo_kit.notebook.helpers import repo_file\n"
        "from grpo_kit.notebook.colab import install_plan\n"
        "print(json.dumps({'file': grpo_kit.__file__, 'gsm8k': str(repo_file('data/gsm8k_sample.jsonl')),\n"
        "  'loss': str(repo_file('bench/results/data/loss.jsonl')), 'png': str(repo_file('bench/results/x.png')),\n"
        "  'cpu': install_plan(generate=True, gpu=False), 'gpu': install_plan(generate=True, gpu=True)}))"
    )
    out = json.loads(_run([str(venv["py"]), "-c", code], cwd=venv["cwd"], env=venv["env"]).stdout)
    site = venv["dir"].resolve()
    assert Path(out["file"]).resolve().is_relative_to(site), out["file"]  # the wheel's copy, not the checkout
    assert Path(out["gsm8k"]).resolve().is_relative_to(site) and Path(out["gsm8k"]).stat().st_size > 100_000
    assert Path(out["loss"]).resolve().is_relative_to(site) and out["png"] == "None"
    cpu, gpu = out["cpu"][0], out["gpu"][0]
    assert "trl==1.16.0" in cpu and "torch>=2.6" in cpu and not any(r.startswith("vllm") for r in cpu)
    assert "vllm==0.26.0" in gpu and "bitsandbytes==0.50.2" in gpu and any(r.startswith("ipywidgets==") for r in gpu)
    assert not any(r.startswith("bitsandbytes") for r in cpu)
    assert out["cpu"][1][:2] == ["--no-deps", "-r"] and Path(out["cpu"][1][2]).is_file()
    # the console script, from the venv's bin/: bad input is one clear line (exit 2) before anything loads
    r = subprocess.run(
        ["grpo-kit", "train", "--set", "num_generations=1"],
        cwd=venv["cwd"],
        env=venv["env"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 2 and "num_generations=1 must be at least 2" in r.stderr, r.stderr[-2000:]


def test_papermill_runs_a_notebook_from_another_folder(venv, repo_root):
    """Notebook 05 (reads the packaged GSM8K sample) executed by papermill in a folder outside the checkout,
    in a kernel of the venv's Python: the installed kit alone must serve it."""
    _run(
        [str(venv["py"]), "-m", "ipykernel", "install", "--prefix", str(venv["dir"]), "--name", "grpo-kit-wheel"],
        cwd=venv["cwd"],
        env=venv["env"],
    )
    out = venv["cwd"] / "05_out.ipynb"
    _run(
        [
            str(venv["py"]),
            "-m",
            "papermill",
            str(repo_root / "notebooks" / "05_rewards_and_verifiers.ipynb"),
            str(out),
            "-k",
            "grpo-kit-wheel",
            "-p",
            "num_problems",
            "20",
            "-p",
            "num_sample_questions",
            "1",
            "-p",
            "sample_max_tokens",
            "8",
            "--cwd",
            str(venv["cwd"]),
            "--no-progress-bar",
        ],
        cwd=venv["cwd"],
        env={**venv["env"], "MPLBACKEND": "Agg"},
    )
    import nbformat

    text = "".join(o.get("text", "") for c in nbformat.read(out, as_version=4).cells for o in c.get("outputs", []))
    assert "GSM8K file:" in text and "Traceback" not in text
