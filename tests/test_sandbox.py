"""The sandbox for model-generated code (grpo_kit.tasks.sandbox) and the python_code_reward verifier."""

import logging
import os
import time

import pytest

from grpo_kit.tasks.code_reward import extract_code, make_python_code_reward
from grpo_kit.tasks.sandbox import SandboxLimits, run_many, run_python


def _limits(**kw):
    """Limits for these tests: they run as root on CI, where Python under /root cannot run as nobody, so they
    opt in to running the code as root (the refusal itself is tested below)."""
    return SandboxLimits(**{"allow_root": True, **kw})


FAST = _limits(timeout_s=2.0, memory_mb=256)


def _block(code: str) -> str:
    return f"Let me write it.\n```python\n{code}\n```\nDone."


def test_correct_code_runs_in_a_scratch_folder_with_a_minimal_environment():
    r = run_python(
        "import os, sys\nprint(6 * 7)\nprint(os.getcwd())\nprint(sorted(os.environ))\n"
        "open('scratch.txt', 'w').write('x')\nprint(sys.stdin.read().strip())",
        stdin="hello",
        limits=FAST,
    )
    assert r.ok and r.reason == "ok" and r.returncode == 0, r
    lines = r.stdout.splitlines()
    assert lines[0] == "42"
    assert "grpo_kit_sandbox_" in lines[1]
    assert "HOME" in lines[2] and "PYTHONPATH" not in lines[2] and "HF_HUB_OFFLINE" not in lines[2]
    assert lines[3] == "hello"


@pytest.mark.parametrize("code", ["while True: pass", "import time\ntime.sleep(60)"])
def test_hang_is_killed_at_the_wall_clock_timeout(code):
    t = time.perf_counter()
    r = run_python(code, limits=_limits(timeout_s=1.0, memory_mb=256))
    took = time.perf_counter() - t
    assert not r.ok and r.reason.startswith("timeout after 1 s"), r
    assert took < 1.0 + 2.0, took


def test_cpu_time_limit():
    r = run_python("while True: pass", limits=_limits(timeout_s=20.0, cpu_s=1, memory_mb=256))
    assert not r.ok and r.reason == "CPU time limit", r
    assert r.duration_s < 15


@pytest.mark.parametrize("code", ["x = bytearray(10 ** 10)", "l = []\nwhile True: l.append('x' * 10 ** 6)"])
def test_memory_bomb_fails_inside_the_limit(code):
    r = run_python(code, limits=FAST)
    assert not r.ok and r.reason == "memory limit (MemoryError)", r


@pytest.mark.parametrize(
    "code, reason",
    [
        ("import os\nos._exit(3)", "exit code 3"),
        ("import ctypes\nctypes.string_at(0)", "crashed: SIGSEGV"),
        ("import os, signal\nos.kill(os.getpid(), signal.SIGKILL)", "killed (SIGKILL"),
        ("raise SystemExit('bye')", "exit code 1"),
    ],
)
def test_crashes_are_reported(code, reason):
    r = run_python(code, limits=FAST)
    assert not r.ok and r.reason.startswith(reason), r


@pytest.mark.parametrize("namespace", [True, False])
@pytest.mark.parametrize(
    "code",
    [
        "import socket\nsocket.create_connection(('1.1.1.1', 80), timeout=1)",
        "import socket\nsocket.getaddrinfo('example.com', 80)",
        "import urllib.request\nurllib.request.urlopen('http://example.com', timeout=1)",
    ],
)
def test_network_attempts_fail(code, namespace):
    r = run_python(code, limits=_limits(timeout_s=5.0, memory_mb=256, network_namespace=namespace))
    assert not r.ok and "network access" in r.reason + r.stderr, r
    assert r.network in ("audit", "seccomp+audit", "namespace+audit", "namespace+seccomp+audit")
    if not namespace:
        assert not r.network.startswith("namespace")


def test_network_namespace_stops_raw_sockets_when_available():
    code = (
        "import ctypes, struct\nlibc = ctypes.CDLL(None, use_errno=True)\nfd = libc.socket(2, 1, 0)\n"
        "addr = struct.pack('<HH4s8x', 2, 0x5000, bytes([1, 1, 1, 1]))\n"
        "rc = libc.connect(fd, addr, len(addr))\nprint(fd, rc, ctypes.get_errno())"
    )
    r = run_python(code, limits=_limits(timeout_s=5.0, memory_mb=256))
    if not r.network.startswith("namespace"):
        pytest.skip("no network namespace here (needs root or unprivileged user namespaces)")
    fd, rc, errno = map(int, r.stdout.split())
    assert rc == -1 and errno == 101, r.stdout  # ENETUNREACH: nothing is up in the empty namespace


