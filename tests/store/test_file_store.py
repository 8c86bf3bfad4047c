from __future__ import annotations

import errno
import json
import os
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.lowlevel
import trio.testing

from kernel.errors import CorruptTranscript, StoreError, UsageError
from kernel.store import FileStore, SessionKey, _commit, _disk, fold_session_summary
from kernel.store._file import default_max_open

from .conformance import MAIN, FakeClock, MakeStore, StoreConformance, entry


class TestFileStoreFlush(StoreConformance):
    @pytest.fixture
    def make_store(self, tmp_path: Path) -> MakeStore:
        return lambda **options: FileStore(tmp_path / "sessions", **options)


class TestFileStoreFsyncFewFiles(StoreConformance):
    """fsync mode, and so few descriptors that transcripts are closed and reopened."""

    @pytest.fixture
    def make_store(self, tmp_path: Path) -> MakeStore:
        return lambda **options: FileStore(
            tmp_path / "sessions", durability="fsync", max_open=2, **options
        )


def transcript(root: Path, key: SessionKey = MAIN) -> Path:
    return Path(_disk.transcript_path(str(root), key))


def summary_file(root: Path, key: SessionKey = MAIN) -> Path:
    return root / key.project / key.session_id / "summary.json"


# -- layout and the one write per append -------------------------------------


async def test_layout_on_disk(tmp_path: Path) -> None:
    async with FileStore(tmp_path) as store:
        await store.append(MAIN, [entry(0), entry(1)])
        await store.append(MAIN.child("subagents/a"), [entry(2)])
    sdir = tmp_path / "proj" / "s1"
    assert sorted(p.relative_to(sdir).as_posix() for p in sdir.rglob("*")) == [
        "#lock",  # the turnstile of the session lock
        "sub",
        "sub/subagents",
        "sub/subagents/a.jsonl",
        "summary.json",
        "transcript.jsonl",
    ]
    lines = (sdir / "transcript.jsonl").read_bytes().splitlines(keepends=True)
    assert [json.loads(line) for line in lines] == [entry(0), entry(1)]
    assert all(line.endswith(b"}\n") for line in lines)
    stored = json.loads((sdir / "summary.json").read_text())
    assert stored["transcript_size"] == (sdir / "transcript.jsonl").stat().st_size
    assert stored["data"]["entry_count"] == 2


