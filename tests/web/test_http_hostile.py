"""Plain HTTP on the WebSocket's port (``kernel.wire._http``) against a hostile client or
page (DESIGN §11), before any token: odd targets, smuggled bodies and pipelined
requests, slow and flooding heads, ``Host`` and ``Origin`` tricks. Each is refused with
the security headers, never an internal error, and the real client still gets in.

Requests are raw bytes on a socket (``raw_exchange``); tests/web/test_http.py reads what
is served to a well-behaved client, and tests/web/test_page.py what hostile data does
to the page in a real Chromium.
"""

from __future__ import annotations

import contextlib
import os
import resource
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import trio

from kernel import Kernel
from kernel.wire import ServerLimits
from tests.server.wsclient import TOKEN, connect, open_test_kernel, running_server

ROOT = Path(__file__).resolve().parents[2]
#: Short deadlines for the attacks that wait them out (the default is 5 s).
FAST = ServerLimits(handshake_timeout=0.6, close_grace=0.3, max_unauthenticated=16)


@pytest.fixture
async def test_kernel(tmp_path: Path) -> AsyncIterator[Kernel]:
    async with open_test_kernel(tmp_path / "home") as k:
        yield k


@pytest.fixture
async def url(test_kernel: Kernel) -> AsyncIterator[str]:
    async with running_server(test_kernel) as u:
        yield u


def port_of(url: str) -> int:
    return int(url.split("/")[2].rpartition(":")[2])


async def raw_exchange(port: int, request: bytes) -> bytes:
    """Send ``request`` on a fresh connection; everything received until the server closes."""
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    received = b""
    async with stream:
        try:
            await stream.send_all(request)
        except trio.BrokenResourceError:
            pass  # answered and closed before taking it all: read what came
        with trio.fail_after(10):
            try:
                while chunk := await stream.receive_some():
                    received += chunk
            except trio.BrokenResourceError:
                pass  # reset after the answer: what came before it still counts
    return received


def status_of(received: bytes) -> int | None:
    """The status of the first response in ``received``; ``None`` when nothing came."""
    if not received.startswith(b"HTTP/1.1 "):
        return None
    return int(received.split(b" ", 2)[1])


def body_of(received: bytes) -> bytes:
    return received.partition(b"\r\n\r\n")[2]


def get(port: int, target: str, *, host: str | None = None, extra: str = "") -> bytes:
    host = f"127.0.0.1:{port}" if host is None else host
    return f"GET {target} HTTP/1.1\r\nHost: {host}\r\n{extra}\r\n".encode("latin-1")


UPGRADE = (
    "Upgrade: websocket\r\nConnection: Upgrade\r\n"
    "Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n"
)


async def client_gets_in(url: str) -> None:
    """The real client: connects with the token and has a request answered."""
    with trio.fail_after(5):
        async with connect(url) as client:
            _, reply = await client.request({"type": "tools", "id": "t"})
    assert reply["status"] == "ok"


async def closed_by_server(stream: trio.SocketStream) -> None:
    """Read until the server closes (EOF or reset); the caller bounds the time."""
    try:
        while await stream.receive_some(4096):
            pass
    except trio.BrokenResourceError:
        pass


# --- the request target and the Host header --------------------------------------------


async def test_a_target_urlsplit_refuses_gets_400_not_an_internal_error(
    url: str, caplog: pytest.LogCaptureFixture
) -> None:
    port = port_of(url)
    for target in [f"//[/?token={TOKEN}", "http://[x/app.js", "//[::1/app.js"]:
        received = await raw_exchange(port, get(port, target))
        assert status_of(received) == 400, (target, received[:80])
    assert "internal error" not in caplog.text
    assert "Traceback" not in caplog.text


async def test_a_websocket_handshake_with_such_a_target_gets_400_not_an_internal_error(
    url: str, caplog: pytest.LogCaptureFixture
) -> None:
    port = port_of(url)
    received = await raw_exchange(port, get(port, "//[/", extra=UPGRADE))
    assert status_of(received) == 400, received[:80]
    assert "internal error" not in caplog.text


async def test_an_origin_urlsplit_refuses_gets_403_not_an_internal_error(
    url: str, caplog: pytest.LogCaptureFixture
) -> None:
    port = port_of(url)
    for origin in ["http://[::1", "http://[evil.example]", "http://[::1]x:1"]:
        for target, more in [("/app.js", ""), (f"/?token={TOKEN}", UPGRADE)]:
            received = await raw_exchange(
                port, get(port, target, extra=f"Origin: {origin}\r\n" + more)
            )
            assert status_of(received) in (400, 403), (origin, target, received[:80])
    assert "internal error" not in caplog.text