def test_subprocesses_refused_and_output_capped():
    r = run_python("import subprocess\nsubprocess.run(['echo', 'hi'])", limits=FAST)
    assert not r.ok and "starting processes is disabled" in r.stderr
    r = run_python("while True: print('x' * 1000)", limits=_limits(timeout_s=5.0, max_output_bytes=4096))
    assert not r.ok and len(r.stdout) <= 4096 and "File too large" in r.stderr


def test_many_hangs_in_parallel_stay_within_the_timeout_bound():
    n, timeout = 8, 1.5
    t = time.perf_counter()
    results = run_many(
        ["while True: pass"] * (n // 2) + ["import time\ntime.sleep(60)"] * (n // 2),
        limits=_limits(timeout_s=timeout, memory_mb=256),
        max_workers=n,
    )
    took = time.perf_counter() - t
    assert all(r.reason.startswith("timeout") for r in results)
    assert took < timeout + 3.0, f"{n} hanging programs took {took:.1f} s with an {timeout} s timeout"


def test_extract_code():
    assert extract_code(_block("print(1)")) == "print(1)\n"
    assert extract_code("```\nx = 1\n```\n```python\ny = 2\n```") == "y = 2\n"
    assert extract_code("```python\n```") is None
    assert extract_code(None) is None


def test_python_code_reward_scores_and_logs(caplog):
    fn = make_python_code_reward(_limits(timeout_s=1.5, memory_mb=256), max_workers=6)
    completions = [
        _block("def add(a, b):\n    return a + b"),  # tests pass
        _block("def add(a, b):\n    return a - b"),  # tests fail
        [{"role": "assistant", "content": _block("while True: pass")}],  # hang, conversational
        _block("x = bytearray(10 ** 10)"),  # memory bomb
        "no code at all",
        _block("print(sum(range(10)))"),  # answer column
        _block("print('hello')"),  # expected_output column
        _block("import socket\nsocket.create_connection(('1.1.1.1', 80))\nprint(45)"),
    ]
    tests = ["assert add(2, 3) == 5"] * 5 + [None, None, None]
    answer = [None] * 5 + ["45", None, "45"]
    expected = [None] * 6 + ["hello", None]
    with caplog.at_level(logging.INFO, logger="grpo_kit.tasks.sandbox"):
        scores = fn(None, completions, tests=tests, answer=answer, expected_output=expected)
    assert scores == [1.0, 0.0, 0.0, 0.0, 0.0, 1.0, 1.0, 0.0]
    text = caplog.text
    assert "sample 2 scored 0: timeout" in text and "sample 3 scored 0: memory limit" in text
    assert "sample 7 scored 0: network access refused" in text
    assert fn.__name__ == "python_code_reward" and fn.last_results[4] is None


def test_python_code_reward_in_the_checked_wrapper():
    from grpo_kit.tasks.rewards import checked_reward_func

    fn = checked_reward_func(make_python_code_reward(FAST))
    assert fn(None, [_block("print(2 + 2)"), "nothing"], answer=[4, 4]) == [1.0, 0.0]


def test_bad_limits_and_columns_are_clear_errors():
    with pytest.raises(ValueError, match="timeout_s"):
        SandboxLimits(timeout_s=0)
    with pytest.raises(ValueError, match="memory_mb"):
        SandboxLimits(memory_mb=1)
    with pytest.raises(ValueError, match="column 'answer'"):
        make_python_code_reward(FAST)(None, [_block("print(1)")], answer=[1, 2])
    with pytest.raises(ValueError, match="none of the columns"):
        make_python_code_reward(FAST)(None, [_block("print(1)")])


# --- issue 18: escapes and verifier gaming (bounded: one fork each, short timeouts) ------------------------------
def _namespaces() -> bool:
    return run_python("pass", limits=FAST).network.startswith("namespace")


def test_outputs_are_files_the_parent_opened_not_paths_in_the_scratch_folder(tmp_path):
    from grpo_kit.tasks.time_limit import call_with_time_limit

    secret = tmp_path / "root_only.txt"
    secret.write_text("TOP SECRET")
    secret.chmod(0o600)
    code = (
        f"import os\nos.mkfifo('stdout.txt')\nos.symlink({str(secret)!r}, 'stderr.txt')\n"
        "os.mkfifo('net_mode')\nprint('done')"
    )
    r = call_with_time_limit(20, run_python, code, limits=_limits(timeout_s=2.0, memory_mb=256, isolation="builtin"))
    # (a FIFO there used to hang the parent forever)
    assert r.ok and r.stdout == "done\n" and "TOP SECRET" not in r.stdout + r.stderr, r


@pytest.mark.parametrize("how", ["os", "ctypes"])
def test_nothing_the_program_started_outlives_the_call(tmp_path, how):
    if not _namespaces():
        pytest.skip(
            "no PID namespace here (needs root or unprivileged user namespaces): a setsid() daemon can "
            "outlive the call, as the module docstring says"
        )
    flag = tmp_path / f"daemon-{how}"
    tmp_path.chmod(0o777)
    fork = "os.fork()" if how == "os" else "__import__('ctypes').CDLL(None).fork()"  # the audit hook sees no ctypes
    code = (
        f"import os, time\nif {fork} == 0:\n    os.setsid()\n    time.sleep(1.5)\n"
        f"    open({str(flag)!r}, 'w').write('escaped')\n    os._exit(0)\nprint('parent exits')"
    )
    r = run_python(
        code,
        limits=_limits(
            timeout_s=5.0, memory_mb=256, allow_subprocess=(how == "os"), isolation="builtin", filesystem="host"
        ),
    )  # a private root would hide the flag
    assert r.stdout == "parent exits\n", r
    time.sleep(2.5)
    assert not flag.exists(), "a setsid() daemon outlived the sandboxed call"


def test_killing_the_parent_does_not_reach_the_trainer():
    if not _namespaces():
        pytest.skip("no PID namespace here: the program sees the trainer as its parent (see the module docstring)")
    for code in [
        "import os, signal\nos.kill(os.getppid(), signal.SIGKILL)\nprint('tried')",
        "import ctypes\nlibc = ctypes.CDLL(None)\nlibc.kill(libc.getppid(), 9)\nprint('tried')",
    ]:
        r = run_python(code, limits=FAST)
        assert r.duration_s < 10, r  # and this test process is still alive to check it


def test_root_without_privilege_drop_refuses_unless_opted_in(caplog, monkeypatch):
    import sys

    from grpo_kit.tasks import sandbox

    default = SandboxLimits(timeout_s=5.0, memory_mb=256)
    r = run_python("import os\nprint(os.geteuid())", limits=default)
    if os.geteuid() != 0:
        assert r.ok and r.stdout.strip() == str(os.geteuid())  # an ordinary user runs as itself
        pytest.skip("not root: nothing to drop or refuse")
    if sandbox._interpreter(default)[1]:
        assert r.ok and int(r.stdout) >= sandbox.SANDBOX_ID_BASE, r  # dropped to a uid of its own
    monkeypatch.setattr(sandbox, "_interpreter", lambda lim: (sys.executable, False))  # as where none can drop
    monkeypatch.setattr(sandbox, "_ROOT_WARNED", False)
    with caplog.at_level(logging.WARNING, logger="grpo_kit.tasks.sandbox"):
        first, second = run_python("print(1)", limits=default), run_python("print(1)", limits=default)
    assert not first.ok and first.reason.startswith("refused: running as root") and "allow_root=True" in first.reason
    assert second.reason == first.reason and caplog.text.count("refused: running as root") == 1  # one warning
    fn = make_python_code_reward(default)
    assert fn(None, [_block("print(4)")], answer=[4]) == [0.0]
    r = run_python("import os\nprint(os.geteuid())", limits=_limits(timeout_s=5.0, memory_mb=256))
    assert r.ok and r.stdout.strip() == "0"  # opted in


def test_concurrent_runs_get_their_own_uid_and_cannot_touch_each_other():
    from grpo_kit.tasks import sandbox

    if os.geteuid() != 0 or not sandbox._interpreter(FAST)[1]:
        pytest.skip("needs root with an interpreter an unprivileged uid can run")
    code = (
        "import glob, os, time\ntime.sleep(0.5)\nmine = os.getcwd()\nhits = 0\n"
        "for d in glob.glob(os.path.join(os.path.dirname(mine), 'grpo_kit_sandbox_*')):\n"
        "    if d != mine:\n        try:\n            open(os.path.join(d, 'x'), 'w').write('x')\n"
        "            hits += 1\n        except OSError:\n            pass\n"
        "print(os.getuid(), hits)"
    )
    results = run_many([code] * 3, limits=FAST, max_workers=3)
    uids = [int(r.stdout.split()[0]) for r in results]
    assert len(set(uids)) == 3 and all(u >= sandbox.SANDBOX_ID_BASE for u in uids), results
    assert all(r.stdout.split()[1] == "0" for r in results), results


WRONG_ADD = "def add(a, b):\n    return a - b\n"


@pytest.mark.parametrize(
    "cheat",
    [
        WRONG_ADD + "import os\nos._exit(0)",
        WRONG_ADD + "import sys\nsys.exit(0)",
        WRONG_ADD + "import atexit, os\natexit.register(lambda: os._exit(0))",
        "class Any:\n    def __eq__(self, other):\n        return True\n    __ne__ = lambda s, o: False\n"
        "def add(a, b):\n    return Any()",
        "class Five(int):\n    def __eq__(self, other):\n        return True\ndef add(a, b):\n    return Five(0)",
        WRONG_ADD + "import builtins\nbuiltins.AssertionError = SystemExit",
        WRONG_ADD
        + "print('tests_completed')\nimport os\nos.write(1, b'[\"tests_completed\", true, \"x\"]')\nos._exit(0)",
    ],
)
def test_tests_mode_cannot_be_gamed_by_exiting_early_or_always_equal(cheat):
    fn = make_python_code_reward(FAST)
    tests = ["assert add(2, 3) == 5\nassert add(1, 1) != 3"]
    assert fn(None, [_block(cheat)], tests=tests) == [0.0], fn.last_results[0]
    assert fn(None, [_block("def add(a, b):\n    return a + b")], tests=tests) == [1.0]


@pytest.mark.parametrize(
    "program,score",
    [
        ("print(*range(46))", 0.0),
        ("for i in range(100):\n    print(i, 'maybe')", 0.0),
        ("print('answer: 45')", 0.0),
        ("print('working...')\nprint(45)", 1.0),
        ("print(' 45 ')", 1.0),
        ("print('90/2')", 1.0),
        ("print(45.5)", 0.0),
    ],
)
def test_answer_mode_reads_the_final_answer_line(program, score):
    assert make_python_code_reward(FAST)(None, [_block(program)], answer=["45"]) == [score]


def test_path_unix_sockets_are_closed(tmp_path):
    import socket

    if "seccomp" not in run_python("pass", limits=FAST).network:
        pytest.skip("no seccomp filter here (an architecture other than x86_64/aarch64, or prctl refused)")
    tmp_path.chmod(0o777)
    path = str(tmp_path / "service.sock")
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path)
    os.chmod(path, 0o777)
    server.listen(1)
    server.setblocking(False)
    try:
        raw = (
            "import ctypes, struct\nlibc = ctypes.CDLL(None, use_errno=True)\nfd = libc.socket(1, 1, 0)\n"
            f"addr = struct.pack('<H108s', 1, {path.encode()!r})\n"
            "print(fd, ctypes.get_errno(), libc.connect(fd, addr, len(addr)))"
        )
        r = run_python(raw, limits=FAST)  # ctypes goes around the audit hook
        assert r.stdout.split()[:2] == ["-1", "1"], r  # EPERM: no AF_UNIX socket at all
        r = run_python(f"import socket\ns = socket.socket(socket.AF_UNIX)\ns.connect({path!r})", limits=FAST)
        assert not r.ok, r
        with pytest.raises(BlockingIOError):
            server.accept()  # nobody got through
        assert (
            run_python("import socket\na, b = socket.socketpair()\na.send(b'x')\nprint(b.recv(1))", limits=FAST).stdout
            == "b'x'\n"
        )  # unnamed pairs (asyncio, multiprocessing) still work
    finally:
        server.close()