async def test_one_write_per_append(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    async with FileStore(tmp_path) as store:
        await store.append(MAIN, [entry(0)])
        fd = store._open[MAIN.name].fd
        writes: list[int] = []
        real_write = os.write

        def counting_write(f: int, data: Any) -> int:
            if f == fd:
                writes.append(len(data))
            return real_write(f, data)

        monkeypatch.setattr(os, "write", counting_write)
        await store.append(MAIN, [entry(i) for i in range(1, 20)])
        await store.append(MAIN, [entry(20)])
    assert len(writes) == 2
    lines = sum(len(json.dumps(entry(i), separators=(",", ":"))) + 1 for i in range(1, 20))
    assert writes[0] == lines + 18  # all lines but the last start with a space


async def test_an_append_cut_short_is_gone_whole(tmp_path: Path) -> None:
    async with FileStore(tmp_path) as store:
        await store.append(MAIN, [entry(0), entry(1)])
    path = transcript(tmp_path)
    good = path.read_bytes()
    assert good.startswith(b" {") and b"\n{" in good  # the first line is marked unfinished
    # A crash mid-write: the first two lines of a three-entry append made it.
    unfinished = b"".join(b" " + json.dumps(entry(i)).encode() + b"\n" for i in (2, 3))
    path.write_bytes(good + unfinished + b'{"type":"us')
    async with FileStore(tmp_path) as store:
        assert await store.load(MAIN) == [entry(0), entry(1)]
        assert [e async for e in store.iter_entries(MAIN)] == [entry(0), entry(1)]
        await store.append(MAIN, [entry(2)])  # the uuid is free: the append never happened
        assert await store.load(MAIN) == [entry(0), entry(1), entry(2)]
        (summary,) = await store.list_session_summaries("proj")
        assert summary.data.entry_count == 3
    assert path.read_bytes() == good + json.dumps(entry(2), separators=(",", ":")).encode() + b"\n"


async def test_repair_keeps_whole_appends_only(tmp_path: Path) -> None:
    async with FileStore(tmp_path) as store:
        await store.append(MAIN, [entry(0)])
        await store.append(MAIN, [entry(1), entry(2), entry(3)])
    path = transcript(tmp_path)
    lines = path.read_bytes().splitlines(keepends=True)
    lines[2] = b" garbage\n"  # damage inside the second append
    path.write_bytes(b"".join(lines))
    async with FileStore(tmp_path) as store:
        report = await store.repair(MAIN)
        assert report is not None and (report.kept, report.first_bad_line) == (1, 3)
        assert await store.load(MAIN) == [entry(0)]


# -- damage ----------------------------------------------------------------------


async def test_torn_tail_is_truncated_on_open(tmp_path: Path) -> None:
    async with FileStore(tmp_path) as store:
        await store.append(MAIN, [entry(0), entry(1)])
    path = transcript(tmp_path)
    good = path.read_bytes()
    with path.open("ab") as f:
        f.write(b'{"type":"user","uuid":"u2","tim')  # an append cut short
    async with FileStore(tmp_path) as store:
        assert await store.load(MAIN) == [entry(0), entry(1)]  # readers skip it
        await store.append(MAIN, [entry(3)])  # opening cuts it off first
        assert await store.load(MAIN) == [entry(0), entry(1), entry(3)]
    assert path.read_bytes() == good + json.dumps(entry(3), separators=(",", ":")).encode() + b"\n"


@pytest.mark.parametrize("garbage", [b"{not json\n", b'["a list"]\n', b'{"no": "type"}\n', b"\n"])
async def test_damage_mid_file_names_file_and_line(tmp_path: Path, garbage: bytes) -> None:
    async with FileStore(tmp_path) as store:
        await store.append(MAIN, [entry(0)])
    path = transcript(tmp_path)
    with path.open("ab") as f:
        f.write(garbage + json.dumps(entry(2)).encode() + b"\n")
    async with FileStore(tmp_path) as store:
        for attempt in (store.load(MAIN), store.append(MAIN, [entry(3)])):
            with pytest.raises(CorruptTranscript) as info:
                await attempt
            assert info.value.path == str(path)
            assert info.value.line == 2
            assert f"{path}:2:" in str(info.value)
        with pytest.raises(CorruptTranscript):
            async for _ in store.iter_entries(MAIN):
                pass


async def test_one_damaged_session_is_listed_flagged_and_hides_no_other(tmp_path: Path) -> None:
    other = SessionKey(MAIN.project, "healthy")
    async with FileStore(tmp_path) as store:
        await store.append(MAIN, [entry(0)])
        await store.append(other, [entry(1)])
    path = transcript(tmp_path)
    with path.open("ab") as f:
        f.write(b"{not json\n" + json.dumps(entry(2)).encode() + b"\n")
    (path.parent / "summary.json").unlink()  # so the listing must rebuild it
    async with FileStore(tmp_path) as store:
        summaries = {s.session_id: s for s in await store.list_session_summaries(MAIN.project)}
    assert summaries["healthy"].problem is None
    assert summaries["healthy"].data.entry_count == 1
    damaged = summaries[MAIN.session_id]
    assert damaged.problem is not None and f"{path}:2:" in damaged.problem
    assert "repairing the session quarantines it" in damaged.problem


async def test_repair_quarantines_and_keeps_the_good_prefix(tmp_path: Path) -> None:
    async with FileStore(tmp_path) as store:
        await store.append(MAIN, [entry(0), entry(1)])
    path = transcript(tmp_path)
    with path.open("ab") as f:
        f.write(b"garbage\n" + json.dumps(entry(3)).encode() + b"\n")
    damaged = path.read_bytes()
    async with FileStore(tmp_path) as store:
        report = await store.repair(MAIN)
        assert report is not None
        assert (report.kept, report.first_bad_line) == (2, 3)
        assert report.quarantined is not None
        quarantined = trio.Path(report.quarantined)
        assert await quarantined.read_bytes() == damaged  # nothing is lost
        assert Path(quarantined).is_relative_to(tmp_path / "proj" / "s1" / "quarantine")
        assert await store.load(MAIN) == [entry(0), entry(1)]
        await store.append(MAIN, [entry(4)])
        (summary,) = await store.list_session_summaries("proj")
        assert summary.data.entry_count == 3
        again = await store.repair(MAIN)
        assert again is not None and again.quarantined is None
        assert await store.repair(SessionKey("proj", "missing")) is None
    assert await _load_fresh(tmp_path, MAIN) == [entry(0), entry(1), entry(4)]


async def test_repair_cuts_a_torn_tail(tmp_path: Path) -> None:
    async with FileStore(tmp_path) as store:
        await store.append(MAIN, [entry(0)])
    path = transcript(tmp_path)
    good = path.read_bytes()
    with path.open("ab") as f:
        f.write(b'{"type":')
    async with FileStore(tmp_path) as store:
        report = await store.repair(MAIN)
    assert report is not None and (report.torn_bytes, report.quarantined) == (8, None)
    assert path.read_bytes() == good


async def _load_fresh(root: Path, key: SessionKey) -> list[dict[str, Any]] | None:
    async with FileStore(root) as store:
        return await store.load(key)


# -- summaries -------------------------------------------------------------------


@pytest.mark.parametrize("damage", ["missing", "corrupt", "stale", "other session"])
async def test_bad_summary_is_rebuilt(tmp_path: Path, damage: str) -> None:
    async with FileStore(tmp_path) as store:
        await store.append(MAIN, [entry(0, title="t"), entry(1, "assistant", cost_usd=0.5)])
    path = summary_file(tmp_path)
    old = path.read_text()
    async with FileStore(tmp_path) as store:
        await store.append(MAIN, [entry(2, usage={"input_tokens": 4})])
    if damage == "missing":
        path.unlink()
    elif damage == "corrupt":
        path.write_text('{"version": 1, "trunc')
    elif damage == "stale":
        path.write_text(old)
    else:
        path.write_text(old.replace('"s1"', '"s9"'))
    async with FileStore(tmp_path) as store:
        (summary,) = await store.list_session_summaries("proj")
        loaded = await store.load(MAIN)
        assert loaded is not None
        assert summary.data == fold_session_summary(None, MAIN, loaded).data
        (info,) = await store.list_sessions("proj")
        assert summary.mtime_ms >= info.mtime_ms
    stored = json.loads(path.read_text())  # written back, whole
    assert stored["data"]["entry_count"] == 3


async def test_state_survives_reopening(tmp_path: Path) -> None:
    clock = FakeClock(10_000)
    async with FileStore(tmp_path, clock=clock) as store:
        await store.append(MAIN, [entry(0), entry(1)])
        listed = await store.list_sessions("proj")
        summaries = await store.list_session_summaries("proj")
    async with FileStore(tmp_path, clock=clock) as store:
        assert await store.list_sessions("proj") == listed
        assert await store.list_session_summaries("proj") == summaries
        await store.append(MAIN, [entry(1), entry(0)])  # still known after reopening
        assert await store.load(MAIN) == [entry(0), entry(1)]
        await store.append(MAIN, [entry(2)])  # the clock stood still: mtime still grows
        (info,) = await store.list_sessions("proj")
        assert info.mtime_ms == listed[0].mtime_ms + 1


# -- listing never opens transcripts -------------------------------------------------

_opened: list[str] | None = None


def _audit(event: str, args: tuple[Any, ...]) -> None:
    if event == "open" and _opened is not None and isinstance(args[0], str | bytes):
        _opened.append(os.fsdecode(args[0]))


sys.addaudithook(_audit)


@pytest.fixture
def opened_files() -> Iterator[list[str]]:
    global _opened
    _opened = []
    try:
        yield _opened
    finally:
        _opened = None


async def test_listing_never_opens_a_transcript(tmp_path: Path, opened_files: list[str]) -> None:
    # Audit hooks see every open() in the process, os.open included.
    async with FileStore(tmp_path) as store:
        for i in range(20):
            await store.append(SessionKey("proj", f"s{i}"), [entry(i)])
            await store.append(SessionKey("proj", f"s{i}", "sub"), [entry(i)])
    opened_files.clear()
    async with FileStore(tmp_path) as store:
        assert len(await store.list_sessions("proj")) == 20
        assert len(await store.list_session_summaries("proj")) == 20
        assert await store.list_subkeys(SessionKey("proj", "s3")) == ["sub"]
        await store.append(SessionKey("proj", "s3"), [entry(99)])  # opens s3 only
        assert len(await store.list_session_summaries("proj")) == 20
    # Files are opened relative to their directory's fd (no link followed below the
    # root), so the hook sees the last component: one transcript, the append's.
    transcripts = [p for p in opened_files if p.endswith(".jsonl")]
    assert transcripts == [transcript(tmp_path, SessionKey("proj", "s3")).name]
    assert any(p.endswith("summary.json") for p in opened_files)  # the hook does see opens


# -- descriptors, locks, other keys ----------------------------------------------------


async def test_open_descriptors_are_bounded(tmp_path: Path) -> None:
    keys = [SessionKey("proj", f"s{i % 25}", None if i % 2 else "sub") for i in range(50)]
    fds_before = len(os.listdir("/proc/self/fd"))
    async with FileStore(tmp_path, max_open=4) as store:
        most = 0

        async def writer(n: int) -> None:
            nonlocal most
            for r in range(3):
                await store.append(keys[n], [entry(r)])
                most = max(most, store.open_files, store.open_files + store._opening)

        async with trio.open_nursery() as nursery:
            for n in range(len(keys)):
                nursery.start_soon(writer, n)
        assert most <= 4
        # Each transcript, and each session being written (its lock and
        # turnstile): 3 x max_open.
        assert len(os.listdir("/proc/self/fd")) <= fds_before + 3 * 4 + 2
        for key in keys:
            assert await store.load(key) == [entry(0), entry(1), entry(2)]
        assert len(store._locks) == 0
    assert len(os.listdir("/proc/self/fd")) <= fds_before + 1


async def test_eviction_closes_session_descriptors_on_the_trio_thread(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Evicting a session's last open transcript closes the session's directory
    # descriptor. Done from the worker thread that closes the transcript, it
    # raced with tasks taking that session's flock meanwhile (EBADF in
    # try_acquire or _end_lease, ~15% of runs of the test above).
    main = SessionKey("proj", "s")
    child = SessionKey("proj", "s", "sub")
    other = SessionKey("proj", "t")
    trio_thread = threading.get_ident()
    async with FileStore(tmp_path, max_open=1) as store:
        seen: list[int] = []
        real_tidy = store._tidy

        def tidy(session: Any) -> None:
            seen.append(threading.get_ident())
            real_tidy(session)

        monkeypatch.setattr(store, "_tidy", tidy)
        await store.append(child, [entry(0)])
        sessions = dict(store._sessions)
        await store.append(main, [entry(1)])  # evicts child; main keeps the session
        await store.append(other, [entry(2)])  # evicts main: the session's last handle
        assert seen and set(seen) == {trio_thread}
        assert ("proj", "s") not in store._sessions
        assert sessions[("proj", "s")]._closed
        assert await store.load(child) == [entry(0)]
        assert await store.load(main) == [entry(1)]


async def test_lock_table_empties(tmp_path: Path) -> None:
    async with FileStore(tmp_path, max_open=64) as store:

        async def writer(t: int) -> None:
            for i in range(50):
                await store.append(SessionKey("p", f"s{t}-{i}"), [{"type": "t"}])

        async with trio.open_nursery() as nursery:
            for t in range(40):
                nursery.start_soon(writer, t)
        assert len(store._locks) == 0
        assert len(store._gates) == 0
        assert len(await store.list_sessions("p")) == 2_000


async def test_key_blocked_mid_append_does_not_block_others(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with FileStore(tmp_path) as store:
        blocked = SessionKey("proj", "slow")
        release = threading.Event()
        real_open = store._open_sync

        def open_sync(key: SessionKey) -> Any:
            if key == blocked:
                assert release.wait(10)  # a disk that hangs, for this file only
            return real_open(key)

        monkeypatch.setattr(store, "_open_sync", open_sync)
        done = trio.Event()

        async def slow() -> None:
            await store.append(blocked, [entry(0)])
            done.set()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(slow)
            await trio.sleep(0.05)
            with trio.fail_after(5):
                for key in [MAIN, blocked.child("sub"), SessionKey("other", "slow")]:
                    await store.append(key, [entry(1)])
                    assert await store.load(key) == [entry(1)]
                assert [i.session_id for i in await store.list_sessions("proj")] == ["s1"]
            assert not done.is_set()
            release.set()
        assert await store.load(blocked) == [entry(0)]


async def test_delete_waits_for_a_child_being_opened(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with FileStore(tmp_path) as store:
        child = MAIN.child("subagents/a")
        await store.append(MAIN, [entry(0)])
        opening = threading.Event()
        release = threading.Event()
        real_open = store._open_sync

        def open_sync(key: SessionKey) -> Any:
            if key == child:
                opening.set()
                assert release.wait(10)
            return real_open(key)

        monkeypatch.setattr(store, "_open_sync", open_sync)
        order: list[str] = []

        async def append_child() -> None:
            await store.append(child, [entry(1)])
            order.append("append")

        async def delete_main() -> None:
            assert await store.delete(MAIN)
            order.append("delete")

        async with trio.open_nursery() as nursery:
            nursery.start_soon(append_child)
            await trio.to_thread.run_sync(opening.wait)
            nursery.start_soon(delete_main)
            await trio.sleep(0.05)
            assert order == []  # delete waits for the child's open
            release.set()
        assert order == ["append", "delete"]
        assert await store.load(child) is None
        assert await store.list_subkeys(MAIN) == []
        await store.append(child, [entry(2)])  # a fresh child afterwards
        assert await store.load(child) == [entry(2)]


# -- failures are all or nothing ---------------------------------------------------------


async def test_failed_write_leaves_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    async with FileStore(tmp_path) as store:
        await store.append(MAIN, [entry(0)])
        fd = store._open[MAIN.name].fd
        real_write = os.write

        def half_then_enospc(f: int, data: Any) -> int:
            if f != fd:
                return real_write(f, data)
            if len(data) > 40:
                return real_write(f, bytes(data[: len(data) // 2]))
            raise OSError(errno.ENOSPC, "No space left on device")

        monkeypatch.setattr(os, "write", half_then_enospc)
        with pytest.raises(StoreError, match="No space left"):
            await store.append(MAIN, [entry(1), entry(2, pad="x" * 100)])
        monkeypatch.undo()
        assert await store.load(MAIN) == [entry(0)]
        await store.append(MAIN, [entry(1)])  # the uuid was not taken
        assert await store.load(MAIN) == [entry(0), entry(1)]
    assert await _load_fresh(tmp_path, MAIN) == [entry(0), entry(1)]


async def test_cancel_during_a_big_write_keeps_all(tmp_path: Path) -> None:
    async with FileStore(tmp_path) as store:
        batch = [entry(i, pad="x" * 10_000) for i in range(50)]  # written from a thread
        with trio.CancelScope() as scope:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(store.append, MAIN, batch)
                await trio.lowlevel.checkpoint()
                await trio.lowlevel.checkpoint()
                scope.cancel()
        loaded = await store.load(MAIN)
        assert loaded in (None, batch)
    assert await _load_fresh(tmp_path, MAIN) == loaded


async def test_fsync_failure_is_reported(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    async with FileStore(tmp_path, durability="fsync") as store:
        await store.append(MAIN, [entry(0)])

        def failing_sync(fds: Any, devices: Any) -> None:
            raise OSError(errno.EIO, "Input/output error")

        monkeypatch.setattr(store.group_commit, "_sync", failing_sync)
        with pytest.raises(StoreError, match="fsync failed"):
            await store.append(MAIN, [entry(1)])
        assert MAIN.name not in store._open  # forgotten: its state on disk is unknown
        monkeypatch.undo()
        await store.append(MAIN, [entry(2)])
        loaded = await store.load(MAIN)
        assert loaded is not None and loaded[0] == entry(0) and loaded[-1] == entry(2)


# -- group commit --------------------------------------------------------------------------


async def test_group_commit_shares_fsyncs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    async with FileStore(tmp_path, durability="fsync", max_open=200) as store:
        rounds: list[int] = []

        def slow_sync(fds: Any, devices: Any) -> None:
            rounds.append(len(fds))
            _commit.sync_files(fds, devices)
            threading.Event().wait(0.02)  # a slow disk: appends pile up meanwhile

        monkeypatch.setattr(store.group_commit, "_sync", slow_sync)
        sessions, appends = 100, 3

        async def writer(n: int) -> None:
            for i in range(appends):
                await store.append(SessionKey("proj", f"s{n}"), [entry(i)])

        async with trio.open_nursery() as nursery:
            for n in range(sessions):
                nursery.start_soon(writer, n)
        assert sum(rounds) == sessions * appends  # every append was in a round
        assert len(rounds) <= 2 * appends + 2  # not one round each
        assert max(rounds) >= sessions // 2
        for n in range(sessions):
            assert await store.load(SessionKey("proj", f"s{n}")) == [
                entry(i) for i in range(appends)
            ]


async def test_durable_appends_rejoin_their_lingering_session_lock(tmp_path: Path) -> None:
    """A durable append parks in its round, so its lock's lease ends under it;
    the writer's next append rejoins the lingering hold instead of taking the
    flock (and checking its file) again."""
    async with FileStore(tmp_path, durability="fsync") as store:
        for i in range(20):
            await store.append(MAIN, [entry(i)])
        (session,) = store._sessions.values()
        assert session.hold == 1  # one flock for all twenty
        await trio.testing.wait_all_tasks_blocked()  # the scheduler ran: the hold ends
        assert session.holders == 0 and session._held_fd is None
        assert await store.load(MAIN) == [entry(i) for i in range(20)]


async def test_durable_appends_to_one_session_share_rounds(tmp_path: Path) -> None:
    """Tasks appending to one session at once: the lock holder writes the
    batches that wait for the lock with its own, one write and one round."""
    async with FileStore(tmp_path, durability="fsync") as store:
        tasks, appends = 40, 5

        async def writer(t: int) -> None:
            await store.append(MAIN, [entry(99_999)])  # every task: stored once
            for i in range(appends):
                await store.append(MAIN, [entry(t * 100 + i), entry(t * 100 + i)])

        async with trio.open_nursery() as nursery:
            for t in range(tasks):
                nursery.start_soon(writer, t)
        loaded = await store.load(MAIN)
        assert loaded is not None
        numbers = [int(e["uuid"][1:]) for e in loaded]
        assert numbers.count(99_999) == 1
        numbers.remove(99_999)
        assert sorted(numbers) == sorted(t * 100 + i for t in range(tasks) for i in range(appends))
        for t in range(tasks):  # each task's appends in the order they were acknowledged
            own = [n for n in numbers if n // 100 == t]
            assert own == sorted(own)
        assert store.group_commit.rounds <= 3 * appends + 3  # not one per append (240)
    assert await _load_fresh(tmp_path, MAIN) == loaded


async def test_a_queued_batch_cancelled_before_it_is_taken_is_not_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with FileStore(tmp_path, durability="fsync") as store:
        await store.append(MAIN, [entry(0)])
        release = threading.Event()

        def slow_sync(fds: Any, devices: Any) -> None:
            release.wait(10)
            _commit.sync_files(fds, devices)

        monkeypatch.setattr(store.group_commit, "_sync", slow_sync)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(store.append, MAIN, [entry(1)])  # holds the lock, in its round
            await trio.testing.wait_all_tasks_blocked()
            nursery.start_soon(store.append, MAIN, [entry(2)])  # queued behind it
            await trio.testing.wait_all_tasks_blocked()
            scope = trio.CancelScope()  # queued, then cancelled before anyone takes it
            nursery.start_soon(_append_in, scope, store, [entry(3)])
            await trio.testing.wait_all_tasks_blocked()
            assert len(store._queued[MAIN.name]) == 2
            scope.cancel()
            await trio.testing.wait_all_tasks_blocked()
            assert len(store._queued[MAIN.name]) == 1
            release.set()
        assert await store.load(MAIN) == [entry(0), entry(1), entry(2)]
        assert not store._queued


async def _append_in(scope: trio.CancelScope, store: FileStore, batch: list[Any]) -> None:
    with scope:
        await store.append(MAIN, batch)


async def test_a_failed_round_fails_the_queued_batches_too(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with FileStore(tmp_path, durability="fsync") as store:
        await store.append(MAIN, [entry(0)])
        release = threading.Event()
        failing = [True]

        def sync(fds: Any, devices: Any) -> None:
            release.wait(10)
            if failing[0]:
                raise OSError(errno.EIO, "Input/output error")
            _commit.sync_files(fds, devices)

        monkeypatch.setattr(store.group_commit, "_sync", sync)
        errors: list[str] = []

        async def append(n: int) -> None:
            try:
                await store.append(MAIN, [entry(n)])
            except StoreError as exc:
                errors.append(str(exc))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(append, 1)  # in a round that will fail
            await trio.testing.wait_all_tasks_blocked()
            for n in (2, 3, 4):  # queued behind it: taken by the next holder together
                nursery.start_soon(append, n)
            await trio.testing.wait_all_tasks_blocked()
            release.set()
        assert len(errors) == 4 and all("fsync failed" in e for e in errors)
        failing[0] = False
        await store.append(MAIN, [entry(5)])
        assert await store.load(MAIN) == [entry(0), entry(5)]


def test_sync_files_uses_every_path(tmp_path: Path) -> None:
    fds = [os.open(tmp_path / f"f{i}", os.O_WRONLY | os.O_CREAT, 0o600) for i in range(12)]
    try:
        for fd in fds:
            os.write(fd, b"x\n")
        devices = [os.fstat(fd).st_dev for fd in fds]
        _commit.sync_files(fds[:2], devices[:2])  # fdatasync each
        _commit.sync_files(fds, devices)  # syncfs once
    finally:
        for fd in fds:
            os.close(fd)


# -- options -------------------------------------------------------------------------------


def test_options_are_checked(tmp_path: Path) -> None:
    with pytest.raises(UsageError, match="durability"):
        FileStore(tmp_path, durability="sometimes")  # type: ignore[arg-type]
    with pytest.raises(UsageError, match="max_open"):
        FileStore(tmp_path, max_open=0)
    assert 16 <= default_max_open() <= 1024


async def test_iter_entries_streams_large_transcripts(tmp_path: Path) -> None:
    big = [entry(i, pad="y" * 3_000) for i in range(800)]  # about 2.4 MB
    async with FileStore(tmp_path) as store:
        for i in range(0, len(big), 100):
            await store.append(MAIN, big[i : i + 100])
        got = []
        async for e in store.iter_entries(MAIN):
            got.append(e["uuid"])
        assert got == [e["uuid"] for e in big]


async def test_an_append_opening_while_the_store_closes_fails_and_leaks_nothing(
    tmp_path: Path,
) -> None:
    store = FileStore(tmp_path)
    key = SessionKey("p", "late")
    real_open = store._open_sync

    def slow_open(k: SessionKey) -> Any:
        time.sleep(0.2)  # aclose runs while this transcript is being opened
        return real_open(k)

    store._open_sync = slow_open  # type: ignore[method-assign]
    failures: list[str] = []

    async def appender() -> None:
        try:
            await store.append(key, [{"type": "x", "uuid": "late-1"}])
        except StoreError as exc:
            failures.append(str(exc))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(appender)
        await trio.sleep(0.05)
        await store.aclose()
    assert failures == ["the store is closed"]
    assert store.open_files == 0
    path = str(transcript(tmp_path, key))
    open_paths = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            open_paths.append(os.readlink(f"/proc/self/fd/{fd}"))
        except OSError:
            pass  # the fd of listdir itself, gone by now
    assert path not in open_paths


# -- FIFOs, torn tails between reads, remembered positions ----------------------------

FIFO_EVERYWHERE = """
import os, sys, trio
from kernel.errors import StoreError
from kernel.store import FileStore, SessionKey
key = SessionKey("p", "s0")
async def main():
    root = sys.argv[1]
    sdir = os.path.join(root, "p", "s0")
    async with FileStore(root) as store:
        await store.append(key, [{"type": "t", "uuid": "u0"}])
    os.unlink(os.path.join(sdir, "summary.json"))
    os.mkfifo(os.path.join(sdir, "summary.json"))
    async with FileStore(root) as store:
        (summary,) = await store.list_session_summaries("p")  # rebuilt, not read
        print("summary", summary.data.entry_count)
        await store.append(key, [{"type": "t", "uuid": "u1"}])
    os.unlink(os.path.join(sdir, "transcript.jsonl"))
    os.mkfifo(os.path.join(sdir, "transcript.jsonl"))
    async with FileStore(root) as store:
        for what in ("load", "append", "repair"):
            try:
                if what == "load":
                    await store.load(key)
                elif what == "append":
                    await store.append(key, [{"type": "t", "uuid": "u2"}])
                else:
                    await store.repair(key)
                print(what, "returned")
            except StoreError as exc:
                print(what, "refused" if "not a regular file" in str(exc) else exc)
trio.run(main)
"""


def test_fifos_in_a_session_directory_block_nobody(tmp_path: Path) -> None:
    """A FIFO at summary.json is rebuilt over; one at transcript.jsonl is refused by
    readers and writers alike, at once (opening a FIFO for reading blocks)."""
    import subprocess

    env = dict(os.environ, PYTHONPATH=str(Path(__file__).parents[2]))
    try:
        done = subprocess.run(
            [sys.executable, "-c", FIFO_EVERYWHERE, str(tmp_path)],
            capture_output=True,
            text=True,
            timeout=20,
            env=env,
        )
    except subprocess.TimeoutExpired:
        pytest.fail("a store operation hung on a FIFO")
    assert done.returncode == 0, done.stderr
    assert done.stdout.split("\n")[:4] == [
        "summary 1",
        "load refused",
        "append refused",
        "repair refused",
    ]


def _glue_on_next_read(
    monkeypatch: pytest.MonkeyPatch, path: Path, at: int, cut: int, data: bytes
) -> list[int]:
    """Patch os.pread: the first read at byte ``at`` first cuts ``path`` to ``cut``
    bytes and appends ``data`` (the next lock holder, between two reads)."""
    real = os.pread
    done: list[int] = []

    def pread(fd: int, n: int, offset: int) -> bytes:
        if offset == at and not done:
            done.append(1)
            w = os.open(path, os.O_WRONLY | os.O_APPEND)
            try:
                os.ftruncate(w, cut)
                os.write(w, data)
            finally:
                os.close(w)
        return real(fd, n, offset)

    monkeypatch.setattr(os, "pread", pread)
    return done


@pytest.mark.parametrize("attempt", range(3))
async def test_a_reader_never_glues_an_unfinished_append_to_the_next(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, attempt: int
) -> None:
    """The whole lines of a dead writer's unfinished append are not returned with the
    lines that replace them: a read starts again at the last finished append."""
    async with FileStore(tmp_path) as store:
        await store.append(MAIN, [entry(0)])
    path = transcript(tmp_path)
    good = path.read_bytes()
    # A two-line append cut short; its first line is whole and says "ghost".
    torn = b' {"type":"ghost","uuid":"g"}\n{"type":"t","uu'
    with open(path, "ab") as f:  # noqa: ASYNC230
        f.write(torn)
    # The next holder's append: its line starts exactly where the torn one did.
    new = [b'{"type":"t","uuid":"n%d","pad":"%s"}\n' % (i, b"x" * 50 * attempt) for i in range(3)]
    done = _glue_on_next_read(
        monkeypatch, path, len(good) + len(torn), len(good), b" " + b" ".join(new[:2]) + new[2]
    )
    async with FileStore(tmp_path) as store:
        loaded = await store.load(MAIN) or []
        assert done
        assert [x["uuid"] for x in loaded] == ["u0", "n0", "n1", "n2"]


def test_line_reader_reads_appends_longer_than_its_chunk(tmp_path: Path) -> None:
    """An append longer than a read grows the read until it is whole; an unfinished
    one at the end is never returned, however long."""
    path = tmp_path / "t.jsonl"
    big = [json.dumps({"type": "t", "pad": c * 700_000}).encode() + b"\n" for c in "ab"]
    whole = b" " + big[0] + big[1]  # one append of two lines, 1.4 MB
    path.write_bytes(whole + b'{"type":"t","n":1}\n' + b" " + big[0] + b'{"type":"x", "pad":"')
    fd = os.open(path, os.O_RDONLY)
    try:
        reader = _disk.LineReader(fd, str(path))
        lines = []
        while not reader.eof:
            lines += list(reader.read())
    finally:
        os.close(fd)
    assert [n for n, _ in lines] == [1, 2, 3]
    assert lines[0][1] == b" " + big[0] and lines[1][1] == big[1]
    assert reader.good_end == len(whole) + len(b'{"type":"t","n":1}\n')
    assert reader.torn_bytes == path.stat().st_size - reader.good_end


async def test_iter_entries_positions_are_checked_and_forgotten_on_delete(
    tmp_path: Path,
) -> None:
    """A remembered position is used only while the line it remembers ends there;
    delete forgets the key's (and its children's) positions."""
    child = MAIN.child("subagents/a")
    async with FileStore(tmp_path) as a, FileStore(tmp_path) as b:
        await b.append(MAIN, [entry(i) for i in range(4)])
        await b.append(child, [entry(9)])
        assert len([x async for x in a.iter_entries(MAIN)]) == 4
        assert len([x async for x in a.iter_entries(child)]) == 1
        pos = a._positions[MAIN.name]
        assert pos.lines == 4 and pos.offset == transcript(tmp_path).stat().st_size
        # The same bytes before it, another last line (same length): not trusted.
        data = transcript(tmp_path).read_bytes()
        transcript(tmp_path).write_bytes(data.replace(b'"uuid":"u3"', b'"uuid":"u7"'))
        assert [x["uuid"] async for x in a.iter_entries(MAIN, start=4)] == []
        assert [x["uuid"] async for x in a.iter_entries(MAIN, start=3)] == ["u7"]
        assert a._positions[MAIN.name] != pos  # the same place, another line
        await b.append(MAIN, [entry(5)])
        assert [x["uuid"] async for x in a.iter_entries(MAIN, start=4)] == ["u5"]
        assert await a.delete(MAIN)
        assert MAIN.name not in a._positions and child.name not in a._positions


def _spy_reader_starts(store: FileStore, monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int]]:
    """(lines, bytes) before where each iter_entries of ``store`` starts reading."""
    starts: list[tuple[int, int]] = []
    real = store._reader_sync

    def reader_sync(*args: Any) -> _disk.LineReader:
        reader = real(*args)
        starts.append((reader.good_lines, reader.good_end))
        return reader

    monkeypatch.setattr(store, "_reader_sync", reader_sync)
    return starts


async def test_iter_entries_one_before_a_remembered_end_starts_at_its_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """HistoryCache re-reads the last entry it folded (start = n - 1 after a read
    that ended at n): the read starts at that line, not at the file's start, also
    when the line ends an append of several; a changed line is not trusted."""
    async with FileStore(tmp_path) as a, FileStore(tmp_path) as b:
        await b.append(MAIN, [entry(i) for i in range(3)])  # one append, three lines
        starts = _spy_reader_starts(a, monkeypatch)
        assert len([x async for x in a.iter_entries(MAIN)]) == 3
        size = transcript(tmp_path).stat().st_size
        last = transcript(tmp_path).read_bytes().splitlines(keepends=True)[-1]
        assert last[:1] != b" "  # an append's last line
        assert [x["uuid"] async for x in a.iter_entries(MAIN, start=2)] == ["u2"]
        assert starts[-1] == (2, size - len(last))
        # Nothing known one line further back: from the start.
        assert [x["uuid"] async for x in a.iter_entries(MAIN, start=1)] == ["u1", "u2"]
        assert starts[-1] == (0, 0)
        assert [x["uuid"] async for x in a.iter_entries(MAIN, start=2)] == ["u2"]
        assert starts[-1] == (2, size - len(last))
        # Another last line of the same length at the same place: not trusted.
        data = transcript(tmp_path).read_bytes()
        transcript(tmp_path).write_bytes(data.replace(b'"uuid":"u2"', b'"uuid":"u8"'))
        assert [x["uuid"] async for x in a.iter_entries(MAIN, start=2)] == ["u8"]
        assert starts[-1] == (0, 0)


async def test_iter_entries_one_before_own_end_starts_at_its_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Right after an append (HistoryCache reads from count - 1), the read starts
    at the last line this process wrote, whether the transcript was opened,
    appended to here, or caught up with another process's appends."""
    async with FileStore(tmp_path) as a, FileStore(tmp_path) as b:
        await b.append(MAIN, [entry(0), entry(1)])
        await b.aclose()
        starts = _spy_reader_starts(a, monkeypatch)
        await a.append(MAIN, [entry(2)])  # opened (scanned), then appended to
        lines = transcript(tmp_path).read_bytes().splitlines(keepends=True)
        size = transcript(tmp_path).stat().st_size
        assert [x["uuid"] async for x in a.iter_entries(MAIN, start=2)] == ["u2"]
        assert starts[-1] == (2, size - len(lines[-1]))
        await a.append(MAIN, [entry(3), entry(4)])  # several lines
        size = transcript(tmp_path).stat().st_size
        last = transcript(tmp_path).read_bytes().splitlines(keepends=True)[-1]
        a._positions.clear()
        assert [x["uuid"] async for x in a.iter_entries(MAIN, start=4)] == ["u4"]
        assert starts[-1] == (4, size - len(last))
    async with FileStore(tmp_path) as a, FileStore(tmp_path) as b:
        await a.append(MAIN, [entry(5)])
        await b.append(MAIN, [entry(6), entry(7)])
        await a.append(MAIN, [entry(7)])  # a duplicate uuid: a catches up, writes nothing
        starts = _spy_reader_starts(a, monkeypatch)
        size = transcript(tmp_path).stat().st_size
        last = transcript(tmp_path).read_bytes().splitlines(keepends=True)[-1]
        assert [x["uuid"] async for x in a.iter_entries(MAIN, start=7)] == ["u7"]
        assert starts[-1] == (7, size - len(last))
