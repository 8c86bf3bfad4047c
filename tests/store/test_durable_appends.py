"""Durable appends (``durability="fsync"``): the group commit, the session hold that
lingers between a writer's appends, and the OFD-locked turnstile (``#lock``) kept open,
next to a careless second process, under cancellation, with a failing fsync, and in an
append loop that never yields.

Another process waiting for its turn gets it, whatever is put at the turnstile; empty
and duplicate appends still yield; a cancelled append is all or nothing and leaves no
hold; a hold ends when the store closes or the session goes; a failed round cuts every
session back and loses nothing acknowledged; descriptors do not leak. Flush mode is the
control where the two differ.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import struct
import subprocess
import sys
import textwrap
import threading
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing

from kernel.errors import StoreError
from kernel.store import FileStore, SessionKey
from kernel.store._locks import TURNSTILE

from .test_multiprocess import TAK, check, start_writer

KEY = SessionKey("p", "s0")
REPO = str(Path(__file__).parents[2])
ENV = dict(os.environ, PYTHONPATH=REPO)

# How long a process competing with a busy durable writer may wait for its turn.
# With the turnstile it gets it within milliseconds; without one (it races, as in
# flush mode) within a fraction of a second. Starved, it never does.
TURN_WAIT_S = 10.0


def e(n: int, **extra: Any) -> dict[str, Any]:
    return {"type": "t", "uuid": f"u{n}", "n": n, **extra}


def session_dir(root: Path, sid: str = "s0") -> Path:
    return root / "p" / sid


def nfds() -> int:
    return len(os.listdir("/proc/self/fd"))


def flock_is_free(directory: Path) -> bool:
    """Whether another open file description (as another process would) can take
    the session lock right now."""
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    finally:
        os.close(fd)  # releases it
    return True


def turnstile_is_free(directory: Path) -> bool:
    """Whether nobody holds a record lock on the session's turnstile."""
    fd = os.open(directory / TURNSTILE, os.O_RDWR)
    try:
        probe = struct.pack("hhqqi4x", fcntl.F_WRLCK, os.SEEK_SET, 0, 0, 0)
        got = fcntl.fcntl(fd, fcntl.F_OFD_GETLK, probe)
        return struct.unpack("hhqqi4x", got)[0] == fcntl.F_UNLCK
    finally:
        os.close(fd)


async def until(predicate: Callable[[], bool], step: float = 0.001) -> None:
    """Poll ``predicate``: it watches threads and other processes, no event to wait on."""
    while not predicate():  # noqa: ASYNC110
        await trio.sleep(step)


def uuid_counts(entries: Sequence[dict[str, Any]] | None) -> Counter[str]:
    return Counter(x["uuid"] for x in entries or [])


# -- a process waiting for its turn next to a busy durable writer ---------------------

COMPETITOR = """
    import sys, trio
    from kernel.store import FileStore, SessionKey
    async def main():
        async with FileStore(sys.argv[1]) as store:
            with trio.move_on_after(float(sys.argv[3])):
                await store.append(SessionKey("p", sys.argv[2]), [{"type": "t", "uuid": "other"}])
                print("ok", flush=True)
                return
            print("starved", flush=True)
    trio.run(main)
"""


async def competitor_gets_a_turn(root: Path, sid: str = "s0") -> bool:
    """Run another process appending one entry to session ``sid``: whether it got
    the session lock within ``TURN_WAIT_S``."""
    done = await trio.run_process(
        [sys.executable, "-c", textwrap.dedent(COMPETITOR), str(root), sid, str(TURN_WAIT_S)],
        capture_stdout=True,
        capture_stderr=True,
        env=ENV,
        check=False,
    )
    if done.returncode != 0:  # not what the test asserts: a broken test
        raise RuntimeError(done.stderr.decode())
    return done.stdout.decode().strip() == "ok"


