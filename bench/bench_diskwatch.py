"""The disk watchdog (issue 22, class 1): what it costs a call, and what it lets through.

Run: ``python bench/bench_diskwatch.py``. Prints each figure next to its baseline
from the same run; never fails on timing.

- **warm call**: a no-op tool in a warm worker that may write the workspace, in
  alternating rounds with the workspace watched (``WorkerPool.watch_budget``: the
  admission check on every call, a look every 50 ms in a thread) and not watched.
- **one look**: ``DiskWatch.look`` when the bound holds (two ``fstatvfs`` in a
  thread), beside a bare ``trio.to_thread.run_sync`` of nothing.
- **one walk**: the frozen walk of a workspace of 10,000 files (``measure_budget``),
  the price of each walk the bound asks for, and of the forced one every 5 s.
- **overshoot**: programs a worker left running write as fast as they can (1 MiB of
  zeros per ``write``, no pause; then 128 MiB per ``write``, which no freezer stops
  midway) against a 64 MiB budget: the bytes past the budget once the watchdog has
  killed them, beside what they would have written.

This file is also the plugin the workers load (its ``noop`` and ``flood`` tools), so
the benchmark imports Trio and the pool only inside ``main``.
"""

from __future__ import annotations

import os
import statistics
import sys
import tempfile
import time

from kernel.tools import tool

# Nothing else at the top: the workers import this file as their plugin.


@tool
def noop() -> None:
    """Do nothing."""


@tool
def flood(writers: int, total: int, chunk: int) -> str:
    """Start ``writers`` programs that each write ``total`` bytes as fast as they can,
    ``chunk`` bytes per ``write`` (from the zero page: no memory charged), a new file
    every 128 MiB."""
    import subprocess

    code = (
        "import mmap, os, sys\n"
        f"buf = mmap.mmap(-1, {chunk})\n"
        f"for i in range({total} // {chunk}):\n"
        f"    if i % max(1, (128 << 20) // {chunk}) == 0:\n"
        "        fd = os.open(f'flood-{sys.argv[1]}-{i}', os.O_CREAT | os.O_WRONLY, 0o600)\n"
        "    os.write(fd, buf)\n"
    )
    for n in range(writers):
        subprocess.Popen([sys.executable, "-c", code, str(n)], stdin=subprocess.DEVNULL)
    return "started"


PLUGIN = os.path.abspath(__file__)
ROUNDS = 8
CALLS_PER_ROUND = 200
MIB = 1 << 20


def _usage(root: str) -> int:
    total = 0
    for top, dirs, files in os.walk(root):
        for name in dirs + files:
            total += os.lstat(os.path.join(top, name)).st_blocks * 512
    return total


def _touch_many(root: str, n: int) -> None:
    for i in range(n):
        os.close(os.open(os.path.join(root, f"f{i}"), os.O_CREAT | os.O_WRONLY, 0o600))


def _unlink_many(root: str, n: int) -> None:
    for i in range(n):
        os.unlink(os.path.join(root, f"f{i}"))


def _row(name: str, values: list[float], base: list[float], unit: str = "us") -> None:
    scale = 1e6 if unit == "us" else 1e3
    p50, b50 = statistics.median(values), statistics.median(base)
    p95 = sorted(values)[int(len(values) * 0.95)]
    b95 = sorted(base)[int(len(base) * 0.95)]
    print(
        f"{name:<34} p50 {p50 * scale:8.1f} {unit}  p95 {p95 * scale:8.1f} {unit}   "
        f"baseline p50 {b50 * scale:8.1f}  p95 {b95 * scale:8.1f}   "
        f"x{p50 / b50 if b50 else float('nan'):.2f}"
    )


async def main() -> None:
    import trio

    from sandbox import Policy, Workspace, measure_budget, open_worker_pool

    policy = Policy(workspace="write", subprocess=True)
    with tempfile.TemporaryDirectory() as root:
        watched_dir, plain_dir = os.path.join(root, "watched"), os.path.join(root, "plain")
        os.mkdir(watched_dir)
        os.mkdir(plain_dir)
        async with (
            open_worker_pool(watched_dir, spare=False) as watched_pool,
            open_worker_pool(plain_dir, spare=False) as plain_pool,
        ):
            with Workspace(watched_dir, max_bytes=64 * MIB, max_files=200_000) as ws:
                async with watched_pool.watch_budget(ws) as watch:
                    on = await watched_pool.start(PLUGIN, policy=policy)
                    off = await plain_pool.start(PLUGIN, policy=policy)
                    with_watch: list[float] = []
                    without: list[float] = []
                    for round_ in range(ROUNDS):
                        pairs = [(on, with_watch), (off, without)]
                        for worker, out in pairs if round_ % 2 else pairs[::-1]:
                            for _ in range(CALLS_PER_ROUND):
                                started = time.perf_counter()
                                await worker.invoke("noop", {})
                                out.append(time.perf_counter() - started)
                    _row("warm call, watched", with_watch, without)
                    print(f"{'':<34} ({watch.looks} looks, {watch.walks} walks meanwhile)")

                    looks: list[float] = []
                    bare: list[float] = []
                    for _ in range(200):
                        started = time.perf_counter()
                        await watch.look()
                        looks.append(time.perf_counter() - started)
                        started = time.perf_counter()
                        await trio.to_thread.run_sync(lambda: None)
                        bare.append(time.perf_counter() - started)
                    _row("one look (the bound holds)", looks, bare)

                    await trio.to_thread.run_sync(_touch_many, watched_dir, 10_000)
                    walks: list[float] = []
                    empty: list[float] = []
                    for _ in range(10):
                        started = time.perf_counter()
                        await measure_budget(watched_pool, ws)
                        walks.append(time.perf_counter() - started)
                        started = time.perf_counter()
                        async with watched_pool.frozen():
                            pass
                        empty.append(time.perf_counter() - started)
                    _row("one walk, 10,000 files (frozen)", walks, empty, unit="ms")
                    print(f"{'':<34} (baseline: freeze and thaw, no walk)")
                    await trio.to_thread.run_sync(_unlink_many, watched_dir, 10_000)
                    await trio.to_thread.run_sync(ws.refresh_usage)

                    for writers, chunk in ((1, MIB), (4, MIB), (4, 128 * MIB)):
                        await watched_pool.close_worker(on)
                        on = await watched_pool.start(PLUGIN, policy=policy)
                        total = 512 * MIB
                        arguments = {"writers": writers, "total": total, "chunk": chunk}
                        await on.invoke("flood", arguments)
                        while watched_pool.writers(ws.path):
                            await watched_pool.writers_changed()  # killed by the watchdog
                        used = await trio.to_thread.run_sync(_usage, watched_dir)
                        print(
                            f"overshoot, {writers} writer(s), {chunk // MIB:3d} MiB writes: "
                            f"{(used - 64 * MIB) / MIB:6.1f} MiB past a 64 MiB budget "
                            f"(they meant {writers * total // MIB} MiB)"
                        )
                        for name in os.listdir(watched_dir):
                            if name.startswith("flood-"):
                                os.unlink(os.path.join(watched_dir, name))
                        await trio.to_thread.run_sync(ws.refresh_usage)


if __name__ == "__main__":
    import trio

    sys.path.insert(0, os.path.dirname(os.path.dirname(PLUGIN)))
    trio.run(main)
