"""What one connection cannot do to the server: bugs, slow readers, silence, junk, crowds."""

from __future__ import annotations

import contextlib
import json
import logging
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import trio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from trio_websocket import ConnectionClosed

from kernel import Kernel
from kernel.wire import ServerLimits

from .wsclient import TOKEN, Client, connect, open_test_kernel, running_server


async def close_code(client: Client) -> tuple[int, str | None, list[dict[str, Any]]]:
    """Read until the connection closes; return its close code, reason and the frames read."""
    frames = []
    with pytest.raises(ConnectionClosed) as closed:
        with trio.fail_after(10):
            while True:
                frames.append(await client.recv())
    assert closed.value.reason is not None
    return closed.value.reason.code, closed.value.reason.reason, frames


@contextlib.contextmanager
def logged(text: str) -> Iterator[trio.Event]:
    """An event set when the server logs a message containing ``text``."""
    seen = trio.Event()

    class Watch(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if text in record.getMessage():
                seen.set()

    handler = Watch()
    server_log = logging.getLogger("tak.server")
    server_log.addHandler(handler)
    try:
        yield seen
    finally:
        server_log.removeHandler(handler)


async def wait(event: trio.Event) -> None:
    with trio.fail_after(10):
        await event.wait()


async def test_a_failing_request_replies_internal_and_closes_only_its_connection(
    kernel: Kernel, url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def broken(*args: object, **kwargs: object) -> None:
        raise RuntimeError("a bug")

    async with connect(url) as bystander:
        await bystander.send(
            {
                "v": 1,
                "type": "run",
                "id": "b",
                "session": "b",
                "prompt": '/call sleep {"seconds": 0.5}',
            }
        )
        monkeypatch.setattr(kernel, "call_tools", broken)
        async with connect(url) as victim:
            calls = [{"id": "a", "name": "add", "arguments": {"a": 1, "b": 2}}]
            await victim.send(
                {"v": 1, "type": "call_tools", "id": "c", "session": "s", "calls": calls}
            )
            code, reason, frames = await close_code(victim)
        assert frames == [
            {
                "v": 1,
                "type": "reply",
                "re": "c",
                "status": "error",
                "seq": 1,
                "error": {
                    "code": "internal",
                    "message": "internal error; the server closes this connection",
                },
            }
        ]
        assert (code, reason) == (1011, "internal error")
        _, reply = await bystander.until_reply("b")
        assert reply["status"] == "ok"
    async with connect(url) as newcomer:
        _, tools = await newcomer.request({"type": "tools", "id": "t"})
        assert tools["status"] == "ok"


async def test_a_bug_in_the_connection_code_closes_with_1011_and_the_server_goes_on(
    url: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from kernel.wire import _connection

    def broken(self: object, message: object) -> None:
        raise KeyError("a bug in the reader")

    async with connect(url) as bystander:
        monkeypatch.setattr(_connection.Connection, "_on_frame", broken)
        async with connect(url) as victim:
            await victim.send({"v": 1, "type": "tools", "id": "t"})
            code, reason, frames = await close_code(victim)
        assert (code, reason, frames) == (1011, "internal error", [])
        assert "internal error; closing the connection" in caplog.text
        monkeypatch.undo()
        _, tools = await bystander.request({"type": "tools", "id": "t"})
        assert tools["status"] == "ok"


def slow_batch(n: int, size: int) -> dict[str, Any]:
    calls = [{"id": f"b{i}", "name": "blob", "arguments": {"size": size}} for i in range(n)]
    return {"v": 1, "type": "call_tools", "id": "big", "session": "slow", "calls": calls}


async def test_a_client_that_stops_reading_is_closed_with_1008_and_others_carry_on(
    kernel: Kernel,
) -> None:
    """20 MB of events for a client that reads nothing: the writer stalls, the client goes."""
    limits = ServerLimits(send_timeout=0.3, close_grace=10)
    async with running_server(kernel, limits=limits) as url:
        async with connect(url) as slow, connect(url) as other:
            with logged("is not reading (one frame took over 0.3 s)") as stalled:
                await slow.send(slow_batch(20, 1 << 20))
                await wait(stalled)
            _, reply = await other.request(
                {
                    "type": "call_tools",
                    "id": "o",
                    "session": "o",
                    "calls": [{"id": "a", "name": "add", "arguments": {"a": 1, "b": 2}}],
                }
            )
            assert reply["result"]["observations"][0]["content"] == "3"
            # Reading again within the grace: what was on the wire, then the close frame.
            code, reason, frames = await close_code(slow)
            assert (code, reason) == (1008, "client too slow: not reading")
            assert all(f["type"] == "event" for f in frames), "no reply for a dropped client"
            assert len(frames) < 20 + 20


async def test_the_outbox_is_bounded_in_bytes(
    kernel: Kernel,
) -> None:
    limits = ServerLimits(outbox_bytes=4 << 20, send_timeout=60, close_grace=10)
    async with running_server(kernel, limits=limits) as url:
        async with connect(url) as slow:
            with logged("bytes queued): disconnecting") as full:
                await slow.send(slow_batch(20, 1 << 20))
                await wait(full)
            code, reason, frames = await close_code(slow)
    assert (code, reason) == (1008, "client too slow: outbox full")
    assert sum(len(json.dumps(f)) for f in frames) < 12 << 20


async def test_a_client_that_never_reads_is_cut_after_the_grace(
    kernel: Kernel,
) -> None:
    limits = ServerLimits(send_timeout=0.2, close_grace=0.2)
    async with running_server(kernel, limits=limits) as url:
        async with connect(url) as slow, connect(url) as other:
            with logged("close grace ran out") as cut:
                await slow.send(slow_batch(20, 1 << 20))
                await wait(cut)
            _, reply = await other.request({"type": "tools", "id": "t"})
            assert reply["status"] == "ok"
            with pytest.raises(ConnectionClosed):
                with trio.fail_after(10):
                    while True:
                        frame = await slow.recv()
                        assert frame["type"] == "event"


async def test_an_idle_connection_is_closed(kernel: Kernel) -> None:
    async with running_server(kernel, limits=ServerLimits(idle_timeout=0.3)) as url:
        async with connect(url) as client:
            await client.request({"type": "tools", "id": "t"})
            code, reason, _ = await close_code(client)
    assert (code, reason) == (1000, "idle for 0.3 s")


async def test_pings_keep_a_quiet_connection_open_and_a_deaf_peer_is_closed(
    kernel: Kernel,
) -> None:
    limits = ServerLimits(ping_interval=0.05, ping_timeout=1.0, close_grace=0.2)
    async with running_server(kernel, limits=limits) as url:
        async with connect(url) as client:  # trio-websocket answers pings by itself
            await trio.sleep(0.5)
            _, reply = await client.request({"type": "tools", "id": "t"})
            assert reply["status"] == "ok"
        # A raw TCP peer that shakes hands and then never reads or answers.
        port = int(url.split(":")[2].split("/")[0])
        stream = await trio.open_tcp_stream("127.0.0.1", port)
        async with stream:
            await stream.send_all(
                (
                    f"GET /?token={TOKEN} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
                    "Upgrade: websocket\r\nConnection: Upgrade\r\n"
                    "Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n"
                    "Sec-WebSocket-Version: 13\r\n\r\n"
                ).encode()
            )
            received = b""
            with trio.fail_after(5):
                while chunk := await stream.receive_some(4096):
                    received += chunk
    assert received.startswith(b"HTTP/1.1 101 ")
    assert b"\x89" in received, "a ping frame"
    assert b"keepalive ping timeout" in received, "the close frame's reason"


async def test_200_concurrent_clients_each_running_a_batch(kernel: Kernel) -> None:
    async with running_server(kernel, limits=ServerLimits(max_connections=256)) as url:
        results: list[list[str]] = []

        async def one_client(i: int) -> None:
            async with connect(url) as client:
                calls = [
                    {"id": "a", "name": "add", "arguments": {"a": i, "b": 1}},
                    {"id": "e", "name": "echo", "arguments": {"text": f"client {i}"}},
                    {"id": "s", "name": "sleep", "arguments": {"seconds": 0.05}},
                ]
                events, reply = await client.request(
                    {"type": "call_tools", "id": "c", "session": f"c{i}", "calls": calls}
                )
                assert len(events) == 6
                results.append([o["content"] for o in reply["result"]["observations"]])

        with trio.fail_after(30):
            async with trio.open_nursery() as nursery:
                for i in range(200):
                    nursery.start_soon(one_client, i)
    assert sorted(results) == sorted(
        [[str(i + 1), f"client {i}", "slept 0.05 s"] for i in range(200)]
    )


# --- junk -----------------------------------------------------------------------------

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4)
    ),
    max_leaves=12,
)
request_like = st.fixed_dictionaries(
    {
        "type": st.sampled_from(
            ["hello", "call_tools", "run", "cancel", "sessions", "history", "tools", "x"]
        )
    },
    optional={
        "v": st.sampled_from([1, 1, 1, 2, "1", True, None]),
        "id": st.text(max_size=10) | st.integers(),
        "session": st.text(max_size=10) | st.integers(),
        "prompt": st.text(max_size=20),
        "target": st.text(max_size=10),
        "project": st.text(max_size=10),
        "after": st.text(max_size=10),
        "calls": st.lists(
            st.fixed_dictionaries(
                {},
                optional={
                    "id": st.text(max_size=5),
                    "name": st.sampled_from(["add", "echo", "divide", "nope"])
                    | st.text(max_size=5),
                    "arguments": json_values,
                    "index": st.integers(),
                },
            ),
            max_size=3,
        ),
        "extra": json_values,
    },
)
junk_frames = st.lists(
    st.one_of(
        st.text(max_size=60),
        st.binary(max_size=20),
        json_values.map(json.dumps),
        request_like.map(json.dumps),
    ),
    min_size=1,
    max_size=15,
)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(frames=junk_frames)
async def test_junk_frames_never_crash_the_server(frames: list[str | bytes]) -> None:
    with tempfile.TemporaryDirectory() as home:
        async with open_test_kernel(Path(home)) as kernel, running_server(kernel) as url:
            async with connect(url) as client:
                for frame in frames:
                    await client.send(frame)
                await client.send({"v": 1, "type": "tools", "id": "final-check"})
                seqs = []
                while True:
                    frame = await client.recv()
                    assert frame["type"] in ("event", "reply", "error")
                    seqs.append(frame["seq"])
                    if frame.get("re") == "final-check" and frame["type"] == "reply":
                        break
                assert seqs == sorted(seqs)
            # and the server still takes new connections
            async with connect(url) as client:
                _, reply = await client.request({"type": "tools", "id": "t"})
                assert reply["status"] == "ok"
