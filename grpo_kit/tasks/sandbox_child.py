"""The harness that grpo_kit.tasks.sandbox starts for each run (``python -I -c <this file> <cfg>``); never imported.

It reads the code, the tests and the run's secret from a file descriptor the parent opened, makes itself
non-dumpable (no process of another privilege, nor of its own uid without ``CAP_SYS_PTRACE``, may read its memory
or open its descriptors through ``/proc``), enters new namespaces (network, PID, IPC, mount) and becomes the PID
namespace's init, which is also the **judge**. It builds the run's file system: with ``filesystem="minimal"`` a new
root of its own (``pivot_root``): the host paths the parent lists, read-only, a private, size-limited ``/tmp``
(``/dev/shm``, ``/var/tmp`` and the scratch folder inside it), a small ``/dev`` and a ``/proc`` of the namespace,
nothing else; where that cannot be built it runs nothing and reports why. With ``filesystem="host"`` the host's
file system stays, with the private ``/tmp`` where a mount namespace exists. Then it forks and **execs** the
program in a fresh interpreter (:mod:`grpo_kit.tasks.sandbox_program`) that holds none of the harness's memory or
descriptors. In tests mode the judge runs the tests itself, in a scope of its own builtins and modules, calling into
the program's objects over a pipe with values only, and reports the verdict and the program's exit status to the
parent on its own descriptor, tagged with the secret. See :mod:`grpo_kit.tasks.sandbox` for what this guarantees.
"""
import ast, builtins, collections, ctypes, decimal, fcntl, fractions, importlib, json, operator, os, resource
import signal, sys, traceback
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
        _libc.prctl(4, 1, 0, 0, 0)  # dumpable for the moment: a non-dumpable process's /proc files are root's
        try:
            for name, text in (("setgroups", "deny"), ("uid_map", f"{ids[0]} {ids[0]} 1"),
                               ("gid_map", f"{ids[1]} {ids[1]} 1")):
                with open(f"/proc/self/{name}", "w") as fh:
                    fh.write(text)
        finally:
            _libc.prctl(4, 0, 0, 0, 0)
    return True
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT = 1, 2, 4, 8, 32
MS_NOATIME, MS_NODIRATIME, MS_BIND, MS_REC, MS_PRIVATE, MS_RELATIME = 1024, 2048, 0x1000, 0x4000, 1 << 18, 1 << 21
def _mount(source, target, fstype, flags, data=None):
    if _libc.mount(source and source.encode(), target.encode(), fstype and fstype.encode(), flags,
                   data and data.encode()) != 0:
        raise OSError(ctypes.get_errno(), f"mount {target}")
def _tmp_layout(tmp, scratch, owner, disk_mb):
    """One tmpfs of ``disk_mb`` at ``tmp`` (the run's /tmp) holds everything the program may write: the scratch
    folder, and the folders bound at /dev/shm and /var/tmp (returned as (inside, where) pairs)."""
    _mount("tmpfs", tmp, "tmpfs", MS_NOSUID | MS_NODEV, f"size={disk_mb}m,mode=1777")
    binds = []
    for path in ("/dev/shm", "/var/tmp"):
        inner = tmp + "/." + os.path.basename(path)
        os.mkdir(inner)
        os.chmod(inner, 0o1777)
        binds.append((inner, path))
    at_home = os.path.dirname(scratch) == "/tmp"
    inner = tmp + scratch[len("/tmp"):] if at_home else tmp + "/.scratch"
    os.mkdir(inner, 0o700)
    os.chown(inner, owner, owner)
    return binds if at_home else binds + [(inner, scratch)]  # last: it may lie inside /var/tmp
def _private_mounts(scratch, owner, disk_mb):
    """The host's file system with a private /tmp (filesystem="host"): it lives in this mount namespace only and
    ends with it; /proc shows this PID namespace only. True when all of it applied."""
    try:
        _mount(None, "/", None, MS_REC | MS_PRIVATE)  # nothing mounted here propagates to the host
        for inner, path in _tmp_layout("/tmp", scratch, owner, disk_mb):
            if os.path.isdir(path):
                _mount(inner, path, None, MS_BIND | MS_REC)
        os.chdir(scratch)
        _mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
        return True
    except OSError:
        return False
_LOCKED = ((os.ST_NOEXEC, MS_NOEXEC), (os.ST_NOATIME, MS_NOATIME), (os.ST_NODIRATIME, MS_NODIRATIME),
           (os.ST_RELATIME, MS_RELATIME))
