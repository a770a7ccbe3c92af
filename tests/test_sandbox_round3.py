"""Issue 52 items 1-4: a verdict the program's own names cannot bend, correct programs never scored 0, no answer key
within the sandbox's reach, memory counted wherever it hides.

Bounded: one short run per program, small sizes; many runs go through run_many. They run as root on CI (the code
under a uid of its own where an interpreter allows it) and as an ordinary user elsewhere.
"""

import ast
import builtins
import json
import os
import tempfile
from pathlib import Path

import pytest

from grpo_kit.tasks import sandbox
from grpo_kit.tasks.code_reward import make_python_code_reward
from grpo_kit.tasks.sandbox import SandboxLimits, run_python

ROOT = Path(__file__).resolve().parent.parent


def _limits(**kw):
    return SandboxLimits(**{"allow_root": True, "timeout_s": 10.0, "memory_mb": 256, **kw})


def _block(code: str) -> str:
    return f"```python\n{code}\n```"


def _scores(programs, tests, limits=None, workers=4):
    """Each program against its tests (one string each) through the code reward; the scores and the results."""
    fn = make_python_code_reward(limits or _limits(), max_workers=workers)
    return fn(None, [_block(p) for p in programs], tests=list(tests)), fn.last_results


# --- item 1: the tests' builtins and modules are the judge's ----------------------------------------------------
# Bundled problems: (a correct program, a wrong one that returns constants and so uses no builtin, the tests: one
# assertion a line, each run as a suite of its own so that one redefined name could flip it).
BUNDLED = [
    (
        "import math\ndef root(x):\n    return math.sqrt(x)\n",
        "import math\ndef root(x):\n    return 0.0\n",
        [
            "assert abs(root(2.0) - 1.41421356) < 1e-6",
            "assert math.isclose(root(9.0), 3.0)",
            "assert round(root(16.0)) == 4",
            "assert isinstance(root(4.0), float) and float(root(1.0)) == 1.0",
            "assert math.floor(root(10.0)) == 3",
        ],
    ),
    (
        "def evens(xs):\n    return [x for x in xs if x % 2 == 0]\n",
        "def evens(xs):\n    return [1, 3]\n",
        [
            "assert sorted(evens([4, 3, 2])) == [2, 4]",
            "assert len(evens(range(10))) == 5",
            "assert all(x % 2 == 0 for x in evens(range(9)))",
            "assert sum(evens([1, 2, 3, 4])) == 6",
            "assert not any(x % 2 for x in evens(list(range(7)))) and max(evens([8, 3, 6])) == 8",
            "assert min(evens([8, 3, 6])) == 6 and set(evens((2, 2, 3))) == {2}",
            "assert tuple(evens([2, 5])) == (2,) and list(map(abs, evens([-2]))) == [2]",
        ],
    ),
    (
        "import re, collections\ndef counts(text):\n    return {k: n for k, n in collections.Counter(re.findall("
        "'[a-z]+', text.lower())).items()}\n",
        "import re, collections\ndef counts(text):\n    return {'W1': 0}\n",
        [
            "assert counts('A b a') == {'a': 2, 'b': 1}",
            "assert re.fullmatch('[a-z]+', next(iter(counts('Hi'))))",
            "assert collections.Counter(counts('x x')) == collections.Counter({'x': 2})",
            "assert str(counts('a')) == \"{'a': 1}\" and repr(counts('')) == '{}'",
            "assert dict(zip(counts('c'), [1])) == {'c': 1} and list(enumerate(counts('z'))) == [(0, 'z')]",
            "assert type(counts('')) is dict and int(counts('q q q')['q']) == 3 and bool(counts('')) is False",
        ],
    ),
]


def _names_used(test: str) -> tuple[set, set]:
    """(builtins, module names) a test line uses: builtins by name, modules as ``name.attribute``."""
    tree = ast.parse(test)
    loads = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}
    dotted = {n.value.id for n in ast.walk(tree) if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name)}
    modules = {n for n in dotted if n not in vars(builtins) and __import__("importlib").util.find_spec(n)}
    return {n for n in loads if n in vars(builtins)}, modules