async def busy_while(
    store: FileStore, keys: Sequence[SessionKey], root: Path, sid: str = "s0"
) -> tuple[bool, int]:
    """One task per key appending back to back (as a server's main loop and its
    subagents do) while another process asks for a turn on session ``sid``."""
    appended = 0

    async def writer(key: SessionKey, tag: str) -> None:
        nonlocal appended
        i = 0
        while True:
            await store.append(key, [{"type": "t", "uuid": f"{tag}-{i}"}])
            i += 1
            appended += 1

    async with trio.open_nursery() as nursery:
        for j, key in enumerate(keys):
            nursery.start_soon(writer, key, f"w{j}")
        await until(lambda: appended >= 50, 0.01)  # every writer is going
        got = await competitor_gets_a_turn(root, sid)
        nursery.cancel_scope.cancel()
    return got, appended


async def test_a_durable_writer_lets_another_process_take_its_turn(tmp_path: Path) -> None:
    """The baseline the commit's own tests cover: one task appending back to back in
    fsync mode; the waiter queues on the turnstile and the lingering hold gives way."""
    async with FileStore(tmp_path, durability="fsync") as store:
        got, _ = await busy_while(store, [KEY], tmp_path)
    assert got
    async with FileStore(tmp_path) as store:
        assert uuid_counts(await store.load(KEY))["other"] == 1


def test_two_tasks_of_one_session_do_not_starve_another_process(tmp_path: Path) -> None:
    async def main() -> bool:
        async with FileStore(tmp_path, durability="fsync") as store:
            got, _ = await busy_while(store, [KEY, KEY.child("subagents/a")], tmp_path)
        return got

    # (Sync tests, where xfails are: an AssertionError here is the bug; anything
    # else, e.g. a competitor that failed to start, fails the test.)
    assert trio.run(main), "another process never got the session lock"


async def test_two_durable_writers_on_two_sessions_do_not_block_a_third(tmp_path: Path) -> None:
    """Holds of different sessions are independent: overlapping writers of two
    sessions (one task each) still let another process into either."""
    async with FileStore(tmp_path, durability="fsync") as store:
        got, _ = await busy_while(store, [KEY, SessionKey("p", "s1")], tmp_path)
    assert got


@pytest.mark.parametrize("thing", ["dir", "fifo"])
def test_something_at_the_turnstile_does_not_starve_another_process(
    tmp_path: Path, thing: str
) -> None:
    """docs: 'Something put at #lock later only costs fairness: waiters then race'."""

    async def main() -> bool:
        async with FileStore(tmp_path) as store:
            await store.append(KEY, [e(0)])
        lock = session_dir(tmp_path) / TURNSTILE
        lock.unlink()
        if thing == "dir":
            lock.mkdir()
        else:
            os.mkfifo(lock)
        async with FileStore(tmp_path, durability="fsync") as store:
            got, _ = await busy_while(store, [KEY], tmp_path)
        return got

    assert trio.run(main), "another process never got the session lock"


async def test_something_at_the_turnstile_only_costs_fairness_in_flush_mode(
    tmp_path: Path,
) -> None:
    """The same attack in flush mode: the hold ends each scheduler turn and the
    waiter wins a race (this is what the fsync case should fall back to)."""
    async with FileStore(tmp_path) as store:
        await store.append(KEY, [e(0)])
    lock = session_dir(tmp_path) / TURNSTILE
    lock.unlink()
    lock.mkdir()
    async with FileStore(tmp_path) as store:
        got, _ = await busy_while(store, [KEY], tmp_path)
    assert got


def test_a_deleted_turnstile_does_not_starve_another_process(tmp_path: Path) -> None:
    async def main() -> bool:
        async with FileStore(tmp_path, durability="fsync") as store:
            await store.append(KEY, [e(0)])  # the session and its turnstile are open
            (session_dir(tmp_path) / TURNSTILE).unlink()  # a careless cleanup of '#*'
            got, _ = await busy_while(store, [KEY], tmp_path)
        return got

    assert trio.run(main), "another process never got the session lock"