def _bind_readonly(path, target):
    """``path`` of the host shown read-only at ``target`` (not its sub-mounts). A remount keeps the flags the
    mount already had: in a user namespace they are locked, and a remount that drops one is refused."""
    _mount(path, target, None, MS_BIND)
    kept = sum(ms for st, ms in _LOCKED if os.statvfs(path).f_flag & st)
    _mount(None, target, None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV | kept)
def _minimal_root(scratch, owner, disk_mb, paths, links):
    """A new root (filesystem="minimal"): a read-only tmpfs holding ``paths`` of the host read-only at their own
    places (never a path inside another's bind) and ``links`` (symlinks) where they were, the run's /tmp, a /dev
    of null, zero, full, random and urandom, and a /proc of this PID namespace; the host's root detached. None, or
    what failed."""
    new = scratch + "/.root"  # staging, in the host's (new, empty) scratch folder: no path shown lies inside it
    try:
        _mount(None, "/", None, MS_REC | MS_PRIVATE)  # nothing mounted here propagates to the host
        os.mkdir(new, 0o755)
        _mount("tmpfs", new, "tmpfs", MS_NOSUID | MS_NODEV, "size=1m,nr_inodes=4096,mode=0755")
        for path in paths:
            target = new + path
            if os.path.isdir(path):
                os.makedirs(target, exist_ok=True)
            else:
                os.makedirs(os.path.dirname(target), exist_ok=True)
                os.close(os.open(target, os.O_CREAT | os.O_WRONLY, 0o644))
            _bind_readonly(path, target)
        for path in ("/tmp", "/dev", "/proc", "/var/tmp", "/dev/shm"):
            os.makedirs(new + path, exist_ok=True)
        _mount("tmpfs", new + "/dev", "tmpfs", MS_NOSUID, "size=64k,nr_inodes=64,mode=0755")
        for name in ("null", "zero", "full", "random", "urandom"):
            os.close(os.open(f"{new}/dev/{name}", os.O_CREAT | os.O_WRONLY, 0o666))
            _mount(f"/dev/{name}", f"{new}/dev/{name}", None, MS_BIND)
        for name, target in (("fd", "/proc/self/fd"), ("stdin", "/proc/self/fd/0"), ("stdout", "/proc/self/fd/1"),
                             ("stderr", "/proc/self/fd/2")):
            os.symlink(target, f"{new}/dev/{name}")
        os.makedirs(new + os.path.dirname(scratch), exist_ok=True)
        binds = _tmp_layout(new + "/tmp", scratch, owner, disk_mb)
        for inner, path in binds:
            os.makedirs(new + path, exist_ok=True)
            _mount(inner, new + path, None, MS_BIND)
        for path, target in links:
            try:
                os.makedirs(os.path.dirname(new + path), exist_ok=True)
                os.symlink(target, new + path)
            except OSError:  # there already, or inside a read-only path that holds it
                pass
        _mount("proc", new + "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
        os.chdir(new)
        if _libc.syscall(_PIVOT_ROOT[os.uname().machine], b".", b".") != 0:
            raise OSError(ctypes.get_errno(), "pivot_root")
        if _libc.umount2(b".", 2) != 0:  # MNT_DETACH: the host's root, stacked on ours, goes
            raise OSError(ctypes.get_errno(), "umount2 of the host's root")
        os.chdir("/")
        for path in ("/dev", "/"):  # nothing more is made: the tree itself read-only
            _mount(None, path, None, MS_REMOUNT | MS_RDONLY | MS_NOSUID | (MS_NODEV if path == "/" else 0))
        os.chdir(scratch)
        return None
    except (OSError, KeyError) as e:  # KeyError: no pivot_root number for this architecture
        return f"{type(e).__name__}: {e}"
_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41}  # syscall numbers
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
    """In the forked child: the run's cgroup, descriptors 0-5 only, the limits, the run's uid, a fresh
    interpreter."""
    if _cgroup_fd is not None:  # the run's own cgroup: every process and page of the program is counted in it
        try:
            os.write(_cgroup_fd, b"0")
        except OSError as e:  # the limits were sized for the cgroup: do not run without it
            os.write(2, f"sandbox: could not join the run's cgroup: {e}\n".encode())
            os._exit(72)
    fds = [os.open(os.devnull, os.O_RDONLY) if fd is None else fd for fd in (code_fd, req_r, resp_w)]
    fds = [fcntl.fcntl(fd, fcntl.F_DUPFD, 10) for fd in fds]  # above 5 first, so no dup2 below closes another
    for target, fd in zip((3, 4, 5), fds):
        os.dup2(fd, target)
    os.closerange(6, 1 << 16)
    mem, nproc = cfg["mem"], cfg["nproc"]
    if mem:
        resource.setrlimit(resource.RLIMIT_AS, (mem, mem))
    resource.setrlimit(resource.RLIMIT_CPU, (cfg["cpu"], cfg["cpu"] + 1))
    resource.setrlimit(resource.RLIMIT_FSIZE, (cfg["fsize"], cfg["fsize"]))
    resource.setrlimit(resource.RLIMIT_NOFILE, (cfg["nofile"], cfg["nofile"]))  # pipes and sockets hold memory
    if cfg["uid"] is None and os.geteuid() != 0 and not _ns:  # the count is the uid's, the trainer's included
        nproc += _tasks_of(os.getuid())
    resource.setrlimit(resource.RLIMIT_NPROC, (nproc, nproc))
    if cfg["uid"] is not None:  # root hands the run its own unprivileged uid/gid
        os.setgroups([])
        os.setgid(cfg["uid"])
        os.setuid(cfg["uid"])
    argv = [sys.executable, "-I", "-c", _payload["program"],
            json.dumps({"subprocess": cfg["subprocess"], "netns": _ns and cfg["netns"], "serve": _tests is not None,
                        "special": SPECIAL, "max_value": cfg["max_value"]})]
    os.execv(sys.executable, argv)
