"""Who may write a run folder: a run is never silently trained over, and one process writes at a time.

* :func:`claim_run_folder` is called before a run writes anything. It takes the folder's lock first, so every
  decision below is made by the one process that holds it. A new run into a folder that already holds one (any
  of :data:`RUN_FILES`) stops with a :class:`RunFolderError` pointing to ``--resume`` and ``--overwrite``; with
  ``overwrite=True`` the old run is *renamed* aside to ``<name>.replaced-<UTC time>`` next to it (never deleted),
  by the process holding its lock, and the new run starts in a fresh, empty folder that the claim locks in turn.
* Run folders are made ``0700``: what a run writes (its samples hold the questions and their answers) is for
  its user alone.
* :func:`unsafe_run_folder` refuses, by rule: the root and the folders directly in it, the top of any file
  system, the operating system's read-only trees (:data:`SYSTEM_TREES`, the Filesystem Hierarchy Standard's),
  the home folder and the checkout (and folders holding them), anything inside a Python installation or a
  package folder (recognised by what it holds: ``pyvenv.cfg``, ``conda-meta``, ``lib/python3.*``,
  ``*.dist-info``, or this interpreter's own prefixes and package folders), and an existing folder that keeps
  other folders but holds no run (a system's state, logs, caches, a project: run files would land among them
  and ``--overwrite`` would move all of it aside).
* The lock file ``RUN_DIR/.grpo_kit.lock`` (JSON: owner PID, host, start time) is created exclusively and
  held for the run's lifetime. A second writer is refused with the owner's PID and start time; a lock
  whose owner is gone (same host, no such process) is taken over, with a message.

What the lock does not do: it is advisory (a process that ignores it is not stopped), and a lock
written on another host is never taken over automatically (delete the file once that run is gone).
"""

from __future__ import annotations

import fcntl
import json
import os
import site
import socket
import sys
import sysconfig
import time
from pathlib import Path

from grpo_kit.readers.bounded import read_json

# What a run writes into its folder (grpo_kit.app.run, grpo_kit.trainer.checkpoints); any one of them means "holds a run".
RUN_FILES = (
    "config.yaml",
    "metrics.csv",
    "samples.jsonl",
    "summary.json",
    "eval.json",
    "rewards.png",
    "checkpoints",
    "adapter",
    "model",
)
LOCK_FILE = ".grpo_kit.lock"
MAX_LOCK_BYTES = 1 << 16  # its content is a PID, a host name and a time
# The operating system's read-only trees (the Filesystem Hierarchy Standard's; /lib* as well): never a run folder,
# nor is anything inside them.
SYSTEM_TREES = ("/bin", "/boot", "/dev", "/etc", "/proc", "/sbin", "/sys", "/usr")
# What a Python installation or environment holds at its top, and what a package folder holds.
PYTHON_MARKERS = ("pyvenv.cfg", "conda-meta", "lib/python3.*")
# (not *.egg-info: `pip install -e .` leaves one in a source checkout, where runs/ is the default run folder)
PACKAGE_MARKERS = ("*.dist-info",)
# The folder that holds the grpo_kit package: the checkout (or site-packages).
PACKAGE_ROOT = Path(__file__).resolve().parents[2]


def _interpreter_trees() -> set[Path]:
    """This interpreter's prefixes, standard library and package folders (a venv's, conda's, the system's)."""
    paths = {sys.prefix, sys.base_prefix, sys.exec_prefix, *sysconfig.get_paths().values()}
    try:
        paths.update(site.getsitepackages())
    except AttributeError:  # an old virtualenv's site module has none
        pass
    return {Path(q).resolve() for q in paths if q and len(Path(q).resolve().parts) > 1}


def _software_tree(p: Path) -> str | None:
    """What installed software ``p`` is (or is inside): a Python installation or environment, or a package
    folder, recognised by what it holds; None when it is no such place."""
    trees = _interpreter_trees()
    for q in (p, *p.parents):
        if q in trees:
            return f"this Python's installation ({q})"
        if len(q.parts) > 1 and q.is_dir():
            if any(next(q.glob(m), None) is not None for m in PYTHON_MARKERS):
                return f"a Python installation or environment ({q})"
            if any(next(q.glob(m), None) is not None for m in PACKAGE_MARKERS):
                return f"a package folder ({q})"
    return None