def test_bubblewrap_where_present_hides_the_host_and_is_required_when_asked(tmp_path, monkeypatch):
    import shutil

    outside = tmp_path / "host_file.txt"
    outside.write_text("host")
    tmp_path.chmod(0o777)
    code = (
        f"import os\nprint(os.path.exists({str(outside)!r}))\n"
        "for p in ('/usr/grpo_kit_probe', '/tmp/grpo_kit_probe'):\n"
        "    try:\n        open(p, 'w').write('x')\n        print('wrote', p)\n"
        "    except OSError as e:\n        print('refused', p, e.errno)"
    )
    r = run_python(code, limits=FAST)
    if r.isolation != "bwrap":
        pytest.skip("bubblewrap is not installed or cannot run here (Debian: apt-get install bubblewrap)")
    lines = r.stdout.splitlines()
    assert lines[0] == "False" and lines[1].startswith("refused /usr/grpo_kit_probe"), r  # host read-only
    assert lines[2] == "wrote /tmp/grpo_kit_probe" and not os.path.exists("/tmp/grpo_kit_probe")  # private /tmp
    monkeypatch.setattr(shutil, "which", lambda name: None)
    r = run_python("print(1)", limits=_limits(isolation="bwrap"))
    assert not r.ok and r.reason.startswith("refused: isolation='bwrap'")
    with pytest.raises(ValueError, match="isolation='docker'"):
        SandboxLimits(isolation="docker")
