"""Checkpoints that survive a kill at any moment, and resuming a run from the last complete one.

Layout: ``RUN_DIR/checkpoints/checkpoint-<step>/`` holding

* ``adapter/`` (PEFT ``save_pretrained``, safetensors) or ``weights.safetensors`` (full fine-tuning),
* ``optimizer``, ``scheduler``, ``scaler``, ``rng``, ``trl_buffer``: each a ``NAME.json`` (structure,
  numbers, strings) plus ``NAME.safetensors`` (every tensor or numpy array in it); no pickle anywhere,
* ``trainer_state.json`` (transformers' ``TrainerState``: global step, epoch, log history),
* ``kit_state.json`` (TRL's micro-step counter, the data sampler's generator state, the run folder's
  metrics rows so far, the byte length of ``samples.jsonl``, the evaluation before training),
* ``manifest.json`` (size and SHA-256 of every other file), written last.

A checkpoint is built in ``checkpoints/.tmp-checkpoint-<step>-<pid>/``; every file is fsync'ed, then the
folder is renamed to its final name and the parent folder fsync'ed. A kill before the rename leaves a
``.tmp-*`` folder that the next save or resume deletes; a kill after it leaves a complete checkpoint. On
resume, checkpoints are tried newest first and one whose files do not match its manifest is skipped
(with a message), so a truncated file falls back to the previous checkpoint.

Resuming goes through transformers' own ``resume_from_checkpoint`` path (data skipping, trainer
state); :class:`ResumableTrainerMixin` replaces its save/load methods with the formats above.
:func:`resume` is the notebook entry point; ``python -m grpo_kit train --resume RUN_DIR`` the CLI's.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import random
import re
import shutil
import signal
import sys
import threading
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from safetensors.torch import load_file, load_model, save_file, save_model

from grpo_kit.readers.bounded import read_json
from grpo_kit.trainer.channel import channel

CHECKPOINTS = "checkpoints"
PREFIX = "checkpoint-"
MANIFEST = "manifest.json"
KIT_STATE = "kit_state.json"
TRAINER_STATE = "trainer_state.json"


class CheckpointError(RuntimeError):
    """No usable checkpoint, or one that does not fit the run."""


class DiskFullError(CheckpointError):
    """The run folder's disk is full (or its quota spent); the message names the folder and its free space."""


# errno values of a write that found no room.
DISK_FULL = (errno.ENOSPC, errno.EDQUOT)


def resume_hint(run_dir: str | os.PathLike) -> str:
    """How to continue the run in ``run_dir``, for the CLI and for notebooks."""
    return (
        f"continue with `python -m grpo_kit train --resume {run_dir}` (notebooks: "
        f"grpo_kit.app.run.resume({str(run_dir)!r}))"
    )


def disk_full_error(run_dir: str | os.PathLike, error: OSError, what: str) -> DiskFullError:
    """The one-line :class:`DiskFullError` for ``error`` (a full disk) while writing ``what`` in ``run_dir``."""
    where = Path(run_dir).absolute()
    existing = next(p for p in (where, *where.parents) if p.exists())
    free = shutil.disk_usage(existing).free
    saved = list_checkpoints(run_dir)
    last = f"the last complete checkpoint, {saved[-1]}, is intact" if saved else "no checkpoint was complete yet"
    return DiskFullError(
        f"disk full while writing {what} in {where}: {free / 2**20:.1f} MiB free there "
        f"({error.strerror or error}); {last}. Free some space, then "
        + (resume_hint(run_dir) if saved else "start the run again")
    )


class Interrupted(RuntimeError):
    """Training stopped on SIGTERM or SIGINT (the state saved when training had started); ``exit_code``: 128 plus
    the signal's number, as a shell reports a process ended by it."""

    def __init__(self, message: str, signum: int):
        super().__init__(message)
        self.signum, self.exit_code = signum, 128 + signum


