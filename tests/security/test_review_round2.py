"""Round 2: a second engineer's attack on the fixes of the first review (issue 10).

Attacked: bounded worker frames (``sandbox._protocol.FROM_WORKER``), the log
budget, the disk budget's free-space bound and its walk with every worker
frozen (``WorkerPool.frozen``), files a worker keeps after unlinking them, and
the cgroup freezer itself. Holes are strict xfails (one attempt each) with the
fix they need in their reason; attempts that were refused are plain tests.
"""

from __future__ import annotations

import os
import platform
import subprocess
import time
from pathlib import Path

import pytest
import trio
from kit import PLUGINS, Arena

from kernel.executor import run_tool_calls
from kernel.home import TakHome
from kernel.messages import Observation, ToolCall
from kernel.plugin import use_context
from plugins import open_plugin_host, remote_tools
from sandbox import Policy, _protocol, open_worker_pool
from tests.security.frame_counter import assert_decoding_bounded, decoded_frames

pytestmark = [
    pytest.mark.usefixtures("confined"),
    pytest.mark.skipif(platform.machine() != "x86_64", reason="raw x86-64 syscall numbers"),
]

_WIDE = Policy(subprocess=True)


def _home(arena: Arena) -> TakHome:
    return TakHome(arena.root / "home").ensure()


# --- F1: max-cost frames back to back -------------------------------------------------------
#
# FROM_WORKER bounds the cost of one frame (~50 ms for 8 MiB of 1 000-digit integers), and
# docs/security.md says such a frame freezes the kernel "once". Nothing bounds how many: a
# result frame for an id no call is waiting for is decoded in full, then dropped without a
# word (pool._dispatch: "a call that was cancelled meanwhile" -- but a cancelled call kills
# its worker, so such a frame is always forged). A worker re-sends the same 8 MiB buffer
# as fast as the socket takes it: the kernel's Trio thread decodes ~20 of them a second,
# for as long as the worker lives (between calls too, from a thread it left running).

_FRAME_STORM = """
import struct, threading
item = b'9' * 1000
n = (8 * 1024 * 1024 - 200) // 1001
body = b'{"type":"result","id":987654321,"ok":true,"value":[' + b','.join([item] * n) + b']}'
frame = struct.pack('!I', len(body)) + body
channel = socket.socket(fileno=os.dup(3))
deadline = time.monotonic() + SECONDS
sent = 0
while time.monotonic() < deadline:
    channel.sendall(frame)
    sent += 1
result = sent
"""


async def _storm(arena: Arena, seconds: float) -> tuple[str, Observation]:
    code = _FRAME_STORM.replace("SECONDS", str(seconds))
    async with open_worker_pool(arena.workspace, spare=False) as pool:
        attacker = await pool.start(str(PLUGINS / "attack.py"), policy=_WIDE)
        bystander = await pool.start(str(PLUGINS / "attack.py"), name="bystander")
        box: list[Observation] = []

        async def attack() -> None:
            [obs] = await run_tool_calls(
                [ToolCall("a", "attack", {"code": code})], remote_tools(attacker)
            )
            box.append(obs)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(attack)
            await trio.sleep(seconds / 2)
            [check] = await run_tool_calls(
                [ToolCall("b", "attack", {"code": "result = 1"})], remote_tools(bystander)
            )
    return box[0].content, check


async def test_max_cost_frames_back_to_back_do_not_monopolise_the_kernel(arena: Arena) -> None:
    with decoded_frames() as decoded:
        result, check = await _storm(arena, 4.0)
    # One worker may cost the kernel's loop a frame now and then, not most of its time:
    # the first forged frame is decoded (~50 ms, once), and its worker is killed for it.
    costly = [size for size, _ in decoded if size > _protocol.COSTLY_BODY]
    assert len(costly) <= 1, f"the kernel decoded {len(costly)} forged frames: {result[:80]}"
    assert_decoding_bounded(decoded)
    assert "broke the protocol" in result, result
    assert check.content == "ALLOWED: 1", check.content
    arena.assert_nothing_seen([result, check.content])


# --- F2: disk a worker keeps after unlinking, where no /proc/<pid>/fd shows it ------------
#
# A walk of the tree cannot see a file that is in no directory; the free-space bound sees
# the disk go, forces a walk, the walk finds nothing, and the lost space is taken for
# "freed elsewhere" from then on. The fix (f9a370c, ``_cgroup.unlinked_open_bytes``)
# adds what the workers' /proc/<pid>/fd entries hold; two other ways to keep an unlinked
# file alive show in no fd table: a shared mapping (the fd closed), and a descriptor in
# flight in a socket pair nobody reads (SCM_RIGHTS within the worker still works).

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
    assert "workspace over its budget" in seen[0].content, seen[0].content
    assert seen[-1].content == "stdout:\nnothing written", [o.content for o in seen]
    arena.assert_nothing_seen([o.content for o in seen])


async def test_an_unlinked_file_held_by_an_fd_counts(arena: Arena) -> None:
    _assert_every_check_saw_it(arena, await _hidden_then_checks(arena, "fd"))


async def test_an_unlinked_file_held_by_a_mapping_counts(arena: Arena) -> None:
    _assert_every_check_saw_it(arena, await _hidden_then_checks(arena, "mmap"))


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


