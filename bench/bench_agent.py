"""What a whole agent turn costs beyond its tools (issue 13), each row beside its baseline.

Every turn runs through ``Kernel.run_turn`` (``open_kernel`` on a ``MemoryStore``,
no plugins, the kernel's default ``subagents=True``) with a scripted model that
calls the no-op tool ``noop`` N times and answers once the results are back:
four entries recorded, two model requests, one batch of calls.

1. One turn with one call, next to ``run_tool_calls`` of that same call on the
   same registry: alternating rounds, the best round of each side (the one
   least disturbed by the machine's other work, as ``timeit`` does). The turn timed
   is a session's second (it reads the first turn's entries back, as every
   later turn reads the one before). Target: <= 5x.
2. 3,000 consecutive turns of one kernel, each on a new session deleted after
   its turn (so the store holds nothing from one turn to the next and the
   history does not grow): the median of turns 2,901-3,000 next to the median
   of turns 10-109, and the process's RSS after turn 100 and after turn 3,000.
   Target: within 1.1x; RSS flat.
3. 1,000 concurrent sessions, each one turn of 10 calls, as turns per second of
   wall time: the default kernel next to the same turns on a kernel with
   ``subagents=False`` (best of alternating rounds). Target: >= 600 turns/s.

Run: ``.venv/bin/python bench/bench_agent.py`` (``make bench``). Prints a table;
never fails on timing.
"""

from __future__ import annotations

import contextlib
import gc
import os
import statistics
import sys
import tempfile
import time
from collections.abc import AsyncIterator

import trio

from kernel import Kernel, ToolCall, open_kernel, run_tool_calls, tool
from kernel.models import ModelRequest, ModelResponse, ScriptedModel
from kernel.store import MemoryStore

ROUNDS = 50  # row 1: alternating rounds
PER_ROUND = 20  # row 1: operations timed together in one round
LONG_RUN = 3_000  # row 2
WINDOW = 100  # row 2: turns whose median stands for "turn 10" and "turn 3,000"
SESSIONS = 1_000  # row 3
CALLS = 10  # row 3: calls in each session's turn
LOAD_ROUNDS = 3  # row 3: alternating rounds


@tool
async def noop(note: str) -> str:
    """Answer at once.

    Args:
        note: Anything.
    """
    return note


def script(request: ModelRequest) -> ModelResponse:
    """Call ``noop`` as many times as the prompt says; answer once the results are back."""
    last = request.messages[-1]
    if last.role == "tool":
        return ScriptedModel.reply("done")
    calls = [("noop", {"note": "x"}) for _ in range(int(last.text))]
    return ScriptedModel.reply("calling", calls=calls)


@contextlib.asynccontextmanager
async def bench_kernel(*, subagents: bool = True) -> AsyncIterator[Kernel]:
    with tempfile.TemporaryDirectory() as home:
        async with open_kernel(
            home=home,
            store=MemoryStore(),
            model=ScriptedModel(script, name="scripted:bench"),
            tools=[noop],
            plugins=[],
            subagents=subagents,
        ) as k:
            yield k


def rss_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


async def one_turn(k: Kernel, prompt: str) -> None:
    """One turn of ``prompt`` on a new session, deleted afterwards (outside any timing)."""
    session = k.session()
    finished = await k.run_turn(session, prompt)
    assert finished.reason == "final", finished


async def turn_vs_calls() -> None:
    async with bench_kernel() as k:
        calls = [ToolCall("c0", "noop", {"note": "x"}, 0)]
        turns: list[float] = []
        batches: list[float] = []
        for _ in range(ROUNDS):
            start = time.perf_counter()
            for _ in range(PER_ROUND):
                await run_tool_calls(calls, k.tools)
            batches.append((time.perf_counter() - start) / PER_ROUND)
            sessions = [k.session() for _ in range(PER_ROUND)]
            for session in sessions:  # the turn timed is the steady state: the second
                await k.run_turn(session, "1")
            start = time.perf_counter()
            for session in sessions:
                await k.run_turn(session, "1")
            turns.append((time.perf_counter() - start) / PER_ROUND)
            for session in sessions:
                await k.store.delete(session.key)
                k.history.forget(session.key)
    turn, batch = min(turns), min(batches)
    ratio = turn / batch
    print(f"{'row':<44}{'baseline':>14}{'measured':>14}{'ratio':>9}  target")
    print(
        f"{'full turn, 1 call (vs run_tool_calls)':<44}{batch * 1e6:>11.1f} µs"
        f"{turn * 1e6:>11.1f} µs{ratio:>8.1f}x  <= 5x: {'met' if ratio <= 5 else 'MISSED'}"
    )


async def long_run() -> None:
    async with bench_kernel() as k:
        times: list[float] = []
        rss_at_100 = 0
        for n in range(1, LONG_RUN + 1):
            session = k.session()
            start = time.perf_counter()
            await k.run_turn(session, "1")
            times.append(time.perf_counter() - start)
            await k.store.delete(session.key)
            k.history.forget(session.key)
            if n == WINDOW:
                gc.collect()
                rss_at_100 = rss_bytes()
        gc.collect()
        rss_at_end = rss_bytes()
    early = statistics.median(times[9 : 9 + WINDOW])
    late = statistics.median(times[-WINDOW:])
    ratio = late / early
    growth = (rss_at_end - rss_at_100) / (LONG_RUN - WINDOW)
    print(
        f"{f'turn {LONG_RUN:,} (vs turn 10), median of {WINDOW}':<44}{early * 1e6:>11.1f} µs"
        f"{late * 1e6:>11.1f} µs{ratio:>8.2f}x  <= 1.1x: {'met' if ratio <= 1.1 else 'MISSED'}"
    )
    # A page is 4 KiB: under ~1 byte a turn is noise, a leak of one record a turn is not.
    print(
        f"{f'RSS after turn {LONG_RUN:,} (vs turn {WINDOW})':<44}"
        f"{rss_at_100 / 2**20:>11.1f} MB{rss_at_end / 2**20:>11.1f} MB"
        f"{growth:>+7.0f} B/turn  flat: {'met' if growth < 100 else 'MISSED'}"
    )


async def concurrent_turns(*, subagents: bool) -> float:
    """Turns per second for ``SESSIONS`` sessions running one ``CALLS``-call turn at once."""
    async with bench_kernel(subagents=subagents) as k:
        await one_turn(k, str(CALLS))  # warm: the first turn pays one-time costs
        sessions = [k.session() for _ in range(SESSIONS)]
        start = time.perf_counter()
        async with trio.open_nursery() as nursery:
            for session in sessions:
                nursery.start_soon(k.run_turn, session, str(CALLS))
        wall = time.perf_counter() - start
    return SESSIONS / wall


async def under_load() -> None:
    best = {True: 0.0, False: 0.0}
    for _ in range(LOAD_ROUNDS):
        for subagents in (False, True):
            rate = await concurrent_turns(subagents=subagents)
            best[subagents] = max(best[subagents], rate)
    on, off = best[True], best[False]
    print(
        f"{f'{SESSIONS:,} sessions x one {CALLS}-call turn':<44}{off:>9.0f} t/s{on:>10.0f} t/s"
        f"{on / off:>8.2f}x  >= 600 turns/s: {'met' if on >= 600 else 'MISSED'}"
    )
    print("  (baseline: the same turns with subagents=False)")


async def main() -> None:
    await turn_vs_calls()
    await long_run()
    await under_load()


if __name__ == "__main__":
    sys.setrecursionlimit(10_000)
    trio.run(main)
