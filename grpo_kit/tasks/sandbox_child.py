"""The harness that grpo_kit.tasks.sandbox starts for each run (``python -I -c <this file> <cfg>``); never imported.

It reads the code, the tests and the run's secret from a file descriptor the parent opened, makes itself
non-dumpable (no process of another privilege, nor of its own uid without ``CAP_SYS_PTRACE``, may read its memory
or open its descriptors through ``/proc``), enters new namespaces (network, PID, IPC, mount) and becomes the PID
namespace's init, which is also the **judge**: it mounts a private, size-limited ``/tmp`` (``/dev/shm``, ``/var/tmp``
and the scratch folder inside it) and a ``/proc`` of the namespace, then forks and **execs** the program in a fresh
interpreter (:mod:`grpo_kit.tasks.sandbox_program`) that holds none of the harness's memory or descriptors. In tests
mode the judge runs the tests itself, calling into the program's objects over a pipe with plain data only, and
reports the verdict and the program's exit status to the parent on its own descriptor, tagged with the secret.
See :mod:`grpo_kit.tasks.sandbox` for what this guarantees.
"""
import builtins, ctypes, fcntl, json, os, resource, signal, sys, traceback
def _parse(data, limit):
    """JSON of at most ``limit`` bytes (this script runs without the package's bounded readers); a bomb of nesting
    raises RecursionError, which every caller treats as a broken channel."""
    if len(data) > limit:
        raise ValueError(f"{len(data)} bytes of JSON; at most {limit}")
    return json.loads(data)
cfg = _parse(sys.argv[1], 1 << 20)
with os.fdopen(cfg["payload_fd"], "rb") as _fh:  # code, tests, the program's bootstrap and the secret; never a path
    _payload = _parse(_fh.read().decode("utf-8", "surrogatepass"), cfg["payload_bytes"])
_libc = ctypes.CDLL(None, use_errno=True)
_libc.prctl(4, 0, 0, 0, 0)  # PR_SET_DUMPABLE 0, kept across fork (an exec resets it: the program's own is dumpable)
resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
def _report(key, value, fd=cfg["report_fd"], tag=_payload["secret"]):  # the harness's channel, not stdout
    os.write(fd, (json.dumps([key, value, tag]) + "\n").encode())
def _unshare():
    """New PID, IPC and mount namespaces (and network, unless turned off); a user namespace too without root."""
    flags = 0x20000000 | 0x08000000 | 0x00020000  # CLONE_NEWPID | CLONE_NEWIPC | CLONE_NEWNS
    flags |= 0x40000000 if cfg["netns"] else 0  # CLONE_NEWNET
    ids = os.geteuid(), os.getegid()
    if _libc.unshare(flags if ids[0] == 0 else flags | 0x10000000) != 0:
        return False
    if ids[0] != 0:  # a new user namespace: keep our own ids in it (unmapped they read 65534)
        for name, text in (("setgroups", "deny"), ("uid_map", f"{ids[0]} {ids[0]} 1"),
                           ("gid_map", f"{ids[1]} {ids[1]} 1")):
            with open(f"/proc/self/{name}", "w") as fh:
                fh.write(text)
    return True
def _mount(source, target, fstype, flags, data=None):
    if _libc.mount(source.encode(), target.encode(), fstype and fstype.encode(), flags,
                   data and data.encode()) != 0:
        raise OSError(ctypes.get_errno(), f"mount {target}")
def _private_mounts(scratch, owner, disk_mb):
    """One tmpfs of ``disk_mb`` at /tmp holds everything the program may write: the scratch folder, /dev/shm and
    /var/tmp are folders in it. It lives in this mount namespace only and ends with it; /proc shows this PID
    namespace only. True when all of it applied."""
    MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_BIND, MS_REC, MS_PRIVATE = 2, 4, 8, 0x1000, 0x4000, 1 << 18
    try:
        _mount("none", "/", None, MS_REC | MS_PRIVATE)  # nothing mounted here propagates to the host
        _mount("tmpfs", "/tmp", "tmpfs", MS_NOSUID | MS_NODEV, f"size={disk_mb}m,mode=1777")
        if os.path.dirname(scratch) == "/tmp":
            os.mkdir(scratch, 0o700)
        else:  # the scratch folder lives elsewhere: a folder of the tmpfs is bound over it
            os.mkdir("/tmp/.scratch", 0o700)
            _mount("/tmp/.scratch", scratch, None, MS_BIND)
        os.chown(scratch, owner, owner)
        for path in ("/dev/shm", "/var/tmp"):
            if os.path.isdir(path):
                inner = "/tmp/." + os.path.basename(path)
                os.mkdir(inner)
                os.chmod(inner, 0o1777)
                _mount(inner, path, None, MS_BIND | MS_REC)
        os.chdir(scratch)
        _mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
        return True
    except OSError:
        return False
