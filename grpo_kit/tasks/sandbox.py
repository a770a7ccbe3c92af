"""Run untrusted, model-generated Python in a subprocess with limits; a code-verifier reward.

``run_python(code)`` runs one program; ``run_many(codes)`` runs many in parallel (a bounded thread pool, one
subprocess each); :func:`grpo_kit.tasks.code_reward.make_python_code_reward` builds a TRL reward function
``fn(prompts, completions, **columns)`` that extracts a ```` ```python ```` block from each completion, runs it
sandboxed, and scores 1.0 (tests pass / output right) or 0.0. A hang, a crash, a memory bomb or a network attempt
scores 0 for that sample with a logged reason (logger ``grpo_kit.tasks.sandbox``) and never stalls training: the
wall-clock timeout kills what the child started. ``run_python`` never raises for what the code does or for a fault
of its own (a ``sandbox error`` result instead).

**What the verdict rests on.** Each run has two processes. The *judge* (``sandbox_child.py``) runs no model code:
it forks and *execs* a fresh interpreter for the program (``sandbox_program.py``), which holds none of the judge's
memory, functions, flags or descriptors, only stdin/stdout/stderr, the program text and, in ``tests`` mode, a pipe
to the judge. The judge is non-dumpable and, with namespaces, PID 1 of the run's PID namespace (no signal from
inside reaches it) behind a ``/proc`` that shows that namespace only. In ``tests`` mode the tests run **in the
judge**, in a scope of the program's top-level names in which the **builtins are the judge's** whatever the
program defines, and a name the tests use as ``name.attribute`` is the judge's module of that name when it has
what they read (a program's ``math`` module, or module attribute of a value module such as
``fractions.Fraction``, is the judge's own too). A call, an attribute, an item, ``len()``, ``iter()``,
``next()``, ``bool()``, ``hash()`` or ``str()`` of a program object is asked of the program over the pipe, and
what comes back is a value (exact types, parsed as untrusted JSON: ``None``, ``bool``, ``int`` of any size,
``float``, ``str``, ``bytes``, ``complex``, ``Fraction``, ``Decimal``, ``range``, ``Counter``, ``OrderedDict``,
``deque``, numpy numbers and arrays of numbers, and lists, tuples, sets, dicts of them) or a handle to the
program's object; an exception comes back as
its nearest builtin class and message. Two program objects compare (and compute) by the program's own operators,
run in the program. A program object and a plain value compare as the plain type it subclasses where its type
keeps that type's method (a namedtuple, an ``IntEnum``), not at all where its type lacks the method (as in
Python); where its type has a method of its own, plain Python would let the program decide, so the judge reports
a **judge error** (the reason ``judge error: ...``, never a silent 0). The program can only choose values; it
cannot reach the assertions, their ``==`` with the tests' values, the judge's builtins or the report. The judge reports "tests completed" (after the last test ran to its end, and only if the program answered
every call) and the program's exit status on a descriptor only it holds, tagged with a per-run secret that never
enters the program's process; the parent reads nothing else. So ``tests_completed`` rests on: the tests' own code,
the values the program's functions return, and the kernel's process isolation (a separate address space, exec,
non-dumpable). In ``expected_output`` / ``answer`` mode the verdict rests on the program's stdout and its exit
status (read by the judge with ``waitpid``), nothing else.

What each run gets:

* **a minimal file system** (``filesystem="minimal"``, the default): the run's own root, holding the system's
  programs and shared libraries (:data:`SYSTEM_PATHS`) and the interpreter's own files (its executable, standard
  library, packages and shared library; :func:`exposed_paths`) **read-only**, a private ``/tmp`` (below), a
  ``/dev`` of ``null``, ``zero``, ``full``, ``random``, ``urandom`` and a ``/proc`` of the run; nothing else of
  the host: no run folder, data file, home folder or checkout (``pivot_root`` in the run's mount namespace, the
  host's root detached). Where no mount namespace can be made (no root, no unprivileged user namespaces, no
  bubblewrap), code execution is **refused** with the reason (one warning per process), unless the weaker
  ``filesystem="host"`` is chosen (:func:`set_default_filesystem`; the app's ``sandbox_filesystem``, which the
  run's plan line names): the host's file system, as far as the run's uid may read it;
  ``SandboxResult.extra["filesystem"]`` says which applied;
* **bubblewrap** where it is installed and works (``isolation="auto"``, the default; ``"bwrap"`` requires it,
  ``"builtin"`` never uses it): the run starts inside ``bwrap`` with every namespace new, on the same minimal root
  (or, with ``filesystem="host"``, the host read-only with the home folder hidden), a private ``/tmp``, ``/dev``
  and ``/proc``, the scratch folder the one writable place; the measures below apply inside it as well.
  ``SandboxResult.isolation`` says ``"bwrap"`` or ``"builtin"`` (Debian: ``apt-get install bubblewrap``);
* a fresh ``python -I`` (isolated mode) in its own session, with a **minimal environment** (``PATH``, ``LANG``,
  ``HOME`` and ``TMPDIR`` = the scratch folder, one thread for BLAS/OpenMP) and the scratch folder (0700) as its
  working directory;
* **channels the parent opened**: stdin, stdout, stderr, the payload and the judge's reports are unnamed temporary
  files the parent reads back through its own file objects, never by path (a FIFO or symlink planted in scratch
  neither hangs the parent nor makes it read another file);
* **namespaces**, when the process may create them (root, or unprivileged user namespaces): new PID, IPC, mount
  and (``network_namespace``) network namespaces. No interface is up, so even raw ``ctypes`` sockets reach
  nothing. When the judge (PID 1) ends, or the parent kills it at the timeout, the kernel kills **every process
  the program started**, ``setsid()`` daemons included;
* **a private, size-limited /tmp**: in the run's mount namespace one tmpfs of ``disk_mb`` is mounted at ``/tmp``
  and holds the scratch folder, ``/dev/shm`` and ``/var/tmp``; everything the program can write lives in it and
  goes with the namespace (``extra["mounts"]``). The host's scratch folder stays empty;
* **limits per run as a whole**: where cgroup v2 has the ``memory`` and ``pids`` controllers and may be written,
  a cgroup per run (:mod:`grpo_kit.tasks.sandbox_cgroup`: ``memory.max`` = ``memory_mb``, no swap, ``pids.max``
  = ``max_processes``; ``extra["cgroup"]``). Otherwise ``RLIMIT_NPROC`` = ``max_processes`` (exact for a run's own
  uid and in a new user namespace) and ``RLIMIT_AS`` per process = ``memory_mb`` (one process: no forks without
  ``allow_subprocess``) or ``memory_mb / max_processes`` (with it), so the sum stays under the run's limit; the
  memory the address space does not count is refused by the seccomp filter (below) or bounded: the run holds at
  most ``memory_mb`` plus :func:`memory_allowance_mb` (its tmpfs ``/tmp`` and the buffers of ``MAX_OPEN_FILES``
  descriptors per process). Always: CPU time (``RLIMIT_CPU``, ``SIGXCPU``), largest file written
  (``RLIMIT_FSIZE``, stdout/stderr included), open descriptors (``RLIMIT_NOFILE``), no core dumps, and the
  parent's wall-clock timeout;
* a **seccomp filter** (x86_64 and aarch64), which no code in the process can lift: no ``AF_UNIX`` socket (the
  host's path-named sockets; ``socketpair()`` still works), no socket at all without a network namespace, no
  ``io_uring``, ``ptrace`` or ``process_vm_*``, no foreign-ABI calls, ``no_new_privs``; no memory outside the
  address space (``memfd_create``, SysV shared memory, message queues and semaphores, POSIX message queues,
  ``bpf``, ``perf_event_open``, ``userfaultfd``, keys); no new namespace, mount or root (``unshare``, ``setns``,
  a ``clone`` with a ``CLONE_NEW*`` flag, ``mount`` and the new mount API, ``pivot_root``, ``chroot``); without
  ``allow_subprocess`` no new process (``fork``, ``vfork``, ``exec*``, a ``clone`` that is not a thread).
  ``SandboxResult.network`` says what applied: ``"namespace+seccomp+audit"`` on a usual Linux;
* a Python **audit hook** (PEP 578) that words these refusals (``PermissionError: network access is disabled``,
  ``starting processes is disabled``); it enforces nothing the kernel does not, so there is no flag to flip;
* **privileges**: when the parent runs as root, each run gets an unprivileged uid/gid of its own
  (``SANDBOX_ID_BASE`` + a slot), distinct among concurrent runs, owning its scratch folder. This needs an
  interpreter such a uid can start: this one, or else the system's ``python3`` (standard library only), probed
  once each. When there is none, ``run_python`` **refuses** (reason ``refused: running as root ...``, one warning
  per process) unless ``SandboxLimits(allow_root=True)``;
* **cleanup that never raises** (:mod:`grpo_kit.tasks.sandbox_cleanup`): the scratch folder is removed
  iteratively (any depth, unreadable entries, mount points detached); a failure is logged and counted.

What is **not** guaranteed: this is a guard against accidents and reward hacking in model output, not a security
boundary against code written to escape the kernel. Names the tests take from the program other than builtins,
modules and value-module attributes are the program's (tests should import the helpers they use). In the weaker
``filesystem="host"`` mode the host's files are readable as far as the run's uid may read them. Without
namespaces (only with ``filesystem="host"``: no root and no unprivileged user namespaces): a ``setsid()``
grandchild escapes the process-group kill, files outside the scratch folder are writable as far as "other"
permissions allow (``/tmp`` included, and what is written there outlives the call), and, when the program also
runs under the trainer's own uid (no root, or ``allow_root=True``), it can signal the trainer and read its memory
through ``/proc``, so neither the verdict nor the limits hold against it. As root without an own uid
(``allow_root=True``) ``RLIMIT_NPROC`` does not apply. Without the seccomp filter (another architecture) the
process block is the audit hook only, and memory outside the address space is not refused. Run training inside a
container or VM if you execute hostile code.
"""

