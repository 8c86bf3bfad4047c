"""Sandbox latency: a warm call with the machine busy, and a cold worker start.

Run: ``python bench/bench_sandbox.py``. Prints each row of issue 13 next to its
baseline, measured in the same run in alternating rounds (so a noisy machine moves
both alike), with the ratio and the target; never fails on timing.

- **warm call, machine busy**: the bench starts one busy-looping process per core
  (normal priority) for this row, then alternates rounds of a no-op tool called in
  a warm worker (``run_tool_calls``, and ``Tool.invoke`` alone) with rounds of a
  socket pair echo to a child process (the least any worker call can cost: one
  frame there, one back). Target: p50 < 1 ms, p99 < 3 ms.
- **cold start**: a worker started from nothing (no spare process) until its first
  result, alternating with ``python -I -S -c pass``. Target: p50 < 4x that.

This file is also the plugin the workers load (its ``noop`` tool), so the
benchmark itself imports Trio and the pool only inside ``main``.
"""

from __future__ import annotations

import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time

from kernel.tools import tool

# Nothing else at the top: the workers import this file as their plugin, and a
# plugin that imported the kernel's side (Trio, the pool) would time that import.


@tool
def noop() -> None:
    """Do nothing."""


PLUGIN = os.path.abspath(__file__)
ROUNDS = 10
CALLS_PER_ROUND = 200
COLD_ROUNDS = 15

#: The echo child: what a worker does with a frame, minus everything but the socket.
_ECHO = """
import socket, sys
s = socket.socket(fileno=int(sys.argv[1]))
while data := s.recv(65536):
    s.sendall(data)
"""
_BURN = "while True: pass"


def _summary(samples_s: list[float]) -> tuple[float, float]:
    ordered = sorted(samples_s)
    p99 = ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))]
    return statistics.median(ordered) * 1000, p99 * 1000


def _burners() -> list[subprocess.Popen[bytes]]:
    return [
        subprocess.Popen([sys.executable, "-I", "-S", "-c", _BURN])
        for _ in range(os.cpu_count() or 1)
    ]


async def _warm(workspace: str, ours: socket.socket) -> dict[str, list[float]]:
    import trio

    from kernel.executor import run_tool_calls
    from kernel.messages import ToolCall
    from plugins import remote_tools
    from sandbox import Policy, open_worker_pool

    call = [ToolCall("c", "noop", {})]
    results: dict[str, list[float]] = {"echo": [], "warm": [], "warm_invoke": []}
    stream = trio.SocketStream(trio.socket.from_stdlib_socket(ours))
    # A call frame's size, give or take: what the echo moves each way.
    frame = b"x" * 120
    try:
        async with open_worker_pool(workspace, spare=False) as pool:
            worker = await pool.start(PLUGIN, policy=Policy(workspace="read"))
            remote = remote_tools(worker)
            invoke = remote[0].invoke
            assert invoke is not None
            for _ in range(200):  # warm up both
                await run_tool_calls(call, remote)
                await stream.send_all(frame)
                await stream.receive_some(65536)
            for _ in range(ROUNDS):
                for _ in range(CALLS_PER_ROUND):
                    started = time.perf_counter()
                    await stream.send_all(frame)
                    got = 0
                    while got < len(frame):
                        got += len(await stream.receive_some(65536))
                    results["echo"].append(time.perf_counter() - started)
                for _ in range(CALLS_PER_ROUND):
                    started = time.perf_counter()
                    [observation] = await run_tool_calls(call, remote)
                    results["warm"].append(time.perf_counter() - started)
                    assert not observation.is_error, observation
                for _ in range(CALLS_PER_ROUND):
                    started = time.perf_counter()
                    await invoke({})
                    results["warm_invoke"].append(time.perf_counter() - started)
            await worker.aclose()
    finally:
        await stream.aclose()
    return results


async def _cold(workspace: str) -> dict[str, list[float]]:
    import trio

    from kernel.executor import run_tool_calls
    from kernel.messages import ToolCall
    from plugins import remote_tools
    from sandbox import Policy, open_worker_pool

    call = [ToolCall("c", "noop", {})]
    results: dict[str, list[float]] = {"python": [], "cold": []}
    policy = Policy(workspace="read")
    async with open_worker_pool(workspace, spare=False) as pool:
        for _ in range(COLD_ROUNDS):
            started = time.perf_counter()
            await trio.run_process([sys.executable, "-I", "-S", "-c", "pass"])
            results["python"].append(time.perf_counter() - started)
            started = time.perf_counter()
            cold = await pool.start(PLUGIN, policy=policy)
            [observation] = await run_tool_calls(call, remote_tools(cold))
            results["cold"].append(time.perf_counter() - started)
            assert not observation.is_error, observation
            await cold.aclose()
    return results


def _row(name: str, samples: list[float], base: list[float], target: str, verdict: str) -> str:
    median, p99 = _summary(samples)
    base_median, base_p99 = _summary(base)
    ratio = median / base_median if base_median else float("inf")
    return (
        f"{name:<38} {median:>8.3f} {p99:>8.3f} {base_median:>8.3f} {base_p99:>8.3f} "
        f"{ratio:>6.1f}x  {target}: {verdict}"
    )


def _ok(met: bool) -> str:
    return "ok" if met else "MISS"


def main() -> int:
    import trio

    from sandbox import probe_isolation

    support = probe_isolation()
    with tempfile.TemporaryDirectory(prefix="tak-bench-") as workspace:
        ours, theirs = socket.socketpair()
        echo = subprocess.Popen(
            [sys.executable, "-I", "-S", "-c", _ECHO, str(theirs.fileno())],
            pass_fds=(theirs.fileno(),),
        )
        theirs.close()
        burners = _burners()
        try:
            warm = trio.run(_warm, workspace, ours)
        finally:
            for child in [*burners, echo]:
                child.kill()
                child.wait()
        cold = trio.run(_cold, workspace)
    print(
        f"sandbox: isolation {support.level}, Landlock ABI {support.landlock_abi}, "
        f"Python {sys.version.split()[0]}, {os.cpu_count()} CPUs; "
        f"warm rows with {os.cpu_count()} CPU burners running"
    )
    print(
        f"{'case':<38} {'p50 ms':>8} {'p99 ms':>8} {'base p50':>8} {'base p99':>8} "
        f"{'ratio':>7}  target"
    )
    for key, name in (("warm", "warm call, busy (run_tool_calls)"), ("warm_invoke", None)):
        p50, p99 = _summary(warm[key])
        label = name or "warm call, busy (Tool.invoke only)"
        print(
            _row(
                label,
                warm[key],
                warm["echo"],
                "p50 < 1 ms, p99 < 3 ms (base: socketpair echo)",
                f"p50 {_ok(p50 < 1.0)}, p99 {_ok(p99 < 3.0)}",
            )
        )
    cold_p50, python_p50 = _summary(cold["cold"])[0], _summary(cold["python"])[0]
    print(
        _row(
            "cold start to first result",
            cold["cold"],
            cold["python"],
            "p50 < 4x (base: python -I -S -c pass)",
            _ok(cold_p50 < 4 * python_p50),
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
