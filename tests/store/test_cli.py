from __future__ import annotations

import argparse
from pathlib import Path

import pytest
import trio

from kernel.cli.sessions import add_commands
from kernel.home import TakHome
from kernel.messages import Message, Observation, Text, ToolCall
from kernel.session import Session
from kernel.store import FileStore, SessionKey


def tak(home: Path, *argv: str) -> int:
    parser = argparse.ArgumentParser(prog="tak")
    parser.add_argument("--home")
    sub = parser.add_subparsers()
    add_commands(sub)
    args = parser.parse_args(["--home", str(home), *argv])
    code: int = args.func(args)
    return code


@pytest.fixture
def home(tmp_path: Path) -> Path:
    async def seed() -> None:
        async with FileStore(TakHome(tmp_path).sessions) as store:
            session = Session(store, SessionKey("default", "chat1"))
            await session.set_title("First chat")
            await session.append(Message("user", [Text("add 2 and 2\nplease")]))
            await session.record_turn(
                Message("assistant", [ToolCall("c1", "add", {"a": 2, "b": 2}, 0)]),
                [Observation("c1", "add", 0, "4")],
            )
            await session.child("a1").append(Message("user", [Text("sub task")]))
            await store.append(SessionKey("work", "w1"), [{"type": "note", "text": "x"}])

    trio.run(seed)
    return tmp_path


def test_ls(home: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert tak(home, "sessions", "ls") == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].split() == ["ID", "MODIFIED", "ENTRIES", "TITLE"]
    assert out[1].split()[0] == "chat1"
    assert out[1].split()[3:] == ["4", "First", "chat"]
    assert tak(home, "sessions", "ls", "--project", "work") == 0
    assert "w1" in capsys.readouterr().out
    assert tak(home, "sessions", "ls", "--project", "empty") == 0
    assert "no sessions" in capsys.readouterr().out


def test_show(home: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert tak(home, "sessions", "show", "chat1") == 0
    out = capsys.readouterr().out
    assert "user:\n  add 2 and 2\n  please" in out
    assert '-> add({"a": 2, "b": 2})  [call c1]' in out
    assert "<- add  [call c1]\n     4" in out
    assert "title:" in out and "First chat" in out
    assert "subagents/a1" in out
    assert tak(home, "sessions", "show", "chat1", "--sub", "subagents/a1") == 0
    assert "sub task" in capsys.readouterr().out


def test_errors(home: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert tak(home, "sessions", "show", "nope") == 2  # an id that names no session: bad input
    assert "no session default/nope" in capsys.readouterr().err
    assert tak(home, "sessions", "show", "../etc") == 2
    assert "session_id" in capsys.readouterr().err
    assert tak(home, "sessions", "rm", "nope") == 2
    assert tak(home, "sessions", "repair", "nope") == 2
    assert tak(home, "sessions") == 2


def test_rm(home: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert tak(home, "sessions", "rm", "chat1") == 0
    assert "removed default/chat1" in capsys.readouterr().out
    assert not (TakHome(home).sessions / "default" / "chat1").exists()
    assert tak(home, "sessions", "show", "chat1") == 2  # no longer a session: bad input


def test_repair_and_show_damage(home: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = TakHome(home).sessions / "default" / "chat1" / "transcript.jsonl"
    lines = path.read_bytes().splitlines(keepends=True)
    path.write_bytes(lines[0] + b"oops\n" + b"".join(lines[1:]))
    assert tak(home, "sessions", "show", "chat1") == 1
    err = capsys.readouterr().err
    assert f"{path}:2:" in err and "sessions repair chat1" in err
    assert tak(home, "sessions", "ls") == 1
    listed = capsys.readouterr()
    assert "chat1" in listed.out and "DAMAGED:" in listed.out  # listed, not hidden
    assert "damaged: chat1" in listed.err
    assert tak(home, "sessions", "repair", "chat1") == 0
    out = capsys.readouterr().out
    assert "damaged from line 2; kept 1 entries" in out
    assert "quarantine" in out
    assert "subagents/a1: ok (1 entries)" in out
    assert tak(home, "sessions", "show", "chat1") == 0
    assert tak(home, "sessions", "ls") == 0


def test_show_marks_calls_whose_results_never_landed(
    home: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    async def crash_between_records() -> None:
        async with FileStore(TakHome(home).sessions) as store:
            session = Session(store, SessionKey("default", "chat1"))
            await session.record_calls(
                Message("assistant", [ToolCall("c9", "write", {"path": "x"}, 0)])
            )

    trio.run(crash_between_records)
    assert tak(home, "sessions", "show", "chat1") == 0
    out = capsys.readouterr().out
    assert "<- add  [call c1]\n     4" in out  # answered in the older one-append form
    assert "<- write (error)  [call c9]\n     Error (crashed): the kernel stopped" in out


def test_a_wrong_setting_in_tak_toml_is_one_line(
    home: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = TakHome(home).ensure().config_file
    config.write_text('[store]\nurl = "sqlite:///x"\n')
    assert tak(home, "sessions", "ls") == 2
    err = capsys.readouterr().err
    assert err == (
        f'tak: error: {config}: $.store.url: expected a postgresql:// URL, got "sqlite://..."\n'
    )
