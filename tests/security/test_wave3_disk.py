"""Wave 3, class 1: the disk budget against what outlives a call.

A plugin with ``subprocess`` (``run_python``) starts programs that go on writing
after its call returned: usage used to be settled only at the end of each call, so
the workspace grew to many times ``max_bytes`` with nothing refused, and empty
files were free. Each attempt here is one way to pass the budget; it is refused
when the disk watchdog (``sandbox._diskwatch``) stops the writers near the limit,
``max_files`` counts the names, and ``fallocate`` cannot allocate at all.

The writers pace themselves (a sleep between chunks) so that what they would have
written, unchecked, is far past anything the watchdog lets through even on a
loaded machine; the tests wait for the writers' end, never on a clock.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest
import seccomp_emulator as emulator
import trio
from kit import Arena

from kernel.executor import run_tool_calls
from kernel.home import TakHome
from kernel.messages import Observation, ToolCall
from kernel.plugin import use_context
from plugins import PluginHost, open_plugin_host
from sandbox import _syscalls, seccomp

MIB = 1 << 20
#: How long the tests wait for a writer to end (it ends by itself well before).
_PATIENCE_S = 120


def _home(arena: Arena) -> TakHome:
    return TakHome(arena.root / "home").ensure()


def _usage(root: Path) -> tuple[int, int]:
    """Bytes (allocated, hard links once) and names under ``root``, as ``du`` counts."""
    seen: set[tuple[int, int]] = set()
    total = names = 0
    for top, dirs, files in os.walk(root):
        for name in dirs + files:
            names += 1
            st = os.lstat(os.path.join(top, name))
            if (st.st_dev, st.st_ino) in seen:
                continue
            seen.add((st.st_dev, st.st_ino))
            total += st.st_blocks * 512
    return total, names


async def _python(host: PluginHost, code: str, call_id: str = "1") -> Observation:
    with use_context(host.context()):
        [obs] = await run_tool_calls([ToolCall(call_id, "run_python", {"code": code})], host.tools)
    return obs


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rpartition(")")[2].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return True
    return state in ("Z", "X")


async def _wait_gone(arena: Arena, pid_files: list[str]) -> None:
    """Until every pid named in ``pid_files`` has ended.

    Called once the call that started the writers has returned: it wrote each
    writer's pid before it printed ``started``, so a file still missing names a
    writer never started (its starter was killed first).
    """
    with trio.move_on_after(_PATIENCE_S):
        while True:
            pids = []
            for name in pid_files:
                try:
                    pids.append(int((arena.workspace / name).read_text()))
                except FileNotFoundError:
                    continue
            if all(_gone(pid) for pid in pids):
                return
            await trio.sleep(0.1)
    raise AssertionError(f"the writers {pid_files} did not end in {_PATIENCE_S} s")


# The child detaches from the call (and with "double_fork", from its parent too: a
# daemon, reparented to init, still in the worker's cgroups) and writes on.
_BACKGROUND = r"""
import os, subprocess, sys
writer = r'''
import mmap, os, sys, time
how, name, total, chunk = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
if how == "double_fork":
    r, w = os.pipe()
    if os.fork():
        os.read(r, 1)  # the daemon has named itself: only then does its parent go
        os._exit(0)
    with open(name + '.pid', 'w') as f:
        f.write(str(os.getpid()))
    os.write(w, b'.')
os.makedirs('out', exist_ok=True)
done = 0
i = 0
while done < total:
    path = f'out/{name}-{i}'
    if how == "files":
        os.close(os.open(path, os.O_CREAT | os.O_WRONLY, 0o600))
        done += 1
        if done % 200 == 0:
            time.sleep(0.01)
        i += 1
        continue
    fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o600)
    if how == "mmap":  # a sparse file whose holes are filled through a mapping
        os.ftruncate(fd, chunk)
        with mmap.mmap(fd, chunk) as m:
            m[:] = b'y' * chunk
    elif how == "posix_fallocate":  # glibc writes the blocks when fallocate is refused
        os.posix_fallocate(fd, 0, chunk)
    else:
        os.write(fd, os.urandom(chunk))
    os.close(fd)
    done += chunk
    i += 1
    time.sleep(0.02)
with open(name + '.done', 'w') as f:
    f.write('wrote everything')
'''
for n in range(WRITERS):
    p = subprocess.Popen([sys.executable, '-c', writer, HOW, f'w{n}', str(TOTAL), str(CHUNK)],
                         stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                         stderr=subprocess.DEVNULL)
    if HOW != "double_fork":
        with open(f'w{n}.pid', 'w') as f:
            f.write(str(p.pid))
    else:
        p.wait()  # until the daemon has written its own pid
