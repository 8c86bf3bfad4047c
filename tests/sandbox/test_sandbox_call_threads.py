"""The worker's call threads (``sandbox.worker.serve``), driven over a socket pair in process.

The thread that reads a call runs it and another one reads on: calls still run in
parallel, a thread is not started per call, the threads kept between calls are
few, and what cannot run (a malformed call, no task left for a thread) is answered.
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest

from sandbox import _protocol
from sandbox import worker as mechanism
from sandbox._protocol import CallFrame, ResultFrame


class Kernel:
    """The kernel's end of the channel: sends call frames, reads result frames."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.sock.settimeout(10)

    def call(self, call_id: int, tool: str, **arguments: Any) -> None:
        frame = CallFrame(id=call_id, tool=tool, arguments=arguments)
        self.sock.sendall(_protocol.encode_frame(frame))

    def send_raw(self, message: dict[str, Any]) -> None:
        self.sock.sendall(_protocol.encode(message))

    def result(self) -> dict[str, Any]:
        header = self._exactly(_protocol.HEADER.size)
        length = _protocol.body_length(header, _protocol.FROM_WORKER)
        return _protocol.decode(self._exactly(length), _protocol.FROM_WORKER)

    def _exactly(self, n: int) -> bytes:
        buf = b""
        while len(buf) < n:
            chunk = self.sock.recv(n - len(buf))
            assert chunk, "the worker closed the channel"
            buf += chunk
        return buf


@contextmanager
def serving(handle: Callable[[CallFrame], ResultFrame]) -> Iterator[Kernel]:
    ours, theirs = socket.socketpair()
    server = threading.Thread(target=mechanism.serve, args=(mechanism.Channel(theirs), handle))
    server.start()
    try:
        yield Kernel(ours)
    finally:
        ours.close()  # the channel's end: serve returns
        server.join(10)
        theirs.close()
    assert not server.is_alive()


def _threads_named_call() -> int:
    return sum(1 for t in threading.enumerate() if t.name == "call")


def test_sequential_calls_reuse_two_threads() -> None:
    idents: list[int] = []

    def handle(call: CallFrame) -> ResultFrame:
        idents.append(threading.get_ident())
        return ResultFrame(id=call.id, ok=True, value=call.arguments["n"])

    with serving(handle) as kernel:
        for n in range(50):
            kernel.call(n + 1, "echo", n=n)
            assert kernel.result() == {"type": "result", "id": n + 1, "ok": True, "value": n}
        # One thread runs the call while the other reads the next frame.
        assert len(set(idents)) <= 2
        assert _threads_named_call() <= mechanism._IDLE_THREADS


def test_calls_run_in_parallel_and_the_threads_shrink_back() -> None:
    parallel = 6
    arrived = threading.Barrier(parallel, timeout=10)

    def handle(call: CallFrame) -> ResultFrame:
        if call.tool == "wait":
            arrived.wait()  # passes only once every call runs at the same time
        return ResultFrame(id=call.id, ok=True, value=call.id)

    with serving(handle) as kernel:
        for n in range(parallel):
            kernel.call(n + 1, "wait")
        ids = sorted(kernel.result()["id"] for _ in range(parallel))
        assert ids == list(range(1, parallel + 1))
        # The burst's threads go back once idle, but for the few kept between calls.
        for n in range(20):
            kernel.call(100 + n, "quick")
            assert kernel.result()["id"] == 100 + n
        assert _threads_named_call() <= mechanism._IDLE_THREADS + 1


def test_results_go_back_in_completion_order() -> None:
    release = threading.Event()

    def handle(call: CallFrame) -> ResultFrame:
        if call.tool == "slow":
            release.wait(10)
        return ResultFrame(id=call.id, ok=True, value=call.tool)

    with serving(handle) as kernel:
        kernel.call(1, "slow")
        kernel.call(2, "fast")
        assert kernel.result()["id"] == 2
        release.set()
        assert kernel.result()["id"] == 1


def test_a_malformed_call_is_answered_and_serving_goes_on() -> None:
    def handle(call: CallFrame) -> ResultFrame:
        return ResultFrame(id=call.id, ok=True, value="ran")

    with serving(handle) as kernel:
        kernel.send_raw({"type": "call", "id": 7, "tool": 3, "arguments": {}})
        reply = kernel.result()
        assert reply["id"] == 7 and reply["error"]["kind"] == "bad_arguments"
        kernel.send_raw({"type": "call", "id": "x", "tool": "t", "arguments": {}})  # unanswerable
        kernel.send_raw({"type": "nonsense"})  # not a call: skipped
        kernel.call(8, "t")
        assert kernel.result() == {"type": "result", "id": 8, "ok": True, "value": "ran"}


def test_a_result_the_kernel_would_refuse_is_replaced() -> None:
    def handle(call: CallFrame) -> ResultFrame:
        return ResultFrame(id=call.id, ok=True, value="x" * (_protocol.FROM_WORKER.max_bytes + 1))

    with serving(handle) as kernel:
        kernel.call(1, "big")
        reply = kernel.result()
        assert reply["error"]["kind"] == "output_too_large"


def test_without_a_task_for_a_new_thread_the_call_is_exhausted(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    release = threading.Event()
    holding = threading.Semaphore(0)

    def handle(call: CallFrame) -> ResultFrame:
        if call.tool == "hold":
            holding.release()
            release.wait(10)
        return ResultFrame(id=call.id, ok=True, value=call.tool)

    monkeypatch.setattr(mechanism, "_THREAD_RETRY_S", 0.0)
    with serving(handle) as kernel:
        # Both calls hold a thread, and a third one reads: no thread is free to start.
        kernel.call(1, "hold")
        kernel.call(2, "hold")
        assert holding.acquire(timeout=10) and holding.acquire(timeout=10)
        real_start = threading.Thread.start

        def refuse(self: threading.Thread) -> None:
            if self.name == "call":
                raise RuntimeError("can't start new thread")
            real_start(self)

        monkeypatch.setattr(threading.Thread, "start", refuse)
        kernel.call(3, "more")
        reply = kernel.result()
        assert reply["id"] == 3 and "the worker is exhausted" in reply["error"]["message"]
        monkeypatch.setattr(threading.Thread, "start", real_start)
        release.set()
        assert sorted(kernel.result()["id"] for _ in range(2)) == [1, 2]
        kernel.call(4, "after")
        assert kernel.result()["value"] == "after"