def _candidates(test: str) -> list[str]:
    """What a redefined name could answer to make the line pass: each literal the line compares with, True, and
    the first argument it was given."""
    literals = {
        repr(ast.literal_eval(n))
        for n in ast.walk(ast.parse(test))
        if isinstance(n, (ast.Constant, ast.List, ast.Tuple, ast.Dict, ast.Set)) and _literal(n)
    }
    return sorted(literals | {"True", "(a[0] if a else 0)"})


def _literal(node) -> bool:
    try:
        ast.literal_eval(node)
        return True
    except ValueError:
        return False


def _redefinitions(test: str, wrong: str):
    """A wrong program redefining each builtin and module name the line uses, one way per candidate answer."""
    used_builtins, modules = _names_used(test)
    for name in sorted(used_builtins):
        for answer in _candidates(test):
            yield name, f"{wrong}\ndef {name}(*a, **k):\n    return {answer}\n"
    for name in sorted(modules):
        for answer in _candidates(test):
            yield (
                name,
                (
                    f"{wrong}\nclass _Fake:\n    def __getattr__(self, attr):\n"
                    f"        return lambda *a, **k: {answer}\n{name} = _Fake()\n"
                ),
            )


def test_a_program_redefining_a_builtin_or_module_the_tests_use_and_otherwise_wrong_scores_0():
    programs, tests, what = [], [], []
    for right, wrong, lines in BUNDLED:
        for line in lines:
            programs += [right, wrong]  # the controls: the correct program passes each line, the wrong one fails it
            tests += [line, line]
            what += [("right", line), ("wrong", line)]
            for name, program in _redefinitions(line, wrong):
                programs.append(program)
                tests.append(line)
                what.append((name, line))
    assert len({w[0] for w in what}) > 25  # the property covers every builtin and module the lines use
    scores, results = _scores(programs, tests)
    bent = [(w, r.reason) for w, s, r in zip(what, scores, results) if (s == 1.0) != (w[0] == "right")]
    assert not bent, f"{len(bent)} of {len(programs)} verdicts wrong: {bent[:8]}"


def test_a_program_that_redefines_every_builtin_still_fails_its_tests():
    flood = (
        "\nimport builtins as _b\n_g = globals()\nfor _n in dir(_b):\n    if not _n.startswith('_'):\n"
        "        _g[_n] = (lambda *a, **k: True)\n"
    )
    programs = [wrong + flood for _, wrong, _ in BUNDLED] + [right + flood for right, _, _ in BUNDLED]
    tests = ["\n".join(lines) for _, _, lines in BUNDLED] * 2
    scores, results = _scores(programs, tests)
    assert scores == [0.0] * len(BUNDLED) + [1.0] * len(BUNDLED), [r.reason for r in results]


