"""Per-key locks whose table empties itself, the per-session delete gate, and
the per-session ``flock`` that keeps other processes out."""

from __future__ import annotations

import fcntl
import os
import stat
import struct
import threading
from collections.abc import Callable, Hashable
from types import TracebackType
from typing import Generic, TypeVar

import trio

K = TypeVar("K", bound=Hashable)


class LockEntry:
    """One key's lock in a ``KeyedLocks`` table, as ``acquire`` hands it out."""

    __slots__ = ("lock", "users")

    def __init__(self) -> None:
        self.lock = trio.Lock()
        self.users = 0  # tasks holding or waiting for ``lock``


# Entries that left a table are kept for reuse (a free lock with no waiters
# is as good as new): creating a trio.Lock costs as much as an append.
_SPARE_MAX = 64


class KeyedLocks(Generic[K]):
    """One ``trio.Lock`` per key, created on first use.

    A key's entry leaves the table as soon as no task holds or waits for its
    lock, so the table's size is bounded by the number of tasks using it,
    whatever the number of keys ever seen. Different keys never wait on each
    other. ``on_idle(key)`` is called each time a key leaves the table.
    """

    __slots__ = ("_on_idle", "_spare", "_table")

    def __init__(self, on_idle: Callable[[K], None] | None = None) -> None:
        self._table: dict[K, LockEntry] = {}
        self._spare: list[LockEntry] = []
        self._on_idle = on_idle

    def __len__(self) -> int:
        return len(self._table)

    def __contains__(self, key: K) -> bool:
        """True while some task holds or waits for ``key``'s lock."""
        return key in self._table

    def acquire_nowait(self, key: K) -> LockEntry | None:
        """Take ``key``'s lock if nobody holds or waits for it, else ``None``."""
        if key in self._table:
            return None
        entry = self._spare.pop() if self._spare else LockEntry()
        entry.lock.acquire_nowait()
        entry.users = 1
        self._table[key] = entry
        return entry

    async def acquire(self, key: K) -> LockEntry:
        """Take ``key``'s lock, waiting if another task holds it; give the
        result to ``release``.

        Taking a free lock does not yield to the scheduler; callers that must
        be schedule points arrange that themselves.
        """
        entry = self._table.get(key)
        if entry is None:
            entry = self._spare.pop() if self._spare else LockEntry()
            self._table[key] = entry
        entry.users += 1
        try:
            entry.lock.acquire_nowait()
        except trio.WouldBlock:
            try:
                await entry.lock.acquire()
            except BaseException:
                self._leave(key, entry)
                raise
        return entry

    def release(self, key: K, entry: LockEntry) -> None:
        """Give back ``key``'s lock, taken by this task with ``acquire``."""
        entry.lock.release()
        self._leave(key, entry)

    def _leave(self, key: K, entry: LockEntry) -> None:
        entry.users -= 1
        if entry.users == 0:
            del self._table[key]
            if len(self._spare) < _SPARE_MAX:
                self._spare.append(entry)
            if self._on_idle is not None:
                self._on_idle(key)

    def hold(self, key: K) -> _Hold[K]:
        """``async with locks.hold(key):`` runs the block under ``key``'s lock."""
        return _Hold(self, key)


class _Hold(Generic[K]):
    __slots__ = ("_entry", "_key", "_locks")

    def __init__(self, locks: KeyedLocks[K], key: K) -> None:
        self._locks = locks
        self._key = key
        self._entry: LockEntry | None = None

    async def __aenter__(self) -> None:
        self._entry = await self._locks.acquire(self._key)

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        entry, self._entry = self._entry, None
        assert entry is not None
        self._locks.release(self._key, entry)


class _Gate:
    __slots__ = ("deleting", "lot", "openers")

    def __init__(self) -> None:
        self.openers = 0
        self.deleting = False
        self.lot = trio.lowlevel.ParkingLot()


