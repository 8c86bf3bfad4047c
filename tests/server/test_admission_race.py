"""An unauthenticated connection dropped for room after its token was already read.

Dropping a connection cancels its scope, but cancellation lands at the
handler's next checkpoint: a reader woken with a ``hello`` in the same
scheduler batch as the drop still runs up to ``authenticate``. These tests
make that interleaving happen every time: the first drives ``Admission`` in
that order, the second drops the connection from a Trio instrument at the
very moment its reader is woken with the ``hello`` (what the accept loop did
1 time in 200 under load), on a real server over 127.0.0.1.
"""

from __future__ import annotations

import json
import logging

import pytest
import trio
from trio_websocket import ConnectionClosed

from kernel import Kernel
from kernel.wire._admission import Admission, serve_listeners
from kernel.wire._handshake import Gate
from kernel.wire._http import PageFiles
from kernel.wire._limits import ServerLimits
from kernel.wire._server import _Server

from .wsclient import TOKEN, bare, connect


def _admission(*, max_unauthenticated: int = 1, max_connections: int = 4) -> Admission:
    return Admission(
        max_unauthenticated=max_unauthenticated,
        max_connections=max_connections,
        handshake_timeout=5.0,
        open_files_budget=1000,
    )


async def test_a_slot_dropped_before_it_authenticates_is_refused_and_the_budgets_hold() -> None:
    admission = _admission()
    first = admission.admit()
    second = admission.admit()  # the budget is full: the oldest (first) is dropped
    assert first.dropped and first.scope.cancel_called
    # Its handler had read the token before reaching a checkpoint.
    assert admission.authenticate(first) == "dropped"
    assert not first.authenticated
    assert (admission.unauthenticated, admission.authenticated) == (1, 0)
    admission.release(first)
    assert admission.open == 1
    assert admission.authenticate(second) == "authenticated"
    assert admission.authenticate(second) == "authenticated"  # twice is once
    admission.release(second)
    assert (admission.open, admission.unauthenticated, admission.authenticated) == (0, 0, 0)


async def test_a_released_slot_does_not_authenticate() -> None:
    admission = _admission(max_unauthenticated=4)
    slot = admission.admit()
    admission.release(slot)
    assert admission.authenticate(slot) == "dropped"
    assert (admission.open, admission.unauthenticated, admission.authenticated) == (0, 0, 0)


async def test_full_is_not_dropped() -> None:
    admission = _admission(max_unauthenticated=4, max_connections=1)
    one, two = admission.admit(), admission.admit()
    assert admission.authenticate(one) == "authenticated"
    assert admission.authenticate(two) == "full"
    assert not two.dropped and (admission.unauthenticated, admission.authenticated) == (1, 1)


class _DropWhenWoken(trio.abc.Instrument):
    """Drops the oldest unauthenticated connection when a connection's reader is
    woken, once ``armed``: the accept loop admitting a newcomer in the same batch."""

    def __init__(self, admission: Admission) -> None:
        self.admission = admission
        self.armed = False
        self.fired = False

    def task_scheduled(self, task: trio.lowlevel.Task) -> None:
        if self.armed and not self.fired and task.name.endswith(" reader"):
            self.fired = True
            self.admission.admit()  # drops the connection whose reader holds the hello


async def test_a_hello_read_as_its_connection_is_dropped_is_no_internal_error(
    kernel: Kernel, caplog: pytest.LogCaptureFixture
) -> None:
    limits = ServerLimits(max_unauthenticated=1)
    admission = _admission(max_unauthenticated=1)
    gate = Gate(
        token=TOKEN, allow_origins=(), allow_remote=False, limits=limits, admission=admission
    )
    server = _Server(kernel, gate, PageFiles({}))
    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    port = listeners[0].socket.getsockname()[1]
    dropper = _DropWhenWoken(admission)
    caplog.set_level(logging.INFO, logger="tak.server")
    trio.lowlevel.add_instrument(dropper)
    try:
        async with trio.open_nursery() as nursery:
            await nursery.start(serve_listeners, listeners, admission, server.handle)
            async with connect(bare(f"ws://127.0.0.1:{port}/")) as client:
                await trio.testing.wait_all_tasks_blocked()  # the reader waits for a frame
                dropper.armed = True  # the next wake of the reader is for the hello
                await client.send({"v": 1, "type": "hello", "id": "h", "token": TOKEN})
                with pytest.raises(ConnectionClosed), trio.fail_after(10):
                    while True:  # a refusal may come first; then the connection ends
                        frame = json.loads(await client.ws.get_message())
                        assert frame["type"] == "error", frame
                        assert frame["error"]["code"] == "too_many_connections", frame
            nursery.cancel_scope.cancel()
    finally:
        trio.lowlevel.remove_instrument(dropper)
    assert dropper.fired
    bugs = [r for r in caplog.records if r.levelno >= logging.ERROR or "internal" in r.message]
    assert not bugs, [r.getMessage() for r in bugs]
    assert admission.authenticated == 0
    assert any("dropped for room" in r.getMessage() for r in caplog.records)
