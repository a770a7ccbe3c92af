"""The process that runs the model's program (``python -I -c <this file> <cfg>``), exec'd by the judge in
:mod:`grpo_kit.tasks.sandbox_child`; never imported.

A fresh interpreter: nothing of the harness (no report channel, no secret, no tests, no flag) is in its memory or
among its descriptors. It holds stdin/stdout/stderr, the program text (fd 3) and, in tests mode, the call channel to
the judge (requests on fd 4, answers on fd 5). Its limits, uid and namespaces were set before the exec; here it
installs the kernel's seccomp filter (which no Python code can lift) and an audit hook (which only words the refusal),
runs the program, and in tests mode then answers the judge's calls into the program's objects with plain data.
"""
import builtins, json, os, sys, signal
def _parse(data, limit):
    """JSON of at most ``limit`` bytes (this script runs without the package's bounded readers)."""
    if len(data) > limit:
        raise ValueError(f"{len(data)} bytes of JSON; at most {limit}")
    return json.loads(data)
cfg = _parse(sys.argv[1], 1 << 16)
with os.fdopen(3, "rb") as _fh:
    _code = _fh.read().decode("utf-8", "surrogatepass")
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # over-long output: write() fails instead of a kill
# The audit hook only gives a refusal a readable message; the kernel (seccomp, namespaces, rlimits) enforces it.
# Its settings are bound as default arguments at creation: there is no module-level flag to flip.
def _make_hook(no_proc=not cfg["subprocess"], PermissionError=PermissionError, int=int):
    proc_events = {"subprocess.Popen", "os.system", "os.exec", "os.posix_spawn", "os.spawn", "os.fork",
                   "os.forkpty", "pty.spawn"}
    net_events = {"socket.connect", "socket.bind", "socket.sendto", "socket.getaddrinfo", "socket.gethostbyname",
                  "socket.gethostbyaddr", "socket.getnameinfo"}
    def hook(event, args):
        if event == "socket.__new__":
            if len(args) > 1 and args[1] is not None and int(args[1]) != 1:  # not AF_UNIX
                raise PermissionError("network access is disabled in the sandbox")
        elif event in net_events:
            raise PermissionError("network access is disabled in the sandbox")
        elif no_proc and event in proc_events:
            raise PermissionError("starting processes is disabled in the sandbox")
    return hook
sys.addaudithook(_make_hook())
# Syscall numbers: x86_64, aarch64 (AUDIT_ARCH_*, then the calls the filter looks at). ``deny``: refused always:
# io_uring, ptrace and process_vm_*; memory no limit counts (memfd, SysV shared memory, message queues and
# semaphores, POSIX message queues, BPF maps, perf buffers, userfaultfd, keys); and new namespaces, mounts and
# root changes (a user namespace's own tmpfs is memory outside every limit).
_ARCH = {"x86_64": dict(arch=0xC000003E, socket=41, clone=56, clone3=435, fork=57, vfork=58, execve=59,
                        execveat=322, deny=(425, 426, 427, 101, 310, 311, 319, 447, 29, 30, 31, 68, 64, 240, 321,
                                        298, 323, 248, 249, 250, 272, 308, 165, 166, 155, 161, 428, 429, 430,
                                        431, 432, 433, 442)),
         "aarch64": dict(arch=0xC00000B7, socket=198, clone=220, clone3=435, fork=None, vfork=None, execve=221,
                         execveat=281, deny=(425, 426, 427, 117, 270, 271, 279, 447, 194, 196, 195, 186, 190, 180,
                                         280, 241, 282, 217, 218, 219, 97, 268, 40, 39, 41, 51, 428, 429, 430,
                                         431, 432, 433, 442))}