# --- item 2: no false negatives on correct code -----------------------------------------------------------------
# (program, tests, what plain Python says): correct and wrong programs over values that are not plain data.
VALUES = [
    (
        "def fact(n):\n    return 1 if n < 2 else n * fact(n - 1)\n",
        "assert fact(25) == 15511210043330985984000000\nassert fact(25) > 2 ** 63 and -fact(30) < 0",
        True,
    ),
    ("def fact(n):\n    return 15511210043330985984000001\n", "assert fact(25) == 15511210043330985984000000", False),
    (
        "def big():\n    return [10 ** 400, {2 ** 70: -(2 ** 90)}]\n",
        "assert big() == [10 ** 400, {2 ** 70: -(2 ** 90)}]",
        True,
    ),
    (
        "def gen(n):\n    yield from range(n)\n",
        "assert list(gen(3)) == [0, 1, 2]\ng = gen(5)\nassert next(g) == 0 and next(g) == 1\nassert sum(gen(4)) == 6\n"
        "assert 2 in gen(3) and 7 not in gen(3)\na, b = gen(2)\nassert (a, b) == (0, 1)",
        True,
    ),
    ("def gen(n):\n    yield from range(n + 1)\n", "assert list(gen(3)) == [0, 1, 2]", False),
    ("def squares(xs):\n    return map(lambda x: x * x, xs)\n", "assert list(squares([1, 2])) == [1, 4]", True),
    ("def pairs(xs):\n    return zip(xs, xs[1:])\n", "assert list(pairs([1, 2, 3])) == [(1, 2), (2, 3)]", True),
    (
        "class P:\n    def __init__(self, x, y):\n        self.x, self.y = x, y\n"
        "    def __eq__(self, o):\n        return isinstance(o, P) and (self.x, self.y) == (o.x, o.y)\n"
        "def mid(a, b):\n    return P((a.x + b.x) / 2, (a.y + b.y) / 2)\n",
        "assert mid(P(0, 0), P(2, 4)) == P(1, 2)\nassert mid(P(0, 0), P(2, 4)) != P(0, 0)\n"
        "assert [mid(P(0, 0), P(2, 2))] == [P(1, 1)]\nassert mid(P(0, 0), P(2, 4)).y == 2",
        True,
    ),
    (
        "class P:\n    def __init__(self, x, y):\n        self.x, self.y = x, y\n"
        "    def __eq__(self, o):\n        return isinstance(o, P) and (self.x, self.y) == (o.x, o.y)\n"
        "def mid(a, b):\n    return P(0, 0)\n",
        "assert mid(P(0, 0), P(2, 4)) == P(1, 2)",
        False,
    ),
    (
        "from fractions import Fraction\ndef half(n):\n    return Fraction(n, 2)\n",
        "from fractions import Fraction\nassert half(3) == Fraction(3, 2)\nassert half(3) + half(1) == 2\n"
        "assert [half(1)] * 2 == [Fraction(1, 2)] * 2\nassert half(1) < 1",
        True,
    ),
    (
        "from fractions import Fraction\ndef half(n):\n    return Fraction(n, 3)\n",
        "from fractions import Fraction\nassert half(3) == Fraction(3, 2)",
        False,
    ),
    (
        "from decimal import Decimal\ndef total(xs):\n    return sum(map(Decimal, xs))\n",
        "from decimal import Decimal\nassert total(['0.1', '0.2']) == Decimal('0.3')\n"
        "assert str(total(['1.50'])) == '1.50'",
        True,
    ),
    (
        "from decimal import Decimal\ndef total(xs):\n    return sum(map(float, xs))\n",
        "from decimal import Decimal\nassert total(['0.1', '0.2']) == Decimal('0.3')",
        False,
    ),
    (
        "from fractions import Fraction\nfrom decimal import Decimal\n"
        "def mixed():\n    return {'f': [Fraction(1, 3)], 'd': (Decimal('2.5'),), 'big': {10 ** 30}}\n",
        "from fractions import Fraction\nfrom decimal import Decimal\n"
        "assert mixed() == {'f': [Fraction(1, 3)], 'd': (Decimal('2.5'),), 'big': {10 ** 30}}",
        True,
    ),
    (
        "from collections import namedtuple\nPoint = namedtuple('Point', 'x y')\ndef origin():\n    return Point(0, 0)\n",
        "assert origin() == (0, 0) and origin().x == 0\nx, y = origin()\nassert (x, y) == (0, 0)",
        True,
    ),
    (
        "from collections import Counter, OrderedDict, defaultdict, deque\n"
        "def c(s):\n    return Counter(s)\ndef o():\n    return OrderedDict(a=1)\n"
        "def d():\n    x = defaultdict(int)\n    x['k'] += 2\n    return x\ndef q():\n    return deque([1, 2])\n",
        "assert c('aab') == {'a': 2, 'b': 1}\nassert o() == {'a': 1}\nassert d() == {'k': 2}\n"
        "assert list(q()) == [1, 2]",
        True,
    ),
    (
        "from collections import Counter\ndef c(s):\n    return Counter(s + 'z')\n",
        "assert c('aab') == {'a': 2, 'b': 1}",
        False,
    ),
    (
        "from enum import IntEnum\nclass Color(IntEnum):\n    RED = 1\ndef red():\n    return Color.RED\n",
        "assert red() == 1",
        True,
    ),
    ("def name():\n    class S(str):\n        pass\n    return S('ab')\n", "assert name() == 'ab'", True),
]


def _plain_python(program: str, tests: str) -> bool:
    """What the tests say of the program in plain Python (the table's own, trusted code)."""
    scope = {"__name__": "__main__"}
    try:
        exec(compile(program + "\n" + tests, "plain", "exec"), scope)
        return True
    except AssertionError:
        return False


