"""Plain HTTP on the WebSocket's port (kernel.wire._http), without a browser: what is served,
to whom, with which headers; and that the WebSocket behind it is unchanged."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import trio

import kernel
from kernel import Kernel
from kernel.wire import open_client
from tests.server.wsclient import TOKEN, open_test_kernel, running_server

WEB = Path(kernel.__file__).parent / "web"


@pytest.fixture
async def test_kernel(tmp_path: Path) -> AsyncIterator[Kernel]:
    async with open_test_kernel(tmp_path) as k:
        yield k


@pytest.fixture
async def url(test_kernel: Kernel) -> AsyncIterator[str]:
    async with running_server(test_kernel) as u:
        yield u


def _port(url: str) -> int:
    return int(url.split("/")[2].rpartition(":")[2])


async def exchange(
    url: str, request: bytes, *, pieces: int = 1
) -> tuple[int, dict[str, str], bytes]:
    """Send ``request`` (in ``pieces`` writes); the response's status, headers and body."""
    stream = await trio.open_tcp_stream("127.0.0.1", _port(url))
    async with stream:
        size = -(-len(request) // pieces)
        for start in range(0, len(request), size):
            await stream.send_all(request[start : start + size])
            await trio.sleep(0.01)
        received = b""
        while chunk := await stream.receive_some():
            received += chunk
    head, _, body = received.partition(b"\r\n\r\n")
    status_line, *lines = head.decode("latin-1").split("\r\n")
    headers = {}
    for line in lines:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    return int(status_line.split()[1]), headers, body


def get(path: str, url: str, *, host: str | None = None, extra: str = "") -> bytes:
    host = host or f"127.0.0.1:{_port(url)}"
    return f"GET {path} HTTP/1.1\r\nHost: {host}\r\n{extra}\r\n".encode()


async def test_the_page_with_the_token_and_its_security_headers(url: str) -> None:
    status, headers, body = await exchange(url, get(f"/?token={TOKEN}", url))
    assert status == 200
    assert headers["content-type"] == "text/html; charset=utf-8"
    assert b'<script type="module" src="/app.js"></script>' in body
    assert b"<script>" not in body  # no inline script
    policy = headers["content-security-policy"]
    assert "default-src 'self'" in policy
    assert "script-src 'self';" in policy
    assert f"connect-src 'self' ws://127.0.0.1:{_port(url)};" in policy
    assert "frame-ancestors 'none'" in policy
    assert headers["x-content-type-options"] == "nosniff"
    assert headers["referrer-policy"] == "no-referrer"
    assert headers["cache-control"] == "no-store"
    assert "set-cookie" not in headers


@pytest.mark.parametrize("query", ["", "?token=wrong-9d1e", f"?token={TOKEN}&token=wrong-9d1e"])
async def test_the_page_without_the_right_token_is_refused(
    url: str, query: str, caplog: pytest.LogCaptureFixture
) -> None:
    status, _, body = await exchange(url, get(f"/{query}", url))
    assert status == 401
    assert b"<html" not in body
    assert "refused (HTTP 401)" in caplog.text
    assert TOKEN not in caplog.text and "wrong-9d1e" not in caplog.text  # tokens are never logged


async def test_the_scripts_and_the_style_sheet_are_served(url: str) -> None:
    for path, kind in [("/app.js", "text/javascript"), ("/style.css", "text/css")]:
        status, headers, body = await exchange(url, get(path, url))
        assert status == 200, path
        assert headers["content-type"] == f"{kind}; charset=utf-8"
        assert body == (WEB / path[1:]).read_bytes()


async def test_head_gives_the_headers_only(url: str) -> None:
    request = f"HEAD /?token={TOKEN} HTTP/1.1\r\nHost: 127.0.0.1:{_port(url)}\r\n\r\n"
    status, headers, body = await exchange(url, request.encode())
    assert (status, body) == (200, b"")
    assert int(headers["content-length"]) == len((WEB / "index.html").read_bytes())


async def test_other_paths_are_not_found(url: str) -> None:
    for path in ["/index.html", "/../pyproject.toml", "/favicon.ico", "/wire.py"]:
        status, _, _ = await exchange(url, get(path, url))
        assert status == 404, path


async def test_a_foreign_host_or_origin_is_refused(url: str) -> None:
    status, _, body = await exchange(url, get(f"/?token={TOKEN}", url, host="evil.example"))
    assert (status, body) == (403, b"Host is not a loopback name\n")
    own = f"Origin: http://127.0.0.1:{_port(url)}\r\n"
    status, _, _ = await exchange(url, get("/app.js", url, extra=own))
    assert status == 200
    status, _, body = await exchange(
        url, get("/app.js", url, extra="Origin: http://evil.example\r\n")
    )
    assert (status, body) == (403, b"Origin not allowed\n")


async def test_other_methods_and_bad_requests(url: str) -> None:
    post = f"POST /?token={TOKEN} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 0\r\n\r\n"
    status, _, _ = await exchange(url, post.encode())
    assert status == 405
    status, _, _ = await exchange(url, b"NONSENSE\r\n\r\n")
    assert status == 400
    huge = get("/", url, extra=f"X-Big: {'a' * 20_000}\r\n")
    status, _, _ = await exchange(url, huge)
    assert status == 431


async def test_the_websocket_still_works_when_its_handshake_comes_in_pieces(url: str) -> None:
    # The head is read before trio-websocket sees it, and given back to it whole.
    request = (
        f"GET /?token={TOKEN} HTTP/1.1\r\nHost: 127.0.0.1:{_port(url)}\r\n"
        "Upgrade: websocket\r\nConnection: Upgrade\r\n"
        "Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n\r\n"
    ).encode()
    stream = await trio.open_tcp_stream("127.0.0.1", _port(url))
    async with stream:
        for start in range(0, len(request), 7):
            await stream.send_all(request[start : start + 7])
        received = await stream.receive_some()
    assert received.startswith(b"HTTP/1.1 101 ")
    async with open_client(url) as client:
        assert client.info.model == "scripted:demo"