LEASER = """
    import fcntl, os, sys
    fd = os.open(sys.argv[1], os.O_RDONLY)
    fcntl.fcntl(fd, fcntl.F_SETLEASE, fcntl.F_RDLCK)  # as an NFS/SMB server may
    print("ready", flush=True)
    sys.stdin.readline()
"""


def test_a_read_lease_on_the_turnstile_does_not_starve_another_process(
    tmp_path: Path,
) -> None:
    async def first() -> None:
        async with FileStore(tmp_path) as store:
            await store.append(KEY, [e(0)])

    trio.run(first)
    leaser = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(LEASER), str(session_dir(tmp_path) / TURNSTILE)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )

    async def main() -> bool:
        async with FileStore(tmp_path, durability="fsync") as store:
            await store.append(KEY, [e(1)])  # opens the session while the lease is held
            assert leaser.stdin is not None
            leaser.stdin.close()  # the lease ends at once
            got, _ = await busy_while(store, [KEY], tmp_path)
        return got

    try:
        ready = leaser.stdout is not None and leaser.stdout.readline().strip() == "ready"
        if not ready:
            raise RuntimeError("the leaser did not start")
        got = trio.run(main)
    finally:
        leaser.kill()
        leaser.wait()
    assert got, "another process never got the session lock"


def test_repair_and_rm_next_to_a_durable_writer_process(tmp_path: Path) -> None:
    """`tak sessions repair` three times next to a durable writer process: each
    gets its turn, and nothing the writer acknowledged is lost or doubled."""
    root = tmp_path / "data" / "sessions"
    writer = start_writer(root, "a", 1, 0, "--durability", "fsync", "--big", "15")
    try:
        writer.wait_for_first_ack()
        for _ in range(3):
            done = subprocess.run(
                [TAK, "--home", str(tmp_path), "sessions", "repair", "s0", "--project", "p"],
                capture_output=True,
                text=True,
                timeout=60,
                env=ENV,
            )
            assert done.returncode == 0, done.stderr
    finally:
        acks = writer.kill()
    assert acks
    check(root, 1, {"a": acks})


# -- empty and duplicate appends must still yield ----------------------------------


async def yields_within(store: FileStore, batch: list[dict[str, Any]], limit: int) -> int | None:
    """Append ``batch`` up to ``limit`` times back to back; after how many appends
    another task got to run (``None``: it never did)."""
    ran_at: int | None = None
    count = 0

    async def other() -> None:
        nonlocal ran_at
        ran_at = count

    async with trio.open_nursery() as nursery:
        nursery.start_soon(other)
        while count < limit and ran_at is None:
            await store.append(KEY, batch)
            count += 1
    return ran_at if ran_at is not None and ran_at < limit else None


async def test_duplicate_only_appends_in_fsync_mode_yield(tmp_path: Path) -> None:
    async with FileStore(tmp_path, durability="fsync") as store:
        await store.append(KEY, [e(0)])
        assert await yields_within(store, [e(0)], 10_000) is not None
        assert uuid_counts(await store.load(KEY)) == {"u0": 1}


async def test_empty_appends_in_flush_mode_yield(tmp_path: Path) -> None:
    """The control: a schedule point at least once a millisecond."""
    async with FileStore(tmp_path) as store:
        assert await yields_within(store, [], 300_000) is not None


def test_empty_appends_in_fsync_mode_yield(tmp_path: Path) -> None:
    async def main() -> int | None:
        async with FileStore(tmp_path, durability="fsync") as store:
            return await yields_within(store, [], 300_000)

    assert trio.run(main) is not None, "300,000 empty appends and no other task ran"


# -- cancellation --------------------------------------------------------------------


