"""FileStore next to other processes: real OS processes, real files, real SIGKILL.

The guarantees (docs/store.md, "Many processes"), each test naming its own:

1. No acknowledged entry is lost or stored twice because of another process;
   per writer, entries are stored in the order their appends were acknowledged.
2. Readers (``tak sessions ls``, ``load``) never cut a file another process
   is writing.
3. An append acknowledged after ``tak sessions rm`` finished is in the new
   session, never in the deleted file.
4. uuid idempotence holds across processes.
5. A writer killed mid-append loses nothing it acknowledged; the torn tail it
   leaves is cut by the next lock holder, and nothing is glued to it.
"""

from __future__ import annotations

import itertools
import os
import random
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import trio

from kernel.store import FileStore, SessionKey
from kernel.store._entries import encode_entries

WRITER = str(Path(__file__).with_name("mp_writer.py"))
TAK = str(Path(sys.executable).with_name("tak"))
Ack = tuple[float, int, int]  # (monotonic time, session index, seq)


class Writer:
    """A writer process whose acknowledgements are read as they come (a full
    pipe would stall it)."""

    def __init__(self, root: Path, writer: str, sessions: int, count: int, *extra: str) -> None:
        env = dict(os.environ, PYTHONPATH=str(Path(__file__).parents[2]))
        self.proc = subprocess.Popen(
            [sys.executable, WRITER, str(root), writer, str(sessions), str(count), *extra],
            stdout=subprocess.PIPE,
            env=env,
        )
        self.out = bytearray()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        while chunk := self.proc.stdout.read1(1 << 16):
            self.out += chunk

    def wait_for_first_ack(self, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while b"\n" not in self.out:
            assert time.monotonic() < deadline and self.proc.poll() is None
            time.sleep(0.001)

    def finish(self, timeout: float = 120) -> list[Ack]:
        assert self.proc.wait(timeout) == 0, f"writer failed: {self.proc.returncode}"
        self._reader.join(timeout)
        return acks_of(bytes(self.out))

    def kill(self) -> list[Ack]:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(30)
        self._reader.join(30)
        return acks_of(bytes(self.out))


start_writer = Writer


def soon() -> str:
    """A start time for writers started together (their imports take ~0.3 s)."""
    return str(time.monotonic() + 1.0)


def acks_of(out: bytes) -> list[Ack]:
    """The acknowledgements a writer printed; a line without its newline is none."""
    acks = []
    for line in out.split(b"\n")[:-1]:
        t, n, seq = line.split()
        acks.append((float(t), int(n), int(seq)))
    return acks


def load_all(root: Path, sessions: int) -> list[list[dict[str, Any]]]:
    async def main() -> list[list[dict[str, Any]]]:
        async with FileStore(root) as store:
            return [await store.load(SessionKey("p", f"s{n}")) or [] for n in range(sessions)]

    return trio.run(main)


def check(
    root: Path, sessions: int, acked: dict[str, list[Ack]], *, shared_uuids: bool = False
) -> list[list[dict[str, Any]]]:
    """Guarantee 1 (and 4 with ``shared_uuids``) over what the writers acknowledged."""
    stored = load_all(root, sessions)
    present: set[tuple[str, int, int]] = set()  # (writer, session, seq)
    for n, entries in enumerate(stored):
        uuids = Counter(e["uuid"] for e in entries)
        assert not [u for u, c in uuids.items() if c > 1], f"s{n}: stored twice"
        batches = Counter((e["writer"], e["seq"], e["size"]) for e in entries)
        for (writer, seq, size), count in batches.items():
            assert shared_uuids or count == size, f"s{n}: batch {writer}/{seq} half stored"
            present.add(("*" if shared_uuids else writer, n, seq))
        for writer in acked:
            seqs = [e["seq"] for e in entries if e["writer"] == writer]
            assert seqs == sorted(seqs), f"s{n}: {writer}'s entries out of order"
    for writer, acks in acked.items():
        for _, n, seq in acks:
            found = ("*" if shared_uuids else writer, n, seq) in present
            assert found, f"{writer}'s acknowledged batch {seq} lost from s{n}"
    return stored


def test_two_writers_on_one_session(tmp_path: Path, stress: bool) -> None:
    """Guarantee 1, with multi-page appends among small ones."""
    count = 6000 if stress else 2000
    at = soon()
    procs = {
        w: start_writer(tmp_path, w, 1, count, "--big", "40", "--start-at", at, "--verify")
        for w in "ab"
    }
    acked = {w: p.finish() for w, p in procs.items()}
    assert all(len(a) == count for a in acked.values())
    (entries,) = check(tmp_path, 1, acked)
    assert len(entries) == 2 * sum(1 + seq % 3 for seq in range(count))


def test_two_durable_writers_on_one_session_take_turns(tmp_path: Path, stress: bool) -> None:
    """Guarantee 1 in fsync mode, where a writer's lock lingers from one append
    to its next: the other process still gets its turns, not only the end."""
    count = 1500 if stress else 300
    at = soon()
    procs = {
        w: start_writer(tmp_path, w, 1, count, "--durability", "fsync", "--start-at", at)
        for w in "ab"
    }
    acked = {w: p.finish() for w, p in procs.items()}
    (entries,) = check(tmp_path, 1, acked)
    assert len(entries) == 2 * sum(1 + seq % 3 for seq in range(count))
    writers = [e["writer"] for e in entries]
    turns = sum(1 for x, y in itertools.pairwise(writers) if x != y)
    # Each side was acknowledged while the other wrote: many turns, not one
    # writer's whole run and then the other's.
    assert turns >= 20, f"only {turns} turns between the writers"


def test_four_writers_one_session_and_a_hundred(tmp_path: Path, stress: bool) -> None:
    """Guarantee 1: 4 processes x 1 session, then 4 processes x 100 sessions."""
    count = 20_000 if stress else 1000
    for sessions in (1, 100):
        root = tmp_path / f"x{sessions}"
        at = soon()
        procs = {
            f"w{i}": start_writer(root, f"w{i}", sessions, count, "--start-at", at)
            for i in range(4)
        }
        acked = {w: p.finish() for w, p in procs.items()}
        stored = check(root, sessions, acked)
        assert sum(len(s) for s in stored) == 4 * sum(1 + seq % 3 for seq in range(count))


def test_readers_next_to_a_writer_of_big_appends(tmp_path: Path, stress: bool) -> None:
    """Guarantee 2: `tak sessions ls` and, in another process, `load` and
    `list_session_summaries` (both rebuild stale summaries) in loops; the
    writer checks it can load every entry it acknowledged."""
    root = tmp_path / "data" / "sessions"
    count = 6000 if stress else 1200
    writer = start_writer(root, "a", 2, count, "--big", "1", "--verify")
    loader = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, trio\n"
            "from kernel.store import FileStore, SessionKey\n"
            "async def main():\n"
            "    async with FileStore(sys.argv[1]) as store:\n"
            "        while True:\n"
            "            for n in range(2):\n"
            "                await store.load(SessionKey('p', f's{n}'))\n"
            "            await store.list_session_summaries('p')\n"
            "trio.run(main)\n",
            str(root),
        ],
        env=dict(os.environ, PYTHONPATH=str(Path(__file__).parents[2])),
    )
    listings = 0
    try:
        while writer.proc.poll() is None or listings < 3:
            ls = subprocess.run(
                [TAK, "--home", str(tmp_path), "sessions", "ls", "--project", "p"],
                capture_output=True,
                timeout=60,
            )
            assert ls.returncode == 0, ls.stderr
            listings += 1
    finally:
        loader.kill()
        loader.wait()
    acked = {"a": writer.finish()}
    check(root, 2, acked)
    assert listings >= 2