class SessionGates(Generic[K]):
    """Keeps a session's delete apart from the opening of its transcripts.

    Opening transcripts of one session (main or children) run side by side;
    deleting the session waits for the opens in flight and holds back new
    ones until it is done, so no append can land in a directory that is
    being removed. Like ``KeyedLocks``, the table empties itself.
    """

    __slots__ = ("_table",)

    def __init__(self) -> None:
        self._table: dict[K, _Gate] = {}

    def __len__(self) -> int:
        return len(self._table)

    def _gate(self, key: K) -> _Gate:
        gate = self._table.get(key)
        if gate is None:
            gate = self._table[key] = _Gate()
        return gate

    def _tidy(self, key: K, gate: _Gate) -> None:
        if gate.openers == 0 and not gate.deleting:
            del self._table[key]

    async def enter_open(self, key: K) -> None:
        """Wait for any delete of session ``key`` to finish, then count an open."""
        gate = self._gate(key)
        while gate.deleting:
            await gate.lot.park()
            gate = self._gate(key)
        gate.openers += 1

    def exit_open(self, key: K) -> None:
        gate = self._table[key]
        gate.openers -= 1
        if gate.openers == 0:
            gate.lot.unpark_all()
            self._tidy(key, gate)

    async def enter_delete(self, key: K) -> None:
        """Hold back new opens of session ``key`` and wait for those in flight.

        The caller holds the session's main key lock, so deletes of one
        session never overlap.
        """
        gate = self._gate(key)
        assert not gate.deleting
        gate.deleting = True
        try:
            while gate.openers:
                await gate.lot.park()
        except BaseException:
            self.exit_delete(key)
            raise

    def exit_delete(self, key: K) -> None:
        gate = self._table[key]
        gate.deleting = False
        gate.lot.unpark_all()
        self._tidy(key, gate)