class SignalStop:
    """SIGTERM and SIGINT (what Colab, SLURM and Kubernetes send before a kill; a notebook's interrupt) while a run
    lasts, as a context manager (installed in the main thread only; the previous handlers put back on exit).

    While ``training``: the first signal is recorded (``signum``) and the trainer (``ResumableTrainerMixin``) saves a
    checkpoint at the end of the next logged step and stops with :class:`Interrupted`. Otherwise (loading, the
    final evaluation) the first signal raises :class:`Interrupted` at once. A second signal gets the previous
    handler at once (SIGTERM ends the process, SIGINT raises ``KeyboardInterrupt``), after a line naming the last
    complete checkpoint of ``run_dir`` to resume from."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self):
        self.signum: int | None = None
        self.training = False
        self.hint = "before training ran a step; nothing to resume: start the run again"  # for a stop outside it
        self.run_dir: Path | None = None
        self._previous: dict = {}

    def __enter__(self) -> SignalStop:
        if threading.current_thread() is threading.main_thread():
            self._previous = {s: signal.signal(s, self._handle) for s in self.SIGNALS}
        return self

    def __exit__(self, *exc) -> bool:
        self._restore()
        return False

    def _restore(self) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        self._previous = {}

    def _handle(self, signum, frame) -> None:
        name = signal.Signals(signum).name
        if self.signum is not None:  # the second: at once, naming what is left to resume from
            saved = list_checkpoints(self.run_dir) if self.run_dir is not None else []
            left = (
                f"resume from {saved[-1]}: {resume_hint(self.run_dir)}"
                if saved
                else "no checkpoint is complete yet: start the run again"
            )
            print(f"[grpo_kit] {name} again: stopping at once, without saving; {left}", file=sys.stderr, flush=True)
            self._restore()
            signal.raise_signal(signum)
            return
        self.signum = signum
        if not self.training:
            raise Interrupted(f"stopped by {name} {self.hint}", signum)

        print(
            f"[grpo_kit] {name}: saving a checkpoint at the end of this step, then stopping (send it again to "
            "stop at once, without saving)",
            file=sys.stderr,
            flush=True,
        )


# ----------------------------------------------------------------------------------------------
# fsync helpers
def fsync_dir(path: str | os.PathLike) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree(root: Path) -> None:
    for dirpath, _dirs, files in os.walk(root):
        for name in files:
            with open(os.path.join(dirpath, name), "rb") as fh:
                os.fsync(fh.fileno())
        fsync_dir(dirpath)


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    """Write a file so that a reader sees the old content or the new, never a torn one."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "w", encoding="utf-8") as fh:
        fh.write(text)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


# ----------------------------------------------------------------------------------------------
# A pickle-free codec for state trees (optimizer/scheduler/RNG state dicts, TRL's buffered batch):
# structure and scalars in JSON, tensors and numpy arrays in safetensors.
def _encode(obj, tensors: dict, key: str):
    if isinstance(obj, torch.Tensor):
        name = f"t{len(tensors)}"
        tensors[name] = obj.detach().to("cpu").contiguous().clone()
        return {"__tensor__": name}
    if isinstance(obj, np.ndarray):
        name = f"t{len(tensors)}"
        tensors[name] = torch.from_numpy(np.ascontiguousarray(obj).copy())
        return {"__ndarray__": name, "dtype": str(obj.dtype)}
    if isinstance(obj, np.generic):
        return _encode(obj.item(), tensors, key)
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    if isinstance(obj, dict):
        return {"__dict__": [[_encode(k, tensors, key), _encode(v, tensors, f"{key}.{k}")] for k, v in obj.items()]}
    if isinstance(obj, tuple):
        return {"__tuple__": [_encode(v, tensors, key) for v in obj]}
    if isinstance(obj, list):
        return [_encode(v, tensors, key) for v in obj]
    if isinstance(obj, torch.dtype):
        return {"__dtype__": str(obj).removeprefix("torch.")}
    raise TypeError(f"cannot store {type(obj).__name__} at {key!r} in a checkpoint (no pickle)")


def _decode(obj, tensors: dict):
    if isinstance(obj, list):
        return [_decode(v, tensors) for v in obj]
    if isinstance(obj, dict):
        if "__tensor__" in obj:
            return tensors[obj["__tensor__"]]
        if "__ndarray__" in obj:
            return tensors[obj["__ndarray__"]].numpy().astype(obj["dtype"], copy=False)
        if "__dict__" in obj:
            return {_decode(k, tensors): _decode(v, tensors) for k, v in obj["__dict__"]}
        if "__tuple__" in obj:
            return tuple(_decode(v, tensors) for v in obj["__tuple__"])
        if "__dtype__" in obj:
            return getattr(torch, obj["__dtype__"])
        raise ValueError(f"unknown entry in a stored state: {sorted(obj)}")
    return obj