def unsafe_run_folder(path: str | os.PathLike) -> str | None:
    """Why ``path`` must not be a run folder (see the module docstring for the rules), or None. Symlinks are
    followed."""
    p = Path(os.path.expanduser(str(path))).resolve()
    top = Path(*p.parts[:2]) if len(p.parts) > 1 else p
    if len(p.parts) <= 2:
        return "it is the root folder" if p == top else f"{p} is a folder directly in the root folder (the system's)"
    if str(top) in SYSTEM_TREES or top.name.startswith("lib"):
        return f"{p} is in the operating system's tree {top}"
    for name, special in (("the home folder", Path.home().resolve()), ("the grpo_kit checkout", PACKAGE_ROOT)):
        if p == special:
            return f"{p} is {name}"
        if p in special.parents:
            return f"{p} holds {name} ({special})"
    if PACKAGE_ROOT / "grpo_kit" in (p, *p.parents):
        return f"{p} is inside the grpo_kit package"
    if (software := _software_tree(p)) is not None:
        return f"{p} is {'' if software.endswith(f'({p})') else 'inside '}{software}"
    if p.is_dir():
        if os.path.ismount(p):
            return f"{p} is the top of a file system"
        kept = sorted(e.name for e in os.scandir(p) if e.is_dir(follow_symlinks=False))
        if kept and not holds_run(p):
            return (
                f"{p} already keeps other folders ({', '.join(kept[:3])}{', ...' if len(kept) > 3 else ''}) "
                "and holds no run: the run's files would land among them, and --overwrite would move them all "
                "aside; use a new folder inside it"
            )
    return None


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
        info = read_json(path, max_bytes=MAX_LOCK_BYTES)
    except FileNotFoundError:
        return None
    except (OSError, ValueError):
        return {}
    return info if isinstance(info, dict) else {}


def _flock_held(path: Path) -> bool:
    """Whether a process holds the lock file's ``flock`` now (probed without waiting)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)  # closing drops the probe's own lock
    return False


def _content_owner(info: dict) -> dict | None:
    """The owner a lock file's content names when it may still run (a live process on this host, or any process
    on another), else None. ``{}`` (unreadable) is not an owner: whoever writes it holds the flock meanwhile."""
    pid, host = info.get("pid"), info.get("host")
    if not info:
        return None
    if host != socket.gethostname():
        return info
    return info if isinstance(pid, int) and pid > 0 and _owner_alive(pid) else None


def _live_owner(run_dir: Path) -> dict | None:
    """The lock's content when a process holds it (its flock, or a live owner named in it), else None."""
    info = read_lock(run_dir)
    if info is None:
        return None
    if _flock_held(Path(run_dir) / LOCK_FILE):
        return info or {"pid": "?", "host": "?", "started": "?"}
    return _content_owner(info)


def _held_message(run_dir: Path, owner: dict) -> str:
    return (
        f"run folder {str(run_dir)!r} is in use by process {owner.get('pid')} on {owner.get('host')} (started "
        f"{owner.get('started')}); wait for that run to end, or stop it. If it is gone, delete "
        f"{run_dir / LOCK_FILE}"
    )


def _same_file(fd: int, path: Path) -> bool:
    try:
        return os.path.samestat(os.fstat(fd), os.stat(path))
    except FileNotFoundError:
        return False


