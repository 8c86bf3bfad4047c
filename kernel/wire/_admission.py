"""Who gets a socket: the server's accept loop and its budgets (DESIGN §9, §11).

Anyone who can reach the port can open TCP connections; only the token makes
one a client. So the server keeps two budgets:

1. **Unauthenticated connections** (accepted, token not shown yet — neither in
   the handshake nor in ``hello``) are at most ``max_unauthenticated``. When a
   new one arrives and the budget is full, the *oldest* is dropped. Refusing
   the newcomer instead would let an attacker who holds every slot lock out
   the real client, which is itself unauthenticated for a moment; dropping the
   oldest makes an attacker win only by opening connections faster than the
   real client finishes a loopback handshake, and every slot lasts at most
   ``handshake_timeout`` anyway.
2. **Authenticated connections** are at most ``max_connections``; only they
   count there, so unauthenticated ones can never make the server answer 503
   to the real client.

And one ceiling over both: the open-file limit. At start the soft
``RLIMIT_NOFILE`` is raised to the hard one; the accept loop never lets
connections take more than what was free at start minus ``fd_reserve`` (for
transcripts, workers, pipes). At the ceiling it drops the oldest
unauthenticated connection to make room, or, when every connection is
authenticated, stops accepting until one closes: new connections wait in the
kernel's listen backlog instead of failing with ``EMFILE``.

A dropped connection's handler is cancelled, but cancellation lands at its next
checkpoint: a reader already woken with a ``hello`` (or a handshake already
read) still runs until then, and asks to ``authenticate`` a slot that has left
the budget. So a slot remembers that it was dropped, and ``authenticate``
answers ``"dropped"`` for it: the connection is closed (its scope is cancelled),
and nothing about it is an internal error.
"""

from __future__ import annotations

import errno
import logging
import math
import os
import resource
from collections.abc import Awaitable, Callable
from typing import Literal, TypeAlias

import attrs
import trio

logger = logging.getLogger("tak.server")

# accept(2) failures that mean "out of resources, try again", not "broken listener".
_CAPACITY_ERRNOS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.ENOBUFS})
_CAPACITY_PAUSE = 0.1
# A flood drops many connections a second: one summary line per this many seconds.
_REPORT_EVERY = 10.0

#: What ``Admission.authenticate`` made of a slot: authenticated now (or before),
#: refused because ``max_connections`` are authenticated, or dropped already
#: (for room, while its handler had not yet reached a checkpoint).
Verdict: TypeAlias = Literal["authenticated", "full", "dropped"]


def raise_open_files_limit() -> tuple[int, int]:
    """Raise the soft ``RLIMIT_NOFILE`` to the hard limit; ``(before, after)``.

    A hard limit of "unlimited" cannot be a soft limit on Linux (``nr_open``
    caps it), so then 2**20 is tried. A limit that cannot be raised is kept.
    """
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    for target in (hard, 1 << 20):
        if target != resource.RLIM_INFINITY and soft != resource.RLIM_INFINITY and target <= soft:
            break
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        except (ValueError, OSError):
            continue
        return soft, target
    return soft, soft


def open_files_in_use() -> int | None:
    """How many file descriptors this process has open (``None`` without ``/proc``)."""
    try:
        return len(os.listdir("/proc/self/fd"))
    except OSError:
        return None


@attrs.define(eq=False)
class Slot:
    """One accepted TCP connection's place in the budgets.

    The connection's handler runs inside ``scope``: its deadline is the
    handshake deadline while the connection is unauthenticated, and dropping
    the connection cancels it.
    """

    accepted_at: float
    #: When the token must have been shown (TCP accept + ``handshake_timeout``).
    token_deadline: float
    scope: trio.CancelScope
    authenticated: bool = False
    #: Dropped to make room (its scope is cancelled): it can no longer authenticate.
    dropped: bool = False
    released: bool = False