def save_state(obj, folder: str | os.PathLike, name: str) -> None:
    """``obj`` (nested dict/list/tuple of tensors, arrays and scalars) to ``name.json`` + ``name.safetensors``."""

    tensors: dict[str, torch.Tensor] = {}
    tree = _encode(obj, tensors, name)
    folder = Path(folder)
    save_file(tensors, str(folder / f"{name}.safetensors"))
    (folder / f"{name}.json").write_text(json.dumps(tree))


def load_state(folder: str | os.PathLike, name: str, device: str | torch.device = "cpu"):
    folder = Path(folder)
    device = torch.device(device)  # accelerate's CPU device under several processes is cpu:0, which safetensors refuses
    tensors = load_file(str(folder / f"{name}.safetensors"), device="cpu" if device.type == "cpu" else str(device))
    return _decode(read_json(folder / f"{name}.json"), tensors)


# ----------------------------------------------------------------------------------------------
# RNG states
def get_rng_state() -> dict:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


# ----------------------------------------------------------------------------------------------
# Checkpoint folders
def checkpoints_dir(run_dir: str | os.PathLike) -> Path:
    return Path(run_dir) / CHECKPOINTS


def _step_of(path: Path) -> int | None:
    m = re.fullmatch(rf"{PREFIX}(\d+)", path.name)
    return int(m.group(1)) if m else None


def checkpoint_step(path: str | os.PathLike) -> int:
    """The optimiser step a checkpoint folder holds (from its name, ``checkpoint-<step>``)."""
    step = _step_of(Path(path))
    if step is None:
        raise CheckpointError(f"{path} is not a checkpoint folder (checkpoint-<step>)")
    return step


def list_checkpoints(run_dir: str | os.PathLike) -> list[Path]:
    """Complete (renamed) checkpoint folders, oldest first."""
    root = checkpoints_dir(run_dir)
    if not root.is_dir():
        return []
    found = [(s, p) for p in root.iterdir() if p.is_dir() and (s := _step_of(p)) is not None]
    return [p for _, p in sorted(found)]


