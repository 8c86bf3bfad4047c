"""The disk watchdog: a workspace's budget holds while its workers live, not only between calls.

The plugin host settles a workspace's usage after each call of a worker that may
write it. A program that worker left running (a plugin with ``subprocess``) writes
on after the call returned, and nothing looked until the next call: the workspace
grew to many times its budget. A ``DiskWatch`` (one per workspace, a task of the
pool's nursery: ``WorkerPool.watch_budget``) looks while any process that may write
the workspace lives, whether a call is under way or not:

1. every ``interval_s`` (``INTERVAL_S``) it bounds the usage from the file system's
   free space and free inodes (``Workspace.bounded_usage``: two ``fstatvfs``, in a
   thread): whatever the workspace gained since the last look, the file system
   lost at least as much;
2. when that bound could pass ``max_bytes`` or ``max_files``, and in any case once
   every ``max(FORCED_WALK_S, 20 walks)`` (space freed elsewhere on the same file
   system, or a hard link, which takes a name but no inode, can hide growth from
   the bound), it walks the tree with every worker frozen (``measure_budget``: the cgroup
   freezer) and adds what the workers keep open after unlinking; walks the bound
   asks for come at most once per four walk times, so a workspace kept near its
   budget by others' writes costs its workers at most a fifth of their time (unless
   the bound is more than a quarter past the budget: then at once, since the walk's
   time is the workers' to lengthen), and
   kill a worker that does not stop within ``SUSPECT_FREEZE_S`` (a task stops only
   between system calls: one long ``write`` after another would keep the walk
   waiting while the disk fills);
3. a walk that finds the workspace over its budget kills, before they thaw, every
   worker that may write it and everything in its cgroups: nothing they started
   runs again once the walk has seen the workspace over. A call of a plugin that
   writes there is then refused before it starts (``admit``) until files are
   removed: no worker can add a little more with each restart.

What can still pass the budget: what the workers write between two looks, that is
their write rate times ``interval_s`` plus a freeze and a walk (``fallocate``,
which allocates a gigabyte in a millisecond, is refused by ``sandbox.seccomp``;
written blocks come at the page cache's pace). docs/security.md gives the figures.
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Awaitable, Callable
from contextlib import AbstractAsyncContextManager
from pathlib import Path
from typing import Final, Protocol

import trio

from kernel.errors import KernelError

from ._workspace import Workspace

logger = logging.getLogger("sandbox.pool")

#: How often a watched workspace's usage is bounded while a writer lives.
INTERVAL_S: Final = 0.05
#: The longest the watchdog goes without a walk while a writer lives.
FORCED_WALK_S: Final = 5.0
#: How long a walk the bound asked for waits for the workers to stop before it kills
#: the ones that did not (a routine walk waits ``_cgroup.FREEZE_S``).
SUSPECT_FREEZE_S: Final = 0.25
#: A forced walk comes after at least this many walks' time, a bound-asked one four.
_FORCED_FACTOR: Final = 20
_ASKED_FACTOR: Final = 4
#: How far past the budget the bound may go while a bound-asked walk waits its turn.
_SPACED_SLACK: Final = 0.25


class Freezer(Protocol):
    """What ``measure_budget`` needs of a pool: stop every worker, see what they hold unlinked."""

    def frozen(self) -> AbstractAsyncContextManager[bool]: ...

    async def unlinked_open_bytes(self, device: int) -> int: ...


class WatchedPool(Freezer, Protocol):
    """What a ``DiskWatch`` needs of the pool that owns it."""

    def frozen(self, *, wait_s: float = ...) -> AbstractAsyncContextManager[bool]:
        """``Freezer.frozen``; a worker that does not stop within ``wait_s`` is killed."""
        ...

    def writers(self, workspace: Path) -> int:
        """How many processes that may write ``workspace`` are alive (or not yet reaped)."""
        ...

    async def writers_changed(self) -> None:
        """Return once a worker was bound to a plugin, or a worker process ended."""
        ...

    async def kill_writers(self, workspace: Path, reason: str) -> None:
        """Kill every worker that may write ``workspace``, everything in its cgroups too."""
        ...


async def measure_budget(
    pool: Freezer,
    workspace: Workspace,
    *,
    while_frozen: Callable[[str], Awaitable[None]] | None = None,
    frozen: AbstractAsyncContextManager[bool] | None = None,
) -> str | None:
    """Walk ``workspace`` with every worker of ``pool`` stopped; what is over its budget.

    Returns ``workspace.over_budget()`` after the walk, plus what the workers keep open
    after unlinking it (in no directory, so no walk sees it). When it is over,
    ``while_frozen(over)`` runs before the workers thaw. ``frozen`` replaces
    ``pool.frozen()`` (the watchdog's, with a shorter wait).

    Raises:
        KernelError: it could not be measured (the tree kept changing, or a worker
            could neither be stopped nor killed).
    """
    async with pool.frozen() if frozen is None else frozen:
        await trio.to_thread.run_sync(workspace.refresh_usage)
        device = os.fstat(workspace.fileno()).st_dev
        # Only what this workspace's workers hold (a pool that tells them apart):
        # another workspace's workers keep their own files, on the same device too.
        of_workspace = getattr(pool, "unlinked_open_bytes_in", None)
        if of_workspace is not None:
            hidden = await of_workspace(workspace.path, device)
        else:
            hidden = await pool.unlinked_open_bytes(device)
        if hidden:
            workspace.add_usage(hidden)
        over = workspace.over_budget()
        if over is not None and while_frozen is not None:
            await while_frozen(over)
    return over


class DiskWatch:
    """Keeps one workspace within its budget while processes that may write it live.

    Made and run by ``WorkerPool.watch_budget``. ``looks``, ``walks`` and ``kills``
    count what it did (tests and benches read them).
    """

    def __init__(
        self, workspace: Workspace, pool: WatchedPool, *, interval_s: float = INTERVAL_S
    ) -> None:
        self.workspace = workspace
        self.interval_s = interval_s
        self.looks = 0
        self.walks = 0
        self.kills = 0
        self._pool = pool
        self._scope = trio.CancelScope()
        self._stopped = trio.Event()
        self._last_walk = -float("inf")
        self._walk_s = 0.0
        # The looks' own thread: a busy default limiter must not delay them.
        self._limiter = trio.CapacityLimiter(1)

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Look until ``stop``; idle (no wake-up at all) while no writer lives."""
        try:
            with self._scope:
                task_status.started()
                while True:
                    while not self._pool.writers(self.workspace.path):
                        await self._pool.writers_changed()
                    await trio.sleep(self.interval_s)
                    try:
                        await self.look()
                    except (KernelError, OSError) as exc:  # its writers were killed
                        logger.warning(
                            "the disk budget of %s could not be checked: %s", self.workspace, exc
                        )
        finally:
            self._stopped.set()

    async def stop(self) -> None:
        """Stop looking and wait until the task has ended; finishes even when cancelled."""
        self._scope.cancel()
        with trio.CancelScope(shield=True):
            await self._stopped.wait()

    async def look(self) -> None:
        """One look: the bound, and a walk when it is needed (see the module's list)."""
        self.looks += 1
        ws = self.workspace
        bound = await trio.to_thread.run_sync(
            functools.partial(ws.bounded_usage, settle=False), limiter=self._limiter
        )
        since = trio.current_time() - self._last_walk
        forced = since >= max(FORCED_WALK_S, _FORCED_FACTOR * self._walk_s)
        if not forced and bound is not None:
            return
        if not forced and since < _ASKED_FACTOR * self._walk_s:
            # Spaced out so that others' writes on the file system cost the workers at
            # most a fifth of their time; but the walk's time is the workers' to make
            # (a big tree, a freeze they delay): past a quarter over, walk now.
            far = functools.partial(ws.far_over, _SPACED_SLACK)
            if not await trio.to_thread.run_sync(far, limiter=self._limiter):
                return
        # The bound says the workspace may be over: a writer that keeps the freezer
        # waiting (one long write(2) after another) is killed after SUSPECT_FREEZE_S,
        # not the 2 s a routine walk grants a legitimate big write.
        suspect = bound is None and self.walks > 0  # not merely the first look
        await self._walk(SUSPECT_FREEZE_S if suspect else None)

    async def admit(self) -> str | None:
        """``None`` when a writing worker may run now, else what is over the budget.

        A workspace whose kept figures are within its budget is admitted at once (no
        system call: the warm path of every call). One that is over is measured
        again first: files removed by someone else lower no kept figure.

        Raises:
            KernelError: it is over and could not be measured again.
        """
        if self.workspace.over_budget() is None:
            return None
        return await self._walk()

    async def _walk(self, wait_s: float | None = None) -> str | None:
        started = trio.current_time()
        self.walks += 1
        frozen = None if wait_s is None else self._pool.frozen(wait_s=wait_s)
        try:
            return await measure_budget(
                self._pool, self.workspace, while_frozen=self._kill, frozen=frozen
            )
        except KernelError as exc:
            # Fail closed: a workspace that cannot be measured cannot be held to a budget.
            await self._kill_writers(f"killed: the workspace's usage could not be measured ({exc})")
            raise
        finally:
            self._last_walk = trio.current_time()
            self._walk_s = self._last_walk - started

    async def _kill(self, over: str) -> None:
        await self._kill_writers(f"killed: workspace over its budget while it ran: {over}")

    async def _kill_writers(self, reason: str) -> None:
        if self._pool.writers(self.workspace.path):
            self.kills += 1
            await self._pool.kill_writers(self.workspace.path, reason)
