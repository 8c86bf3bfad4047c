"""Class 7: denial of service before authentication (DESIGN §11, kernel/wire/_admission.py).

The attacker can reach the port but has no token: it opens idle sockets,
half-finished handshakes, slow handshakes, upgraded WebSockets that never say
``hello``, wrong tokens in a loop, or simply more connections than the process
has file descriptors. Each attempt is refused when the real client, with the
token, still gets in (and every attacking socket is closed by the server at
its deadline); nothing outside the kernel sees anything.
"""

from __future__ import annotations

import contextlib
import os
import resource
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
import trio
from kit import Arena
from trio_websocket import ConnectionClosed, ConnectionRejected

from kernel import Kernel
from kernel.wire import ServerLimits
from tests.server.wsclient import TOKEN, bare, connect, open_test_kernel, running_server

ROOT = Path(__file__).resolve().parents[2]

# Short deadlines keep the attempts fast; the defaults are 5 s and 16.
FAST = ServerLimits(handshake_timeout=0.6, close_grace=0.3, max_unauthenticated=16)


@pytest.fixture
async def kernel(tmp_path: Path) -> AsyncIterator[Kernel]:
    async with open_test_kernel(tmp_path / "home") as k:
        yield k


def port_of(url: str) -> int:
    return int(url.split(":")[2].split("/")[0])


def handshake(port: int, query: str = "") -> bytes:
    return (
        f"GET /{query} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
        "Upgrade: websocket\r\nConnection: Upgrade\r\n"
        "Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n\r\n"
    ).encode()


async def upgraded(port: int, query: str = "") -> tuple[trio.SocketStream, bytes]:
    """A raw TCP connection that sent a handshake; the response head it got."""
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    await stream.send_all(handshake(port, query))
    head = b""
    with trio.fail_after(5):
        while b"\r\n\r\n" not in head:
            chunk = await stream.receive_some(4096)
            if not chunk:
                break
            head += chunk
    return stream, head


async def closed_by_server(stream: trio.SocketStream) -> None:
    """Read until the server closes (EOF or reset); the caller bounds the time."""
    try:
        while await stream.receive_some(4096):
            pass
    except trio.BrokenResourceError:
        pass


async def client_gets_in(url: str) -> None:
    """The real client: connects with the token and has a request answered."""
    with trio.fail_after(5):
        async with connect(url) as client:
            _, reply = await client.request({"type": "tools", "id": "t"})
    assert reply["status"] == "ok"


@contextlib.asynccontextmanager
async def held(streams: list[trio.SocketStream]) -> AsyncIterator[list[trio.SocketStream]]:
    try:
        yield streams
    finally:
        for s in streams:
            await trio.aclose_forcefully(s)


@pytest.mark.parametrize("count", [65, 200])
async def test_upgraded_sockets_without_the_token_do_not_take_the_clients_places(
    kernel: Kernel, arena: Arena, count: int
) -> None:
    """Before: 64 upgraded-but-silent sockets made the server answer 503 to the client."""
    async with running_server(kernel, limits=ServerLimits(max_connections=64)) as url:
        port = port_of(url)
        async with held([]) as streams:
            for _ in range(count):
                stream, head = await upgraded(port)
                streams.append(stream)
                assert head.startswith(b"HTTP/1.1 101 ")
            await client_gets_in(url)
    arena.assert_nothing_seen()