def test_values_compare_as_in_plain_python():
    assert all(_plain_python(p, t) == expected for p, t, expected in VALUES)  # the table is right
    scores, results = _scores([p for p, _, _ in VALUES], [t for _, t, _ in VALUES])
    wrong = [
        (p.splitlines()[-1], r.reason, r.stderr[-300:])
        for (p, _, e), s, r in zip(VALUES, scores, results)
        if s != (1.0 if e else 0.0)
    ]
    assert not wrong, wrong


NUMPY = [
    (
        "import numpy as np\ndef f(n):\n    return np.arange(n)\ndef g():\n    return np.float64(1.5)\n"
        "def h():\n    return np.array([[1.5, 2], [3, 4]], dtype=np.float32)\n",
        "import numpy as np\nassert np.allclose(f(3), [0, 1, 2])\nassert (f(3) == np.array([0, 1, 2])).all()\n"
        "assert g() == 1.5 and f(3).shape == (3,)\nassert h().dtype == np.float32 and h()[1, 0] == 3",
        True,
    ),
    (
        "import numpy as np\ndef f(n):\n    return np.arange(n) + 1\n",
        "import numpy as np\nassert np.allclose(f(3), [0, 1, 2])",
        False,
    ),
]


def test_numpy_numbers_and_arrays_compare_as_in_plain_python():
    lim = _limits(drop_privileges=False)  # this interpreter, whose packages the sandbox shows
    if not run_python("import numpy", limits=lim).ok:
        pytest.skip("numpy is not importable in the sandbox's interpreter here")
    assert all(_plain_python(p, t) == expected for p, t, expected in NUMPY)
    scores, results = _scores([p for p, _, _ in NUMPY], [t for _, t, _ in NUMPY], lim)
    assert scores == [1.0, 0.0], [(r.reason, r.stderr[-300:]) for r in results]


def test_what_cannot_be_compared_is_a_judge_error_not_a_silent_0(caplog):
    money = (
        "class Money:\n    def __init__(self, v):\n        self.v = v\n"
        "    def __eq__(self, o):\n        return self.v == o\n    __hash__ = None\n"
        "def cost():\n    return Money(5)\n"
    )
    assert _plain_python(money, "assert cost() == 5")  # plain Python: the program's __eq__ says so
    scores, results = _scores([money, money], ["assert cost() == 5", "assert [cost()] == [5]"])
    assert scores == [0.0, 0.0]
    for r in results:
        assert r.reason.startswith("judge error:") and "compare" in r.reason and not r.tests_completed, r
    # what cannot cross: a value over the channel's limit, a function of the tests', a list too long to send
    odd = (
        "def big():\n    return 'x' * (17 << 20)\ndef apply(f, x):\n    return f(x)\n"
        "def many():\n    return list(range(1_000_001))\n"
    )
    scores, results = _scores(
        [odd] * 3,
        [
            "assert big() == 'x' * (17 << 20)",
            "assert apply(lambda x: x + 1, 2) == 3",
            "assert many() == list(range(1_000_001))",
        ],
        _limits(memory_mb=512),
    )
    assert scores == [0.0] * 3 and all(r.reason.startswith("judge error:") for r in results), results
    # an object of the program's own never equals a plain value by its own say-so (round two's guarantee)
    anything = "class Any:\n    def __eq__(self, o):\n        return True\ndef add(a, b):\n    return Any()\n"
    scores, results = _scores([anything], ["assert add(2, 3) == 5"])
    assert scores == [0.0], results[0]


# --- item 3: nothing of the host within reach -------------------------------------------------------------------
def _world_readable_answer_key() -> Path:
    """A run folder as a careless user leaves it: world-readable, in the checkout's runs/ (git ignores it), outside
    the /tmp, /var/tmp and /dev/shm that every sandbox mode replaces."""
    (ROOT / "runs").mkdir(exist_ok=True)  # left there: a checkout's runs/ is where run folders go
    run = Path(tempfile.mkdtemp(prefix="grpo_kit_answer_key_", dir=str(ROOT / "runs")))
    run.chmod(0o755)
    (run / "samples.jsonl").write_text('{"prompt": "What is 6 x 7?", "answer": "42"}\n')
    (run / "samples.jsonl").chmod(0o644)
    return run


def _others_may_enter(path: Path) -> bool:
    return all(p.stat().st_mode & 0o001 for p in (path, *path.parents))