class Admission:
    """The two connection budgets and the open-file ceiling of one server."""

    def __init__(
        self,
        *,
        max_unauthenticated: int,
        max_connections: int,
        handshake_timeout: float,
        open_files_budget: float,
    ) -> None:
        self.max_unauthenticated = max_unauthenticated
        self.max_connections = max_connections
        self.handshake_timeout = handshake_timeout
        self.open_files_budget = open_files_budget
        # Insertion order is age: the first key is the oldest.
        self._unauthenticated: dict[Slot, None] = {}
        self.authenticated = 0
        self._open = 0
        self._changed = trio.Event()
        self._dropped = 0
        self._capacity_errors = 0
        self._next_report = -math.inf

    @property
    def unauthenticated(self) -> int:
        return len(self._unauthenticated)

    @property
    def open(self) -> int:
        """Connections holding a socket, counting dropped ones not yet closed."""
        return self._open

    def admit(self) -> Slot:
        """A new TCP connection: unauthenticated, with a deadline; drops the oldest if full."""
        while len(self._unauthenticated) >= self.max_unauthenticated:
            self._drop_oldest("over max_unauthenticated")
        now = trio.current_time()
        deadline = now + self.handshake_timeout
        slot = Slot(
            accepted_at=now, token_deadline=deadline, scope=trio.CancelScope(deadline=deadline)
        )
        self._unauthenticated[slot] = None
        self._open += 1
        return slot

    def authenticate(self, slot: Slot) -> Verdict:
        """Move ``slot`` to the authenticated budget, if it is still unauthenticated
        (not dropped) and that budget has room.

        Once authenticated a connection has no deadline and is never dropped for
        room: only its own limits (idle, ping, slow reader) close it. A slot
        dropped meanwhile stays dropped (see the module docstring).
        """
        if slot.authenticated:
            return "authenticated"
        if slot.dropped or slot.released:
            return "dropped"
        if self.authenticated >= self.max_connections:
            return "full"
        del self._unauthenticated[slot]
        slot.authenticated = True
        slot.scope.deadline = math.inf
        self.authenticated += 1
        return "authenticated"

    def release(self, slot: Slot) -> None:
        """The connection's socket is closed: give its place back."""
        if slot.released:
            return
        slot.released = True
        if slot.authenticated:
            self.authenticated -= 1
        else:
            self._unauthenticated.pop(slot, None)
        self._open -= 1
        self._changed.set()
        self._changed = trio.Event()

    async def wait_for_room(self) -> None:
        """Return when one more socket fits under the open-file ceiling."""
        while self._open >= self.open_files_budget:
            if self._unauthenticated:
                self._drop_oldest("near the open-file limit")
            await self._changed.wait()

    def _drop_oldest(self, why: str) -> None:
        slot = next(iter(self._unauthenticated))
        del self._unauthenticated[slot]
        slot.dropped = True
        slot.scope.cancel()
        self._dropped += 1
        self._report(f"dropped unauthenticated connections ({why})")

    def capacity_error(self, exc: OSError) -> None:
        self._capacity_errors += 1
        self._report(f"accept failed: {exc.strerror}")

    def _report(self, what: str) -> None:
        now = trio.current_time()
        if now < self._next_report:
            return
        self._next_report = now + _REPORT_EVERY
        logger.warning(
            "%s: %d dropped, %d accept failures so far; %d unauthenticated, "
            "%d authenticated connections open",
            what,
            self._dropped,
            self._capacity_errors,
            len(self._unauthenticated),
            self.authenticated,
        )


async def serve_listeners(
    listeners: list[trio.SocketListener],
    admission: Admission,
    handler: Callable[[trio.SocketStream, Slot], Awaitable[None]],
    *,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Accept on every listener, within ``admission``'s budgets, until cancelled.

    Each connection is handed to ``handler(stream, slot)``, which must not
    raise; the stream is closed and the slot released after it returns.
    """
    async with trio.open_nursery() as handlers, trio.open_nursery() as loops:
        for listener in listeners:
            loops.start_soon(_accept_loop, listener, admission, handler, handlers)
        task_status.started()


async def _accept_loop(
    listener: trio.SocketListener,
    admission: Admission,
    handler: Callable[[trio.SocketStream, Slot], Awaitable[None]],
    handlers: trio.Nursery,
) -> None:
    async with listener:
        while True:
            await admission.wait_for_room()
            try:
                stream = await listener.accept()
            except OSError as exc:
                if exc.errno not in _CAPACITY_ERRNOS:
                    raise
                # Out of descriptors anyway (other parts of the process use them too):
                # leave the connection in the backlog and try again shortly.
                admission.capacity_error(exc)
                await trio.sleep(_CAPACITY_PAUSE)
                continue
            # Admitted here, not in the task: the next wait_for_room must count it.
            handlers.start_soon(_run_handler, stream, admission, admission.admit(), handler)


async def _run_handler(
    stream: trio.SocketStream,
    admission: Admission,
    slot: Slot,
    handler: Callable[[trio.SocketStream, Slot], Awaitable[None]],
) -> None:
    try:
        with slot.scope:
            await handler(stream, slot)
    finally:
        await trio.aclose_forcefully(stream)
        admission.release(slot)