async def test_cancelled_durable_appends_are_all_or_nothing_and_leave_no_hold(
    tmp_path: Path,
) -> None:
    """A durable append cancelled after 0..24 scheduler turns (new sessions, open
    ones, evictions with max_open=2): re-appending the same uuid stores it exactly
    once, and then another description can take the session lock and the turnstile."""
    outcomes = Counter[str]()
    async with FileStore(tmp_path, durability="fsync", max_open=2) as store:
        for k in range(75):
            key = SessionKey("p", f"n{k}") if k % 3 == 0 else SessionKey("p", f"c{k % 4}")
            if k % 5 == 1:
                key = key.child("subagents/a")
            acked = False
            with trio.CancelScope() as scope:

                async def cancel_after(turns: int, scope: trio.CancelScope = scope) -> None:
                    for _ in range(turns):
                        await trio.lowlevel.cancel_shielded_checkpoint()
                    scope.cancel()

                async with trio.open_nursery() as nursery:
                    # Every tenth is left to finish (a loaded machine may need more
                    # than 24 turns for any append to get through its round).
                    if k % 10:
                        nursery.start_soon(cancel_after, k % 25)
                    await store.append(key, [e(k)])
                    acked = True
            outcomes["acked" if acked else "cancelled"] += 1
            await store.append(key, [e(k)])  # again, uncancelled: a duplicate if it got in
            assert uuid_counts(await store.load(key))[f"u{k}"] == 1, f"append {k}"
            assert len(store._locks) == 0 and store._opening == 0
            assert all(s.holders == 0 and s.waiters == 0 for s in store._sessions.values())
            await trio.sleep(0.002)  # the scheduler runs: holds end
            directory = session_dir(tmp_path, key.session_id)
            assert flock_is_free(directory), f"append {k}: the session lock is still held"
            assert turnstile_is_free(directory)
    assert outcomes["acked"] and outcomes["cancelled"], outcomes


HOLDER = """
    import fcntl, os, sys
    fd = os.open(sys.argv[1], os.O_RDONLY | os.O_DIRECTORY)
    fcntl.flock(fd, fcntl.LOCK_EX)
    print("ready", flush=True)
    sys.stdin.readline()
"""


