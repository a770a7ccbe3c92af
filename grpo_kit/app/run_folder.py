"""Who may write a run folder: a run is never silently trained over, and one process writes at a time.

* :func:`claim_run_folder` is called before a run writes anything. A new run into a folder that already
  holds one (any of :data:`RUN_FILES`) stops with a :class:`RunFolderError` pointing to ``--resume`` and
  ``--overwrite``; with ``overwrite=True`` the old run is *renamed* aside to ``<name>.replaced-<UTC time>``
  next to it (never deleted) and the new run starts in a fresh, empty folder.
* The lock file ``RUN_DIR/.grpo_kit.lock`` (JSON: owner PID, host, start time) is created exclusively and
  held for the run's lifetime. A second writer is refused with the owner's PID and start time; a lock
  whose owner is gone (same host, no such process) is taken over, with a message.

What the lock does not do: it is advisory (a process that ignores it is not stopped), and a lock
written on another host is never taken over automatically (delete the file once that run is gone).
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time
from pathlib import Path

# What a run writes into its folder (grpo_kit.app.run, grpo_kit.trainer.checkpoints); any one of them means "holds a run".
RUN_FILES = ("config.yaml", "metrics.csv", "samples.jsonl", "summary.json", "eval.json", "rewards.png",
             "checkpoints", "adapter", "model")
LOCK_FILE = ".grpo_kit.lock"


class RunFolderError(ValueError):
    """The run folder cannot be used as asked (holds a run, or another process writes it)."""


def holds_run(run_dir: str | os.PathLike) -> list[str]:
    """The :data:`RUN_FILES` present in ``run_dir`` (empty: no run there)."""
    run_dir = Path(run_dir)
    return [name for name in RUN_FILES if (run_dir / name).exists()]


def _owner_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by another user
        return True
    return True


def read_lock(run_dir: str | os.PathLike) -> dict | None:
    """The lock's content (``pid``, ``host``, ``started``), ``{}`` when unreadable, None when there is none."""
    path = Path(run_dir) / LOCK_FILE
    try:
        info = json.loads(path.read_bytes().decode("utf-8"))
    except FileNotFoundError:
        return None
    except (OSError, ValueError):
        return {}
    return info if isinstance(info, dict) else {}


def _live_owner(run_dir: Path) -> dict | None:
    """The lock's content when a live process (or one on another host) holds it, else None."""
    info = read_lock(run_dir)
    if info is None:
        return None
    pid, host = info.get("pid"), info.get("host")
    if isinstance(pid, int) and pid > 0 and host == socket.gethostname() and not _owner_alive(pid):
        return None
    if not info:  # a lock file we cannot read: its writer may be mid-write, so treat it as held
        return {"pid": "?", "host": "?", "started": "?"}
    return info


def _held_message(run_dir: Path, owner: dict) -> str:
    return (f"run folder {str(run_dir)!r} is in use by process {owner.get('pid')} on {owner.get('host')} (started "
            f"{owner.get('started')}); wait for that run to end, or stop it. If it is gone, delete "
            f"{run_dir / LOCK_FILE}")


class RunLock:
    """The lock file of one run folder, held by this process until :meth:`release`."""

    def __init__(self, run_dir: str | os.PathLike):
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / LOCK_FILE
        self.held = False

    def acquire(self) -> "RunLock":
        info = {"pid": os.getpid(), "host": socket.gethostname(),
                "started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())}
        data = json.dumps(info).encode()
        for _ in range(2):
            try:
                fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            except FileExistsError:
                owner = _live_owner(self.run_dir)
                if owner is not None:
                    raise RunFolderError(_held_message(self.run_dir, owner)) from None
                print(f"[grpo_kit] taking over the lock of {self.run_dir}: its owner "
                      f"(process {read_lock(self.run_dir).get('pid')}) is gone", file=sys.stderr, flush=True)
                try:
                    self.path.unlink()
                except FileNotFoundError:
                    pass
                continue
            try:
                os.write(fd, data)
                os.fsync(fd)
            finally:
                os.close(fd)
            self.held = True
            return self
        raise RunFolderError(_held_message(self.run_dir, read_lock(self.run_dir) or {}))

    def release(self) -> None:
        if self.held and (read_lock(self.run_dir) or {}).get("pid") == os.getpid():
            self.path.unlink(missing_ok=True)
        self.held = False


def _aside_name(run_dir: Path) -> Path:
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    for n in range(1000):
        candidate = run_dir.with_name(f"{run_dir.name}.replaced-{stamp}" + (f"-{n}" if n else ""))
        if not candidate.exists():
            return candidate
    raise RunFolderError(f"cannot find a free name to move {run_dir} aside")


def claim_run_folder(run_dir: str | os.PathLike, *, resume: bool = False, overwrite: bool = False) -> RunLock:
    """Make ``run_dir`` this process's run folder and lock it; returns the held :class:`RunLock`.

    New run (``resume=False``): a folder holding a run is refused, or with ``overwrite`` renamed aside
    (the new name is printed). ``resume=True``: the run already there is continued, so it must not be
    ``overwrite``. Either way another live writer is refused first, before anything moves.
    """
    run_dir = Path(run_dir)
    if resume and overwrite:
        raise RunFolderError("--resume continues the run in its folder and --overwrite moves it aside: choose one")
    if run_dir.is_dir():
        owner = _live_owner(run_dir)
        if owner is not None:
            raise RunFolderError(_held_message(run_dir, owner))
        found = holds_run(run_dir)
        if found and not resume:
            if not overwrite:
                raise RunFolderError(
                    f"run folder {str(run_dir)!r} already holds a run ({', '.join(found)}); nothing was changed. "
                    f"Continue it with `train --resume {run_dir}` (notebooks: grpo_kit.app.run.resume), or start "
                    f"over with --overwrite (train(..., overwrite=True)), which moves the old run aside, or pick "
                    "another output_dir")
            aside = _aside_name(run_dir)
            os.rename(run_dir, aside)
            print(f"[grpo_kit] moved the run that was in {run_dir} to {aside} (--overwrite)", file=sys.stderr,
                  flush=True)
    run_dir.mkdir(parents=True, exist_ok=True)
    return RunLock(run_dir).acquire()
