"""Class 6 and 9, worker side: memory, processes, disk, CPU, the log and what is left behind.

A worker's whole process tree is held by its cgroup set (memory, pids);
``RLIMIT_AS`` alone would let every child take the limit again. A file past
``RLIMIT_FSIZE`` fails with ``EFBIG`` and the worker lives; a call past its
deadline kills the worker. Worker text reaches the kernel's log one record,
one line, with no control characters. Nothing a worker started outlives it.
Every resource attempt also proves the kernel kept answering
(``responsive.while_responsive``).
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager

import pytest
import trio
from kit import PLUGINS, Arena
from responsive import cgroup_dirs_of, dirs_removed, wait_gone, while_responsive

from kernel.executor import run_tool_calls
from kernel.home import TakHome
from kernel.messages import Observation, ToolCall
from plugins import open_plugin_host, remote_tools
from sandbox import Limits, Policy, Worker, open_worker_pool, probe_isolation

pytestmark = pytest.mark.usefixtures("confined")

MB = 1 << 20
HOG = str(PLUGINS / "hog.py")


def _needs_memory_cgroup() -> None:
    if not probe_isolation().memory_limit.startswith("cgroup:"):
        pytest.skip("no writable memory cgroup here: RLIMIT_AS only")


@asynccontextmanager
async def hog(arena: Arena, policy: Policy) -> AsyncIterator[Worker]:
    async with open_worker_pool(arena.workspace, spare=False) as pool:
        yield await pool.start(HOG, policy=policy)


async def call(worker: Worker, tool: str, **arguments: object) -> Observation:
    [observation] = await run_tool_calls([ToolCall("c", tool, arguments)], remote_tools(worker))
    return observation


# -- memory ----------------------------------------------------------------------------

_BYTEARRAY = """
b = bytearray()
try:
    for _ in range(100):
        b += b'x' * (10 << 20)
except MemoryError:
    raise Refused(f'MemoryError at {len(b) >> 20} MB')
