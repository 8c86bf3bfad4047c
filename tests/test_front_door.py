"""The front door (issue 14, item 4): every failure a user can cause from ``tak`` or
``tak repl`` is one line on stderr with a non-zero status, never a traceback, and
every command a hint prints runs as printed where ``tak`` is not on ``PATH``.

Each test runs the installed ``tak`` script as a real process.
"""

from __future__ import annotations

import json
import os
import pty
import re
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.cli_kit import one_line, tak

TAK = Path(sys.executable).with_name("tak")
FIXTURES = Path(__file__).parent / "plugins" / "fixtures"
ROOT = Path(__file__).parent.parent


def _env_without_tak(**extra: str) -> dict[str, str]:
    """The environment of a fresh machine: no ``tak`` on ``PATH``."""
    env = {k: v for k, v in os.environ.items() if k != "TAK_HOME"}
    env["PATH"] = os.pathsep.join(
        d for d in env.get("PATH", "").split(os.pathsep) if d and not (Path(d) / "tak").exists()
    )
    env.update(extra)
    return env


def installed_tak(
    *args: str, home: Path | str | None = None, **kwargs: Any
) -> subprocess.CompletedProcess[str]:
    """The installed ``tak`` script, run where it is not on ``PATH``, its home from
    ``TAK_HOME`` (``home``) as a user's shell would give it."""
    environ = _env_without_tak(**({"TAK_HOME": str(home)} if home is not None else {}))
    return tak(*args, program=(str(TAK),), environ=environ, **kwargs)


def one_line_failure(result: subprocess.CompletedProcess[str], *needles: str) -> str:
    """The failure's one stderr line, after checking it is one line, without a
    traceback, with a non-zero status, and names each of ``needles``."""
    assert result.returncode != 0, (result.stdout, result.stderr)
    assert "Traceback" not in result.stderr
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


# --- a home the OS refuses -------------------------------------------------------------


@pytest.mark.parametrize(
    "command",
    [("demo",), ("call", "read_file", '{"path": "x"}'), ("sessions", "ls"), ("tools",)],
    ids=lambda c: " ".join(c[:2]),
)
def test_a_home_below_a_regular_file_is_one_line(tmp_path: Path, command: tuple[str, ...]) -> None:
    (tmp_path / "file").write_text("not a directory\n")
    home = tmp_path / "file" / "home"
    line = one_line_failure(installed_tak(*command, home=home), "Not a directory")
    assert f"TAK_HOME {home}" in line


