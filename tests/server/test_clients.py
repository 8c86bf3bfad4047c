"""Real clients: tak serve and tak repl as processes, the example client, another library."""

from __future__ import annotations

import argparse
import io
import json
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import trio

from kernel import Kernel
from kernel.repl import run_repl
from kernel.wire import ServerLimits
from tests.cli_kit import one_line

from .wsclient import TOKEN, connect, running_server

ROOT = Path(__file__).resolve().parents[2]
# Until kernel/cli/__init__.py lists kernel.cli.serve, run its commands through this shim.
SHIM = (
    "import argparse, sys; from kernel.cli import serve; "
    "p = argparse.ArgumentParser(prog='tak'); p.add_argument('--home'); "
    "serve.add_commands(p.add_subparsers()); a = p.parse_args(); sys.exit(a.func(a))"
)


def tak(*args: str) -> list[str]:
    """The command line of ``tak ARGS``: the real CLI once serve is wired into it."""
    from kernel.cli import build_parser

    commands = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    if "serve" in commands.choices:
        return [sys.executable, "-m", "kernel.cli", *args]
    return [sys.executable, "-c", SHIM, *args]


class Lines:
    """Reads a process's output line by line."""

    def __init__(self, stream: trio.abc.ReceiveStream) -> None:
        self.stream = stream
        self.buffer = b""
        self.seen: list[str] = []

    async def until(self, text: str, seconds: float = 15) -> str:
        with trio.fail_after(seconds):
            while True:
                while b"\n" in self.buffer:
                    line, self.buffer = self.buffer.split(b"\n", 1)
                    decoded = line.decode()
                    self.seen.append(decoded)
                    if text in decoded:
                        return decoded
                chunk = await self.stream.receive_some()
                if not chunk:
                    raise AssertionError(f"{text!r} never came; got {self.seen}")
                self.buffer += chunk


async def test_tak_serve_then_tak_repl_piped(tmp_path: Path) -> None:
    """The README's flow, both as real processes: serve prints the URL, repl runs a script."""
    stderr = (tmp_path / "serve.log").open("wb")
    server = await trio.lowlevel.open_process(
        tak("--home", str(tmp_path / "home"), "--plugin", "demo", "serve", "--port", "0"),
        stdout=subprocess.PIPE,
        stderr=stderr,
    )
    try:
        assert server.stdout is not None
        out = Lines(server.stdout)
        url = await out.until("ws://")
        assert url.startswith("ws://127.0.0.1:") and "/?token=" in url
        assert len(url.split("token=")[1]) >= 40

        script = "\n".join(
            [
                '/call add {"a": 2, "b": 40}',
                "hello there",
                "/session second",
                '/call divide {"a": 1, "b": 0}',
                "/tools",
                "/sessions",
                "/history",
                "/quit",
                "this line is never run",
            ]
        )
        result = await trio.run_process(
            tak("--home", str(tmp_path / "client"), "repl", url, "--session", "first"),
            stdin=script.encode(),
            capture_stdout=True,
            capture_stderr=True,
            check=False,
        )
        stdout = result.stdout.decode()
        assert result.returncode == 0, result.stderr.decode()
        assert "✓ [0] add (" in stdout and "): 42" in stdout
        assert "You said: hello there" in stdout
        assert "session: second" in stdout
        assert "✗ [0] divide exception" in stdout
        assert "add  Add two integers." in stdout
        assert "first  " in stdout and "second  " in stdout
        assert "assistant: → divide" in stdout
        assert "never run" not in stdout
        assert "connected to tak" in result.stderr.decode()
        history = (tmp_path / "client" / "data" / "repl_history").read_text().splitlines()
        assert history[0] == '/call add {"a": 2, "b": 40}'

        # and an ordinary client on the same server
        async with connect(url) as client:
            _, reply = await client.request({"type": "sessions", "id": "s"})
        assert {s["session_id"] for s in reply["result"]["sessions"]} == {"first", "second"}
        assert out.seen == [url], "the URL is the only line on stdout"
    finally:
        server.send_signal(signal.SIGTERM)
        with trio.fail_after(10):
            code = await server.wait()
        stderr.close()
    assert code == 0
    log = (tmp_path / "serve.log").read_text()
    assert "connected" in log and "stopping" in log


async def test_tak_repl_ctrl_c_cancels_the_running_request_and_goes_on(
    url: str, tmp_path: Path
) -> None:
    repl = await trio.lowlevel.open_process(
        tak("--home", str(tmp_path), "repl", url),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
    )
    assert repl.stdin is not None and repl.stdout is not None
    out = Lines(repl.stdout)
    try:
        await repl.stdin.send_all(b'/call sleep {"seconds": 30}\n')
        await out.until("→ [0] sleep")
        repl.send_signal(signal.SIGINT)
        assert "✗ [0] sleep cancelled" in await out.until("sleep cancelled")
        await out.until("(cancelled)")
        await repl.stdin.send_all(b'/call add {"a": 1, "b": 2}\nlong turn\n')
        assert (await out.until("✓ [0] add")).endswith(": 3")
        await out.until("You said: long turn")
        await repl.stdin.aclose()
        with trio.fail_after(10):
            assert await repl.wait() == 0
    finally:
        if repl.returncode is None:
            repl.kill()
            await repl.wait()


async def test_tak_serve_refuses_a_public_address_without_allow_remote(tmp_path: Path) -> None:
    result = await trio.run_process(
        tak("--home", str(tmp_path), "serve", "--host", "0.0.0.0", "--port", "0"),
        capture_stdout=True,
        capture_stderr=True,
        check=False,
    )
    assert result.returncode == 2
    assert result.stdout == b""
    assert b"not a loopback address" in result.stderr


