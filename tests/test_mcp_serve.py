"""``tak mcp serve``, a real process, driven by the official MCP SDK's own client
(stdio and streamable HTTP), under Trio. Guarantees: kernel/mcp/_server.py."""

from __future__ import annotations

import contextlib
import json
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import trio

pytest.importorskip("mcp")

import httpx2
import mcp_types as types
from mcp import Client
from mcp.client.stdio import StdioServerParameters
from mcp.client.streamable_http import streamable_http_client

TAK = [sys.executable, "-m", "kernel.cli"]


def serve_command(home: Path, *options: str) -> list[str]:
    """``tak --plugin demo mcp serve OPTIONS`` on ``home``."""
    return [*TAK, "--home", str(home), "--plugin", "demo", "mcp", "serve", *options]


@pytest.fixture
def home(tmp_path: Path) -> Path:
    (tmp_path / "workspace").mkdir()
    return tmp_path


def text(result: types.CallToolResult) -> str:
    [block] = result.content
    assert isinstance(block, types.TextContent)
    return block.text


async def round_trip(client: Client) -> None:
    """What every transport must do: list, call, a failing call, bad arguments."""
    listed = {t.name: t for t in (await client.list_tools()).tools}
    assert {"add", "divide", "echo", "read_file"} <= set(listed)
    assert listed["add"].description == "Add two integers."
    assert listed["add"].input_schema["required"] == ["a", "b"]
    assert listed["add"].input_schema["properties"]["a"]["type"] == "integer"

    added = await client.call_tool("add", {"a": 2, "b": 40})
    assert (text(added), added.is_error) == ("42", False)

    divided = await client.call_tool("divide", {"a": 1, "b": 0})
    assert divided.is_error
    assert text(divided) == "Error (exception): float division by zero"

    bad = await client.call_tool("add", {"a": "two", "b": 40})
    assert bad.is_error
    assert text(bad) == "Error (bad_arguments): $.a: expected int, got str"

    unknown = await client.call_tool("teleport", {})
    assert unknown.is_error and text(unknown).startswith("Error (unknown_tool)")