def _tasks_of(uid):
    """Processes and threads of ``uid`` now (what RLIMIT_NPROC counts)."""
    n = 0
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/status") as fh:
                fields = dict(line.split(":", 1) for line in fh if ":" in line)
            n += int(fields["Threads"]) if int(fields["Uid"].split()[0]) == uid else 0
        except (OSError, ValueError, KeyError):
            pass
    return n
def _exec_program(code_fd, req_r, resp_w):
    """In the forked child: descriptors 0-5 only, the limits, the run's uid, then a fresh interpreter."""
    fds = [os.open(os.devnull, os.O_RDONLY) if fd is None else fd for fd in (code_fd, req_r, resp_w)]
    fds = [fcntl.fcntl(fd, fcntl.F_DUPFD, 10) for fd in fds]  # above 5 first, so no dup2 below closes another
    for target, fd in zip((3, 4, 5), fds):
        os.dup2(fd, target)
    os.closerange(6, 1 << 16)
    if cfg["cgroup"]:  # the run's own cgroup: every process and page of the program is counted in it
        try:
            with open(os.path.join(cfg["cgroup"], "cgroup.procs"), "w") as fh:
                fh.write("0")
        except OSError as e:  # the limits were sized for the cgroup: do not run without it
            os.write(2, f"sandbox: could not join the run's cgroup: {e}\n".encode())
            os._exit(72)
    mem, nproc = cfg["mem"], cfg["nproc"]
    if mem:
        resource.setrlimit(resource.RLIMIT_AS, (mem, mem))
    resource.setrlimit(resource.RLIMIT_CPU, (cfg["cpu"], cfg["cpu"] + 1))
    resource.setrlimit(resource.RLIMIT_FSIZE, (cfg["fsize"], cfg["fsize"]))
    if cfg["uid"] is None and os.geteuid() != 0 and not _ns:  # the count is the uid's, the trainer's included
        nproc += _tasks_of(os.getuid())
    resource.setrlimit(resource.RLIMIT_NPROC, (nproc, nproc))
    if cfg["uid"] is not None:  # root hands the run its own unprivileged uid/gid
        os.setgroups([])
        os.setgid(cfg["uid"])
        os.setuid(cfg["uid"])
    argv = [sys.executable, "-I", "-c", _payload["program"],
            json.dumps({"subprocess": cfg["subprocess"], "netns": _ns and cfg["netns"], "serve": _tests is not None})]
    os.execv(sys.executable, argv)
# --- the judge's side of the call channel: plain data only, parsed as untrusted input ----------------------------
class ProgramGone(BaseException):
    """The program ended, or answered with something that is not the protocol: the tests cannot pass."""
class ProgramError(Exception):
    """The program raised an exception that is not a builtin ``Exception`` subclass."""
_TAGS = {"L": list, "T": tuple, "S": set, "F": frozenset}
class Remote:
    """A handle to one of the program's objects (a function, a class, an instance): calling it, reading an
    attribute or an item, or ``len()`` asks the program; equal only to a handle of the same object."""
    __slots__ = ("_h", "_rpc")
    def __init__(self, h, rpc):
        object.__setattr__(self, "_h", h)
        object.__setattr__(self, "_rpc", rpc)
    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return self._rpc("getattr", self._h, [name])
    def __call__(self, *args, **kwargs):
        return self._rpc("call", self._h, list(args), kwargs)
    def __getitem__(self, key):
        return self._rpc("getitem", self._h, [key])
    def __len__(self):
        n = self._rpc("len", self._h, [])
        if type(n) is not int or n < 0:
            raise TypeError("len() of a program object gave no length")
        return n
    def __eq__(self, other):
        return type(other) is Remote and other._h == self._h
    def __hash__(self):
        return hash(("Remote", self._h))
    def __repr__(self):
        return f"<program object #{self._h}>"
def _enc(x):
    t = type(x)
    if x is None or t in (bool, str, int):
        return x
    if t is float:
        return x if x - x == 0 else {"f": repr(x)}
    if t in (list, tuple, set, frozenset):
        return {next(k for k, v in _TAGS.items() if v is t): [_enc(v) for v in x]}
    if t is dict:
        return {"D": [[_enc(k), _enc(v)] for k, v in x.items()]}
    if t is bytes:
        return {"B": x.hex()}
    if t is complex:
        return {"C": [x.real, x.imag]}
    if t is Remote:
        return {"H": x._h}
    raise TypeError(f"a {t.__name__} cannot be passed to the program (plain values and its own objects only)")