def test_the_program_sees_a_minimal_file_system():
    run = _world_readable_answer_key()
    host_files = [
        str(run / "samples.jsonl"),
        str(ROOT / "data" / "gsm8k_sample.jsonl"),
        str(ROOT),
        os.path.expanduser("~"),
        "/etc/hostname",
    ]
    try:
        probe = (
            "import os, json\nseen = {}\n"
            f"for p in {host_files!r}:\n"
            "    try:\n        with open(p) as fh:\n            seen[p] = fh.read(20)\n"
            "    except IsADirectoryError:\n        seen[p] = os.listdir(p)[:3]\n"
            "    except OSError as e:\n        seen[p] = None\n"
            "wrote = []\nfor d in ('/run/lock', '/var/lock', '/dev/mqueue', '/usr', '/', '/etc', '/var/tmp/..'):\n"
            "    try:\n        with open(os.path.join(d, 'grpo_kit_probe'), 'wb') as fh:\n"
            "            fh.write(b'x' * (1 << 20))\n        wrote.append(d)\n    except OSError:\n        pass\n"
            "print(json.dumps({'seen': seen, 'root': sorted(os.listdir('/')), 'wrote': wrote}))"
        )
        host = run_python(probe, limits=_limits(filesystem="host"))
        r = run_python(probe, limits=_limits())
        got = json.loads(r.stdout)
        assert not any(got["seen"].values()), got  # no answer key, no checkout, no home, no host file
        assert got["wrote"] == [], got  # nothing writable outside the private /tmp
        python = sandbox._interpreter(_limits())[0]
        paths, links = sandbox.exposed_paths(python)
        shown = {Path(p).parts[1] for p in paths} | {Path(link).parts[1] for link, _ in links}
        assert set(got["root"]) <= shown | {"dev", "proc", "tmp", "var"}, got["root"]
        assert r.extra.get("filesystem") == "minimal", r
        if _others_may_enter(run):  # the attack itself: the weaker mode reads it, as round three found
            assert json.loads(host.stdout)["seen"][str(run / "samples.jsonl")], host
    finally:
        for p in (run / "samples.jsonl", run):
            (p.unlink if p.is_file() else p.rmdir)()


def test_the_answer_key_is_not_within_reach_of_any_reward(tmp_path):
    run = _world_readable_answer_key()
    try:
        cheat = f"import json\nrow = json.loads(open({str(run / 'samples.jsonl')!r}).readline())\nprint(row['answer'])"
        fn = make_python_code_reward(_limits())
        assert fn(None, [_block(cheat)], answer=["42"]) == [0.0]
        assert fn(None, [_block(cheat)], expected_output=["42"]) == [0.0]
        if _others_may_enter(run):  # the weaker mode, named: the answer key is within its reach
            assert make_python_code_reward(_limits(filesystem="host"))(None, [_block(cheat)], answer=["42"]) == [1.0]
    finally:
        (run / "samples.jsonl").unlink()
        run.rmdir()


def test_without_a_mount_namespace_code_execution_is_refused_unless_opted_in(monkeypatch, caplog):
    monkeypatch.setitem(sandbox._MINIMAL_OK, True, False)  # as on a machine where none can be built
    monkeypatch.setitem(sandbox._MINIMAL_OK, False, False)
    r = run_python("print(1)", limits=_limits())
    assert not r.ok and r.reason.startswith("refused: ") and "filesystem='host'" in r.reason, r
    r = run_python("print(1)", limits=_limits(filesystem="host"))
    assert r.ok and r.stdout == "1\n" and r.extra["filesystem"] == "host", r
    with pytest.raises(ValueError, match="filesystem='nfs'"):
        SandboxLimits(filesystem="nfs")