_CLONE_NEW = 0x7E020000  # CLONE_NEWNS | NEWCGROUP | NEWUTS | NEWIPC | NEWUSER | NEWPID | NEWNET
def _filter(nr, x86, no_proc, no_inet):
    """The BPF program: foreign ABIs and ``nr["deny"]`` refused; clone3 answers ENOSYS (its flags sit behind a
    pointer the filter cannot read, so threads and processes use clone); a clone with a CLONE_NEW* flag refused;
    AF_UNIX sockets (path-named sockets of the host) refused, every socket without a network namespace; without
    ``allow_subprocess`` every new process (fork, vfork, exec, a clone that is not a thread)."""
    LD, JEQ, JGE, JSET, RET = 0x20, 0x15, 0x35, 0x45, 0x06
    ALLOW, EPERM, ENOSYS = 0x7FFF0000, 0x00050000 | 1, 0x00050000 | 38
    prog = [(LD, 0, 0, 4), (JEQ, 1, 0, nr["arch"]), (RET, 0, 0, EPERM), (LD, 0, 0, 0)]
    if x86:
        prog += [(JGE, 0, 1, 0x40000000), (RET, 0, 0, EPERM)]  # x32 ABI numbers
    deny = list(nr["deny"])
    if no_proc:
        deny += [n for n in (nr["fork"], nr["vfork"], nr["execve"], nr["execveat"]) if n is not None]
    prog += [(JEQ, 0, 1, nr["clone3"]), (RET, 0, 0, ENOSYS)]
    for n in deny:
        prog += [(JEQ, 0, 1, n), (RET, 0, 0, EPERM)]
    if no_inet:
        prog += [(JEQ, 0, 1, nr["socket"]), (RET, 0, 0, EPERM)]
    else:  # args[0] (the family), low half
        prog += [(JEQ, 0, 3, nr["socket"]), (LD, 0, 0, 16), (JEQ, 0, 1, 1), (RET, 0, 0, EPERM), (LD, 0, 0, 0)]
    # clone: args[0] (the flags), low half; last, so a thread jumps straight to ALLOW
    thread = [(JSET, 1, 0, 0x10000), (RET, 0, 0, EPERM)] if no_proc else []  # without CLONE_THREAD: a process
    prog += [(JEQ, 0, 3 + len(thread), nr["clone"]), (LD, 0, 0, 16), (JSET, 0, 1, _CLONE_NEW), (RET, 0, 0, EPERM),
             *thread]
    return prog + [(RET, 0, 0, ALLOW)]
def _install_seccomp(no_proc, no_inet):
    import ctypes, platform  # lazy: this file runs as a script; only this step needs them
    nr = _ARCH.get(platform.machine())
    if nr is None:
        return False
    prog = _filter(nr, platform.machine() == "x86_64", no_proc, no_inet)
    class Filter(ctypes.Structure):
        _fields_ = [("code", ctypes.c_ushort), ("jt", ctypes.c_ubyte), ("jf", ctypes.c_ubyte), ("k", ctypes.c_uint)]
    class Prog(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.POINTER(Filter))]
    filters = (Filter * len(prog))(*[Filter(*f) for f in prog])
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(38, 1, 0, 0, 0) != 0:  # PR_SET_NO_NEW_PRIVS
        return False
    return libc.prctl(22, 2, ctypes.byref(Prog(len(prog), filters)), 0, 0) == 0  # PR_SET_SECCOMP, FILTER
try:
    _seccomp = _install_seccomp(not cfg["subprocess"], not cfg["netns"])
except Exception:
    _seccomp = False