@pytest.mark.parametrize("durability", ["flush", "fsync"])
def test_rm_while_a_writer_appends(tmp_path: Path, durability: str) -> None:
    """Guarantee 3: `tak sessions rm` next to a writer that keeps appending
    (in fsync mode its lock lingers from one append to the next)."""
    root = tmp_path / "data" / "sessions"
    writer = start_writer(root, "a", 1, 0, "--big", "10", "--durability", durability)
    try:
        # Acknowledged appends before the rm (a loaded machine may take long to
        # start the writer: wait for them rather than for a fixed time).
        writer.wait_for_first_ack()
        time.sleep(0.2)
        rm_start = time.monotonic()
        rm = subprocess.run(
            [TAK, "--home", str(tmp_path), "sessions", "rm", "s0", "--project", "p"],
            capture_output=True,
            timeout=60,
        )
        rm_end = time.monotonic()
        assert rm.returncode == 0, rm.stderr
        time.sleep(0.5)
    finally:
        acks = writer.kill()
    (entries,) = load_all(root, 1)
    stored = {e["seq"] for e in entries}
    after = [seq for t, _, seq in acks if t > rm_end]
    before = [seq for t, _, seq in acks if t < rm_start]
    assert after and before
    assert set(after) <= stored, "acknowledged after rm, but lost"
    assert not set(before) & stored, "rm left entries acknowledged before it"
    # What is stored is one run of the writer's sequence: nothing went to the old file.
    first = min(stored)
    assert sorted(stored) == list(range(first, first + len(stored)))
    assert (tmp_path / "data" / "sessions" / "p").exists()
    assert not [n for n in os.listdir(root / "p") if n.startswith("#")]


def test_same_uuid_from_two_processes_is_stored_once(tmp_path: Path, stress: bool) -> None:
    """Guarantee 4."""
    count = 5000 if stress else 2000
    at = soon()
    procs = {
        w: start_writer(tmp_path, w, 1, count, "--uuids", "shared", "--start-at", at) for w in "ab"
    }
    acked = {w: p.finish() for w, p in procs.items()}
    (entries,) = check(tmp_path, 1, acked, shared_uuids=True)
    assert len(entries) == sum(1 + seq % 3 for seq in range(count))


def test_sigkill_mid_append_next_to_another_writer(tmp_path: Path, stress: bool) -> None:
    """Guarantee 5: writers killed mid-way through big appends, another writing on."""
    rng = random.Random()
    rounds = 40 if stress else 8
    steady = start_writer(tmp_path, "steady", 1, 0, "--big", "200")
    acked: dict[str, list[Ack]] = {}
    try:
        for r in range(rounds):
            victim = start_writer(tmp_path, f"k{r}", 1, 0, "--big", "2")
            victim.wait_for_first_ack()  # appending now: any moment from here
            time.sleep(rng.uniform(0, 0.05))
            acked[f"k{r}"] = victim.kill()
    finally:
        acked["steady"] = steady.kill()
    check(tmp_path, 1, acked)

    # Every line on disk is whole: no append was glued to a torn tail.
    async def append_end() -> None:
        async with FileStore(tmp_path) as store:
            await store.append(SessionKey("p", "s0"), [{"type": "end", "uuid": "end"}])

    trio.run(append_end)
    data = (tmp_path / "p" / "s0" / "transcript.jsonl").read_bytes()
    assert data.endswith(b'{"type":"end","uuid":"end"}\n')


# -- careless processes (the turnstile `#lock`, a lock holder killed with a torn tail, rm,
# repair and mv between a writer's stat and its write), and readers racing writers ----

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