# --- item 4: memory counted wherever it hides -------------------------------------------------------------------
HOLD = """
import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
libc.shmat.restype = ctypes.c_void_p
held = 0
try:
    for i in range(STEPS):
        STEP
        held += CHUNK
except Exception:
    pass
print(held >> 20, flush=True)
"""
# How each route held memory outside the address space at HEAD (as root, cgroup v1): (one step, bytes per step).
# Writes to a file (memfd, tmpfs) are capped by RLIMIT_FSIZE one file at a time, so each step takes a new one.
ROUTES = {
    "memfd": ("os.write(os.memfd_create(f'm{i}'), b'x' * CHUNK)", 1 << 20),
    "sysv_shm": (
        "sid = libc.shmget(0, CHUNK, 0o1600)\n        assert sid >= 0, ctypes.get_errno()\n"
        "        addr = libc.shmat(sid, None, 0)\n        assert addr not in (None, 2 ** 64 - 1)\n"
        "        ctypes.memset(addr, 1, CHUNK)\n        libc.shmdt(ctypes.c_void_p(addr))",
        8 << 20,
    ),
    "sysv_msg": (
        "q = libc.msgget(0, 0o1600)\n        assert q >= 0, ctypes.get_errno()\n"
        "        buf = ctypes.create_string_buffer(8 + 8192)\n"
        "        ctypes.c_long.from_buffer(buf).value = 1\n"
        "        assert libc.msgsnd(q, buf, 8192, 0o4000) == 0 == libc.msgsnd(q, buf, 8192, 0o4000)",
        16384,
    ),
    "user_namespace_tmpfs": (
        "if i == 0:\n            uid, gid = os.getuid(), os.getgid()\n"
        "            assert libc.unshare(0x10000000 | 0x20000) == 0, ctypes.get_errno()\n"
        "            for name, text in (('setgroups', 'deny'), ('uid_map', f'0 {uid} 1'), "
        "('gid_map', f'0 {gid} 1')):\n"
        "                open(f'/proc/self/{name}', 'w').write(text)\n"
        "            os.makedirs('m', exist_ok=True)\n"
        "            assert libc.mount(b'none', b'm', b'tmpfs', 0, b'size=2g') == 0\n"
        "        open(f'm/{i}', 'wb').write(b'x' * CHUNK)",
        1 << 20,
    ),
}


@pytest.mark.parametrize("route", sorted(ROUTES))
def test_memory_outside_the_address_space_is_closed(route):
    step, chunk = ROUTES[route]
    code = HOLD.replace("STEPS", str((384 << 20) // chunk)).replace("STEP\n", step + "\n").replace("CHUNK", str(chunk))
    lim = _limits(memory_mb=64, disk_mb=8, timeout_s=20.0)
    r = run_python(code, limits=lim)
    held_mib = int(r.stdout.split()[-1]) if r.stdout.split() else 0
    assert held_mib <= lim.memory_mb + sandbox.memory_allowance_mb(lim), (route, held_mib, r)


def test_descriptors_per_process_are_bounded():
    code = (
        "import os\nn = 0\ntry:\n    while True:\n        os.pipe()\n        n += 2\nexcept OSError:\n    pass\n"
        "print(n)"
    )
    r = run_python(code, limits=_limits())
    assert int(r.stdout) <= sandbox.MAX_OPEN_FILES, r


def test_the_weaker_mode_is_opt_in_and_named_in_the_plan_line(tmp_path, monkeypatch):
    from grpo_kit.app import run as run_mod
    from grpo_kit.app.config import ConfigError, GRPOKitConfig
    from grpo_kit.app.console import plan_lines

    with pytest.raises(ConfigError, match="sandbox_filesystem='nfs' is not allowed"):
        GRPOKitConfig(sandbox_filesystem="nfs").validate()
    plan = {
        mode: "\n".join(
            plan_lines(GRPOKitConfig(sandbox_filesystem=mode), device="cpu", dtype="float32", info={"backend": "hf"})
        )
        for mode in sandbox.FILESYSTEMS
    }
    assert "sandbox" not in plan["minimal"] and "sandbox_filesystem=host, the weaker mode" in plan["host"]
    seen = []

    def stop(cfg):
        seen.append(sandbox.default_filesystem())
        raise ValueError("stopped after the setting")

    monkeypatch.setattr(sandbox, "_DEFAULT_FILESYSTEM", ["minimal"])
    monkeypatch.setattr(run_mod, "build_datasets", stop)
    for mode in ("host", "minimal"):
        with pytest.raises(ValueError, match="stopped after the setting"):
            run_mod.train(
                GRPOKitConfig(model="tiny-llama", sandbox_filesystem=mode, output_dir=str(tmp_path / "r")),
                progress=False,
            )
    assert seen == ["host", "minimal"]  # what the code reward and the python tool then run under