class RunLock:
    """The lock file of one run folder, held by this process until :meth:`release`.

    Held as an exclusive ``flock`` on a descriptor kept open for the run: the kernel lets one process at a time
    have it, and drops it when the process ends however it ends, so taking over a dead run's lock is the same
    atomic step as taking a free one. The file's content (owner PID, host, start time) is for the messages.
    ``created``: the folders :func:`claim_run_folder` made for the run (removed again by :meth:`abandon`)."""

    def __init__(self, run_dir: str | os.PathLike):
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / LOCK_FILE
        self.held = False
        self.created: list[Path] = []
        self._fd: int | None = None

    def acquire(self) -> RunLock:
        for _ in range(10):
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                raise RunFolderError(_held_message(self.run_dir, read_lock(self.run_dir) or {})) from None
            if not _same_file(fd, self.path):  # its last holder removed it between our open and our lock
                os.close(fd)
                continue
            previous = read_lock(self.run_dir) or {}
            owner = _content_owner(previous)
            if owner is not None:  # a live process that holds no flock (another host, or an older kit)
                os.close(fd)
                raise RunFolderError(_held_message(self.run_dir, owner))
            if previous:
                print(
                    f"[grpo_kit] taking over the lock of {self.run_dir}: its owner (process "
                    f"{previous.get('pid')}) is gone",
                    file=sys.stderr,
                    flush=True,
                )
            info = {
                "pid": os.getpid(),
                "host": socket.gethostname(),
                "started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
            }
            os.ftruncate(fd, 0)
            os.pwrite(fd, json.dumps(info).encode(), 0)
            os.fsync(fd)
            self._fd, self.held = fd, True
            return self
        raise RunFolderError(_held_message(self.run_dir, read_lock(self.run_dir) or {}))

    def release(self) -> None:
        if self.held and self._fd is not None:
            if _same_file(self._fd, self.path):  # removed before the flock goes, so no one locks a removed file
                self.path.unlink(missing_ok=True)
            os.close(self._fd)
        self._fd, self.held = None, False

    def moved_to(self, folder: Path) -> None:
        """The locked folder was renamed to ``folder`` (by this holder): its lock file goes with it, and
        :meth:`release` removes it there."""
        self.run_dir, self.path = Path(folder), Path(folder) / LOCK_FILE

    def abandon(self) -> None:
        """:meth:`release`, then remove the folders the claim made when nothing else is in them (a run that
        failed before training leaves nothing behind)."""
        self.release()
        for folder in reversed(self.created):
            try:
                folder.rmdir()
            except OSError:  # not empty, or gone: leave it
                break


def _aside_name(run_dir: Path) -> Path:
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    for n in range(1000):
        candidate = run_dir.with_name(f"{run_dir.name}.replaced-{stamp}" + (f"-{n}" if n else ""))
        if not candidate.exists():
            return candidate
    raise RunFolderError(f"cannot find a free name to move {run_dir} aside")


def claim_run_folder(run_dir: str | os.PathLike, *, resume: bool = False, overwrite: bool = False) -> RunLock:
    """Make ``run_dir`` this process's run folder and lock it; returns the held :class:`RunLock`.

    The lock is taken first, so another live writer is refused before anything moves, and what is decided next
    is decided by its holder alone. New run (``resume=False``): a folder holding a run is refused, or with
    ``overwrite`` renamed aside under its lock (the new name is printed) and a fresh folder claimed in its place.
    ``resume=True``: the run already there is continued, so it must not be ``overwrite``.
    """
    run_dir = Path(run_dir)
    if (why := unsafe_run_folder(run_dir)) is not None:
        raise RunFolderError(f"output_dir={str(run_dir)!r} cannot be a run folder: {why}")
    if resume and overwrite:
        raise RunFolderError("--resume continues the run in its folder and --overwrite moves it aside: choose one")
    lock = _locked_folder(run_dir)
    found = holds_run(run_dir)
    if not found or resume:
        return lock
    if not overwrite:
        lock.abandon()
        raise RunFolderError(
            f"run folder {str(run_dir)!r} already holds a run ({', '.join(found)}); nothing was changed. "
            f"Continue it with `train --resume {run_dir}` (notebooks: grpo_kit.app.run.resume), or start "
            f"over with --overwrite (train(..., overwrite=True)), which moves the old run aside, or pick "
            "another output_dir"
        )
    try:
        aside = _aside_name(run_dir)
        os.rename(run_dir, aside)  # only the lock's holder moves it: a second claim was refused by the lock
        lock.moved_to(aside)
        print(f"[grpo_kit] moved the run that was in {run_dir} to {aside} (--overwrite)", file=sys.stderr, flush=True)
        fresh = _locked_folder(run_dir)  # another claim may have made the new folder first: then it is theirs
    finally:
        lock.release()
    fresh.created = [*lock.created, *fresh.created]
    return fresh


def _locked_folder(run_dir: Path) -> RunLock:
    """``run_dir`` made (0700, with its missing parents) and locked; the folders made are the lock's ``created``."""
    created = [p for p in (run_dir.absolute(), *run_dir.absolute().parents) if not p.exists()][::-1]
    for folder in created:
        try:
            folder.mkdir(mode=0o700)
        except FileExistsError:  # made meanwhile by another claim
            pass
    if run_dir.is_dir() and run_dir.stat().st_uid == os.geteuid():
        os.chmod(run_dir, 0o700)  # a run's samples hold the questions and their answers
    lock = RunLock(run_dir)
    try:
        lock.acquire()
    except BaseException:
        lock.created = created
        lock.abandon()
        raise
    lock.created = created
    return lock
