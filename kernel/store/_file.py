"""``FileStore``: JSONL transcripts on disk, the embedded default."""

from __future__ import annotations

import contextlib
import math
import os
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable, Container
from pathlib import Path
from typing import Any, Literal, TypeAlias

import trio

from ..errors import CorruptTranscript, StoreError, UsageError
from . import _disk
from ._base import BaseStore, TranscriptState, check_start
from ._commit import GroupCommit
from ._disk import FdOwner, LineReader, Position, RepairReport
from ._entries import EncodedEntry, Entry
from ._key import SessionKey, check_name
from ._locks import KeyedLocks, SessionFlock, SessionGates, lock_holders, open_turnstile
from ._summary import SessionInfo, SessionSummary

Durability: TypeAlias = Literal["flush", "fsync"]

# Appends bigger than this are written from a worker thread.
_BIG_WRITE = 64 * 1024
# Bytes iter_entries decodes per trip to a worker thread.
_CHUNK = 1 << 20
# Read positions remembered for iter_entries(start=...).
_POSITIONS_MAX = 4096


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
    __slots__ = (
        "dev",
        "dirty",
        "fd",
        "hold",
        "ino",
        "key",
        "last_len",
        "lines",
        "path",
        "release",
        "session",
        "size",
        "used",
    )

    def __init__(
        self,
        key: SessionKey,
        path: str,
        opened: _disk.Opened,
        session: SessionFlock,
        release: Callable[[SessionFlock], None],
    ) -> None:
        super().__init__(summary=opened.summary, uuids=opened.uuids, mtime_ms=opened.mtime_ms)
        self.key = key
        self.path = path
        self.fd = opened.fd
        self.dev = opened.dev
        self.ino = opened.ino
        self.size = opened.size  # the end of the last whole append, as of the last look
        self.lines = opened.lines
        # Bytes of the line ending at ``size`` (0: unknown): iter_entries(start=
        # lines - 1), which HistoryCache does after each append, starts there.
        self.last_len = opened.last_len
        self.dirty = opened.summary_dirty  # mtime and summary not yet on disk
        self.session = session  # its flock is held from _state_for_append to _write
        self.hold = -1  # the session's hold in which this file was last checked
        self.release = release
        self.used = trio.current_time()  # opened, then last appended to (close_idle)

    def fresh(self, batch: list[EncodedEntry]) -> list[EncodedEntry]:
        fresh = super().fresh(batch)
        if not fresh:
            # BaseStore.append calls _write only when something is fresh: the
            # session lock _state_for_append took is given back here instead.
            self.release(self.session)
        return fresh