from __future__ import annotations

import itertools
import json
import logging
import math
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from grpo_kit.readers.bounded import parse_json
from grpo_kit.tasks.sandbox_cgroup import make_run_cgroup, remove_run_cgroup
from grpo_kit.tasks.sandbox_cleanup import remove_tree

logger = logging.getLogger("grpo_kit.tasks.sandbox")

# The harness (judge) and the program's interpreter, files of their own so that they read (and lint) as Python.
_BOOTSTRAP = (Path(__file__).resolve().parent / "sandbox_child.py").read_text(encoding="utf-8")
_PROGRAM = (Path(__file__).resolve().parent / "sandbox_program.py").read_text(encoding="utf-8")


@dataclass
class SandboxLimits:
    """Limits for one sandboxed run (see the module docstring for what each one does)."""

    timeout_s: float = 5.0  # wall clock; the process group is killed after it
    cpu_s: int | None = None  # CPU seconds (RLIMIT_CPU); None: ceil(timeout_s)
    memory_mb: int | None = 512  # address space (RLIMIT_AS); None: no limit
    max_output_bytes: int = 1 << 20  # largest file the program may write (stdout/stderr included)
    network_namespace: bool = True  # try an empty network namespace (the audit hook applies anyway)
    allow_subprocess: bool = False
    drop_privileges: bool = True  # as root: run the code under an unprivileged uid of its own
    python: str | None = None  # interpreter; None: this one, or as root the system's python3 (see below)
    # As root where the code cannot run as nobody: refuse (score 0, one warning) unless this is True.
    allow_root: bool = False
    isolation: str = "auto"  # "bwrap": bubblewrap around the run (required); "builtin": never; "auto": where it works
    max_processes: int = 8  # processes and threads of the run as a whole (cgroup pids.max, else RLIMIT_NPROC)
    disk_mb: int = 64  # all the run may write: its private /tmp (scratch, /dev/shm, /var/tmp inside) is this big
    # "minimal": a root of the interpreter, its libraries and packages (read-only) and a private /tmp; refused where
    # it cannot be built. "host": the host's file system, as far as the run's uid may read it (weaker). None: the
    # process's setting (set_default_filesystem; the app's sandbox_filesystem), "minimal" unless changed.
    filesystem: str | None = None

    def __post_init__(self):
        if not (isinstance(self.timeout_s, (int, float)) and math.isfinite(self.timeout_s) and self.timeout_s > 0):
            raise ValueError(f"timeout_s={self.timeout_s!r} must be a positive number of seconds")
        if self.cpu_s is not None and (not isinstance(self.cpu_s, int) or self.cpu_s < 1):
            raise ValueError(f"cpu_s={self.cpu_s!r} must be a whole number of seconds >= 1, or None")
        if self.memory_mb is not None and (not isinstance(self.memory_mb, int) or self.memory_mb < 32):
            raise ValueError(f"memory_mb={self.memory_mb!r} must be an int >= 32 (MiB), or None")
        if not isinstance(self.max_output_bytes, int) or self.max_output_bytes < 1024:
            raise ValueError(f"max_output_bytes={self.max_output_bytes!r} must be an int >= 1024")
        if not isinstance(self.max_processes, int) or not 1 <= self.max_processes <= 4096:
            raise ValueError(f"max_processes={self.max_processes!r} must be an int from 1 to 4096")
        if not isinstance(self.disk_mb, int) or not 1 <= self.disk_mb <= 1 << 20:
            raise ValueError(f"disk_mb={self.disk_mb!r} must be an int from 1 to 1048576 (MiB)")
        if self.isolation not in ISOLATIONS:
            raise ValueError(f"isolation={self.isolation!r} is not allowed; choose one of {list(ISOLATIONS)}")
        if self.filesystem is not None and self.filesystem not in FILESYSTEMS:
            raise ValueError(
                f"filesystem={self.filesystem!r} is not allowed; choose one of {list(FILESYSTEMS)} "
                "or None (the process's setting)"
            )


