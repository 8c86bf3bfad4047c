"""Agent turn overhead as a session's history grows, and reading a long session back.

1. Per-turn overhead: one scripted agent turn (the model calls one trivial tool,
   then answers) on a ``FileStore`` session holding 10 earlier turns, beside the
   same turn on a session holding 10,000 earlier turns (40,000 entries, filled
   by appending entries directly). Each column is the median of a few turns on
   one ``Session``; the first turn on it (which may have to read the whole
   transcript) is printed apart. Target: the long session within 2x of the
   short one.
2. ``tak sessions show`` of a 40,000-entry session, done the way the command
   does it: stream the entries from the store and format each (printing to a
   buffer). ``load`` alone beside it. Target: under 1 s.

Run: ``.venv/bin/python bench/bench_turns.py`` (``make bench``). Prints a
table; never fails on timing.
"""

from __future__ import annotations

import io
import statistics
import sys
import tempfile
import time
import uuid
from typing import Any

import trio

from kernel.agent import Agent
from kernel.messages import Message, Observation, Text, ToolCall
from kernel.models import ModelRequest, ModelResponse, ScriptedModel
from kernel.session import Session, message_entry
from kernel.store import FileStore, SessionKey
from kernel.tools import tool

SHORT_TURNS = 10
LONG_TURNS = 10_000
TIMED_TURNS = 7
FILL_BATCH = 400  # entries per direct append while filling


@tool
async def noop(note: str) -> str:
    """Answer at once.

    Args:
        note: Anything.
    """
    return f"ok {note}"


def answer(request: ModelRequest) -> ModelResponse:
    """Call ``noop`` once after a prompt; answer in words once its result is back."""
    last = request.messages[-1]
    if last.role == "tool":
        return ScriptedModel.reply("done")
    return ScriptedModel.reply(
        "calling", calls=[ToolCall(f"c{uuid.uuid4().hex[:8]}", "noop", {"note": "x"})]
    )


def turn_entries(i: int) -> list[dict[str, Any]]:
    """The four entries a recorded turn leaves: prompt, calls, results, answer."""
    ts = "2025-01-01T00:00:00.000Z"
    call = ToolCall(f"fill{i}", "noop", {"note": f"turn {i}"})
    user = message_entry(Message("user", [Text(f"prompt number {i} " * 4)]), timestamp=ts)
    calls = message_entry(Message("assistant", [Text("calling"), call]), timestamp=ts, model="fill")
    results = message_entry(
        Message("tool", [Observation(call_id=call.id, name="noop", content=f"ok {i}", index=0)]),
        timestamp=ts,
        answers=calls["uuid"],
    )
    final = message_entry(Message("assistant", [Text(f"answer {i}")]), timestamp=ts, model="fill")
    return [user, calls, results, final]


async def fill(store: FileStore, key: SessionKey, turns: int) -> None:
    batch: list[dict[str, Any]] = []
    for i in range(turns):
        batch += turn_entries(i)
        if len(batch) >= FILL_BATCH:
            await store.append(key, batch)
            batch = []
    if batch:
        await store.append(key, batch)


async def time_turns(store: FileStore, key: SessionKey) -> tuple[float, float]:
    """(first turn, median of the next ones) in seconds, on one ``Session``."""
    agent = Agent(ScriptedModel(answer, name="scripted:bench"), [noop])
    session = Session(store, key)
    times = []
    for _ in range(TIMED_TURNS + 1):
        start = time.perf_counter()
        finished = await agent.run_turn(session, "go")
        times.append(time.perf_counter() - start)
        assert finished.reason == "final", finished
    return times[0], statistics.median(times[1:])


async def show_like_cli(store: FileStore, key: SessionKey) -> tuple[float, float, int]:
    """(load seconds, stream+format seconds, entries) for ``tak sessions show``."""
    from kernel.cli.sessions import format_entry

    start = time.perf_counter()
    loaded = await store.load(key)
    load_s = time.perf_counter() - start
    out = io.StringIO()
    start = time.perf_counter()
    count = 0
    async for entry in store.iter_entries(key):
        print(format_entry(entry), file=out)
        count += 1
    show_s = time.perf_counter() - start
    assert loaded is not None and count == len(loaded)
    return load_s, show_s, count


async def main() -> None:
    with tempfile.TemporaryDirectory() as root:
        async with FileStore(root) as store:
            short, long = SessionKey("bench", "short"), SessionKey("bench", "long")
            await fill(store, short, SHORT_TURNS)
            start = time.perf_counter()
            await fill(store, long, LONG_TURNS)
            fill_s = time.perf_counter() - start
            short_first, short_median = await time_turns(store, short)
            long_first, long_median = await time_turns(store, long)
            load_s, show_s, count = await show_like_cli(store, long)

    print(f"(filled {LONG_TURNS * 4:,} entries in {fill_s:.1f} s)")
    print(
        f"{'per-turn overhead':<34}{'turn ' + str(SHORT_TURNS):>14}{'turn ' + str(LONG_TURNS):>14}{'ratio':>9}"
    )
    print(
        f"{'  first turn on a Session':<34}{short_first * 1e3:>11.1f} ms{long_first * 1e3:>11.1f} ms"
        f"{long_first / short_first:>8.1f}x"
    )
    print(
        f"{'  next turns (median of ' + str(TIMED_TURNS) + ')':<34}{short_median * 1e3:>11.1f} ms"
        f"{long_median * 1e3:>11.1f} ms{long_median / short_median:>8.1f}x (target <= 2x)"
    )
    print(
        f"{'sessions show, ' + format(count, ',') + ' entries':<34}{show_s:>12.2f} s   (target < 1 s)"
    )
    print(f"{'  store.load alone':<34}{load_s:>12.2f} s")


if __name__ == "__main__":
    sys.setrecursionlimit(10_000)
    trio.run(main)
