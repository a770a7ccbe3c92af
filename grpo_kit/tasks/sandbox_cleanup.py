"""Removing a sandbox's scratch folder whatever the program left in it; never raises.

:func:`remove_tree` walks the tree iteratively (no recursion: a tree thousands of folders deep is fine), one open
folder at a time relative to its parent's descriptor (no path is ever longer than one name, so depth past
``PATH_MAX`` is fine), never following a symlink and never entering another file system (a mount point is detached,
not emptied). It opens up unreadable folders of its own, and checks each step back up against the inode it came
from, so a folder moved away mid-walk stops the walk instead of leading it outside. What it cannot remove is
logged (logger ``grpo_kit.tasks.sandbox``) and counted (:func:`cleanup_failures`).
"""

from __future__ import annotations

import ctypes
import logging
import os
import stat
import threading

logger = logging.getLogger("grpo_kit.tasks.sandbox")

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)
_MNT_DETACH = 2
_failures = 0
_failures_lock = threading.Lock()


def cleanup_failures() -> int:
    """How many entries this process's sandbox cleanups could not remove, in all."""
    return _failures


def _failed(what: str, error: BaseException, errors: list) -> None:
    global _failures
    errors.append(error)
    with _failures_lock:
        _failures += 1
    logger.warning("grpo_kit.tasks.sandbox: could not remove %s: %s", what, error)


def _open_dir(name: str, dir_fd: int) -> int:
    """The folder ``name`` in ``dir_fd``, opened without following a link; made readable first if it is not."""
    try:
        return os.open(name, _DIR_FLAGS, dir_fd=dir_fd)
    except PermissionError:
        path_fd = os.open(name, os.O_PATH | os.O_NOFOLLOW | os.O_DIRECTORY, dir_fd=dir_fd)
        try:
            os.chmod(f"/proc/self/fd/{path_fd}", 0o700)  # the folder itself: a link was refused by O_NOFOLLOW
        finally:
            os.close(path_fd)
        return os.open(name, _DIR_FLAGS, dir_fd=dir_fd)


def _detach(name: str, dir_fd: int) -> bool:
    """Detach whatever is mounted at ``name`` (a program may have left a mount in scratch)."""
    libc = ctypes.CDLL(None, use_errno=True)
    return libc.umount2(f"/proc/self/fd/{dir_fd}/{name}".encode(), _MNT_DETACH) == 0


def _empty_one_level(fd: int, dev: int, skip: set, errors: list) -> tuple[str, os.stat_result] | None:
    """Unlink every non-folder in ``fd``; the first folder still to empty (name, its lstat), or None when none."""
    with os.scandir(fd) as entries:
        for entry in entries:
            try:
                st = entry.stat(follow_symlinks=False)
                if not stat.S_ISDIR(st.st_mode):
                    os.unlink(entry.name, dir_fd=fd)
                elif (st.st_dev, st.st_ino) in skip:
                    continue
                elif st.st_dev != dev:  # a mount point: detach it, never walk into another file system
                    if not _detach(entry.name, fd):
                        skip.add((st.st_dev, st.st_ino))
                        _failed(f"mount point {entry.name!r}", OSError(ctypes.get_errno(), "umount2"), errors)
                    else:
                        return entry.name, os.stat(entry.name, dir_fd=fd, follow_symlinks=False)
                else:
                    return entry.name, st
            except FileNotFoundError:
                continue
            except OSError as e:
                _failed(repr(entry.name), e, errors)
    return None


def _walk(top_fd: int, path: str, errors: list) -> None:
    """Empty the folder open at ``top_fd`` depth first, holding one descriptor (and the inode chain) at a time."""
    top = os.fstat(top_fd)
    chain = [(top.st_dev, top.st_ino, "")]  # (dev, inode, name in its parent) from the top down
    skip: set = set()  # folders that could not be emptied: not entered again
    fd = top_fd
    while True:
        child = _empty_one_level(fd, top.st_dev, skip, errors)
        if child is not None:
            name, st = child
            try:
                new = _open_dir(name, fd)
            except OSError as e:
                skip.add((st.st_dev, st.st_ino))
                _failed(f"{name!r} under {path}", e, errors)
                continue
            if fd != top_fd:
                os.close(fd)
            fd = new
            chain.append((st.st_dev, st.st_ino, name))
            continue
        if len(chain) == 1:
            return
        parent = os.open("..", _DIR_FLAGS, dir_fd=fd)
        dev, ino, name = chain.pop()
        os.close(fd)
        pst = os.fstat(parent)
        if (pst.st_dev, pst.st_ino) != chain[-1][:2]:  # moved while we walked: stop rather than leave the tree
            os.close(parent)
            raise OSError(f"a folder under {path} moved during cleanup")
        try:
            os.rmdir(name, dir_fd=parent)
        except OSError as e:
            skip.add((dev, ino))
            _failed(f"{name!r} under {path}", e, errors)
        fd = parent if len(chain) > 1 else top_fd
        if fd != parent:
            os.close(parent)


def remove_tree(path: str) -> int:
    """Remove ``path`` and everything under it; the number of entries that could not be removed (0: all gone).

    Never raises: each failure is logged at WARNING and counted in :func:`cleanup_failures`."""
    errors: list = []
    try:
        if not stat.S_ISDIR(os.lstat(path).st_mode):  # a file or a link: the entry itself
            os.unlink(path)
            return 0
        top_fd = os.open(path, _DIR_FLAGS)
        try:
            _walk(top_fd, path, errors)
        finally:
            os.close(top_fd)
        os.rmdir(path)
    except FileNotFoundError:
        pass
    except Exception as e:  # anything at all (RecursionError included): counted and logged, never raised
        _failed(path, e, errors)
    return len(errors)
