"""Wave 3, class 1, attacked again: the disk watchdog against a second engineer.

Each test is one attempt on the budget that ``sandbox._diskwatch`` holds while
workers live (see ``test_wave3_disk.py`` for the first engineer's own attempts);
each must be refused. Real plugins in real confined workers; the tests wait for
what they started, never on a clock.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import trio
from kit import Arena

from kernel.executor import run_tool_calls
from kernel.home import TakHome
from kernel.messages import Observation, ToolCall
from kernel.plugin import use_context
from plugins import PluginHost, open_plugin_host
from sandbox import DiskWatch, Workspace

MIB = 1 << 20


def _home(arena: Arena) -> TakHome:
    return TakHome(arena.root / "home").ensure()


async def _python(
    host: PluginHost, code: str, call_id: str, workspace: Workspace | None = None
) -> Observation:
    with use_context(host.context(workspace=workspace)):
        [obs] = await run_tool_calls([ToolCall(call_id, "run_python", {"code": code})], host.tools)
    return obs


# A program that holds an unlinked temporary file (O_TMPFILE in the workspace, as tempfile.TemporaryFile(dir=...)
# makes one) of 40 MiB, within its own workspace's budget, and lives on.
_HOLDER = r"""
import subprocess, sys
holder = '''
import os, tempfile, time
f = tempfile.TemporaryFile(dir='.')
f.write(os.urandom(40 << 20)); f.flush()
open('held', 'w').write('40 MiB held')
time.sleep(600)
'''
import os, time
subprocess.Popen([sys.executable, '-c', holder], stdin=subprocess.DEVNULL)
while not os.path.exists('held'):
    time.sleep(0.05)
print('started')
"""


async def test_a_file_held_in_another_workspace_is_not_charged_to_this_one(
    arena: Arena, confined: None
) -> None:
    """Two workspaces on one file system: a task's worker keeps a 40 MiB temporary file
    (unlinked, within its own 64 MiB budget); a worker of the host's workspace writes
    30 MiB (within its own). The host's walk must not add the task's file to the host's
    usage, kill the host's writers for it, and refuse the host's next calls."""
    task = arena.root / "task"
    task.mkdir()
    config = {"workspace": {"max_bytes": 64 * MIB}}
    async with open_plugin_host(
        arena.workspace, plugins=["python"], config=config, home=_home(arena)
    ) as host:
        async with host.open_workspace(task) as lent:
            held = await _python(host, _HOLDER, "1", lent)
            # Lives long enough for the host's watchdog to walk while it runs.
            wrote = await _python(
                host,
                "import os, time\nopen('mine', 'wb').write(os.urandom(30 << 20))\n"
                "time.sleep(1)\nprint('wrote')",
                "2",
            )
            then = await _python(host, "print('after')", "3")
    assert (task / "held").exists(), held.content
    assert not wrote.is_error and "wrote" in wrote.content, wrote.content
    assert not then.is_error and "after" in then.content, then.content
    arena.assert_nothing_seen([held.content, wrote.content, then.content])


# 60,000 one-page mappings of one file (alternate offsets: neighbours never merge), and
# 1,000 of an 8 MiB file then unlinked: held by mappings only, in no directory.
_MAPPINGS = r"""
import subprocess, sys
mapper = '''
import ctypes, os, time
libc = ctypes.CDLL(None, use_errno=True)
libc.mmap.restype = ctypes.c_void_p
libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                      ctypes.c_int, ctypes.c_long]
def many(fd, n):
    for i in range(n):
        assert libc.mmap(None, 4096, 1, 1, fd, 4096 * (i % 2)) != ctypes.c_void_p(-1).value
fd = os.open('pages', os.O_CREAT | os.O_RDWR, 0o600)
os.ftruncate(fd, 8192)
many(fd, 60_000)
os.close(fd)
fd = os.open('gone', os.O_CREAT | os.O_RDWR, 0o600)
os.write(fd, os.urandom(8 << 20))
many(fd, 1_000)
os.close(fd)
os.unlink('gone')
open('mapped', 'w').write('done')
time.sleep(600)
'''
import os, time
subprocess.Popen([sys.executable, '-c', mapper], stdin=subprocess.DEVNULL)
while not os.path.exists('mapped'):
    time.sleep(0.05)
print('started')
"""


async def test_many_mappings_do_not_make_every_walk_slow(
    arena: Arena, confined: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The walk adds what workers keep mapped after unlinking. It stat'ed every mapping
    of every member: 60,000 one-page mappings made each walk take over a second, and the
    watchdog spaces its walks by their time (a bound-asked walk waits four walk times, a
    forced one twenty), so a worker could buy itself seconds of unchecked writing. The
    work must follow the unlinked files, not the mappings: counted in stats of /proc."""
    config = {"workspace": {"max_bytes": 64 * MIB}}
    async with open_plugin_host(
        arena.workspace, plugins=["python"], config=config, home=_home(arena)
    ) as host:
        started = await _python(host, _MAPPINGS, "1")
        stats = 0
        real_stat = os.stat

        def counting(path: Any, *args: Any, **kwargs: Any) -> os.stat_result:
            nonlocal stats
            if str(path).startswith("/proc/"):
                stats += 1
            return real_stat(path, *args, **kwargs)

        device = os.stat(arena.workspace).st_dev
        monkeypatch.setattr(os, "stat", counting)
        hidden = await host.pool.unlinked_open_bytes_in(arena.workspace, device)
        monkeypatch.setattr(os, "stat", real_stat)
    assert "started" in started.content, started.content
    assert 8 * MIB <= hidden < 9 * MIB, f"{hidden} bytes held by mappings of one 8 MiB file"
    assert stats < 2_000, f"{stats} stats of /proc for 61,000 mappings of two files"
    arena.assert_nothing_seen([started.content])


