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
# Syscall numbers: x86_64, aarch64 (AUDIT_ARCH_*, then the calls the filter looks at).
_ARCH = {"x86_64": dict(arch=0xC000003E, socket=41, clone=56, clone3=435, fork=57, vfork=58, execve=59,
                        execveat=322, ptrace=101, pvr=310, pvw=311, uring=(425, 426, 427)),
         "aarch64": dict(arch=0xC00000B7, socket=198, clone=220, clone3=435, fork=None, vfork=None, execve=221,
                         execveat=281, ptrace=117, pvr=270, pvw=271, uring=(425, 426, 427))}
def _filter(nr, x86, no_proc, no_inet):
    """The BPF program: foreign ABIs, io_uring, ptrace and process_vm_* refused; AF_UNIX sockets (path-named
    sockets of the host) refused, every socket without a network namespace; without ``allow_subprocess`` every new
    process (fork, vfork, exec, a clone that is not a thread; clone3 answers ENOSYS so threads use clone)."""
    LD, JEQ, JGE, JSET, RET = 0x20, 0x15, 0x35, 0x45, 0x06
    ALLOW, EPERM, ENOSYS = 0x7FFF0000, 0x00050000 | 1, 0x00050000 | 38
    prog = [(LD, 0, 0, 4), (JEQ, 1, 0, nr["arch"]), (RET, 0, 0, EPERM), (LD, 0, 0, 0)]
    if x86:
        prog += [(JGE, 0, 1, 0x40000000), (RET, 0, 0, EPERM)]  # x32 ABI numbers
    deny = [*nr["uring"], nr["ptrace"], nr["pvr"], nr["pvw"]]
    if no_proc:
        deny += [n for n in (nr["fork"], nr["vfork"], nr["execve"], nr["execveat"]) if n is not None]
        prog += [(JEQ, 0, 1, nr["clone3"]), (RET, 0, 0, ENOSYS)]
    for n in deny:
        prog += [(JEQ, 0, 1, n), (RET, 0, 0, EPERM)]
    if no_inet:
        prog += [(JEQ, 0, 1, nr["socket"]), (RET, 0, 0, EPERM)]
    else:  # args[0] (the family), low half
        prog += [(JEQ, 0, 3, nr["socket"]), (LD, 0, 0, 16), (JEQ, 0, 1, 1), (RET, 0, 0, EPERM), (LD, 0, 0, 0)]
    if no_proc:  # a clone without CLONE_THREAD is a new process
        prog += [(JEQ, 0, 3, nr["clone"]), (LD, 0, 0, 16), (JSET, 1, 0, 0x10000), (RET, 0, 0, EPERM)]
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
# Values cross to the judge as JSON with exact types (a subclass of int is not an int); anything else stays here
# and the judge gets a handle to it: {"H": n}. Containers: {"L"|"T"|"S"|"F": [...]}, {"D": [[k, v], ...]}.
def _make_encoder(type=type, len=len, isinstance=isinstance, id=id, repr=repr, float=float):
    handles, index = [], {}
    tags = {list: "L", tuple: "T", set: "S", frozenset: "F"}
    def handle(x):
        key = id(x)
        if key not in index:
            index[key] = len(handles)
            handles.append(x)
        return {"H": index[key]}
    def enc(x, depth=0):
        t = type(x)
        if x is None or t is bool or t is str:
            return x
        if t is int:
            return x if -(1 << 63) < x < (1 << 63) else handle(x)
        if t is float:
            return x if x - x == 0 else {"f": repr(x)}
        if depth > 50:
            return handle(x)
        if t in tags and len(x) <= 100_000:
            return {tags[t]: [enc(v, depth + 1) for v in x]}
        if t is dict and len(x) <= 100_000:
            return {"D": [[enc(k, depth + 1), enc(v, depth + 1)] for k, v in x.items()]}
        if t is bytes:
            return {"B": x.hex()}
        if t is complex:
            return {"C": [enc(x.real), enc(x.imag)]}
        return handle(x)
    makers = {"L": list, "T": tuple, "S": set, "F": frozenset}
    def dec(x):
        """The judge's arguments: plain values, or handles to this program's objects."""
        if isinstance(x, list):
            return [dec(v) for v in x]
        if not isinstance(x, dict):
            return x
        (tag, v), = x.items()
        if tag == "H":
            return handles[v]
        if tag in makers:
            return makers[tag](dec(e) for e in v)
        if tag == "D":
            return {dec(k): dec(e) for k, e in v}
        return bytes.fromhex(v) if tag == "B" else complex(dec(v[0]), dec(v[1])) if tag == "C" else float(v)
    return enc, dec
def _serve(g, enc, dec, dumps=json.dumps, loads=_parse, getattr=getattr, len=len, str=str, type=type,
           BaseException=BaseException):
    """Answer the judge: ``{"op": "call"|"getattr"|"getitem"|"len", "h": n, "a": [...]}`` -> ``{"v": value}`` or
    ``{"e": [builtin exception name, message]}``, one JSON line each; EOF ends the program."""
    with os.fdopen(4, "rb") as req, _resp as resp:
        sys.stdout.flush()  # the program's output so far comes before the tests'
        resp.write(dumps({"g": {k: enc(v) for k, v in g.items() if not k.startswith("__")}}).encode() + b"\n")
        resp.flush()
        for line in req:
            msg = loads(line, len(line))  # the judge's own requests
            try:
                obj, args = dec({"H": msg["h"]}), dec(msg["a"])
                op = msg["op"]
                if op == "call":
                    value = obj(*args, **dict(dec(msg["k"])))
                else:
                    value = getattr(obj, args[0]) if op == "getattr" else obj[args[0]] if op == "getitem" else len(obj)
                out = {"v": enc(value)}
            except BaseException as e:  # the program's exception, reported by its nearest builtin class
                name = next((c.__name__ for c in type(e).__mro__ if getattr(builtins, c.__name__, None) is c),
                            "Exception")
                out = {"e": [name, str(e)[:2000]]}
            sys.stdout.flush()
            resp.write(dumps(out).encode() + b"\n")
            resp.flush()
_tests = cfg["serve"]
_codec = _make_encoder()
del cfg, _fh
sys.argv = ["main.py"]
_g = {"__name__": "__main__", "__file__": "main.py", "__builtins__": builtins}
if not _tests:
    _resp.close()
exec(compile(_code, "main.py", "exec"), _g)
if _tests:
    _serve(_g, *_codec)
