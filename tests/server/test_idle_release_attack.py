"""The kernel's idle-session releaser attacked (``kernel.kernel.IdleSessions``).

Its rounds raced with calls being recorded and turns being held, failing, a
tiny ``after_s``, and the kernel closing while a round closes descriptors.
Real ``FileStore`` on a temporary home; counts and the mock clock, never
elapsed time.
"""

from __future__ import annotations

import contextlib
import logging
import os
import random
import threading
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing

from kernel import Kernel, ToolCall, open_kernel, tool
from kernel.kernel import IdleSessions
from kernel.models import ScriptedModel
from kernel.models._scripted import demo_script
from kernel.store import FileStore, SessionKey
from plugins.demo import plugin as demo_plugin


@tool
async def nap(turns: int) -> str:
    """Yield ``turns`` times, so that releases land in the middle of the call."""
    for _ in range(turns):
        await trio.lowlevel.checkpoint()
    return f"napped {turns}"


@contextlib.asynccontextmanager
async def idle_kernel(home: Path, idle: IdleSessions) -> AsyncIterator[Kernel]:
    async with open_kernel(
        home=home,
        model=ScriptedModel(demo_script, name="scripted:demo"),
        tools=[*demo_plugin.tools, nap],
        plugins=[],
        idle_sessions=idle,
    ) as k:
        assert isinstance(k.store, FileStore)
        yield k


def open_fds() -> set[int]:
    return {int(n) for n in os.listdir("/proc/self/fd")}


async def test_a_tiny_after_s_does_not_spin_the_releaser(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    """after_s=1e-9 made the releaser's period smaller than the clock's resolution:
    it never slept again (a core at 100 %, and an autojump clock that never moved)."""
    async with idle_kernel(tmp_path / "home", IdleSessions(keep=4, after_s=1e-9)) as k:
        real = k.release_idle_sessions
        rounds = 0
        spun = trio.Event()

        async def counting() -> None:
            nonlocal rounds
            rounds += 1
            if rounds > 1000:
                spun.set()
            await real()

        k.release_idle_sessions = counting  # type: ignore[method-assign]
        with trio.move_on_after(10):
            await spun.wait()
        assert rounds <= 10 * 10 + 2, f"{rounds} release rounds in 10 s"
        await k.run_turn(k.session("s"), "still alive")


async def test_a_failing_release_round_does_not_end_the_kernel(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    async with idle_kernel(tmp_path / "home", IdleSessions(keep=0, after_s=3600)) as k:
        assert isinstance(k.store, FileStore)
        store = k.store
        real = store.close_idle
        failed = trio.Event()

        async def failing(**kwargs: Any) -> int:
            failed.set()
            raise OSError(28, "No space left on device")

        store.close_idle = failing  # type: ignore[method-assign]
        with caplog.at_level(logging.ERROR, logger="tak"):
            await k.run_turn(k.session("a"), "hello")
            with trio.fail_after(30):
                await failed.wait()
            await trio.testing.wait_all_tasks_blocked()
        store.close_idle = real  # type: ignore[method-assign]
        await k.run_turn(k.session("b"), "hello again")  # the kernel still works
        await k.release_idle_sessions()
        assert store.open_files == 0
    assert any("releasing idle sessions failed" in r.message for r in caplog.records)


@pytest.mark.parametrize("seed", range(3))
async def test_releases_racing_calls_and_turns_lose_nothing(tmp_path: Path, seed: int) -> None:
    """keep=0 and a short after_s: every call's end and every 0.1 s a round closes
    what is idle, while other calls are being recorded and turns held."""
    home = tmp_path / "home"
    calls: dict[str, int] = {}
    turns: dict[str, int] = {}
    async with idle_kernel(home, IdleSessions(keep=0, after_s=0.05)) as k:

        async def client(c: int) -> None:
            r = random.Random(seed * 10 + c)
            for n in range(12):
                sid = f"s{r.randrange(4)}"
                session = k.session(sid)
                if r.random() < 0.7:
                    batch = [
                        ToolCall(f"c{c}-{n}-{j}", "nap", {"turns": r.randint(0, 20)}, index=j)
                        for j in range(r.randint(1, 3))
                    ]
                    obs = await k.call_tools(session, batch)
                    assert [o.content for o in obs] == [
                        f"napped {b.arguments['turns']}"  # type: ignore[index]
                        for b in batch
                    ]
                    calls[sid] = calls.get(sid, 0) + len(batch)
                else:
                    await k.run_turn(session, f'/call add {{"a": {n}, "b": {c}}}')
                    turns[sid] = turns.get(sid, 0) + 1
                for _ in range(r.randint(0, 5)):
                    await trio.lowlevel.checkpoint()

        async with trio.open_nursery() as nursery:
            for c in range(5):
                nursery.start_soon(client, c)
        await k.release_idle_sessions()
        for sid in calls.keys() | turns.keys():
            entries = await k.store.load(SessionKey("default", sid)) or []
            uuids = [e["uuid"] for e in entries]
            assert len(uuids) == len(set(uuids)), sid
            results = [
                part
                for m in await k.session(sid).messages()
                for part in m.parts
                if type(part).__name__ == "Observation"
            ]
            assert len(results) == calls.get(sid, 0) + turns.get(sid, 0), sid


async def test_the_kernel_closing_while_a_round_closes_descriptors(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The kernel exits while its releaser is in the worker thread closing
    transcripts: the exit waits for it, nothing raises, every descriptor is
    closed and the summaries read back right."""
    home = tmp_path / "home"
    before = open_fds()
    in_thread = threading.Event()
    go_on = threading.Event()
    real = FileStore._close_all_sync

    def slow(self: FileStore, handles: list[Any]) -> None:
        if not in_thread.is_set():
            in_thread.set()
            go_on.wait(30)
        real(self, handles)

    monkeypatch.setattr(FileStore, "_close_all_sync", slow)
    async with idle_kernel(home, IdleSessions(keep=0, after_s=3600)) as k:
        for i in range(4):
            await k.call_tools(k.session(f"s{i}"), [ToolCall("c", "add", {"a": i, "b": 1})])
        # The kernel's own releaser, woken by the first call's end, is in the thread.
        await trio.to_thread.run_sync(in_thread.wait, 30)
        threading.Timer(0.05, go_on.set).start()  # lets it go once the kernel is exiting
    go_on.set()
    assert open_fds() <= before
    async with FileStore(home / "data" / "sessions") as store:
        summaries = await store.list_session_summaries("default")
        assert len(summaries) == 4
        for s in summaries:
            assert s.data is not None and s.problem is None
            assert sum(s.data.type_counts.values()) == len(
                await store.load(SessionKey("default", s.session_id)) or []
            )


async def test_busy_sessions_do_not_count_against_keep_in_the_history_cache() -> None:
    """keep is the idle sessions kept: two busy ones, the most recent, made
    release_idle(keep=2) drop every idle one."""
    from kernel.history import HistoryCache
    from kernel.store import MemoryStore

    store = MemoryStore()
    cache = HistoryCache()
    keys = [SessionKey("p", f"s{i}") for i in range(5)]
    for k in keys:
        await store.append(
            k, [{"type": "user", "uuid": k.session_id, "message": {"role": "user", "parts": []}}]
        )
        await cache.history(store, k)
    assert cache.release_idle(keep=2, busy={keys[3].name, keys[4].name}) == 1
    assert list(cache._sessions) == [k.name for k in keys[1:]]
