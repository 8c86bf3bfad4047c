"""`tak`'s last line of defence: whatever a command raises is one line on stderr
with a non-zero exit (an interrupt 130, a ``SystemExit`` its own code), and `--debug`
shows the traceback (issue 14, item 4); and the "show it" hint runs as printed, whatever
the home is called."""

from __future__ import annotations

import argparse
import errno
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from kernel import cli
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


def fake_command(
    monkeypatch: pytest.MonkeyPatch, raise_: BaseException, *, debug: bool = False
) -> None:
    def boom(args: argparse.Namespace) -> int:
        raise raise_

    parser = argparse.ArgumentParser(prog="tak")
    parser.set_defaults(func=boom, command="x", debug=debug)
    monkeypatch.setattr(cli, "build_parser", lambda: parser)


def test_system_exit_from_a_command_is_not_swallowed(monkeypatch: pytest.MonkeyPatch) -> None:
    fake_command(monkeypatch, SystemExit(3))
    with pytest.raises(SystemExit) as caught:
        cli.main([])
    assert caught.value.code == 3


def test_keyboard_interrupt_inside_a_group_is_130(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    fake_command(
        monkeypatch, BaseExceptionGroup("g", [BaseExceptionGroup("h", [KeyboardInterrupt()])])
    )
    assert cli.main([]) == 130
    assert capsys.readouterr().err == "\ntak x: interrupted\n"


def test_a_broken_pipe_that_is_not_stdout_is_an_error(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # stdout is fine here (pytest's capture); the pipe that broke was another one.
    fake_command(monkeypatch, BrokenPipeError(errno.EPIPE, "Broken pipe"))
    code = cli.main([])
    assert code != 0
    assert "Broken pipe" in capsys.readouterr().err


def test_an_unexpected_error_is_one_line_naming_debug(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    fake_command(monkeypatch, RuntimeError("multi\nline"))
    assert cli.main([]) == 1
    err = capsys.readouterr().err
    assert err.startswith("tak x: internal error: RuntimeError") and "--debug" in err


@pytest.mark.parametrize(
    "home", ["/tmp/my home", "/tmp/it's here", '/tmp/"quoted" $HOME `x`', "-starts-with-dash"]
)
def test_the_show_it_hint_is_runnable_as_printed_with_any_home(home: str) -> None:
    from kernel.cli._common import home_option, tak_command

    hint = tak_command(*home_option(home), "sessions", "show", "abc", "--project", "my proj")
    words = shlex.split(hint)
    assert words[1:] == ["--home", home, "sessions", "show", "abc", "--project", "my proj"]


def test_a_tak_home_with_a_newline_is_usable_and_its_hint_round_trips(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    home = tmp_path / "odd\nhome"
    code = cli.main(["--home", str(home), "run", "hi"])
    assert code == 0
    out = capsys.readouterr().out
    hint = out.split("show it:    ", 1)[1].rstrip("\n")
    words = shlex.split(hint)
    assert words[words.index("--home") + 1] == str(home)
