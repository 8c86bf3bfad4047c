"""For resource attempts: prove the kernel stayed responsive while the attack ran.

``await while_responsive(arena, attempt)`` runs ``attempt`` and, beside it, a
ticker that sleeps 10 ms at a time (the longest gap between two of its
wake-ups, less the 10 ms, is how long the Trio loop was frozen: a freeze
anywhere counts, not only during a call), an in-process tool through
``run_tool_calls`` every few milliseconds (each must answer well within its
deadline) and one call in a second, fresh worker (it must complete). Real
processes are involved, so this uses the real clock.
"""

from __future__ import annotations

import os
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

import trio
from kit import Arena

from kernel.executor import run_tool_calls
from kernel.messages import ToolCall
from kernel.tools import tool

T = TypeVar("T")

#: A ping must come back within this (its deadline is 2 s; the kernel must not stall).
MAX_PING_S = 1.0
#: The longest the Trio loop may go without waking a 10 ms sleeper, past its 10 ms.
#: Generous: real processes start meanwhile on a loaded 2-CPU machine.
MAX_STALL_S = 0.5
_TICK_S = 0.01
#: The second worker's call (a cold start and one call) must come back within this.
MAX_SECOND_WORKER_S = 10.0


@tool(timeout=2)
def ping() -> str:
    """Answer at once."""
    return "pong"


async def while_responsive(arena: Arena, attempt: Callable[[], Awaitable[T]]) -> T:
    """Run ``attempt``; fail unless the kernel answered throughout."""
    latencies: list[float] = []
    gaps: list[float] = [0.0]
    second: list[str] = []
    box: list[T] = []

    async def ticker() -> None:
        while True:
            started = time.monotonic()
            await trio.sleep(_TICK_S)
            gaps.append(time.monotonic() - started - _TICK_S)

    async def pinger() -> None:
        while True:
            started = time.monotonic()
            [obs] = await run_tool_calls([ToolCall("p", "ping", {})], [ping])
            assert obs.content == "pong", obs
            latencies.append(time.monotonic() - started)
            await trio.sleep(0.02)

    async def second_worker() -> None:
        started = time.monotonic()
        second.append(await arena.attack("result = 1"))
        second.append(f"{time.monotonic() - started:.2f}")

    async def run() -> None:
        box.append(await attempt())

    async with trio.open_nursery() as nursery:
        nursery.start_soon(ticker)
        nursery.start_soon(pinger)
        async with trio.open_nursery() as both:
            both.start_soon(second_worker)
            both.start_soon(run)
        nursery.cancel_scope.cancel()
    assert latencies, "no ping ran during the attempt"
    assert max(latencies) < MAX_PING_S, f"the kernel stalled for {max(latencies):.2f} s"
    assert max(gaps) < MAX_STALL_S, f"the Trio loop froze for {max(gaps):.2f} s"
    assert second[0] == "ALLOWED: 1", f"a second worker's call failed: {second[0]}"
    assert float(second[1]) < MAX_SECOND_WORKER_S, f"a second worker took {second[1]} s"
    return box[0]


def pid_alive(pid: int) -> bool:
    """A live process (not a zombie) has this pid."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rpartition(")")[2].split()[0]
    except OSError:
        return False
    return state not in ("Z", "X")


async def wait_gone(pid: int, within_s: float = 5.0) -> None:
    with trio.move_on_after(within_s):
        while pid_alive(pid):  # noqa: ASYNC110 (nothing to wait on but /proc)
            await trio.sleep(0.02)
    assert not pid_alive(pid), f"pid {pid} is still running"


def cgroup_dirs_of(pid: int) -> list[str]:
    """The ``tak-worker-*`` cgroup directories ``pid`` is in (v1 and v2)."""
    dirs = []
    with open(f"/proc/{pid}/cgroup") as f:
        for line in f.read().splitlines():
            _, controllers, path = line.split(":", 2)
            if "tak-worker-" not in path:
                continue
            hierarchy = controllers.split(",")[0] if controllers else ""
            dirs.append(os.path.join("/sys/fs/cgroup", hierarchy, path.lstrip("/")))
    return dirs


def dirs_removed(dirs: list[str]) -> bool:
    """None of ``dirs`` exists any more."""
    return not any(os.path.exists(d) for d in dirs)