async def test_a_host_header_with_userinfo_is_refused(url: str) -> None:
    port = port_of(url)
    received = await raw_exchange(port, get(port, "/app.js", host=f"evil.example@127.0.0.1:{port}"))
    assert status_of(received) in (400, 403), received[:80]
    received = await raw_exchange(
        port, get(port, "/", host=f"evil.example@127.0.0.1:{port}", extra=UPGRADE)
    )
    assert status_of(received) in (400, 403), received[:80]


async def test_an_absolute_form_target_for_another_host_is_refused(url: str) -> None:
    # RFC 9112 §3.2.2: with an absolute-form target the server uses its authority, not Host.
    port = port_of(url)
    received = await raw_exchange(port, get(port, f"http://evil.example/?token={TOKEN}"))
    assert status_of(received) in (400, 403), received[:80]
    assert b"<html" not in received


async def test_answers_to_requests_h11_cannot_read_have_the_security_headers_too(
    url: str,
) -> None:
    port = port_of(url)
    for request in [
        b"NONSENSE\r\n\r\n",
        get(port, "/", extra=f"X-Big: {'a' * 20_000}\r\n"),
        get(port, "/", extra="Transfer-Encoding: gzip\r\n"),
    ]:
        received = await raw_exchange(port, request)
        head = received.partition(b"\r\n\r\n")[0].lower()
        assert status_of(received) in (400, 431, 501)
        assert b"\r\ncontent-security-policy: " in head, head
        assert b"\r\nx-content-type-options: nosniff" in head, head


async def test_refused_websocket_handshakes_have_the_security_headers_too(url: str) -> None:
    port = port_of(url)
    for request, status in [
        (get(port, "/?token=wrong", extra=UPGRADE), 401),
        (get(port, "/", host="evil.example", extra=UPGRADE), 403),
        (get(port, "http://127.0.0.1/", extra=UPGRADE), 400),
    ]:
        received = await raw_exchange(port, request)
        head = received.partition(b"\r\n\r\n")[0].lower()
        assert status_of(received) == status, received[:80]
        assert b"\r\ncontent-security-policy: " in head, head
        assert b"\r\nx-content-type-options: nosniff" in head, head


# --- targets ----------------------------------------------------------------


@pytest.mark.parametrize(
    "target",
    [
        "/../pyproject.toml",
        "/%2e%2e/pyproject.toml",
        "/%2E%2E%2Fpyproject.toml",
        "/..%2fkernel/wire/_http.py",
        "/app.js/../../pyproject.toml",
        "/style.css/../app.js",
        "//app.js",
        "///etc/passwd",
        "/./app.js",
        "/APP.JS",
        "/app.js/",
        "/%61pp.js",
        "/..\\..\\pyproject.toml",
        "/app.js%00.html",
        "/web/app.js",
        "/kernel/web/app.js",
        "/__init__.py",
        "/index.html",
        "*",
    ],
)
async def test_no_target_but_the_pages_own_files_is_served(url: str, target: str) -> None:
    port = port_of(url)
    received = await raw_exchange(port, get(port, target))
    assert status_of(received) in (400, 404), (target, received[:120])
    assert b"[project]" not in received and b"import" not in body_of(received)


async def test_a_nul_or_a_space_in_the_target_is_a_bad_request(url: str) -> None:
    port = port_of(url)
    for request in [
        f"GET /app.js\x00 HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n\r\n".encode(),
        f"GET /app .js HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n\r\n".encode(),
        f"GET /?token={TOKEN}\x00 HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n\r\n".encode(),
    ]:
        received = await raw_exchange(port, request)
        assert status_of(received) == 400, request


async def test_a_very_long_target_is_refused_without_reading_it_all(url: str) -> None:
    port = port_of(url)
    received = await raw_exchange(port, get(port, "/" + "a" * 40_000))
    assert status_of(received) in (414, 431), received[:80]


async def test_a_query_string_on_an_asset_is_ignored(url: str) -> None:
    port = port_of(url)
    received = await raw_exchange(port, get(port, "/app.js?v=1&token=wrong#x"))
    assert status_of(received) == 200


