"""``FileStore.close_idle`` attacked: releases racing appends, reads, deletes, other processes.

Each test runs the real store on a temporary directory and checks what a
user would notice: every acknowledged entry is stored once, in order; the
summary read back (after the store is closed and opened again, which trusts
what close_idle wrote) counts exactly the entries on disk; no descriptor
outlives the store. Interleavings are varied by seeded random checkpoints,
not by timing.
"""

from __future__ import annotations

import fcntl
import os
import random
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import trio

from kernel.store import FileStore, SessionKey, _disk

pytestmark = pytest.mark.filterwarnings("error")


def open_fds() -> set[int]:
    return {int(n) for n in os.listdir("/proc/self/fd")}


def entry(tag: str, n: int) -> dict[str, Any]:
    return {"type": "user" if n % 2 else "assistant", "uuid": f"{tag}-{n}", "n": n}


async def check_on_disk(root: Path, expected: dict[SessionKey, list[str]]) -> None:
    """A fresh store (trusting what was written at close) reads exactly ``expected``."""
    async with FileStore(root) as again:
        for key, uuids in expected.items():
            got = await again.load(key)
            assert [e["uuid"] for e in got or []] == uuids, key
        for project in {k.project for k in expected}:
            summaries = {s.session_id: s for s in await again.list_session_summaries(project)}
            for key, uuids in expected.items():
                if key.project != project or key.subpath is not None:
                    continue
                data = summaries[key.session_id].data
                assert data is not None, key
                assert sum(data.type_counts.values()) == len(uuids), (key, data)
        # An append after reopening goes after the last line, not into it.
        for key, uuids in expected.items():
            await again.append(key, [entry("after", len(uuids))])
            got = await again.load(key)
            assert [e["uuid"] for e in got or []] == [*uuids, f"after-{len(uuids)}"], key


@pytest.mark.parametrize("durability", ["flush", "fsync"])
@pytest.mark.parametrize("seed", range(6))
async def test_close_idle_racing_appends_loses_nothing(
    tmp_path: Path, durability: str, seed: int
) -> None:
    rng = random.Random(seed)
    keys = [SessionKey("p", f"s{i}") for i in range(3)]
    keys += [k.child("subagents/a") for k in keys[:2]]
    expected: dict[SessionKey, list[str]] = {k: [] for k in keys}
    before = open_fds()
    store = FileStore(tmp_path, durability=durability, max_open=rng.choice([2, 3, 64]))  # type: ignore[arg-type]
    writers_done = 0

    async def writer(w: int) -> None:
        nonlocal writers_done
        r = random.Random(seed * 100 + w)
        for n in range(40):
            key = r.choice(keys)
            batch = [entry(f"w{w}", n * 10 + j) for j in range(r.randint(1, 3))]
            await store.append(key, batch)
            expected[key].extend(e["uuid"] for e in batch)
            for _ in range(r.randint(0, 3)):
                await trio.lowlevel.checkpoint()
        writers_done += 1

    async def releaser() -> None:
        r = random.Random(seed * 100 + 99)
        while writers_done < 4:
            busy = {keys[r.randrange(3)].name} if r.random() < 0.3 else set()
            await store.close_idle(
                keep=r.choice([0, 0, 1]), used_before=trio.current_time(), busy=busy
            )
            for _ in range(r.randint(0, 2)):
                await trio.lowlevel.checkpoint()

    async def reader() -> None:
        r = random.Random(seed * 100 + 98)
        while writers_done < 4:
            key = r.choice(keys)
            seen = [e["uuid"] async for e in store.iter_entries(key, start=r.randint(0, 5))]
            assert len(seen) == len(set(seen))
            await trio.lowlevel.checkpoint()

    try:
        async with trio.open_nursery() as nursery:
            for w in range(4):
                nursery.start_soon(writer, w)
            nursery.start_soon(releaser)
            nursery.start_soon(reader)
        for key, uuids in expected.items():
            got = await store.load(key)
            assert [e["uuid"] for e in got or []] == uuids, key
    finally:
        await store.aclose()
    assert open_fds() <= before
    await check_on_disk(tmp_path, expected)