class SessionFlock:
    """An exclusive ``flock`` on a session directory, shared by this process's tasks.

    ``flock`` belongs to an open file description, not to a task: while any
    task of this process holds it (``holders > 0``) no other *process* can
    append to, repair or delete the session, and the tasks of this process
    keep their own order with ``KeyedLocks``. So a task finding the lock held
    here joins the hold, and the last one out unlocks.

    A hold outlives its last holder until this Trio run next gets back to
    its scheduler (a ``run_sync_soon`` callback ends it): back-to-back
    appends, which yield at most once a millisecond, share one ``flock``
    and one check of their file (``hold`` numbers the holds, so a handle
    checked in this one need not be checked again). Other processes wait
    that much longer, at most until this process next yields.

    Waiters queue on a turnstile, the file ``#lock`` in the session
    directory: a waiter holds it exclusively until it has the session lock,
    and a process taking the session lock without waiting first checks that
    it can share the turnstile. Without it a process appending back to back
    takes the lock again microseconds after each release, before a waiter
    in another process has even been woken (`tak sessions rm` next to a
    busy server waited forever).

    The turnstile is held with open-file-description record locks
    (``F_OFD_SETLKW``), not ``flock``: asking whether anyone queues is then
    one ``F_OFD_GETLK``, which takes nothing, where a ``flock`` probe took
    and gave back a shared lock (two calls). It is opened once per
    ``SessionFlock`` and kept (opening it on every attempt cost a third of
    a durable append); a kept one found deleted is opened again, and one
    that cannot be opened (something else at ``#lock``) is tried again at
    the next fresh take.

    A hold stays "fresh" until the scheduler next runs; after that, joining
    it (another task's append while a durable append waits in its round)
    first asks the turnstile. A hold whose last holder leaves after that
    lingers until the scheduler next runs: the same writer's next append,
    which follows without yielding, rejoins it the same way, instead of a
    new ``flock`` and a new check of its file. When another process queues
    — or no turnstile can tell — the hold drains: no task joins it any
    more, the last holder out unlocks at once, and the tasks turned away
    wait for the lock like another process would.

    The first attempt never blocks (``LOCK_NB`` on the shared descriptor).
    Waiting for another process is done by a worker thread on a private open
    file description of the same directory: a blocked ``flock`` cannot be
    interrupted, so a cancelled waiter abandons the thread, and whichever of
    the two comes last closes the private description, which releases the
    lock if the thread got it after all.
    """

    __slots__ = (
        "_closed",
        "_draining",
        "_fresh",
        "_held_fd",
        "_scheduled",
        "_turnstile",
        "dead",
        "dev",
        "fd",
        "handles",
        "hold",
        "holders",
        "ino",
        "waiters",
    )

    def __init__(self, fd: int, dev: int, ino: int, *, turnstile: int | None = None) -> None:
        self.fd = fd  # the session directory, opened O_RDONLY|O_DIRECTORY
        self.dev = dev
        self.ino = ino
        self.holders = 0
        self.waiters = 0  # tasks of this process in acquire(): the fd must stay open
        self.hold = 0  # how many times this process has taken the flock
        self.handles = 0  # transcripts of this session open for appending here
        self.dead = False  # the directory was deleted: never lock it again
        self._held_fd: int | None = None
        self._fresh = False  # taken since the scheduler last ran: join without asking
        self._draining = False  # another process queues: no joins, unlock when empty
        self._scheduled = False  # an end_lease callback is pending
        self._closed = False
        # The turnstile's descriptor (opened by the caller, in a worker thread:
        # creating it waits for the journal); -1: none usable; None: not opened yet.
        self._turnstile = turnstile

    def try_acquire(self) -> bool:
        """Take (or join) the lock without waiting; whether it is now held."""
        if self._held_fd is not None:
            if self._draining:
                return False
            if not self._fresh and not self._nobody_queues():
                if self.holders == 0:
                    self._unlock()
                else:
                    self._draining = True  # the last holder out unlocks
                return False
            self.holders += 1
            return True
        turnstile = self._turnstile
        if turnstile is None or turnstile < 0:
            turnstile = self._turnstile = open_turnstile(self.fd)
        if turnstile >= 0 and _queued(turnstile):
            return False
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        self._taken(self.fd)
        return True

    def _nobody_queues(self) -> bool:
        """Whether the turnstile says no other process waits (``False``: it cannot say)."""
        turnstile = self._turnstile
        if turnstile is None or turnstile < 0:
            return False
        try:
            if os.fstat(turnstile).st_nlink == 0:  # deleted: waiters queue on a new one
                os.close(turnstile)
                self._turnstile = None  # opened again at the next fresh take
                return False
            return not _queued(turnstile)
        except OSError:
            return False

    def _taken(self, fd: int) -> None:
        self._held_fd = fd
        self.holders = 1
        self.hold += 1
        self._fresh = True
        self._schedule_end()

    def _schedule_end(self) -> None:
        if not self._scheduled:
            self._scheduled = True
            _lease(self)

    def end_lease(self) -> None:
        """The scheduler ran: the hold is no longer fresh, and with no holder it ends."""
        self._scheduled = False
        self._fresh = False
        if self.holders == 0:
            self._unlock()

    def _unlock(self) -> None:
        self._draining = False
        fd, self._held_fd = self._held_fd, None
        if fd is None:
            return
        if fd != self.fd:
            os.close(fd)  # a private description: closing it releases the lock
        elif not self._closed:
            fcntl.flock(fd, fcntl.LOCK_UN)

    async def acquire(self) -> None:
        """Take (or join) the lock, waiting in a thread while another process holds it.

        Raises:
            OSError: ``flock`` failed for another reason than the lock being held.
        """
        while not self.try_acquire():
            wait = _FlockWait(os.open(".", _DIR_FLAGS, dir_fd=self.fd))
            self.waiters += 1
            try:
                got = await trio.to_thread.run_sync(wait.block, abandon_on_cancel=True)
            except BaseException:
                wait.abandon()
                raise
            finally:
                self.waiters -= 1
            if not got:
                continue
            if self._held_fd is not None:  # cannot be: our private description holds it
                os.close(wait.fd)
                raise AssertionError("flock held twice by one process")
            self._taken(wait.fd)
            return

    def release(self) -> None:
        """Leave the hold; the last holder out unlocks when the hold drains, and
        otherwise lets it linger until the scheduler next runs."""
        self.holders -= 1
        if self.holders == 0:
            if self._draining:
                self._unlock()
            else:
                self._schedule_end()  # see the class docstring

    def close(self) -> None:
        """Close the directory (and any private description), releasing the lock."""
        assert self.holders == 0 and self.waiters == 0
        if self._closed:
            return
        if self._held_fd is not None and self._held_fd != self.fd:
            os.close(self._held_fd)
        self._held_fd = None
        self._closed = True
        if self._turnstile is not None and self._turnstile >= 0:
            os.close(self._turnstile)
        self._turnstile = None
        os.close(self.fd)


# The flocks taken since this Trio run's scheduler last ran: their leases
# end together, in one run_sync_soon callback (one each cost a wakeup write).
_LEASED: trio.lowlevel.RunVar[list[SessionFlock]] = trio.lowlevel.RunVar("tak_leased_flocks")


def _lease(flock: SessionFlock) -> None:
    try:
        leased = _LEASED.get()
    except LookupError:
        leased = []
        _LEASED.set(leased)
    if not leased:
        trio.lowlevel.current_trio_token().run_sync_soon(_end_leases, leased)
    leased.append(flock)


