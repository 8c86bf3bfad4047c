"""``kernel.mcp`` at its edges: the stdio transport given frames that are no JSON-RPC
message (answered, never left waiting), lone surrogates, and the HTTP guard's Host and
token checks (a query token outside latin-1, a non-ASCII token's printed URL)."""

from __future__ import annotations

import json
import socket
from pathlib import Path
from typing import Any
from urllib.parse import quote

import trio

from kernel import tool


class _Wire:
    """One end of a socket pair that ``serve_stdio`` serves on the other."""

    def __init__(self, sock: socket.socket) -> None:
        self.stream = trio.SocketStream(trio.socket.from_stdlib_socket(sock))
        self.buffer = b""

    async def send(self, line: bytes) -> None:
        await self.stream.send_all(line + b"\n")

    async def receive(self) -> dict[str, Any]:
        while b"\n" not in self.buffer:
            data = await self.stream.receive_some(65536)
            assert data, "the server closed the wire"
            self.buffer += data
        line, _, self.buffer = self.buffer.partition(b"\n")
        answer: dict[str, Any] = json.loads(line)
        return answer

    async def until(self, wanted: int) -> list[dict[str, Any]]:
        """Every answer up to and including the one for id ``wanted``."""
        answers = [await self.receive()]
        while answers[-1].get("id") != wanted:
            answers.append(await self.receive())
        return answers


@tool
def surrogate() -> str:
    """Return text with a lone surrogate."""
    return "x\udc80y"


async def _serving(tmp_path: Path, body: Any) -> None:
    from kernel import open_kernel
    from kernel.mcp import mcp_server, serve_stdio

    ours, theirs = socket.socketpair()
    with ours, theirs:
        wire = _Wire(ours)
        with trio.fail_after(60):  # a hang guard
            async with (
                open_kernel(home=tmp_path, tools=[surrogate], plugins=[]) as k,
                trio.open_nursery() as nursery,
            ):
                server = mcp_server(k, k.session())
                nursery.start_soon(serve_stdio, server, theirs.fileno(), theirs.fileno())
                params = {"protocolVersion": "2025-06-18", "capabilities": {},
                          "clientInfo": {"name": "t", "version": "1"}}  # fmt: skip
                hello = {"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": params}
                await wire.send(json.dumps(hello).encode())
                assert "result" in await wire.receive()
                await wire.send(b'{"jsonrpc": "2.0", "method": "notifications/initialized"}')
                await body(wire)
                nursery.cancel_scope.cancel()


async def test_mcp_stdio_answers_an_invalid_request_with_its_id(tmp_path: Path) -> None:
    async def body(wire: _Wire) -> None:
        await wire.send(b'{"jsonrpc": "2.0", "id": 7, "method": 5}')
        await wire.send(b'{"jsonrpc": "2.0", "id": 8, "method": "tools/list"}')
        answers = await wire.until(8)  # id 8 is answered: the server lives on
        assert any(a.get("id") == 7 and "error" in a for a in answers), answers

    await _serving(tmp_path, body)


async def test_mcp_stdio_answers_a_line_that_is_not_json(tmp_path: Path) -> None:
    async def body(wire: _Wire) -> None:
        await wire.send(b"{not json")
        await wire.send(b'{"jsonrpc": "2.0", "id": 8, "method": "tools/list"}')
        answers = await wire.until(8)
        assert any(a.get("id") is None and "error" in a for a in answers), answers

    await _serving(tmp_path, body)


async def test_mcp_stdio_survives_bad_frames_and_sends_a_surrogate_as_json(tmp_path: Path) -> None:
    """After bad frames the next request is answered; a tool's lone surrogate reaches
    the client as U+FFFD (the writer's model_dump_json does not die of it)."""

    async def body(wire: _Wire) -> None:
        await wire.send(b'{"jsonrpc": "2.0", "id": 7, "method": 5}')
        await wire.send(b"[]")
        await wire.send(b"\xff\xfe")
        call = {"jsonrpc": "2.0", "id": 9, "method": "tools/call",
                "params": {"name": "surrogate", "arguments": {}}}  # fmt: skip
        await wire.send(json.dumps(call).encode())
        [*_, answer] = await wire.until(9)
        assert answer["result"]["content"][0]["text"] == "x\ufffdy", answer
        await wire.send(b'{"jsonrpc": "2.0", "id": 10, "method": "tools/list"}')
        assert "result" in (await wire.until(10))[-1]

    await _serving(tmp_path, body)


async def _ok(scope: Any, receive: Any, send: Any) -> None:
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b"ok"})


async def _status(token: str, headers: list[tuple[bytes, bytes]], query: bytes = b"") -> int:
    from kernel.mcp import guarded_app

    app = guarded_app(_ok, token, allow_remote=False)
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b""}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    scope = {"type": "http", "path": "/mcp", "headers": headers, "query_string": query}
    await app(scope, receive, send)
    status: int = sent[0]["status"]
    return status


LOCAL = (b"host", b"localhost:8765")


async def test_a_query_token_outside_latin1_is_refused_not_raised() -> None:
    assert await _status("secret", [LOCAL], b"token=%CF%80") == 401


async def test_the_printed_url_works_with_a_non_ascii_token() -> None:
    token = "clé"
    assert await _status(token, [LOCAL], b"token=" + quote(token, safe="").encode()) == 200


async def test_the_http_guard_checks_host_then_token_and_the_header_wins() -> None:
    assert await _status("secret", [LOCAL], b"token=secret") == 200
    assert await _status("secret", [(b"host", b"[::1]:1")], b"token=secret") == 200
    assert await _status("secret", [(b"host", b"evil.example")], b"token=secret") == 403
    assert await _status("secret", [(b"host", b"localhost.evil.example")], b"token=secret") == 403
    assert await _status("secret", [], b"token=secret") == 403  # no Host at all
    wrong = (b"authorization", b"Bearer nope")
    assert await _status("secret", [LOCAL, wrong], b"token=secret") == 401
    assert await _status("secret", [LOCAL, (b"authorization", b"Bearer secret")]) == 200
    assert await _status("secret", [LOCAL], b"token=secre") == 401
    assert await _status("secret", [LOCAL], b"token=") == 401
    assert await _status("a+b", [LOCAL], b"token=" + quote("a+b", safe="").encode()) == 200
