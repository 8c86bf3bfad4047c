"""Group commit: durable appends share write-and-fsync rounds."""

from __future__ import annotations

import ctypes
import os
import threading
import time
from collections.abc import Callable, Sequence

import trio

from ..errors import StoreError
from ._disk import cut_back

# Below this many files in a round, fdatasync each; from it on, one syncfs()
# per file system is cheaper than a journal commit per file.
SYNCFS_MIN_FILES = 8

# The longest a round waits for the appends of the last one to come back.
_MAX_GATHER_S = 0.005

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


class _Waiter:
    __slots__ = ("dev", "error", "fd", "size_before", "task")

    def __init__(self, fd: int, dev: int, size_before: int, task: trio.lowlevel.Task) -> None:
        self.fd = fd
        self.dev = dev
        self.size_before = size_before
        self.task = task
        self.error: StoreError | None = None


def _refuse(_: trio.lowlevel.RaiseCancelT) -> trio.lowlevel.Abort:
    return trio.lowlevel.Abort.FAILED  # a round always finishes: wait for it


class GroupCommit:
    """Durable appends in rounds: a worker thread flushes every file whose
    append waits for it, at once, and takes the next round.

    The appends are written before they join (on the Trio thread, like any
    append: a ``write()`` to the page cache); files whose appends arrive
    while a round is being flushed make up the next round, so N sessions
    appending at once pay a few flushes, not N sequential fsyncs. The thread
    runs only while appends wait for it, and each append is woken once, by
    the end of its round. Only the flush is in the thread: a thread that
    also wrote took the GIL back after every ``write()``, which cost more
    than the write (bench/bench_store.py).
    """

    def __init__(self, sync: Callable[[Sequence[int], Sequence[int]], None] = sync_files) -> None:
        self._sync = sync
        self._lock = threading.Lock()  # guards _pending, _working and _expect
        self._more = threading.Condition(self._lock)  # _pending reached _expect
        self._pending: list[_Waiter] = []
        self._working = False
        # The last round's size and flush time: appends just woken by a round
        # come back for the next one, so it waits (at most one flush's time)
        # until as many have.
        self._expect = 0
        self._last_flush_s = 0.0
        self.rounds = 0  # completed rounds, for tests and benchmarks

    async def sync(self, fd: int, dev: int, size_before: int) -> None:
        """Return once what was written to ``fd`` is durable.

        ``dev`` is the device of ``fd``'s file system (``st_dev``);
        ``size_before`` the file's size before the append being made durable.

        Not cancellable: a round, once joined, finishes, and the caller must
        keep ``fd`` open and unwritten-to until then. A cancellation arrives
        at the caller's next checkpoint.

        Raises:
            StoreError: the flush failed; the file was cut back to ``size_before``.
        """
        waiter = _Waiter(fd, dev, size_before, trio.lowlevel.current_task())
        with self._lock:
            pending = self._pending
            pending.append(waiter)
            if len(pending) == self._expect:
                self._more.notify()
            start = not self._working
            self._working = True
        if start:
            token = trio.lowlevel.current_trio_token()
            trio.lowlevel.start_thread_soon(
                lambda: self._work(token), _ignore, name="tak FileStore group commit"
            )
        await trio.lowlevel.wait_task_rescheduled(_refuse)
        if waiter.error is not None:
            raise waiter.error

    def _work(self, token: trio.lowlevel.TrioToken) -> None:
        """The worker thread: rounds until nothing waits."""
        while True:
            with self._lock:
                if 0 < len(self._pending) < self._expect:
                    self._more.wait_for(self._gathered, timeout=self._last_flush_s)
                waiters, self._pending = self._pending, []
                if not waiters:
                    self._working = False
                    self._expect = 0
                    return
                self._expect = len(waiters)
            started = time.perf_counter()
            try:
                self._sync([w.fd for w in waiters], [w.dev for w in waiters])
            except BaseException as exc:  # OSError, or a bug: fail the round, do not hang it
                for w in waiters:
                    cut_back(w.fd, w.size_before)
                    w.error = StoreError(f"fsync failed: {exc}")
                    w.error.__cause__ = exc
            self._last_flush_s = min(time.perf_counter() - started, _MAX_GATHER_S)
            # Its tasks are parked until this runs, so the Trio run is alive.
            token.run_sync_soon(self._finish, waiters)

    def _gathered(self) -> bool:
        return len(self._pending) >= self._expect

    def _finish(self, waiters: list[_Waiter]) -> None:
        self.rounds += 1
        for w in waiters:
            trio.lowlevel.reschedule(w.task)


def _ignore(_: object) -> None:
    pass