async def test_close_idle_with_a_disk_error_closes_every_other_descriptor(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A summary that cannot be written (a full disk, a bug) leaks no descriptor
    and leaves the other sessions' summaries written."""
    keys = [SessionKey("p", f"s{i}") for i in range(5)]
    before = open_fds()
    async with FileStore(tmp_path) as store:
        for k in keys:
            await store.append(k, [entry(k.session_id, 0)])
        real = _disk.write_summary
        calls = 0

        def failing(root: str, sdir: str, stored: Any, *, durable: bool) -> None:
            nonlocal calls
            calls += 1
            if calls == 1:
                raise RuntimeError("a summary writer's bug")
            real(root, sdir, stored, durable=durable)

        monkeypatch.setattr(_disk, "write_summary", failing)
        with pytest.raises(RuntimeError):
            await store.close_idle(keep=0)
        monkeypatch.setattr(_disk, "write_summary", real)
        assert store.open_files == 0
        assert open_fds() <= before  # the failing one and the four after it: closed
        await store.append(keys[0], [entry("s0", 1)])
    assert open_fds() <= before
    async with FileStore(tmp_path) as again:
        summaries = await again.list_session_summaries("p")
        assert [sum(s.data.type_counts.values()) for s in summaries if s.data] == [2, 1, 1, 1, 1]


async def test_close_idle_racing_delete_and_repair(tmp_path: Path) -> None:
    """A session deleted or repaired while close_idle writes its summary comes
    back as it should: deleted stays deleted (no summary resurrected), repaired
    reads its whole lines."""
    store = FileStore(tmp_path)
    async with store:
        for round_ in range(20):
            key = SessionKey("p", f"d{round_}")
            child = key.child("subagents/x")
            await store.append(key, [entry("m", 0)])
            await store.append(child, [entry("c", 0)])
            async with trio.open_nursery() as nursery:
                nursery.start_soon(lambda: store.close_idle(keep=0))
                for _ in range(round_ % 4):
                    await trio.lowlevel.checkpoint()
                nursery.start_soon(store.delete, key)
            assert await store.load(key) is None
            assert await store.load(child) is None
            assert not (tmp_path / "p" / key.session_id).exists() or not any(
                (tmp_path / "p" / key.session_id).iterdir()
            )
        listed = await store.list_session_summaries("p")
        assert listed == []


WRITER = """
import sys, trio
from kernel.store import FileStore, SessionKey

async def main():
    root, tag, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
    keys = [SessionKey("p", f"s{i}") for i in range(3)]
    async with FileStore(root) as store:
        for i in range(n):
            key = keys[i % 3]
            await store.append(key, [{"type": "user", "uuid": f"{tag}-{i}", "n": i}])
            if i % 5 == 4:
                await store.close_idle(keep=0)
            if i % 37 == 36:
                await store.repair(key)

trio.run(main)
"""


async def test_two_processes_releasing_one_home(tmp_path: Path) -> None:
    """Two processes append to the same sessions, each releasing them (and one
    repairing) all the time: every entry of each is stored once, the summaries
    count them all."""
    script = tmp_path / "writer.py"
    script.write_text(WRITER)
    root = tmp_path / "home"
    n = 300
    procs = [
        await trio.lowlevel.open_process(
            [sys.executable, str(script), str(root), tag, str(n)], stderr=subprocess.PIPE
        )
        for tag in ("a", "b")
    ]
    for p in procs:
        assert await p.wait() == 0, p.stderr.receive_some if p.stderr else None
    async with FileStore(root) as store:
        for i in range(3):
            got = await store.load(SessionKey("p", f"s{i}")) or []
            uuids = [e["uuid"] for e in got]
            assert len(uuids) == len(set(uuids))
            for tag in ("a", "b"):
                mine = [u for u in uuids if u.startswith(f"{tag}-")]
                assert mine == [f"{tag}-{j}" for j in range(i, n, 3)]
        summaries = await store.list_session_summaries("p")
        assert [sum(s.data.type_counts.values()) for s in summaries if s.data] == [200] * 3


async def test_a_summary_written_at_release_is_not_put_beside_another_processes_new_transcript(
    tmp_path: Path,
) -> None:
    """Another process (here: another store on the same root, which locks the
    same way) deletes an idle session and starts it again; this one's release
    then wrote its old summary and checkpoint into the new session's
    directory, and the listing counted the deleted transcript's entries."""
    key = SessionKey("p", "s")
    async with FileStore(tmp_path) as serve, FileStore(tmp_path) as other:
        await serve.append(key, [entry("old", n) for n in range(5)])
        assert await other.delete(key)
        await other.append(key, [entry("new", 0)])
        await other.close_idle(keep=0)  # its summary: 1 entry
        assert await serve.close_idle(keep=0) == 1
    async with FileStore(tmp_path) as again:
        assert [e["uuid"] for e in await again.load(key) or []] == ["new-0"]
        (summary,) = await again.list_session_summaries("p")
        assert summary.data is not None
        assert sum(summary.data.type_counts.values()) == 1, summary
        await again.append(key, [entry("new", 1)])
    async with FileStore(tmp_path) as again:
        (summary,) = await again.list_session_summaries("p")
        assert summary.data is not None
        assert sum(summary.data.type_counts.values()) == 2, summary


async def test_a_release_after_delete_and_restart_in_the_same_millisecond(tmp_path: Path) -> None:
    """As above, the new transcript of the same size and stamped in the same
    millisecond: the old summary was taken for the new one's."""
    key = SessionKey("p", "s")
    ms = lambda: 1_800_000_000_000  # noqa: E731
    async with FileStore(tmp_path, clock=ms) as serve, FileStore(tmp_path, clock=ms) as other:
        await serve.append(key, [{"type": "old", "uuid": "u-0"}])
        assert await other.delete(key)
        await other.append(key, [{"type": "new", "uuid": "u-1"}])  # the same size
        await other.close_idle(keep=0)
        assert await serve.close_idle(keep=0) == 1
    async with FileStore(tmp_path) as again:
        (summary,) = await again.list_session_summaries("p")
        assert summary.data is not None and summary.data.type_counts == {"new": 1}, summary


def tear(sdir: Path) -> None:
    """What a process killed half-way through an append leaves: under the
    session's flock (as any writer takes it), a last line without its end."""
    dfd = os.open(sdir, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(dfd, fcntl.LOCK_EX)  # waits for this process's hold to end
        with (sdir / "transcript.jsonl").open("ab") as f:
            f.write(b'{"type":"user","uuid":"torn-0","n":')
    finally:
        os.close(dfd)  # and the lock with it


@pytest.mark.parametrize("released", [True, False])
async def test_a_torn_last_line_left_while_released_is_cut_at_reopen(
    tmp_path: Path, released: bool
) -> None:
    """Another process killed half-way through an append leaves a torn last line
    (its flock went with it). The next append of this one, reopening after a
    release or catching up on a descriptor kept open, goes after the whole
    lines, never glued to the torn one."""
    key = SessionKey("p", "s")
    async with FileStore(tmp_path) as store:
        await store.append(key, [entry("a", n) for n in range(3)])
        if released:
            assert await store.close_idle(keep=0) == 1
        await trio.to_thread.run_sync(tear, tmp_path / "p" / "s")
        await store.append(key, [entry("a", 3)])
        got = await store.load(key)
        assert [e["uuid"] for e in got or []] == ["a-0", "a-1", "a-2", "a-3"]
    await check_on_disk(tmp_path, {key: ["a-0", "a-1", "a-2", "a-3"]})


async def test_sessions_kept_busy_do_not_count_against_keep(tmp_path: Path) -> None:
    """keep is the idle transcripts kept: with two busy sessions the most recent,
    close_idle(keep=2) closed every idle one (the busy counted as the kept)."""
    keys = [SessionKey("p", f"s{i}") for i in range(5)]
    async with FileStore(tmp_path) as store:
        for k in keys:
            await store.append(k, [entry(k.session_id, 0)])
        busy = {keys[3].name, keys[4].name}
        assert await store.close_idle(keep=2, busy=busy) == 1
        assert list(store._open) == [k.name for k in keys[1:]]
