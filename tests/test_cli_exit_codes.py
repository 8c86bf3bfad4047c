"""One exit-code rule for every ``tak`` command (docs/cli.md, kernel/cli/_exit.py):
0 ok, 1 failed, 2 bad usage or input, 130 interrupted.

``exit_code`` is checked against the whole ``KernelError`` tree; then every
command of the parser (the walk fails on a command without cases) is run with
real causes: a wrong flag or value, a wrong ``tak.toml``, a ``TAK_HOME`` that is
a file, a name that names nothing (2); a PostgreSQL store that refuses the
connection, a tool call that fails, a server that is not there (1); Ctrl-C (130).
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import attrs
import pytest

import kernel.models  # (defines KernelErrors: the providers')
import kernel.wire  # noqa: F401  (the wire's)
import plugins  # noqa: F401  (the trust errors)
from kernel.cli import build_parser, main
from kernel.cli._exit import BAD_INPUT, FAILED, INTERRUPTED, OK, exit_code
from kernel.errors import KernelError, StoreError, UsageError

# --- the rule ---------------------------------------------------------------------------


def _subclasses(cls: type[KernelError]) -> Iterator[type[KernelError]]:
    for sub in cls.__subclasses__():
        yield sub
        yield from _subclasses(sub)


def test_every_kernel_error_class_has_its_code() -> None:
    # The modules that define KernelError subclasses are imported above.
    classes: list[type[KernelError]] = [KernelError, *_subclasses(KernelError)]
    assert len(classes) > 8  # the tree as kernel/errors.py draws it, and more
    for cls in classes:
        error = KernelError.__new__(cls)  # no constructor: some take their own arguments
        expected = BAD_INPUT if issubclass(cls, UsageError) else FAILED
        assert exit_code(error) == expected, cls


def test_the_store_a_lost_lease_and_the_os_are_failures_not_bad_input() -> None:
    assert exit_code(StoreError("PostgreSQL: lease lost")) == FAILED
    assert exit_code(ConnectionRefusedError(111, "Connection refused")) == FAILED
    assert exit_code(RuntimeError("a bug")) == FAILED
    assert exit_code(UsageError("--concurrency: expected 1 or more")) == BAD_INPUT


def test_groups_interrupted_wins_then_failed_bad_input_only_if_all() -> None:
    assert exit_code(KeyboardInterrupt()) == INTERRUPTED
    assert exit_code(BaseExceptionGroup("", [KeyboardInterrupt()])) == INTERRUPTED
    assert exit_code(ExceptionGroup("", [ExceptionGroup("", [UsageError("x")])])) == BAD_INPUT
    both = ExceptionGroup("", [UsageError("x"), UsageError("y")])
    assert exit_code(both) == BAD_INPUT
    assert exit_code(ExceptionGroup("", [UsageError("x"), StoreError("y")])) == FAILED
    mixed = BaseExceptionGroup("", [StoreError("y"), KeyboardInterrupt()])
    assert exit_code(mixed) == INTERRUPTED
    assert (exit_code(SystemExit(0)), exit_code(SystemExit(3)), exit_code(SystemExit())) == (
        0,
        3,
        0,
    )


def test_main_maps_what_a_handler_raises(monkeypatch: pytest.MonkeyPatch) -> None:
    from kernel.cli import tools

    for raised, code in (
        (StoreError("gone"), FAILED),
        (UsageError("bad"), BAD_INPUT),
        (KeyboardInterrupt(), INTERRUPTED),
        (ExceptionGroup("", [StoreError("in a nursery")]), FAILED),
    ):

        def handler(args: object, raised: BaseException = raised) -> int:
            raise raised

        monkeypatch.setattr(tools, "cmd_tools", handler)
        assert main(["tools"]) == code, raised


# --- every command ------------------------------------------------------------------------

#: Nothing listens there: a connection refused at once, on loopback.
DEAD_STORE = "postgresql://127.0.0.1:1/tak"


@attrs.frozen
class Case:
    argv: tuple[str, ...]
    code: int
    #: "store": TAK_STORE_URL names a dead PostgreSQL; "toml": a wrong tak.toml;
    #: "file": TAK_HOME is a file
    setup: str | None = None


HOME_FILE = "file"
STORE = "store"
TOML = "toml"
#: replaced by a missing file's path
MISSING = "{missing}"

CASES: dict[str, list[Case]] = {
    "tools": [
        Case(("tools", "--workspace", MISSING), BAD_INPUT),
        Case(("tools",), BAD_INPUT, setup=TOML),
        Case(("tools",), BAD_INPUT, setup=HOME_FILE),
    ],
    "call": [
        Case(("call", "read_file", "{}", "--timeout", "0"), BAD_INPUT),
        Case(("call", "read_file", '{"path": "not-there.txt"}'), FAILED),  # an error observation
    ],
    "demo": [Case(("demo",), BAD_INPUT, setup=TOML), Case(("demo",), FAILED, setup=STORE)],
    "run": [
        Case(("run", "hi", "--temperature", "7"), BAD_INPUT),
        Case(("run", "hi"), BAD_INPUT, setup=HOME_FILE),
        Case(("run", "hi"), FAILED, setup=STORE),
    ],
    "batch run": [
        Case(("batch", "run", MISSING), BAD_INPUT),
        Case(("batch", "run", "{tasks}", "--concurrency", "0"), BAD_INPUT),
    ],
    "batch resume": [Case(("batch", "resume", "nope"), BAD_INPUT)],
    "batch ls": [
        Case(("batch", "ls", "--json"), OK),
        Case(("batch", "ls", "extra"), BAD_INPUT),
        Case(("batch", "ls"), BAD_INPUT, setup=HOME_FILE),
    ],
    "batch show": [Case(("batch", "show", "nope"), BAD_INPUT)],
    "batch worker": [
        Case(("batch", "worker", "--run", "../r", "--store", DEAD_STORE), BAD_INPUT),
        # a database that cannot be reached: never 2 (that is bad input)
        Case(("batch", "worker", "--run", "r", "--store", DEAD_STORE), FAILED),
    ],
    "sessions ls": [
        Case(("sessions", "ls"), OK),
        Case(("sessions", "ls"), BAD_INPUT, setup=TOML),
        Case(("sessions", "ls"), FAILED, setup=STORE),
    ],
    "sessions show": [
        Case(("sessions", "show", "nope"), BAD_INPUT),
        Case(("sessions", "show", "x"), FAILED, setup=STORE),
    ],
    "sessions rm": [
        Case(("sessions", "rm", "nope"), BAD_INPUT),
        Case(("sessions", "rm", "x"), FAILED, setup=STORE),
    ],
    "sessions repair": [
        Case(("sessions", "repair", "nope"), BAD_INPUT),
        # PostgreSQL keeps its own integrity: repair is a file store's
        Case(("sessions", "repair", "x"), BAD_INPUT, setup=STORE),
    ],
    "doctor": [Case(("doctor", "--no-such-flag"), BAD_INPUT)],
    "plugins ls": [Case(("plugins", "ls", "--workspace", MISSING), BAD_INPUT)],
    "plugins trust": [Case(("plugins", "trust", "nope"), BAD_INPUT)],
    "plugins untrust": [Case(("plugins", "untrust"), BAD_INPUT)],
    "plugins new": [Case(("plugins", "new"), BAD_INPUT)],
    "plugins check": [Case(("plugins", "check"), BAD_INPUT)],
    "serve": [
        Case(("serve", "--port", "70000"), BAD_INPUT),
        Case(("serve", "--host", "0.0.0.0"), BAD_INPUT),
        Case(("serve", "--port", "0"), BAD_INPUT, setup=HOME_FILE),
        Case(("serve", "--port", "{taken}"), FAILED),
    ],
    "repl": [
        Case(("repl", "http://127.0.0.1:8765/?token=x"), BAD_INPUT),
        Case(("repl", "ws://127.0.0.1:{refused}/?token=x"), FAILED),
    ],
    "mcp ls": [
        Case(("mcp", "ls"), OK),
        Case(("mcp", "ls"), BAD_INPUT, setup=TOML),
        Case(("mcp", "ls"), BAD_INPUT, setup=HOME_FILE),
    ],
    "mcp trust": [Case(("mcp", "trust", "nope"), BAD_INPUT)],
    "mcp untrust": [Case(("mcp", "untrust", "nope"), BAD_INPUT)],
    "mcp serve": [
        Case(("mcp", "serve", "--token-file", "t"), BAD_INPUT),
        Case(("mcp", "serve", "--http", "0.0.0.0:0"), BAD_INPUT),
        Case(("mcp", "serve", "--http", "127.0.0.1:{taken}"), FAILED),
    ],
}


def leaf_commands(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()) -> Iterator[str]:
    """Every command a person can run (``batch show``, ``tools``...), from the parser."""
    groups = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    if not groups:
        yield " ".join(path)
    for group in groups:
        for name, sub in group._name_parser_map.items():
            yield from leaf_commands(sub, (*path, name))


def test_every_command_has_cases() -> None:
    commands = set(leaf_commands(build_parser()))
    assert commands - set(CASES) == set(), "add the new command's exit codes to CASES"
    assert set(CASES) - commands == set()


@pytest.mark.parametrize("command", sorted(leaf_commands(build_parser())))
def test_a_wrong_flag_is_bad_usage(command: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main([*command.split(), "--no-such-flag"])
    assert exited.value.code == BAD_INPUT
    assert len(capsys.readouterr().err.splitlines()) == 1


def _refused_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
    return port  # closed: nothing listens there


def _prepare(case: Case, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, taken: int) -> list[str]:
    """The home for ``case`` and its argv, as ``tak --home HOME ARGV``."""
    home = tmp_path / "home"
    monkeypatch.delenv("TAK_HOME", raising=False)
    monkeypatch.delenv("TAK_STORE_URL", raising=False)
    (home / "config").mkdir(parents=True)
    if case.setup == HOME_FILE:
        home = tmp_path / "a-file"
        home.write_text("")
    elif case.setup == TOML:
        (home / "config" / "tak.toml").write_text("[store]\nurl = 5\n")
    elif case.setup == STORE:
        monkeypatch.setenv("TAK_STORE_URL", DEAD_STORE)
    if case.setup not in (TOML, HOME_FILE):
        # A dead PostgreSQL is retried for request_timeout_s (30 s) where a restart is
        # ridden out (the batch ledger): the same failure, sooner.
        (home / "config" / "tak.toml").write_text("[store]\nrequest_timeout_s = 1\n")
    (tmp_path / "tasks.jsonl").write_text('{"id": "t1", "prompt": "hi"}\n')
    words = {
        MISSING: str(tmp_path / "not-there"),
        "{tasks}": str(tmp_path / "tasks.jsonl"),
        "{refused}": str(_refused_port()),
        "{taken}": str(taken),
    }
    argv = []
    for word in case.argv:
        for key, value in words.items():
            word = word.replace(key, value)
        argv.append(word)
    return ["--home", str(home), *argv]


@pytest.mark.parametrize("command", sorted(CASES))
def test_each_command_exits_by_the_rule(
    command: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capfd: pytest.CaptureFixture[str],
) -> None:
    # A port another socket listens on: a server cannot listen there too.
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    with listener:
        for number, case in enumerate(CASES[command]):
            where = tmp_path / str(number)
            where.mkdir()
            with monkeypatch.context() as patched:
                argv = _prepare(case, where, patched, listener.getsockname()[1])
                # In this process (a server's signals and log handler are undone
                # when main returns); Ctrl-C is a process's, below.
                try:
                    code = main(argv)
                except SystemExit as exc:  # argparse's own usage errors
                    code = exit_code(exc)
                out, err = capfd.readouterr()
            assert code == case.code, f"tak {' '.join(argv)}: {code}, not {case.code}\n{err}"
            if code != OK:
                said = err + out
                assert said.strip(), f"tak {' '.join(argv)}: exits {code} without saying why"
                assert "Traceback" not in said


def _descendants(pid: int) -> list[str]:
    """The command lines of the processes below ``pid`` (from /proc)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(ppid, []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            todo.append(child)
            try:
                found.append(Path(f"/proc/{child}/cmdline").read_bytes().replace(b"\0", b" "))
            except OSError:
                continue
    return [line.decode(errors="replace") for line in found]


def test_ctrl_c_is_130(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("TAK_HOME", "TAK_STORE_URL")}
    call = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "kernel.cli",
            "--home",
            str(tmp_path / "home"),
            "call",
            "run_command",
            '{"command": "sleep 600"}',
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        # Ctrl-C once the tool runs (its `sleep` is a process below tak's worker).
        for _ in range(1200):
            if any(line.startswith("sleep 600") for line in _descendants(call.pid)):
                break
            time.sleep(0.1)
        else:
            raise AssertionError("the call's sleep never started")
        call.send_signal(signal.SIGINT)
        out, err = call.communicate(timeout=120)
    finally:
        call.kill()
        call.wait()
    assert call.returncode == INTERRUPTED, out + err
    assert "interrupted" in err
