"""The ``python`` built-in plugin: real fresh interpreters, in the test's own process."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from builtin_kit import run_calls, tool_context

from kernel.tools import ToolFailure
from plugins import python
from tests.hang_guard import hang_guard


@pytest.fixture
def ws(tmp_path: Path) -> Iterator[Path]:
    root = tmp_path / "ws"
    root.mkdir()
    with tool_context(root):
        yield root


def test_output_and_the_last_expression_value(ws: Path) -> None:
    out = python.run_python.fn(
        "import sys\nx = 6\nprint('hi')\nprint('warn', file=sys.stderr)\nx * 7"
    )
    assert out == "stdout:\nhi\nstderr:\nwarn\nvalue:\n42"
    assert python.run_python.fn("{'a': [1, 2]}") == "value:\n{'a': [1, 2]}"
    assert python.run_python.fn("x = 1") == "(no output and no value)"
    assert python.run_python.fn("print('only')\nNone") == "stdout:\nonly"


def test_runs_fresh_and_isolated_in_the_workspace(
    ws: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("OPENAI_API_KEY", "sk-should-not-leak")
    python.run_python.fn("open('made.txt', 'w').write('x')\nimport json\nsecret = 1")
    assert (ws / "made.txt").read_text() == "x"
    assert python.run_python.fn("import os\nos.getcwd()") == f"value:\n{str(ws)!r}"
    # A fresh interpreter: nothing from the last call, isolated mode, no secrets.
    assert python.run_python.fn("'secret' in globals()") == "value:\nFalse"
    assert python.run_python.fn("import sys\nsys.flags.isolated") == "value:\n1"
    assert python.run_python.fn("import os\n'OPENAI_API_KEY' in os.environ") == "value:\nFalse"


def test_an_exception_shows_the_snippets_traceback(ws: Path) -> None:
    out = python.run_python.fn("print('before')\ndef f():\n    return 1 / 0\nf()")
    assert out.startswith(
        "exit code 1\nstdout:\nbefore\nstderr:\nTraceback (most recent call last):\n"
    )
    assert '  File "<cell>", line 4, in <module>\n    f()\n' in out
    assert '  File "<cell>", line 3, in f\n    return 1 / 0\n' in out
    assert out.endswith("ZeroDivisionError: division by zero")
    assert "runner" not in out and "exec(" not in out
    syntax = python.run_python.fn("def broken(:\n    pass")
    assert syntax.startswith("exit code 1\nstderr:\n")
    assert syntax.endswith("SyntaxError: invalid syntax")
    assert python.run_python.fn("raise SystemExit(4)") == "exit code 4"


def test_deadline_kills_the_interpreter_and_keeps_output(ws: Path) -> None:
    # Unkilled, the code would sleep an hour: only the deadline's kill ends it. The
    # deadline leaves a loaded machine (3-4x slower) time to start the interpreter and
    # print before it: at 0.5 s, a slow run was killed before 'working' came.
    with hang_guard(), pytest.raises(ToolFailure) as info:
        python.run_python.fn("import time\nprint('working')\ntime.sleep(3600)", timeout=3)
    assert info.value.kind == "timeout"
    assert info.value.message == ("code did not finish within 3 s and was killed\nstdout:\nworking")


def test_output_and_value_are_capped(ws: Path) -> None:
    out = python.run_python.fn("print('y' * 100_000)\n'v' * 100_000")
    stdout, _, value = out.partition("value:\n")
    assert "bytes of stdout truncated; 100001 bytes in all" in stdout
    assert "bytes of value truncated; 100002 bytes in all" in value
    assert len(value) < python.MAX_VALUE_BYTES + 200
    with pytest.raises(ValueError, match="write it to a file in the workspace"):
        python.run_python.fn("#" * 200_000)


def test_a_failing_repr_is_reported(ws: Path) -> None:
    code = "class A:\n    def __repr__(self):\n        raise RuntimeError('nope')\nA()"
    assert python.run_python.fn(code) == "value:\n<repr failed: RuntimeError: nope>"


async def test_python_through_the_executor(ws: Path) -> None:
    ok, raised, slow = await run_calls(
        python.plugin,
        [
            ("run_python", {"code": "sum(range(10))"}),
            ("run_python", {"code": "1/0"}),
            ("run_python", {"code": "while True: pass", "timeout": 0.3}),
        ],
    )
    assert ok.content == "value:\n45" and not ok.is_error
    assert not raised.is_error and raised.content.startswith("exit code 1\nstderr:\nTraceback")
    assert slow.error is not None and slow.error.kind == "timeout"
    assert slow.content == "Error (timeout): code did not finish within 0.3 s and was killed"


def test_python_permissions() -> None:
    assert not python.plugin.in_process
    assert python.plugin.permissions.subprocess