print('started')
"""


def _background(how: str, *, writers: int = 1, total: int, chunk: int = 0) -> str:
    return f"HOW, WRITERS, TOTAL, CHUNK = {how!r}, {writers}, {total}, {chunk}\n" + _BACKGROUND


@pytest.mark.parametrize("how", ["write", "double_fork", "mmap", "posix_fallocate"])
async def test_a_program_writing_after_its_call_returned_is_stopped_at_the_budget(
    arena: Arena, how: str, confined: None
) -> None:
    budget = 4 * MIB
    config = {"workspace": {"max_bytes": budget}}
    async with open_plugin_host(
        arena.workspace, plugins=["python"], config=config, home=_home(arena)
    ) as host:
        started = await _python(host, _background(how, total=96 * MIB, chunk=256 * 1024))
        await _wait_gone(arena, ["w0.pid"])
        used, _ = await trio.to_thread.run_sync(_usage, arena.workspace)
        then = await _python(host, "print('after')", "2")
    assert not (arena.workspace / "w0.done").exists(), "the writer wrote all 96 MiB"
    # 96 MiB unchecked; what the watchdog lets through is a few looks' worth.
    assert used < 48 * MIB, f"{used} bytes in a workspace of {budget}"
    assert then.is_error and "workspace over its budget" in then.content, then.content
    arena.assert_nothing_seen([started.content, then.content])


async def test_writers_racing_the_watchdog_are_all_stopped(arena: Arena, confined: None) -> None:
    """Four writers at once, each 1 MiB per 20 ms: all killed, none finishes."""
    config = {"workspace": {"max_bytes": 4 * MIB}}
    async with open_plugin_host(
        arena.workspace, plugins=["python"], config=config, home=_home(arena)
    ) as host:
        code = _background("write", writers=4, total=128 * MIB, chunk=MIB)
        started = await _python(host, code)
        await _wait_gone(arena, [f"w{n}.pid" for n in range(4)])
        used, _ = await trio.to_thread.run_sync(_usage, arena.workspace)
    finished = [n for n in range(4) if (arena.workspace / f"w{n}.done").exists()]
    assert not finished, f"writers {finished} wrote all 128 MiB"
    assert used < 256 * MIB, f"{used} bytes of the 512 MiB the writers meant"
    arena.assert_nothing_seen([started.content])


_STUCK = r"""
import subprocess, sys
writer = '''
import mmap, os, sys
buf = mmap.mmap(-1, 128 << 20)  # never touched: the zero page, no memory charged
for i in range(4):
    fd = os.open(f'stuck{sys.argv[1]}-{i}', os.O_CREAT | os.O_WRONLY, 0o600)
    os.write(fd, buf)  # one system call of 128 MiB: no freezer stops it midway
    os.close(fd)
with open(f'w{sys.argv[1]}.done', 'w') as f:
    f.write('wrote everything')
'''
for n in range(4):
    p = subprocess.Popen([sys.executable, '-c', writer, str(n)], stdin=subprocess.DEVNULL)
    with open(f'w{n}.pid', 'w') as f:
        f.write(str(p.pid))