@pytest.mark.parametrize("payload", [b"", b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\n"])
async def test_200_unfinished_handshakes_are_closed_at_the_deadline(
    kernel: Kernel, arena: Arena, payload: bytes
) -> None:
    """Silent sockets, and sockets stuck half-way through the headers."""
    async with running_server(kernel, limits=FAST) as url:
        port = port_of(url)
        async with held([]) as streams:
            for _ in range(200):
                stream = await trio.open_tcp_stream("127.0.0.1", port)
                if payload:
                    await stream.send_all(payload)
                streams.append(stream)
            # meanwhile, the client gets in
            await client_gets_in(url)
            # every attacking socket is closed by the server, the last ones at the deadline
            with trio.fail_after(FAST.handshake_timeout + 2):
                async with trio.open_nursery() as nursery:
                    for s in streams:
                        nursery.start_soon(closed_by_server, s)
    arena.assert_nothing_seen()


async def test_slowloris_is_closed_at_the_deadline(kernel: Kernel, arena: Arena) -> None:
    """One header byte at a time, never finishing: each socket is cut at the deadline."""
    limits = ServerLimits(handshake_timeout=1.0, max_unauthenticated=32)
    async with running_server(kernel, limits=limits) as url:
        port = port_of(url)
        request = handshake(port)
        # Bytes each socket had sent when the server cut it: at 5 a second, the whole
        # head takes ~40 s; cut at the 1 s deadline, a handful (counted, not timed).
        cut_at: list[int] = []

        async def dribble() -> None:
            sent = 0
            async with await trio.open_tcp_stream("127.0.0.1", port) as stream:
                try:
                    for byte in request[:-2]:  # never the final CRLF
                        await stream.send_all(bytes([byte]))
                        sent += 1
                        with trio.move_on_after(0.2):
                            if not await stream.receive_some(1):
                                break
                except (trio.BrokenResourceError, trio.ClosedResourceError):
                    pass
            cut_at.append(sent)

        with trio.fail_after(120):  # a hang guard: uncut, the dribblers end after ~40 s
            async with trio.open_nursery() as nursery:
                for _ in range(20):
                    nursery.start_soon(dribble)
                await trio.sleep(0.3)
                await client_gets_in(url)
        assert len(cut_at) == 20
        assert all(sent < len(request) - 2 for sent in cut_at), (len(request), cut_at)
    arena.assert_nothing_seen()


async def test_an_upgraded_socket_that_never_says_hello_is_closed(
    kernel: Kernel, arena: Arena
) -> None:
    async with running_server(kernel, limits=FAST) as url:
        # A hang guard: only the server's handshake deadline closes a silent socket.
        with trio.fail_after(120):
            async with connect(bare(url)) as silent:
                with pytest.raises(ConnectionClosed) as closed:
                    for _ in range(5):
                        frame = await silent.recv()
                        assert frame["error"]["code"] == "unauthorized"
                assert closed.value.reason is not None and closed.value.reason.code == 1008
        await client_gets_in(url)
    arena.assert_nothing_seen()


async def test_wrong_tokens_in_a_loop_hold_nothing(kernel: Kernel, arena: Arena) -> None:
    """Each wrong token gets 401 and its socket is closed by the server, even left open."""
    async with running_server(kernel, limits=FAST) as url:
        port = port_of(url)
        async with connect(url) as real:
            async with held([]) as streams:
                for i in range(100):
                    stream, head = await upgraded(port, f"?token=wrong{i}")
                    assert head.startswith(b"HTTP/1.1 401 "), head[:40]
                    streams.append(stream)  # the attacker never closes its side
                with trio.fail_after(2):
                    async with trio.open_nursery() as nursery:
                        for s in streams:
                            nursery.start_soon(closed_by_server, s)
            # the connected client was never disturbed, and a new one gets in
            _, reply = await real.request({"type": "tools", "id": "t"})
            assert reply["status"] == "ok"
        await client_gets_in(url)
    arena.assert_nothing_seen()


async def test_wrong_tokens_in_hello_in_a_loop_are_refused(kernel: Kernel, arena: Arena) -> None:
    async with running_server(kernel, limits=FAST) as url:
        for i in range(30):
            async with connect(bare(url)) as client:
                await client.send({"v": 1, "type": "hello", "id": "h", "token": f"guess{i}"})
                frame = await client.recv()
                assert frame["error"]["code"] == "unauthorized"
        await client_gets_in(url)
    arena.assert_nothing_seen()


async def test_unauthenticated_sockets_never_count_against_max_connections(
    kernel: Kernel, arena: Arena
) -> None:
    """Only clients with the token fill max_connections; a full server says so, then frees."""
    limits = ServerLimits(max_connections=2, handshake_timeout=5)
    async with running_server(kernel, limits=limits) as url:
        port = port_of(url)
        async with held([]) as streams:
            for _ in range(10):
                stream, head = await upgraded(port)
                assert head.startswith(b"HTTP/1.1 101 ")
                streams.append(stream)
            async with connect(url) as first:
                async with connect(url):
                    with pytest.raises(ConnectionRejected) as rejected:
                        async with connect(url):
                            pass
                    assert rejected.value.status_code == 503
                    # the token in hello: refused with too_many_connections, closed with 1013
                    async with connect(bare(url)) as late:
                        await late.send({"v": 1, "type": "hello", "id": "h", "token": TOKEN})
                        frame = await late.recv()
                        assert frame["error"]["code"] == "too_many_connections"
                        with pytest.raises(ConnectionClosed) as closed:
                            await late.recv()
                        assert closed.value.reason is not None
                        assert closed.value.reason.code == 1013
                _, reply = await first.request({"type": "tools", "id": "t"})
                assert reply["status"] == "ok"
            # both gone: places come back
            with trio.fail_after(5):
                while True:
                    try:
                        await client_gets_in(url)
                        break
                    except ConnectionRejected:
                        await trio.sleep(0.05)
    arena.assert_nothing_seen()


@contextlib.contextmanager
def soft_open_files_limit(soft: int) -> Iterator[tuple[int, int]]:
    before = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, before[1]))
    try:
        yield before
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, before)


