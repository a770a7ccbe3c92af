"""A cgroup v2 per sandboxed run, where the machine allows it: memory and processes counted for the run as a whole.

:func:`make_run_cgroup` makes a child cgroup with ``memory.max`` (= ``memory_mb``, no swap) and ``pids.max``
(= ``max_processes``) under the trainer's own cgroup, or under the root of the cgroup2 mount when that is where the
trainer runs; the program's process joins it before its exec, so every process and thread it starts, and every page
it writes to its private tmpfs, is counted there. None where cgroup v2 is missing, lacks the ``memory`` or ``pids``
controller, or may not be written (then the sandbox sizes per-process limits so their sum stays under the run's).
:func:`remove_run_cgroup` kills what is left in it and removes it; it never raises.
"""

from __future__ import annotations

import itertools
import logging
import os
import threading
import time

logger = logging.getLogger("grpo_kit.tasks.sandbox")

_CONTROLLERS = ("memory", "pids")
_base: list = []  # probed once per process: [the folder runs' cgroups are made in, or None]
_lock = threading.Lock()
_counter = itertools.count()


def _cgroup2_mount() -> str | None:
    try:
        with open("/proc/self/mountinfo", encoding="utf-8") as fh:
            for line in fh:
                left, _, right = line.partition(" - ")
                if right.split()[:1] == ["cgroup2"]:
                    return left.split()[4]
    except OSError:
        pass
    return None


def _write(path: str, text: str) -> None:
    with open(path, "w", encoding="utf-8") as fh:
        fh.write(text)


def _probe() -> str | None:
    """The cgroup folder in which runs' cgroups can be made with memory and pids enabled, or None."""
    mount = _cgroup2_mount()
    if mount is None:
        return None
    try:
        with open("/proc/self/cgroup", encoding="utf-8") as fh:
            own = next(line.split("::", 1)[1].strip() for line in fh if line.startswith("0::"))
        base = os.path.join(mount, own.lstrip("/"))
        with open(os.path.join(base, "cgroup.controllers"), encoding="utf-8") as fh:
            if not set(_CONTROLLERS) <= set(fh.read().split()):
                return None
        with open(os.path.join(base, "cgroup.subtree_control"), encoding="utf-8") as fh:
            enabled = set(fh.read().split())
        if not set(_CONTROLLERS) <= enabled:  # only possible where the trainer's cgroup is the root one
            _write(os.path.join(base, "cgroup.subtree_control"), " ".join("+" + c for c in _CONTROLLERS))
        probe = os.path.join(base, f"grpo_kit_sandbox_probe_{os.getpid()}")
        os.mkdir(probe)
        try:
            _write(os.path.join(probe, "pids.max"), "1")
        finally:
            os.rmdir(probe)
        return base
    except (OSError, StopIteration, IndexError):
        return None


def make_run_cgroup(lim) -> str | None:
    """A fresh cgroup for one run of ``lim`` (a :class:`~grpo_kit.tasks.sandbox.SandboxLimits`), or None."""
    with _lock:
        if not _base:
            _base.append(_probe())
    if _base[0] is None:
        return None
    path = os.path.join(_base[0], f"grpo_kit_sandbox_{os.getpid()}_{next(_counter)}")
    try:
        os.mkdir(path)
        if lim.memory_mb is not None:
            _write(os.path.join(path, "memory.max"), str(lim.memory_mb * 2**20))
            if os.path.exists(os.path.join(path, "memory.swap.max")):
                _write(os.path.join(path, "memory.swap.max"), "0")
            _write(os.path.join(path, "memory.oom.group"), "1")  # out of memory: the whole run goes
        _write(os.path.join(path, "pids.max"), str(lim.max_processes))
        return path
    except OSError as e:
        logger.warning("grpo_kit.tasks.sandbox: no cgroup for this run (%s); per-process limits instead", e)
        remove_run_cgroup(path)
        return None


def remove_run_cgroup(path: str) -> int:
    """Kill what is left in the run's cgroup and remove it: 0, or 1 (logged) when it would not go. Never raises."""
    try:
        if os.path.exists(os.path.join(path, "cgroup.kill")):
            _write(os.path.join(path, "cgroup.kill"), "1")
        for _ in range(50):
            try:
                os.rmdir(path)
                return 0
            except FileNotFoundError:
                return 0
            except OSError:  # busy until its last process is reaped
                time.sleep(0.02)
        os.rmdir(path)
        return 0
    except Exception as e:  # never raised into training: logged and counted
        logger.warning("grpo_kit.tasks.sandbox: could not remove the run's cgroup %s: %s", path, e)
        return 1