result = f'{len(b) >> 20} MB held'
"""
_MMAP = """
import mmap
m = mmap.mmap(-1, 1 << 30)
m.write(b'x' * (400 << 20))
result = '400 MB written to an anonymous map'
"""
#: Four children, each under its own RLIMIT_AS, together twice the limit.
_CHILDREN = """
hold = "import sys; b = b'x' * (150 << 20); print('ok', flush=True); sys.stdin.read()"
kids = [
    subprocess.Popen([sys.executable, '-c', hold], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    for _ in range(4)
]
held = [k.stdout.readline() for k in kids]
for k in kids:
    k.stdin.close()
    k.wait()
if held.count(b'ok\\n') == len(kids):
    result = f'{len(kids)} children held 150 MB each'
else:
    raise Refused(f'children ended with {[k.returncode for k in kids]}')
"""


@pytest.mark.parametrize(
    ("code", "policy"),
    [
        (_BYTEARRAY, Policy(limits=Limits(memory_bytes=200 * MB))),
        (_MMAP, Policy(limits=Limits(memory_bytes=200 * MB))),
        (_CHILDREN, Policy(subprocess=True, limits=Limits(memory_bytes=300 * MB))),
    ],
    ids=["bytearray", "mmap", "children"],
)
async def test_a_memory_bomb_is_held_to_the_limit(arena: Arena, code: str, policy: Policy) -> None:
    if policy.subprocess:
        _needs_memory_cgroup()  # the per-process rlimit does not hold a tree
    result = await while_responsive(arena, lambda: arena.attack(code, policy=policy))
    assert not result.startswith("ALLOWED"), result
    arena.assert_nothing_seen([result])


async def test_memory_outside_the_address_space_is_held_and_named(arena: Arena) -> None:
    # Pages of the worker's private tmpfs (its TMPDIR) are not in the address space
    # (RLIMIT_AS misses them; memfd_create is refused outright), the memory cgroup
    # counts them: the OOM killer ends the worker, and its call says why.
    _needs_memory_cgroup()
    code = (
        "fd = os.open(os.environ['TMPDIR'] + '/fill', os.O_CREAT | os.O_WRONLY, 0o600)\n"
        "for _ in range(40): os.write(fd, b'x' * (10 << 20))"
    )
    policy = Policy(limits=Limits(memory_bytes=200 * MB, file_size_bytes=None))
    result = await while_responsive(arena, lambda: arena.attack(code, policy=policy))
    assert result.startswith("failed: Error (crashed): "), result
    assert f"killed: out of memory (memory cgroup limit {200 * MB} bytes)" in result
    arena.assert_nothing_seen([result])


# -- processes ---------------------------------------------------------------------------

_FORKS = """
bomb = '''
import os, time
n = 0
try:
    while n < 500:
        if os.fork() == 0:
            os.closerange(0, 3)
            time.sleep(60)
            os._exit(0)
        n += 1
except OSError as e:
    print(n, e.errno, flush=True)
else:
    print(n, 0, flush=True)
'''
out = subprocess.run([sys.executable, '-c', bomb], capture_output=True, text=True).stdout.split()
if int(out[0]) >= 500:
    result = f'{out[0]} processes'
else:
    raise Refused(f'fork {int(out[0]) + 1} failed with errno {out[1]}')
"""
_THREADS = """
import threading
stop = threading.Event()
started = 0
try:
    for _ in range(200):
        threading.Thread(target=stop.wait, daemon=True).start()
        started += 1
except RuntimeError:
    raise Refused(f'thread {started + 1} refused')
finally:
    stop.set()
result = f'{started} threads'
"""


@pytest.mark.parametrize(
    ("code", "policy"),
    [
        (_FORKS, Policy(subprocess=True, limits=Limits(processes=32))),
        # Workers without subprocess cannot fork, but threads are tasks too.
        (_THREADS, Policy(limits=Limits(processes=32))),
    ],
    ids=["fork-bomb", "thread-bomb"],
)
async def test_a_task_bomb_is_held_to_the_process_limit(
    arena: Arena, code: str, policy: Policy
) -> None:
    if not probe_isolation().process_limit.startswith("cgroup:"):
        pytest.skip("no writable pids cgroup here")
    result = await while_responsive(arena, lambda: arena.attack(code, policy=policy))
    arena.assert_refused(result)


async def test_too_many_open_files_are_refused(arena: Arena) -> None:
    code = "files = [open(f'f{i}', 'w') for i in range(1000)]\nresult = len(files)"
    result = await arena.attack(code, policy=Policy(limits=Limits(open_files=64)))
    assert result == "denied: EMFILE", result
    arena.assert_refused(result)


# -- disk --------------------------------------------------------------------------------

_FSIZE = Policy(subprocess=True, limits=Limits(file_size_bytes=MB))


async def test_a_file_past_the_size_limit_fails_and_the_worker_lives(arena: Arena) -> None:
    async with hog(arena, _FSIZE) as worker:
        before = await call(worker, "pid")
        observation = await call(worker, "write_bytes", name="big", size=2 * MB)
        after = await call(worker, "pid")
    assert observation.is_error
    assert "File too large" in observation.content
    assert f"file size limit is {MB} bytes" in observation.content
    assert before.content == after.content  # no SIGXFSZ: the same process answered
    assert (arena.workspace / "big").stat().st_size <= MB
    arena.assert_nothing_seen([observation.content])


async def test_a_child_writing_past_the_size_limit_is_stopped(arena: Arena) -> None:
    async with hog(arena, _FSIZE) as worker:
        before = await call(worker, "pid")
        observation = await call(worker, "child_writes", name="big", size=2 * MB)
        after = await call(worker, "pid")
    # SIGXFSZ (25) when the child restored its default action, EFBIG otherwise.
    assert observation.content in ("returncode -25", "returncode 1"), observation
    assert before.content == after.content
    assert (arena.workspace / "big").stat().st_size <= MB
    arena.assert_nothing_seen([observation.content])


async def test_a_file_past_the_size_limit_in_an_attempt_is_refused(arena: Arena) -> None:
    code = "open('big', 'wb').write(b'x' * (2 << 20))\nresult = os.path.getsize('big')"
    result = await arena.attack(code, policy=Policy(limits=Limits(file_size_bytes=MB)))
    assert result == "denied: EFBIG", result
    arena.assert_refused(result)


# -- CPU ---------------------------------------------------------------------------------


@pytest.mark.parametrize("in_child", [False, True], ids=["worker", "child"])
async def test_a_spin_past_the_deadline_kills_the_worker(arena: Arena, in_child: bool) -> None:
    policy = Policy(subprocess=True)
    async with hog(arena, policy) as worker:
        first = worker.pid
        # The spin never ends by itself: only the 1 s deadline's kill answers the call
        # (a hang guard, not a measurement).
        with trio.fail_after(120):
            observation = await while_responsive(
                arena, lambda: call(worker, "spin", in_child=in_child)
            )
        assert observation.is_error and "timeout" in observation.content.lower(), observation
        assert first is not None
        await wait_gone(first)
        again = await call(worker, "pid")  # restarted for the next call
        assert again.content != str(first)
    arena.assert_nothing_seen([observation.content])


# -- the log -----------------------------------------------------------------------------

_FORGERIES = [
    "ok\n2025-01-01 12:00:00 INFO kernel.server: client authenticated",
    "ok\r2025-01-01 12:00:00 INFO kernel.server: overwritten",
    "\x1b[2K\x1b[1Ghidden\x1b]0;title\x07",
    "\x9b31mC1 control sequence\x85next line",
    "nul\x00 del\x7f backspace\x08 vertical\x0b",
    "separator\u2028next line\u202eRTL override",
]


@pytest.mark.parametrize("text", _FORGERIES, ids=["lf", "cr", "ansi", "c1", "c0-del", "unicode"])
@pytest.mark.parametrize("channel", ["log", "stderr"])
async def test_worker_text_cannot_forge_log_lines(
    arena: Arena, caplog: pytest.LogCaptureFixture, text: str, channel: str
) -> None:
    caplog.set_level(logging.DEBUG)
    async with hog(arena, Policy()) as worker:
        if channel == "log":
            observation = await call(worker, "log", text=text)
        else:
            observation = await call(worker, "emit", text=text, stream="stderr")
    assert not observation.is_error, observation
    if channel == "log":
        [record] = [r for r in caplog.records if r.name == "tak.plugin.hog"]  # one record
        assert "\\" in record.getMessage()  # the control characters are there, escaped
    else:
        lines = [r.getMessage() for r in caplog.records if r.name == "sandbox.worker"]
        assert lines, "nothing was logged"
        for line in lines:  # a line of stderr: one record, under the worker's prefix
            assert line.startswith("[hog pid "), line
    arena.assert_nothing_seen()


async def test_a_huge_log_line_is_cut(arena: Arena, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    async with hog(arena, Policy()) as worker:
        await call(worker, "log", text="\x1b" * 100_000)
    [record] = [r for r in caplog.records if r.name == "tak.plugin.hog"]
    assert len(record.getMessage()) < 9000
    arena.assert_nothing_seen()


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


# A stdout flood was once logged line by line, unbounded, on the Trio thread: each worker
# has a log budget (LogBudget: 1 000 lines at once, then 100 lines and 100 KiB a second);
# what is past it is dropped, counted, and said once.


_FLOOD_LINES = 100_000


_FLOOD = f"os.write(1, b'x\\n' * {_FLOOD_LINES})\nresult = 'flooded'"


class _Counter(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.count = 0

    def emit(self, record: logging.LogRecord) -> None:
        self.count += 1


@contextmanager
def _info_logging(arena: Arena) -> Iterator[_Counter]:
    """Log at INFO as ``tak serve`` does, counting records instead of keeping them."""
    root = logging.getLogger()
    counter = _Counter()
    level, kept = root.level, arena._log.level
    root.setLevel(logging.INFO)
    arena._log.setLevel(logging.WARNING)  # the arena keeps every record it sees
    root.addHandler(counter)
    try:
        yield counter
    finally:
        root.removeHandler(counter)
        root.setLevel(level)
        arena._log.setLevel(kept)


async def test_a_stdout_flood_is_not_logged_line_by_line(arena: Arena) -> None:
    with _info_logging(arena) as counter:
        result = await arena.attack(_FLOOD)
    assert result == "ALLOWED: 'flooded'", result
    assert counter.count <= 10_000, f"the kernel logged {counter.count} lines for one call"
    arena.assert_nothing_seen([result])


FLOODS = {
    "stderr": f"os.write(2, b'x\\n' * {_FLOOD_LINES})",
    "log_records": (
        "from kernel.plugin import context\nlog = context().logger\n"
        "for i in range(20_000):\n    log.warning('x %d', i)"
    ),
    "long_lines": "for _ in range(200):\n    os.write(1, b'y' * 50_000 + b'\\n')",
    # The worker is never blocked on a full pipe: dropped lines are read all the same.
    "eight_mib": "os.write(1, b'z\\n' * (4 * 1024 * 1024))",
}


@pytest.mark.parametrize("name", list(FLOODS))
async def test_every_flood_is_held_to_the_log_budget(arena: Arena, name: str) -> None:
    code = FLOODS[name] + "\nresult = 'flooded'"
    with _info_logging(arena) as counter:
        result = await arena.attack(code)
    # Finished (a worker blocked on a full pipe would have met its deadline), and the
    # kernel's work for it is bounded: counted in lines logged, not timed.
    assert result == "ALLOWED: 'flooded'", result
    assert counter.count <= 1_500, f"the kernel logged {counter.count} lines for one call"
    dropped = [r for r in arena._log.records if "lines dropped" in r.getMessage()]
    assert dropped, "no record says that lines were dropped"
    arena.assert_nothing_seen([result])


# -- leftovers ---------------------------------------------------------------------------


@pytest.mark.parametrize("how", ["plain", "new_session", "double_fork"])
async def test_a_background_program_ends_with_its_worker(arena: Arena, how: str) -> None:
    async with hog(arena, Policy(subprocess=True)) as worker:
        observation = await call(worker, "leave_behind", how=how)
        assert not observation.is_error, observation
        pid = int(observation.content)
        dirs = cgroup_dirs_of(pid)
    await wait_gone(pid)
    assert dirs_removed(dirs), dirs
    arena.assert_nothing_seen()


async def test_kit_memory_cgroup_is_per_worker(arena: Arena) -> None:
    # Not an attempt: each worker is in a cgroup set of its own, removed with it.
    _needs_memory_cgroup()
    async with hog(arena, Policy()) as worker:
        pid = worker.pid
        assert pid is not None
        dirs = cgroup_dirs_of(pid)
        assert dirs and not dirs_removed(dirs)
    assert dirs_removed(dirs)


def _home(arena: Arena) -> TakHome:
    return TakHome(arena.root / "home").ensure()


async def test_a_host_without_workers_primes_no_process(arena: Arena) -> None:
    async with open_plugin_host(arena.workspace, plugins=["fs"], home=_home(arena)) as host:
        host.prime()
        await trio.sleep(0.2)
        assert not host.pool._processes and not host.pool._spare_coming
