"""Who may connect: the token (query, header, hello), Origin, Host, and where the server binds."""

from __future__ import annotations

import pytest
import trio
from trio_websocket import ConnectionClosed, ConnectionRejected

from kernel import Kernel, UsageError
from kernel.wire import ServerLimits, serve_websocket

from .wsclient import TOKEN, Client, bare, connect, running_server


async def expect_closed(client: Client, code: int) -> None:
    with pytest.raises(ConnectionClosed) as closed:
        for _ in range(10):
            await client.recv()
    assert closed.value.reason is not None
    assert closed.value.reason.code == code


async def test_token_in_the_query_authenticates(url: str) -> None:
    assert url.endswith(f"/?token={TOKEN}")
    async with connect(url) as client:
        _, reply = await client.request({"type": "tools", "id": "t"})
    assert reply["status"] == "ok"
    assert "add" in [t["name"] for t in reply["result"]["tools"]]


async def test_token_in_the_authorization_header_authenticates(url: str) -> None:
    async with connect(bare(url), headers=[(b"Authorization", f"Bearer {TOKEN}".encode())]) as c:
        _, reply = await c.request({"type": "tools", "id": "t"})
    assert reply["status"] == "ok"


async def test_token_in_hello_authenticates(url: str) -> None:
    async with connect(bare(url)) as client:
        _, hello = await client.request({"type": "hello", "id": "h", "token": TOKEN})
        assert hello["status"] == "ok"
        assert hello["result"]["protocol"] == 1
        assert hello["result"]["model"] == "scripted:demo"
        _, reply = await client.request({"type": "tools", "id": "t"})
    assert reply["status"] == "ok"


@pytest.mark.parametrize(
    ("suffix", "headers"),
    [
        ("?token=wrong", []),
        ("", [(b"Authorization", b"Bearer wrong")]),
        (f"?token={TOKEN}", [(b"Authorization", b"Bearer wrong")]),
    ],
)
async def test_a_wrong_token_in_the_handshake_is_refused_with_401(
    url: str, suffix: str, headers: list[tuple[bytes, bytes]]
) -> None:
    with pytest.raises(ConnectionRejected) as rejected:
        async with connect(bare(url) + suffix, headers=headers):
            pass
    assert rejected.value.status_code == 401


async def test_without_a_token_only_hello_is_accepted(url: str) -> None:
    async with connect(bare(url)) as client:
        await client.send({"v": 1, "type": "tools", "id": "t"})
        error = await client.recv()
        assert error["type"] == "error"
        assert error["re"] == "t"
        assert error["error"]["code"] == "unauthorized"
        await expect_closed(client, 1008)


async def test_a_wrong_token_in_hello_closes_the_connection(url: str) -> None:
    async with connect(bare(url)) as client:
        await client.send({"v": 1, "type": "hello", "id": "h", "token": "wrong"})
        error = await client.recv()
        assert (error["type"], error["re"], error["error"]["code"]) == (
            "error",
            "h",
            "unauthorized",
        )
        await expect_closed(client, 1008)


async def test_no_hello_within_the_timeout_closes_the_connection(kernel: Kernel) -> None:
    async with running_server(kernel, limits=ServerLimits(handshake_timeout=0.2)) as url:
        async with connect(bare(url)) as client:
            error = await client.recv()
            assert error["error"]["code"] == "unauthorized"
            assert "within 0.2 s" in error["error"]["message"]
            await expect_closed(client, 1008)


async def test_a_foreign_origin_is_refused_before_the_handshake(kernel: Kernel) -> None:
    async with running_server(kernel, allow_origins=["http://localhost:3000"]) as url:
        port = url.split(":")[2].split("/")[0]
        for origin in ("http://evil.example", f"http://evil.example:{port}", "null"):
            with pytest.raises(ConnectionRejected) as rejected:
                async with connect(url, headers=[(b"Origin", origin.encode())]):
                    pass
            assert rejected.value.status_code == 403
            assert rejected.value.body == b"Origin not allowed\n"
        # the server's own origin, and an allowed one
        for origin in (f"http://127.0.0.1:{port}", "http://localhost:3000"):
            async with connect(url, headers=[(b"Origin", origin.encode())]) as client:
                _, reply = await client.request({"type": "tools", "id": "t"})
                assert reply["status"] == "ok"


async def handshake_status(url: str, host_header: str) -> int:
    """Send a WebSocket handshake with this Host header over raw TCP; return the HTTP status."""
    port = int(url.split(":")[2].split("/")[0])
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    async with stream:
        await stream.send_all(
            (
                f"GET /?token={TOKEN} HTTP/1.1\r\nHost: {host_header}\r\n"
                "Upgrade: websocket\r\nConnection: Upgrade\r\n"
                "Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n\r\n"
            ).encode()
        )
        received = b""
        with trio.fail_after(5):
            while b"\r\n" not in received:
                received += await stream.receive_some(4096)
    return int(received.split(b" ", 2)[1])


async def test_a_non_loopback_host_header_is_refused(url: str) -> None:
    """DNS rebinding: a page of evil.example resolved to 127.0.0.1 still says Host: evil.example."""
    port = url.split(":")[2].split("/")[0]
    assert await handshake_status(url, f"evil.example:{port}") == 403
    assert await handshake_status(url, f"localhost:{port}") == 101
    assert await handshake_status(url, f"127.0.0.1:{port}") == 101


async def test_a_non_loopback_host_header_is_allowed_with_allow_remote(kernel: Kernel) -> None:
    async with running_server(kernel, allow_remote=True) as url:
        assert await handshake_status(url, "kernel.example:8765") == 101


async def test_binding_a_non_loopback_address_needs_allow_remote(kernel: Kernel) -> None:
    with pytest.raises(UsageError, match="not a loopback address"):
        await serve_websocket(kernel, "0.0.0.0", 0)
    async with trio.open_nursery() as nursery:
        url = await nursery.start(
            lambda task_status: serve_websocket(
                kernel, "0.0.0.0", 0, allow_remote=True, task_status=task_status
            )
        )
        assert url.startswith("ws://0.0.0.0:")
        nursery.cancel_scope.cancel()


async def test_connections_beyond_the_limit_get_503(kernel: Kernel) -> None:
    async with running_server(kernel, limits=ServerLimits(max_connections=2)) as url:
        async with connect(url), connect(url):
            with pytest.raises(ConnectionRejected) as rejected:
                async with connect(url):
                    pass
            assert rejected.value.status_code == 503
        # freed: the count follows the connections
        with trio.fail_after(5):
            while True:
                try:
                    async with connect(url) as client:
                        _, reply = await client.request({"type": "tools", "id": "t"})
                        break
                except ConnectionRejected:
                    await trio.sleep(0.05)
        assert reply["status"] == "ok"


@pytest.mark.parametrize("host", ["localhost", "::1"])
async def test_other_loopback_addresses_serve(kernel: Kernel, host: str) -> None:
    async with trio.open_nursery() as nursery:
        try:
            url = await nursery.start(
                lambda task_status: serve_websocket(kernel, host, 0, task_status=task_status)
            )
        except OSError:
            pytest.skip(f"cannot bind {host} here")
        assert url.startswith(f"ws://{'[::1]' if host == '::1' else host}:")
        async with connect(url) as client:
            _, reply = await client.request({"type": "tools", "id": "t"})
        assert reply["status"] == "ok"
        nursery.cancel_scope.cancel()