class FileStore(BaseStore):
    """Transcripts as JSONL files under ``root`` (layout: ``kernel.store._disk``).

    Several processes may use one root: each append, delete and repair holds
    an exclusive ``flock`` on the session directory (``SessionFlock``), checks
    that its file is still the one at the path, and first takes in what
    other processes appended (their uuids, their summary counts); readers
    take no lock and read whole appends only (docs/store.md, "Many
    processes"). Each append is one ``write()`` of
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
        self._writes_park = self._durable  # in a group-commit round
        self._locks = KeyedLocks(on_idle=self._key_idle)
        # Open transcripts by SessionKey.name, least recently used first.
        self._open: OrderedDict[str, _OpenTranscript] = OrderedDict()
        self._opening = 0  # descriptors being opened: they count against max_open
        self._room = trio.lowlevel.ParkingLot()  # tasks waiting for a free slot
        self._waiting_for_room = 0
        self._gates: SessionGates[tuple[str, str]] = SessionGates()
        # Session directory locks by (project, session_id), while this process
        # has a transcript of the session open or holds the lock.
        self._sessions: dict[tuple[str, str], SessionFlock] = {}
        # The end of the last append read by iter_entries, per key name;
        # checked against the file before use. Oldest first, bounded.
        self._positions: dict[str, Position] = {}

    @property
    def open_files(self) -> int:
        """How many transcripts have a descriptor open for appending right now."""
        return len(self._open)

    # -- opening and closing -------------------------------------------------

    def _key_idle(self, name: str) -> None:
        # Every way a slot frees ends here: a transcript left open is now a
        # victim, and one taken out of the open table (delete, repair, a file
        # found replaced, a buried session) was taken out under some key's
        # lock, whose release comes here too. Waking only for the first left
        # an opener parked for good after a delete closed the last slot.
        if self._waiting_for_room and (
            name in self._open or len(self._open) + self._opening < self.max_open
        ):
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
        await self._close_all([handle])

    async def _close_all(self, handles: list[_OpenTranscript]) -> None:
        """Close ``handles`` (already out of the open table), writing their summaries."""
        # Session bookkeeping stays on the Trio thread: _forget may close the
        # session's directory descriptor, and done from the worker thread it
        # raced with tasks taking that session's flock meanwhile (EBADF, or a
        # flock on whatever file next got the descriptor's number).
        for h in handles:
            self._forget(h)
        # The handles have left the open table: if this were cancelled before the
        # thread ran, nobody would close the descriptors or write the summaries.
        with trio.CancelScope(shield=True):
            await trio.to_thread.run_sync(self._close_all_sync, handles)

    def _close_all_sync(self, handles: list[_OpenTranscript]) -> None:
        # Each is closed whatever happened to the one before: the handles have
        # left the open table, and a descriptor skipped here is leaked for good
        # (close_idle runs again and again in a long-running process).
        first: BaseException | None = None
        for h in handles:
            try:
                self._close_one_sync(h)
            except BaseException as exc:
                first = first or exc
        if first is not None:
            raise first

    def _close_one_sync(self, h: _OpenTranscript) -> None:
        # The summary goes in the session's directory by name: when another
        # process deleted this transcript (and maybe started the session
        # again), ours describes a file that is gone, and put beside its
        # successor it was taken for the new one's (same size, same
        # millisecond). So only for the file still at the path.
        dirty = h.dirty
        if dirty:
            try:
                st = _disk.transcript_stat(h.path)
            except OSError:
                st = None
            dirty = st is not None and (st.st_dev, st.st_ino) == (h.dev, h.ino)
        # close_transcript closes the descriptor whatever else fails.
        _disk.close_transcript(
            self._root,
            h.key,
            h.fd,
            size=h.size,
            summary=h.summary,
            mtime_ms=h.mtime_ms,
            dirty=dirty,
            durable=self._durable,
            lines=h.lines,
            last_len=h.last_len,
            uuids=h.uuids,
        )

    def _discard(self, handle: _OpenTranscript) -> None:
        """Forget a handle whose file state is unknown; the next open rescans."""
        name = handle.key.name
        if self._open.get(name) is handle:
            del self._open[name]
        self._forget(handle)
        os.close(handle.fd)

    def _forget(self, handle: _OpenTranscript) -> None:
        """``handle`` has left the open table: it no longer keeps its session lock alive."""
        session = handle.session
        session.handles -= 1
        self._tidy(session)

    def _tidy(self, session: SessionFlock) -> None:
        if session.waiters:  # the task waiting comes back here when it is done
            return
        if session.holders == 0 and (session.handles == 0 or session.dead):
            if session.handles == 0:  # a dead session's handles may still be closing
                session.close()
            for sk, s in list(self._sessions.items()):
                if s is session:
                    del self._sessions[sk]

    def _release(self, session: SessionFlock) -> None:
        session.release()
        if session.holders == 0 and (session.handles == 0 or session.dead):
            self._tidy(session)  # (waiters: see _tidy)

    async def _lock_session(self, key: SessionKey, *, create: bool = True) -> SessionFlock | None:
        """Hold the flock of ``key``'s session directory (``None``: no session, not ``create``).

        A new lock is checked to be on the directory that is at the session's
        path (a lock on a directory deleted meanwhile protects nothing); a
        known one is checked by the caller, when the file it wants is not
        where it was.

        Raises:
            StoreError: the directory cannot be opened or locked.
        """
        sk = (key.project, key.session_id)
        while True:
            session = self._sessions.get(sk)
            if session is not None and not session.dead:
                if not session.try_acquire():
                    try:
                        await session.acquire()
                    except BaseException:
                        self._tidy(session)  # its last user may have left meanwhile
                        raise
                if self._sessions.get(sk) is session:  # not buried while waiting
                    return session
                self._release(session)
                continue
            try:
                session = await trio.to_thread.run_sync(self._open_session_sync, key, create)
            except FileNotFoundError:
                return None
            known = self._sessions.get(sk)
            if known is not None and not known.dead:  # another task was quicker
                session.close()
                continue
            self._sessions[sk] = session
            try:
                if not session.try_acquire():
                    await session.acquire()
            except BaseException:
                self._tidy(session)
                raise
            if _disk.session_is_at(self._root, key, session.fd):
                return session
            self._bury(session)  # deleted between the open and the lock
            self._release(session)

    def _open_session_sync(self, key: SessionKey, create: bool) -> SessionFlock:
        try:
            fd = _disk.open_session_dir(self._root, key, create=create, durable=self._durable)
        except NotADirectoryError as exc:
            raise FileNotFoundError(str(exc)) from None
        except FileNotFoundError:
            raise
        except OSError as exc:
            raise StoreError(f"{key}: cannot open the session directory: {exc}") from exc
        try:
            _disk.sweep_leftovers(fd)
            st = os.fstat(fd)
            turnstile = open_turnstile(fd)
        except BaseException:
            os.close(fd)
            raise
        return SessionFlock(fd, st.st_dev, st.st_ino, turnstile=turnstile)

    def _bury(self, session: SessionFlock) -> None:
        """``session``'s directory was deleted by another process: forget its transcripts.

        Called with the lock held, so no append of this process is writing to
        them (each checked its file after taking the lock).
        """
        session.dead = True
        for sk, s in list(self._sessions.items()):
            if s is session:
                del self._sessions[sk]
        for name, h in list(self._open.items()):
            if h.session is session:
                del self._open[name]
                session.handles -= 1
                os.close(h.fd)  # no summary: the file is gone

    async def _state_for_append(self, key: SessionKey) -> TranscriptState:
        """``key``'s transcript, current, with its session lock held (``_write``
        or ``fresh`` gives it back)."""
        name = key.name
        handle = self._open.get(name)
        if handle is not None:
            # The hot path, spelled out: lock, check the file at the path is
            # still ours and no longer than we know, go.
            session = handle.session
            if session.try_acquire():
                if handle.hold == session.hold:  # checked since the flock was taken
                    self._open.move_to_end(name)
                    return handle
                try:
                    st = os.stat(handle.path, follow_symlinks=False)
                except OSError:
                    st = None
                if (
                    st is not None
                    and st.st_size == handle.size
                    and st.st_ino == handle.ino
                    and st.st_dev == handle.dev
                ):
                    handle.hold = session.hold
                    self._open.move_to_end(name)
                    return handle
                self._release(session)
        # A descriptor slot is reserved before the session is locked, so that
        # the session descriptors of tasks waiting for room stay bounded too.
        reserved = name not in self._open
        if reserved:
            await self._make_room()
        try:
            return await self._locked_state(key, reserved)
        finally:
            if reserved:
                self._opening -= 1
                self._room.unpark_all()

    async def _locked_state(self, key: SessionKey, reserved: bool) -> _OpenTranscript:
        name = key.name
        while True:
            session = await self._lock_session(key)
            assert session is not None
            try:
                handle = self._open.get(name)
                if handle is not None:
                    self._open.move_to_end(name)
                    st = _disk.transcript_stat(handle.path)
                    if (
                        st is not None
                        and st.st_ino == handle.ino
                        and st.st_dev == handle.dev
                        and st.st_size >= handle.size
                    ):
                        if st.st_size != handle.size:  # another process appended
                            await self._catch_up(handle, st.st_size)
                        handle.hold = session.hold
                        return handle
                    # Another file at the path, or none: ours was deleted or
                    # replaced (by `tak sessions rm` or `repair` elsewhere).
                    del self._open[name]
                    self._forget(handle)
                    os.close(handle.fd)
                if not _disk.session_is_at(self._root, key, session.fd):
                    self._bury(session)
                    self._release(session)
                    continue
                if not reserved:
                    await self._make_room()
                    try:
                        handle = await self._open_handle(key, session)
                    finally:
                        self._opening -= 1
                        self._room.unpark_all()
                else:
                    handle = await self._open_handle(key, session)
                handle.hold = session.hold
                self._open[name] = handle
                return handle
            except BaseException:
                self._release(session)
                raise

    async def _catch_up(self, handle: _OpenTranscript, size: int) -> None:
        """Take in the appends other processes made since ``handle.size``."""
        args = (handle.fd, handle.path, handle.size, handle.lines)
        if size - handle.size > _BIG_WRITE:
            tail = await trio.to_thread.run_sync(
                lambda: _disk.read_tail(*args, durable=self._durable)
            )
        else:
            tail = _disk.read_tail(*args, durable=self._durable)
        uuids = handle.uuids
        summary = handle.summary
        for entry in tail.entries:
            uuid = entry.get("uuid")
            if isinstance(uuid, str):
                uuids.add(uuid)
            if summary is not None:
                summary.add(entry)
        handle.size = tail.end
        handle.lines = tail.lines
        if tail.last_len:
            handle.last_len = tail.last_len
        handle.mtime_ms = max(handle.mtime_ms, tail.mtime_ms)
        handle.dirty = True

    async def _open_handle(self, key: SessionKey, session: SessionFlock) -> _OpenTranscript:
        """Open ``key``'s transcript in a slot reserved by ``_make_room``."""
        sk = (key.project, key.session_id)
        await self._gates.enter_open(sk)
        try:
            opened = await trio.to_thread.run_sync(self._open_sync, key)
            path = _disk.transcript_path(self._root, key)
            session.handles += 1
            handle = _OpenTranscript(key, path, opened, session, self._release)
            if self._closed:
                # aclose ran while this was opening: it cannot have seen it.
                await self._close(handle)
                raise StoreError("the store is closed")
        finally:
            self._gates.exit_open(sk)
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
        session = state.session
        data = fresh[0][2] if len(fresh) == 1 else _disk.batch_bytes([e[2] for e in fresh])
        try:
            if len(data) > _BIG_WRITE:
                # A worker thread is not interrupted by cancellation: the
                # write completes and is committed below before any checkpoint.
                await trio.to_thread.run_sync(_disk.write_all, state.fd, data, state.size)
            elif os.write(state.fd, data) != len(data):  # a short write: finish it
                _disk.write_all(state.fd, data, state.size, written=True)
            if self._durable:
                # Flushed by a group-commit round in a worker thread; not
                # cancellable, so the batch is all in or all out.
                await self.group_commit.sync(state.fd, state.dev, state.size)
        except OSError as exc:
            _disk.cut_back(state.fd, state.size)
            self._discard(state)
            raise StoreError(f"{key}: append failed: {exc}") from exc
        except StoreError:
            self._discard(state)
            raise
        finally:
            self._release(session)  # the bytes are in (or cut back): others may look
        state.size += len(data)
        state.lines += len(fresh)
        state.last_len = len(fresh[-1][2])  # an append's last line has no leading space
        state.dirty = True
        state.used = trio.current_time()
        state.commit(fresh, mtime_ms)

    # -- reading -------------------------------------------------------------

    async def _open_for_read(self, key: SessionKey) -> FdOwner | None:
        """An fd on the file at ``key``'s transcript path now.

        No lock: another process may be half-way through an append, and
        ``LineReader`` stops before whatever follows the last whole one. The
        file at the path, not a descriptor this process holds: another
        process may have replaced it (repair) or deleted it.
        """
        self._check_open()
        path = _disk.transcript_path(self._root, key)
        fd = await trio.to_thread.run_sync(_disk.open_for_read, self._root, path)
        return None if fd is None else FdOwner(fd)

    async def load(self, key: SessionKey) -> list[dict[str, Any]] | None:
        """See ``SessionStore.load``."""
        owner = await self._open_for_read(key)
        if owner is None:
            return None
        path = _disk.transcript_path(self._root, key)
        try:
            return await trio.to_thread.run_sync(_disk.read_all, owner, path, None)
        finally:
            owner.close()

    async def iter_entries(
        self, key: SessionKey, *, start: int = 0
    ) -> AsyncIterator[dict[str, Any]]:
        """See ``SessionStore.iter_entries``.

        Starts reading at the byte offset of the last position this process
        knows at or before ``start`` (from its own appends or an earlier
        read of the same file), and decodes nothing before ``start``.
        """
        check_start(start)
        owner = await self._open_for_read(key)
        if owner is None:
            return
        name = key.name
        try:
            fd = owner.take()
            handle = self._open.get(name)
            own = (
                None
                if handle is None
                else (handle.dev, handle.ino, handle.lines, handle.size, handle.last_len)
            )
            remembered = self._positions.get(name)
            reader = await trio.to_thread.run_sync(
                self._reader_sync,
                fd,
                _disk.transcript_path(self._root, key),
                start,
                own,
                remembered,
            )
            while not reader.eof:
                batch: list[Entry] = await trio.to_thread.run_sync(reader.entries, _CHUNK, start)
                for entry in batch:
                    yield entry
            position = _disk.position_of(os.fstat(fd), reader)
            if position is not None:
                self._remember(name, position)
        finally:
            owner.close()

    @staticmethod
    def _reader_sync(
        fd: int,
        path: str,
        start: int,
        own: tuple[int, int, int, int, int] | None,
        remembered: Position | None,
    ) -> LineReader:
        """A reader of ``fd`` from the furthest known line start at or before entry
        ``start``; from the file's start when none is known.

        Known are the end of this process's own appends (``own``: the file's
        identity, entries, bytes, and the length of the last line; true of the
        file as long as this process holds it open, which it did when ``own`` was
        taken with ``fd`` open) and the end of an earlier read (``remembered``;
        checked against the file: the inode of a deleted file is reused, and
        identity and size prove nothing). Each also gives the start of the line
        ending there, so ``start`` one entry before a known end (HistoryCache
        re-reads the last entry it folded) starts there, not at the file's start.
        An append's last line never begins with a space, so ``LineReader`` takes
        it whole from its start even when it ends an append of several lines.
        """
        st = os.fstat(fd)
        best = (0, 0)

        def consider(lines: int, end: int, last_len: int) -> None:
            nonlocal best
            if lines <= start:
                at = (lines, end)
            elif lines == start + 1 and last_len:
                at = (start, end - last_len)
            else:
                return
            if at[0] > best[0]:
                best = at

        if own is not None:
            dev, ino, lines, size, last_len = own
            if (st.st_dev, st.st_ino) == (dev, ino) and size <= st.st_size:
                consider(lines, size, last_len)
        if (
            remembered is not None
            and best[0] < min(remembered.lines, start)
            and remembered.lines <= start + 1
            and _disk.position_holds(fd, st, remembered)
        ):
            consider(remembered.lines, remembered.offset, remembered.line_len)
        return LineReader(fd, path, start=best[1], lineno=best[0])

    def _remember(self, name: str, position: Position) -> None:
        positions = self._positions
        positions.pop(name, None)
        positions[name] = position
        if len(positions) > _POSITIONS_MAX:
            del positions[next(iter(positions))]

    def _forget_positions(self, key: SessionKey) -> None:
        """Drop what iter_entries remembers of ``key`` (and of its children when it is
        a main transcript): deleted here, whatever comes next at its path is new."""
        self._positions.pop(key.name, None)
        if key.subpath is None:
            children = key.name + ":"
            for name in [n for n in self._positions if n.startswith(children)]:
                del self._positions[name]

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
                            problem=f"{exc}; repairing the session quarantines it",
                        )
                    if rebuilt is not None:
                        by_id[sid] = rebuilt
        for sid, handle in self._open_mains(project).items():
            assert handle.summary is not None
            by_id[sid] = SessionSummary(sid, handle.mtime_ms, handle.summary.data())
        return [by_id[sid] for sid in sorted(by_id)]

    def _mtime_ms_sync(self, key: SessionKey) -> int:
        try:
            fd = _disk.open_regular(self._root, _disk.transcript_path(self._root, key), os.O_RDONLY)
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
        """See ``SessionStore.delete``.

        Holds the session's lock: waits while another process is appending to
        it (wrap the call in a cancel scope to bound the wait; ``lock_holders``
        names who holds it).
        """
        self._check_open()
        async with self._locks.hold(key.name):
            session = await self._lock_session(key, create=False)
            if session is None:
                return False
            try:
                if key.subpath is not None:
                    handle = self._open.pop(key.name, None)
                    if handle is not None:
                        self._forget(handle)
                        os.close(handle.fd)
                    return await trio.to_thread.run_sync(self._delete_sync, key)
                return await self._delete_session(key, session)
            finally:
                self._forget_positions(key)
                self._release(session)

    async def _delete_session(self, key: SessionKey, session: SessionFlock) -> bool:
        sk = (key.project, key.session_id)
        await self._gates.enter_delete(sk)
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
                    handle = self._open.pop(name)
                    self._forget(handle)
                    os.close(handle.fd)
                deleted = await trio.to_thread.run_sync(self._delete_sync, key)
                self._bury(session)
                return deleted
        finally:
            self._gates.exit_delete(sk)

    async def lock_holders(self, key: SessionKey) -> list[int]:
        """The pids holding ``key``'s session lock now (Linux; empty if unknown)."""
        self._check_open()

        def holders() -> list[int]:
            try:
                fd = _disk.open_session_dir(self._root, key, create=False, durable=False)
            except (OSError, StoreError):
                return []
            try:
                return lock_holders(fd)
            finally:
                os.close(fd)

        return await trio.to_thread.run_sync(holders)

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
        transcript. Holds the session's lock, like ``delete``.

        Raises:
            StoreError: the file system refused.
        """
        self._check_open()
        async with self._locks.hold(key.name):
            session = await self._lock_session(key, create=False)
            if session is None:
                return None
            try:
                handle = self._open.pop(key.name, None)
                if handle is not None:
                    await self._close(handle)
                return await trio.to_thread.run_sync(self._repair_sync, key)
            except OSError as exc:
                raise StoreError(f"{key}: repair failed: {exc}") from exc
            finally:
                self._release(session)

    def _repair_sync(self, key: SessionKey) -> RepairReport | None:
        return _disk.repair_transcript(self._root, key, durable=self._durable)

    async def close_idle(
        self, *, keep: int, used_before: float = -math.inf, busy: Container[str] = ()
    ) -> int:
        """Close the descriptors of transcripts nobody is appending to now: those
        last appended to (or opened) before ``used_before`` (a ``trio.current_time()``),
        and the least recently used beyond the ``keep`` most recent of them (those
        in use are not counted). Returns how many were closed. Kept, besides those with an append in flight: the
        transcripts of the sessions whose main transcript's name
        (``SessionKey.name``) is in ``busy``.

        Their summaries and mtimes are written, as ``aclose`` does; the next
        append to one opens it again (its checkpoint and tail are read, not the
        whole file). ``max_open`` bounds the descriptors an append may need; this
        lets a long-running process give back those of sessions it is done with
        (``kernel.kernel.IdleSessions``).
        """
        if self._closed:
            return 0
        # keep counts idle transcripts: those in use are kept besides them.
        idle = [
            (name, handle)
            for name, handle in self._open.items()
            if name not in self._locks and name.partition(":")[0] not in busy
        ]
        excess = len(idle) - keep
        victims = [
            name
            for at, (name, handle) in enumerate(idle)
            if at < excess or handle.used < used_before
        ]
        if not victims:
            return 0
        async with contextlib.AsyncExitStack() as stack:
            # Free locks are taken without yielding: nobody appends to these meanwhile.
            for name in victims:
                await stack.enter_async_context(self._locks.hold(name))
            closing = [h for n in victims if (h := self._open.pop(n, None)) is not None]
            await self._close_all(closing)
        return len(closing)

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
                    await self._close_all(closing)


def _by_id(info: SessionInfo) -> str:
    return info.session_id