_resp = os.fdopen(5, "wb")
_resp.write(json.dumps({"seccomp": _seccomp}).encode() + b"\n")  # for SandboxResult.network only, not the verdict
_resp.flush()
# Values cross to the judge as JSON with exact types (a subclass of int is not an int). Plain data and the standard
# library's exact numbers and containers go by value: {"I": hex} (an int past 64 bits), {"f": repr} (inf, nan),
# {"C": [re, im]}, {"B"|"Y": hex} (bytes, bytearray), {"L"|"T"|"S"|"F": [...]}, {"D"|"Ctr"|"OD": [[k, v], ...]},
# {"Q": [n, d]} (Fraction), {"Dec": text} (Decimal), {"R": [start, stop, step]}, {"DQ": [maxlen, [...]]} (deque),
# {"ND": [dtype, shape, nested list]} (a numpy array of numbers; a numpy number goes as the Python number).
# Anything else stays here and the judge gets a handle: {"H": n, "ops": the special methods of cfg["special"] its
# type defines (beyond object's, or beyond those of the plain type it subclasses), "as": its value as that plain
# type, "M": module (and "a": its attribute) when it is a module or a module's attribute}. The judge decides what
# each means; nothing sent here can do more than a value the program could return.
def _make_encoder(special, type=type, len=len, isinstance=isinstance, id=id, repr=repr, getattr=getattr,
                  str=str, hex=hex, object=object, sys=sys, max_entries=1_000_000, max_depth=50):
    """(enc, dec): a container of more than ``max_entries`` or nested deeper than ``max_depth`` goes as a handle."""
    import collections, decimal, fractions, types  # lazy: only the tests mode compares values
    handles, index = [], {}
    tags = {list: "L", tuple: "T", set: "S", frozenset: "F"}
    pairs = {dict: "D", collections.Counter: "Ctr", collections.OrderedDict: "OD"}
    bases = (int, float, complex, str, bytes, tuple, list, dict, set, frozenset)
    Fraction, Decimal, deque, Module = fractions.Fraction, decimal.Decimal, collections.deque, types.ModuleType
    def handle(x, depth):
        key = id(x)
        if key not in index:
            index[key] = len(handles)
            handles.append(x)
        out, t = {"H": index[key]}, type(x)
        base = next((b for b in bases if isinstance(x, b) and t is not b), None)  # a subclass of a plain type
        ref = object if base is None else base  # a plain type too big or deep to send: its own methods count
        out["ops"] = [m for m in special if getattr(t, m, None) is not getattr(ref, m, None)]
        if base is not None and depth <= max_depth:
            try:
                out["as"] = enc(base(x), depth + 1)
            except Exception:  # its value could not be taken: a handle alone
                pass
        if isinstance(x, Module):
            out["M"] = x.__name__
        else:
            mod, name = getattr(x, "__module__", None), getattr(x, "__qualname__", None)
            if type(mod) is str and type(name) is str and mod != "__main__" and getattr(
                    sys.modules.get(mod), name, None) is x:
                out["M"], out["a"] = mod, name
        return out
    def enc(x, depth=0):
        t = type(x)
        if x is None or t is bool or t is str:
            return x
        if t is int:
            return x if -(1 << 63) < x < (1 << 63) else {"I": hex(x)}
        if t is float:
            return x if x - x == 0 else {"f": repr(x)}
        if depth > max_depth:
            return handle(x, depth)
        if t in tags and len(x) <= max_entries:
            return {tags[t]: [enc(v, depth + 1) for v in x]}
        if t in pairs and len(x) <= max_entries:
            return {pairs[t]: [[enc(k, depth + 1), enc(v, depth + 1)] for k, v in x.items()]}
        if t is bytes or t is bytearray:
            return {"B" if t is bytes else "Y": x.hex()}
        if t is complex:
            return {"C": [enc(x.real), enc(x.imag)]}
        if t is Fraction:
            return {"Q": [enc(x.numerator), enc(x.denominator)]}
        if t is Decimal:
            return {"Dec": str(x)}
        if t is range:
            return {"R": [enc(x.start), enc(x.stop), enc(x.step)]}
        if t is deque and len(x) <= max_entries:
            return {"DQ": [x.maxlen, [enc(v, depth + 1) for v in x]]}
        np = sys.modules.get("numpy")  # looked up now: the program imports it, or not
        if (np is not None and getattr(t, "__module__", None) == "numpy" and getattr(x, "dtype", None) is not None
                and getattr(x.dtype, "kind", None) in ("b", "i", "u", "f", "c")):
            if t is np.ndarray and x.size <= max_entries:
                return {"ND": [x.dtype.str, list(x.shape), enc(x.tolist(), depth + 1)]}
            if isinstance(x, np.generic):
                return enc(x.item(), depth)
        return handle(x, depth)
    return enc, _make_decoder(handles)
