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
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import trio
from kit import PLUGINS, Arena, own_file_system

from kernel.errors import SandboxError
from kernel.executor import run_tool_calls
from kernel.home import TakHome
from kernel.messages import Observation, ToolCall
from kernel.plugin import Permissions, use_context
from kernel.tools import ToolFailure
from plugins import open_plugin_host, remote_tools
from plugins._host import PluginHost
from sandbox import Policy, Workspace, open_worker_pool
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


# -- disk a worker keeps after unlinking, where no /proc/<pid>/fd shows it ---------------------
#
# A walk of the tree cannot see a file that is in no directory; the free-space bound sees
# the disk go, forces a walk, the walk finds nothing, and the lost space would be taken
# for "freed elsewhere" from then on. ``_cgroup.unlinked_open_bytes`` adds what the
# workers' /proc/<pid>/fd entries hold; two other ways to keep an unlinked file alive
# show in no fd table: a shared mapping (the fd closed), and a descriptor in flight in a
# socket pair nobody reads (SCM_RIGHTS within the worker).


_HOLD = r"""
import subprocess, sys
hold = '''
import mmap, os, socket, time
HOW = "{how}"
fd = os.open('hidden', os.O_CREAT | os.O_RDWR, 0o600)
os.unlink('hidden')
size = 4 << 20
if HOW == "fd":
    os.write(fd, os.urandom(size))
    os.fsync(fd)
elif HOW == "mmap":
    import ctypes
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                          ctypes.c_int, ctypes.c_long]
    os.ftruncate(fd, size)
    # Not mmap.mmap: it keeps a dup of the fd. PROT_READ|PROT_WRITE, MAP_SHARED.
    addr = libc.mmap(None, size, 3, 1, fd, 0)
    assert addr not in (None, ctypes.c_void_p(-1).value), ctypes.get_errno()
    ctypes.memmove(addr, os.urandom(size), size)
    libc.msync(ctypes.c_void_p(addr), ctypes.c_size_t(size), 4)  # MS_SYNC
    os.close(fd)  # only the mapping keeps it now
elif HOW == "in_flight":
    os.write(fd, os.urandom(size))
    os.fsync(fd)
    a, b = socket.socketpair()
    socket.send_fds(a, [b"x"], [fd])
    os.close(fd)  # only b's receive queue keeps it now
os.sync()
print('held', flush=True)
time.sleep(600)
'''
p = subprocess.Popen([sys.executable, '-c', hold], stdout=subprocess.PIPE,
                     stdin=subprocess.DEVNULL, stderr=subprocess.PIPE)
line = p.stdout.readline().decode().strip()
print(line or p.stderr.read().decode()[-300:])
"""


async def _hidden_then_checks(arena: Arena, how: str) -> list[Observation]:
    config = {"workspace": {"max_bytes": 1 << 20}}
    with own_file_system(arena.workspace):
        return await _hidden_then_checks_on(arena, how, config)


async def _hidden_then_checks_on(
    arena: Arena, how: str, config: dict[str, Any]
) -> list[Observation]:
    async with open_plugin_host(
        arena.workspace, plugins=["python"], config=config, home=_home(arena)
    ) as host:
        with use_context(host.context()):
            seen = []
            for i in range(4):
                code = _HOLD.replace("{how}", how) if i == 0 else "print('nothing written')"
                [obs] = await run_tool_calls(
                    [ToolCall(str(i), "run_python", {"code": code})], host.tools
                )
                seen.append(obs)
    return seen


def _assert_every_check_saw_it(arena: Arena, seen: list[Observation]) -> None:
    assert "Traceback" not in seen[0].content, seen[0].content
    # Counted, and the disk watchdog kills the holder with its worker: calls are
    # refused until it is gone, and then the 4 MiB are free and the next calls run.
    # Or, the holder in its fsync past the freezer's wait: killed for that (as in
    # tests/security/test_overlap.py); never "held", a pass.
    assert (
        "workspace over its budget" in seen[0].content
        or "could not be stopped to measure the workspace" in seen[0].content
    ), seen[0].content
    assert seen[-1].content == "stdout:\nnothing written", [o.content for o in seen]
    arena.assert_nothing_seen([o.content for o in seen])


