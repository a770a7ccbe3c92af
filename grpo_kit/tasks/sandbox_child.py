"""The program that grpo_kit.tasks.sandbox starts for each run (``python -I -c <this file> <cfg>``); never imported.

It reads the code, the tests and the run's secret from a file descriptor the parent opened, enters
new namespaces (with a PID-namespace init that reaps and reports the exit status), sets the
limits, drops to the run's uid, installs the audit hook and the seccomp filter, then runs the
program and the tests, reporting to the parent on its own file descriptor. See
:mod:`grpo_kit.tasks.sandbox` for what this guarantees.
"""
import os, sys, resource, signal, json
cfg = eval(sys.argv[1])
with os.fdopen(cfg["payload_fd"], "rb") as fh:  # code, tests and the run's secret; never a file by path
    _payload = json.loads(fh.read().decode("utf-8", "surrogatepass"))
def _report(key, value, fd=cfg["report_fd"], tag=_payload["secret"]):  # the harness's channel, not stdout
    os.write(fd, (json.dumps([key, value, tag]) + "\n").encode())
resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
_ns = False
if cfg["netns"]:
    try:
        import ctypes
        libc = ctypes.CDLL(None, use_errno=True)
        # CLONE_NEWNET | CLONE_NEWPID | CLONE_NEWIPC (| CLONE_NEWUSER without root)
        flags = 0x40000000 | 0x20000000 | 0x08000000
        _ids = os.geteuid(), os.getegid()
        if libc.unshare(flags if os.geteuid() == 0 else flags | 0x10000000) == 0:
            _ns = True
            if _ids[0] != 0:  # a new user namespace: keep our own ids in it (unmapped they read 65534)
                for name, text in (("setgroups", "deny"), ("uid_map", f"{_ids[0]} {_ids[0]} 1"),
                                   ("gid_map", f"{_ids[1]} {_ids[1]} 1")):
                    with open(f"/proc/self/{name}", "w") as fh:
                        fh.write(text)
    except Exception:
        pass
if _ns:
    # The first child is PID 1 of a new PID namespace: when it ends, the kernel kills every process left in
    # it, daemons and setsid() included. It only reaps; the program runs in its child, a normal process.
    init = os.fork()
    if init:
        _report("init_pid", init)
        os.waitpid(init, 0)
        os._exit(0)
    libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: die with the outer bootstrap
    worker = os.fork()
    if worker:
        while True:
            pid, status = os.wait()
            if pid == worker:
                _report("status", status)
                os._exit(0)
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # over-long output: write() fails instead of a kill
cpu = cfg["cpu"]
resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
if cfg["mem"]:
    resource.setrlimit(resource.RLIMIT_AS, (cfg["mem"], cfg["mem"]))
resource.setrlimit(resource.RLIMIT_FSIZE, (cfg["fsize"], cfg["fsize"]))
import socket as _s, ast as _ast  # before dropping privileges, as the hook and the test harness need them
if cfg["uid"] is not None:  # root hands the run its own unprivileged uid/gid
    os.setgroups([])
    os.setgid(cfg["uid"])
    os.setuid(cfg["uid"])
_ALLOWED_FAMILIES = {int(_s.AF_UNIX)}
_NO_PROC = not cfg["subprocess"]
_PROC_EVENTS = {"subprocess.Popen", "os.system", "os.exec", "os.posix_spawn", "os.spawn", "os.fork",
                "os.forkpty", "pty.spawn"}
def _hook(event, args):
    if event == "socket.__new__":
        if len(args) > 1 and args[1] is not None and int(args[1]) not in _ALLOWED_FAMILIES:
            raise PermissionError("network access is disabled in the sandbox")
    elif event in ("socket.connect", "socket.bind", "socket.sendto", "socket.getaddrinfo",
                   "socket.gethostbyname", "socket.gethostbyaddr", "socket.getnameinfo"):
        raise PermissionError("network access is disabled in the sandbox")
    elif _NO_PROC and event in _PROC_EVENTS:
        raise PermissionError("starting processes is disabled in the sandbox")