def _dec(x, rpc):
    """A value from the program; anything off the protocol raises (and counts as the program gone)."""
    if x is None or type(x) in (bool, str, int, float):
        return x
    if type(x) is not dict or len(x) != 1:
        raise ValueError("not a value")
    (tag, v), = x.items()
    if tag == "H" and type(v) is int:
        return Remote(v, rpc)
    if tag in _TAGS and type(v) is list:
        return _TAGS[tag](_dec(e, rpc) for e in v)
    if tag == "D" and type(v) is list:
        return {_dec(k, rpc): _dec(e, rpc) for k, e in v}
    if tag == "B" and type(v) is str:
        return bytes.fromhex(v)
    if tag == "C" and type(v) is list and len(v) == 2 and all(type(e) in (int, float) for e in v):
        return complex(*v)
    if tag == "f" and v in ("inf", "-inf", "nan"):
        return float(v)
    raise ValueError("not a value")
def _make_rpc(req, resp, limit, gone):
    def rpc(op, h, args, kwargs=None):
        msg = {"op": op, "h": h, "a": _enc(list(args)), "k": _enc(dict(kwargs or {}))}
        try:
            req.write(json.dumps(msg).encode() + b"\n")
            req.flush()
            line = resp.readline(limit + 1)
            if not line.endswith(b"\n"):
                raise ValueError("no answer")
            out = _parse(line, limit)
            if type(out) is dict and "v" in out:
                return _dec(out["v"], rpc)
            name, text = out["e"]
            cls = getattr(builtins, str(name), None)
        except Exception as e:  # a broken pipe, a bad line, a bomb of nesting (RecursionError): no verdict
            gone.append(e)
            raise ProgramGone(f"the program stopped answering: {type(e).__name__}") from None
        if not (isinstance(cls, type) and issubclass(cls, Exception)):
            cls = ProgramError
        raise cls(str(text))
    return rpc
def _run_tests(tests, req, resp):
    """(every test ran to its end, the tests failed). The tests run here, never in the program's process."""
    gone = []  # set once the program failed the protocol, whatever the tests catch
    rpc = _make_rpc(req, resp, cfg["fsize"], gone)
    try:
        line = resp.readline(cfg["fsize"] + 1)
        names = _parse(line, cfg["fsize"])["g"] if line.endswith(b"\n") else None
        scope = {str(k): _dec(v, rpc) for k, v in names.items()}
    except Exception:  # the program ended (or broke the protocol) before its names came: nothing to test
        return False, False
    scope.update(__name__="__tests__", __builtins__=builtins)
    try:
        exec(compile(tests, "tests", "exec"), scope)
        if gone:
            raise ProgramGone(f"the program stopped answering: {type(gone[0]).__name__}")
        return True, False
    except ProgramGone as e:
        print(f"tests: {e}", file=sys.stderr, flush=True)
        return False, True
    except BaseException:  # a failing test: its traceback on stderr, as a program's own would be
        traceback.print_exc()
        sys.stderr.flush()
        return False, True
def _judge():
    """Fork and exec the program, run the tests against it, report the verdict and its exit status; exit."""
    code_fd = os.memfd_create("main.py")
    os.write(code_fd, _payload["code"].encode("utf-8", "surrogatepass"))
    os.lseek(code_fd, 0, 0)
    req_r, req_w = os.pipe() if _tests is not None else (None, None)
    resp_r, resp_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            _exec_program(code_fd, req_r, resp_w)
        finally:
            os._exit(71)
    for fd in (code_fd, req_r, resp_w):
        if fd is not None:
            os.close(fd)
    resp = os.fdopen(resp_r, "rb")
    try:
        seccomp = _parse(resp.readline(256), 256).get("seccomp") is True
    except Exception:
        seccomp = False
    net = (("namespace", _ns and cfg["netns"]), ("seccomp", seccomp), ("audit", True))
    _report("net", "+".join(m for m, on in net if on))
    completed = failed = False
    if _tests is not None:
        with os.fdopen(req_w, "wb") as req:
            completed, failed = _run_tests(_tests, req, resp)
    resp.close()
    for stream in (sys.stdout, sys.stderr):  # what the tests printed, before os._exit skips the flush
        stream.flush()
    status = os.waitpid(pid, 0)[1]
    _report("tests_completed", completed)
    _report("status", 1 << 8 if failed and status == 0 else status)
    os._exit(0)
_tests = _payload["tests"]
try:
    _ns = _unshare()
except Exception:
    _ns = False
if _ns:
    # The first child is PID 1 of a new PID namespace: when it ends, the kernel kills every process left in it,
    # daemons and setsid() included. It is the judge; the program runs in its child.
    _init = os.fork()
    if _init:
        _report("init_pid", _init)
        os.close(cfg["report_fd"])
        os.waitpid(_init, 0)
        os._exit(0)
    _libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: die with the outer bootstrap
    _owner = cfg["uid"] if cfg["uid"] is not None else os.geteuid()
    _report("mounts", _private_mounts(cfg["scratch"], _owner, cfg["disk_mb"]))
_judge()
