"""Issue 39, items 1-3: a verdict no model code can forge, limits per run, cleanup that never raises.

Bounded attacks: a few forks, small sizes, short timeouts. They run as root on CI (where the code runs under a uid of
its own when an interpreter allows it) and as an ordinary user elsewhere.
"""

import logging
import os
import uuid

import pytest

from grpo_kit.tasks import sandbox
from grpo_kit.tasks.code_reward import make_python_code_reward
from grpo_kit.tasks.sandbox import SandboxLimits, run_python


def _limits(**kw):
    return SandboxLimits(**{"allow_root": True, "timeout_s": 5.0, "memory_mb": 256, **kw})


def _block(code: str) -> str:
    return f"```python\n{code}\n```"


ADD_TESTS = ["assert add(2, 3) == 5\nassert add(1, 1) != 3"]
RIGHT_ADD = "def add(a, b):\n    return a + b\n"
WRONG_ADD = "def add(a, b):\n    return 0\n"

# Each one tries to get a wrong `add` scored 1.0 by reaching the harness from the program's interpreter.
FORGERIES = [
    # the harness's reporting function in the program's own __main__ (issue 39, item 1)
    WRONG_ADD + "import __main__\n__main__._report('tests_completed', True)\nimport os\nos._exit(0)",
    # any harness function or closure found through the garbage collector
    WRONG_ADD + "import gc, os\nfor f in gc.get_objects():\n"
    "    if callable(f) and getattr(f, '__name__', '') in ('_report', 'report'):\n"
    "        try:\n            f('tests_completed', True)\n        except Exception:\n            pass\nos._exit(0)",
    # every string that looks like a secret, written as a report line to every descriptor the program holds
    WRONG_ADD + "import gc, os, re, json\n"
    "hexes = {o for o in gc.get_objects() for o in ([o] if isinstance(o, str) else o.values() "
    "if isinstance(o, dict) else []) if isinstance(o, str) and re.fullmatch('[0-9a-f]{32}', o)}\n"
    "for fd in range(3, 64):\n    for h in hexes:\n"
    "        try:\n            os.write(fd, (json.dumps(['tests_completed', True, h]) + '\\n').encode())\n"
    "        except OSError:\n            pass\nos._exit(0)",
    # another process's descriptors, through /proc
    WRONG_ADD + "import os, glob, json\nfor p in glob.glob('/proc/[0-9]*/fd/*'):\n"
    "    try:\n        fd = os.open(p, os.O_WRONLY | os.O_APPEND)\n"
    "        os.write(fd, (json.dumps(['tests_completed', True, 'x']) + '\\n').encode())\n"
    "    except OSError:\n        pass\nos._exit(0)",
    # the test code's own frame: patch the asserting globals from the program
    WRONG_ADD + "import sys\nsys.modules['builtins'].AssertionError = SystemExit",
]


@pytest.mark.parametrize("cheat", FORGERIES)
def test_the_verdict_cannot_be_forged_from_the_program(cheat):
    fn = make_python_code_reward(_limits())
    assert fn(None, [_block(cheat)], tests=ADD_TESTS) == [0.0], fn.last_results[0]
    assert fn(None, [_block(RIGHT_ADD)], tests=ADD_TESTS) == [1.0], fn.last_results[0]


def test_tests_see_plain_values_and_the_programs_exceptions():
    code = (
        "def pair(n):\n    return (n, [n], {'k': n}, {n}, b'x', 1.5, None, True)\n"
        "def boom(x):\n    raise ValueError(f'bad {x}')\n"
        "class Box:\n    pass\n"
        "def box():\n    return Box()\nCONST = 7\nprint('side output')"
    )
    tests = (
        "assert pair(2) == (2, [2], {'k': 2}, {2}, b'x', 1.5, None, True)\nassert CONST == 7\n"
        "try:\n    boom(1)\n    assert False\nexcept ValueError as e:\n    assert 'bad 1' in str(e)\n"
        "assert box() != box()\nassert isinstance(pair(1)[0], int)\nprint('tests ran')"
    )
    fn = make_python_code_reward(_limits())
    assert fn(None, [_block(code)], tests=[tests]) == [1.0], fn.last_results[0]
    assert fn.last_results[0].stdout == "side output\ntests ran\n", fn.last_results[0]
    r = run_python(code, tests="assert CONST == 8", limits=_limits())  # a failing test: its traceback, exit 1
    assert not r.tests_completed and r.reason == "exit code 1: AssertionError", r


def test_the_process_block_has_no_flag_to_flip():
    flip = "import __main__\n__main__._NO_PROC = False\n"
    r = run_python(flip + "import subprocess\nprint(subprocess.run(['true']).returncode)", limits=_limits())
    assert not r.ok and r.stdout == "", r
    r = run_python("import ctypes\nprint(ctypes.CDLL(None).fork())", limits=_limits())  # around the audit hook
    assert r.stdout.strip() in ("", "-1"), r


def test_the_network_block_has_no_flag_to_flip_without_a_namespace():
    code = (
        "import gc, sys\nfor o in gc.get_objects():\n"
        "    if isinstance(o, dict) and '_ALLOWED_FAMILIES' in o:\n        o['_ALLOWED_FAMILIES'].add(2)\n"
        "import ctypes\nprint(ctypes.CDLL(None).socket(2, 1, 0))"
    )
    r = run_python(code, limits=_limits(network_namespace=False))
    assert r.stdout.strip() == "-1", r


