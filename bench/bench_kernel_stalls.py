"""How long the kernel's Trio loop stalls while hostile work runs: the figures the tests count.

Run: ``python bench/bench_kernel_stalls.py``. For each attempt, a ticker sleeps 10 ms
at a time beside the call; the longest gap between its wake-ups, less the 10 ms, is
the longest stall of the loop. Each row is printed next to the same-run baseline (a
call that does nothing), with the ratio; never fails on timing.

The tests check the same attempts by what does not depend on the machine's speed:
the fs tools end by themselves, on their caps or their own clock (tests/security/
test_fs_dos.py); the kernel decodes no worker frame past
the limits of ``sandbox._protocol.FROM_WORKER`` (tests/security/frame_counter.py);
calls in other workers are still answered (tests/security/responsive.py).
"""

from __future__ import annotations

import logging
import os
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import trio

from kernel.executor import CallLimits, run_tool_calls
from kernel.messages import ToolCall
from kernel.plugin import ToolContext, use_context
from plugins import fs
from sandbox import Workspace

ROUNDS = 3


async def _stall_during(attempt: Callable[[], Awaitable[Any]]) -> float:
    """The longest the loop went without waking a 10 ms sleeper, past its 10 ms."""
    gaps = [0.0]

    async def ticker() -> None:
        while True:
            started = time.monotonic()
            await trio.sleep(0.01)
            gaps.append(time.monotonic() - started - 0.01)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(ticker)
        await attempt()
        nursery.cancel_scope.cancel()
    return max(gaps)


def _fs_call(tool: str, **arguments: Any) -> Callable[[], Awaitable[Any]]:
    async def call() -> Any:
        return await run_tool_calls(
            [ToolCall("c", tool, arguments)], fs.plugin.tools, limits=CallLimits(timeout=10)
        )

    return call


def _workspace(root: Path) -> None:
    (root / "big.txt").write_text(("a" * 40 + "!\n") * 100_000)
    (root / "line.txt").write_text("x" * (8 * 1024 * 1024 - 1))
    (root / "few.txt").write_text(("x" * 1000 + "\n") * 8000 + "needle\n" * 3)


def main() -> int:
    attempts = {
        "grep, catastrophic pattern": ("grep", {"pattern": "(a+)+$", "path": "big.txt"}),
        "read_file, one 8 MiB line": ("read_file", {"path": "line.txt"}),
        "edit_file, several matches": (
            "edit_file",
            {"path": "few.txt", "old": "needle", "new": "n"},
        ),
    }
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        _workspace(root)
        with Workspace(root, protected=(".tak",)) as ws:
            context = ToolContext(ws, "p/s", logging.getLogger("bench"), {})
            with use_context(context):

                async def rounds() -> dict[str, list[float]]:
                    stalls: dict[str, list[float]] = {"baseline: read_file of a tiny file": []}
                    (root / "tiny.txt").write_text("hi\n")
                    for _ in range(ROUNDS):  # alternating, so a noisy machine moves both
                        stalls["baseline: read_file of a tiny file"].append(
                            await _stall_during(_fs_call("read_file", path="tiny.txt"))
                        )
                        for name, (tool, arguments) in attempts.items():
                            stall = await _stall_during(_fs_call(tool, **arguments))
                            stalls.setdefault(name, []).append(stall)
                    return stalls

                stalls = trio.run(rounds)
    base = max(stalls.pop("baseline: read_file of a tiny file"))
    print(f"longest Trio loop stall over {ROUNDS} rounds (pid {os.getpid()})")
    print(f"  {'baseline: read_file of a tiny file':32} {base * 1000:8.1f} ms")
    for name, samples in stalls.items():
        worst = max(samples)
        ratio = worst / base if base > 0 else float("inf")
        print(f"  {name:32} {worst * 1000:8.1f} ms  ({ratio:.1f}x the baseline)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
