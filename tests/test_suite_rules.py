"""Rules the test suite keeps about itself, checked by reading its source (``ast``).

- No test asserts elapsed wall-clock time (on a loaded machine every bound is wrong):
  deadlines are tested under the autojump clock, work by counters, speed in bench/.
- No test imports from ``conftest``: that name is whichever folder's conftest.py was
  loaded last, so selecting several folders at once broke collection.
- Selecting several folders at once collects.
"""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

TESTS = Path(__file__).parent
ROOT = TESTS.parent

# Clocks whose readings are wall time. trio.current_time is one too, unless the
# test runs under a MockClock (autojump_clock, thread_clock): there it is virtual
# time, exact and independent of the machine's speed.
_WALL_CLOCKS = {
    "time.monotonic",
    "time.monotonic_ns",
    "time.perf_counter",
    "time.perf_counter_ns",
    "time.time",
    "time.time_ns",
    "monotonic",
    "perf_counter",
}
_TRIO_CLOCK = "trio.current_time"
_MOCK_CLOCK_FIXTURES = {"autojump_clock", "thread_clock", "mock_clock"}


def _dotted(node: ast.expr) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return f"{_dotted(node.value)}.{node.attr}"
    return ""


def _test_files() -> Iterator[Path]:
    for path in sorted(TESTS.rglob("*.py")):
        if ".venv" not in path.parts:
            yield path


class _Durations:
    """Finds ``assert``s that compare a duration measured with a wall clock.

    A *timestamp* is a wall-clock reading, or a name assigned one. A *duration* is a
    difference of timestamps, a name assigned one (or a list appended one, and the
    loop variables over it), or a call of a function of the module that returns one
    (``fs_call_seconds``; of a tuple, only the positions that are durations).
    """

    def __init__(self, tree: ast.Module, uses_mock_clock: set[str]) -> None:
        self.tree = tree
        self.uses_mock_clock = uses_mock_clock
        self.found: list[tuple[int, str]] = []
        # function name -> the positions of its returned tuple that are durations
        # (None: the whole value)
        self.returns: dict[str, set[int] | None] = {}
        for _ in range(2):  # helpers returning what other helpers return
            self._find_returns()

    def _is_clock(self, node: ast.AST, mock: bool) -> bool:
        if not isinstance(node, ast.Call):
            return False
        name = _dotted(node.func)
        return name in _WALL_CLOCKS or (name == _TRIO_CLOCK and not mock)

    def _is_stamp(self, node: ast.AST, stamps: set[str], mock: bool) -> bool:
        return any(
            self._is_clock(n, mock) or (isinstance(n, ast.Name) and n.id in stamps)
            for n in ast.walk(node)
        )

    def _is_duration(self, node: ast.AST, names: tuple[set[str], set[str]], mock: bool) -> bool:
        stamps, durations = names
        for n in ast.walk(node):
            if isinstance(n, ast.BinOp) and isinstance(n.op, ast.Sub):
                if self._is_stamp(n.left, stamps, mock) and self._is_stamp(n.right, stamps, mock):
                    return True
            elif isinstance(n, ast.Name) and n.id in durations:
                return True
            elif isinstance(n, ast.Call) and self.returns.get(_dotted(n.func), set()) is None:
                return True
        return False

    def _scan(self, fn: ast.AST, mock: bool) -> tuple[set[str], set[str]]:
        stamps: set[str] = set()
        durations: set[str] = set()
        names = (stamps, durations)
        for _ in range(3):  # names defined from names defined further down the loop
            for node in ast.walk(fn):
                if isinstance(node, ast.Assign | ast.AnnAssign | ast.AugAssign):
                    if node.value is not None:
                        targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                        self._assign(targets, node.value, names, mock)
                elif (
                    isinstance(node, ast.Call)
                    and isinstance(node.func, ast.Attribute)
                    and node.func.attr in ("append", "extend", "add")
                    and isinstance(node.func.value, ast.Name)
                    and any(self._is_duration(arg, names, mock) for arg in node.args)
                ):
                    durations.add(node.func.value.id)
                elif isinstance(node, ast.comprehension | ast.For) and self._is_duration(
                    node.iter, names, mock
                ):
                    durations.update(n.id for n in ast.walk(node.target) if isinstance(n, ast.Name))
        return stamps, durations

    def _assign(
        self, targets: list[ast.expr], value: ast.expr, names: tuple[set[str], set[str]], mock: bool
    ) -> None:
        stamps, durations = names
        called = value.value if isinstance(value, ast.Await) else value
        positions = (
            self.returns.get(_dotted(called.func), set()) if isinstance(called, ast.Call) else set()
        )
        for target in targets:
            if positions and isinstance(target, ast.Tuple):
                for i, element in enumerate(target.elts):
                    if i in positions:
                        durations.update(n.id for n in ast.walk(element) if isinstance(n, ast.Name))
                continue
            found = [n.id for n in ast.walk(target) if isinstance(n, ast.Name)]
            if self._is_duration(value, names, mock):
                durations.update(found)
            elif self._is_stamp(value, stamps, mock):
                stamps.update(found)

    def _functions(self) -> Iterator[tuple[ast.FunctionDef | ast.AsyncFunctionDef, bool]]:
        for node in ast.walk(self.tree):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                yield node, node.name in self.uses_mock_clock

    def _find_returns(self) -> None:
        for fn, mock in self._functions():
            names = self._scan(fn, mock)
            for ret in ast.walk(fn):
                if not isinstance(ret, ast.Return) or ret.value is None:
                    continue
                if isinstance(ret.value, ast.Tuple):
                    hits = {
                        i
                        for i, element in enumerate(ret.value.elts)
                        if self._is_duration(element, names, mock)
                    }
                    if hits:
                        self.returns[fn.name] = hits
                elif self._is_duration(ret.value, names, mock):
                    self.returns[fn.name] = None

    def check(self) -> None:
        for fn, mock in self._functions():
            names = self._scan(fn, mock)
            for a in ast.walk(fn):
                if not isinstance(a, ast.Assert):
                    continue
                for cmp in ast.walk(a.test):
                    if isinstance(cmp, ast.Compare) and any(
                        self._is_duration(side, names, mock)
                        for side in [cmp.left, *cmp.comparators]
                    ):
                        self.found.append((a.lineno, ast.unparse(cmp)))
                        break