def _file_digest(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def write_manifest(folder: Path) -> None:
    files = {}
    for p in sorted(folder.rglob("*")):
        if p.is_file() and p.name != MANIFEST:
            files[str(p.relative_to(folder))] = {"bytes": p.stat().st_size, "sha256": _file_digest(p)}
    (folder / MANIFEST).write_text(json.dumps({"format": 1, "files": files}, indent=1))


def verify_checkpoint(folder: str | os.PathLike) -> str | None:
    """None when every file listed in the manifest is there with its size and hash and the run's JSON state
    files parse; else the problem. Never raises: a checkpoint unreadable for any reason is just not usable."""
    folder = Path(folder)
    try:
        manifest = read_json(folder / MANIFEST)
    except FileNotFoundError:
        return "no manifest.json"
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as e:
        return f"manifest.json cannot be read ({type(e).__name__})"
    files = manifest.get("files") if isinstance(manifest, dict) else None
    if not isinstance(files, dict):
        return "manifest.json lists no files"
    try:
        for rel, meta in files.items():
            if Path(rel).is_absolute() or ".." in Path(rel).parts:
                return f"manifest.json names a path outside the checkpoint: {rel!r}"
            p = folder / rel
            if not p.is_file():
                return f"{rel} is missing"
            if p.stat().st_size != meta["bytes"]:
                return f"{rel} has {p.stat().st_size} bytes, the manifest says {meta['bytes']}"
            if _file_digest(p) != meta["sha256"]:
                return f"{rel} does not match its SHA-256 in the manifest"
        for name in (KIT_STATE, TRAINER_STATE):
            if (folder / name).is_file():
                read_json(folder / name)
    except (OSError, UnicodeDecodeError, ValueError, RecursionError, KeyError, TypeError) as e:
        return f"cannot be read ({type(e).__name__}: {e})"
    return None


def last_checkpoint(run_dir: str | os.PathLike, *, log=None) -> Path | None:
    """The newest checkpoint that passes :func:`verify_checkpoint` (broken ones are reported and skipped)."""
    for path in reversed(list_checkpoints(run_dir)):
        problem = verify_checkpoint(path)
        if problem is None:
            return path
        msg = f"[grpo_kit] skipping checkpoint {path}: {problem}"
        log(msg) if log is not None else print(msg, file=sys.stderr, flush=True)
    return None


def remove_stale_temporaries(run_dir: str | os.PathLike) -> list[Path]:
    """Delete ``.tmp-*`` folders left by a writer that was killed before its rename, and ``.old-*`` ones whose
    step is there again. A complete ``.old-checkpoint-<step>-<pid>`` without its ``checkpoint-<step>`` (a writer
    killed between moving it aside and renaming its new copy in) is renamed back: it may be the last complete
    checkpoint of the run, whoever wrote it."""
    root = checkpoints_dir(run_dir)
    removed = []
    if root.is_dir():
        for p in sorted(root.iterdir()):
            if p.name.startswith(".old-"):
                final = root / p.name.removeprefix(".old-").rsplit("-", 1)[0]
                if _step_of(final) is not None and not final.exists() and verify_checkpoint(p) is None:
                    os.rename(p, final)
                    fsync_dir(root)
                    print(
                        f"[grpo_kit] restored {final} from {p.name} (a save of that step was cut short)",
                        file=sys.stderr,
                        flush=True,
                    )
                    continue
            if p.name.startswith(".tmp-") or p.name.startswith(".old-"):
                shutil.rmtree(p, ignore_errors=True)
                removed.append(p)
    return removed


def write_checkpoint(run_dir: str | os.PathLike, step: int, fill, *, keep: int = 2) -> Path:
    """Build a checkpoint with ``fill(tmp_folder)``, then publish it atomically as ``checkpoint-<step>``.

    ``keep``: complete checkpoints kept afterwards (the newest; 0 keeps all).
    """
    root = checkpoints_dir(run_dir)
    root.mkdir(parents=True, exist_ok=True)
    remove_stale_temporaries(run_dir)
    tmp = root / f".tmp-{PREFIX}{step}-{os.getpid()}"
    try:
        tmp.mkdir()
        fill(tmp)
        write_manifest(tmp)
        _fsync_tree(tmp)
    except OSError as e:
        if e.errno not in DISK_FULL:
            raise
        shutil.rmtree(tmp, ignore_errors=True)  # the space it took back; the complete checkpoints are untouched
        raise disk_full_error(run_dir, e, f"{PREFIX}{step}") from None
    final = root / f"{PREFIX}{step}"

    if final.exists():  # the same step saved again (e.g. a stop right after a periodic save)
        old = root / f".old-{PREFIX}{step}-{os.getpid()}"
        os.rename(final, old)
        os.rename(tmp, final)
        fsync_dir(root)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.rename(tmp, final)
    fsync_dir(root)
    if keep and keep > 0:
        for old in list_checkpoints(run_dir)[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
        fsync_dir(root)
    return final


# ----------------------------------------------------------------------------------------------
# Several processes: each one's RNG and TRL buffer, written by the main one as NAME_rank<r> (rank 0: NAME)
RANK_SUFFIX = "_rank"


def _sharding():
    """:mod:`grpo_kit.trainer.sharding`, imported on first use."""
    from grpo_kit.trainer import (
        sharding,  # lazy: imports accelerate (slow); the CLI imports this module for its helpers
    )

    return sharding


def _gather_to_main(obj) -> list | None:
    """``obj`` of every process in rank order on rank 0, None on the others (a collective); ``[obj]`` in a
    single process. Tensors travel on the CPU."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return [obj]
    sharding = _sharding()
    out = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(sharding.map_tensors(obj, lambda t: t.detach().cpu()), out, dst=0)
    return out


def _own_file(folder: str | os.PathLike, name: str, rank: int) -> str:
    """The state file ``name`` of process ``rank``: its own where the checkpoint has one, else the main process's."""
    own = f"{name}{RANK_SUFFIX}{rank}"
    return own if rank > 0 and (Path(folder) / f"{own}.json").is_file() else name


# ----------------------------------------------------------------------------------------------
# The trainer side
def _find_repeat_sampler(obj, depth: int = 0):
    """The data sampler with its own ``torch.Generator`` (TRL's RepeatSampler) inside a (wrapped) DataLoader."""
    if obj is None or depth > 5:
        return None
    if isinstance(getattr(obj, "generator", None), torch.Generator) and hasattr(obj, "mini_repeat_count"):
        return obj
    for attr in ("batch_sampler", "sampler", "base_dataloader"):
        found = _find_repeat_sampler(getattr(obj, attr, None), depth + 1)
        if found is not None:
            return found
    return None


class ResumableTrainerMixin:
    """Put before a transformers/TRL ``Trainer`` class: pickle-free, atomic, verified checkpoints.

    Attributes set by the caller: ``keep_checkpoints`` (int), ``run_state_provider`` (a callable
    returning a JSON-able dict stored as ``kit_state["run"]``; the run folder's metrics so far).
    """

    keep_checkpoints: int = 2
    run_state_provider = None

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._kit_init_resume()

    def _kit_init_resume(self):
        self._kit_step_begin = None  # snapshot taken at the start of each optimiser step
        self._kit_epoch_begin = None  # (epoch index, sampler generator state) at each epoch start
        self._kit_resume_state = None  # kit_state of the checkpoint being resumed
        from transformers import TrainerCallback  # lazy: slow to import; the CLI imports this module for its helpers

        trainer = self

        class _Snapshots(TrainerCallback):
            def on_epoch_begin(self, args, state, control, **kw):
                trainer._kit_on_epoch_begin(state)

            def on_step_begin(self, args, state, control, **kw):
                trainer._kit_step_begin = trainer._kit_snapshot()

            def on_step_end(self, args, state, control, **kw):
                trainer._kit_stop_on_signal(args, state, control)

        self.add_callback(_Snapshots())

    def _kit_stop_on_signal(self, args, state, control) -> None:
        """After a SIGTERM/SIGINT (the channel's ``signals``, a :class:`SignalStop`): save and stop at the end of the
        first logged step (a step between two logged ones would lose its metrics row on resume)."""
        signals = channel(self).signals
        if signals is None or signals.signum is None or state.global_step % max(1, args.logging_steps):
            return
        control.should_save = True
        control.should_training_stop = True
        ckpt = checkpoints_dir(args.output_dir) / f"{PREFIX}{state.global_step}"
        channel(self).stop_error = Interrupted(
            f"training stopped by {signal.Signals(signals.signum).name} at step "
            f"{state.global_step} of {state.max_steps}; state saved in {ckpt}; " + resume_hint(args.output_dir),
            signals.signum,
        )

    # -- what is saved besides model/optimizer --------------------------------------------------
    def _kit_sampler(self):
        return _find_repeat_sampler(getattr(self.callback_handler, "train_dataloader", None))

    def _kit_on_epoch_begin(self, state):
        sampler = self._kit_sampler()
        resume = self._kit_resume_state
        if resume is not None and sampler is not None and resume.get("sampler") is not None:
            # First epoch after a resume: put the sampler's generator where the original run had it
            # when it started this epoch (its permutation is drawn lazily, after this callback).
            s = resume["sampler"]
            epoch_now = int(state.epoch or 0)
            key = "epoch_start" if epoch_now == s["epoch"] else "current"
            sampler.generator.set_state(torch.tensor(s[key], dtype=torch.uint8))
            self._kit_resume_state = None
        if sampler is not None:
            self._kit_epoch_begin = (int(state.epoch or 0), sampler.generator.get_state().tolist())

    def _kit_snapshot(self) -> dict:
        metrics = getattr(self, "_metrics", None)
        return {
            "rng": get_rng_state(),
            "trl_step": int(getattr(self, "_step", 0)),
            "trl_metrics": (
                {m: {k: list(v) for k, v in d.items()} for m, d in metrics.items()}
                if isinstance(metrics, dict)
                else None
            ),
            "run": self.run_state_provider() if self.run_state_provider else None,
        }

    def _kit_state(self, snapshot: dict) -> dict:
        sampler = self._kit_sampler()
        sampler_state = None
        if sampler is not None and self._kit_epoch_begin is not None:
            sampler_state = {
                "epoch": self._kit_epoch_begin[0],
                "epoch_start": self._kit_epoch_begin[1],
                "current": sampler.generator.get_state().tolist(),
            }
        return {
            "format": 1,
            "global_step": self.state.global_step,
            "trl_step": snapshot["trl_step"],
            "sampler": sampler_state,
            "trl_metrics": snapshot["trl_metrics"],
            "run": snapshot["run"],
        }

    # -- save ------------------------------------------------------------------------------------
    def _save_checkpoint(self, model, trial=None, *, mid_step: bool = False):
        """Write ``checkpoints/checkpoint-<global_step>`` atomically.

        ``mid_step``: called while an optimiser step is half done (a stop on OOM): the RNG state, TRL's
        step counter and the run files are taken from the snapshot at the start of that step, and the
        weights and optimiser have not changed since, so resuming redoes the step from its beginning.
        """
        self.store_flos()
        snapshot = self._kit_step_begin if (mid_step and self._kit_step_begin is not None) else self._kit_snapshot()
        writes = self.args.should_save
        unwrapped = self.accelerator.unwrap_model(self.model)
        buffered = getattr(self, "_buffered_inputs", None)
        # Every process takes part in these gathers; only the writing one keeps what they return.
        gathered = _gather_to_main((snapshot["rng"], buffered))
        others = gathered[1:] if gathered else []  # the other processes' RNG and TRL buffer
        weights, optimizer = self._kit_whole_state(unwrapped, keep=writes)
        if not writes:
            return None
        sharding = _sharding()

        def fill(tmp: Path):
            if hasattr(unwrapped, "peft_config") and weights is not None:  # FSDP2: the adapter gathered whole
                sharding.write_adapter(unwrapped, tmp / "adapter", weights)
            elif hasattr(unwrapped, "peft_config"):
                unwrapped.save_pretrained(tmp / "adapter", safe_serialization=True)
            elif weights is not None:
                save_file(weights, str(tmp / "weights.safetensors"))
            else:
                save_model(unwrapped, str(tmp / "weights.safetensors"))
            save_state(optimizer, tmp, "optimizer")
            if self.lr_scheduler is not None:
                save_state(self.lr_scheduler.state_dict(), tmp, "scheduler")
            scaler = getattr(self.accelerator, "scaler", None)
            if scaler is not None:
                save_state(scaler.state_dict(), tmp, "scaler")
            save_state(snapshot["rng"], tmp, "rng")
            if buffered is not None:
                save_state(buffered, tmp, "trl_buffer")
            for rank, (rng, buffer) in enumerate(others, start=1):  # each process resumes its own
                save_state(rng, tmp, f"rng{RANK_SUFFIX}{rank}")
                if buffer is not None:
                    save_state(buffer, tmp, f"trl_buffer{RANK_SUFFIX}{rank}")
            self.state.save_to_json(str(tmp / TRAINER_STATE))
            (tmp / KIT_STATE).write_text(json.dumps(self._kit_state(snapshot)))

        return write_checkpoint(
            self.args.output_dir, self.state.global_step, fill, keep=int(getattr(self, "keep_checkpoints", 2) or 0)
        )

    def _kit_whole_state(self, unwrapped, *, keep: bool):
        """(model tensors, optimizer state dict) to write. Under FSDP2 both gathered whole by every process, in the
        one-process format (the adapter's entries, or the model's with tied weights once); the processes that do not
        write get (None, None). Unsharded: (None: the model writes itself, the optimizer's own state)."""
        sharding = _sharding()
        if not sharding.is_sharded(unwrapped):
            return None, (self.optimizer.state_dict() if keep else None)
        if hasattr(unwrapped, "peft_config"):
            weights = sharding.whole_adapter(unwrapped, keep=keep)
        else:
            seen: set[int] = set()  # a tied weight under each of its names: written once, as save_model does
            state = {k: v for k, v in unwrapped.state_dict().items() if id(v) not in seen and not seen.add(id(v))}
            weights = sharding.whole_state(state, keep=keep)
        return weights, sharding.whole_state(self.optimizer.state_dict(), keep=keep)

    def load_checkpoint_weights(self, checkpoint) -> None:
        """The model's weights (adapter or full) from ``checkpoint`` without training: what a run resumed at
        max_steps needs before its final save and evaluation. transformers' Trainer has no public call for it, so
        this is its private ``_load_from_checkpoint`` (this class's override below), named here once."""
        self._load_from_checkpoint(str(checkpoint))

    # -- load (called by transformers' Trainer.train(resume_from_checkpoint=...)) ----------------
    def _load_from_checkpoint(self, resume_from_checkpoint, model=None):
        sharding = _sharding()
        folder = Path(resume_from_checkpoint)
        model = self.accelerator.unwrap_model(model if model is not None else self.model)
        if (folder / "adapter").is_dir():
            from peft import set_peft_model_state_dict  # lazy: peft imports transformers; LoRA checkpoints only

            if not hasattr(model, "peft_config"):
                raise CheckpointError(f"{folder} holds a LoRA adapter but the model has none (use_lora differs)")
            sd = load_file(str(folder / "adapter" / "adapter_model.safetensors"))
            if sharding.is_sharded(model):  # FSDP2: each process keeps its shards of the whole tensors
                try:
                    sharding.load_whole_adapter(model, sd)
                except ValueError as e:
                    raise CheckpointError(f"{folder}: {e}") from None
            else:
                result = set_peft_model_state_dict(model, sd)
                unexpected = getattr(result, "unexpected_keys", None)
                if unexpected:
                    raise CheckpointError(f"{folder}: adapter tensors that do not fit the model: {unexpected[:5]}")
        elif sharding.is_sharded(model):
            with sharding.loading_whole_tensors(model):
                result = model.load_state_dict(load_file(str(folder / "weights.safetensors")), strict=False)
            if result.unexpected_keys:
                raise CheckpointError(f"{folder}: weights that do not fit the model: {result.unexpected_keys[:5]}")
        else:
            load_model(model, str(folder / "weights.safetensors"))
        kit = read_json(folder / KIT_STATE)
        self._kit_resume_state = kit
        self._step = kit["trl_step"]
        buffer = _own_file(folder, "trl_buffer", self.args.process_index)
        if (folder / f"{buffer}.json").is_file():
            device = self.accelerator.device
            self._buffered_inputs = load_state(folder, buffer, device=device)
        if kit.get("trl_metrics") is not None and isinstance(getattr(self, "_metrics", None), dict):
            for mode, values in kit["trl_metrics"].items():
                self._metrics[mode].clear()
                self._metrics[mode].update(values)

    def _load_optimizer_and_scheduler(self, checkpoint):
        if checkpoint is None:
            return
        sharding = _sharding()
        folder = Path(checkpoint)
        state = load_state(folder, "optimizer", device=self.args.device)
        if sharding.is_sharded(self.model):  # FSDP2: the whole moments cut to this process's shards
            state = sharding.shard_optimizer_state(state, self.optimizer)
        self.optimizer.load_state_dict(state)
        if self.lr_scheduler is not None and (folder / "scheduler.json").is_file():
            self.lr_scheduler.load_state_dict(load_state(folder, "scheduler"))

    def _load_scaler(self, checkpoint):
        scaler = getattr(self.accelerator, "scaler", None)
        if checkpoint is not None and scaler is not None and (Path(checkpoint) / "scaler.json").is_file():
            scaler.load_state_dict(load_state(checkpoint, "scaler"))

    def _load_rng_state(self, checkpoint):
        rng = _own_file(checkpoint, "rng", self.args.process_index) if checkpoint is not None else "rng"
        if checkpoint is not None and (Path(checkpoint) / f"{rng}.json").is_file():
            set_rng_state(load_state(checkpoint, rng))


# ----------------------------------------------------------------------------------------------
# The run-folder side
def find_resume_checkpoint(run_dir: str | os.PathLike) -> Path:
    remove_stale_temporaries(run_dir)
    ckpt = last_checkpoint(run_dir)
    if ckpt is None:
        raise CheckpointError(
            f"no complete checkpoint in {checkpoints_dir(run_dir)}; the run saves one every "
            "save_steps steps (save_steps=0: none), so there is nothing to resume from. "
            "Start the run again instead."
        )
    return ckpt


def read_run_state(ckpt: str | os.PathLike) -> dict:
    return read_json(Path(ckpt) / KIT_STATE).get("run") or {}
