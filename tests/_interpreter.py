"""Run a script in Triton's CPU interpreter: TRITON_INTERPRET=1 must be set before Triton is imported (Triton
wraps its standard library at import), so the kernels' interpreter checks run in a fresh process."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def run_in_triton_interpreter(script: str, ok_marker: str, timeout: int = 600) -> None:
    """Run ``script`` with the kit importable under TRITON_INTERPRET=1; assert it exits 0 and prints ``ok_marker``."""
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    res = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout
    )
    assert res.returncode == 0 and ok_marker in res.stdout, res.stdout + res.stderr