async def test_the_example_client_runs(url: str) -> None:
    result = await trio.run_process(
        [sys.executable, str(ROOT / "examples" / "ws_client.py"), url],
        capture_stdout=True,
        capture_stderr=True,
        check=False,
    )
    stdout = result.stdout.decode()
    assert result.returncode == 0, result.stderr.decode()
    assert "connected: tak" in stdout
    assert "reply    [0] 42" in stdout
    assert "reply    [1] Error (exception): float division by zero" in stdout
    assert "finished [0] echo: hello over websocket" in stdout
    assert "reply: ok, final" in stdout


async def test_another_websocket_library_speaks_the_protocol(url: str, kernel: Kernel) -> None:
    """The ``websockets`` library (sync client, in a thread) as an independent peer."""
    pytest.importorskip("websockets")
    from websockets.sync.client import connect as ws_connect

    def session() -> list[dict[str, Any]]:
        frames = []
        with ws_connect(url) as ws:
            calls = [
                {"id": "a", "name": "echo", "arguments": {"text": "ünïcode ✓"}},
                {"id": "b", "name": "sleep", "arguments": {"seconds": 0.1}},
            ]
            ws.send(
                json.dumps(
                    {"v": 1, "type": "call_tools", "id": "w", "session": "w", "calls": calls}
                )
            )
            while True:
                frame = json.loads(ws.recv(timeout=10))
                frames.append(frame)
                if frame["type"] == "reply":
                    break
            ws.send("{broken")
            frames.append(json.loads(ws.recv(timeout=10)))
        return frames

    frames = await trio.to_thread.run_sync(session)
    assert [f["kind"] for f in frames[:4]].count("call_finished") == 2
    reply = frames[4]
    assert [o["content"] for o in reply["result"]["observations"]] == ["ünïcode ✓", "slept 0.1 s"]
    assert frames[5]["error"]["code"] == "bad_json"


async def run_lines(url: str, *lines: str, close_input: bool = True) -> tuple[int, str, str]:
    """``run_repl`` in this process, fed ``lines``; its exit status, stdout and stderr."""
    send, receive = trio.open_memory_channel[str](len(lines))
    for line in lines:
        send.send_nowait(line)
    if close_input:
        send.close()
    out, err = io.StringIO(), io.StringIO()
    with trio.fail_after(10):
        code = await run_repl(url, out=out, err=err, lines=receive, session="inproc")
    return code, out.getvalue(), err.getvalue()


async def test_slash_cancel_typed_while_a_request_runs_cancels_it(url: str) -> None:
    code, out, err = await run_lines(
        url, '/call sleep {"seconds": 30}', "/cancel", '/call add {"a": 1, "b": 2}'
    )
    assert code == 0, err
    assert "✗ [0] sleep cancelled" in out
    assert "(cancelled)" in out
    assert "✓ [0] add" in out


async def test_the_repl_reports_failures_in_its_exit_status(url: str) -> None:
    code, _, err = await run_lines(url, "/nope", "/session ../bad", "hi")
    assert code == 1
    assert "unknown command /nope" in err
    assert "error (invalid_request)" in err


async def test_the_repl_ends_when_the_server_closes_the_connection(kernel: Kernel) -> None:
    async with running_server(kernel, limits=ServerLimits(idle_timeout=0.3)) as url:
        code, _, err = await run_lines(url, close_input=False)
    assert code == 1
    assert "connection closed: 1000 idle for 0.3 s" in err


async def test_the_repl_says_when_it_cannot_connect(url: str) -> None:
    code, _, err = await run_lines(url.replace(TOKEN, "not-the-token-42"))
    assert code == 1
    assert "cannot talk to ws://127.0.0.1:" in err
    assert "refused: HTTP 401 wrong token" in err
    assert "not-the-token-42" not in err, "the token is not printed"


def test_serve_refuses_a_port_out_of_range(tmp_path: Path) -> None:
    argv = [sys.executable, "-m", "kernel.cli", "--home", str(tmp_path / "home")]
    server = subprocess.Popen(
        [*argv, "serve", "--port", "99999"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert server.stdout is not None
        first = server.stdout.readline()  # a URL when it listens; "" when it refused
        assert first == "", f"listening: {first.strip()}"
        assert server.wait(timeout=60) == 2
        assert server.stderr is not None
        assert "--port" in server.stderr.read().splitlines()[-1]
    finally:
        if server.poll() is None:
            server.send_signal(signal.SIGINT)  # stops cleanly, its workers too
            try:
                server.wait(timeout=30)
            except subprocess.TimeoutExpired:
                server.kill()
                server.wait()


def test_repl_without_a_token_says_to_use_the_printed_url(tmp_path: Path) -> None:
    home = tmp_path / "home"
    argv = [sys.executable, "-m", "kernel.cli", "--home", str(home)]
    server = subprocess.Popen(
        [*argv, "serve", "--port", "0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        assert server.stdout is not None
        ws = server.stdout.readline().strip()
        assert ws.startswith("ws://"), ws
        repl = subprocess.run(
            [*argv, "repl", ws.split("?", 1)[0]],
            input="hi\n",
            capture_output=True,
            text=True,
            timeout=60,
        )
    finally:
        server.send_signal(signal.SIGINT)
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
    assert repl.returncode != 0
    line = one_line(repl)
    assert line.startswith("tak repl:") and "token" in line