async def test_a_cancelled_wait_for_another_process_leaves_no_hold(tmp_path: Path) -> None:
    """A durable append waiting (in a thread, queued on the turnstile) for another
    process is cancelled; once that process lets go, the abandoned thread's flock
    and turnstile lock are given back, and appends go on."""
    directory = session_dir(tmp_path)
    async with FileStore(tmp_path, durability="fsync") as store:
        await store.append(KEY, [e(0)])
        await trio.sleep(0.002)
        holder = subprocess.Popen(  # noqa: ASYNC220
            [sys.executable, "-c", textwrap.dedent(HOLDER), str(directory)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        try:
            assert holder.stdout is not None and holder.stdout.readline().strip() == "ready"
            (session,) = store._sessions.values()
            with trio.move_on_after(30) as scope:
                async with trio.open_nursery() as nursery:

                    async def cancel_when_waiting() -> None:
                        await until(lambda: session.waiters > 0)
                        await trio.sleep(0.05)  # queued on the turnstile, blocked in flock
                        nursery.cancel_scope.cancel()

                    nursery.start_soon(cancel_when_waiting)
                    await store.append(KEY, [e(1)])
                    pytest.fail("the append got the lock another process holds")
            assert not scope.cancelled_caught
            assert not turnstile_is_free(directory)  # the abandoned thread queues
            assert holder.stdin is not None
            holder.stdin.close()
            assert holder.wait(10) == 0
        finally:
            holder.kill()
            holder.wait()
        for _ in range(1000):  # the abandoned thread gets the lock, then closes it
            if flock_is_free(directory) and turnstile_is_free(directory):
                break
            await trio.sleep(0.01)
        else:
            pytest.fail("the cancelled waiter's thread kept the lock")
        with trio.fail_after(10):
            await store.append(KEY, [e(2)])
        assert [x["n"] for x in await store.load(KEY) or []] == [0, 2]


# -- a lingering hold when the store closes or the session goes ------------------------


async def test_aclose_ends_a_lingering_hold_and_closes_the_turnstile(tmp_path: Path) -> None:
    directory = session_dir(tmp_path)
    before = nfds()
    store = FileStore(tmp_path, durability="fsync")
    await store.append(KEY, [e(0)])
    await store.append(KEY, [e(1)])
    (session,) = store._sessions.values()
    assert session.holders == 0 and session._held_fd is not None  # lingering
    await store.aclose()
    assert flock_is_free(directory)
    assert nfds() == before
    await trio.sleep(0.002)  # the lease callback runs on a closed hold: harmless
    assert nfds() == before


async def test_delete_by_this_process_ends_a_lingering_hold(tmp_path: Path) -> None:
    async with FileStore(tmp_path, durability="fsync") as store:
        before = nfds()
        child = KEY.child("subagents/a")
        await store.append(KEY, [e(0)])
        await store.append(child, [e(1)])
        (session,) = store._sessions.values()
        assert session.holders == 0 and session._held_fd is not None  # lingering
        assert await store.delete(KEY)
        assert not store._sessions and nfds() == before
        await trio.sleep(0.002)
        assert nfds() == before
        await store.append(KEY, [e(2)])
        await store.append(child, [e(3)])  # the child opens into the new session
        assert [x["n"] for x in await store.load(KEY) or []] == [2]
        assert [x["n"] for x in await store.load(child) or []] == [3]
        await trio.sleep(0.002)
        assert flock_is_free(session_dir(tmp_path))


# -- fsync failure with several sessions in one round -----------------------------------


async def test_a_failed_round_of_several_sessions_cuts_all_back_and_loses_nothing_acked(
    tmp_path: Path,
) -> None:
    keys = [SessionKey("p", f"s{i}") for i in range(6)] + [SessionKey("p", "s0", "subagents/a")]
    async with FileStore(tmp_path, durability="fsync") as store:
        for i, key in enumerate(keys):
            await store.append(key, [e(100 + i)])  # acknowledged before the failure
        sizes = {k.name: os.stat(store._open[k.name].path).st_size for k in keys}
        gc = store.group_commit
        real_sync = gc._sync
        first_round = threading.Event()
        calls: list[int] = []

        def sync(fds: Sequence[int], devices: Sequence[int]) -> None:
            calls.append(len(fds))
            if len(calls) == 1:  # hold the first round until the others queue up
                assert first_round.wait(120)
                return real_sync(fds, devices)
            raise OSError(5, "Input/output error")

        gc._sync = sync
        results: dict[str, str] = {}

        async def one(key: SessionKey, n: int) -> None:
            try:
                await store.append(key, [e(n), e(n + 1000)])
                results[key.name] = "acked"
            except StoreError:
                results[key.name] = "failed"

        async with trio.open_nursery() as nursery:
            nursery.start_soon(one, keys[0], 0)
            await until(lambda: bool(calls))
            for i, key in enumerate(keys[1:], 1):
                nursery.start_soon(one, key, i)
            await until(lambda: len(gc._pending) == len(keys) - 1)
            first_round.set()
        assert calls == [1, len(keys) - 1]  # one round failed, with six files in it
        assert results[keys[0].name] == "acked"
        assert [results[k.name] for k in keys[1:]] == ["failed"] * (len(keys) - 1)
        for key in keys[1:]:
            size = os.stat(tmp_path / "p" / key.session_id / _rel(key)).st_size
            assert size == sizes[key.name], key
        gc._sync = real_sync
        await trio.sleep(0.002)
        for i, key in enumerate(keys):
            await store.append(key, [e(200 + i)])
        await trio.sleep(0.002)
        for key in keys:  # no hold left behind by the failed round
            assert flock_is_free(session_dir(tmp_path, key.session_id))
        for i, key in enumerate(keys):
            got = [x["n"] for x in await store.load(key) or []]
            want = [100 + i] + ([0, 1000] if i == 0 else []) + [200 + i]
            assert got == want, key
    async with FileStore(tmp_path) as store:  # and as another process sees it
        for i, key in enumerate(keys):
            assert next(x["n"] for x in await store.load(key) or []) == 100 + i


def _rel(key: SessionKey) -> str:
    return "transcript.jsonl" if key.subpath is None else f"sub/{key.subpath}.jsonl"


# -- descriptors ------------------------------------------------------------------------


async def test_turnstile_descriptors_do_not_leak(tmp_path: Path) -> None:
    """Many sessions through max_open=2 in fsync mode, first opens of a session by
    two tasks at once (one SessionFlock is thrown away), deletes among them: at most
    3 x max_open turnstiles open, none left after aclose."""
    before = nfds()
    peak = 0
    store = FileStore(tmp_path, durability="fsync", max_open=2)

    def turnstiles() -> int:
        n = 0
        for fd in os.listdir("/proc/self/fd"):
            with contextlib.suppress(OSError):
                n += os.readlink(f"/proc/self/fd/{fd}").endswith("/" + TURNSTILE)
        return n

    async def worker(w: int) -> None:
        nonlocal peak
        for r in range(3):
            for s in range(40):
                key = SessionKey("p", f"s{s}")
                if (s + w) % 2:
                    key = key.child(f"subagents/w{w}")
                await store.append(key, [{"type": "t", "uuid": f"{w}-{r}-{s}"}])
                peak = max(peak, turnstiles())
                if w == 0 and r == 1 and s % 7 == 0:
                    await store.delete(SessionKey("p", f"s{s}"))

    with trio.fail_after(600):
        async with trio.open_nursery() as nursery:
            for w in range(4):
                nursery.start_soon(worker, w)
    # Sessions with a transcript open or being opened (max_open), one thrown away
    # per opener, and the delete's: bounded by max_open, not by the 40 sessions.
    assert peak <= 3 * 2
    await store.aclose()
    assert nfds() == before


# -- the gather wait ----------------------------------------------------------------------


class _CountingCondition(threading.Condition):
    def __init__(self, lock: Any) -> None:
        super().__init__(lock)
        self.waits = 0
        self.timed_out = 0

    def wait_for(self, predicate: Any, timeout: float | None = None) -> Any:
        self.waits += 1
        got = super().wait_for(predicate, timeout)
        if not got:
            self.timed_out += 1
        return got


async def test_a_lone_writer_after_a_big_round_waits_for_the_others_once(
    tmp_path: Path,
) -> None:
    """A round of 15 sessions, then one writer alone for 100 appends: only its first
    round waits for the 14 that are not coming back."""
    async with FileStore(tmp_path, durability="fsync") as store:
        gc = store.group_commit
        counting = gc._more = _CountingCondition(gc._lock)
        real_sync = gc._sync
        go = threading.Event()
        entered = threading.Event()

        def sync(fds: Sequence[int], devices: Sequence[int]) -> None:
            if gc.rounds == 0:
                entered.set()  # the first round has its one file: hold it
                assert go.wait(120)
            real_sync(fds, devices)

        gc._sync = sync
        async with trio.open_nursery() as nursery:
            nursery.start_soon(store.append, SessionKey("p", "first"), [e(0)])
            await until(entered.is_set)
            for s in range(15):
                nursery.start_soon(store.append, SessionKey("p", f"s{s}"), [e(s)])
            await until(lambda: len(gc._pending) == 15)
            go.set()
        assert gc.rounds == 2 and gc._expect in (0, 15)
        waits_before = counting.timed_out
        for n in range(100):
            await store.append(KEY, [e(100 + n)])
        assert gc.rounds == 102
        assert counting.timed_out - waits_before <= 1, counting.timed_out - waits_before