def test_debug_shows_the_traceback(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("not a directory\n")
    result = installed_tak("--debug", "demo", home=tmp_path / "file" / "home")
    assert result.returncode != 0
    assert "Traceback" in result.stderr and "NotADirectoryError" in result.stderr


def test_a_home_without_permission_is_one_line() -> None:
    # As root, modes do not refuse; sysfs does (EPERM on mkdir), for any uid.
    home = Path("/sys/tak-front-door-test")
    try:
        home.mkdir()
    except PermissionError:
        pass
    except OSError:
        pytest.skip("no sysfs that refuses mkdir here")
    else:
        home.rmdir()
        pytest.skip("sysfs accepted a directory")
    one_line_failure(
        installed_tak("demo", home=home), f"TAK_HOME {home}", "Operation not permitted"
    )


def _read_only(home: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """``tak ARGS`` with ``home`` mounted read-only (in a mount namespace of its own)."""
    script = 'mount --bind "$1" "$1" && mount -o remount,bind,ro "$1" && shift && exec "$@"'
    return subprocess.run(
        ["unshare", "-m", "sh", "-c", script, "sh", str(home), str(TAK), *args],
        capture_output=True,
        text=True,
        timeout=120,
        env=_env_without_tak(TAK_HOME=str(home)),
    )


def test_a_read_only_home_is_one_line_and_sessions_ls_still_lists(tmp_path: Path) -> None:
    home = tmp_path / "home"
    assert installed_tak("demo", home=home).returncode == 0
    shutil.rmtree(home / "workspace")
    (home / "workspace").mkdir()
    if shutil.which("unshare") is None or _read_only(home, "--version").returncode != 0:
        pytest.skip("cannot mount a read-only home here (unshare -m)")
    one_line_failure(_read_only(home, "demo"), f"TAK_HOME {home}", "Read-only file system")
    for command in (("tools",), ("call", "read_file", '{"path": "x"}')):
        one_line_failure(
            _read_only(home, *command), f"workspace {home / 'workspace'}", "Read-only file system"
        )
    listed = _read_only(home, "sessions", "ls")
    assert listed.returncode == 0, listed.stderr
    assert "demo: five parallel calls" in listed.stdout


# --- tak repl to a wrong URL -----------------------------------------------------------


def _refused_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
    return port  # closed, and nothing listens on it


def test_repl_to_a_refused_connection_says_why_in_one_line(tmp_path: Path) -> None:
    url = f"ws://127.0.0.1:{_refused_port()}/?token=secret"
    line = one_line_failure(
        installed_tak("repl", url, home=tmp_path, stdin="/tools\n"), "tak repl: cannot talk to"
    )
    assert "Connection refused" in line
    assert "secret" not in line


@pytest.mark.parametrize("url", ["http://127.0.0.1:8765/?token=x", "127.0.0.1:8765", "ws:///x"])
def test_repl_to_a_url_that_is_not_ws_is_one_line(tmp_path: Path, url: str) -> None:
    line = one_line_failure(
        installed_tak("repl", url, home=tmp_path, stdin="/tools\n"), "tak repl:"
    )
    if "://" not in url or url.startswith("http"):
        assert "expected a ws:// URL" in line


# --- a closed pipe ---------------------------------------------------------------------


def test_a_closed_pipe_ends_the_command_quietly(tmp_path: Path) -> None:
    # `tak tools | head -1`: the reader is gone before tak writes.
    process = subprocess.Popen(
        [str(TAK), "tools"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=_env_without_tak(TAK_HOME=str(tmp_path)),
    )
    assert process.stdout is not None and process.stderr is not None
    process.stdout.close()
    code = process.wait(timeout=120)
    stderr = process.stderr.read().decode()
    process.stderr.close()
    assert code == 0
    assert stderr == ""


# --- a broken workspace plugin ---------------------------------------------------------

FLAKY = '''\
import os

from kernel.plugin import Plugin

if os.path.exists("broken"):
    raise RuntimeError("the flag file says break")

plugin = Plugin("flaky")


@plugin.tool
def ping() -> str:
    """Answer pong."""
    return "pong"
'''


def test_a_broken_trusted_plugin_is_one_line_per_command(tmp_path: Path) -> None:
    # Trusted while it loads; then it raises on import (its code unchanged: the
    # approval still holds, and every command loads it again).
    home = tmp_path / "home"
    folder = home / "workspace" / ".tak" / "plugins"
    folder.mkdir(parents=True)
    (folder / "flaky.py").write_text(FLAKY)
    trusted = installed_tak("plugins", "trust", str(folder / "flaky.py"), home=home)
    assert trusted.returncode == 0, trusted.stderr
    (home / "workspace" / "broken").write_text("")
    listed = installed_tak(
        "tools", home=home, cwd=tmp_path
    )  # the script is not below: its full path
    assert listed.returncode == 0
    assert "Traceback" not in listed.stderr
    [line] = listed.stderr.splitlines()
    assert "flaky" in line and "RuntimeError: the flag file says break" in line
    assert f"details: {TAK} --debug plugins check {folder / 'flaky.py'}" in line
    assert "read_file" in listed.stdout and "ping" not in listed.stdout


def test_plugins_check_says_why_in_one_line_and_the_details_with_debug(tmp_path: Path) -> None:
    plugin = str(FIXTURES / "crash_on_import.py")
    checked = installed_tak("plugins", "check", plugin, home=tmp_path)
    one_line_failure(checked, "tak plugins check:", "RuntimeError: this plugin crashes on import")
    detailed = installed_tak("--debug", "plugins", "check", plugin, home=tmp_path)
    assert detailed.returncode == 1
    assert "Traceback" in detailed.stderr  # the worker's, asked for
    assert detailed.stderr.splitlines()[-1].startswith("tak plugins check: ")
    assert "RuntimeError: this plugin crashes on import" in detailed.stderr


def test_trusting_a_plugin_that_crashes_is_one_line(tmp_path: Path) -> None:
    result = installed_tak("plugins", "trust", str(FIXTURES / "crash_on_import.py"), home=tmp_path)
    one_line_failure(result, "tak plugins trust:", "RuntimeError: this plugin crashes on import")


# --- the REPL --------------------------------------------------------------------------


@pytest.fixture
def server(tmp_path: Path) -> Iterator[str]:
    process = subprocess.Popen(
        [str(TAK), "--plugin", "demo", "serve", "--port", "0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env=_env_without_tak(TAK_HOME=str(tmp_path / "server")),
    )
    assert process.stdout is not None
    url = process.stdout.readline().strip()
    assert url.startswith("ws://"), url
    yield url
    process.terminate()
    process.wait(timeout=30)
    process.stdout.close()


def test_the_interactive_repl_exits_0_after_an_unknown_command(server: str, tmp_path: Path) -> None:
    controller, terminal = pty.openpty()
    try:
        process = subprocess.Popen(
            [str(TAK), "repl", server],
            stdin=terminal,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=_env_without_tak(TAK_HOME=str(tmp_path / "client")),
        )
        os.write(controller, b"/nonsense\n/help\n/quit\n")
        out, err = process.communicate(timeout=60)
    finally:
        os.close(controller)
        os.close(terminal)
    assert "unknown command /nonsense; /help lists them" in err
    assert "/call TOOL {json}" in out  # it went on
    assert process.returncode == 0, err


def test_piped_repl_still_fails_on_an_unknown_command(server: str, tmp_path: Path) -> None:
    result = installed_tak("repl", server, home=tmp_path / "client", stdin="/nonsense\n")
    assert result.returncode == 1
    assert "unknown command /nonsense" in result.stderr


def test_repl_lists_sessions_newest_first(server: str, tmp_path: Path) -> None:
    script = '/session a-old\n/call add {"a": 1, "b": 1}\n'
    first = installed_tak("repl", server, home=tmp_path / "client", stdin=script)
    assert first.returncode == 0, first.stderr
    time.sleep(0.01)  # modification times in milliseconds
    script = '/session b-new\n/call add {"a": 1, "b": 1}\n/sessions\n'
    second = installed_tak("repl", server, home=tmp_path / "client", stdin=script)
    assert second.returncode == 0, second.stderr
    ids = [line.split()[0] for line in second.stdout.splitlines() if line.startswith(("a-", "b-"))]
    assert ids == ["b-new", "a-old"]


# --- sessions repair -------------------------------------------------------------------


def test_sessions_repair_says_what_it_did(tmp_path: Path) -> None:
    home = tmp_path / "home"
    assert installed_tak("demo", home=home).returncode == 0
    [session] = (home / "data" / "sessions" / "default").iterdir()
    clean = installed_tak("sessions", "repair", session.name, home=home)
    assert clean.returncode == 0, clean.stderr
    assert clean.stdout == f"default/{session.name}: ok (4 entries), nothing to repair\n"
    with (session / "transcript.jsonl").open("ab") as f:
        f.write(b'{"type": "us')
    torn = installed_tak("sessions", "repair", session.name, home=home)
    assert torn.returncode == 0, torn.stderr
    assert torn.stdout == (
        f"default/{session.name}: cut a torn last line (12 bytes, an append that never "
        "finished); kept 4 entries\n"
    )


# --- names and hints -------------------------------------------------------------------


def test_the_research_agent_names_tools_as_they_are_called(tmp_path: Path) -> None:
    sys.path.insert(0, str(ROOT / "examples"))
    try:
        from research_agent import SYSTEM
    finally:
        sys.path.remove(str(ROOT / "examples"))
    listed = installed_tak("tools", home=tmp_path)
    tools = {line.split()[0] for line in listed.stdout.splitlines() if line[:1].isalpha()}
    named = set(re.findall(r"\b[a-z]+(?:[._][a-z]+)+\b", SYSTEM)) - {"notes.md", "report.md"}
    assert named and named <= tools, named - tools


def test_the_demo_hint_runs_as_printed_without_tak_on_path(tmp_path: Path) -> None:
    home = tmp_path / "home"
    demo = installed_tak("--home", str(home), "demo", cwd=tmp_path)
    assert demo.returncode == 0, demo.stderr
    hint = next(line for line in demo.stdout.splitlines() if line.startswith("show it:"))
    command = hint.removeprefix("show it:").strip()
    assert not command.startswith("tak ")  # not on PATH here: the script's own path
    shown = subprocess.run(
        command,
        shell=True,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
        env=_env_without_tak(),
    )
    assert shown.returncode == 0, shown.stderr
    assert "demo: five parallel calls" in shown.stdout


def test_make_demos_hint_runs_as_printed_from_the_checkout(tmp_path: Path) -> None:
    """`make demo` runs examples/research_agent.py with the venv's python, not as the
    `tak` script: its hint must still name a tak that runs (issue 14: it printed
    `tak sessions show ...`, and tak is not on PATH after make demo)."""
    env = _env_without_tak(TAK_HOME=str(tmp_path / "home"))
    demo = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "research_agent.py")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert demo.returncode == 0, demo.stderr
    hint = next(line for line in demo.stdout.splitlines() if line.startswith("show it:"))
    command = hint.removeprefix("show it:").strip()
    assert not command.startswith("tak ")
    shown = subprocess.run(
        command, shell=True, cwd=ROOT, capture_output=True, text=True, timeout=60, env=env
    )
    assert shown.returncode == 0, shown.stderr


def test_plugin_after_the_command_says_where_it_goes(tmp_path: Path) -> None:
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text(json.dumps({"id": "a", "prompt": "hi"}) + "\n")
    home = tmp_path / "home"
    ran: Any = tak("batch", str(tasks), "--model", "scripted:demo", "--plugin", "demo", home=home)
    assert ran.returncode == 0 or "tak --plugin" in one_line(ran)