def _end_leases(leased: list[SessionFlock]) -> None:
    flocks = leased[:]
    leased.clear()
    for flock in flocks:
        flock.end_lease()


_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | getattr(os, "O_CLOEXEC", 0)
TURNSTILE = "#lock"
# O_RDWR: the waiter's OFD write lock needs it. O_NONBLOCK: a careless process
# may leave a FIFO (or a device) at ``#lock``, and opening one can block (it is
# then refused as not regular). It does not make the locks non-blocking.
_TURNSTILE_FLAGS = (
    os.O_RDWR
    | os.O_CREAT
    | os.O_NOFOLLOW
    | os.O_NONBLOCK
    | os.O_NOCTTY
    | getattr(os, "O_CLOEXEC", 0)
)


# struct flock: l_type, l_whence, l_start, l_len, l_pid (0 for OFD locks), padding.
_FLOCK = struct.Struct("hhqqi4x")
_F_OFD_GETLK: int | None = getattr(fcntl, "F_OFD_GETLK", None)
_F_OFD_SETLKW: int | None = getattr(fcntl, "F_OFD_SETLKW", None)


def _queued(turnstile: int) -> bool:
    """Whether another process waits in the queue (holds the turnstile's write lock)."""
    if _F_OFD_GETLK is None:  # no OFD locks (not Linux): probe with flock
        try:
            fcntl.flock(turnstile, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        fcntl.flock(turnstile, fcntl.LOCK_UN)
        return False
    probe = _FLOCK.pack(fcntl.F_RDLCK, os.SEEK_SET, 0, 0, 0)
    return bool(_FLOCK.unpack(fcntl.fcntl(turnstile, _F_OFD_GETLK, probe))[0] != fcntl.F_UNLCK)


def _queue_up(turnstile: int) -> None:
    """Wait for, then hold, the turnstile's write lock (until ``turnstile`` is closed)."""
    if _F_OFD_SETLKW is None:
        fcntl.flock(turnstile, fcntl.LOCK_EX)
    else:
        fcntl.fcntl(turnstile, _F_OFD_SETLKW, _FLOCK.pack(fcntl.F_WRLCK, os.SEEK_SET, 0, 0, 0))


def open_turnstile(dir_fd: int) -> int:
    """The session's turnstile file, or -1: no queue (its directory was deleted, or
    something other than a regular file is at ``#lock``; waiters then race for the
    session lock as they would without a turnstile)."""
    try:
        fd = os.open(TURNSTILE, _TURNSTILE_FLAGS, 0o600, dir_fd=dir_fd)
    except OSError:
        return -1
    try:
        regular = stat.S_ISREG(os.fstat(fd).st_mode)
    except OSError:
        regular = False
    if not regular:
        os.close(fd)
        return -1
    return fd


class _FlockWait:
    """One blocking ``flock`` in a worker thread, safe to abandon.

    Exactly one side closes ``fd`` unless the waiter takes it over: the
    thread when ``flock`` failed or the waiter had already gone, ``abandon``
    when the thread got the lock for a waiter that is gone.
    """

    __slots__ = ("abandoned", "fd", "got", "lock")

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.lock = threading.Lock()
        self.abandoned = False
        self.got = False

    def block(self) -> bool:
        turnstile = open_turnstile(self.fd)
        try:
            if turnstile >= 0:
                _queue_up(turnstile)  # first in the queue
            fcntl.flock(self.fd, fcntl.LOCK_EX)
        except BaseException:
            with self.lock:
                os.close(self.fd)
            raise
        finally:
            if turnstile >= 0:
                os.close(turnstile)
        with self.lock:
            if self.abandoned:
                os.close(self.fd)
                return False
            self.got = True
        return True

    def abandon(self) -> None:
        """The waiter is gone (cancelled): release the lock if the thread has it."""
        with self.lock:
            self.abandoned = True
            if self.got:
                os.close(self.fd)


def lock_holders(fd: int) -> list[int]:
    """Pids holding a ``flock`` on the file of ``fd`` (Linux ``/proc/locks``; else none)."""
    st = os.fstat(fd)
    want = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    pids: list[int] = []
    try:
        with open("/proc/locks") as f:
            for line in f:
                fields = line.split()
                # "1: FLOCK  ADVISORY  WRITE 1234 08:01:5678 0 EOF"; "->" marks waiters
                if len(fields) >= 6 and fields[1] == "FLOCK" and fields[5] == want:
                    pids.append(int(fields[4]))
    except (OSError, ValueError):
        pass
    return pids