@dataclass
class SandboxResult:
    """What one run did. ``ok``: exited with status 0 within the limits."""

    ok: bool
    reason: str  # "ok", "timeout after 5.0 s", "CPU time limit", "memory limit", "crashed: SIGSEGV", ...
    returncode: int | None
    stdout: str = ""
    stderr: str = ""
    duration_s: float = 0.0
    network: str = ""  # what applied: "namespace+seccomp+audit", "namespace+audit", "seccomp+audit" or "audit"
    extra: dict = field(default_factory=dict)
    tests_completed: bool = False  # the harness ran every test to its end (run_python's ``tests``)
    isolation: str = ""  # "bwrap" (bubblewrap around the run) or "builtin"


def _tail(text: str, n: int = 300) -> str:
    text = text.strip()
    return text if len(text) <= n else "..." + text[-n:]


def _reason(rc: int | None, stderr: str, timed_out: bool, timeout_s: float) -> str:
    if timed_out:
        return f"timeout after {timeout_s:g} s (wall clock)"
    if rc == 0:
        return "ok"
    if rc is not None and rc < 0:
        sig = -rc
        if sig == signal.SIGXCPU:
            return "CPU time limit"
        name = signal.Signals(sig).name if sig in signal.Signals._value2member_map_ else str(sig)
        if sig == signal.SIGKILL:
            return "killed (SIGKILL: CPU hard limit or out of memory)"
        return f"crashed: {name}"
    last = stderr.strip().splitlines()[-1] if stderr.strip() else ""
    if "MemoryError" in last or "MemoryError" in stderr[-2000:]:
        return "memory limit (MemoryError)"
    if "network access is disabled" in stderr[-2000:]:
        return "network access refused (PermissionError)"
    return f"exit code {rc}" + (f": {_tail(last, 200)}" if last else "")


