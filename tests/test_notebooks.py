"""The notebook series in CI: pairing, parameters, the committed real runs, and a run of every notebook.

The committed notebooks keep every output of a real execution with their own documented parameters (their first
cell says where and how long it ran). In CI each notebook is parameterised by papermill with
``notebooks/ci_params.yaml`` (tiny or embedded models, 2 steps, short completions) into a temporary folder, keeping
the committed outputs; ``pytest --nbval-lax`` (a subprocess) then executes it once: any cell that raises fails, and
the outputs of the cells tagged ``nbval-check-output`` (deterministic: they do not depend on the run's parameters)
must equal the committed ones (``notebooks/nbval_sanitize.cfg`` masks volatile text). Untagged cells, whose
output depends on the run, are not compared.

Refresh the committed outputs after an intended change (executes with the notebook's own parameters, minutes for
03 and 04): ``python tests/test_notebooks.py --refresh [NAME ...]``.
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
EXPECTED = [
    "01_grpo_math",
    "02_vram_profiling",
    "03_qwen2.5_grpo",
    "04_llama3.1_grpo_long_context",
    "05_rewards_and_verifiers",
    "06_multi_turn_tools",
]


def pictures(outputs: list) -> list:
    """The figures among a cell's outputs (PNG display data, without their text stand-in): what the committed
    notebooks keep of the cells nbval does not check, so that they can be read without running them."""
    import nbformat

    return [
        nbformat.from_dict(
            {"output_type": "display_data", "metadata": {}, "data": {"image/png": o["data"]["image/png"]}}
        )
        for o in outputs
        if o.get("output_type") in ("display_data", "execute_result") and "image/png" in o.get("data", {})
    ]


def _ci_params() -> dict:
    import yaml

    return yaml.safe_load((NB_DIR / "ci_params.yaml").read_text())


def _env() -> dict:
    env = dict(
        os.environ,
        PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
        GRPO_KIT_STATIC_DASHBOARD="1",
        MPLBACKEND="Agg",
        TQDM_DISABLE="1",
    )
    return env


def _prepare(name: str, out: Path, params: dict | None = None) -> Path:
    """The committed notebook with CI parameters injected (not executed; outputs kept)."""
    import papermill as pm

    path = out / f"{name}.ipynb"
    pm.execute_notebook(
        str(NB_DIR / f"{name}.ipynb"),
        str(path),
        parameters=_ci_params().get(name, {}) if params is None else params,
        prepare_only=True,
        kernel_name="python3",
        progress_bar=False,
    )
    return path


def _nbval(path: Path, cwd: Path) -> subprocess.CompletedProcess:
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "-p",
        "no:cacheprovider",
        "--nbval-lax",
        "--nbval-sanitize-with",
        str(NB_DIR / "nbval_sanitize.cfg"),
        "--nbval-current-env",
        "--nbval-cell-timeout",
        "900",
        "-c",
        os.devnull,
        "--rootdir",
        str(cwd),
        str(path),
    ]
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
    reqs = "".join(
        (ROOT / f).read_text()
        for f in (
            "requirements-kit.txt",
            "requirements-notebooks.txt",
            "grpo_kit/requirements-nodeps.txt",
            "requirements-vllm-cpu.txt",
            "requirements-vllm-cuda.txt",
        )
    )
    for pin in re.findall(r'"([\w-]+==[\d.]+)"', install):
        assert pin in reqs, f"{name}: install cell pins {pin}, requirements differ"
    for c in code:
        if CHECK_TAG in c.metadata.get("tags", []):
            assert c.get("outputs"), f"{name}: checked cell without reference output: {c.source[:60]!r}"
        if c.get("outputs"):  # nbval treats outputs without an execution count as an unrun reference
            assert c.get("execution_count") is not None, f"{name}: outputs without execution count: {c.source[:60]!r}"
    defined = set(re.findall(r"^(\w+)\s*=", tagged[0].source, flags=re.M))
    unknown = set(_ci_params().get(name, {})) - defined
    assert not unknown, f"{name}: ci_params.yaml sets unknown parameters {unknown}"


def _texts(nb) -> str:
    """All text a notebook's committed outputs show (streams, plain-text results and errors)."""
    out = []
    for c in nb.cells:
        for o in c.get("outputs", []):
            out.append(
                o.get("text", "")
                if o.get("output_type") == "stream"
                else o.get("data", {}).get("text/plain", "")
                if "data" in o
                else "\n".join(o.get("traceback", []))
            )
    return "\n".join(t if isinstance(t, str) else "".join(t) for t in out)


def closing_steps(text: str) -> int:
    """How far a committed training run went, from its own closing lines: the last ``step N/N | ...`` line, or
    the summary's ``steps: N``; 0 when neither is there."""
    done = [int(n) for k, n in re.findall(r"step (\d+)/(\d+) \|", text) if k == n]
    done += [int(n) for n in re.findall(r"\bsteps:\s*(\d+)", text)]
    return max(done, default=0)