def _mock_clock_functions(tree: ast.Module) -> set[str]:
    """Functions that run under a MockClock: tests taking one, and the functions
    nested in them (their helpers defined inside)."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            params = {a.arg for a in [*node.args.args, *node.args.kwonlyargs]}
            if params & _MOCK_CLOCK_FIXTURES:
                names.update(
                    n.name
                    for n in ast.walk(node)
                    if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)
                )
    return names


#: A file naming none of these reads no wall clock: nothing in it can be a duration.
_CLOCK_WORDS = re.compile(r"monotonic|perf_counter|time_ns|\btime\(|current_time")


def elapsed_time_assertions(path: Path, root: Path = ROOT) -> list[str]:
    """``path:line: comparison`` for each assert comparing a wall-clock duration."""
    source = path.read_text()
    if not _CLOCK_WORDS.search(source):
        return []
    tree = ast.parse(source, str(path))
    finder = _Durations(tree, _mock_clock_functions(tree))
    finder.check()
    rel = path.relative_to(root)
    return [f"{rel}:{line}: {text}" for line, text in sorted(set(finder.found))]


def test_no_test_asserts_elapsed_wall_clock_time() -> None:
    found = [hit for path in _test_files() for hit in elapsed_time_assertions(path)]
    assert not found, (
        "elapsed wall-clock time asserted (use autojump_clock, a counter, or bench/):\n"
        + "\n".join(found)
    )


def test_the_rule_sees_the_shapes_it_forbids(tmp_path: Path) -> None:
    """The checker itself: each forbidden shape is found; the allowed ones are not."""
    sample = tmp_path / "test_sample.py"
    sample.write_text(
        "import time, trio\n"
        "def seconds():\n"
        "    t0 = time.perf_counter()\n"
        "    return time.perf_counter() - t0\n"
        "def test_a():\n"
        "    started = time.monotonic()\n"
        "    assert time.monotonic() - started < 5\n"
        "def test_b():\n"
        "    elapsed = seconds()\n"
        "    assert elapsed < 4.0\n"
        "async def test_c():\n"
        "    t0 = trio.current_time()\n"
        "    assert trio.current_time() - t0 < 1\n"
        "async def test_d(autojump_clock):\n"
        "    t0 = trio.current_time()\n"
        "    assert trio.current_time() - t0 == 30\n"  # virtual time: allowed
        "def test_e():\n"
        "    assert seconds() < 1\n"
        "def stall():\n"
        "    gaps = []\n"
        "    last = time.monotonic()\n"
        "    gaps.append(time.monotonic() - last)\n"
        "    return 'result', max(gaps)\n"
        "def test_f():\n"
        "    result, worst = stall()\n"
        "    assert result == 'result'\n"  # not a duration: allowed
        "    assert worst < 0.5\n"
        "def test_g():\n"
        "    cut = []\n"
        "    t0 = time.monotonic()\n"
        "    cut.append(time.monotonic() - t0)\n"
        "    assert all(t < 1 for t in cut)\n"
        "def test_h():\n"
        "    deadline = time.monotonic() + 30\n"
        "    assert len([deadline]) == 1\n"  # no duration in it: allowed
    )
    found = [hit.split(":")[1] for hit in elapsed_time_assertions(sample, root=tmp_path)]
    assert found == ["7", "10", "13", "18", "27", "32"]


def test_no_test_imports_from_conftest() -> None:
    found = []
    for path in _test_files():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            # (a conftest named by its package, tests.x.conftest, is one module: not the collision)
            if isinstance(node, ast.ImportFrom) and node.module == "conftest":
                found.append(f"{path.relative_to(ROOT)}:{node.lineno}")
            elif isinstance(node, ast.Import) and any(a.name == "conftest" for a in node.names):
                found.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not found, "import from a kit module instead: " + ", ".join(found)


def test_several_folders_collect_at_once() -> None:
    """Every folder with a conftest.py, selected together (the root one last: a
    folder's own conftest is then not the last one loaded)."""
    folders = sorted(str(p.parent.relative_to(ROOT)) for p in TESTS.glob("*/conftest.py"))
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "--collect-only",
            "-q",
            "-p",
            "no:cacheprovider",
            *folders,
            "tests/test_layers.py",
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**os.environ, "PYTEST_ADDOPTS": ""},
        timeout=600,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert " collected" in result.stdout.splitlines()[-1]


def test_a_stuck_test_is_named_and_the_run_goes_on(tmp_path: Path) -> None:
    """A test blocked for good (no deadline of its own) fails by name at the suite's
    hang limit (tests/hang_guard.py), and the rest of the run still runs."""
    (tmp_path / "test_stuck.py").write_text(
        "import threading\n\n"
        "def test_stuck():\n    threading.Event().wait()\n\n"
        "def test_after():\n    pass\n"
    )
    options = ["-c", os.devnull, "--rootdir", str(tmp_path), "-p", "tests.hang_guard",
               "-p", "no:cacheprovider", "-n", "1", "-q"]  # fmt: skip
    result = subprocess.run(
        [sys.executable, "-m", "pytest", *options, str(tmp_path / "test_stuck.py")],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**os.environ, "PYTEST_ADDOPTS": "", "TAK_TEST_HANG_S": "2"},
        timeout=600,
    )
    out = result.stdout + result.stderr
    assert result.returncode == 1, out[-3000:]
    assert "crashed while running 'test_stuck.py::test_stuck'" in out, out[-3000:]
    assert "in test_stuck" in out  # the stack it was stuck in
    assert "1 passed" in out  # test_after, on a new worker
