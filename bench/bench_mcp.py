"""Per-call overhead of an MCP server's tool through the kernel, beside the SDK's bare client.

One stdio MCP server (tests/mcp/server.py, the SDK's ``MCPServer``) per side:
the kernel's way (``open_mcp_servers`` → ``run_tool_calls`` of one call to
``t.echo``) and the SDK's own ``ClientSession.call_tool("echo", ...)``, in
alternating rounds of sequential calls, then the same with 10 calls at once.
Prints the median per call, each beside the other, and the kernel's overhead
per call. Run: ``.venv/bin/python bench/bench_mcp.py`` (``make bench``); never
fails on timing. Needs the ``mcp`` extra.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import trio

ROOT = Path(__file__).resolve().parents[1]
SERVER = str(ROOT / "tests" / "mcp" / "server.py")
ROUNDS = 5
CALLS = 200
BATCH = 10


async def kernel_side(rounds: list[float], batched: list[float]) -> None:
    from kernel import ToolCall, ToolRegistry, run_tool_calls
    from kernel.home import McpServerConfig
    from plugins import open_mcp_servers

    registry = ToolRegistry()
    config = McpServerConfig(command=sys.executable, args=[SERVER], startup_timeout=30)
    async with open_mcp_servers({"t": config}, registry) as mcp:
        await mcp.list_tools()
        for _ in range(20):  # warm up
            await run_tool_calls([ToolCall("w", "t.echo", {"text": "hi"})], registry)
        await _alternate.wait_turn("kernel")
        for r in range(ROUNDS):
            start = time.perf_counter()
            for i in range(CALLS):
                await run_tool_calls([ToolCall(str(i), "t.echo", {"text": "hi"})], registry)
            rounds.append((time.perf_counter() - start) / CALLS)
            calls = [ToolCall(str(i), "t.echo", {"text": "hi"}) for i in range(BATCH)]
            start = time.perf_counter()
            for _ in range(CALLS // BATCH):
                await run_tool_calls(calls, registry)
            batched.append((time.perf_counter() - start) / CALLS)
            await _alternate.done("kernel", r)


async def sdk_side(rounds: list[float], batched: list[float]) -> None:
    from mcp import ClientSession
    from mcp.client.stdio import StdioServerParameters, stdio_client

    params = StdioServerParameters(command=sys.executable, args=[SERVER])
    async with stdio_client(params) as (read, write), ClientSession(read, write) as session:
        await session.initialize()
        for _ in range(20):
            await session.call_tool("echo", {"text": "hi"})
        await _alternate.wait_turn("sdk")
        for r in range(ROUNDS):
            start = time.perf_counter()
            for _ in range(CALLS):
                await session.call_tool("echo", {"text": "hi"})
            rounds.append((time.perf_counter() - start) / CALLS)
            start = time.perf_counter()
            for _ in range(CALLS // BATCH):
                async with trio.open_nursery() as nursery:
                    for _ in range(BATCH):
                        nursery.start_soon(session.call_tool, "echo", {"text": "hi"})
            batched.append((time.perf_counter() - start) / CALLS)
            await _alternate.done("sdk", r)


class _Alternate:
    """Rounds taken in turn: kernel, sdk, kernel, sdk, ... (one side idle at a time)."""

    def __init__(self) -> None:
        self.turn = "kernel"
        self.changed = trio.Event()

    async def wait_turn(self, side: str) -> None:
        while self.turn != side:
            await self.changed.wait()

    async def done(self, side: str, round_: int) -> None:
        self.turn = "sdk" if side == "kernel" else "kernel"
        self.changed.set()
        self.changed = trio.Event()
        if round_ < ROUNDS - 1:
            await self.wait_turn(side)


_alternate = _Alternate()


async def main() -> None:
    ours: list[float] = []
    ours_batched: list[float] = []
    bare: list[float] = []
    bare_batched: list[float] = []
    async with trio.open_nursery() as nursery:
        nursery.start_soon(kernel_side, ours, ours_batched)
        nursery.start_soon(sdk_side, bare, bare_batched)
    print("MCP tool call (stdio, the SDK's MCPServer echo), median of alternating rounds")
    print(f"{'':34} {'kernel':>10} {'SDK client':>11} {'overhead':>10}")
    for label, a, b in (
        (f"one call at a time ({CALLS} calls)", ours, bare),
        (f"{BATCH} at once (per call)", ours_batched, bare_batched),
    ):
        k, s = statistics.median(a) * 1e3, statistics.median(b) * 1e3
        print(f"{label:34} {k:8.3f} ms {s:8.3f} ms {(k - s) * 1e3:7.0f} µs")


if __name__ == "__main__":
    trio.run(main)