# the least a committed real run shows: training steps its closing lines report (issue 36)
MIN_COMMITTED_STEPS = {"03_qwen2.5_grpo": 20, "04_llama3.1_grpo_long_context": 20, "06_multi_turn_tools": 20}


@pytest.mark.parametrize("name", EXPECTED)
def test_committed_outputs_are_a_real_run(name):
    """The committed outputs come from a real execution: at least one picture, no error, and for the training
    notebooks a run of at least MIN_COMMITTED_STEPS steps by its own closing lines."""
    import nbformat

    nb = nbformat.read(NB_DIR / f"{name}.ipynb", as_version=4)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert sum(len(pictures(c.get("outputs", []))) for c in code) >= 1, f"{name}: no picture in the committed outputs"
    assert not [o for c in code for o in c.get("outputs", []) if o.get("output_type") == "error"], (
        f"{name}: the committed outputs hold an error"
    )
    # a red box a reader meets: a library's warning or the kit's own line printed to stderr (issue 56)
    stderr = [
        "".join(o.get("text", "")).strip()[:120]
        for c in code
        for o in c.get("outputs", [])
        if o.get("output_type") == "stream" and o.get("name") == "stderr"
    ]
    assert not stderr, f"{name}: the committed outputs print to stderr: {stderr}"
    if name in MIN_COMMITTED_STEPS:
        steps = closing_steps(_texts(nb))
        assert steps >= MIN_COMMITTED_STEPS[name], (
            f"{name}: the committed run shows {steps} steps, at least {MIN_COMMITTED_STEPS[name]} wanted"
        )


# ------------------------------------------------------------------ execution (slow)
@pytest.mark.parametrize("name", EXPECTED)
def test_notebook_runs(name, tmp_path):
    path = _prepare(name, tmp_path)
    res = _nbval(path, tmp_path)
    assert res.returncode == 0, f"{name} failed under nbval:\n{res.stdout[-6000:]}\n{res.stderr[-2000:]}"


@pytest.mark.parametrize(
    "name, params, needle",
    [
        ("05_rewards_and_verifiers", {"num_problems": "many"}, "num_problems='many' has the wrong type"),
        ("03_qwen2.5_grpo", {"model": "no-such-model"}, "model='no-such-model' is not a built-in name"),
        # the full setup's 4-bit option is refused before any model loads on a machine without a CUDA GPU
        ("04_llama3.1_grpo_long_context", {"setup": "full", "four_bit": True}, "load_in_4bit=True needs a CUDA GPU"),
    ],
)
def test_bad_parameter_fails_in_validation_cell(name, params, needle, tmp_path):
    """A wrong type or an unknown model stops the notebook in the cell after the parameters."""
    import papermill as pm

    out = tmp_path / "out.ipynb"
    old = dict(os.environ)
    os.environ.update(_env())
    try:
        with pytest.raises(pm.PapermillExecutionError) as err:
            pm.execute_notebook(
                str(NB_DIR / f"{name}.ipynb"),
                str(out),
                parameters=params,
                kernel_name="python3",
                progress_bar=False,
                cwd=str(tmp_path),
            )
    finally:
        os.environ.clear()
        os.environ.update(old)
    assert needle in str(err.value)
    # the failing cell is the validation cell: the injected parameters, then the first cell after them
    assert err.value.exec_count == 4, f"failed in cell {err.value.exec_count}, not the validation cell"


# ------------------------------------------------------------------ refresh the committed outputs
def refresh(names) -> None:
    """Execute each notebook with its own parameters (not CI's) in a temporary folder and commit every output:
    the real run a reader sees. Prints each notebook's wall time and the machine's load average."""
    import tempfile

    import nbformat
    import papermill as pm

    # The inline backend, as Jupyter and Colab use it: plt.show() then leaves its figure in the outputs.
    os.environ.update(_env(), MPLBACKEND="module://matplotlib_inline.backend_inline")
    for name in names:
        t0 = time.perf_counter()
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / f"{name}.ipynb"
            pm.execute_notebook(
                str(NB_DIR / f"{name}.ipynb"), str(out), kernel_name="python3", cwd=tmp, progress_bar=False
            )
            executed = nbformat.read(out, as_version=4)
        for c in executed.cells:  # papermill's bookkeeping, not the notebook's
            c.metadata.pop("papermill", None)
            c.metadata.pop("execution", None)
        executed.metadata.pop("papermill", None)
        nbformat.write(executed, NB_DIR / f"{name}.ipynb")
        load = os.getloadavg()
        print(
            f"refreshed {name}: {time.perf_counter() - t0:.0f} s wall, load average "
            f"{load[0]:.1f} {load[1]:.1f} {load[2]:.1f} on {os.cpu_count()} CPUs"
        )


if __name__ == "__main__":
    if sys.argv[1:2] != ["--refresh"]:
        sys.exit("usage: python tests/test_notebooks.py --refresh [NAME ...]")
    refresh(sys.argv[2:] or EXPECTED)
