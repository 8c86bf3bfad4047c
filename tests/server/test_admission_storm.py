"""Connect storms against a small unauthenticated budget (``kernel.wire._admission``).

Attackers without the token open connection after connection (raw TCP, a
half-sent upgrade, a whole WebSocket handshake and a hello without the
token) while real clients connect with the token, in the URL and in a
``hello``. What must hold: nothing is logged as an error or an internal
error, a real client gets in within a few tries, and once in it is never
dropped. On a real server over 127.0.0.1.
"""

from __future__ import annotations

import logging
import random

import pytest
import trio
from trio_websocket import (
    ConnectionClosed,
    ConnectionRejected,
    ConnectionTimeout,
    HandshakeError,
)

from kernel import Kernel
from kernel.wire._limits import ServerLimits

from .wsclient import TOKEN, bare, connect, running_server

pytestmark = pytest.mark.filterwarnings("ignore::trio.TrioDeprecationWarning")


async def _attacker(host: str, port: int, seed: int, stop: trio.Event) -> None:
    r = random.Random(seed)
    while not stop.is_set():
        kind = r.randrange(3)
        try:
            if kind < 2:
                stream = await trio.open_tcp_stream(host, port)
                async with stream:
                    if kind == 1:
                        await stream.send_all(b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\nUpgr")
                    with trio.move_on_after(r.random() * 0.05):
                        await stream.receive_some()
            else:
                async with connect(f"ws://{host}:{port}/", connect_timeout=1) as ws:
                    await ws.send({"v": 1, "type": "hello", "id": "h"})
                    with trio.move_on_after(0.05):
                        await ws.recv()
        except (
            OSError,
            ConnectionClosed,
            ConnectionTimeout,
            HandshakeError,
            trio.BrokenResourceError,
        ):
            pass
        await trio.lowlevel.checkpoint()


async def _real_client(url: str, in_url: bool, got_in: list[int]) -> None:
    """Connect until authenticated; then three requests, none of which may fail."""
    authenticated = False
    for attempt in range(1, 200):
        try:
            # A server that closes the socket mid-handshake leaves trio-websocket's
            # client waiting for its connect_timeout: a try, not a failure.
            async with connect(url if in_url else bare(url), connect_timeout=1) as ws:
                if not in_url:
                    await ws.send({"v": 1, "type": "hello", "id": "h", "token": TOKEN})
                    frame = await ws.recv()
                    if frame["type"] == "error":
                        assert frame["error"]["code"] == "too_many_connections", frame
                        continue
                    assert frame["type"] == "reply", frame
                else:
                    await ws.send({"v": 1, "type": "hello", "id": "h"})
                    frame = await ws.recv()
                    assert frame["type"] == "reply", frame
                got_in.append(attempt)
                authenticated = True
                # In: dropping it now would be locking out the real client.
                for n in range(3):
                    await trio.sleep(0.02)
                    _, reply = await ws.request({"type": "sessions", "id": f"s{n}"})
                    assert reply["type"] == "reply" and reply["status"] == "ok", reply
                return
        except (ConnectionClosed, ConnectionRejected, ConnectionTimeout, HandshakeError, OSError):
            if authenticated:
                raise  # cut after it was authenticated
            continue
    raise AssertionError("never got in")


async def test_a_connect_storm_neither_logs_an_internal_error_nor_locks_out_a_client(
    kernel: Kernel, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    limits = ServerLimits(max_unauthenticated=2, max_connections=8, handshake_timeout=2.0)
    async with running_server(kernel, limits=limits) as url:
        host_port = bare(url).split("//", 1)[1].rstrip("/")
        host, port = host_port.rsplit(":", 1)
        stop = trio.Event()
        got_in: list[int] = []
        with trio.fail_after(120):
            async with trio.open_nursery() as attackers:
                for i in range(12):
                    attackers.start_soon(_attacker, host, int(port), i, stop)
                async with trio.open_nursery() as clients:
                    for i in range(6):
                        clients.start_soon(_real_client, url, i % 2 == 0, got_in)
                stop.set()
    assert len(got_in) == 6
    # The storm did crowd the budget (the summary line is said once per 10 s).
    assert any("dropped unauthenticated" in r.getMessage() for r in caplog.records)
    bugs = [
        r.getMessage()
        for r in caplog.records
        if r.levelno >= logging.ERROR or "internal" in r.getMessage().lower()
    ]
    assert not bugs, bugs[:5]