class _SlowToFreeze:
    """A pool whose workers take a second to stop: the attacker's to arrange (a tree
    that is slow to walk, many processes to freeze and read, a freeze they delay)."""

    def __init__(self) -> None:
        self.kills: list[str] = []

    @contextlib.asynccontextmanager
    async def frozen(self, *, wait_s: float = 2.0) -> AsyncIterator[bool]:
        await trio.sleep(1.0)
        yield True

    async def unlinked_open_bytes(self, device: int) -> int:
        return 0

    def writers(self, workspace: Path) -> int:
        return 1

    async def writers_changed(self) -> None:
        await trio.sleep_forever()

    async def kill_writers(self, workspace: Path, reason: str) -> None:
        self.kills.append(reason)


async def test_a_slow_walk_does_not_buy_unchecked_writing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, autojump_clock: trio.abc.Clock
) -> None:
    """Walks the bound asks for wait four walk times after the last: a walk that took a
    second let the workers write for four more with nothing looking, however far past
    the budget the bound said they were. 100 MiB gone from the file system at once,
    against a 4 MiB budget: the next look walks."""
    free = [10_000_000_000, 1_000_000]
    with Workspace(tmp_path, max_bytes=4 * MIB) as ws:
        monkeypatch.setattr(ws, "free_bytes", lambda: free[0])
        monkeypatch.setattr(ws, "free_inodes", lambda: free[1])
        watch = DiskWatch(ws, _SlowToFreeze())
        await watch.look()  # the first look walks (and takes a second)
        assert watch.walks == 1
        free[0] -= 100 * MIB
        await watch.look()
        assert watch.walks == 2, "a bound 25 times the budget waited for its turn"
        free[0] -= MIB // 2  # a little past the bound's last figure: within a quarter
        await watch.look()
        assert watch.walks == 2, "a bound just past the budget walked at once"


# Blocks allocated by the kernel's own copy loops, from a sparse source (512 MiB of
# holes, no block): no user-space buffer, up to 512 MiB per system call.
_COPIER = r"""
import subprocess, sys
copier = '''
import os, sys
how = sys.argv[1]
src = os.open('sparse', os.O_CREAT | os.O_RDWR, 0o600)
os.ftruncate(src, 1 << 29)
for i in range(8):
    dst = os.open(f'copy{i}', os.O_CREAT | os.O_WRONLY, 0o600)
    done = 0
    while done < 1 << 29:
        if how == 'copy_file_range':
            done += os.copy_file_range(src, dst, (1 << 29) - done, done, done)
        elif how == 'sendfile':
            done += os.sendfile(dst, src, done, (1 << 29) - done)
        else:  # splice: a pipe's pages moved into the file
            r, w = os.pipe()
            os.write(w, bytes(65536))
            done += os.splice(r, dst, 65536)
            os.close(r)
            os.close(w)
    os.close(dst)
open('w.done', 'w').write('copied 4 GiB')
'''
p = subprocess.Popen([sys.executable, '-c', copier, HOW], stdin=subprocess.DEVNULL)
open('w.pid', 'w').write(str(p.pid))
print('started')
"""


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] in ("Z", "X")
    except (FileNotFoundError, ProcessLookupError):
        return True


def _allocated(root: Path) -> int:
    return sum(
        os.lstat(os.path.join(top, name)).st_blocks * 512
        for top, dirs, files in os.walk(root)
        for name in dirs + files
    )


@pytest.mark.parametrize("how", ["copy_file_range", "sendfile", "splice"])
async def test_kernel_side_copies_are_stopped_at_the_budget(
    arena: Arena, how: str, confined: None
) -> None:
    config = {"workspace": {"max_bytes": 4 * MIB}}
    async with open_plugin_host(
        arena.workspace, plugins=["python"], config=config, home=_home(arena)
    ) as host:
        started = await _python(host, _COPIER.replace("HOW", repr(how)), "1")
        pid_file = arena.workspace / "w.pid"
        with trio.move_on_after(120):
            while True:  # until the copier has ended (it does by itself, or is killed)
                if not pid_file.exists() or _gone(int(pid_file.read_text())):
                    break
                await trio.sleep(0.1)
        used = await trio.to_thread.run_sync(_allocated, arena.workspace)
        then = await _python(host, "print('after')", "2")
    assert not (arena.workspace / "w.done").exists(), f"{how} copied all 4 GiB"
    assert used < 256 * MIB, f"{used} bytes in a workspace of 4 MiB"
    assert then.is_error and "workspace over its budget" in then.content, then.content
    arena.assert_nothing_seen([started.content, then.content])


async def test_one_directory_of_hard_links_does_not_make_the_walk_read_it_all(
    arena: Arena, confined: None
) -> None:
    """Hard links are names without inodes: no free-inode bound sees them, so one
    directory can hold millions before a walk. The walk stopped past ``max_files`` only
    between directories, and read that one whole (every name a stat), on every walk and
    every refused call's walk, with every worker of the pool frozen meanwhile."""
    config = {"workspace": {"max_files": 1000}}
    code = (
        "import os\nos.mkdir('l')\nopen('l/one', 'w').close()\n"
        "for i in range(30_000):\n    os.link('l/one', f'l/{i}')\nprint('linked')"
    )
    async with open_plugin_host(
        arena.workspace, plugins=["python"], config=config, home=_home(arena)
    ) as host:
        linked = await _python(host, code, "1")
        await trio.to_thread.run_sync(host.workspace.refresh_usage)
        names = host.workspace.files()
    assert len(os.listdir(arena.workspace / "l")) > 1000, linked.content
    assert 1000 < names <= 1001, f"the walk counted {names} names to find more than 1000"
    arena.assert_nothing_seen([linked.content])