# --- the judge's side of the call channel: values only, parsed as untrusted input --------------------------------
class ProgramGone(BaseException):
    """The program ended, or answered with something that is not the protocol: the tests cannot pass."""
class ProgramError(Exception):
    """The program raised an exception that is not a builtin ``Exception`` subclass."""
class JudgeError(Exception):
    """What the judge cannot decide as plain Python would without asking the program (a program object compared
    with a plain value by its own ``__eq__``, a value over the channel's limit): reported as the judge's error,
    never as a silent 0."""
# The special methods whose presence on a program object's type the judge asks about (beyond object's, or beyond
# those of the plain type it subclasses): comparisons and arithmetic with a plain value.
SPECIAL = ("__eq__", "__ne__", "__lt__", "__le__", "__gt__", "__ge__", "__hash__", "__add__", "__radd__", "__sub__",
           "__rsub__", "__mul__", "__rmul__", "__truediv__", "__rtruediv__", "__floordiv__", "__rfloordiv__",
           "__mod__", "__rmod__", "__pow__", "__rpow__", "__matmul__", "__rmatmul__", "__and__", "__rand__",
           "__or__", "__ror__", "__xor__", "__rxor__", "__lshift__", "__rlshift__", "__rshift__", "__rrshift__")
_NONE = object()  # no plain value
# Packages whose import does something (opens a browser or a window, runs tests or an installer): never imported by
# the judge, nor is any __main__ module.
_NO_IMPORT = {"antigravity", "this", "turtle", "turtledemo", "tkinter", "idlelib", "webbrowser", "test", "ensurepip",
              "venv", "pip", "lib2to3"}
def _judge_error(message):
    _judged.append(message)
    raise JudgeError(message)
_judged = []  # set once the judge could not decide, whatever the tests catch
# Each comparison and arithmetic method by the operator function that computes it.
_OPERATORS = {"__eq__": "eq", "__ne__": "ne", "__lt__": "lt", "__le__": "le", "__gt__": "gt", "__ge__": "ge",
              "__add__": "add", "__sub__": "sub", "__mul__": "mul", "__truediv__": "truediv",
              "__floordiv__": "floordiv", "__mod__": "mod", "__pow__": "pow", "__matmul__": "matmul",
              "__and__": "and_", "__or__": "or_", "__xor__": "xor", "__lshift__": "lshift", "__rshift__": "rshift"}
