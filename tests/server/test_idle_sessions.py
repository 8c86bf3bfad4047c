"""Idle sessions give back their descriptors and cached history (``kernel.kernel.IdleSessions``).

What a kernel keeps of a session between uses — the ``FileStore``'s open
transcript (with its directory and lock file) and the ``HistoryCache``'s fold —
is released when more than ``keep`` idle sessions hold theirs, and when one
has not been used for ``after_s``; a session in use is kept; a released one
reads back whole. Counts and a mock clock, never elapsed time.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest
import trio
import trio.testing

from kernel import Kernel, ToolCall, UsageError, open_kernel, tool
from kernel.kernel import IdleSessions
from kernel.models import ScriptedModel
from kernel.models._scripted import demo_script
from kernel.store import FileStore
from plugins.demo import plugin as demo_plugin

gate = trio.Event()


@tool
async def wait_for_gate() -> str:
    """Wait until the test opens the gate."""
    await gate.wait()
    return "through"


@contextlib.asynccontextmanager
async def idle_kernel(home: Path, idle: IdleSessions) -> AsyncIterator[Kernel]:
    async with open_kernel(
        home=home,
        model=ScriptedModel(demo_script, name="scripted:demo"),
        tools=[*demo_plugin.tools, wait_for_gate],
        plugins=[],
        idle_sessions=idle,
    ) as k:
        assert isinstance(k.store, FileStore)
        yield k


def kept(k: Kernel) -> tuple[int, int]:
    """(open transcripts, cached histories)."""
    assert isinstance(k.store, FileStore)
    return k.store.open_files, len(k.history)


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


async def until(condition: Callable[[], bool]) -> None:
    """Wait for ``condition``: the kernel's releaser closes descriptors in a worker
    thread, which no Trio clock can wait for. A condition, not a duration: the
    deadline only turns "never" into a failure."""
    with trio.fail_after(60):
        while not condition():  # noqa: ASYNC110 (a worker thread sets no Event)
            await trio.sleep(0.005)


async def test_idle_sessions_beyond_keep_are_released(tmp_path: Path) -> None:
    async with idle_kernel(tmp_path / "home", IdleSessions(keep=2, after_s=3600)) as k:
        for i in range(12):
            await k.run_turn(k.session(f"s{i}"), f'/call add {{"a": {i}, "b": 1}}')
        await until(lambda: kept(k) <= (2, 2))  # by the kernel itself, after the turns
        await k.release_idle_sessions()  # and once more, to see which it kept
        assert kept(k) == (2, 2)
        assert list(k.history._sessions) == ["default/s10", "default/s11"]
        assert isinstance(k.store, FileStore)
        assert list(k.store._open) == ["default/s10", "default/s11"]


@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="needs /proc")
async def test_fds_do_not_grow_with_the_sessions_served(tmp_path: Path) -> None:
    """Without a bound they grew by 3 a session (transcript, directory, lock file)."""
    async with idle_kernel(tmp_path / "home", IdleSessions(keep=4, after_s=3600)) as k:
        for i in range(40):
            await k.call_tools(k.session(f"s{i}"), [ToolCall("c", "add", {"a": i, "b": 1})])
            if i == 9:
                await k.release_idle_sessions()
                after_ten = open_fds()
        await until(lambda: open_fds() <= after_ten)


async def test_a_session_unused_for_after_s_is_released(
    tmp_path: Path, mock_clock: trio.testing.MockClock
) -> None:
    async with idle_kernel(tmp_path / "home", IdleSessions(keep=10, after_s=100)) as k:
        for i in range(3):
            await k.run_turn(k.session(f"s{i}"), "hello")
        await k.release_idle_sessions()
        assert kept(k) == (3, 3)
        mock_clock.jump(60)
        await k.release_idle_sessions()
        assert kept(k) == (3, 3)
        await k.run_turn(k.session("s2"), "again")  # s2 is used again at 60
        mock_clock.jump(50)  # 110: s0 and s1 idle for 110 s, s2 for 50
        await k.release_idle_sessions()
        assert kept(k) == (1, 1)
        assert list(k.history._sessions) == ["default/s2"]
        mock_clock.jump(60)  # 170: s2 idle for 110 s
        await k.release_idle_sessions()
        assert kept(k) == (0, 0)


async def test_the_kernel_releases_idle_sessions_by_itself(tmp_path: Path) -> None:
    async with idle_kernel(tmp_path / "home", IdleSessions(keep=10, after_s=0.05)) as k:
        for i in range(3):
            await k.run_turn(k.session(f"s{i}"), "hello")
        await until(lambda: kept(k) == (0, 0))


async def test_a_session_in_use_is_kept_and_a_released_one_reads_back_whole(
    tmp_path: Path,
) -> None:
    global gate
    gate = trio.Event()
    async with idle_kernel(tmp_path / "home", IdleSessions(keep=0, after_s=3600)) as k:
        busy = k.session("busy")
        await k.run_turn(busy, "first")
        async with trio.open_nursery() as nursery:
            nursery.start_soon(
                k.call_tools, busy, [ToolCall("w", "wait_for_gate", {})], name="waits"
            )
            await trio.testing.wait_all_tasks_blocked()  # its call runs, no append in flight
            for i in range(3):
                await k.run_turn(k.session(f"s{i}"), "hello")
            await k.release_idle_sessions()
            assert isinstance(k.store, FileStore)
            assert [h.key.session_id for h in k.store._open.values()] == ["busy"]
            gate.set()
        await until(lambda: kept(k) == (0, 0))
        await k.run_turn(busy, "third")
        texts = [m.text for m in await busy.messages()]
        assert texts[0] == "first" and texts[-2] == "third", texts
        assert any("through" in str(m) for m in await busy.messages())
        summaries = await k.store.list_session_summaries("default")
        assert {s.session_id for s in summaries} == {"busy", "s0", "s1", "s2"}


@pytest.mark.parametrize(
    ("keep", "after_s"),
    [(-1, 1.0), (True, 1.0), (1.5, 1.0), (1, 0), (1, -2.0), (1, float("inf")), (1, False)],
)
def test_bad_settings_are_refused(keep: object, after_s: object) -> None:
    with pytest.raises(UsageError, match="IdleSessions"):
        IdleSessions(keep=keep, after_s=after_s)  # type: ignore[arg-type]
