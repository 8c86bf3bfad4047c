"""A refusal is the command's whole output: one line saying what is wrong, exit 2.

A ``TAK_HOME`` that is a file is named as such (the system's own words, "File
exists" or "Not a directory", are about a path below it); ``tak serve`` and
``tak mcp serve --http`` refuse a non-loopback host before a kernel is opened,
so no log line comes first.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import attrs
import pytest

from kernel.cli import main
from kernel.cli._exit import exit_code


@attrs.frozen
class Refused:
    returncode: int
    stdout: str
    stderr: str


@pytest.fixture
def tak(
    monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> Callable[..., Refused]:
    """``tak ARGV...`` in this process, its status and what it wrote (its descriptors:
    a log handler's lines too)."""
    monkeypatch.delenv("TAK_HOME", raising=False)
    monkeypatch.delenv("TAK_STORE_URL", raising=False)

    def run(*argv: str) -> Refused:
        capfd.readouterr()
        try:
            code = main(list(argv))
        except SystemExit as exc:
            code = exit_code(exc)
        out, err = capfd.readouterr()
        return Refused(code, out, err)

    return run


@pytest.mark.parametrize(
    ("command", "prog"),
    [
        (["tools"], "tak tools"),
        (["run", "hi"], "tak run"),
        (["sessions", "ls"], "tak: error"),
        (["mcp", "ls"], "tak mcp ls"),
        (["batch", "ls"], "tak batch ls"),
        (["serve", "--port", "0"], "tak serve"),
    ],
)
def test_a_tak_home_that_is_a_file_is_said_so(
    tak: Callable[..., Refused], tmp_path: Path, command: list[str], prog: str
) -> None:
    home = tmp_path / "home"
    home.write_text("")
    refused = tak("--home", str(home), *command)
    assert refused.returncode == 2, refused.stdout + refused.stderr
    assert refused.stderr.splitlines() == [f"{prog}: TAK_HOME {home} is a file, not a directory"]
    assert not home.is_dir() and home.read_text() == ""  # nothing made beside it either


@pytest.mark.parametrize(
    "command",
    [["serve", "--host", "0.0.0.0", "--port", "0"], ["mcp", "serve", "--http", "0.0.0.0:0"]],
)
def test_a_remote_host_is_refused_before_anything_is_logged(
    tak: Callable[..., Refused], tmp_path: Path, command: list[str]
) -> None:
    refused = tak("--home", str(tmp_path / "home"), *command)
    assert refused.returncode == 2, refused.stdout + refused.stderr
    prog = "tak mcp serve" if command[0] == "mcp" else "tak serve"
    assert refused.stderr.splitlines() == [
        f"{prog}: refusing to bind '0.0.0.0': not a loopback address (--allow-remote to serve "
        "other machines, and put TLS in front)"
    ]
    assert refused.stdout == ""
    assert not (tmp_path / "home").exists()  # refused before the home was made