def _binary(name):
    """A comparison or arithmetic method of :class:`Remote`: between two program objects the program's own
    operator decides (in the program); with a plain value, the plain value it subclasses decides here when its
    type keeps that method; a method its type lacks is NotImplemented, as in Python; one of its own is the
    judge's error, since the program could answer anything."""
    forward = "__" + name[3:] if name.startswith("__r") and "__" + name[3:] in _OPERATORS else name
    reflected, op = forward != name, _OPERATORS[forward]
    def method(self, other):
        if type(other) is Remote:
            return NotImplemented if reflected else self._rpc(op, self._h, [other])
        own = self._ops | ({"__ne__"} if "__eq__" in self._ops else set())  # object's __ne__ asks __eq__
        if self._twin is not _NONE and name not in own:
            fn = getattr(operator, op)
            return fn(other, self._twin) if reflected else fn(self._twin, other)
        if name not in own:
            return NotImplemented
        _judge_error(f"the tests compare or compute a program object whose type has its own {name} with a plain "
                     "value: plain Python would let the program's method decide, and it could answer anything")
    method.__name__ = name
    return method
class Remote:
    """A handle to one of the program's objects (a function, a class, an instance, an iterator): calling it,
    reading or setting an attribute or an item, ``len()``, ``iter()``, ``next()``, ``bool()``, ``hash()``,
    ``str()`` ask the program; comparisons and arithmetic follow :func:`_binary`."""
    __slots__ = ("_h", "_rpc", "_twin", "_ops")
    def __init__(self, h, rpc, twin=_NONE, ops=()):
        for name, value in (("_h", h), ("_rpc", rpc), ("_twin", twin), ("_ops", frozenset(ops))):
            object.__setattr__(self, name, value)
    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return self._rpc("getattr", self._h, [name])
    def __setattr__(self, name, value):
        self._rpc("setattr", self._h, [name, value])
    def __call__(self, *args, **kwargs):
        return self._rpc("call", self._h, list(args), kwargs)
    def __getitem__(self, key):
        return self._rpc("getitem", self._h, [key])
    def __setitem__(self, key, value):
        self._rpc("setitem", self._h, [key, value])
    def __len__(self):
        n = self._rpc("len", self._h, [])
        if type(n) is not int or n < 0:
            raise TypeError("len() of a program object gave no length")
        return n
    def __iter__(self):
        return self._rpc("iter", self._h, [])
    def __next__(self):
        return self._rpc("next", self._h, [])
    def __bool__(self):
        return self._rpc("truth", self._h, []) is True
    def __hash__(self):
        if self._twin is not _NONE and "__hash__" not in self._ops:
            return hash(self._twin)
        n = self._rpc("hash", self._h, [])
        if type(n) is not int:
            raise TypeError("hash() of a program object gave no integer")
        return n
    def __str__(self):
        text = self._rpc("str", self._h, [])
        return text if type(text) is str else f"<program object #{self._h}>"
    def __repr__(self):
        return f"<program object #{self._h}>"  # the judge's own messages never ask the program
    for _name in SPECIAL:
        if _name != "__hash__":
            locals()[_name] = _binary(_name)
    for _name in ("neg", "pos", "abs", "invert", "index", "int", "float"):
        locals()[f"__{_name}__"] = (lambda op: lambda self: self._rpc(op, self._h, []))(_name)
    del _name
# Modules whose classes and functions compute values and touch nothing: a program's name for one of them (``from
# fractions import Fraction``) is the judge's own in the tests. Others stay the program's: the tests' arguments
# must never reach, in the judge, a function the program picked (os.remove, subprocess.run).
_VALUE_MODULES = {"math", "cmath", "fractions", "decimal", "collections", "itertools", "functools", "operator",
                  "statistics", "string", "re", "heapq", "bisect", "numbers", "datetime", "enum", "copy"}
def _wanted(module, attribute=None):
    """The judge's own module (or its attribute) of that name, or _NONE where it cannot be imported here (or is
    not one whose attributes the judge takes, :data:`_VALUE_MODULES`)."""
    if type(module) is not str or module.split(".")[0] in _NO_IMPORT or not all(
            part.isidentifier() and part != "__main__" for part in module.split(".")):
        return _NONE
    if attribute is not None and (type(attribute) is not str or module not in _VALUE_MODULES):
        return _NONE
    try:
        value = importlib.import_module(module)
        for part in (attribute.split(".") if attribute else []):
            value = getattr(value, part)
        return value
    except Exception:  # not importable here, or no such attribute
        return _NONE
