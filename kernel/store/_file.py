"""``FileStore``: JSONL transcripts on disk, the embedded default."""

from __future__ import annotations

import contextlib
import os
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any, Literal, TypeAlias

import trio

from ..errors import CorruptTranscript, StoreError, UsageError
from . import _disk
from ._base import BaseStore, TranscriptState
from ._commit import GroupCommit
from ._disk import FdOwner, LineReader, RepairReport
from ._entries import EncodedEntry, Entry
from ._key import SessionKey, check_name
from ._locks import KeyedLocks, SessionGates
from ._summary import SessionInfo, SessionSummary

Durability: TypeAlias = Literal["flush", "fsync"]

# Appends bigger than this are written from a worker thread.
_BIG_WRITE = 64 * 1024


def default_max_open() -> int:
    """A quarter of the soft open-files limit, between 16 and 1024."""
    try:
        import resource

        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    except (ImportError, OSError, ValueError):
        return 256
    if soft == resource.RLIM_INFINITY:
        return 1024
    return max(16, min(1024, soft // 4))


class _OpenTranscript(TranscriptState):
    __slots__ = ("dev", "dirty", "fd", "key", "size")

    def __init__(self, key: SessionKey, opened: _disk.Opened) -> None:
        super().__init__(summary=opened.summary, uuids=opened.uuids, mtime_ms=opened.mtime_ms)
        self.key = key
        self.fd = opened.fd
        self.dev = opened.dev
        self.size = opened.size
        self.dirty = opened.summary_dirty  # mtime and summary not yet on disk


class FileStore(BaseStore):
    """Transcripts as JSONL files under ``root`` (layout: ``kernel.store._disk``).

    One process owns a root at a time. Each append is one ``write()`` of
    whole lines on a descriptor kept open; at most ``max_open`` such
    descriptors are open, the least recently used idle one being closed to
    make room (reads use a short-lived descriptor of their own).
    ``durability="flush"`` survives the process being killed; ``"fsync"``
    survives power loss, with fsyncs batched across sessions (group commit).

    While a transcript is open its summary and mtime live in memory; they
    are written when it is closed. A summary found missing, corrupt or stale
    is rebuilt from the transcript.

    Use ``async with FileStore(root) as store:``, or call ``aclose()``.

    Raises:
        UsageError: ``durability`` or ``max_open`` is not valid.
    """

    def __init__(
        self,
        root: str | os.PathLike[str],
        *,
        durability: Durability = "flush",
        max_open: int | None = None,
        clock: Callable[[], int] | None = None,
    ) -> None:
        super().__init__(clock=clock)
        if durability not in ("flush", "fsync"):
            raise UsageError(f"durability: expected 'flush' or 'fsync', got {durability!r}")
        if max_open is not None and max_open < 1:
            raise UsageError(f"max_open: expected at least 1, got {max_open}")
        self.root = Path(root)
        self.durability: Durability = durability
        self.max_open = max_open if max_open is not None else default_max_open()
        self.group_commit = GroupCommit()
        self._root = os.fspath(root)
        self._durable = durability == "fsync"
        self._locks = KeyedLocks(on_idle=self._key_idle)
        # Open transcripts by SessionKey.name, least recently used first.
        self._open: OrderedDict[str, _OpenTranscript] = OrderedDict()
        self._opening = 0  # descriptors being opened: they count against max_open
        self._room = trio.lowlevel.ParkingLot()  # tasks waiting for a free slot
        self._waiting_for_room = 0
        self._gates: SessionGates[tuple[str, str]] = SessionGates()

    @property
    def open_files(self) -> int:
        """How many transcripts have a descriptor open for appending right now."""
        return len(self._open)

    # -- opening and closing -------------------------------------------------

    def _key_idle(self, name: str) -> None:
        if self._waiting_for_room and name in self._open:
            self._room.unpark_all()

    async def _make_room(self) -> None:
        """Wait until one more descriptor fits, closing idle ones, and reserve it."""
        while len(self._open) + self._opening >= self.max_open:
            victim = next((n for n in self._open if n not in self._locks), None)
            if victim is None:  # every open transcript is in use
                self._waiting_for_room += 1
                try:
                    await self._room.park()
                finally:
                    self._waiting_for_room -= 1
                continue
            # Hold the victim's lock while its summary is written, so nobody
            # reopens it halfway; the lock is free, so this does not wait.
            async with self._locks.hold(victim):
                await self._close(self._open.pop(victim))
        self._opening += 1

    async def _close(self, handle: _OpenTranscript) -> None:
        # The handle has left the open table: if this were cancelled before the
        # thread ran, nobody would close the descriptor or write the summary.
        with trio.CancelScope(shield=True):
            await trio.to_thread.run_sync(self._close_all_sync, [handle])

    def _close_all_sync(self, handles: list[_OpenTranscript]) -> None:
        for h in handles:
            _disk.close_transcript(
                self._root,
                h.key,
                h.fd,
                size=h.size,
                summary=h.summary,
                mtime_ms=h.mtime_ms,
                dirty=h.dirty,
                durable=self._durable,
            )

    def _discard(self, handle: _OpenTranscript) -> None:
        """Forget a handle whose file state is unknown; the next open rescans."""
        name = handle.key.name
        if self._open.get(name) is handle:
            del self._open[name]
        os.close(handle.fd)

    def _cached_state(self, name: str) -> TranscriptState | None:
        handle = self._open.get(name)
        if handle is not None:
            self._open.move_to_end(name)
        return handle

    async def _state_for_append(self, key: SessionKey) -> TranscriptState:
        await self._make_room()
        try:
            session = (key.project, key.session_id)
            await self._gates.enter_open(session)
            try:
                opened = await trio.to_thread.run_sync(self._open_sync, key)
                handle = _OpenTranscript(key, opened)
                if self._closed:
                    # aclose ran while this was opening: it cannot have seen it.
                    await self._close(handle)
                    raise StoreError("the store is closed")
                self._open[key.name] = handle
            finally:
                self._gates.exit_open(session)
        finally:
            self._opening -= 1
            self._room.unpark_all()
        return handle

    def _open_sync(self, key: SessionKey) -> _disk.Opened:
        try:
            return _disk.open_transcript(self._root, key, durable=self._durable)
        except OSError as exc:
            raise StoreError(f"{key}: cannot open transcript: {exc}") from exc

    # -- appending -----------------------------------------------------------

    async def _write(
        self, key: SessionKey, state: TranscriptState, fresh: list[EncodedEntry], mtime_ms: int
    ) -> None:
        assert isinstance(state, _OpenTranscript)
        data = fresh[0][2] if len(fresh) == 1 else _disk.batch_bytes([e[2] for e in fresh])
        try:
            if self._durable:
                # Written and flushed by a group-commit round in a worker
                # thread; not cancellable, so the batch is all in or all out.
                await self.group_commit.append(state.fd, state.dev, data, state.size)
            elif len(data) > _BIG_WRITE:
                # A worker thread is not interrupted by cancellation: the
                # write completes and is committed below before any checkpoint.
                await trio.to_thread.run_sync(_disk.write_all, state.fd, data, state.size)
            elif os.write(state.fd, data) != len(data):  # a short write: finish it
                _disk.write_all(state.fd, data, state.size, written=True)
        except OSError as exc:
            _disk.cut_back(state.fd, state.size)
            self._discard(state)
            raise StoreError(f"{key}: append failed: {exc}") from exc
        except StoreError:
            self._discard(state)
            raise
        state.size += len(data)
        state.dirty = True
        state.commit(fresh, mtime_ms)

    # -- reading -------------------------------------------------------------

    async def _open_for_read(self, key: SessionKey) -> tuple[FdOwner | None, int | None]:
        """An fd on ``key``'s transcript as of now, and how far to read it.

        Taken under the key's lock, so it sees whole appends only; the
        reading itself happens outside the lock.
        """
        self._check_open()
        async with self._locks.hold(key.name):
            handle = self._open.get(key.name)
            if handle is not None:
                return FdOwner(os.dup(handle.fd)), handle.size
            path = _disk.transcript_path(self._root, key)
            fd = await trio.to_thread.run_sync(_disk.open_for_read, self._root, path)
            return (None if fd is None else FdOwner(fd)), None

    async def load(self, key: SessionKey) -> list[dict[str, Any]] | None:
        """See ``SessionStore.load``."""
        owner, limit = await self._open_for_read(key)
        if owner is None:
            return None
        path = _disk.transcript_path(self._root, key)
        try:
            return await trio.to_thread.run_sync(_disk.read_all, owner, path, limit)
        finally:
            owner.close()

    async def iter_entries(self, key: SessionKey) -> AsyncIterator[dict[str, Any]]:
        """See ``SessionStore.iter_entries``."""
        owner, limit = await self._open_for_read(key)
        if owner is None:
            return
        try:
            reader = LineReader(owner.take(), _disk.transcript_path(self._root, key), limit)
            while not reader.eof:
                batch: list[Entry] = await trio.to_thread.run_sync(reader.entries)
                for entry in batch:
                    yield entry
        finally:
            owner.close()

    # -- listing -------------------------------------------------------------

    def _open_mains(self, project: str) -> dict[str, _OpenTranscript]:
        return {
            h.key.session_id: h
            for h in self._open.values()
            if h.key.project == project and h.key.subpath is None and h.size
        }

    async def list_sessions(self, project: str) -> list[SessionInfo]:
        """See ``SessionStore.list_sessions``: directory metadata, no transcript read."""
        check_name("project", project)
        self._check_open()
        listed = await trio.to_thread.run_sync(
            _disk.list_sessions, self._root, os.path.join(self._root, project)
        )
        live = self._open_mains(project)
        if live:  # their mtime is in memory until they are closed
            listed = [i for i in listed if i.session_id not in live]
            listed.extend(SessionInfo(sid, h.mtime_ms) for sid, h in live.items())
        listed.sort(key=_by_id)
        return listed

    async def list_session_summaries(self, project: str) -> list[SessionSummary]:
        """See ``SessionStore.list_session_summaries``.

        Reads summary files only; a summary found missing, corrupt or older
        than its transcript is rebuilt from the transcript and stored again.
        """
        check_name("project", project)
        self._check_open()
        good, stale = await trio.to_thread.run_sync(
            _disk.list_summaries, self._root, os.path.join(self._root, project)
        )
        by_id = {s.session_id: s for s in good}
        for sid in stale:
            key = SessionKey(project, sid)
            async with self._locks.hold(key.name):
                if key.name not in self._open:
                    try:
                        rebuilt = await trio.to_thread.run_sync(self._rebuild_sync, key)
                    except CorruptTranscript as exc:
                        # One damaged session must not hide the others: list it, flagged.
                        rebuilt = SessionSummary(
                            sid,
                            await trio.to_thread.run_sync(self._mtime_ms_sync, key),
                            problem=f"{exc}; `tak sessions repair {sid}` quarantines it",
                        )
                    if rebuilt is not None:
                        by_id[sid] = rebuilt
        for sid, handle in self._open_mains(project).items():
            assert handle.summary is not None
            by_id[sid] = SessionSummary(sid, handle.mtime_ms, handle.summary.data())
        return [by_id[sid] for sid in sorted(by_id)]

    def _mtime_ms_sync(self, key: SessionKey) -> int:
        try:
            fd = _disk.open_file(self._root, _disk.transcript_path(self._root, key), os.O_RDONLY)
            try:
                return os.fstat(fd).st_mtime_ns // 1_000_000
            finally:
                os.close(fd)
        except (OSError, StoreError):
            return 0

    def _rebuild_sync(self, key: SessionKey) -> SessionSummary | None:
        try:
            return _disk.rebuild_summary(self._root, key, durable=self._durable)
        except OSError as exc:
            raise StoreError(f"{key}: cannot rebuild summary: {exc}") from exc

    async def list_subkeys(self, key: SessionKey) -> list[str]:
        """See ``SessionStore.list_subkeys``."""
        self._check_open()
        return await trio.to_thread.run_sync(_disk.list_subkeys, self._root, key)

    # -- deleting, repairing, closing ---------------------------------------

    async def delete(self, key: SessionKey) -> bool:
        """See ``SessionStore.delete``."""
        self._check_open()
        async with self._locks.hold(key.name):
            if key.subpath is not None:
                handle = self._open.pop(key.name, None)
                if handle is not None:
                    os.close(handle.fd)
                return await trio.to_thread.run_sync(self._delete_sync, key)
            session = (key.project, key.session_id)
            await self._gates.enter_delete(session)
            try:
                async with contextlib.AsyncExitStack() as stack:
                    # Appends to children in flight finish first; no child
                    # transcript opens again until the directory is gone.
                    children = sorted(
                        n for n, h in self._open.items() if h.key.main == key and n != key.name
                    )
                    for name in children:
                        await stack.enter_async_context(self._locks.hold(name))
                    for name in [n for n, h in self._open.items() if h.key.main == key]:
                        os.close(self._open.pop(name).fd)
                    return await trio.to_thread.run_sync(self._delete_sync, key)
            finally:
                self._gates.exit_delete(session)

    def _delete_sync(self, key: SessionKey) -> bool:
        try:
            if key.subpath is None:
                return _disk.delete_session(self._root, key, durable=self._durable)
            return _disk.delete_subkey(self._root, key, durable=self._durable)
        except OSError as exc:
            raise StoreError(f"{key}: delete failed: {exc}") from exc

    async def repair(self, key: SessionKey) -> RepairReport | None:
        """Make ``key``'s transcript readable again, keeping every byte somewhere.

        A torn last line is cut off. Damage before that moves the whole file
        to ``<session>/quarantine/<time>/`` and leaves the lines before the
        first damaged one in its place. Returns ``None`` if there is no
        transcript.

        Raises:
            StoreError: the file system refused.
        """
        self._check_open()
        async with self._locks.hold(key.name):
            handle = self._open.pop(key.name, None)
            if handle is not None:
                await self._close(handle)
            try:
                return await trio.to_thread.run_sync(self._repair_sync, key)
            except OSError as exc:
                raise StoreError(f"{key}: repair failed: {exc}") from exc

    def _repair_sync(self, key: SessionKey) -> RepairReport | None:
        return _disk.repair_transcript(self._root, key, durable=self._durable)

    async def aclose(self) -> None:
        """Close every transcript, writing summaries and mtimes; refuse further use."""
        if self._closed:
            return
        self._closed = True
        with trio.CancelScope(shield=True):
            while self._open:
                async with contextlib.AsyncExitStack() as stack:
                    names = [n for n in self._open if n not in self._locks]
                    if not names:  # all in use: wait for an append in flight
                        names = [next(iter(self._open))]
                    for name in names:
                        await stack.enter_async_context(self._locks.hold(name))
                    closing = [h for n in names if (h := self._open.pop(n, None))]
                    await trio.to_thread.run_sync(self._close_all_sync, closing)


def _by_id(info: SessionInfo) -> str:
    return info.session_id