sys.addaudithook(_hook)
# Path-named AF_UNIX sockets are files, which no namespace here hides: a seccomp filter refuses creating any
# AF_UNIX socket (EPERM), and io_uring (which would bypass it); foreign-ABI syscalls are refused outright.
def _seccomp_unix_block():
    import ctypes, platform
    arch = {"x86_64": (0xC000003E, 41), "aarch64": (0xC00000B7, 198)}.get(platform.machine())
    if arch is None:
        return False
    audit_arch, nr_socket = arch
    ld, jeq, jge, ret = 0x20, 0x15, 0x35, 0x06
    allow, deny = 0x7FFF0000, 0x00050000 | 1  # SECCOMP_RET_ALLOW, SECCOMP_RET_ERRNO | EPERM
    prog = [(ld, 0, 0, 4), (jeq, 1, 0, audit_arch), (ret, 0, 0, deny), (ld, 0, 0, 0),
            (jge, 6, 0, 0x40000000),  # x32 ABI numbers
            (jeq, 2, 0, nr_socket), (jeq, 4, 0, 425),  # io_uring_setup
            (ret, 0, 0, allow), (ld, 0, 0, 16), (jeq, 1, 0, 1),  # args[0] == AF_UNIX
            (ret, 0, 0, allow), (ret, 0, 0, deny)]
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
    _unix_blocked = _seccomp_unix_block()
except Exception:
    _unix_blocked = False
_report("net", "+".join(m for m, on in (("namespace", _ns), ("seccomp", _unix_blocked), ("audit", True)) if on))
_PLAIN = (int, float, complex, bool, str, bytes, type(None), list, tuple, dict, set, frozenset)
# == in the tests: a plain value (a number, a str, a container of them) equals only a plain value, so an
# object of the program's own (e.g. one whose __eq__ is always True) cannot pass for the expected result.
# The builtins it uses are bound now, before the program could replace them.
def _make_same(type=type, len=len, zip=zip, all=all, PLAIN=_PLAIN):
    numbers = (int, float, complex, bool)
    def same(a, b):
        ta, tb = type(a), type(b)
        if ta not in PLAIN or tb not in PLAIN:
            return ta not in PLAIN and tb not in PLAIN and a == b
        if ta in numbers and tb in numbers:
            return a == b
        if ta is not tb:
            return False
        if ta in (list, tuple):
            return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
        if ta is dict:
            return (len(a) == len(b) and all(type(k) in PLAIN for k in a) and all(k in b for k in a)
                    and all(same(a[k], b[k]) for k in a))
        if ta in (set, frozenset):
            return all(type(x) in PLAIN for x in a) and all(type(x) in PLAIN for x in b) and a == b
        return a == b
    return same
class _StrictEq(_ast.NodeTransformer):
    def visit_Compare(self, node):
        self.generic_visit(node)
        if len(node.ops) != 1 or not isinstance(node.ops[0], (_ast.Eq, _ast.NotEq)):
            return node
        call = _ast.Call(_ast.Name("__grpo_kit_same__", _ast.Load()), [node.left, node.comparators[0]], [])
        return _ast.UnaryOp(_ast.Not(), call) if isinstance(node.ops[0], _ast.NotEq) else call
_tests = _payload["tests"]
_tests = None if _tests is None else compile(_ast.fix_missing_locations(_StrictEq().visit(_ast.parse(_tests))),
                                             "tests", "exec")
def _run(src=_payload["code"], tests=_tests, same=_make_same(), report=_report,
         dict=dict, exec=exec, compile=compile):
    g = {"__name__": "__main__", "__file__": "main.py", "__builtins__": __builtins__}
    exec(compile(src, "main.py", "exec"), g)
    if tests is not None:
        exec(tests, dict(g, __grpo_kit_same__=same))
        report("tests_completed", True)  # after the last assertion, tagged with a value never handed to the program
del _hook, cfg, _payload, _tests
sys.argv = ["main.py"]
_run()
