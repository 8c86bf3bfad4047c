"""The disk budget settled after each call: what a call left counts, however it is held,
and the walk sees a workspace that no worker changes meanwhile.

A settle walks the workspace when the file system changed since the last walk and
that walk took at most ``CHEAP_WALK_S`` of CPU; a dearer walk is spaced out (once in
walk_cpu / 2 ms settles, at most 32), and free space exactly equal to the last walk's
means no walk. The walk runs with every worker frozen (``WorkerPool.frozen``), and a
file a worker keeps open after unlinking it is counted
(``_cgroup.unlinked_open_bytes``). The two strict xfails are holes still open,
documented in docs/security.md: in a workspace whose walk is dear (20,000 names), hard
links and space freed elsewhere hide growth until the next walk (at most 32 calls, or
the watchdog's forced walk within 5 s).
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import trio
from kit import Arena

from kernel.errors import SandboxError
from kernel.executor import run_tool_calls
from kernel.home import TakHome
from kernel.messages import ToolCall
from kernel.plugin import Permissions, use_context
from kernel.tools import ToolFailure
from plugins import open_plugin_host
from plugins._host import PluginHost
from sandbox import Workspace
from sandbox._workspace import CHEAP_WALK_S

#: Empty files that make a walk dear (about 45 ms of CPU here: every settle but one
#: in ~20 skips the walk); ~450 kB of directory blocks on ext4.
_DEAR = 20_000


def _home(arena: Arena) -> TakHome:
    return TakHome(arena.root / "home").ensure()


def _make_dear(workspace: Path) -> None:
    """What an earlier call (or session) of the plugin left: many empty files."""
    d = workspace / "dear"
    d.mkdir()
    for i in range(_DEAR):
        os.close(os.open(d / str(i), os.O_CREAT | os.O_WRONLY, 0o600))


def _names(top: Path) -> int:
    return sum(len(dirs) + len(files) for _, dirs, files in os.walk(top))


@contextlib.asynccontextmanager
async def _dear_host(arena: Arena, config: dict[str, Any]) -> AsyncIterator[Any]:
    """A python-plugin host on a workspace made dear to walk, after one warm call,
    inside its tool context."""

    _make_dear(arena.workspace)
    async with open_plugin_host(
        arena.workspace, plugins=["python"], config=config, home=_home(arena)
    ) as host:
        with use_context(host.context()):
            first = await _call(host, 0, "print('warm')")
            assert not first.is_error, first.content
            yield host


async def _call(host, n: int, code: str):  # type: ignore[no-untyped-def]

    [obs] = await run_tool_calls([ToolCall(str(n), "run_python", {"code": code})], host.tools)
    return obs


_LINKS = r"""
import os
os.makedirs('l', exist_ok=True)
open('l/target', 'w').close()
for i in range(30000):
    os.link('l/target', f'l/{i}')
print('linked')
"""


@pytest.mark.xfail(
    strict=True,
    reason="a dear walk (many empty files) spaces the settle's walks out, and hard links "
    "take names but no inode: the free-inode bound never sees them, so a call that takes "
    "the workspace past max_files passes (until the watchdog's forced walk, <= 5 s later)",
)
async def test_hard_links_past_max_files_in_a_dear_workspace_fail_the_call(
    arena: Arena, confined: None
) -> None:
    config = {"workspace": {"max_bytes": 50_000_000, "max_files": 40_000}}
    async with _dear_host(arena, config) as host:
        if True:  # the block the call runs in (as in the co-tenant test)
            ws = host.workspace
            assert ws._walk_s > 2 * CHEAP_WALK_S  # the walk is dear: settles skip it
            watch = host.pool._watches[ws.path]
            walks = watch.walks
            linked = await _call(host, 1, _LINKS)
            watchdog_walked = watch.walks != walks
    assert _names(arena.workspace) > 40_000  # the links were made: 50,000+ names
    if watchdog_walked and linked.is_error:
        pytest.xfail("inconclusive: the watchdog's forced walk fell inside the call")
    assert linked.is_error and "max_files" in linked.content, linked.content


#: 9 MB in 100 kB writes over ~0.2 s: a few MB between two looks of the watchdog.
_TRICKLE = r"""
import time
with open('big', 'wb') as f:
    for _ in range(90):
        f.write(b'x' * 100_000)
        f.flush()
        time.sleep(0.004)
print('wrote')
"""


_SHRINK = r"""
import os, sys
path, size, step = sys.argv[1], int(sys.argv[2]), 2 << 20
fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o600)
os.posix_fallocate(fd, 0, size)
print('ready', flush=True)
while not os.path.exists(path + '.stop') and size > 0:
    size = max(0, size - step)
    os.ftruncate(fd, size)