print('started')
"""


async def test_writers_stuck_in_long_writes_cannot_outwait_the_freezer(
    arena: Arena, confined: None
) -> None:
    """A task stops for the freezer only between system calls: writers that spend their
    life inside 128 MiB writes keep a walk from starting. Those that do not stop in
    time are killed (a walk the bound asked for waits a quarter second)."""
    config = {"workspace": {"max_bytes": 4 * MIB}}
    async with open_plugin_host(
        arena.workspace, plugins=["python"], config=config, home=_home(arena)
    ) as host:
        started = await _python(host, _STUCK)
        await _wait_gone(arena, [f"w{n}.pid" for n in range(4)])
        used, _ = await trio.to_thread.run_sync(_usage, arena.workspace)
    finished = [n for n in range(4) if (arena.workspace / f"w{n}.done").exists()]
    assert not finished, f"writers {finished} wrote all 512 MiB"
    assert used < 1024 * MIB, f"{used} bytes of the 2 GiB the writers meant"
    arena.assert_nothing_seen([started.content])


async def test_many_empty_files_in_one_call_are_refused(arena: Arena, confined: None) -> None:
    config = {"workspace": {"max_files": 1000}}
    code = "import os\nfor i in range(5000):\n    os.close(os.open(f'e{i}', os.O_CREAT, 0o600))"
    async with open_plugin_host(
        arena.workspace, plugins=["python", "fs"], config=config, home=_home(arena)
    ) as host:
        ran = await _python(host, code)
        with use_context(host.context()):
            [then] = await run_tool_calls(
                [ToolCall("2", "write_file", {"path": "more.txt", "content": "y"})], host.tools
            )
    assert ran.is_error and "workspace over its budget" in ran.content, ran.content
    assert "max_files 1000 ([workspace] max_files in tak.toml)" in ran.content
    assert then.is_error, then.content  # fs tools refuse new names too
    arena.assert_nothing_seen([ran.content, then.content])


async def test_empty_files_made_after_the_call_returned_are_stopped(
    arena: Arena, confined: None
) -> None:
    config = {"workspace": {"max_files": 2000}}
    async with open_plugin_host(
        arena.workspace, plugins=["python"], config=config, home=_home(arena)
    ) as host:
        started = await _python(host, _background("files", total=40_000))
        await _wait_gone(arena, ["w0.pid"])
        _, names = await trio.to_thread.run_sync(_usage, arena.workspace)
    assert not (arena.workspace / "w0.done").exists(), "the writer made all 40,000 files"
    assert names < 20_000, f"{names} names in a workspace of at most 2000"
    arena.assert_nothing_seen([started.content])


async def test_hard_links_count_as_names(arena: Arena, confined: None) -> None:
    """A hard link takes a name and no inode: the free-inode bound cannot see it, the
    watchdog's walk (at least every few seconds while a writer lives) does."""
    config = {"workspace": {"max_files": 1000}}
    code = (
        "import os\nopen('one', 'w').close()\n"
        "for i in range(3000):\n    os.link('one', f'link{i}')\nprint('linked')"
    )
    async with open_plugin_host(
        arena.workspace, plugins=["python"], config=config, home=_home(arena)
    ) as host:
        seen = [await _python(host, code)]
        with trio.move_on_after(_PATIENCE_S):
            while "workspace over its budget" not in seen[-1].content:
                await trio.sleep(0.5)
                seen.append(await _python(host, "print('still here')", str(len(seen))))
    assert "workspace over its budget" in seen[-1].content, seen[-1].content
    assert "files > max_files 1000" in seen[-1].content, seen[-1].content
    arena.assert_nothing_seen([o.content for o in seen])


_FALLOCATE = """
libc = ctypes.CDLL(None, use_errno=True)
libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_long, ctypes.c_long]
fd = os.open('prealloc', os.O_CREAT | os.O_RDWR, 0o600)
if libc.fallocate(fd, MODE, 0, 512 << 20) == -1:
    raise OSError(ctypes.get_errno(), 'fallocate')
result = f'{os.fstat(fd).st_blocks * 512} bytes allocated'
"""


@pytest.mark.parametrize(
    "mode",
    [
        pytest.param(0x00, id="grow"),
        pytest.param(0x01, id="keep_size"),  # past RLIMIT_FSIZE's reach: the size stays
        pytest.param(0x10, id="zero_range"),
        pytest.param(0x11, id="zero_range_keep_size"),
    ],
)
async def test_fallocate_allocates_nothing(arena: Arena, mode: int, confined: None) -> None:
    """512 MiB in one system call, in a millisecond: refused in every mode that allocates
    (EOPNOTSUPP, as on a file system without it)."""
    result = await arena.attack(_FALLOCATE.replace("MODE", str(mode)))
    assert result == f"denied: {errno.errorcode[errno.EOPNOTSUPP]}", result
    assert (arena.workspace / "prealloc").stat().st_blocks == 0
    arena.assert_refused(result)


async def test_kit_punching_a_hole_still_works(arena: Arena, confined: None) -> None:
    code = (
        "fd = os.open('holes', os.O_CREAT | os.O_RDWR, 0o600)\n"
        "os.write(fd, b'x' * (1 << 20))\n"
        "libc = ctypes.CDLL(None, use_errno=True)\n"
        "libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_long, ctypes.c_long]\n"
        "assert libc.fallocate(fd, 3, 0, 1 << 20) == 0, ctypes.get_errno()\n"
        "result = os.fstat(fd).st_blocks"
    )
    assert await arena.attack(code) == "ALLOWED: 0"


@pytest.mark.parametrize("table", [_syscalls.X86_64, _syscalls.AARCH64], ids=lambda t: t.machine)
def test_kit_the_fallocate_rule_on_every_architecture(table: _syscalls.SyscallTable) -> None:
    nr = table.get("fallocate")
    assert nr is not None
    for policy in (seccomp.SeccompPolicy(), seccomp.SeccompPolicy(subprocess=True, network=True)):
        program = seccomp.build_filter(policy, table)
        for mode, errno_value in ((0, errno.EOPNOTSUPP), (1, errno.EOPNOTSUPP), (3, None)):
            verdict = emulator.run(program, arch=table.audit_arch, nr=nr, args=(3, mode, 0, 1))
            if errno_value is None:
                assert verdict.allowed, (mode, verdict)
            else:
                assert verdict.errno == errno_value, (mode, verdict)
