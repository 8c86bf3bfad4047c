"""The disk budget between and during calls: names (``max_files``) and the watchdog.

The watchdog's decisions are checked against a pool played by the test (the
``WatchedPool`` seam: who writes, freezing, killing), on a real ``Workspace``,
under a clock the test moves; the red-team attempts in
tests/security/test_wave3_disk.py run it against real workers.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import trio
import trio.lowlevel
import trio.testing

from kernel import UsageError
from kernel.errors import SandboxError
from kernel.home import Config, TakHome, workspace_max_files
from sandbox import DEFAULT_MAX_FILES, DiskWatch, Workspace, measure_budget, open_worker_pool
from sandbox import _workspace as workspace_module
from sandbox._cgroup import FREEZE_S
from sandbox._diskwatch import FORCED_WALK_S, SUSPECT_FREEZE_S


class FakePool:
    """The pool as the watchdog sees it; records what it was asked to do."""

    def __init__(self) -> None:
        self.alive = 0
        self.changed = trio.Event()
        self.is_frozen = False
        self.kills: list[tuple[str, bool]] = []  # (reason, while frozen)
        self.waits: list[float] = []  # how long each freeze might wait

    def set_writers(self, n: int) -> None:
        self.alive = n
        self.changed.set()
        self.changed = trio.Event()

    @contextlib.asynccontextmanager
    async def frozen(self, *, wait_s: float = FREEZE_S) -> AsyncIterator[bool]:
        self.waits.append(wait_s)
        self.is_frozen = True
        try:
            yield True
        finally:
            self.is_frozen = False

    async def unlinked_open_bytes(self, device: int) -> int:
        return 0

    def writers(self, workspace: Path) -> int:
        return self.alive

    async def writers_changed(self) -> None:
        await self.changed.wait()

    async def kill_writers(self, workspace: Path, reason: str) -> None:
        self.kills.append((reason, self.is_frozen))
        self.alive = 0


def _free_space(monkeypatch: pytest.MonkeyPatch, ws: Workspace) -> list[int]:
    """The file system's free bytes and inodes, as the test says (others share /tmp)."""
    free = [10_000_000_000, 1_000_000]
    monkeypatch.setattr(ws, "free_bytes", lambda: free[0])
    monkeypatch.setattr(ws, "free_inodes", lambda: free[1])
    return free


# -- names: max_files --------------------------------------------------------------------


def test_every_name_counts_hard_links_included(workspace: Path) -> None:
    (workspace / "d" / "e").mkdir(parents=True)
    (workspace / "d" / "f").write_bytes(b"x")
    for i in range(3):
        os.link(workspace / "d" / "f", workspace / f"link{i}")
    os.symlink("d", workspace / "s")
    with Workspace(workspace, max_files=100) as ws:
        # d, d/e, d/f, link0-2, s: a hard link's blocks count once, its names each.
        assert ws.files() == 7
        assert ws.usage() < 64 * 1024


def test_new_names_past_max_files_are_refused(workspace: Path) -> None:
    with Workspace(workspace, max_bytes=1 << 30, max_files=3) as ws:
        ws.write_text("a", "1")
        ws.mkdir("b")
        ws.append("c", "3")
        for make in (
            lambda: ws.write_text("d", "4"),
            lambda: ws.mkdir("e"),
            lambda: ws.append("f", "6"),
        ):
            with pytest.raises(SandboxError, match=r"budget of 3 files \(3 in use"):
                make()
        ws.write_text("a", "replaced: no new name")
        ws.append("c", "more: no new name")
        ws.remove("a")
        ws.write_text("d", "a name was freed")
        assert sorted(os.listdir(workspace)) == ["b", "c", "d"]
        assert ws.files() == 3