def _read(fh, limit: int) -> str:
    """What the child wrote into a file the parent opened (never reopened by path: no FIFO or symlink tricks)."""
    fh.seek(0)
    return fh.read(limit).decode("utf-8", errors="replace")


def _reports(fh, secret: str) -> dict:
    """The harness's ``[key, value, secret]`` lines: net mode, PID-namespace init, exit status, tests completed.
    Lines without the run's secret are the program's and ignored; the exit status is the last one written."""
    out = {}
    for line in _read(fh, 1 << 16).splitlines():
        try:
            key, value, tag = parse_json(line, "a report line")
        except (ValueError, TypeError):
            continue
        if tag == secret and (key == "status" or key not in out):
            out[key] = value
    return out


def _parent_pid(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            return int(fh.read().rsplit(b")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return None


_ROOT_WARNED = False


def _refuse_as_root() -> SandboxResult:
    global _ROOT_WARNED
    reason = (
        "refused: running as root and the code cannot run as an unprivileged user (no interpreter it may "
        f"start: {sys.executable}, {', '.join(_SYSTEM_PYTHONS)}); set SandboxLimits(allow_root=True) to run "
        "model code as root anyway"
    )
    if not _ROOT_WARNED:
        logger.warning("grpo_kit.tasks.sandbox %s", reason)
        _ROOT_WARNED = True
    return SandboxResult(ok=False, reason=reason, returncode=None)


def run_python(
    code: str, *, stdin: str = "", limits: SandboxLimits | None = None, tests: str | None = None
) -> SandboxResult:
    """Run ``code`` (a Python program) in a sandboxed subprocess; never raises for what the code does.

    ``stdin`` is fed to the program; stdout and stderr come back (up to ``max_output_bytes``).
    ``tests``: Python run by the judge after the program (see the module docstring); ``tests_completed`` is True
    only when the judge ran the last of them to its end.
    """
    if not isinstance(code, str):
        raise ValueError(f"code must be a str, got {type(code).__name__}")
    lim = limits or SandboxLimits()
    t0 = time.perf_counter()
    try:
        return _run_checked(code, stdin, lim, tests)
    except Exception as e:  # a fault of the sandbox itself: a 0 with a reason, never an exception into training
        logger.warning("grpo_kit.tasks.sandbox: the sandbox failed: %s: %s", type(e).__name__, e)
        return SandboxResult(
            ok=False,
            reason=f"sandbox error: {type(e).__name__}: {e}",
            returncode=None,
            duration_s=time.perf_counter() - t0,
        )


def _run_checked(code: str, stdin: str, lim: SandboxLimits, tests: str | None) -> SandboxResult:
    python, drop = _interpreter(lim)
    if os.geteuid() == 0 and not drop and not lim.allow_root:
        return _refuse_as_root()
    uid = _take_id() if drop else None
    try:
        bwrap = _bwrap(lim, uid, python)
        if lim.isolation == "bwrap" and bwrap is None:
            return SandboxResult(
                ok=False,
                reason="refused: isolation='bwrap' but bubblewrap (bwrap) is not installed "
                "or cannot create namespaces here (Debian: apt-get install bubblewrap)",
                returncode=None,
            )
        fs = lim.filesystem or _DEFAULT_FILESYSTEM[0]
        if fs == "minimal" and _MINIMAL_OK.get(bwrap is not None) is False:
            return _refuse_filesystem(_MINIMAL_WHY.get(bwrap is not None, "it failed before"))
        cgroup = make_run_cgroup(lim)
        scratch = tempfile.mkdtemp(prefix="grpo_kit_sandbox_")
        try:
            result = _run_in(scratch, code, stdin, tests, lim, python, uid, bwrap, cgroup)
        finally:
            _clean_up(scratch, cgroup)
        if fs == "minimal" and result.extra.get("filesystem") == "minimal":
            _MINIMAL_OK[bwrap is not None] = True
        elif fs == "minimal" and result.reason.startswith("refused: "):  # the judge could not build it: from now
            _MINIMAL_OK[bwrap is not None] = False  # on refused before anything starts
            _MINIMAL_WHY[bwrap is not None] = result.reason.removeprefix("refused: ")
            return _refuse_filesystem(_MINIMAL_WHY[bwrap is not None])
        return result
    finally:
        if uid is not None:
            _give_id(uid)


# The file systems a run can see (SandboxLimits.filesystem); the process's setting for limits that name none.
FILESYSTEMS = ("minimal", "host")
_DEFAULT_FILESYSTEM = ["minimal"]
_MINIMAL_OK: dict[bool, bool] = {}  # with bubblewrap or not: whether the minimal file system was built
_MINIMAL_WHY: dict[bool, str] = {}
_FS_WARNED = False


def set_default_filesystem(filesystem: str) -> None:
    """The file system of runs whose limits name none (``SandboxLimits.filesystem=None``): the app sets it from
    its ``sandbox_filesystem``; ``"host"`` is the weaker mode (the run's plan line names it)."""
    if filesystem not in FILESYSTEMS:
        raise ValueError(f"filesystem={filesystem!r} is not allowed; choose one of {list(FILESYSTEMS)}")
    _DEFAULT_FILESYSTEM[0] = filesystem


def default_filesystem() -> str:
    """The file system of runs whose limits name none."""
    return _DEFAULT_FILESYSTEM[0]


def _refuse_filesystem(why: str) -> SandboxResult:
    global _FS_WARNED
    reason = (
        f"refused: {why}; without the minimal file system the program could read the host's files (run "
        "folders, data files, the home folder). Set SandboxLimits(filesystem='host') (train: "
        "sandbox_filesystem: host) to run it with the host's file system visible"
    )
    if not _FS_WARNED:
        logger.warning("grpo_kit.tasks.sandbox %s", reason)
        _FS_WARNED = True
    return SandboxResult(ok=False, reason=reason, returncode=None, extra={"filesystem": None})


def _clean_up(scratch: str, cgroup: str | None) -> None:
    """Remove the run's scratch folder and cgroup; what fails is logged and counted, never raised (the result of
    the run stands)."""
    try:
        failed = remove_tree(scratch) + (remove_run_cgroup(cgroup) if cgroup is not None else 0)
    except Exception as e:  # remove_tree never raises; this guards the run's result all the same
        failed = 1
        logger.warning("grpo_kit.tasks.sandbox: cleanup failed: %s: %s", type(e).__name__, e)
    if failed:
        logger.warning("grpo_kit.tasks.sandbox: %d entries of a run were left behind", failed)


def _child_config(
    lim: SandboxLimits,
    uid: int | None,
    scratch: str,
    cgroup: str | None,
    payload,
    report,
    python: str,
    bwrap: str | None,
) -> dict:
    """What the harness (sandbox_child.py) needs: limits per process, sized so that the run as a whole stays
    within ``memory_mb`` and ``max_processes`` (a cgroup, where there is one, holds the sum by itself), and the
    file system to build (the host paths it shows; bubblewrap, where it runs, has built it already)."""
    mem = None if lim.memory_mb is None else lim.memory_mb * 2**20
    if mem is not None and lim.allow_subprocess and cgroup is None:
        mem = max(mem // lim.max_processes, 32 * 2**20)  # RLIMIT_AS is per process: the sum stays under the limit
    fs = lim.filesystem or _DEFAULT_FILESYSTEM[0]
    paths, links = exposed_paths(python) if fs == "minimal" and bwrap is None else ([], [])
    return dict(
        cpu=int(lim.cpu_s or max(1, math.ceil(lim.timeout_s))),
        mem=mem,
        nproc=lim.max_processes,
        fsize=lim.max_output_bytes,
        netns=lim.network_namespace,
        subprocess=lim.allow_subprocess,
        uid=uid,
        payload_fd=payload.fileno(),
        report_fd=report.fileno(),
        scratch=scratch,
        disk_mb=lim.disk_mb,
        cgroup=cgroup,
        nofile=MAX_OPEN_FILES,
        max_value=MAX_VALUE_BYTES,
        filesystem=fs,
        root_ready=fs == "minimal" and bwrap is not None,
        paths=paths,
        links=links,
    )


# Descriptors per process of the program: pipes and socket pairs hold kernel memory outside its address space,
# about a MiB each at most (a pipe grown to pipe-max-size; a socket's buffers are smaller), so this bounds it.
MAX_OPEN_FILES = 64
# The largest value (as JSON) the program may hand the judge in one answer; past it, the judge's error.
MAX_VALUE_BYTES = 16 << 20


def memory_allowance_mb(lim: SandboxLimits) -> int:
    """MiB a run may hold beyond ``memory_mb`` without a cgroup v2 to count it: its private /tmp (``disk_mb``,
    a tmpfs, so memory) and the kernel buffers of its descriptors (``MAX_OPEN_FILES`` per process, about a MiB
    each). memfd, SysV and POSIX shared memory and queues, BPF maps, perf buffers and new namespaces (a user
    namespace's own tmpfs) are refused by the seccomp filter; every other page is in the address space limit."""
    processes = lim.max_processes if lim.allow_subprocess else 1
    return lim.disk_mb + MAX_OPEN_FILES * processes


def _start_child(scratch, cfg, python, uid, bwrap, **files) -> subprocess.Popen:
    """The judge's process in ``scratch``: the bootstrap with its config, inside bubblewrap where given; a clean
    environment, one thread per math library, its own session (so the whole tree can be killed). ``files``: the
    standard streams and the payload and report descriptors (``pass_fds``)."""
    env = {
        "PATH": "/usr/local/bin:/usr/bin:/bin",
        "LANG": "C.UTF-8",
        "HOME": scratch,
        "TMPDIR": scratch,
        "OMP_NUM_THREADS": "1",
        "OPENBLAS_NUM_THREADS": "1",
        "MKL_NUM_THREADS": "1",
        "PYTHONIOENCODING": "utf-8",
    }
    argv = [python, "-I", "-c", _BOOTSTRAP, json.dumps(cfg)]
    as_user = {}
    if bwrap:  # bubblewrap starts as the run's uid (dropped by Popen, in C), so the bootstrap has none to drop
        argv = _bwrap_argv(bwrap, scratch, python, cfg["filesystem"]) + argv
        if uid is not None:
            argv[-1] = json.dumps({**cfg, "uid": None})
            as_user = dict(user=uid, group=uid, extra_groups=[])
    return subprocess.Popen(argv, cwd=scratch, env=env, start_new_session=True, close_fds=True, **files, **as_user)


def _result(
    got: dict, rc, stdout: str, stderr: str, *, timed_out: bool, lim, t0: float, bwrap, cgroup
) -> SandboxResult:
    """The run's :class:`SandboxResult` from the judge's report ``got`` and the process's exit code ``rc``."""
    if isinstance(got.get("status"), int):  # the judge's report: the program's own status
        rc = os.waitstatus_to_exitcode(got["status"])
    reason = _reason(rc, stderr, timed_out, lim.timeout_s)
    if isinstance(got.get("judge_error"), str) and not timed_out:
        reason = f"judge error: {got['judge_error']}"
    filesystem = got.get("filesystem") if got.get("filesystem") in FILESYSTEMS else None
    return SandboxResult(
        ok=(rc == 0 and not timed_out),
        reason=reason,
        returncode=rc,
        stdout=stdout,
        stderr=stderr,
        duration_s=time.perf_counter() - t0,
        network=str(got.get("net", "")),
        tests_completed=got.get("tests_completed") is True,
        isolation="bwrap" if bwrap else "builtin",
        extra={"mounts": got.get("mounts") is True, "cgroup": cgroup is not None, "filesystem": filesystem},
    )


def _run_in(scratch, code, stdin, tests, lim, python, uid, bwrap, cgroup) -> SandboxResult:
    t0 = time.perf_counter()
    timed_out = False
    proc = None
    secret = secrets.token_hex(16)
    # Every channel is a file the parent opened and keeps: no name in the scratch folder to swap.
    out, err, inp, payload, report = (tempfile.TemporaryFile() for _ in range(5))
    try:
        if uid is not None:
            os.chown(scratch, uid, uid)
        os.chmod(scratch, 0o700)
        inp.write(stdin.encode("utf-8", "surrogatepass"))
        payload.write(
            json.dumps({"code": code, "tests": tests, "secret": secret, "program": _PROGRAM}).encode(
                "utf-8", "surrogatepass"
            )
        )
        payload_bytes = payload.tell()
        for fh in (inp, payload):
            fh.flush()
            fh.seek(0)
        cfg = {
            **_child_config(lim, uid, scratch, cgroup, payload, report, python, bwrap),
            "payload_bytes": payload_bytes,
        }
        proc = _start_child(
            scratch,
            cfg,
            python,
            uid,
            bwrap,
            stdin=inp,
            stdout=out,
            stderr=err,
            pass_fds=(payload.fileno(), report.fileno()),
        )
        try:
            proc.wait(timeout=lim.timeout_s)
        except subprocess.TimeoutExpired:
            timed_out = True
        _kill_all(proc, report, secret)
        got = _reports(report, secret)
        if isinstance(got.get("refused"), str):  # the judge ran nothing: the file system asked for is impossible
            return SandboxResult(
                ok=False,
                reason=f"refused: {got['refused'][:500]}",
                returncode=None,
                duration_s=time.perf_counter() - t0,
                extra={"filesystem": None},
            )
        return _result(
            got,
            proc.returncode,
            _read(out, lim.max_output_bytes),
            _read(err, lim.max_output_bytes),
            timed_out=timed_out,
            lim=lim,
            t0=t0,
            bwrap=bwrap,
            cgroup=cgroup,
        )
    except OSError as e:  # could not start the child (fork limit, disk full): a 0 with a reason
        return SandboxResult(
            ok=False,
            reason=f"sandbox could not run the code: {e}",
            returncode=None,
            duration_s=time.perf_counter() - t0,
        )
    finally:
        if proc is not None:
            _kill_all(proc, report, secret)
        for fh in (out, err, inp, payload, report):
            fh.close()


# Unprivileged ids for code that root runs: one per concurrent run, owned by no account, so one run's processes
# can neither signal another's nor enter its scratch folder (mode 0700). Spread by PID across trainer processes.
SANDBOX_ID_BASE = 2_000_000_000
_SYSTEM_PYTHONS = ("/usr/bin/python3", "/usr/local/bin/python3")
_ids_lock = threading.Lock()
_ids_in_use: set[int] = set()
_RUNNABLE: dict[str, bool] = {}


def _take_id() -> int:
    with _ids_lock:
        base = SANDBOX_ID_BASE + (os.getpid() % 100_000) * 256
        uid = next(base + i for i in itertools.count() if base + i not in _ids_in_use)
        _ids_in_use.add(uid)
        return uid


def _give_id(uid: int) -> None:
    with _ids_lock:
        _ids_in_use.discard(uid)


def _unprivileged_can_run(python: str) -> bool:
    """Whether an unprivileged uid can start ``python`` and import what the bootstrap needs (probed once each)."""
    if python not in _RUNNABLE:
        code = (
            f"import os; os.setgroups([]); os.setgid({SANDBOX_ID_BASE - 1}); os.setuid({SANDBOX_ID_BASE - 1}); "
            "import json, socket, ast, ctypes, resource"
        )
        try:
            _RUNNABLE[python] = (
                subprocess.run(
                    [python, "-I", "-c", code], cwd="/", env={"PATH": "/usr/bin:/bin"}, capture_output=True, timeout=30
                ).returncode
                == 0
            )
        except (OSError, subprocess.SubprocessError):
            _RUNNABLE[python] = False
    return _RUNNABLE[python]


ISOLATIONS = ("auto", "bwrap", "builtin")
_BWRAP_OK: dict[bool, bool] = {}
# What of the host the program sees in the minimal file system, read-only, where it exists: the system's programs
# and shared libraries, what the dynamic loader and the C library read, the time zones. The interpreter's own files
# (its executable, standard library, packages and shared library) are added by exposed_paths.
SYSTEM_PATHS = (
    "/usr/bin",
    "/usr/lib",
    "/usr/lib32",
    "/usr/lib64",
    "/usr/libexec",
    "/usr/local/bin",
    "/usr/local/lib",
    "/usr/share/zoneinfo",
    "/bin",
    "/lib",
    "/lib32",
    "/lib64",
    "/libx32",
    "/etc/ld.so.cache",
    "/etc/ld.so.conf",
    "/etc/ld.so.conf.d",
    "/etc/localtime",
    "/etc/passwd",
    "/etc/group",
    "/etc/nsswitch.conf",
)
_EXPOSED: dict[str, tuple[list[str], list[list[str]]]] = {}
_INTERPRETER_PATHS = (
    "import json, sys, sysconfig; print(json.dumps([sys.executable, sysconfig.get_config_var('LIBDIR'), *sys.path]))"
)


def exposed_paths(python: str) -> tuple[list[str], list[list[str]]]:
    """(host paths, [symlink, target] pairs) the minimal file system shows for runs of ``python``: SYSTEM_PATHS
    and the interpreter's own files, each resolved (the symlinks on the way recreated), none inside another.
    Probed once per interpreter; nothing of the home folder, the checkout or the run folders unless the
    interpreter lives there, and then only its own files."""
    if python not in _EXPOSED:
        try:
            out = subprocess.run(
                [python, "-I", "-c", _INTERPRETER_PATHS],
                capture_output=True,
                timeout=30,
                cwd="/",
                env={"PATH": "/usr/bin:/bin"},
            ).stdout
            own = [p for p in parse_json(out, f"{python}'s paths") if isinstance(p, str)]
        except (OSError, ValueError, subprocess.SubprocessError):  # its own files then come from SYSTEM_PATHS only
            own = [python]
        links: dict[str, str] = {}
        wanted = [p for p in (*SYSTEM_PATHS, python, *own) if os.path.isabs(p) and os.path.lexists(p)]
        for p in wanted:
            _record_links(p, links, 0)
        real = sorted({os.path.realpath(p) for p in wanted if os.path.exists(p)})
        paths = [p for p in real if not any(p.startswith(q + os.sep) for q in real if q != "/")]
        links_out = [[k, v] for k, v in sorted(links.items()) if not any(k.startswith(q + os.sep) for q in paths)]
        _EXPOSED[python] = (paths, links_out)
    return _EXPOSED[python]


def _record_links(path: str, links: dict, depth: int) -> None:
    """Each symlink on the way to ``path`` (and on the way to where it leads) into ``links``."""
    cur = "/"
    for part in Path(path).parts[1:]:
        nxt = os.path.join(cur, part)
        if os.path.islink(nxt) and nxt not in links and depth < 40:
            links[nxt] = os.readlink(nxt)
            _record_links(os.path.normpath(os.path.join(os.path.dirname(nxt), links[nxt])), links, depth + 1)
        cur = os.path.realpath(nxt)


def _bwrap_argv(bwrap: str, scratch: str, python: str, filesystem: str) -> list[str]:
    """bubblewrap: every namespace new, a private /tmp, /dev and /proc, the scratch folder the one writable place;
    ``filesystem="minimal"``: on a new root of exposed_paths (read-only) and nothing else, ``"host"``: the host
    read-only with the home folder hidden (unless this interpreter lives there)."""
    argv = [bwrap, "--unshare-all", "--die-with-parent", "--new-session"]
    if filesystem == "minimal":
        paths, links = exposed_paths(python)
        for p in paths:
            argv += ["--ro-bind", p, p]
        for link, target in links:
            argv += ["--symlink", target, link]
        argv += ["--dev", "/dev", "--proc", "/proc", "--tmpfs", "/tmp", "--remount-ro", "/"]
        return argv + ["--bind", scratch, scratch, "--chdir", scratch, "--"]
    argv += ["--ro-bind", "/", "/", "--dev", "/dev", "--proc", "/proc", "--tmpfs", "/tmp"]
    home = os.path.realpath(os.path.expanduser("~"))
    keep = [os.path.realpath(p) for p in (sys.prefix, sys.base_prefix, os.path.dirname(sys.executable))]
    if (
        home not in ("/", "")
        and os.path.isdir(home)
        and not any(k == home or k.startswith(home + os.sep) for k in keep)
    ):
        argv += ["--tmpfs", home]
    return argv + ["--bind", scratch, scratch, "--chdir", scratch, "--"]


def _bwrap(lim: SandboxLimits, uid: int | None, python: str) -> str | None:
    """The bwrap to wrap the run in, or None (isolation='builtin', not installed, or it fails here; probed once)."""
    path = shutil.which("bwrap") if lim.isolation != "builtin" else None
    if path is None:
        return None
    key = uid is not None
    if key not in _BWRAP_OK:
        as_user = dict(user=SANDBOX_ID_BASE - 1, group=SANDBOX_ID_BASE - 1, extra_groups=[]) if key else {}
        scratch = tempfile.mkdtemp(prefix="grpo_kit_sandbox_probe_")
        try:
            os.chmod(scratch, 0o777)
            _BWRAP_OK[key] = (
                subprocess.run(
                    _bwrap_argv(path, scratch, python, "minimal") + [python, "-I", "-c", ""],
                    capture_output=True,
                    timeout=30,
                    **as_user,
                ).returncode
                == 0
            )
        except (OSError, subprocess.SubprocessError):
            _BWRAP_OK[key] = False
        finally:
            remove_tree(scratch)
    return path if _BWRAP_OK[key] else None


def _interpreter(lim: SandboxLimits) -> tuple[str, bool]:
    """(the interpreter to start, whether the code runs under its own unprivileged uid).

    As root: ``lim.python``, else this interpreter, else the system's ``python3`` (its standard library only),
    the first one an unprivileged uid can run (pyenv under ``/root`` cannot be)."""
    if os.geteuid() != 0 or not lim.drop_privileges:
        return lim.python or sys.executable, False
    for python in [lim.python] if lim.python else [sys.executable, *_SYSTEM_PYTHONS]:
        if os.path.isfile(python) and _unprivileged_can_run(python):
            return python, True
    return lim.python or sys.executable, False


def _kill_all(proc: subprocess.Popen, report, secret: str) -> None:
    """SIGKILL the child's PID-namespace init (whose end kills every process left in the namespace, setsid()
    daemons included) and the child's process group, then reap the child."""
    init = _reports(report, secret).get("init_pid")
    if not (isinstance(init, int) and init > 1 and _parent_pid(init) == proc.pid):
        init = None  # gone already, or not the child's own
    for kill, target in ((os.kill, init), (os.killpg, proc.pid)):
        if target is not None:
            try:
                kill(target, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
    try:
        proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        pass


def default_workers() -> int:
    return max(1, min(8, os.cpu_count() or 1))


def run_many(
    codes, *, stdins=None, tests=None, limits: SandboxLimits | None = None, max_workers: int | None = None
) -> list[SandboxResult]:
    """Run many programs, ``max_workers`` at a time (default: the CPU count, at most 8).

    ``stdins``, ``tests``: one per program (see :func:`run_python`), or None. Wall time is bounded by
    about ``ceil(len(codes) / max_workers) * timeout_s`` plus start-up costs, whatever the programs do.
    """
    codes = list(codes)
    stdins = [""] * len(codes) if stdins is None else list(stdins)
    tests = [None] * len(codes) if tests is None else list(tests)
    if not len(stdins) == len(tests) == len(codes):
        raise ValueError(f"{len(codes)} programs but {len(stdins)} stdin strings and {len(tests)} tests")
    if not codes:
        return []
    workers = max(1, min(len(codes), max_workers or default_workers()))
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="grpo_kit_sandbox") as pool:
        return list(
            pool.map(
                lambda job: run_python(job[0], stdin=job[1], tests=job[2], limits=limits), zip(codes, stdins, tests)
            )
        )
