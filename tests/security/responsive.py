"""For resource attempts: prove the kernel stayed responsive while the attack ran.

``await while_responsive(arena, attempt)`` runs ``attempt`` and, beside it, an
in-process tool through ``run_tool_calls`` again and again (each must answer
``pong``, not its 2 s deadline's timeout, and at least one must answer while the
attack runs) and one call in a second, fresh worker (it must complete). Counted,
not timed: how long the loop stalls meanwhile is a figure for a benchmark
(bench/bench_kernel_stalls.py prints the fs tools'), never asserted (on a loaded
machine every bound is wrong).
"""

from __future__ import annotations

import os
from collections.abc import Awaitable, Callable
from typing import TypeVar

import trio
from kit import Arena

from kernel.executor import run_tool_calls
from kernel.messages import ToolCall
from kernel.tools import tool

T = TypeVar("T")


@tool(timeout=2)
def ping() -> str:
    """Answer at once."""
    return "pong"


async def while_responsive(arena: Arena, attempt: Callable[[], Awaitable[T]]) -> T:
    """Run ``attempt``; fail unless the kernel answered throughout."""
    pongs = 0
    attempt_done = False
    second: list[str] = []
    box: list[T] = []

    async def pinger() -> None:
        nonlocal pongs
        while True:
            [obs] = await run_tool_calls([ToolCall("p", "ping", {})], [ping])
            assert obs.content == "pong", obs  # not "did not finish within 2 s"
            if not attempt_done:
                pongs += 1
            await trio.sleep(0.02)

    async def second_worker() -> None:
        second.append(await arena.attack("result = 1"))

    async def run() -> None:
        nonlocal attempt_done
        box.append(await attempt())
        attempt_done = True

    async with trio.open_nursery() as nursery:
        nursery.start_soon(pinger)
        async with trio.open_nursery() as both:
            both.start_soon(second_worker)
            both.start_soon(run)
        nursery.cancel_scope.cancel()
    assert pongs, "no ping was answered during the attempt"
    assert second == ["ALLOWED: 1"], f"a second worker's call failed: {second}"
    return box[0]


def pid_alive(pid: int) -> bool:
    """A live process (not a zombie) has this pid."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rpartition(")")[2].split()[0]
    except OSError:
        return False
    return state not in ("Z", "X")


async def wait_gone(pid: int, within_s: float = 30.0) -> None:
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