_TAGS = {"L": list, "T": tuple, "S": set, "F": frozenset}
_PAIRS = {"D": dict, "Ctr": collections.Counter, "OD": collections.OrderedDict}
def _enc(x):
    """A value the tests pass to the program: values only (and the program's own objects, by handle)."""
    t = type(x)
    if x is None or t in (bool, str):
        return x
    if t is int:
        return x if -(1 << 63) < x < (1 << 63) else {"I": hex(x)}
    if t is float:
        return x if x - x == 0 else {"f": repr(x)}
    tag = next((k for k, v in (*_TAGS.items(), *_PAIRS.items()) if v is t), None)
    if tag in _TAGS:
        return {tag: [_enc(v) for v in x]}
    if tag is not None:
        return {tag: [[_enc(k), _enc(v)] for k, v in x.items()]}
    simple = {bytes: lambda: {"B": x.hex()}, bytearray: lambda: {"Y": x.hex()},
              complex: lambda: {"C": [x.real, x.imag]}, fractions.Fraction: lambda: {"Q": [_enc(x.numerator),
              _enc(x.denominator)]}, decimal.Decimal: lambda: {"Dec": str(x)},
              range: lambda: {"R": [_enc(x.start), _enc(x.stop), _enc(x.step)]},
              collections.deque: lambda: {"DQ": [x.maxlen, [_enc(v) for v in x]]}, Remote: lambda: {"H": x._h}}
    if t in simple:
        return simple[t]()
    _judge_error(f"the tests pass a {t.__name__} to the program; only values and the program's own objects cross")
def _int(v):
    if type(v) is int:
        return v
    if type(v) is dict and set(v) == {"I"} and type(v["I"]) is str:
        return int(v["I"], 16)
    raise ValueError("not an integer")
def _dec(x, rpc):
    """A value from the program; anything off the protocol raises (and counts as the program gone)."""
    if x is None or type(x) in (bool, str, int, float):
        return x
    if type(x) is not dict:
        raise ValueError("not a value")
    if "H" in x:
        if type(x["H"]) is not int or not set(x) <= {"H", "ops", "as", "M", "a"}:
            raise ValueError("not a handle")
        ops = x.get("ops", [])
        if type(ops) is not list or not all(type(o) is str for o in ops):
            raise ValueError("not a handle")
        return Remote(x["H"], rpc, _dec(x["as"], rpc) if "as" in x else _NONE, ops)
    if len(x) != 1:
        raise ValueError("not a value")
    (tag, v), = x.items()
    if tag in _TAGS and type(v) is list:
        return _TAGS[tag](_dec(e, rpc) for e in v)
    if tag in _PAIRS and type(v) is list:
        return _PAIRS[tag](dict((_dec(k, rpc), _dec(e, rpc)) for k, e in v))  # a Counter counts pairs, else
    if tag == "DQ" and type(v) is list and len(v) == 2 and (v[0] is None or type(v[0]) is int):
        return collections.deque([_dec(e, rpc) for e in v[1]], v[0])
    if tag == "I":
        return _int(x)
    if tag in ("B", "Y") and type(v) is str:
        return (bytes if tag == "B" else bytearray).fromhex(v)
    if tag == "C" and type(v) is list and len(v) == 2 and all(type(e) in (int, float) for e in v):
        return complex(*v)
    if tag == "f" and v in ("inf", "-inf", "nan"):
        return float(v)
    if tag == "Q" and type(v) is list and len(v) == 2:
        return fractions.Fraction(_int(v[0]), _int(v[1]))
    if tag == "Dec" and type(v) is str and len(v) <= 10_000:
        return decimal.Decimal(v)
    if tag == "R" and type(v) is list and len(v) == 3:
        return range(*map(_int, v))
    if (tag == "ND" and type(v) is list and len(v) == 3 and type(v[0]) is str and type(v[1]) is list
            and all(type(n) is int and n >= 0 for n in v[1])):
        return _ndarray(v[0], v[1], _dec(v[2], rpc))
    raise ValueError("not a value")
def _ndarray(dtype, shape, values):
    """A numpy array of numbers from the program, built with the judge's own numpy."""
    np = _wanted("numpy")
    if np is _NONE:
        _judge_error("the program returned a numpy array, and the judge cannot import numpy")
    kind = np.dtype(dtype)
    if kind.kind not in "biufc":
        raise ValueError("not an array of numbers")
    return np.array(values, dtype=kind).reshape(shape)
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
            if type(out) is dict and type(out.get("x")) is int:
                big = out["x"]
            else:
                name, text = out["e"]
                cls = getattr(builtins, str(name), None)
                big = None
        except JudgeError:
            raise
        except Exception as e:  # a broken pipe, a bad line, a bomb of nesting (RecursionError): no verdict
            gone.append(e)
            raise ProgramGone(f"the program stopped answering: {type(e).__name__}") from None
        if big is not None:
            _judge_error(f"a value of {big} bytes came back, over the channel's limit of {limit}")
        if not (isinstance(cls, type) and issubclass(cls, Exception)):
            cls = ProgramError
        raise cls(str(text))
    return rpc
