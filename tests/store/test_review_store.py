"""Review of issue 11: the FileStore next to careless processes and crashes, the
HistoryCache across processes, and PostgresStore under cancellation and a killed server.

Each ``xfail(strict=True)`` is a hole found in review (its reason: the repro and a
suggested fix); the other tests are attacks that held.
"""

from __future__ import annotations

import functools
import os
import random
import signal
import subprocess
import sys
import textwrap
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import trio

from kernel.errors import StoreError
from kernel.history import history_from_entries, messages_from_entries
from kernel.messages import Message, Text
from kernel.session import Session
from kernel.store import FileStore, PostgresStore, SessionKey
from kernel.store._entries import encode_entries
from tests.store import pg_server

from .test_multiprocess import TAK, acks_of, start_writer

KEY = SessionKey("p", "s0")
REPO = str(Path(__file__).parents[2])
ENV = dict(os.environ, PYTHONPATH=REPO)


def transcript(root: Path) -> Path:
    return root / "p" / "s0" / "transcript.jsonl"


def e(n: int, **extra: Any) -> dict[str, Any]:
    return {"type": "t", "uuid": f"u{n}", "n": n, **extra}


def run_py(code: str, *args: str, timeout: float = 20) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=ENV,
    )


# -- the turnstile `#lock` in the hands of a careless process -------------------------


def test_a_fifo_turnstile_does_not_hang_a_writer(tmp_path: Path) -> None:
    async def first() -> None:
        async with FileStore(tmp_path) as store:
            await store.append(KEY, [e(0)])

    trio.run(first)
    lock = transcript(tmp_path).parent / "#lock"
    lock.unlink(missing_ok=True)
    os.mkfifo(lock)
    code = """
        import sys, trio
        from kernel.store import FileStore, SessionKey
        async def main():
            async with FileStore(sys.argv[1]) as store:
                await store.append(SessionKey("p", "s0"), [{"type": "t", "uuid": "u1"}])
            print("ok")
        trio.run(main)
    """
    try:
        done = run_py(code, str(tmp_path), timeout=4)
    except subprocess.TimeoutExpired:
        pytest.fail("the append hung on the FIFO at #lock")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ok"


async def test_a_symlinked_or_deleted_turnstile_is_harmless(tmp_path: Path) -> None:
    """A link at #lock is not followed (nothing is created where it points); a deleted
    #lock is made again; appends go on either way."""
    async with FileStore(tmp_path) as store:
        await store.append(KEY, [e(0)])
    lock = transcript(tmp_path).parent / "#lock"
    outside = tmp_path / "outside"
    lock.unlink(missing_ok=True)
    lock.symlink_to(outside)  # dangling: O_CREAT would create it if followed
    async with FileStore(tmp_path) as store:
        with trio.fail_after(5):
            await store.append(KEY, [e(1)])
        assert not outside.exists()
        lock.unlink()
        await trio.sleep(0.01)  # the lease ends
        with trio.fail_after(5):
            await store.append(KEY, [e(2)])
    async with FileStore(tmp_path) as store:
        assert [x["n"] for x in await store.load(KEY) or []] == [0, 1, 2]


# -- a lock holder killed with a torn tail -------------------------------------------

HOLDER = """
    import fcntl, os, sys, time
    sdir = sys.argv[1]
    dfd = os.open(sdir, os.O_RDONLY | os.O_DIRECTORY)
    fcntl.flock(dfd, fcntl.LOCK_EX)
    fd = os.open(os.path.join(sdir, "transcript.jsonl"), os.O_WRONLY | os.O_APPEND)
    os.write(fd, b' {"type":"t","uuid":"half-1"}\\n{"type":"t","uu')  # an append cut short
    print("ready", flush=True)
    time.sleep(60)
"""


