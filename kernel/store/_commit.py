"""Group commit: durable appends share write-and-fsync rounds."""

from __future__ import annotations

import ctypes
import os
import threading
from collections.abc import Callable, Sequence

import trio

from ..errors import StoreError
from ._disk import cut_back, write_all

# Below this many files in a round, fdatasync each; from it on, one syncfs()
# per file system is cheaper than a journal commit per file.
SYNCFS_MIN_FILES = 8

_fdatasync = getattr(os, "fdatasync", os.fsync)


def _load_syncfs() -> Callable[[int], int] | None:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.syncfs
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int]
    fn.restype = ctypes.c_int
    syncfs: Callable[[int], int] = fn
    return syncfs


_syncfs: Callable[[int], int] | None = None
_syncfs_loaded = False


def sync_files(fds: Sequence[int], devices: Sequence[int]) -> None:
    """Make every write to ``fds`` (on file systems ``devices``) durable, in as
    few flushes as possible.

    Raises:
        OSError: a flush failed; some of the data may not be durable.
    """
    global _syncfs, _syncfs_loaded
    if len(fds) >= SYNCFS_MIN_FILES:
        if not _syncfs_loaded:
            _syncfs, _syncfs_loaded = _load_syncfs(), True
        if _syncfs is not None:
            for fd in dict(zip(devices, fds, strict=True)).values():  # one fd per device
                if _syncfs(fd) != 0:
                    err = ctypes.get_errno()
                    raise OSError(err, os.strerror(err))
            return
    for fd in fds:
        _fdatasync(fd)


class _Write:
    __slots__ = ("data", "dev", "error", "fd", "size_before", "task")

    def __init__(
        self, fd: int, dev: int, data: bytes, size_before: int, task: trio.lowlevel.Task
    ) -> None:
        self.fd = fd
        self.dev = dev
        self.data = data
        self.size_before = size_before
        self.task = task
        self.error: StoreError | None = None


def _refuse(_: trio.lowlevel.RaiseCancelT) -> trio.lowlevel.Abort:
    return trio.lowlevel.Abort.FAILED  # a round always finishes: wait for it


class GroupCommit:
    """Durable appends in rounds: a worker thread writes the appends waiting
    for it, flushes them all at once, and takes the next round.

    Appends that arrive while a round is being flushed make up the next
    round, so N sessions appending at once pay a few flushes, not N
    sequential fsyncs. The thread runs only while appends wait for it, and
    each append is woken once, by the end of its round. Writing in the
    worker keeps the Trio thread off files in the middle of a flush (a write
    can wait for the journal commit a flush makes).
    """

    def __init__(self, sync: Callable[[Sequence[int], Sequence[int]], None] = sync_files) -> None:
        self._sync = sync
        self._lock = threading.Lock()  # guards _pending and _working
        self._pending: list[_Write] = []
        self._working = False
        self.rounds = 0  # completed rounds, for tests and benchmarks

    async def append(self, fd: int, dev: int, data: bytes, size_before: int) -> None:
        """Write ``data`` at the end of ``fd`` (one ``write()``) and return once durable.

        ``dev`` is the device of ``fd``'s file system (``st_dev``).

        Not cancellable: a round, once joined, finishes, and the caller must
        keep ``fd`` open and unwritten-to until then. A cancellation arrives
        at the caller's next checkpoint.

        Raises:
            StoreError: the write or the flush failed; the file was cut back
                to ``size_before``.
        """
        write = _Write(fd, dev, data, size_before, trio.lowlevel.current_task())
        with self._lock:
            self._pending.append(write)
            start = not self._working
            self._working = True
        if start:
            token = trio.lowlevel.current_trio_token()
            trio.lowlevel.start_thread_soon(
                lambda: self._work(token), _ignore, name="tak FileStore group commit"
            )
        await trio.lowlevel.wait_task_rescheduled(_refuse)
        if write.error is not None:
            raise write.error

    def _work(self, token: trio.lowlevel.TrioToken) -> None:
        """The worker thread: rounds until nothing waits."""
        while True:
            with self._lock:
                writes, self._pending = self._pending, []
                if not writes:
                    self._working = False
                    return
            try:
                self._write_and_sync(writes)
            except BaseException as exc:  # a bug: fail the round, do not hang it
                for w in writes:
                    if w.error is None:
                        w.error = StoreError(f"group commit failed: {exc!r}")
            # Its tasks are parked until this runs, so the Trio run is alive.
            token.run_sync_soon(self._finish, writes)

    def _finish(self, writes: list[_Write]) -> None:
        self.rounds += 1
        for w in writes:
            trio.lowlevel.reschedule(w.task)

    def _write_and_sync(self, writes: list[_Write]) -> None:
        failed = False
        for w in writes:
            try:
                if os.write(w.fd, w.data) != len(w.data):
                    write_all(w.fd, w.data, w.size_before, written=True)
            except OSError as exc:
                cut_back(w.fd, w.size_before)
                w.error = StoreError(f"append failed: {exc}")
                w.error.__cause__ = exc
                failed = True
            except StoreError as exc:
                w.error = exc
                failed = True
        written = [w for w in writes if w.error is None] if failed else writes
        try:
            self._sync([w.fd for w in written], [w.dev for w in written])
        except OSError as exc:
            for w in written:
                cut_back(w.fd, w.size_before)
                w.error = StoreError(f"fsync failed: {exc}")
                w.error.__cause__ = exc


def _ignore(_: object) -> None:
    pass