async def test_the_soft_open_files_limit_is_raised_at_start(
    kernel: Kernel, arena: Arena, caplog: pytest.LogCaptureFixture
) -> None:
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or hard < 2048:
        pytest.skip(f"hard RLIMIT_NOFILE {hard}: nothing to raise to")
    caplog.set_level("INFO", logger="tak.server")
    with soft_open_files_limit(1024):
        async with running_server(kernel) as url:
            assert resource.getrlimit(resource.RLIMIT_NOFILE)[0] == hard
            await client_gets_in(url)
    assert any("raised the open-file limit" in r.getMessage() for r in caplog.records)
    arena.assert_nothing_seen()


def _set_small_nofile() -> None:  # runs in the child before exec
    resource.setrlimit(resource.RLIMIT_NOFILE, (120, 120))


async def test_tak_serve_under_a_small_open_files_limit_survives_a_flood(
    tmp_path: Path, arena: Arena
) -> None:
    """400 connections against a server allowed 120 descriptors: no EMFILE crash."""
    env = {**os.environ, "TAK_HOME": str(tmp_path / "home")}
    process = await trio.lowlevel.open_process(
        [sys.executable, "-m", "kernel.cli", "serve", "--port", "0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
        preexec_fn=_set_small_nofile,
        cwd=ROOT,
    )
    log = bytearray()

    async def collect_log() -> None:
        assert process.stderr is not None
        while chunk := await process.stderr.receive_some(65536):
            log.extend(chunk)

    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(collect_log)
            assert process.stdout is not None
            line = b""
            with trio.fail_after(20):
                while not line.endswith(b"\n"):
                    chunk = await process.stdout.receive_some(4096)
                    assert chunk, f"tak serve exited: {bytes(log)[-2000:]!r}"
                    line += chunk
            # The first line: tak serve prints the page's http:// URL on the next one.
            url = line.decode().splitlines()[0].strip()
            assert url.startswith("ws://"), url
            port = port_of(url)
            async with held([]) as streams:
                with trio.fail_after(20):
                    for i in range(400):
                        stream = await trio.open_tcp_stream("127.0.0.1", port)
                        if i % 2:
                            await stream.send_all(handshake(port))
                        streams.append(stream)
                    await client_gets_in(url)
                assert process.poll() is None, "the server died"
            await client_gets_in(url)
            process.terminate()
            with trio.fail_after(10):
                await process.wait()
    finally:
        with trio.CancelScope(shield=True):
            if process.returncode is None:
                process.kill()
                await process.wait()
    text = log.decode(errors="replace")
    assert process.returncode == 0, text[-2000:]
    assert "Traceback" not in text, text[-2000:]
    arena.assert_nothing_seen()


_FLOOD = """
import socket, sys, threading, time
port, seconds = int(sys.argv[1]), float(sys.argv[2])
stop = time.monotonic() + seconds
def run():
    held = []
    while time.monotonic() < stop:
        try:
            held.append(socket.create_connection(("127.0.0.1", port)))
        except OSError:
            time.sleep(0.001)
            continue
        if len(held) > 100:
            held.pop(0).close()
    for s in held:
        s.close()
threads = [threading.Thread(target=run) for _ in range(4)]
for t in threads:
    t.start()
for t in threads:
    t.join()
"""


@pytest.fixture
async def served(tmp_path: Path) -> AsyncIterator[str]:
    async with open_test_kernel(tmp_path / "home") as k:
        async with running_server(k) as url:
            yield url


async def test_a_continuous_connection_flood_does_not_lock_out_the_client(
    served: str, arena: Arena
) -> None:
    """Refused: four threads of another process open connections as fast as they can
    for as long as the client needs (the server drops the oldest unauthenticated one
    each time); the real client still gets in, every time. The flood outlasts the
    hang guard, so a client locked out fails; a slow machine only makes it slower."""
    port = int(served.split(":")[2].split("/")[0])
    flood = await trio.lowlevel.open_process([sys.executable, "-c", _FLOOD, str(port), "3600"])
    try:
        await trio.sleep(0.5)
        for n in range(5):
            with trio.fail_after(120):  # a hang guard, not a measurement
                async with connect(served) as client:
                    _, reply = await client.request({"type": "tools", "id": f"t{n}"})
            assert reply["status"] == "ok"
    finally:
        with trio.CancelScope(shield=True):
            flood.kill()
            await flood.wait()
    arena.assert_nothing_seen()
