"""What every backend shares: the append path, the key locks, the mtime clock."""

from __future__ import annotations

import abc
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from types import TracebackType
from typing import Any, Self

import trio

from ..errors import StoreError, UsageError
from ._entries import EncodedEntry, encode_entries
from ._key import SessionKey
from ._locks import KeyedLocks, LockEntry
from ._summary import SessionInfo, SessionSummary, SummaryBuilder

# Longest stretch of back-to-back appends before one of them yields to the
# scheduler. Every append is a cancel point; making each one a schedule point
# too would cost more than the write itself (see bench/bench_store.py).
_YIELD_INTERVAL_S = 0.001


def check_start(start: int) -> None:
    """Refuse a ``start`` position ``iter_entries`` cannot mean.

    Raises:
        UsageError: ``start`` is negative or not an int.
    """
    # bool is an int in Python: refuse it with the rest.
    if not isinstance(start, int) or isinstance(start, bool) or start < 0:
        raise UsageError(f"start: expected a position of 0 or more, got {start!r}")


def epoch_ms() -> int:
    """The default store clock: wall-clock time in epoch milliseconds."""
    return time.time_ns() // 1_000_000


class TranscriptState:
    """What a store keeps in memory about one transcript it is writing."""

    __slots__ = ("mtime_ms", "summary", "uuids")

    def __init__(self, *, summary: SummaryBuilder | None, uuids: set[str], mtime_ms: int) -> None:
        self.summary = summary  # main transcripts only
        self.uuids = uuids
        self.mtime_ms = mtime_ms

    def fresh(self, batch: list[EncodedEntry]) -> list[EncodedEntry]:
        """The entries of ``batch`` whose uuid is not stored yet."""
        uuids = self.uuids
        for e in batch:
            if e[1] is not None and e[1] in uuids:
                return [e for e in batch if e[1] is None or e[1] not in uuids]
        return batch

    def commit(self, fresh: list[EncodedEntry], mtime_ms: int) -> None:
        """Record that ``fresh`` is stored, stamped ``mtime_ms``."""
        summary = self.summary
        uuids = self.uuids
        for entry, uuid, _ in fresh:
            if uuid is not None:
                uuids.add(uuid)
            if summary is not None:
                summary.add(entry)
        self.mtime_ms = mtime_ms


class _Queued:
    """A batch waiting for its key's lock, for the holder to write with its own."""

    __slots__ = ("batch", "error", "lock", "taken")

    def __init__(self, batch: list[EncodedEntry]) -> None:
        self.batch = batch
        self.taken = False
        self.error: StoreError | None = None
        self.lock: LockEntry | None = None  # the key's lock, when not taken and now held


def _joined(first: list[EncodedEntry], rest: list[list[EncodedEntry]]) -> list[EncodedEntry]:
    """Batches as one, in order; the first of several entries with one uuid wins."""
    seen = {e[1] for e in first if e[1] is not None}
    out = list(first)
    for batch in rest:
        for e in batch:
            uuid = e[1]
            if uuid is not None:
                if uuid in seen:
                    continue
                seen.add(uuid)
            out.append(e)
    return out


def _fail(queued: list[_Queued] | None, exc: BaseException) -> None:
    """The holder's write failed: so did the batches it took."""
    for q in queued or ():
        # One exception each: raised from several tasks, one instance would
        # gather all their tracebacks.
        q.error = StoreError(str(exc) if isinstance(exc, StoreError) else f"append failed: {exc!r}")
        q.error.__cause__ = exc


class ClosableStore(abc.ABC):
    """What every backend shares: ``async with`` closes it, and use after ``aclose`` fails."""

    _closed: bool = False

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    @abc.abstractmethod
    async def aclose(self) -> None:
        """Release what the store holds; finishes even when cancelled."""

    def _check_open(self) -> None:
        if self._closed:
            raise StoreError("the store is closed")


