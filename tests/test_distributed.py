"""DDP on the CPU (gloo): 2 processes x accumulation k == 1 process x accumulation 2k, for the grpo and dapo
normalisations (tests/_parallel_worker.py's update mode, as tests/test_fsdp.py runs it under FSDP2)."""

import subprocess
import sys

import torch

LOSS_TYPES = ["grpo", "dapo"]


def _launch(repo_root, tmp_path, nproc, total_micro):
    out = tmp_path / f"update_{nproc}.pt"
    # accelerate 1.16 starts several CPU processes only through its torchrun launcher (`--multi_gpu`; `--cpu`
    # alone runs one process unless mpirun is installed); GRPOConfig(use_cpu=True) then selects gloo (MULTI_CPU).
    launcher = ["--multi_gpu"] if nproc > 1 else []
    cmd = [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        *launcher,
        "--num_processes",
        str(nproc),
        "--num_machines",
        "1",
        "--mixed_precision",
        "no",
        "--dynamo_backend",
        "no",
        "--main_process_port",
        "0",
        str(repo_root / "tests" / "_parallel_worker.py"),
        "update",
        str(out),
        str(total_micro),
        ",".join(LOSS_TYPES),
        "hf",
    ]
    r = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    return torch.load(out)


def test_two_processes_match_one_process_with_double_accumulation(repo_root, tmp_path):
    one = _launch(repo_root, tmp_path, 1, 4)
    two = _launch(repo_root, tmp_path, 2, 4)
    assert (one["world"], one["gas"], two["world"], two["gas"]) == (1, 4, 2, 2)
    assert two["distributed_type"] == "DistributedType.MULTI_CPU"
    assert list(one["updates"]) == list(two["updates"]) == LOSS_TYPES
    for loss_type in LOSS_TYPES:
        u_one, u_two = one["updates"][loss_type], two["updates"][loss_type]
        assert u_one.keys() == u_two.keys()
        nonzero = 0
        for name, u1 in u_one.items():
            torch.testing.assert_close(u_two[name], u1, rtol=1e-4, atol=1e-7, msg=f"{loss_type}: {name}")
            nonzero += int(u1.abs().max() > 0)
        assert nonzero == len(u_one)  # every trainable tensor moved
