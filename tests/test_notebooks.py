"""The notebook series in CI: pairing, parameters, and a real run of every notebook.

Each notebook is parameterised by papermill with ``notebooks/ci_params.yaml`` (tiny or
embedded models, 2 steps, short completions) into a temporary folder, keeping the
committed outputs of the cells tagged ``nbval-check-output``; ``pytest --nbval-lax``
(a subprocess) then executes it once: any cell that raises fails, and the tagged cells'
outputs must equal the committed ones (``notebooks/nbval_sanitize.cfg`` masks volatile
text). All other cells are committed without outputs.

Refresh the committed reference outputs after an intended change:
``python tests/test_notebooks.py --refresh [NAME ...]``.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
NB_DIR = ROOT / "notebooks"
CHECK_TAG = "nbval-check-output"
NAMES = sorted(p.stem for p in NB_DIR.glob("[0-9][0-9]_*.ipynb"))
EXPECTED = ["01_grpo_math", "02_vram_profiling", "03_qwen2.5_grpo", "04_llama3.1_grpo_long_context",
            "05_rewards_and_verifiers"]


def pictures(outputs: list) -> list:
    """The figures among a cell's outputs (PNG display data, without their text stand-in): what the committed
    notebooks keep of the cells nbval does not check, so that they can be read without running them."""
    import nbformat

    return [nbformat.from_dict({"output_type": "display_data", "metadata": {},
                                "data": {"image/png": o["data"]["image/png"]}})
            for o in outputs
            if o.get("output_type") in ("display_data", "execute_result") and "image/png" in o.get("data", {})]


def _ci_params() -> dict:
    import yaml

    return yaml.safe_load((NB_DIR / "ci_params.yaml").read_text())


def _env() -> dict:
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
               GRPO_KIT_STATIC_DASHBOARD="1", MPLBACKEND="Agg", TQDM_DISABLE="1")
    return env


def _prepare(name: str, out: Path, params: dict | None = None) -> Path:
    """The committed notebook with CI parameters injected (not executed; outputs kept)."""
    import papermill as pm

    path = out / f"{name}.ipynb"
    pm.execute_notebook(str(NB_DIR / f"{name}.ipynb"), str(path),
                        parameters=_ci_params().get(name, {}) if params is None else params,
                        prepare_only=True, kernel_name="python3", progress_bar=False)
    return path


def _nbval(path: Path, cwd: Path) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--nbval-lax",
           "--nbval-sanitize-with", str(NB_DIR / "nbval_sanitize.cfg"), "--nbval-current-env",
           "--nbval-cell-timeout", "900", "-c", os.devnull, "--rootdir", str(cwd), str(path)]
    return subprocess.run(cmd, cwd=cwd, env=_env(), capture_output=True, text=True)


# ------------------------------------------------------------------ structure (fast)
def test_all_notebooks_present():
    assert NAMES == EXPECTED


@pytest.mark.parametrize("name", EXPECTED)
def test_pair_in_sync(name):
    """The .ipynb and its jupytext percent script hold the same cells (sources and tags)."""
    import jupytext

    def cells(nb):
        return [(c.cell_type, c.source.strip(), sorted(c.metadata.get("tags", []))) for c in nb.cells]

    ipynb = jupytext.read(NB_DIR / f"{name}.ipynb")
    script = jupytext.read(NB_DIR / f"{name}.py")
    assert cells(ipynb) == cells(script), f"{name}: run `jupytext --sync notebooks/{name}.ipynb`"


@pytest.mark.parametrize("name", EXPECTED)
def test_layout(name):
    """One parameters cell; Colab-only install cell first with the pinned versions; outputs
    committed only for the checked cells; every CI parameter exists in the notebook."""
    import nbformat

    nb = nbformat.read(NB_DIR / f"{name}.ipynb", as_version=4)
    code = [c for c in nb.cells if c.cell_type == "code"]
    tagged = [c for c in code if "parameters" in c.metadata.get("tags", [])]
    assert len(tagged) == 1, f"{name}: expected one cell tagged 'parameters'"
    assert code.index(tagged[0]) == 1, "the parameters cell follows the install cell"
    install = code[0].source
    assert '"google.colab" in sys.modules' in install and "GRPO_KIT_REPO" in install
    reqs = "".join((ROOT / f).read_text() for f in ("requirements-kit.txt", "requirements-notebooks.txt",
                                                     "grpo_kit/requirements-nodeps.txt", "requirements-vllm-cpu.txt",
                                                     "requirements-vllm-cuda.txt"))
    for pin in re.findall(r'"([\w-]+==[\d.]+)"', install):
        assert pin in reqs, f"{name}: install cell pins {pin}, requirements differ"
    for c in code:
        if CHECK_TAG not in c.metadata.get("tags", []):  # pictures only (nbval does not compare images)
            assert c.get("outputs", []) == pictures(c.get("outputs", [])), \
                f"{name}: stale text outputs in an unchecked cell: {c.source[:60]!r}"
        else:
            assert c.get("outputs"), f"{name}: checked cell without reference output: {c.source[:60]!r}"
    defined = set(re.findall(r"^(\w+)\s*=", tagged[0].source, flags=re.M))
    unknown = set(_ci_params().get(name, {})) - defined
    assert not unknown, f"{name}: ci_params.yaml sets unknown parameters {unknown}"


# ------------------------------------------------------------------ execution (slow)
@pytest.mark.parametrize("name", EXPECTED)
def test_notebook_runs(name, tmp_path):
    path = _prepare(name, tmp_path)
    res = _nbval(path, tmp_path)
    assert res.returncode == 0, f"{name} failed under nbval:\n{res.stdout[-6000:]}\n{res.stderr[-2000:]}"


@pytest.mark.parametrize("name, params, needle", [
    ("05_rewards_and_verifiers", {"num_problems": "many"}, "num_problems='many' has the wrong type"),
    ("03_qwen2.5_grpo", {"model": "no-such-model"}, "model='no-such-model' is not a built-in name"),
    # the full setup's 4-bit option is refused before any model loads on a machine without a CUDA GPU
    ("04_llama3.1_grpo_long_context", {"setup": "full", "four_bit": True}, "load_in_4bit=True needs a CUDA GPU"),
])
def test_bad_parameter_fails_in_validation_cell(name, params, needle, tmp_path):
    """A wrong type or an unknown model stops the notebook in the cell after the parameters."""
    import papermill as pm

    out = tmp_path / "out.ipynb"
    old = dict(os.environ)
    os.environ.update(_env())
    try:
        with pytest.raises(pm.PapermillExecutionError) as err:
            pm.execute_notebook(str(NB_DIR / f"{name}.ipynb"), str(out), parameters=params, kernel_name="python3",
                                progress_bar=False, cwd=str(tmp_path))
    finally:
        os.environ.clear()
        os.environ.update(old)
    assert needle in str(err.value)
    # the failing cell is the validation cell: the injected parameters, then the first cell after them
    assert err.value.exec_count == 4, f"failed in cell {err.value.exec_count}, not the validation cell"


# ------------------------------------------------------------------ refresh the references
def refresh(names) -> None:
    """Execute each notebook with the CI parameters and store in the committed .ipynb the outputs of the
    checked cells and the figures (only) of the others."""
    import tempfile

    import nbformat
    import papermill as pm

    # The inline backend, as Jupyter and Colab use it: plt.show() then leaves its figure in the outputs.
    os.environ.update(_env(), MPLBACKEND="module://matplotlib_inline.backend_inline")
    for name in names:
        t0 = time.perf_counter()
        with tempfile.TemporaryDirectory() as tmp:
            src = _prepare(name, Path(tmp))
            out = Path(tmp) / "executed.ipynb"
            pm.execute_notebook(str(src), str(out), kernel_name="python3", cwd=tmp, progress_bar=False)
            executed = nbformat.read(out, as_version=4)
        by_source = {c.source: c for c in executed.cells if CHECK_TAG in c.metadata.get("tags", [])}
        figures = {c.source: c.get("outputs", []) for c in executed.cells if c.cell_type == "code"}
        figures_count = {c.source: c.get("execution_count") for c in executed.cells if c.cell_type == "code"}
        committed = nbformat.read(NB_DIR / f"{name}.ipynb", as_version=4)
        for c in committed.cells:
            if c.cell_type != "code":
                continue
            ref = by_source.get(c.source)
            # nbval treats a cell with outputs but no execution count as an error ("unrun reference")
            c.execution_count = ref.execution_count if ref is not None else None
            c.outputs = list(ref.outputs) if ref is not None else pictures(figures.get(c.source, []))
            if ref is None and c.outputs:
                c.execution_count = figures_count[c.source]
        nbformat.write(committed, NB_DIR / f"{name}.ipynb")
        print(f"refreshed {name} ({time.perf_counter() - t0:.0f} s)")


if __name__ == "__main__":
    if sys.argv[1:2] != ["--refresh"]:
        sys.exit("usage: python tests/test_notebooks.py --refresh [NAME ...]")
    refresh(sys.argv[2:] or EXPECTED)