def _make_decoder(handles, isinstance=isinstance, dict=dict):
    """The judge's arguments: plain values, or handles to this program's objects (``handles``)."""
    import collections, decimal, fractions  # lazy: only the tests mode takes arguments
    Fraction, Decimal, deque = fractions.Fraction, decimal.Decimal, collections.deque
    makers = {"L": list, "T": tuple, "S": set, "F": frozenset}
    def dec(x):
        if isinstance(x, list):
            return [dec(v) for v in x]
        if not isinstance(x, dict):
            return x
        (tag, v), = x.items()
        if tag == "H":
            return handles[v]
        if tag in makers:
            return makers[tag](dec(e) for e in v)
        if tag in ("D", "Ctr", "OD"):
            return {"D": dict, "Ctr": collections.Counter, "OD": collections.OrderedDict}[tag](
                dict((dec(k), dec(e)) for k, e in v))  # a Counter would count the pairs themselves
        if tag == "DQ":
            return deque(dec(v[1]), v[0])
        simple = {"I": lambda: int(v, 16), "B": lambda: bytes.fromhex(v), "Y": lambda: bytearray.fromhex(v),
                  "C": lambda: complex(dec(v[0]), dec(v[1])), "Q": lambda: Fraction(dec(v[0]), dec(v[1])),
                  "Dec": lambda: Decimal(v), "R": lambda: range(*dec(v)), "f": lambda: float(v)}
        return simple[tag]()
    return dec
def _serve(g, enc, dec, limit, dumps=json.dumps, loads=_parse, getattr=getattr, len=len, str=str, type=type,
           BaseException=BaseException):
    """Answer the judge: ``{"op": name, "h": n, "a": [...], "k": {...}}`` -> ``{"v": value}`` or
    ``{"e": [builtin exception name, message]}``, one JSON line each; EOF ends the program. ``name`` is "call"
    (the object called with the arguments) or a function of :mod:`operator` or the builtins applied to the object
    and the arguments (``getattr``, ``eq``, ``add``, ``next``, ``len``, ...). A value over ``limit`` bytes of JSON
    is answered ``{"x": its size}``, which the judge reports as its own error."""
    import operator  # lazy: only the tests mode answers calls
    with os.fdopen(4, "rb") as req, _resp as resp:
        sys.stdout.flush()  # the program's output so far comes before the tests'
        names = {k: enc(v) for k, v in g.items() if not k.startswith("__")}
        resp.write(dumps({"g": names}).encode() + b"\n")
        resp.flush()
        for line in req:
            msg = loads(line, len(line))  # the judge's own requests
            try:
                obj, args, op = dec({"H": msg["h"]}), dec(msg["a"]), msg["op"]
                if op == "call":
                    value = obj(*args, **dict(dec(msg["k"])))
                else:
                    value = (getattr(operator, op, None) or getattr(builtins, op))(obj, *args)
                out = dumps({"v": enc(value)})
            except BaseException as e:  # the program's exception, reported by its nearest builtin class
                name = next((c.__name__ for c in type(e).__mro__ if getattr(builtins, c.__name__, None) is c),
                            "Exception")
                out = dumps({"e": [name, str(e)[:2000]]})
            if len(out) > limit:
                out = dumps({"x": len(out)})
            sys.stdout.flush()
            resp.write(out.encode() + b"\n")
            resp.flush()
_tests = cfg["serve"]
_codec = _make_encoder(cfg["special"]) if _tests else None
_limit = cfg["max_value"]
del cfg, _fh
sys.argv = ["main.py"]
_g = {"__name__": "__main__", "__file__": "main.py", "__builtins__": builtins}
if not _tests:
    _resp.close()
exec(compile(_code, "main.py", "exec"), _g)
if _tests:
    _serve(_g, *_codec, _limit)