def transcript(home: Path, session: str) -> str:
    shown = subprocess.run(
        [*TAK, "--home", str(home), "sessions", "show", session],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert shown.returncode == 0, shown.stderr
    return shown.stdout


def assert_recorded(home: Path, session: str) -> None:
    shown = transcript(home, session)
    assert '-> add({"a": 2, "b": 40})' in shown
    assert "<- add" in shown and "42" in shown
    assert "<- divide (error)" in shown and "float division by zero" in shown
    assert "$.a: expected int, got str" in shown


# -- stdio ------------------------------------------------------------------------------


async def test_stdio_round_trip_with_the_sdk_client_recorded_in_the_session(home: Path) -> None:
    # guarantees 1, 2
    server = StdioServerParameters(
        command=sys.executable,
        args=serve_command(home, "--session", "mcp-stdio")[1:],
    )
    async with Client(server) as client:
        assert client.server_info is not None and client.server_info.name == "tak"
        await round_trip(client)
    assert_recorded(home, "mcp-stdio")


async def test_stdio_calls_run_concurrently_and_a_cancelled_call_is_recorded(
    home: Path,
) -> None:
    server = StdioServerParameters(
        command=sys.executable, args=serve_command(home, "--session", "mcp-cancel")[1:]
    )
    async with Client(server) as client:
        finished: list[str] = []

        async def sleep_long() -> None:
            with trio.move_on_after(1):  # the SDK client sends notifications/cancelled
                await client.call_tool("sleep", {"seconds": 30})
            finished.append("sleep")

        async with trio.open_nursery() as nursery:
            nursery.start_soon(sleep_long)
            await trio.sleep(0.2)
            added = await client.call_tool("add", {"a": 1, "b": 1})
            finished.append(text(added))
    assert finished == ["2", "sleep"]
    shown = transcript(home, "mcp-cancel")
    assert "<- sleep (error)" in shown
    assert "Error (cancelled)" in shown


def start_stdio(home: Path) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [*TAK, "--home", str(home), "mcp", "serve", "--session", "raw"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )


INITIALIZE = {
    "jsonrpc": "2.0",
    "id": 1,
    "method": "initialize",
    "params": {
        "protocolVersion": "2025-06-18",
        "capabilities": {},
        "clientInfo": {"name": "test", "version": "0"},
    },
}


def send(process: subprocess.Popen[bytes], *frames: dict[str, object]) -> None:
    assert process.stdin is not None
    for frame in frames:
        process.stdin.write(json.dumps(frame).encode() + b"\n")
    process.stdin.flush()


def test_stdio_stdout_carries_only_frames_and_eof_ends_it(home: Path) -> None:
    # guarantee 3
    process = start_stdio(home)
    send(
        process,
        INITIALIZE,
        {"jsonrpc": "2.0", "method": "notifications/initialized"},
        {"jsonrpc": "2.0", "id": 2, "method": "tools/list"},
        {"jsonrpc": "2.0", "id": 3, "method": "tools/call",
         "params": {"name": "read_file", "arguments": {"path": "missing.txt"}}},
    )  # fmt: skip
    assert process.stdout is not None
    frames = [json.loads(process.stdout.readline()) for _ in range(3)]  # each line a frame
    assert [f["id"] for f in frames] == [1, 2, 3]
    assert all(f["jsonrpc"] == "2.0" for f in frames)
    assert frames[2]["result"]["isError"] is True
    out, err = process.communicate(timeout=30)  # closes stdin: EOF ends the server
    assert process.returncode == 0, err.decode()
    assert out == b""
    assert b"stdin closed: stopping" in err  # logs go to stderr


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_stdio_a_signal_ends_it_cleanly_while_stdin_stays_open(
    home: Path, signum: signal.Signals
) -> None:
    process = start_stdio(home)
    send(process, INITIALIZE)
    assert process.stdout is not None
    assert json.loads(process.stdout.readline())["id"] == 1
    process.send_signal(signum)
    # stdin is still open: the reader must not hold the exit for another line
    assert process.wait(timeout=15) == 0
    assert process.stdout.read() == b""
    assert process.stdin is not None
    process.stdin.close()
    assert process.stderr is not None
    assert f"{signum.name}: stopping" in process.stderr.read().decode()


# -- streamable HTTP --------------------------------------------------------------------


@contextlib.contextmanager
def serving_http(home: Path, *options: str) -> Iterator[str]:
    """``tak --plugin demo mcp serve --http 127.0.0.1:0 OPTIONS``: the URL line it printed;
    SIGINT afterwards must end it with status 0 and no more output."""
    process = subprocess.Popen(
        serve_command(home, "--http", "127.0.0.1:0", *options),
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        assert process.stdout is not None
        url = process.stdout.readline().strip()
        assert url.startswith("http://127.0.0.1:") and "/mcp?token=" in url, url
        yield url
        process.send_signal(signal.SIGINT)
        assert process.wait(timeout=15) == 0
        assert process.stdout.read() == ""  # one line, the URL, and nothing else
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


@pytest.fixture
def http_server(home: Path) -> Iterator[str]:
    with serving_http(home, "--session", "mcp-http") as url:
        yield url


async def test_http_round_trip_with_a_bearer_token(home: Path, http_server: str) -> None:
    endpoint, _, token = http_server.partition("?token=")
    async with httpx2.AsyncClient(headers={"Authorization": f"Bearer {token}"}) as http:
        async with Client(streamable_http_client(endpoint, http_client=http)) as client:
            await round_trip(client)
    assert_recorded(home, "mcp-http")


async def test_http_the_printed_url_works_as_is(http_server: str) -> None:
    async with Client(http_server) as client:
        added = await client.call_tool("add", {"a": 1, "b": 2})
        assert text(added) == "3"


async def test_http_without_the_token_is_refused(http_server: str) -> None:
    endpoint, _, token = http_server.partition("?token=")
    initialize = {**INITIALIZE}
    headers = {"Accept": "application/json, text/event-stream"}
    async with httpx2.AsyncClient() as http:
        for refused in (
            await http.post(endpoint, json=initialize, headers=headers),
            await http.post(endpoint, json=initialize, headers={**headers,
                            "Authorization": f"Bearer {token}x"}),
            await http.post(f"{endpoint}?token=nope", json=initialize, headers=headers),
        ):  # fmt: skip
            assert refused.status_code == 401
            assert refused.text == "wrong token\n"
            assert refused.headers["www-authenticate"] == "Bearer"
        rebinding = await http.post(
            endpoint, json=initialize, headers={**headers, "Host": "evil.example:80",
                                                "Authorization": f"Bearer {token}"},
        )  # fmt: skip
        assert rebinding.status_code == 403
        accepted = await http.post(
            endpoint, json=initialize, headers={**headers, "Authorization": f"Bearer {token}"}
        )
        assert accepted.status_code == 200


async def test_http_token_file_is_created_and_its_token_used(home: Path) -> None:
    token_file = home / "mcp-token"
    with serving_http(home, "--token-file", str(token_file)) as url:
        token = token_file.read_text().strip()
        assert token_file.stat().st_mode & 0o777 == 0o600
        endpoint, _, printed = url.partition("?token=")
        assert printed == token
        async with httpx2.AsyncClient(headers={"Authorization": f"Bearer {token}"}) as http:
            async with Client(streamable_http_client(endpoint, http_client=http)) as client:
                assert text(await client.call_tool("echo", {"text": "hi"})) == "hi"


def test_http_refuses_a_non_loopback_host_without_allow_remote(home: Path) -> None:
    result = subprocess.run(
        [*TAK, "--home", str(home), "mcp", "serve", "--http", "0.0.0.0:0"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert result.returncode == 2
    assert "refusing to bind '0.0.0.0': not a loopback address" in result.stderr
    assert result.stdout == ""


def test_http_options_without_http_are_a_usage_error(home: Path) -> None:
    result = subprocess.run(
        [*TAK, "--home", str(home), "mcp", "serve", "--allow-remote"],
        capture_output=True,
        text=True,
        timeout=30,
        stdin=subprocess.DEVNULL,
    )
    assert result.returncode == 2
    assert "--token-file and --allow-remote go with --http" in result.stderr


@pytest.mark.parametrize(
    ("text", "expected"),
    [("127.0.0.1:8766", ("127.0.0.1", 8766)), ("[::1]:0", ("::1", 0)),
     ("localhost:1", ("localhost", 1))],
)  # fmt: skip
def test_http_address_forms(text: str, expected: tuple[str, int]) -> None:
    from kernel.cli._mcp_serve import parse_host_port

    assert parse_host_port(text) == expected


@pytest.mark.parametrize("text", ["8766", "127.0.0.1", ":8766", "host:http", "host:70000"])
def test_http_address_refused(text: str) -> None:
    from kernel.cli._mcp_serve import parse_host_port
    from kernel.errors import UsageError

    with pytest.raises(UsageError, match="expected HOST:PORT"):
        parse_host_port(text)


# -- kernel.mcp as a library: a program serves its own kernel --------------------------


async def test_a_program_serves_its_kernel_in_process(tmp_path: Path) -> None:
    """``kernel.mcp.mcp_server`` is the server ``tak mcp serve`` runs, for any kernel."""
    from kernel import open_kernel, tool
    from kernel.mcp import mcp_server

    @tool
    def add(a: int, b: int) -> int:
        """Add two integers."""
        return a + b

    async with open_kernel(home=tmp_path, tools=[add], plugins=[]) as k:
        session = k.session("served")
        async with Client(mcp_server(k, session)) as client:
            listed = {t.name for t in (await client.list_tools()).tools}
            assert "add" in listed
            added = await client.call_tool("add", {"a": 2, "b": 40})
            assert (text(added), added.is_error) == ("42", False)
            bad = await client.call_tool("add", {"a": "two", "b": 40})
            assert bad.is_error and "$.a" in text(bad)
        kinds = [m.role for m in await session.messages()]
    assert kinds == ["assistant", "tool", "assistant", "tool"]  # each call recorded


async def test_serve_stdio_speaks_json_rpc_lines_on_the_fds_it_is_given(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The stdio transport on a socket pair: one JSON object a line each way. A line
    that is no JSON-RPC message is answered (JSON-RPC 2.0: parse error, or invalid
    request with its id) instead of leaving the client waiting, and a frame past
    ``MAX_FRAME_BYTES`` is refused and skipped; the connection goes on."""
    import kernel.mcp._server

    monkeypatch.setattr(kernel.mcp._server, "MAX_FRAME_BYTES", 100_000)
    import socket

    from kernel import open_kernel
    from kernel.mcp import mcp_server, serve_stdio

    ours, theirs = socket.socketpair()
    with ours, theirs:
        stream = trio.SocketStream(trio.socket.from_stdlib_socket(ours))

        async def request(line: bytes) -> dict[str, object]:
            await stream.send_all(line + b"\n")
            data = b""
            while not data.endswith(b"\n"):
                data += await stream.receive_some(65536)
            reply: dict[str, object] = json.loads(data)
            return reply

        with trio.fail_after(60):  # a hang guard
            async with open_kernel(home=tmp_path, plugins=[]) as k, trio.open_nursery() as nursery:
                server = mcp_server(k, k.session())
                nursery.start_soon(serve_stdio, server, theirs.fileno(), theirs.fileno())
                params = {"protocolVersion": "2025-06-18", "capabilities": {},
                          "clientInfo": {"name": "t", "version": "1"}}  # fmt: skip
                hello = {"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": params}
                answer = await request(json.dumps(hello).encode())
                assert answer["id"] == 1 and "result" in answer, answer
                for line, code, request_id in [
                    (b"{not json", -32700, None),
                    (b'{"jsonrpc": "2.0", "id": 2, "method": 7}', -32600, 2),
                    (b'{"jsonrpc": "2.0", "id": "s", "params": {}}', -32600, "s"),
                    (b"[1, 2]", -32600, None),
                    (b'"x" ' * 60_000, -32600, None),  # too long: one refusal
                ]:
                    refused = await request(line)
                    assert refused["id"] == request_id, (line[:40], refused)
                    assert refused["error"]["code"] in (code, -32700), refused  # type: ignore[index]
                await stream.send_all(
                    json.dumps({"jsonrpc": "2.0", "method": "notifications/initialized"}).encode()
                    + b"\n"
                )
                listed = await request(b'{"jsonrpc": "2.0", "id": 3, "method": "tools/list"}')
                assert listed["id"] == 3 and "tools" in listed["result"], listed  # type: ignore[operator]
                nursery.cancel_scope.cancel()
