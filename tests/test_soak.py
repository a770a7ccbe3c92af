"""Short soak (bench/soak.py): RSS stays flat over a few dozen GRPO steps, and the same threshold catches a
deliberate leak. The full figure (200 steps) is in bench/results/soak.md."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))

from soak import drift  # noqa: E402

# Rise of the RSS floor, MiB per 100 steps (see bench/soak.py: transient per-step buffers of ~6 MiB tilt a
# 20-step least-squares slope by up to ~25, but not the floor: clean runs measured ~0-1). The 200-step soak
# measured a slope of +0.36. The injected leak is 2 MiB per step, ~200 per 100 steps (measured ~150-200).
THRESHOLD = 25.0
SMALL = ("per_device_train_batch_size=4", "max_completion_length=8")


def test_drift_slope_floor_and_spread():
    flat = [500.0 + (0.3 if i % 2 else 0.0) for i in range(30)]
    assert abs(drift(flat, 5)["slope_mib_per_100_steps"]) < 1 and drift(flat, 5)["floor_rise_mib_per_100_steps"] == 0
    spiky = [500.0 + (6.0 if i % 4 == 3 else 0.0) + (12.0 if i == 29 else 0.0) for i in range(30)]
    assert drift(spiky, 5)["floor_rise_mib_per_100_steps"] == 0  # transient buffers do not lift the floor
    leaking = [500.0 + 0.5 * i for i in range(30)]
    d = drift(leaking, 5)
    assert d["slope_mib_per_100_steps"] == pytest.approx(50.0) and d["max_minus_min_mib"] == pytest.approx(12.0)
    assert d["floor_rise_mib_per_100_steps"] == pytest.approx(48.0, rel=0.1)
    with pytest.raises(ValueError):
        drift([1.0, 2.0], 2)


def test_short_soak_flat_and_injected_leak_caught(tmp_path, repo_root):
    """Two fresh processes side by side (one thread each): 20 clean steps pass ``--check-slope``, 20 steps
    with a 2 MiB-per-step leak fail it. (In one process the second run's leak would be hidden in memory
    the first run freed but the allocator kept resident, so each run gets its own process.)"""
    runs = {}
    for name, extra in (("clean", []), ("leak", ["--leak-mib", "2"])):
        cmd = [
            sys.executable,
            str(repo_root / "bench" / "soak.py"),
            "--steps",
            "20",
            "--warmup",
            "5",
            "--out",
            str(tmp_path / name / "soak"),
            "--runs-dir",
            str(tmp_path / name),
            "--check-floor",
            str(THRESHOLD),
            *extra,
            *[a for s in SMALL for a in ("--set", s)],
        ]
        runs[name] = subprocess.Popen(
            cmd,
            cwd=repo_root,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(repo_root)},
        )
    out = {name: proc.communicate(timeout=600)[0] for name, proc in runs.items()}
    assert runs["clean"].returncode == 0, out["clean"][-3000:]
    assert runs["leak"].returncode == 1 and "FAIL: RSS floor rises" in out["leak"], out["leak"][-3000:]
    for name in runs:
        summary = next((line for line in out[name].splitlines() if line.startswith("20 steps")), None)
        assert summary is not None, out[name][-3000:]
        rows = (tmp_path / name / "data" / "soak.jsonl").read_text().splitlines()  # bench/_common.record's data file
        rss = json.loads(rows[-1])["detail"]["rss_mib"]
        assert len(rss) == 20, rss
        print(f"{name}: {summary}; RSS per step {rss}")  # shown with pytest -s