async def test_a_killed_lock_holder_blocks_nobody_and_only_a_holder_cuts(tmp_path: Path) -> None:
    """While a (stopped) process holds the lock, readers and summary rebuilds read whole
    appends and cut nothing, `rm` refuses naming it; once it is SIGKILLed the next
    writer proceeds, cuts its torn tail and glues nothing to it."""
    root = tmp_path / "data" / "sessions"
    async with FileStore(root) as store:
        await store.append(KEY, [e(0), e(1)])
    size = transcript(root).stat().st_size
    holder = subprocess.Popen(  # noqa: ASYNC220
        [sys.executable, "-c", textwrap.dedent(HOLDER), str(transcript(root).parent)],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "ready"
        torn = transcript(root).stat().st_size
        assert torn > size
        async with FileStore(root) as reader:
            assert [x["n"] for x in await reader.load(KEY) or []] == [0, 1]
            assert [x["n"] async for x in reader.iter_entries(KEY, start=1)] == [1]
            (summary,) = await reader.list_session_summaries("p")  # stale: rebuilt
            assert summary.data.entry_count == 2
        assert transcript(root).stat().st_size == torn, "a reader cut a holder's file"
        rm = await trio.run_process(
            [
                TAK,
                "--home",
                str(tmp_path),
                "sessions",
                "rm",
                "s0",
                "--project",
                "p",
                "--wait",
                "0.3",
            ],
            capture_stdout=True,
            capture_stderr=True,
            check=False,
        )
        assert rm.returncode == 1
        assert f"pid {holder.pid}" in rm.stderr.decode()
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    async with FileStore(root) as store:
        with trio.fail_after(5):
            await store.append(KEY, [e(2)])
    data = transcript(root).read_bytes()
    assert data.endswith(b'"n":2}\n') and b"half-1" not in data
    async with FileStore(root) as store:
        assert [x["n"] for x in await store.load(KEY) or []] == [0, 1, 2]


# -- rm and repair racing a writer between its stat and its write ---------------------


async def test_rm_and_repair_wait_for_a_writer_between_stat_and_write(tmp_path: Path) -> None:
    root = tmp_path / "data" / "sessions"
    base = ["--home", str(tmp_path), "sessions"]
    async with FileStore(root) as store:
        await store.append(KEY, [e(0)])
        await trio.sleep(0.01)
        original = store._write
        seen: list[subprocess.CompletedProcess[str]] = []

        async def write(*args: Any) -> None:
            # The stat is done, the flock held: other processes run now, blocking us.
            for cmd in ("rm", "repair"):
                seen.append(
                    subprocess.run(  # noqa: ASYNC221 (deliberately blocking, flock held)
                        [TAK, *base, cmd, "s0", "--project", "p", "--wait", "0.3"],
                        capture_output=True,
                        text=True,
                        timeout=30,
                        env=ENV,
                    )
                )
            await original(*args)

        store._write = write  # type: ignore[method-assign,assignment]
        await store.append(KEY, [e(1)])
        store._write = original  # type: ignore[method-assign]
        for done in seen:
            assert done.returncode == 1, done.stdout + done.stderr
            assert f"in use by pid {os.getpid()}" in done.stderr
        assert [x["n"] for x in await store.load(KEY) or []] == [0, 1]
        await trio.sleep(0.01)  # the lease ends
        rm = await trio.run_process(
            [TAK, *base, "rm", "s0", "--project", "p"], capture_stdout=True, check=False
        )
        assert rm.returncode == 0
        await store.append(KEY, [e(2)])  # the writer starts a new session, not the old file
        assert [x["n"] for x in await store.load(KEY) or []] == [2]
    assert not [n for n in os.listdir(root / "p") if n.startswith("#")]


async def test_a_session_directory_renamed_under_a_writer(tmp_path: Path) -> None:
    """A careless `mv p/s0 p/s9` while a writer holds the transcript open: the writer's
    next append starts a new p/s0 and nothing more goes into the moved directory."""
    async with FileStore(tmp_path) as store:
        await store.append(KEY, [e(0)])
        await trio.sleep(0.01)
        os.rename(tmp_path / "p" / "s0", tmp_path / "p" / "s9")
        await store.append(KEY, [e(1)])
        await store.append(SessionKey("p", "s9"), [e(2)])
        assert [x["n"] for x in await store.load(KEY) or []] == [1]
        assert [x["n"] for x in await store.load(SessionKey("p", "s9")) or []] == [0, 2]


# -- readers racing writers ----------------------------------------------------------


async def test_a_reader_never_glues_a_torn_tail_to_the_next_append(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with FileStore(tmp_path) as store:
        await store.append(KEY, [e(0)])
    path = transcript(tmp_path)
    good = path.read_bytes()
    torn = b'{"type":"ghost","note":"' + b"y" * 30  # a writer killed mid-line
    with open(path, "ab") as f:  # noqa: ASYNC230
        f.write(torn)
    new_line = b'{"type":"t","uuid":"u1","n":1,"pad":"' + b"x" * 300 + b'"}\n'
    real_pread = os.pread
    done: list[int] = []

    def pread(fd: int, n: int, offset: int) -> bytes:
        if offset == len(good) + len(torn) and not done:
            done.append(1)  # meanwhile, the next lock holder cuts the tail and appends
            w = os.open(path, os.O_WRONLY | os.O_APPEND)
            try:
                os.ftruncate(w, len(good))
                os.write(w, new_line)
            finally:
                os.close(w)
        return real_pread(fd, n, offset)

    monkeypatch.setattr(os, "pread", pread)
    async with FileStore(tmp_path) as store:
        loaded = await store.load(KEY) or []
    assert done
    assert [x["type"] for x in loaded] in (["t"], ["t", "t"]), loaded


def sized(n: int, length: int) -> dict[str, Any]:
    """Entry ``n`` padded so that its line is ``length`` bytes."""
    bare = len(encode_entries([e(n, pad="")])[0][2])
    return e(n, pad="b" * (length - bare))


async def test_iter_entries_start_after_delete_and_rewrite_with_a_reused_inode(
    tmp_path: Path,
) -> None:
    async with FileStore(tmp_path) as a, FileStore(tmp_path) as b:
        for _attempt in range(20):
            await b.delete(KEY)
            await b.append(KEY, [e(i, pad="a" * 100) for i in range(3)])
            await trio.sleep(0.01)
            assert len([x async for x in a.iter_entries(KEY)]) == 3  # A remembers the end
            old = transcript(tmp_path).stat().st_ino
            transcript_lines = transcript(tmp_path).read_bytes().splitlines(keepends=True)
            await b.delete(KEY)  # closes B's descriptor: the inode is free
            # New entries, the 2nd one ending where the old 3rd did: A's stale position
            # (3 entries, that offset) falls on a line end of the new file.
            old_lens = [len(x) for x in transcript_lines]
            lines = [sized(10, old_lens[0] + old_lens[1]), sized(11, old_lens[2])]
            lines += [e(12 + i) for i in range(3)]
            await b.append(KEY, lines[:1])
            await b.append(KEY, lines[1:2])
            await b.append(KEY, lines[2:])
            await trio.sleep(0.01)
            if transcript(tmp_path).stat().st_ino == old:
                break
        else:
            pytest.skip("the file system did not reuse the inode")
        got = [x["n"] async for x in a.iter_entries(KEY, start=3)]
        assert got == [x["n"] for x in (await a.load(KEY) or [])[3:]]


async def test_readers_see_every_acknowledged_append_and_start_agrees_with_load(
    tmp_path: Path,
) -> None:
    """A writer process of mixed big/small appends; another process (this one) loads
    after each acknowledgement it has read: every acknowledged batch is there, whole,
    and iter_entries(start=n) lies between the loads before and after it."""
    writer = start_writer(tmp_path, "a", 1, 400, "--big", "4")
    rng = random.Random(7)
    checks = 0
    try:
        async with FileStore(tmp_path) as store:
            while writer.proc.poll() is None or checks < 5:
                acked = {seq for _, _, seq in acks_of(bytes(writer.out))}
                before = await store.load(KEY) or []
                seqs = Counter(x["seq"] for x in before)
                assert acked <= set(seqs), f"acknowledged but not loaded: {acked - set(seqs)}"
                assert all(c == 1 + s % 3 for s, c in seqs.items()), "half an append read"
                n = rng.randrange(len(before) + 1)
                middle = [x async for x in store.iter_entries(KEY, start=n)]
                after = await store.load(KEY) or []
                assert middle[: len(before) - n] == before[n:]
                assert after[n : n + len(middle)] == middle
                checks += 1
    finally:
        writer.finish()
    assert checks > 5


def test_two_writers_with_big_appends_and_deletes_from_a_third(tmp_path: Path) -> None:
    """Two writer processes (big and small appends) on one session while a third deletes
    it four times, then both are SIGKILLed: what was acknowledged after the last delete is all there, what was
    acknowledged before the first is gone, nothing is half stored or stored twice, and
    no `#` leftovers remain."""
    procs = {w: start_writer(tmp_path, w, 1, 0, "--big", "7") for w in "ab"}
    for p in procs.values():
        p.wait_for_first_ack()
    spans: list[tuple[float, float]] = []

    async def deleter() -> None:
        async with FileStore(tmp_path) as store:
            for _ in range(4):
                await trio.sleep(0.08)
                t0 = time.monotonic()
                with trio.fail_after(20):
                    await store.delete(KEY)
                spans.append((t0, time.monotonic()))
            await trio.sleep(0.2)

    try:
        trio.run(deleter)
    finally:
        acked = {w: p.kill() for w, p in procs.items()}

    async def load() -> list[dict[str, Any]]:
        async with FileStore(tmp_path) as store:
            return await store.load(KEY) or []

    entries = trio.run(load)
    assert len(spans) == 4
    uuids = Counter(x["uuid"] for x in entries)
    assert not [u for u, c in uuids.items() if c > 1]
    for (w, seq, size), c in Counter((x["writer"], x["seq"], x["size"]) for x in entries).items():
        assert c == size, f"{w}/{seq} half stored"
    for w in "ab":
        seqs = [x["seq"] for x in entries if x["writer"] == w]
        assert seqs == sorted(seqs), f"{w}'s entries out of order"
    present = {(x["writer"], x["seq"]) for x in entries}
    last_end, first_start = spans[-1][1], spans[0][0]
    for w, acks in acked.items():
        assert [t for t, _, _ in acks if t > last_end]
        for t, _, seq in acks:
            if t > last_end:
                assert (w, seq) in present, f"{w}/{seq} acknowledged after the last rm, lost"
            if t < first_start:
                assert (w, seq) not in present, f"{w}/{seq} survived every rm"
    assert not [n for n in os.listdir(tmp_path / "p") if n.startswith("#")]


# -- the HistoryCache across processes -----------------------------------------------


def msg(text: str) -> Message:
    return Message("user", [Text(text)])


async def fresh(root: Path) -> list[dict[str, Any]]:
    async with FileStore(root) as store:
        return await store.load(KEY) or []


async def test_history_cache_follows_another_process(tmp_path: Path) -> None:
    """Process A caches; B appends, compacts, deletes and writes again (a different
    count): A's messages() and history() equal a fresh read each time."""
    async with FileStore(tmp_path) as sa, FileStore(tmp_path) as sb:
        a, b = Session(sa, KEY), Session(sb, KEY)

        async def same() -> None:
            entries = await fresh(tmp_path)
            assert await a.messages() == messages_from_entries(entries)
            assert await a.history() == history_from_entries(entries)

        await a.append(msg("a1"), msg("a2"))
        await same()
        await b.append(msg("b1"))
        await a.append(msg("a3"))  # lands after B's: A's cache must notice
        await same()
        through = (await fresh(tmp_path))[-1]["uuid"]
        await b.append_entries([{"type": "compaction", "uuid": "c1", "through": through,
                                 "summary": "so far"}])  # fmt: skip
        await b.append(msg("b2"))
        await same()
        await a.append(msg("a4"))
        await same()
        await sb.delete(KEY)
        await b.append(msg("b3"))
        await same()
        await sb.delete(KEY)
        await a.append(msg("a5"))
        await same()


async def test_history_cache_after_another_process_rewrites_the_same_count(
    tmp_path: Path,
) -> None:
    async with FileStore(tmp_path) as sa, FileStore(tmp_path) as sb:
        a, b = Session(sa, KEY), Session(sb, KEY)
        await a.append(msg("old question"), msg("old detail"))
        assert len(await a.messages()) == 2
        await sb.delete(KEY)
        await b.append(msg("new question"), msg("new detail"))
        await a.append(msg("reply"))
        assert await a.messages() == messages_from_entries(await fresh(tmp_path))


# -- PostgresStore -------------------------------------------------------------------


async def test_pg_cancelled_appends_store_all_or_nothing_and_free_the_connection(
    db_url: str,
) -> None:
    """Appends cancelled at random moments: one that raised Cancelled stored nothing,
    one that returned stored all; the only connection is free again each time."""
    rng = random.Random(3)
    async with PostgresStore(db_url, max_connections=1) as store:
        await store.list_sessions("p")
        # Deadlines around what one append takes on this machine now (a loaded CI
        # runner is slower), so that some appends finish and some are cancelled.
        started = trio.current_time()
        warm = [e(-1000 - j, b=-1, pad="z" * 4000) for j in range(200)]
        await store.append(SessionKey("p", "warm"), warm)
        full = trio.current_time() - started
        outcomes: dict[int, bool] = {}
        for n in range(40):
            batch = [e(n * 1000 + j, b=n, pad="z" * 4000) for j in range(200)]
            returned = False
            with trio.move_on_after(rng.uniform(0, 2 * full)):
                await store.append(KEY, batch)
                returned = True
            outcomes[n] = returned
        with trio.fail_after(5):
            await store.append(KEY, [e(-1)])
        stored = Counter(x.get("b") for x in await store.load(KEY) or [])
        for n, returned in outcomes.items():
            assert stored.get(n, 0) == (200 if returned else 0), (n, returned, stored.get(n))
        assert 0 < sum(outcomes.values()) < len(outcomes)  # both kinds happened
        rows = await store.run_in_thread(
            lambda c: c.execute(
                "SELECT count(*) FROM pg_stat_activity WHERE state LIKE 'idle in transaction%'"
            ).fetchall()
        )
        assert rows == [(0,)]


SAME_UUIDS = """
import sys, trio
from kernel.store import PostgresStore, SessionKey
async def main():
    async with PostgresStore(sys.argv[1], max_connections=2) as store:
        key = SessionKey("p", "s0")
        async def task(t):
            for n in range(t, 300, 2):
                await store.append(key, [{"type": "t", "uuid": f"u-{n}-{j}", "n": n}
                                         for j in range(1 + n % 3)])
        async with trio.open_nursery() as nursery:
            for t in range(2):
                nursery.start_soon(task, t)
trio.run(main)
"""


async def test_pg_same_uuids_from_two_processes_at_once_are_stored_once(db_url: str) -> None:
    """Two processes append the same uuids to a session that does not exist yet (both
    create its row): no error, every entry once, in seq order without gaps."""
    async with trio.open_nursery() as nursery:
        for _ in range(2):
            nursery.start_soon(
                functools.partial(
                    trio.run_process, [sys.executable, "-c", SAME_UUIDS, db_url], env=ENV
                )
            )
    async with PostgresStore(db_url) as store:
        entries = await store.load(KEY) or []
        (summary,) = await store.list_session_summaries("p")
    uuids = Counter(x["uuid"] for x in entries)
    assert len(uuids) == sum(1 + n % 3 for n in range(300))
    assert max(uuids.values()) == 1
    assert summary.data.entry_count == len(entries)


async def test_pg_iter_entries_start_agrees_with_load_under_concurrent_appends(
    db_url: str,
) -> None:
    """Pages of iter_entries(start=n) (500 rows a query) while two tasks append: what it
    returns lies between a load before and a load after."""
    async with PostgresStore(db_url, max_connections=4) as store:
        await store.append(KEY, [e(i) for i in range(1200)])
        stop = trio.Event()

        async def appender(t: int) -> None:
            i = 0
            while not stop.is_set():
                await store.append(KEY, [e(10_000 * (t + 1) + i + j) for j in range(3)])
                i += 3

        async with trio.open_nursery() as nursery:
            nursery.start_soon(appender, 0)
            nursery.start_soon(appender, 1)
            for n in (0, 1, 499, 500, 1000, 1199):
                before = await store.load(KEY) or []
                middle = [x async for x in store.iter_entries(KEY, start=n)]
                after = await store.load(KEY) or []
                assert middle[: len(before) - n] == before[n:]
                assert after[n : n + len(middle)] == middle
            stop.set()


@pytest.fixture
def own_server(pg_to_break: pg_server.PgServer) -> pg_server.PgServer:
    """A server other tests do not use, to kill (running again after the test)."""
    return pg_to_break


async def test_pg_killed_server_mid_append_is_a_store_error_and_loses_nothing(
    own_server: pg_server.PgServer,
) -> None:
    """Appends running when the server is killed (-m immediate): a StoreError, not a hang
    or an acknowledgement; after a restart every acknowledged batch is there, whole, and
    the same store works again."""
    url = own_server.url()
    acked: list[int] = []
    errors: list[str] = []
    async with PostgresStore(url, max_connections=2) as store:
        await store.append(KEY, [e(-1)])

        async def writer(t: int) -> None:
            n = t
            while True:
                try:
                    await store.append(KEY, [e(n * 10 + j, b=n) for j in range(3)])
                except StoreError as exc:
                    errors.append(str(exc))
                    return
                acked.append(n)
                n += 2

        with trio.fail_after(15):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(writer, 0)
                nursery.start_soon(writer, 1)
                await trio.sleep(0.3)
                await trio.to_thread.run_sync(pg_server.stop, own_server, "immediate")
        assert len(errors) == 2 and all(x.startswith("PostgreSQL 127.0.0.1:") for x in errors)
        await trio.to_thread.run_sync(pg_server.start, own_server)
        with trio.fail_after(20):
            while True:  # the pool reconnects in the background
                try:
                    await store.append(KEY, [e(-2)])
                    break
                except StoreError:
                    await trio.sleep(0.2)
        stored = Counter(x["b"] for x in await store.load(KEY) or [] if "b" in x)
    assert acked
    for n in acked:
        assert stored[n] == 3, f"batch {n} acknowledged, then lost"
    assert all(c == 3 for c in stored.values())


def test_pg_cancel_is_prompt_while_the_server_is_down(own_server: pg_server.PgServer) -> None:
    # In a child process: the wait is not interruptible, the test must not sit it out.
    child = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(CANCEL_WHILE_DOWN), own_server.url()],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=ENV,
    )
    try:
        assert child.stdin is not None and child.stdout is not None
        assert child.stdout.readline().strip() == "appended"
        pg_server.stop(own_server, "immediate")
        child.stdin.write("go\n")
        child.stdin.flush()
        try:
            out, _ = child.communicate(timeout=6)
        except subprocess.TimeoutExpired:
            pytest.fail("an append cancelled after 1 s had not returned after 6 s")
        assert child.returncode == 0 and out.strip() == "prompt", out
    finally:
        child.kill()
        child.wait()


CANCEL_WHILE_DOWN = """
    import sys, time, trio
    from kernel.errors import StoreError
    from kernel.store import PostgresStore, SessionKey
    key = SessionKey("p", "s0")
    async def main():
        async with PostgresStore(sys.argv[1], max_connections=1) as store:
            await store.append(key, [{"type": "t", "uuid": "u0"}])
            print("appended", flush=True)
            await trio.to_thread.run_sync(sys.stdin.readline)  # the server is killed
            try:
                await store.append(key, [{"type": "t", "uuid": "u1"}])
            except StoreError:
                pass  # the broken connection: an error at once
            t0 = time.monotonic()
            with trio.move_on_after(1):
                await store.append(key, [{"type": "t", "uuid": "u2"}])
            print("prompt" if time.monotonic() - t0 < 3 else "slow", flush=True)
    trio.run(main)
"""
