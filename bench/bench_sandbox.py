"""Sandbox overhead: a no-op tool in a warm worker vs in process, and a cold worker start.

Run: ``python bench/bench_sandbox.py``. Prints a table next to the targets
(warm round trip under 1 ms median, cold start to first result under
150 ms); never fails on timing.

This file is also the plugin the workers load (its ``noop`` tool), so the
benchmark itself imports Trio and the pool only inside ``main``.
"""

from __future__ import annotations

import os
import statistics
import sys
import tempfile
import time
from typing import Any

from kernel.tools import tool
from plugins import remote_tools


@tool
def noop() -> None:
    """Do nothing."""


PLUGIN = os.path.abspath(__file__)
WARM_CALLS = 2000
COLD_STARTS = 15


def _summary(samples_s: list[float]) -> tuple[float, float]:
    ordered = sorted(samples_s)
    p99 = ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))]
    return statistics.median(ordered) * 1000, p99 * 1000


async def _measure(workspace: str) -> dict[str, list[float]]:
    import trio

    from kernel.executor import run_tool_calls
    from kernel.messages import ToolCall
    from sandbox import Policy, open_worker_pool

    call = [ToolCall("c", "noop", {})]
    results: dict[str, list[float]] = {
        "in_process": [],
        "warm": [],
        "warm_invoke": [],
        "cold": [],
        "spare": [],
    }
    policy = Policy(workspace="read")

    async def timed(tools: Any) -> float:
        started = time.perf_counter()
        [observation] = await run_tool_calls(call, tools)
        elapsed = time.perf_counter() - started
        assert not observation.is_error, observation
        return elapsed

    for _ in range(WARM_CALLS):
        results["in_process"].append(await timed([noop]))

    async with open_worker_pool(workspace) as pool:
        worker = await pool.start(PLUGIN, policy=policy)
        remote = remote_tools(worker)
        invoke = remote[0].invoke
        assert invoke is not None
        for _ in range(200):  # warm up
            await timed(remote)
        for _ in range(WARM_CALLS):
            results["warm"].append(await timed(remote))
        for _ in range(WARM_CALLS):
            started = time.perf_counter()
            await invoke({})
            results["warm_invoke"].append(time.perf_counter() - started)
        await worker.aclose()

        # With the pool's spare process ready (the steady state for starts and restarts).
        for _ in range(COLD_STARTS):
            await trio.sleep(0.5)  # time for the next spare to start
            started = time.perf_counter()
            started_worker = await pool.start(PLUGIN, policy=policy)
            await timed(remote_tools(started_worker))
            results["spare"].append(time.perf_counter() - started)
            await started_worker.aclose()

    # Without a spare: the interpreter starts from nothing.
    async with open_worker_pool(workspace, spare=False) as pool:
        for _ in range(COLD_STARTS):
            started = time.perf_counter()
            cold = await pool.start(PLUGIN, policy=policy)
            [observation] = await run_tool_calls(call, remote_tools(cold))
            results["cold"].append(time.perf_counter() - started)
            assert not observation.is_error, observation
            await cold.aclose()
    return results


def main() -> int:
    import trio

    from sandbox import probe_isolation

    support = probe_isolation()
    with tempfile.TemporaryDirectory(prefix="tak-bench-") as workspace:
        results = trio.run(_measure, workspace)
    rows = [
        ("no-op, in process (run_tool_calls)", results["in_process"], None),
        ("no-op, warm worker (run_tool_calls)", results["warm"], 1.0),
        ("no-op, warm worker (Tool.invoke only)", results["warm_invoke"], 1.0),
        ("cold worker: start to first result", results["cold"], 150.0),
        ("worker from the spare: start to result", results["spare"], 150.0),
    ]
    print(
        f"sandbox: isolation {support.level}, Landlock ABI {support.landlock_abi}, "
        f"Python {sys.version.split()[0]}, {os.cpu_count()} CPUs"
    )
    print(f"{'case':<40} {'n':>5} {'median ms':>10} {'p99 ms':>9} {'target':>12}")
    for name, samples, target in rows:
        median, p99 = _summary(samples)
        verdict = (
            "" if target is None else f"< {target:g} ms " + ("ok" if median < target else "MISS")
        )
        print(f"{name:<40} {len(samples):>5} {median:>10.3f} {p99:>9.3f} {verdict:>12}")
    overhead = _summary(results["warm"])[0] - _summary(results["in_process"])[0]
    print(f"worker overhead per call (median): {overhead:.3f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
