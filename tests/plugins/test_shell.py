"""The ``shell`` built-in plugin with real processes, in the test's own process."""

from __future__ import annotations

import contextlib
import errno
import os
import signal
import subprocess
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
from builtin_kit import run_calls, tool_context

from kernel.tools import ToolFailure
from plugins import shell
from tests.hang_guard import hang_guard


@pytest.fixture
def ws(tmp_path: Path) -> Iterator[Path]:
    root = tmp_path / "ws"
    root.mkdir()
    with tool_context(root):
        yield root


def is_gone(pid: int) -> bool:
    """Gone, or a zombie nobody reaps yet (init in a container may be slow to)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] in ("Z", "X")
    except FileNotFoundError:
        return True


def wait_until_gone(pid: int, within: float = 30.0) -> bool:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if is_gone(pid):
            return True
        time.sleep(0.02)
    return False


def test_string_runs_in_sh_in_the_workspace(ws: Path) -> None:
    out = shell.run_command.fn("echo out; echo err >&2; pwd; ls | wc -l; exit 3")
    assert out == f"exit code 3\nstdout:\nout\n{ws}\n0\nstderr:\nerr\n"


def test_argv_runs_without_a_shell(ws: Path) -> None:
    out = shell.run_command.fn(["echo", "$HOME; touch pwned", "`id`"])
    assert out == "exit code 0\nstdout:\n$HOME; touch pwned `id`\n"
    assert not (ws / "pwned").exists()
    assert shell.run_command.fn(["true"]) == "exit code 0\n(no output)\n"


def test_commands_do_not_see_the_kernels_secrets(ws: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OPENAI_API_KEY", "sk-should-not-leak")
    out = shell.run_command.fn(["env"])
    assert "sk-should-not-leak" not in out
    assert "PATH=" in out


def test_a_signal_is_reported(ws: Path) -> None:
    assert shell.run_command.fn("kill -KILL $$") == "killed by signal 9 (SIGKILL)\n(no output)\n"


def test_deadline_kills_the_whole_process_group(ws: Path) -> None:
    # Unkilled, the command would sleep an hour: only the deadline's kill ends it.
    with hang_guard(), pytest.raises(ToolFailure) as info:
        shell.run_command.fn("sleep 3600 & echo $! > bg.pid; echo started; sleep 3600", timeout=0.5)
    assert info.value.kind == "timeout"
    assert info.value.message == (
        "command did not finish within 0.5 s and was killed\nstdout:\nstarted\n"
    )
    assert wait_until_gone(int((ws / "bg.pid").read_text()))


def test_background_programs_end_with_the_command(ws: Path) -> None:
    with hang_guard():  # a command waiting for its hour-long background program
        out = shell.run_command.fn("sleep 3600 & echo $! > bg.pid; echo done")
    assert out == "exit code 0\nstdout:\ndone\n"
    assert wait_until_gone(int((ws / "bg.pid").read_text()))


def test_output_keeps_head_and_tail_with_a_marker(ws: Path) -> None:
    out = shell.run_command.fn(
        "echo START; head -c 200000 /dev/zero | tr '\\0' a; echo; echo END; "
        "head -c 50000 /dev/zero | tr '\\0' e >&2"
    )
    stdout, _, stderr = out.partition("stderr:\n")
    assert stdout.startswith("exit code 0\nstdout:\nSTART\naaa")
    assert stdout.rstrip().endswith("aaa\nEND")
    assert "[... 168011 bytes of stdout truncated; 200011 bytes in all, showing the first" in stdout
    assert "bytes of stderr truncated; 50000 bytes in all" in stderr
    assert len(out) < 2 * shell.MAX_STREAM_BYTES + 1000


def test_bad_commands(ws: Path) -> None:
    with pytest.raises(FileNotFoundError, match="program not found: 'no-such-program'"):
        shell.run_command.fn(["no-such-program"])
    with pytest.raises(ValueError, match="command is an empty list"):
        shell.run_command.fn([])
    with pytest.raises(ValueError, match="command is empty"):
        shell.run_command.fn("  ")
    with pytest.raises(ValueError, match="timeout must be more than 0 and at most 600 s"):
        shell.run_command.fn("true", timeout=0)
    (ws / "script.sh").write_text("echo hi\n")
    with pytest.raises(PermissionError, match=r"cannot run './script.sh': permission denied"):
        shell.run_command.fn(["./script.sh"])


def test_without_a_process_group_of_its_own(ws: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """As in a sandbox worker, whose seccomp filter refuses setpgid."""
    real_popen = shell._popen

    def refusing_setpgid(
        argv: Sequence[str], *args: Any, process_group: int | None, **kwargs: Any
    ) -> subprocess.Popen[bytes]:
        if process_group is not None:
            raise PermissionError(errno.EPERM, "Operation not permitted")
        return real_popen(argv, *args, process_group=process_group, **kwargs)

    monkeypatch.setattr(shell, "_popen", refusing_setpgid)
    assert shell.run_command.fn("echo hi; exit 2") == "exit code 2\nstdout:\nhi\n"
    with pytest.raises(ToolFailure, match=r"did not finish within 0.3 s") as info:
        shell.run_command.fn(["sh", "-c", "echo $$ > sh.pid; echo x; sleep 60"], timeout=0.3)
    assert info.value.kind == "timeout"
    assert wait_until_gone(int((ws / "sh.pid").read_text()))
    # A leftover holding the pipes is not waited for: the worker's group kill ends it.
    try:
        with hang_guard():  # not waited for: it would hold the output for an hour
            out = shell.run_command.fn("sleep 3600 & echo $! > bg.pid; echo done")
    finally:
        with contextlib.suppress(FileNotFoundError, ValueError, ProcessLookupError):
            os.kill(int((ws / "bg.pid").read_text()), signal.SIGKILL)  # no group kill here
    assert out == (
        "exit code 0\nstdout:\ndone\n"
        "[programs the command left in the background still hold its output; stopped reading]\n"
    )
    os.kill(int((ws / "bg.pid").read_text()), 9)


async def test_shell_through_the_executor(ws: Path) -> None:
    ok, failed, slow, bad = await run_calls(
        shell.plugin,
        [
            ("run_command", {"command": ["echo", "hi"]}),
            ("run_command", {"command": "echo oops >&2; exit 1"}),
            ("run_command", {"command": "sleep 30", "timeout": 0.3}),
            ("run_command", {"command": 5}),
        ],
    )
    assert ok.content == "exit code 0\nstdout:\nhi\n" and not ok.is_error
    assert failed.content == "exit code 1\nstderr:\noops\n" and not failed.is_error
    assert slow.error is not None and slow.error.kind == "timeout"
    assert slow.error.type == "CommandTimeout"
    assert (
        slow.content
        == "Error (timeout): command did not finish within 0.3 s and was killed\n(no output)\n"
    )
    assert bad.error is not None and bad.error.kind == "bad_arguments"


def test_shell_permissions() -> None:
    assert not shell.plugin.in_process
    assert shell.plugin.permissions.subprocess
    assert shell.plugin.permissions.workspace == "write"
