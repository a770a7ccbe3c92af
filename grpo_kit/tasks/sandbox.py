"""Run untrusted, model-generated Python in a subprocess with limits; a code-verifier reward.

``run_python(code)`` runs one program; ``run_many(codes)`` runs many in parallel (a bounded
thread pool, one subprocess each); :func:`grpo_kit.tasks.code_reward.make_python_code_reward` builds a TRL reward function
``fn(prompts, completions, **columns)`` that extracts a ```` ```python ```` block from each
completion, runs it sandboxed, and scores 1.0 (tests pass / output right) or 0.0. A hang, a
crash, a memory bomb or a network attempt scores 0 for that sample with a logged reason (logger
``grpo_kit.tasks.sandbox``) and never stalls training: the wall-clock timeout kills what the child started.

What each run gets (applied by a small bootstrap in the child before the user code runs):

* **bubblewrap** where it is installed and works (``isolation="auto"``, the default; ``"bwrap"``
  requires it, ``"builtin"`` never uses it): the run starts inside ``bwrap`` with every namespace
  new, the host file system **read-only**, a private ``/tmp``, ``/dev`` and ``/proc``, the home
  folder hidden (unless the interpreter lives there) and the scratch folder the one writable place;
  the measures below apply inside it as well. ``SandboxResult.isolation`` says ``"bwrap"`` or
  ``"builtin"`` (Debian: ``apt-get install bubblewrap``; the kit does not install it);
* a fresh ``python -I`` (isolated mode: no user site, ``PYTHON*`` variables ignored) in its own
  session / process group, with a **minimal environment** (``PATH``, ``LANG``, ``HOME`` and
  ``TMPDIR`` = the scratch folder, one thread for BLAS/OpenMP) and a **scratch temporary folder
  (mode 0700) as its working directory**, deleted afterwards;
* **channels the parent opened**: stdin, stdout, stderr, the program text and the harness's
  reports are unnamed temporary files the parent created and reads back through its own file
  objects. Nothing is read by path after the child ran, so a FIFO or a symlink planted in the
  scratch folder neither hangs the parent nor makes it read another file;
* **wall-clock timeout** (parent side), **CPU time** (``RLIMIT_CPU``, ``SIGXCPU``), **address
  space** (``RLIMIT_AS``: a memory bomb gets a ``MemoryError``), largest file written
  (``RLIMIT_FSIZE``, stdout/stderr included, so endless printing is cut off), no core dumps;
* **namespaces**, when the process may create them (root, or unprivileged user namespaces
  enabled): new, empty network, PID and IPC namespaces (``unshare``). No interface is up, so even
  raw ``ctypes`` sockets reach nothing, and abstract ``AF_UNIX`` sockets and SysV IPC of the host
  are out of reach. The program runs under an init process of the PID namespace; when the
  program ends, or the parent kills that init at the timeout, the kernel kills **every process
  the program started**, ``setsid()`` daemons and ``ctypes`` forks included, and the program's
  parent is not the trainer (``os.getppid()`` is 0);
* a **seccomp filter** (x86_64 and aarch64) refuses creating any ``AF_UNIX`` socket with ``EPERM``,
  so path-named sockets of the host (``/var/run/...``, ``/tmp/...``) cannot be connected to even
  through ``ctypes``; ``socketpair()`` still works. It also refuses ``io_uring`` and foreign-ABI
  system calls, and sets ``no_new_privs`` (no setuid binary gains privileges).
  ``SandboxResult.network`` says what applied: ``"namespace+seccomp+audit"`` on a usual Linux;
* always, a Python audit hook (PEP 578) refuses creating non-``AF_UNIX`` sockets, ``connect``,
  ``bind`` and DNS look-ups (``PermissionError``), and by default new processes (``subprocess``,
  ``os.system``, ``os.exec*``, ``os.fork``, ``os.posix_spawn``; ``allow_subprocess=True`` lifts
  this). Without namespaces this hook, the seccomp filter and the process-group kill are all there
  is (``network`` without ``namespace``);
* **privileges**: when the parent runs as root, each run gets an unprivileged uid/gid of its own
  (``SANDBOX_ID_BASE`` + a slot, no supplementary groups), distinct among concurrent runs, and its
  scratch folder (0700) belongs to it: one sample's processes can neither signal another's nor
  read or write its scratch folder. This needs an interpreter such a uid can start: this one, or
  else the system's ``python3`` (standard library only; pyenv under ``/root`` cannot be run by
  others), probed once each. When there is none, ``run_python`` **refuses** (``ok=False``, reason
  ``refused: running as root ...``, one warning per process) unless ``SandboxLimits(allow_root=True)``.

The verifier (:func:`grpo_kit.tasks.code_reward.make_python_code_reward`): in ``tests`` mode the tests run after the program,
in its namespace, and a sample counts only when the harness writes "tests completed" to its own
report file after the last test, tagged with a per-run secret that the parent checks; exiting
early (``os._exit``, ``sys.exit``, ``atexit``), printing a fake marker or faking the exit status
scores 0, and ``==``/``!=`` in the tests compare plain values, so an object with an always-true
``__eq__`` fails. In ``answer`` mode the final answer is the last non-empty line of stdout, which
must be exactly one number.

What is **not** guaranteed: this is a guard against accidents and reward hacking in model output,
not a security boundary against code written to escape. The audit hook and the tests harness live
in the program's own process: code that inspects the interpreter (``gc``, frames, ``ctypes``) can
switch the hook off or find the run's secret. Without the seccomp filter (another architecture)
path-named ``AF_UNIX`` sockets the program's uid may open can be connected to with ``ctypes``.
Without bubblewrap, files outside the scratch folder are readable and, as far as
file permissions allow ("other" permissions for the run's uid), writable; with it they are
readable where permissions allow, never writable. Without namespaces a ``setsid()``
grandchild escapes the process-group kill, and a program running under the trainer's own uid (no
root, or ``allow_root=True``) can signal the trainer.
Run training inside a container or VM if you execute hostile code.
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

logger = logging.getLogger("grpo_kit.tasks.sandbox")

# The child's program, a file of its own so that it reads (and lints) as Python.
_BOOTSTRAP = (Path(__file__).resolve().parent / "sandbox_child.py").read_text(encoding="utf-8")


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

    def __post_init__(self):
        if not (isinstance(self.timeout_s, (int, float)) and math.isfinite(self.timeout_s) and self.timeout_s > 0):
            raise ValueError(f"timeout_s={self.timeout_s!r} must be a positive number of seconds")
        if self.cpu_s is not None and (not isinstance(self.cpu_s, int) or self.cpu_s < 1):
            raise ValueError(f"cpu_s={self.cpu_s!r} must be a whole number of seconds >= 1, or None")
        if self.memory_mb is not None and (not isinstance(self.memory_mb, int) or self.memory_mb < 32):
            raise ValueError(f"memory_mb={self.memory_mb!r} must be an int >= 32 (MiB), or None")
        if not isinstance(self.max_output_bytes, int) or self.max_output_bytes < 1024:
            raise ValueError(f"max_output_bytes={self.max_output_bytes!r} must be an int >= 1024")
        if self.isolation not in ISOLATIONS:
            raise ValueError(f"isolation={self.isolation!r} is not allowed; choose one of {list(ISOLATIONS)}")


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
            key, value, tag = json.loads(line)
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
    reason = ("refused: running as root and the code cannot run as an unprivileged user (no interpreter it may "
              f"start: {sys.executable}, {', '.join(_SYSTEM_PYTHONS)}); set SandboxLimits(allow_root=True) to run "
              "model code as root anyway")
    if not _ROOT_WARNED:
        logger.warning("grpo_kit.tasks.sandbox %s", reason)
        _ROOT_WARNED = True
    return SandboxResult(ok=False, reason=reason, returncode=None)


def run_python(code: str, *, stdin: str = "", limits: SandboxLimits | None = None,
               tests: str | None = None) -> SandboxResult:
    """Run ``code`` (a Python program) in a sandboxed subprocess; never raises for what the code does.

    ``stdin`` is fed to the program; stdout and stderr come back (up to ``max_output_bytes``).
    ``tests``: Python run after the program, in its namespace (``==`` there is plain-value equality);
    ``tests_completed`` is True only when the harness saw the last of them finish.
    """
    if not isinstance(code, str):
        raise ValueError(f"code must be a str, got {type(code).__name__}")
    lim = limits or SandboxLimits()
    python, drop = _interpreter(lim)
    if os.geteuid() == 0 and not drop and not lim.allow_root:
        return _refuse_as_root()
    uid = _take_id() if drop else None
    bwrap = _bwrap(lim, uid)
    if lim.isolation == "bwrap" and bwrap is None:
        if uid is not None:
            _give_id(uid)
        return SandboxResult(ok=False, reason="refused: isolation='bwrap' but bubblewrap (bwrap) is not installed "
                             "or cannot create namespaces here (Debian: apt-get install bubblewrap)", returncode=None)
    scratch = tempfile.mkdtemp(prefix="grpo_kit_sandbox_")
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
        payload.write(json.dumps({"code": code, "tests": tests, "secret": secret}).encode("utf-8", "surrogatepass"))
        for fh in (inp, payload):
            fh.flush()
            fh.seek(0)
        cfg = dict(cpu=int(lim.cpu_s or max(1, math.ceil(lim.timeout_s))),
                   mem=None if lim.memory_mb is None else lim.memory_mb * 2**20,
                   fsize=lim.max_output_bytes, netns=lim.network_namespace, subprocess=lim.allow_subprocess,
                   uid=uid, payload_fd=payload.fileno(), report_fd=report.fileno())
        env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": scratch, "TMPDIR": scratch,
               "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
               "PYTHONIOENCODING": "utf-8"}
        argv = [python, "-I", "-c", _BOOTSTRAP, repr(cfg)]
        as_user = {}
        if bwrap:  # bubblewrap starts as the run's uid (dropped by Popen, in C), so the bootstrap has none to drop
            argv = _bwrap_argv(bwrap, scratch) + argv
            if uid is not None:
                cfg["uid"], argv[-1] = None, repr({**cfg, "uid": None})
                as_user = dict(user=uid, group=uid, extra_groups=[])
        proc = subprocess.Popen(argv, cwd=scratch, env=env, stdin=inp, stdout=out, stderr=err,
                                start_new_session=True, close_fds=True, pass_fds=(payload.fileno(), report.fileno()),
                                **as_user)
        try:
            proc.wait(timeout=lim.timeout_s)
        except subprocess.TimeoutExpired:
            timed_out = True
        _kill_all(proc, report, secret)
        got = _reports(report, secret)
        rc = proc.returncode
        if isinstance(got.get("status"), int):  # the program ran under a PID-namespace init: its own status
            rc = os.waitstatus_to_exitcode(got["status"])
        stdout, stderr = _read(out, lim.max_output_bytes), _read(err, lim.max_output_bytes)
        reason = _reason(rc, stderr, timed_out, lim.timeout_s)
        return SandboxResult(ok=(rc == 0 and not timed_out), reason=reason, returncode=rc, stdout=stdout,
                             stderr=stderr, duration_s=time.perf_counter() - t0, network=str(got.get("net", "")),
                             tests_completed=got.get("tests_completed") is True,
                             isolation="bwrap" if bwrap else "builtin")
    except OSError as e:  # could not start the child (fork limit, disk full): a 0 with a reason
        return SandboxResult(ok=False, reason=f"sandbox could not run the code: {e}", returncode=None,
                             duration_s=time.perf_counter() - t0)
    finally:
        if proc is not None:
            _kill_all(proc, report, secret)
        for fh in (out, err, inp, payload, report):
            fh.close()
        shutil.rmtree(scratch, ignore_errors=True)
        if uid is not None:
            _give_id(uid)


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
        code = (f"import os; os.setgroups([]); os.setgid({SANDBOX_ID_BASE - 1}); os.setuid({SANDBOX_ID_BASE - 1}); "
                "import json, socket, ast, ctypes, resource")
        try:
            _RUNNABLE[python] = subprocess.run([python, "-I", "-c", code], cwd="/", env={"PATH": "/usr/bin:/bin"},
                                               capture_output=True, timeout=30).returncode == 0
        except (OSError, subprocess.SubprocessError):
            _RUNNABLE[python] = False
    return _RUNNABLE[python]


ISOLATIONS = ("auto", "bwrap", "builtin")
_BWRAP_OK: dict[bool, bool] = {}


def _bwrap_argv(bwrap: str, scratch: str) -> list[str]:
    """bubblewrap: every namespace new, the host read-only, a private /tmp, /dev and /proc, the home folder
    hidden (unless this interpreter lives there), the scratch folder the one writable place."""
    argv = [bwrap, "--unshare-all", "--die-with-parent", "--new-session", "--ro-bind", "/", "/", "--dev", "/dev",
            "--proc", "/proc", "--tmpfs", "/tmp"]
    home = os.path.realpath(os.path.expanduser("~"))
    keep = [os.path.realpath(p) for p in (sys.prefix, sys.base_prefix, os.path.dirname(sys.executable))]
    if home not in ("/", "") and os.path.isdir(home) and not any(k == home or k.startswith(home + os.sep)
                                                                  for k in keep):
        argv += ["--tmpfs", home]
    return argv + ["--bind", scratch, scratch, "--chdir", scratch, "--"]


def _bwrap(lim: SandboxLimits, uid: int | None) -> str | None:
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
            _BWRAP_OK[key] = subprocess.run(_bwrap_argv(path, scratch) + ["true"], capture_output=True, timeout=30,
                                            **as_user).returncode == 0
        except (OSError, subprocess.SubprocessError):
            _BWRAP_OK[key] = False
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
    return path if _BWRAP_OK[key] else None


def _interpreter(lim: SandboxLimits) -> tuple[str, bool]:
    """(the interpreter to start, whether the code runs under its own unprivileged uid).

    As root: ``lim.python``, else this interpreter, else the system's ``python3`` (its standard library only),
    the first one an unprivileged uid can run (pyenv under ``/root`` cannot be)."""
    if os.geteuid() != 0 or not lim.drop_privileges:
        return lim.python or sys.executable, False
    for python in ([lim.python] if lim.python else [sys.executable, *_SYSTEM_PYTHONS]):
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


def run_many(codes, *, stdins=None, tests=None, limits: SandboxLimits | None = None,
             max_workers: int | None = None) -> list[SandboxResult]:
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
        return list(pool.map(lambda job: run_python(job[0], stdin=job[1], tests=job[2], limits=limits),
                             zip(codes, stdins, tests)))