@pytest.mark.usefixtures("confined")
async def test_an_unlinked_file_held_by_an_fd_counts(arena: Arena) -> None:
    _assert_every_check_saw_it(arena, await _hidden_then_checks(arena, "fd"))


@pytest.mark.usefixtures("confined")
async def test_an_unlinked_file_held_by_a_mapping_counts(arena: Arena) -> None:
    _assert_every_check_saw_it(arena, await _hidden_then_checks(arena, "mmap"))


@pytest.mark.usefixtures("confined")
async def test_an_unlinked_file_cannot_be_held_in_flight(arena: Arena) -> None:
    """F2b: an unlinked file whose only reference is a descriptor in flight (SCM_RIGHTS on
    a worker-internal socketpair, never received) would be in no fd table, so no count
    could find it: sendmsg and sendmmsg, the only calls that pass descriptors, are
    refused in every worker."""
    code = (
        "fd = os.open('hidden', os.O_CREAT | os.O_WRONLY, 0o600)\n"
        "os.unlink('hidden')\n"
        "a, b = socket.socketpair()\n"
        "socket.send_fds(a, [b'x'], [fd])\n"
        "result = 'in flight'"
    )
    for policy in (None, Policy(subprocess=True), arena.network_policy()):
        arena.assert_refused(await arena.attack(code, policy=policy))


# -- a worker that the freezer cannot stop --------------------------------------------------
#
# The walk runs inside ``WorkerPool.frozen()``; ``_cgroup.freeze`` waits 2 s for every task
# of a set to stop, then gives up (thaws the set, OSError). A task stops only on its way
# back to user space or in a freezable sleep; a write(2) holds the inode's rwsem for as
# long as it copies, and the writers queued behind it sleep uninterruptibly, not
# freezably. Eight processes each writing 1 GiB (from untouched anonymous memory: the
# zero page, no memory charged) to one file keep some task of the set unfreezable for
# seconds at a time, while a ninth process goes on working: the block must not run as if
# every worker were stopped.


_WIDE = Policy(subprocess=True)


_UNFREEZABLE = r"""
import subprocess, sys
writer = '''
import mmap, os
buf = mmap.mmap(-1, 1 << 30)  # never touched: reads come from the zero page
fd = os.open('w.dat', os.O_CREAT | os.O_WRONLY, 0o600)
while True:
    os.pwrite(fd, buf, 0)
'''
witness = '''
import os, time
fd = os.open('witness', os.O_CREAT | os.O_WRONLY | os.O_APPEND, 0o600)
while True:
    os.write(fd, b'.')
    time.sleep(0.001)
'''
for _ in range(8):
    subprocess.Popen([sys.executable, '-c', writer], stdin=subprocess.DEVNULL)
subprocess.Popen([sys.executable, '-c', witness], stdin=subprocess.DEVNULL)
time.sleep(1)
result = 'started'
"""


@pytest.mark.usefixtures("confined")
async def test_the_walk_never_runs_while_a_worker_runs(arena: Arena) -> None:
    async with open_worker_pool(arena.workspace, spare=False) as pool:
        worker = await pool.start(str(PLUGINS / "attack.py"), policy=_WIDE)
        [obs] = await run_tool_calls(
            [ToolCall("a", "attack", {"code": _UNFREEZABLE})], remote_tools(worker)
        )
        assert obs.content == "ALLOWED: 'started'", obs.content
        witness = arena.workspace / "witness"
        moved = []
        for _ in range(3):
            started = time.monotonic()
            async with pool.frozen() as complete:
                before = witness.stat().st_size
                await trio.sleep(0.3)
                moved.append(
                    (
                        complete,
                        witness.stat().st_size - before,
                        round(time.monotonic() - started, 2),
                    )
                )
            await trio.sleep(0.2)
    # What the walk sees must not change under it: either every worker is stopped, or
    # the block does not run as if it were.
    ran_live = [m for m in moved if m[1] > 0]
    assert not ran_live, f"the frozen block ran while a worker ran (complete, bytes, s): {moved}"
    arena.assert_nothing_seen([obs.content])