# --- F3: a worker that the freezer cannot stop ----------------------------------------------
#
# The walk runs inside ``WorkerPool.frozen()``; ``_cgroup.freeze`` waits 2 s for every task of
# a set to stop, then gives up (thaws the set, OSError), and ``frozen()`` logs it and runs
# the block anyway -- and ``PluginHost._check_budget`` ignores what ``frozen()`` yields. A
# task stops only on its way back to user space or in a freezable sleep; a write(2) holds
# the inode's rwsem for as long as it copies, and the writers queued behind it sleep
# uninterruptibly, not freezably. Eight processes each writing 1 GiB (from untouched
# anonymous memory: the zero page, no memory charged) to one file keep some task of the
# set unfreezable for seconds at a time, while a ninth process goes on working.

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


# --- F4: grep's clock does not run while it walks -------------------------------------------
#
# grep checks its deadline before each file it reads and between RE2 windows, never while
# ``_walk_files`` lists directories: a tree of directories only (or a glob nothing
# matches) is walked to MAX_WALK_ENTRIES without a look at the clock. And each directory
# is listed by its path from the workspace root, so one at depth d costs d lookups: 1 900
# levels with 50 subdirectories each (95 000 entries, under the 200 000 cap) make the walk
# quadratic -- the kernel's thread is held past grep's deadline, unkillable.


def _deep_and_wide(root: Path, depth: int = 1900, width: int = 50) -> None:
    here = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for _ in range(depth):
            os.mkdir("a", dir_fd=here)
            for j in range(width):
                os.mkdir(f"b{j}", dir_fd=here)
            nxt = os.open("a", os.O_RDONLY | os.O_DIRECTORY, dir_fd=here)
            os.close(here)
            here = nxt
    finally:
        os.close(here)


def test_grep_walking_a_deep_tree_of_directories_is_bounded(arena: Arena, stress: bool) -> None:
    from test_review_kernel import fs_call

    # Building 95,000 directories takes half a minute: `make stress` builds the whole
    # tree, `make test` one deep enough to pass the depth cap (tests/plugins/test_fs.py
    # checks the cap and the clock per directory with a fake clock).
    _deep_and_wide(arena.workspace, depth=1900 if stress else 300, width=50 if stress else 5)
    try:
        outcome = fs_call(arena.workspace, "grep", pattern="x", path=".", glob="*.py")
    finally:
        # Python's rmtree recurses once per level (pytest's cleanup of tmp_path would
        # fail at this depth); rm walks without recursion.
        subprocess.run(["rm", "-rf", str(arena.workspace / "a")], check=True)
    # It ended by itself (within the hang guard), at its depth cap or its clock, and says so.
    returned = outcome.get("returned", "")
    assert "[did not enter directories more than" in returned or "[stopped after " in returned, (
        outcome
    )
    arena.assert_nothing_seen()


# --- refused: leaving the freezer, and log floods from many workers at once -----------------

_LEAVE_CGROUP = """
errors = []
for path in ('/sys/fs/cgroup/freezer/cgroup.procs', '/sys/fs/cgroup/memory/cgroup.procs',
             '/sys/fs/cgroup/pids/cgroup.procs', '/sys/fs/cgroup/unified/cgroup.procs',
             '/sys/fs/cgroup/cgroup.procs'):
    try:
        with open(path, 'w') as f:
            f.write('0')
    except OSError as exc:
        errors.append(exc.errno)
        continue
    result = 'moved via ' + path
    break
else:
    if errors and all(e in (errno.EACCES, errno.EPERM, errno.ENOENT) for e in errors):
        raise OSError(errors[0], 'refused')
"""


async def test_a_worker_cannot_move_itself_out_of_its_cgroups(arena: Arena) -> None:
    result = await arena.attack(_LEAVE_CGROUP, policy=_WIDE)
    arena.assert_refused(result)


_LOG_FLOOD = (
    "from kernel.plugin import context\nlog = context().logger\n"
    "for i in range({records}):\n    log.warning('x' * 8000)\nresult = 'flooded'"
)


async def test_log_floods_from_four_workers_at_once_do_not_freeze_the_kernel(
    arena: Arena, stress: bool
) -> None:
    # Each flood is over three times what the kernel logs of a worker (1,200 records);
    # make stress floods 20,000 records of 8 KB each.
    code = _LOG_FLOOD.replace("{records}", "20_000" if stress else "4_000")

    async def flood() -> list[Observation]:
        async with open_worker_pool(arena.workspace, spare=False) as pool:
            workers = [await pool.start(str(PLUGINS / "attack.py"), name=f"w{i}") for i in range(4)]
            out: list[Observation] = []

            async def one(i: int) -> None:
                [obs] = await run_tool_calls(
                    [ToolCall(str(i), "attack", {"code": code})], remote_tools(workers[i])
                )
                out.append(obs)

            async with trio.open_nursery() as nursery:
                for i in range(4):
                    nursery.start_soon(one, i)
        return out

    # The kernel's work for the floods is bounded: counted in records logged, not timed.
    results = await flood()
    assert [r.content for r in results] == ["ALLOWED: 'flooded'"] * 4, results
    records = [r for r in arena._log.records if r.name.startswith("tak.plugin.w")]
    assert 0 < len(records) <= 4 * 1_200, f"{len(records)} plugin records logged"
    arena.assert_nothing_seen([r.content for r in results])