def test_the_walk_stops_once_it_is_past_max_files(
    workspace: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for d in range(30):
        (workspace / f"d{d}").mkdir()
        for f in range(100):
            (workspace / f"d{d}" / f"f{f}").touch()
    scans = 0
    scan = workspace_module._scan

    def counted(fd: int, links: set[tuple[int, int]]) -> tuple[list[str], int, int]:
        nonlocal scans
        scans += 1
        return scan(fd, links)

    monkeypatch.setattr(workspace_module, "_scan", counted)
    with Workspace(workspace, max_bytes=1 << 30, max_files=150) as ws:
        ws.refresh_usage()
        # 3,030 names in 31 directories: it stopped after the third directory.
        assert 150 < ws.files() <= 330 and scans == 3
        assert ws.over_budget() == (
            f"{ws.files()} files > max_files 150 ([workspace] max_files in tak.toml)"
        )
        with pytest.raises(SandboxError, match="disk budget"):
            ws.write_text("d0/f0", "no growth while over on names")


def test_new_inodes_are_bounded_without_a_walk(
    workspace: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with Workspace(workspace, max_bytes=1 << 30, max_files=100) as ws:
        free = _free_space(monkeypatch, ws)
        walks = 0
        measure = ws._measure

        def counted() -> tuple[int, int]:
            nonlocal walks
            walks += 1
            return measure()

        monkeypatch.setattr(ws, "_measure", counted)
        ws.refresh_usage()
        free[1] -= 40  # someone made 40 files (the test only says so)
        assert ws.bounded_usage(settle=False) is not None
        assert ws.files() == 40 and walks == 1
        free[1] -= 61  # past 100: only a walk can say
        assert ws.bounded_usage(settle=False) is None
        # settle=False never forces a walk for the count of calls: the watchdog
        # walks on its own clock.
        free[1] += 61
        ws.refresh_usage()
        for _ in range(100):
            assert ws.bounded_usage(settle=False) is not None


@pytest.mark.parametrize("value", ["0", "-5", "1.5", "true", '"10"'])
def test_a_bad_max_files_is_one_clear_line(tmp_path: Path, value: str) -> None:
    home = TakHome(tmp_path).ensure()
    home.config_file.write_text(f"[workspace]\nmax_files = {value}\n")
    with pytest.raises(UsageError) as caught:
        home.load_config()
    assert str(caught.value).startswith(f"{home.config_file}: $.workspace.max_files: expected")
    with pytest.raises(UsageError) as caught:
        home.read_config()
    assert str(caught.value).startswith(f"{home.config_file}: $.workspace.max_files: expected")


def test_max_files_is_read_and_has_a_default() -> None:
    assert Config.from_toml({"workspace": {"max_files": 10}}).workspace.max_files == 10
    assert workspace_max_files({"workspace": {"max_files": 10}}) == 10
    assert workspace_max_files({}) is None  # the host then applies DEFAULT_MAX_FILES
    assert DEFAULT_MAX_FILES == 200_000


# -- the watchdog ------------------------------------------------------------------------


async def test_the_watchdog_sleeps_while_no_writer_lives(
    workspace: Path, autojump_clock: trio.testing.MockClock
) -> None:
    pool = FakePool()
    with Workspace(workspace, max_bytes=1 << 20) as ws:
        watch = DiskWatch(ws, pool)
        async with trio.open_nursery() as nursery:
            await nursery.start(watch.run)
            await trio.sleep(3600)
            assert watch.looks == 0  # not one wake-up in an hour
            pool.set_writers(1)
            await trio.sleep(1)
            assert watch.looks > 0  # counted as it starts, before its thread
            await watch.stop()
            # Stopped: the nursery has nothing left to wait for.
            assert not nursery.child_tasks


async def test_a_look_walks_only_when_the_bound_could_pass_the_budget(
    workspace: Path, monkeypatch: pytest.MonkeyPatch, mock_clock: trio.testing.MockClock
) -> None:
    pool = FakePool()
    pool.set_writers(1)
    with Workspace(workspace, max_bytes=1 << 20) as ws:
        free = _free_space(monkeypatch, ws)
        watch = DiskWatch(ws, pool)
        await watch.look()
        assert watch.walks == 1  # the first look knows nothing yet
        for _ in range(10):
            mock_clock.jump(watch.interval_s)
            free[0] -= 8192  # a little growth: the bound holds it
            await watch.look()
        assert watch.walks == 1 and pool.kills == []
        # A writer passes the budget behind the kernel's back.
        (workspace / "big").write_bytes(os.urandom(2 << 20))
        free[0] -= 2 << 20
        mock_clock.jump(watch.interval_s)
        await watch.look()
        assert watch.walks == 2
        [(reason, frozen)] = pool.kills
        assert frozen, "the writers must be killed before they thaw"
        # The walk the bound asked for gives a writer stuck in write(2) a quarter second.
        assert pool.waits == [FREEZE_S, SUSPECT_FREEZE_S]
        assert reason.startswith("killed: workspace over its budget while it ran: ")
        assert "> max_bytes 1048576" in reason


async def test_a_walk_comes_at_least_every_forced_walk_s(
    workspace: Path, monkeypatch: pytest.MonkeyPatch, mock_clock: trio.testing.MockClock
) -> None:
    """Space freed elsewhere hides growth from the bound: only a walk sees it."""
    pool = FakePool()
    pool.set_writers(1)
    with Workspace(workspace, max_bytes=1 << 20) as ws:
        _free_space(monkeypatch, ws)  # never changes: someone frees what is written
        watch = DiskWatch(ws, pool)
        await watch.look()
        (workspace / "big").write_bytes(os.urandom(2 << 20))
        mock_clock.jump(FORCED_WALK_S - 0.1)
        await watch.look()
        assert watch.walks == 1 and not pool.kills
        mock_clock.jump(0.1)
        await watch.look()
        assert watch.walks == 2 and len(pool.kills) == 1


async def test_writers_are_refused_until_files_are_removed(
    workspace: Path, mock_clock: trio.testing.MockClock
) -> None:
    pool = FakePool()
    with Workspace(workspace, max_bytes=1 << 20, max_files=100) as ws:
        watch = DiskWatch(ws, pool)
        assert await watch.admit() is None
        (workspace / "big").write_bytes(os.urandom(2 << 20))
        await measure_budget(pool, ws)
        over = await watch.admit()
        assert over is not None and "bytes > max_bytes 1048576" in over
        (workspace / "big").unlink()  # by someone else: no kept figure falls
        assert await watch.admit() is None


async def test_the_walk_runs_beside_the_trio_loop(workspace: Path) -> None:
    """A walk of a huge tree takes a while: the loop goes on meanwhile."""
    pool = FakePool()
    with Workspace(workspace, max_bytes=1 << 20) as ws:
        loop_ran = threading.Event()
        saw_the_loop: list[bool] = []
        measure = ws._measure

        def slow_measure() -> tuple[int, int]:
            saw_the_loop.append(loop_ran.wait(timeout=30))
            return measure()

        ws._measure = slow_measure  # type: ignore[method-assign]

        async def loop_task() -> None:
            for _ in range(100):
                await trio.lowlevel.checkpoint()
            loop_ran.set()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(measure_budget, pool, ws)
            nursery.start_soon(loop_task)
        assert saw_the_loop == [True]


async def test_watch_budget_is_one_task_of_the_pool_and_ends_with_its_block(
    workspace: Path,
) -> None:
    async with open_worker_pool(workspace, spare=False) as pool:
        with Workspace(pool.workspace, max_bytes=1 << 20) as ws:
            before = set(pool._nursery.child_tasks)
            async with pool.watch_budget(ws) as watch:
                [task] = set(pool._nursery.child_tasks) - before
                assert "DiskWatch.run" in task.name
                with pytest.raises(SandboxError, match="already watched"):
                    async with pool.watch_budget(ws):
                        pass
            assert set(pool._nursery.child_tasks) == before
            assert watch.looks == 0  # no worker: it never woke


async def test_a_workspace_that_cannot_be_measured_stops_its_writers(
    workspace: Path, mock_clock: trio.testing.MockClock
) -> None:
    """Fail closed: no walk, no budget; the writers go, and the look says why."""
    pool = FakePool()
    pool.set_writers(1)
    with Workspace(workspace, max_bytes=1 << 20) as ws:

        def keeps_changing() -> tuple[int, int]:
            raise SandboxError("the workspace kept changing while its disk usage was measured")

        ws._measure = keeps_changing  # type: ignore[method-assign]
        watch = DiskWatch(ws, pool)
        with pytest.raises(SandboxError, match="kept changing"):
            await watch.look()
        [(reason, _)] = pool.kills
        assert reason.startswith("killed: the workspace's usage could not be measured (")