def _scope(tests, names, rpc):
    """The tests' globals: the program's top-level names (its values, or handles to its objects), except that the
    builtins are the judge's whatever the program defines; a name the tests read as ``name.attribute`` is the
    judge's module of that name when it has every attribute they read, or else, when the program's value is a
    module, the judge's module of the program's module's name; and a value module's attribute the program holds
    (``Fraction``) is the judge's own."""
    tree = ast.parse(tests)
    loaded = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
    read = collections.defaultdict(set)
    for n in ast.walk(tree):
        if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name):
            read[n.value.id].add(n.attr)
    scope = {}
    for name, raw in names.items():
        if not str(name).isidentifier() or hasattr(builtins, name):
            continue  # the tests' builtins are the judge's: a program's `abs` never answers for `abs`
        value = _dec(raw, rpc)
        if type(value) is Remote and "M" in raw and (name in read if "a" not in raw else name in loaded):
            own = _wanted(raw["M"], raw.get("a"))  # a module the tests read from, or a value module's attribute
            if own is not _NONE:
                value = own
            elif "a" not in raw:
                value = _Unavailable(name, raw["M"])  # else: not a value module's, the program's own object
        scope[name] = value
    for name, attributes in read.items():
        if name not in names or hasattr(builtins, name):
            continue
        module = _wanted(name)
        if module is not _NONE and all(hasattr(module, a) for a in attributes):
            scope[name] = module  # the tests read math.isclose: the judge's math, not the program's `math`
    return scope
class _Unavailable:
    """A module the tests use through the program's name for it that the judge cannot import: using it is the
    judge's error (the program's copy could answer anything)."""
    def __init__(self, name, module):
        self._what = f"the tests use {name} (the program's module {module!r}), which the judge cannot import"
    def __getattr__(self, name):
        _judge_error(self._what)
    def __call__(self, *a, **k):
        _judge_error(self._what)
def _run_tests(tests, req, resp):
    """(every test ran to its end, the tests failed). The tests run here, never in the program's process."""
    gone = []  # set once the program failed the protocol, whatever the tests catch
    rpc = _make_rpc(req, resp, cfg["max_value"], gone)
    try:
        line = resp.readline(cfg["max_value"] + 1)
        names = _parse(line, cfg["max_value"])["g"] if line.endswith(b"\n") else None
        scope = _scope(tests, dict(names), rpc)
    except SyntaxError:  # the tests themselves: their traceback, as a failing test's
        traceback.print_exc()
        return False, True
    except Exception:  # the program ended (or broke the protocol) before its names came: nothing to test
        return False, False
    scope.update(__name__="__tests__", __builtins__=builtins)
    try:
        exec(compile(tests, "tests", "exec"), scope)
        if gone:
            raise ProgramGone(f"the program stopped answering: {type(gone[0]).__name__}")
        if _judged:
            raise JudgeError(_judged[0])
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
    if _judged:
        _report("judge_error", _judged[0][:500])
    _report("tests_completed", completed)
    _report("status", 1 << 8 if failed and status == 0 else status)
    os._exit(0)
def _refuse(reason):
    """Run nothing: the file system asked for could not be built here."""
    _report("refused", reason)
    os._exit(0)
_tests = _payload["tests"]
_cgroup_fd = os.open(os.path.join(cfg["cgroup"], "cgroup.procs"), os.O_WRONLY) if cfg["cgroup"] else None
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
    if cfg["filesystem"] == "minimal" and not cfg["root_ready"]:
        _why = _minimal_root(cfg["scratch"], _owner, cfg["disk_mb"], cfg["paths"], cfg["links"])
        if _why is not None:
            _refuse(f"the minimal file system could not be built here ({_why})")
        _report("mounts", True)
    else:
        _report("mounts", _private_mounts(cfg["scratch"], _owner, cfg["disk_mb"]))
elif cfg["filesystem"] == "minimal" and not cfg["root_ready"]:
    _refuse("no mount namespace here (needs root, or unprivileged user namespaces)")
_report("filesystem", cfg["filesystem"])
_judge()
