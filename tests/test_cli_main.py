"""`tak`'s last line of defence: whatever a command raises is one line on stderr
with a non-zero exit, and `--debug` shows the traceback (issue 14, item 4)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from kernel.cli import main

TAK = str(Path(sys.executable).with_name("tak"))


def test_an_unexpected_error_is_one_line_and_debug_shows_the_traceback(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from kernel.cli import tools

    def broken(args: object) -> int:
        raise RuntimeError("something inside broke")

    monkeypatch.setattr(tools, "cmd_tools", broken)
    assert main(["tools"]) == 1
    err = capsys.readouterr().err
    assert err == (
        "tak tools: internal error: RuntimeError: something inside broke "
        "(run with --debug for the traceback)\n"
    )
    with pytest.raises(RuntimeError, match="something inside broke"):
        main(["--debug", "tools"])


def test_an_os_error_names_the_reason_and_the_path(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from kernel.cli import tools

    def denied(args: object) -> int:
        raise PermissionError(13, "Permission denied", "/srv/tak/data")

    monkeypatch.setattr(tools, "cmd_tools", denied)
    assert main(["tools"]) == 1
    assert capsys.readouterr().err == "tak tools: /srv/tak/data: Permission denied\n"


def test_a_closed_pipe_is_not_a_traceback(tmp_path: Path) -> None:
    tak = subprocess.Popen(
        [TAK, "--home", str(tmp_path), "tools"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    assert tak.stdout is not None and tak.stderr is not None
    tak.stdout.readline()
    tak.stdout.close()  # `| head -1`
    err = tak.stderr.read()
    assert tak.wait(60) == 0
    assert b"Traceback" not in err and b"BrokenPipe" not in err