class BaseStore(ClosableStore):
    """The append algorithm and locking, over a backend's ``_state_for_append``/``_write``."""

    def __init__(self, *, clock: Callable[[], int] | None = None) -> None:
        self._locks: KeyedLocks[str] = KeyedLocks()  # by SessionKey.name
        self._clock = clock if clock is not None else epoch_ms
        self._next_yield = 0.0
        # Whether every append that writes parks anyway (FileStore's group
        # commit): then append yields only when it wrote nothing, and a
        # writer's next append follows its last without a scheduler turn,
        # which lets it rejoin a lingering session flock (SessionFlock).
        # Appends that wait for a key's lock meanwhile leave their batches
        # here, by key name, and the holder writes them with its own: one
        # write and one round for all of them, not one round each.
        self._writes_park = False
        self._queued: dict[str, list[_Queued]] = {}
        self._closed = False

    async def append(self, key: SessionKey, entries: Sequence[Mapping[str, Any]]) -> None:
        """See ``SessionStore.append``."""
        batch = encode_entries(entries)
        # Always a cancel point; a schedule point at least once per
        # _YIELD_INTERVAL_S of back-to-back calls.
        now = time.perf_counter()
        if now >= self._next_yield and not self._writes_park:
            self._next_yield = now + _YIELD_INTERVAL_S
            await trio.lowlevel.checkpoint()
        else:
            await trio.lowlevel.checkpoint_if_cancelled()
        if self._closed:
            raise StoreError("the store is closed")
        if not batch:
            if self._writes_park:
                await trio.lowlevel.cancel_shielded_checkpoint()  # it yields no other way
            return
        # locks.hold(name) spelled out: this is the hot path.
        locks = self._locks
        name = key.name
        lock = locks.acquire_nowait(name)
        if lock is None:
            if not self._writes_park:
                lock = await locks.acquire(name)
            else:
                mine = await self._wait_queued(name, batch)
                if mine.taken:  # written (or failed) by the holder it waited for
                    if mine.error is not None:
                        raise mine.error
                    return
                lock = mine.lock
                assert lock is not None
        try:
            if self._closed:  # closed while this append waited for the lock
                raise StoreError("the store is closed")
            state = self._cached_state(name)
            if state is None:
                state = await self._state_for_append(key)
            queued = self._queued.pop(name, None) if self._writes_park else None
            if queued:
                for q in queued:
                    q.taken = True
                batch = _joined(batch, [q.batch for q in queued])
            try:
                fresh = state.fresh(batch)
            except BaseException as exc:
                _fail(queued, exc)
                raise
            if fresh:
                mtime_ms = max(self._clock(), state.mtime_ms + 1)
                # Nothing between here and the state's commit inside _write
                # may be a checkpoint that can raise Cancelled before the
                # bytes are written: that is what makes append all-or-nothing.
                try:
                    await self._write(key, state, fresh, mtime_ms)
                except BaseException as exc:
                    _fail(queued, exc)
                    raise
        finally:
            locks.release(name, lock)
        if not fresh and self._writes_park:
            await trio.lowlevel.cancel_shielded_checkpoint()  # the park it did not make

    async def _wait_queued(self, name: str, batch: list[EncodedEntry]) -> _Queued:
        """Wait for ``name``'s lock with ``batch`` left for its holder to take.

        Returns the queued record: ``taken`` (the holder wrote the batch with
        its own, or failed to: ``error``), or not taken and holding ``lock``.
        Cancelled before the batch is taken, nothing of it is written; after,
        it is written or not with the holder's, all of it or none.
        """
        mine = _Queued(batch)
        queue = self._queued.setdefault(name, [])
        queue.append(mine)
        try:
            lock = await self._locks.acquire(name)
        except BaseException:
            if not mine.taken:
                queue.remove(mine)
                if not queue and self._queued.get(name) is queue:
                    del self._queued[name]
            raise
        if mine.taken:
            self._locks.release(name, lock)
            return mine
        # Not taken: the holders before this one wrote nothing (each takes
        # the queue only once it has its state), or this store is closing.
        queue.remove(mine)
        if not queue and self._queued.get(name) is queue:
            del self._queued[name]
        mine.lock = lock
        return mine

    def _cached_state(self, name: str) -> TranscriptState | None:
        """The state of the transcript named ``name`` if it is at hand without waiting."""
        return None

    @abc.abstractmethod
    async def _state_for_append(self, key: SessionKey) -> TranscriptState:
        """The state of ``key``'s transcript, opening (or creating) it if needed."""

    @abc.abstractmethod
    async def _write(
        self, key: SessionKey, state: TranscriptState, fresh: list[EncodedEntry], mtime_ms: int
    ) -> None:
        """Store ``fresh`` after ``state``'s entries, then ``state.commit`` it."""

    @abc.abstractmethod
    async def load(self, key: SessionKey) -> list[dict[str, Any]] | None: ...

    async def iter_entries(
        self, key: SessionKey, *, start: int = 0
    ) -> AsyncIterator[dict[str, Any]]:
        """See ``SessionStore.iter_entries``.

        This default loads the whole transcript and skips to ``start``: right
        for any backend, but as slow as ``load``. Backends override it.
        """
        check_start(start)
        entries = await self.load(key)
        for entry in (entries or [])[start:]:
            yield entry

    @abc.abstractmethod
    async def list_sessions(self, project: str) -> list[SessionInfo]: ...

    @abc.abstractmethod
    async def list_session_summaries(self, project: str) -> list[SessionSummary]: ...

    @abc.abstractmethod
    async def delete(self, key: SessionKey) -> bool: ...

    @abc.abstractmethod
    async def list_subkeys(self, key: SessionKey) -> list[str]: ...
