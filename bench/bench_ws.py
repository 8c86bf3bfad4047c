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

Then the issue-13 row: 10 clients, one-call `call_tools`, calls per second
over the WebSocket next to the same calls in process, in alternating rounds
(in process, websocket, open_client, ...); printed with the median of the
rounds, the ratio to the in-process median and the target (websocket at least
40% of in process). Clients and server share this process and its one core,
so the ratio also pays for the client's side of every frame.
"""

from __future__ import annotations

import functools
import json
import statistics
import tempfile
import time
from collections.abc import Awaitable, Callable

import trio
from trio_websocket import open_websocket_url

from kernel import Kernel, ToolCall, open_kernel, tool
from kernel.store import MemoryStore
from kernel.wire import ServerLimits, open_client, serve_websocket

ROUNDS = 2000
#: The target row: alternating rounds of this many calls each, 10 clients.
TARGET_CLIENTS = 10
TARGET_ROUNDS = 7
TARGET_CALLS = 1000
TARGET_RATIO = 0.40


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
                runs: list[tuple[str, Client]] = [
                    ("in process", functools.partial(in_process, k)),
                    ("websocket", functools.partial(json_client, url)),
                    ("open_client", functools.partial(typed_client, url)),
                ]
                for clients in (1, 10, 100):
                    for name, run in runs:
                        latencies: list[float] = []
                        wall = await clients_run(
                            run, clients, max(ROUNDS // clients, 20), latencies
                        )
                        row(name, clients, latencies, wall)
                await target_row(runs)
                nursery.cancel_scope.cancel()


Client = Callable[[int, list[float]], Awaitable[None]]


async def clients_run(run: Client, clients: int, rounds: int, latencies: list[float]) -> float:
    """Wall seconds for ``clients`` concurrent clients making ``rounds`` calls each."""
    started = time.perf_counter()
    async with trio.open_nursery() as group:
        for _ in range(clients):
            group.start_soon(run, rounds, latencies)
    return time.perf_counter() - started


async def target_row(runs: list[tuple[str, Client]]) -> None:
    rates: dict[str, list[float]] = {name: [] for name, _ in runs}
    for _ in range(TARGET_ROUNDS):
        for name, run in runs:
            wall = await clients_run(run, TARGET_CLIENTS, TARGET_CALLS // TARGET_CLIENTS, [])
            rates[name].append(TARGET_CALLS / wall)
    base = statistics.median(rates["in process"])
    print(
        f"\n{TARGET_CLIENTS} clients, one-call call_tools, median of {TARGET_ROUNDS} "
        "alternating rounds"
    )
    print(f"{'':<11} {'calls/s':>9}  {'vs in process':>13}  target")
    for name, _ in runs:
        rate = statistics.median(rates[name])
        if name == "in process":
            target = "baseline"
        elif name == "websocket":
            met = "met" if rate / base >= TARGET_RATIO else "NOT met"
            target = f">= {TARGET_RATIO:.0%}  {met}"
        else:
            target = "(typed client; no target)"
        print(f"{name:<11} {rate:>9.0f}  {rate / base:>12.0%}  {target}")


if __name__ == "__main__":
    trio.run(main)
