"""Round trips over `tak serve`'s WebSocket next to the same calls made in process.

One-call `call_tools` batches (the `echo` tool) against a real server on
127.0.0.1: the latency of one round trip (median, p99) with one client, and
calls per second with 1, 10 and 100 concurrent clients, each sending its next
request when the previous one replied. The in-process rows run the same
`Kernel.call_tools` (transcript append included) without the socket. The
`websocket` rows are the server seen by a bare JSON client (one `json.dumps`
and one `json.loads` a frame); the `open_client` rows are the same calls made
with `kernel.wire.open_client` (typed records, a reader task routing frames),
so the difference is what the client costs: clients and server share this
process. A `MemoryStore` keeps the disk out of the numbers. Target: median
under 2 ms.
"""

from __future__ import annotations

import functools
import json
import statistics
import tempfile
import time

import trio
from trio_websocket import open_websocket_url

from kernel import Kernel, ToolCall, open_kernel, tool
from kernel.store import MemoryStore
from kernel.wire import ServerLimits, open_client, serve_websocket

ROUNDS = 2000


@tool
async def echo(text: str) -> str:
    """Return the text.

    Args:
        text: What to return.
    """
    return text


def request(i: int) -> str:
    return json.dumps(
        {
            "v": 1,
            "type": "call_tools",
            "id": str(i),
            "session": "bench",
            "calls": [{"id": f"c{i}", "name": "echo", "arguments": {"text": "hi"}}],
        }
    )


async def json_client(url: str, rounds: int, latencies: list[float]) -> None:
    async with open_websocket_url(url) as ws:
        for i in range(rounds):
            started = time.perf_counter()
            await ws.send_message(request(i))
            while json.loads(await ws.get_message())["type"] != "reply":
                pass
            latencies.append(time.perf_counter() - started)


async def typed_client(url: str, rounds: int, latencies: list[float]) -> None:
    async with open_client(url) as client:
        for i in range(rounds):
            started = time.perf_counter()
            await client.call_tools("bench", [ToolCall(f"c{i}", "echo", {"text": "hi"})])
            latencies.append(time.perf_counter() - started)


async def in_process(k: Kernel, rounds: int, latencies: list[float]) -> None:
    session = k.session("bench")
    for i in range(rounds):
        started = time.perf_counter()
        await k.call_tools(session, [ToolCall(f"c{i}", "echo", {"text": "hi"})])
        latencies.append(time.perf_counter() - started)


def row(name: str, clients: int, latencies: list[float], wall: float) -> None:
    ordered = sorted(latencies)
    p99 = ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))]
    print(
        f"{name:<11} {clients:>7}  {statistics.median(ordered) * 1e3:>8.3f}  "
        f"{p99 * 1e3:>8.3f}  {len(latencies) / wall:>9.0f}"
    )


async def main() -> None:
    with tempfile.TemporaryDirectory() as home:
        # plugins=[]: only the bench tool, no plugin workers
        async with open_kernel(
            home=home, model="scripted:echo", tools=[echo], store=MemoryStore(), plugins=[]
        ) as k:
            async with trio.open_nursery() as nursery:
                url = await nursery.start(
                    functools.partial(
                        serve_websocket, k, port=0, limits=ServerLimits(max_connections=256)
                    )
                )
                print(f"{'':<11} {'clients':>7}  {'median ms':>8}  {'p99 ms':>8}  {'calls/s':>9}")
                for clients in (1, 10, 100):
                    for name, run in (
                        ("in process", functools.partial(in_process, k)),
                        ("websocket", functools.partial(json_client, url)),
                        ("open_client", functools.partial(typed_client, url)),
                    ):
                        latencies: list[float] = []
                        rounds = max(ROUNDS // clients, 20)
                        started = time.perf_counter()
                        async with trio.open_nursery() as group:
                            for _ in range(clients):
                                group.start_soon(run, rounds, latencies)
                        row(name, clients, latencies, time.perf_counter() - started)
                nursery.cancel_scope.cancel()


if __name__ == "__main__":
    trio.run(main)