async def test_the_token_in_the_query_must_match_exactly(url: str) -> None:
    port = port_of(url)
    for query in [
        f"?token={TOKEN[:-1]}",
        f"?token={TOKEN}x",
        f"?token={TOKEN.upper()}",
        f"?token=%20{TOKEN}",
        f"?TOKEN={TOKEN}",
        f"?token[]={TOKEN}",
        "?token=",
        f"?x=1;token={TOKEN}",
        "?token=%ff%fe",
        "?token=%",
        f"?token={TOKEN}%00",
        "?token=" + "a" * 8000,
    ]:
        received = await raw_exchange(port, get(port, f"/{query}"))
        assert status_of(received) == 401, query
        assert b"<html" not in received
    received = await raw_exchange(port, get(port, f"/?x=1&token={TOKEN}&y=2"))
    assert status_of(received) == 200


async def test_the_pages_token_is_compared_in_constant_time(
    url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    import hmac

    from kernel.wire import _handshake

    compared: list[tuple[bytes, bytes]] = []
    original = hmac.compare_digest

    def compare_digest(a: bytes, b: bytes) -> bool:
        compared.append((a, b))
        return original(a, b)

    monkeypatch.setattr(_handshake.hmac, "compare_digest", compare_digest)
    port = port_of(url)
    assert status_of(await raw_exchange(port, get(port, "/?token=guess-1"))) == 401
    assert status_of(await raw_exchange(port, get(port, f"/?token={TOKEN}"))) == 200
    assert compared == [(b"guess-1", TOKEN.encode()), (TOKEN.encode(), TOKEN.encode())]


# --- smuggling ----------------------------------------------------------------


async def test_a_pipelined_request_after_a_get_is_not_answered(url: str) -> None:
    port = port_of(url)
    request = get(port, "/app.js") + get(port, f"/?token={TOKEN}") + get(port, "/style.css")
    received = await raw_exchange(port, request)
    assert status_of(received) == 200
    assert received.count(b"HTTP/1.1 ") == 1
    assert b"<html" not in received


async def test_folded_or_conflicting_framing_headers_smuggle_nothing(url: str) -> None:
    port = port_of(url)
    smuggled = (
        f"GET /app.js HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n GET /?token={TOKEN} HTTP/1.1\r\n\r\n"
    ).encode()
    received = await raw_exchange(port, smuggled)
    assert b"<html" not in received
    both = (
        f"GET /app.js HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Length: 5\r\n"
        "Transfer-Encoding: chunked\r\n\r\n0\r\n\r\n"
    ).encode()
    received = await raw_exchange(port, both)
    # h11 reads the chunked body (RFC 9112 §6.3); the connection closes after the answer.
    assert received.count(b"HTTP/1.1 ") == 1
    received = await raw_exchange(port, get(port, "/app.js", extra="Content-Length: 1, 2\r\n"))
    assert status_of(received) == 400


@pytest.mark.parametrize("extra", ["Content-Length: 300000\r\n", "Transfer-Encoding: chunked\r\n"])
async def test_a_get_with_a_body_is_answered_once_and_the_body_is_not_a_request(
    url: str, extra: str
) -> None:
    port = port_of(url)
    inner = get(port, f"/?token={TOKEN}")
    body = inner + b"x" * (300000 - len(inner))
    if "chunked" in extra:
        body = f"{len(inner):x}\r\n".encode() + inner + b"\r\n0\r\n\r\n"
    received = await raw_exchange(port, get(port, "/app.js", extra=extra) + body)
    assert status_of(received) == 200
    assert received.count(b"HTTP/1.1 ") == 1
    assert b"<html" not in received


async def test_http_1_0_needs_a_host_too(url: str) -> None:
    port = port_of(url)
    received = await raw_exchange(port, f"GET /?token={TOKEN} HTTP/1.0\r\n\r\n".encode())
    assert status_of(received) == 400
    assert b"<html" not in received
    request = f"GET /app.js HTTP/1.0\r\nHost: 127.0.0.1:{port}\r\n\r\n".encode()
    assert status_of(await raw_exchange(port, request)) == 200


async def test_many_small_headers_are_refused_like_one_big_one(url: str) -> None:
    port = port_of(url)
    bomb = "".join(f"X-{i}: {i}\r\n" for i in range(3000))
    received = await raw_exchange(port, get(port, "/app.js", extra=bomb))
    assert status_of(received) == 431


# --- Host and Origin ----------------------------------------------------------


@pytest.mark.parametrize(
    "host",
    [
        "evil.example:{port}",
        "evil.example",
        "127.0.0.1.evil.example:{port}",
        "localhost.evil.example:{port}",
        "localhost.:{port}",
        "0.0.0.0:{port}",
        "127.1:{port}",
        "0x7f000001:{port}",
        "2130706433:{port}",
        "192.168.1.1:{port}",
        "127.0.0.1:{port} evil.example",
        "127.0.0.1:99999",
        "",
    ],
)
async def test_dns_rebinding_hosts_are_refused_for_the_page_and_its_files(
    url: str, host: str
) -> None:
    port = port_of(url)
    for target in [f"/?token={TOKEN}", "/app.js"]:
        received = await raw_exchange(port, get(port, target, host=host.format(port=port)))
        assert status_of(received) in (400, 403), (host, target, received[:80])
        assert b"<html" not in received and b"import" not in body_of(received)


@pytest.mark.parametrize(
    "origin",
    [
        "null",
        "http://evil.example",
        "http://127.0.0.1:{other}",
        "http://localhost:{port}",  # not the host dialled (Host: 127.0.0.1:PORT)
        "http://127.0.0.1.evil.example:{port}",
        "file://",
        "chrome-extension://abcdef",
        "",
    ],
)
async def test_foreign_origins_are_refused_for_the_page_and_the_websocket(
    url: str, origin: str
) -> None:
    port = port_of(url)
    extra = f"Origin: {origin.format(port=port, other=port + 1)}\r\n"
    for target, more in [(f"/?token={TOKEN}", ""), ("/app.js", ""), (f"/?token={TOKEN}", UPGRADE)]:
        received = await raw_exchange(port, get(port, target, extra=extra + more))
        assert status_of(received) == 403, (origin, target, received[:80])


async def test_two_origin_headers_are_refused_for_the_page_and_the_websocket(url: str) -> None:
    # One reader would take the first and another the last: refuse both orders.
    port = port_of(url)
    own, foreign = f"http://127.0.0.1:{port}", "http://evil.example"
    for first, second in [(own, foreign), (foreign, own), (own, own)]:
        extra = f"Origin: {first}\r\nOrigin: {second}\r\n"
        for target, more in [(f"/?token={TOKEN}", ""), (f"/?token={TOKEN}", UPGRADE)]:
            received = await raw_exchange(port, get(port, target, extra=extra + more))
            assert status_of(received) == 400, (first, second, more, received[:80])
            assert b"<html" not in received
    received = await raw_exchange(port, get(port, f"/?token={TOKEN}", extra=f"Origin: {own}\r\n"))
    assert status_of(received) == 200


async def test_refusals_never_log_the_token_or_the_target(
    url: str, caplog: pytest.LogCaptureFixture
) -> None:
    port = port_of(url)
    secret = "s3cr3t-4b1d"
    for request in [
        get(port, f"/?token={secret}"),
        get(port, f"/?token={secret}", host="evil.example"),
        get(port, f"/{secret}.js"),
        get(port, f"/?token={secret}", extra="Origin: http://evil.example\r\n"),
        get(port, f"/?token={secret}", extra=f"X-Big: {'a' * 20_000}\r\n"),
        f"NONSENSE /?token={secret}\r\n\r\n".encode(),
        get(port, f"/?token={secret}", extra=UPGRADE),
        get(port, f"/?token={TOKEN}"),
    ]:
        await raw_exchange(port, request)
    assert "refused" in caplog.text
    assert secret not in caplog.text and TOKEN not in caplog.text


# --- slow and flooding clients ------------------------------------------------


async def test_a_page_request_one_byte_at_a_time_is_cut_at_the_handshake_deadline(
    test_kernel: Kernel,
) -> None:
    async with running_server(test_kernel, limits=FAST) as url:
        port = port_of(url)
        request = get(port, f"/?token={TOKEN}")
        stream = await trio.open_tcp_stream("127.0.0.1", port)
        sent = 0
        async with stream:
            with trio.fail_after(FAST.handshake_timeout + 5):
                try:
                    for byte in request[:-1]:  # never the last byte
                        await stream.send_all(bytes([byte]))
                        sent += 1
                        with trio.move_on_after(0.05):
                            if not await stream.receive_some(4096):
                                break
                except trio.BrokenResourceError:
                    pass
        assert sent < len(request) - 1, "the server waited for the whole slow head"


async def test_slow_page_requests_hold_unauthenticated_places_and_the_client_gets_in(
    test_kernel: Kernel,
) -> None:
    """Half-sent page heads are dropped oldest first like half-sent handshakes."""
    limits = ServerLimits(handshake_timeout=60, close_grace=0.3, max_unauthenticated=4)
    async with running_server(test_kernel, limits=limits) as url:
        port = port_of(url)
        streams = []
        try:
            for _ in range(12):
                stream = await trio.open_tcp_stream("127.0.0.1", port)
                await stream.send_all(get(port, f"/?token={TOKEN}")[:-2])  # no blank line
                streams.append(stream)
                await trio.sleep(0.01)  # accepted in this order
            # Long before the 60 s deadline: the oldest 8 are dropped to keep 4.
            with trio.fail_after(10):
                async with trio.open_nursery() as nursery:
                    for s in streams[:8]:
                        nursery.start_soon(closed_by_server, s)
            await client_gets_in(url)
        finally:
            for s in streams:
                await trio.aclose_forcefully(s)


async def test_a_flood_of_page_requests_leaves_no_descriptor_behind(test_kernel: Kernel) -> None:
    async with running_server(test_kernel, limits=FAST) as url:
        port = port_of(url)
        await client_gets_in(url)
        before = len(os.listdir("/proc/self/fd"))
        statuses: list[int | None] = []

        async def one(i: int) -> None:
            target = [f"/?token={TOKEN}", "/app.js", "/nothing", f"/?token=x{i}"][i % 4]
            statuses.append(status_of(await raw_exchange(port, get(port, target))))

        with trio.fail_after(60):
            for start in range(0, 400, 40):
                async with trio.open_nursery() as nursery:
                    for i in range(start, start + 40):
                        nursery.start_soon(one, i)
        assert sorted(set(statuses), key=str) == [200, 401, 404]
        await client_gets_in(url)
        # Each answer was followed by the server's close (the EOF each exchange read).
        assert len(os.listdir("/proc/self/fd")) <= before + 2


async def test_page_requests_that_never_read_their_answer_are_cut_at_the_deadline(
    test_kernel: Kernel,
) -> None:
    async with running_server(test_kernel, limits=FAST) as url:
        port = port_of(url)
        streams = []
        try:
            for i in range(100):
                stream = await trio.open_tcp_stream("127.0.0.1", port)
                target = f"/?token={TOKEN}" if i % 2 else "/app.js"
                # keep-alive and a pipeline of many: nothing is read on this side
                await stream.send_all(get(port, target, extra="Connection: keep-alive\r\n") * 50)
                streams.append(stream)
            await client_gets_in(url)
            with trio.fail_after(FAST.handshake_timeout + 5):
                async with trio.open_nursery() as nursery:
                    for s in streams:
                        nursery.start_soon(closed_by_server, s)
        finally:
            for s in streams:
                await trio.aclose_forcefully(s)


def _small_open_files_limit() -> None:  # runs in the child before exec
    resource.setrlimit(resource.RLIMIT_NOFILE, (120, 120))


async def test_tak_serve_under_a_small_open_files_limit_survives_a_flood_of_page_requests(
    tmp_path: Path,
) -> None:
    """400 page requests (idle, half-sent, unread) against a server allowed 120 descriptors."""
    process = await trio.lowlevel.open_process(
        [sys.executable, "-m", "kernel.cli", "serve", "--port", "0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env={**os.environ, "TAK_HOME": str(tmp_path / "home")},
        preexec_fn=_small_open_files_limit,
        cwd=ROOT,
    )
    log = bytearray()

    async def collect_log() -> None:
        assert process.stderr is not None
        while chunk := await process.stderr.receive_some(65536):
            log.extend(chunk)

    streams: list[trio.SocketStream] = []
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(collect_log)
            assert process.stdout is not None
            printed = b""
            with trio.fail_after(20):
                while printed.count(b"\n") < 2:
                    chunk = await process.stdout.receive_some(4096)
                    assert chunk, f"tak serve exited: {bytes(log)[-2000:]!r}"
                    printed += chunk
            url = printed.decode().splitlines()[0].strip()
            port = port_of(url)
            with trio.fail_after(30):
                for i in range(400):
                    stream = await trio.open_tcp_stream("127.0.0.1", port)
                    request = get(port, ["/app.js", f"/?token={TOKEN}", "/"][i % 3]) * 20
                    if i % 4 == 1:
                        request = request[:30]  # a head that never ends
                    if i % 4 != 0:
                        with contextlib.suppress(trio.BrokenResourceError):
                            await stream.send_all(request)
                    streams.append(stream)
                await client_gets_in(url)
            assert process.poll() is None, "the server died"
            for s in streams:
                await trio.aclose_forcefully(s)
            await client_gets_in(url)
            process.terminate()
            with trio.fail_after(10):
                await process.wait()
    finally:
        for s in streams:
            await trio.aclose_forcefully(s)
        with trio.CancelScope(shield=True):
            if process.returncode is None:
                process.kill()
                await process.wait()
    text = log.decode(errors="replace")
    assert process.returncode == 0, text[-2000:]
    assert "Traceback" not in text, text[-2000:]