print('exhausted' if size == 0 else 'stopped', flush=True)
"""


class _CoTenant:
    """Another tenant of the same file system removing its files (a loaded machine, or a
    hostile neighbour): a process shrinking a fallocated file 2 MiB at a time, as fast
    as it goes."""

    def __init__(self, path: Path, size: int) -> None:
        self.path = path
        self.size = size
        self.exhausted = False

    def __enter__(self) -> _CoTenant:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _SHRINK, str(self.path), str(self.size)],
            stdout=subprocess.PIPE, text=True,
        )  # fmt: skip
        assert self.proc.stdout is not None
        assert self.proc.stdout.readline().strip() == "ready"
        return self

    def __exit__(self, *exc: object) -> None:
        Path(f"{self.path}.stop").touch()
        out, _ = self.proc.communicate(timeout=30)
        self.exhausted = out.strip() != "stopped"
        self.path.unlink(missing_ok=True)


@pytest.mark.xfail(
    strict=True,
    reason="a dear walk spaces the settle's walks out, so the call relies on the "
    "free-space bound alone, which space freed elsewhere on the file system masks: the "
    "loaded-machine hole 2c4479f closed is open again at the plugin's choice",
)
async def test_a_write_past_the_budget_while_a_co_tenant_frees_space_fails_the_call(
    arena: Arena, confined: None
) -> None:
    if os.stat(arena.root).st_dev != os.stat(arena.workspace).st_dev:
        pytest.skip("the co-tenant must share the workspace's file system")
    budget = 4_000_000
    config = {"workspace": {"max_bytes": budget}}
    async with _dear_host(arena, config) as host:
        if True:  # the block the call runs in (as in the hard-link test)
            ws = host.workspace
            assert ws.usage() < budget * 3 // 4 and ws._walk_s > 2 * CHEAP_WALK_S
            watch = host.pool._watches[ws.path]
            walks = watch.walks
            other = _CoTenant(arena.root / "co-tenant", 1 << 30)
            with other:
                wrote = await _call(host, 1, _TRICKLE)
            watchdog_walked = watch.walks != walks
    complete = (arena.workspace / "big").stat().st_blocks * 512 >= 9_000_000  # > 2x budget
    if other.exhausted or (wrote.is_error and (watchdog_walked or not complete)):
        # The co-tenant could not keep up on this machine (its freeing stalled between
        # two looks, and the watchdog or the settle stopped the writer midway).
        pytest.xfail("inconclusive: the mask did not hold for the whole write")
    assert wrote.is_error and "workspace over its budget" in wrote.content, wrote.content


def test_space_the_workspace_freed_itself_is_not_credited_twice(tmp_path: Path) -> None:
    """Space the Workspace frees itself (fs write_file shrinking a file) lowers the kept
    figure and raises free space: the free-space baseline moves with it (``_adjust``),
    or a worker that then writes as many blocks would leave free space equal to the
    last walk's, no walk would come, and the next fs write would pass the budget."""
    size = 1 << 20
    with Workspace(tmp_path, max_bytes=size + 200_000) as ws:
        ws.write_bytes("big", b"x" * size)
        (tmp_path / "w").touch()  # the worker's file, already there: no new inode
        ws.refresh_usage()
        ws.write_bytes("big", b"")  # fs write_file: frees 1 MiB, in-process
        with open(tmp_path / "w", "r+b") as f:  # the worker: 1 MiB, not through ws
            f.write(b"y" * size)
            f.flush()
            os.fsync(f.fileno())
        ws.settle_usage()  # the host's settle after the worker's call
        with pytest.raises(SandboxError, match="past its disk budget"):
            ws.write_bytes("more", b"z" * size)  # fs write_file again: over, refused
    assert Workspace(tmp_path).refresh_usage() <= size + 200_000


# -- the check around a worker's call, on a pool without workers ------------------------
#
# A directory moved back and forth while the tree is walked: a program doing it can only
# be a worker's (or a program a worker left running), and the host walks with every
# worker frozen: tests/security/test_overlap.py::
# test_a_directory_a_worker_keeps_moving_cannot_hide_from_the_budget.


class _NoWorkers:
    """A pool with no worker running: freezing them all is nothing to do."""

    @contextlib.asynccontextmanager
    async def frozen(self) -> AsyncIterator[bool]:
        yield True

    async def unlinked_open_bytes(self, device: int) -> int:
        return 0


async def test_budget_check_fails_closed_when_the_workspace_cannot_be_measured(
    arena: Arena, monkeypatch: pytest.MonkeyPatch
) -> None:
    (arena.workspace / "big").write_bytes(os.urandom(1 << 20))

    def keeps_changing(self: Workspace) -> int:
        raise SandboxError("the workspace kept changing while its disk usage was measured")

    with Workspace(arena.workspace, max_bytes=1000) as ws:
        host = object.__new__(PluginHost)
        host.workspace = ws
        host.pool = _NoWorkers()  # type: ignore[assignment]
        monkeypatch.setattr(Workspace, "refresh_usage", keeps_changing)
        hook = host._budget_check(Permissions(workspace="write"))
        assert hook is not None
        with pytest.raises(ToolFailure):
            # What runs around a worker's call: the check itself, or a preparation
            # before the call that returns the check.
            after = await hook()
            if callable(after):
                await after()
    arena.assert_nothing_seen()


async def test_what_a_background_process_writes_between_calls_is_counted(arena: Arena) -> None:
    with Workspace(arena.workspace, max_bytes=1 << 20) as ws:
        host = object.__new__(PluginHost)
        host.workspace = ws
        host.pool = _NoWorkers()  # type: ignore[assignment]
        await trio.to_thread.run_sync(ws.usage)  # measured once, at the first write
        hook = host._budget_check(Permissions(workspace="write"))
        assert hook is not None
        # Between two calls, a background process fills 4 MiB (past the 1 MiB budget).
        (arena.workspace / "filler").write_bytes(os.urandom(4 << 20))
        os.sync()
        with pytest.raises(ToolFailure):
            after = await hook()  # the next call starts ...
            if callable(after):
                await after()  # ... writes nothing, and ends
    arena.assert_nothing_seen()