def test_memory_holds_for_the_run_as_a_whole():
    # six processes each try to hold 300 MB at once under memory_mb=512: at most one may succeed
    code = (
        "import os, time\nkids = []\nfor i in range(6):\n    pid = os.fork()\n    if pid == 0:\n"
        "        try:\n            b = bytearray(300 * 2 ** 20)\n            print('held', flush=True)\n"
        "            time.sleep(1.5)\n        except MemoryError:\n            print('refused', flush=True)\n"
        "        os._exit(0)\n    if pid > 0:\n        kids.append(pid)\n"
        "for pid in kids:\n    os.waitpid(pid, 0)\n"
    )
    for pre in ("", "import ctypes\nos.fork = ctypes.CDLL(None).fork\n"):
        r = run_python(
            pre + code if not pre else "import os\n" + pre + code,
            limits=_limits(memory_mb=512, timeout_s=10.0, allow_subprocess=not pre),
        )
        assert r.stdout.count("held") <= 1, r


def test_processes_are_limited_per_run():
    code = (
        "import os, time\nn = 0\nfor i in range(60):\n    try:\n        pid = os.fork()\n    except OSError:\n"
        "        break\n    if pid == 0:\n        time.sleep(2)\n        os._exit(0)\n    n += 1\nprint(n)"
    )
    r = run_python(code, limits=_limits(timeout_s=10.0, allow_subprocess=True))
    assert r.stdout.strip() and int(r.stdout) < 60 and int(r.stdout) <= sandbox.SandboxLimits().max_processes, r


def test_tmp_and_shm_are_private_and_small():
    tag = uuid.uuid4().hex
    paths = [f"/tmp/grpo_kit_probe_{tag}", f"/dev/shm/grpo_kit_probe_{tag}", f"/var/tmp/grpo_kit_probe_{tag}"]
    code = (
        "import os\n"
        f"for p in {paths!r}:\n    try:\n        with open(p, 'wb') as f:\n            f.write(b'x' * 4096)\n"
        "        print('wrote', p)\n    except OSError as e:\n        print('refused', p, e.errno)\n"
        "try:\n    with open('big', 'wb') as f:\n        for i in range(64):\n            f.write(b'x' * 2 ** 20)\n"
        "    print('big file written')\nexcept OSError as e:\n    print('big file refused', e.errno)"
    )
    r = run_python(code, limits=_limits(disk_mb=16, max_output_bytes=64 << 20))
    for p in paths:
        assert not os.path.exists(p), f"{p} outlived the call: {r}"
    assert "big file refused" in r.stdout, r  # 64 MiB does not fit in disk_mb=16


def _scratch_folders() -> set:
    import tempfile

    return {n for n in os.listdir(tempfile.gettempdir()) if n.startswith("grpo_kit_sandbox_")}


def test_a_deep_tree_in_scratch_neither_raises_nor_stays_behind():
    before = _scratch_folders()
    code = "import os\nprint(os.getcwd())\nfor i in range(1500):\n    os.mkdir('d')\n    os.chdir('d')\nprint('deep')"
    r = run_python(code, limits=_limits(timeout_s=20.0))
    assert "deep" in r.stdout, r
    assert not os.path.exists(r.stdout.split()[0])
    fn = make_python_code_reward(_limits(timeout_s=20.0))
    assert fn(None, [_block(RIGHT_ADD + code)], tests=ADD_TESTS) == [1.0], fn.last_results[0]
    assert _scratch_folders() <= before


def test_remove_tree_is_iterative_and_stays_inside(tmp_path):
    from grpo_kit.tasks.sandbox_cleanup import remove_tree

    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep.txt").write_text("keep")
    top = tmp_path / "scratch"
    top.mkdir()
    fd = os.open(top, os.O_RDONLY)
    for _ in range(2000):  # deeper than PATH_MAX allows as a path
        os.mkdir("dd", dir_fd=fd)
        new = os.open("dd", os.O_RDONLY, dir_fd=fd)
        os.close(fd)
        fd = new
    os.symlink(str(outside), "link", dir_fd=fd)
    os.close(fd)
    locked = top / "locked"
    locked.mkdir()
    (locked / "f").write_text("x")
    locked.chmod(0)
    (top / "fifo").parent.mkdir(exist_ok=True)
    os.mkfifo(top / "fifo")
    assert remove_tree(str(top)) == 0
    assert not top.exists() and (outside / "keep.txt").read_text() == "keep"
    assert remove_tree(str(top)) == 0  # gone already: nothing to do


def test_a_cleanup_failure_is_logged_and_counted_never_raised(tmp_path, monkeypatch, caplog):
    from grpo_kit.tasks import sandbox_cleanup

    top = tmp_path / "scratch"
    (top / "a").mkdir(parents=True)
    (top / "a" / "f").write_text("x")

    def refuse(*a, **k):
        raise PermissionError(1, "refused")

    monkeypatch.setattr(sandbox_cleanup.os, "unlink", refuse)
    before = sandbox_cleanup.cleanup_failures()
    with caplog.at_level(logging.WARNING, logger="grpo_kit.tasks.sandbox"):
        failed = sandbox_cleanup.remove_tree(str(top))
    assert failed >= 1 and sandbox_cleanup.cleanup_failures() >= before + failed
    assert "could not remove" in caplog.text
    monkeypatch.undo()
    assert sandbox_cleanup.remove_tree(str(top)) == 0 and not top.exists()
    monkeypatch.setattr(sandbox, "remove_tree", lambda path: (_ for _ in ()).throw(RecursionError("deep")))
    r = run_python("print(1)", limits=_limits())
    assert r.stdout == "1\n"  # run_python never raises, whatever its cleanup meets
