"""DDP on the CPU (gloo): 2 processes x accumulation k == 1 process x accumulation 2k."""

import subprocess
import sys

import pytest
import torch


def _launch(repo_root, tmp_path, nproc, total_micro, loss_type):
    out = tmp_path / f"update_{nproc}.pt"
    # accelerate 1.16 starts several CPU processes only through its torchrun launcher (`--multi_gpu`; `--cpu`
    # alone runs one process unless mpirun is installed); GRPOConfig(use_cpu=True) then selects gloo (MULTI_CPU).
    launcher = ["--multi_gpu"] if nproc > 1 else []
    cmd = [sys.executable, "-m", "accelerate.commands.launch", *launcher, "--num_processes", str(nproc),
           "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port", "0",
           str(repo_root / "tests" / "_ddp_worker.py"), str(out), str(total_micro), loss_type]
    r = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    return torch.load(out)


@pytest.mark.parametrize("loss_type", ["grpo", "dapo"])
def test_two_processes_match_one_process_with_double_accumulation(repo_root, tmp_path, loss_type):
    one = _launch(repo_root, tmp_path, 1, 4, loss_type)
    two = _launch(repo_root, tmp_path, 2, 4, loss_type)
    assert (one["world"], one["gas"], two["world"], two["gas"]) == (1, 4, 2, 2)
    assert one["update"].keys() == two["update"].keys()
    nonzero = 0
    for name, u1 in one["update"].items():
        torch.testing.assert_close(two["update"][name], u1, rtol=1e-4, atol=1e-7, msg=name)
        nonzero += int(u1.abs().max() > 0)
    assert nonzero == len(one["update"])  # every trainable tensor moved
