"""``PostgresStore``: transcripts in PostgreSQL, shared by many kernel processes and hosts.

psycopg 3's async API needs asyncio, so the store runs its sync API in
threads (``trio.lowlevel.start_thread_soon``), at most ``max_connections``
at a time (a ``trio.CapacityLimiter`` the size of the connection pool, so a
thread never waits for a connection another thread of this store holds).

Guarantees (each test in tests/store/test_postgres.py names the one it checks):

1. An append is one transaction: all of its fresh entries are stored, with
   the main summary folded and the mtime stamped, or nothing is.
2. Per key, the order of entries is the order in which appends committed,
   across processes: an append first locks its key's ``tak_sessions`` row
   (``SELECT … FOR UPDATE``), which orders concurrent appends, and takes its
   sequence numbers from that row. Sequence numbers have no gaps, so
   ``iter_entries(key, start=n)`` is ``WHERE seq >= n``.
3. uuid idempotence holds across processes: under the row lock, uuids already
   stored for the key are looked up and skipped (a unique index stands
   behind it).
4. ``mtime_ms`` comes from the database clock (``clock_timestamp()``), or the
   ``clock=`` given for tests, and strictly grows per key
   (``greatest(now, previous + 1)``), whichever host appends.
5. The summary is the same pure fold as in the other stores, folded in the
   append's transaction onto the summary read under the row lock.
6. Cancellation never leaves a query running unbounded: every session has a
   ``statement_timeout``; when the Trio task waiting for a thread is
   cancelled, the thread's query is cancelled on the server
   (``cancel_safe``), and the task waits for the thread to give its
   connection back before raising ``Cancelled``. A server that does not
   answer the cancel within ``CANCEL_GRACE_S`` (frozen, or its host gone) has
   the connection's socket shut down under the thread, which then fails at
   once; that connection is closed, never handed out again. If the append
   committed before the cancel landed, it returns normally instead (the
   cancellation is seen at the caller's next checkpoint): an append that
   raises ``Cancelled`` stored nothing, unless its COMMIT was on its way when
   the server stopped answering (then, as after a timeout, it may have
   committed: entries with uuids are safe to append again). A thread still waiting for a
   connection (the server is down, the pool reconnecting) asks the pool in
   short slices and stops at the next one once cancelled, so a cancel is
   prompt then too; uncancelled, it gives up after ``connect_timeout_s`` with
   a StoreError (made with ``retry_lost_connections``: at the call's deadline).
7. Listing reads the ``tak_sessions`` table only, never an entry.
8. The schema is versioned in the database (``tak_schema_version``); new
   versions are applied under an advisory lock, so processes starting
   together do not race, and a database newer than this code is refused.
   The wait for that lock is bounded by the statement timeout, like every
   statement: a lock held elsewhere fails the call, never holds a thread.
   (``migrate_schema`` does the same for tables of other code beside the
   store's: the batch ledger's.)
9. Made with ``retry_lost_connections=True``, the store outlives a server
   restart shorter than its ``request_timeout_s``: a call whose connection
   was lost (the server restarting, the network dropping it) is made again,
   after each of ``RETRY_DELAYS`` (then every 2 s), each retry logged, and
   waits for the pool to reconnect, all within the call's deadline (guarantee
   10); then it fails with the last one-line StoreError, saying it gave up.
   Only calls that are safe to make twice are: reads, and appends whose
   entries all have a uuid (guarantee 3: a second try stores nothing twice,
   whether the first committed or not). Only a lost connection is retried: a
   statement timeout, an error the server answered fail at once. Without it,
   a lost connection is a StoreError at once (the pool drops the connection,
   so the next call may work).
10. Every call ends within ``request_timeout_s`` (default 30 s) of real
   time, whatever the server or the network do (plus at most
   ``CANCEL_GRACE_S`` to take its thread back): its connection waits, its
   queries and its retries share that deadline, and a call that reaches it
   is cancelled (guarantee 6) and fails with ``StoreError: PostgreSQL
   host:port/db: WHAT timed out after N s``. The deadline is the client's
   own: a frozen server, or one whose host stopped answering, cannot hold
   it. Connections also have TCP keepalives and ``tcp_user_timeout``, so the
   operating system drops a connection to a host that went away (an idle
   one within about ``KEEPALIVE_IDLE_S + KEEPALIVE_INTERVAL_S *
   KEEPALIVE_COUNT`` seconds, one with unacknowledged data after
   ``request_timeout_s``); these socket settings are defaults, and the ones a
   URL sets win. Server and socket timeouts are at most ``MAX_TIMEOUT_MS``
   (PostgreSQL's C int): a longer ``request_timeout_s`` sets them at that.

Entries are stored as PostgreSQL ``json`` (the exact text ``FileStore``
writes), not ``jsonb``: ``jsonb`` refuses strings with ``\\u0000``, turns
``1e300`` into an integer and ``-0.0`` into ``0``, so entries would not come
back deep-equal to what was appended.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import re
import socket
import threading
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

import attrs
import outcome
import trio

from .._checks import check_positive
from ..errors import StoreError, UsageError
from ..home import DEFAULT_STORE_REQUEST_TIMEOUT_S
from ._base import ClosableStore, check_start
from ._entries import EncodedEntry, encode_entries
from ._key import SessionKey, check_name
from ._locks import KeyedLocks
from ._summary import SessionInfo, SessionSummary, SummaryBuilder, SummaryData

if TYPE_CHECKING:
    from psycopg import Connection
    from psycopg_pool import ConnectionPool

T = TypeVar("T")

logger = logging.getLogger("tak.store")

#: Seconds waited before each retry of a call whose connection was lost
#: (guarantee 9), the last one repeated until the call's deadline: the pool
#: drops the idle connections a restart broke, which calls meet one a try.
RETRY_DELAYS = (0.1, 0.2, 0.4, 0.8, 1.6, 2.0)

#: How long a call may take, all its tries included (guarantee 10): tak.toml's
#: ``[store] request_timeout_s`` when unset.
DEFAULT_REQUEST_TIMEOUT_S = DEFAULT_STORE_REQUEST_TIMEOUT_S
#: How long a cancelled or timed-out call waits for the server to cancel its
#: query before it shuts the connection's socket down (guarantee 6).
CANCEL_GRACE_S = 2.0
#: TCP keepalives of every connection: a host that went away is noticed on an
#: idle connection after about KEEPALIVE_IDLE_S + KEEPALIVE_INTERVAL_S * KEEPALIVE_COUNT.
KEEPALIVE_IDLE_S = 10
KEEPALIVE_INTERVAL_S = 5
KEEPALIVE_COUNT = 3

# How long psycopg_pool keeps retrying a connection it lost before it gives
# that attempt up. Its retries back off (1, 2, 4, 8 s...): a short attempt
# makes a waiting call start a fresh one (first try at once), so a server
# back from a restart is reached within about a second.
_RECONNECT_S = 1.0

# Rows per page of iter_entries: each page is one query in one thread hop.
_PAGE = 500

_PASSWORD = re.compile(r"(://[^:/@\s\"']*):[^@\s\"']*@")

# How long a thread waits for the pool at a time before it looks whether its
# task was cancelled: psycopg_pool's wait cannot be woken from outside.
_CONNECTION_SLICE_S = 0.05

# pg_advisory_xact_lock key of schema migrations ("tak" + 1).
_MIGRATION_LOCK = 0x74616B01

# Each version is a list of statements, applied in one transaction. Never
# edit one that has shipped: add the next.
_MIGRATIONS: tuple[tuple[str, ...], ...] = (
    (
        # Names are [A-Za-z0-9._-]: the C collation sorts them as Python does,
        # and lets the primary keys serve ORDER BY and prefix scans.
        """
        CREATE TABLE tak_sessions (
            project text COLLATE "C" NOT NULL,
            session_id text COLLATE "C" NOT NULL,
            subpath text COLLATE "C" NOT NULL,  -- '' for the main transcript
            next_seq bigint NOT NULL DEFAULT 0,
            mtime_ms bigint NOT NULL DEFAULT 0,
            summary jsonb,                      -- main transcripts only
            PRIMARY KEY (project, session_id, subpath)
        )
        """,
        """
        CREATE TABLE tak_entries (
            project text COLLATE "C" NOT NULL,
            session_id text COLLATE "C" NOT NULL,
            subpath text COLLATE "C" NOT NULL,
            seq bigint NOT NULL,
            uuid text COLLATE "C",
            entry json NOT NULL,
            PRIMARY KEY (project, session_id, subpath, seq)
        )
        """,
        """
        CREATE UNIQUE INDEX tak_entries_uuid ON tak_entries (project, session_id, subpath, uuid)
            WHERE uuid IS NOT NULL
        """,
    ),
)

_LOCK_KEY = """
SELECT next_seq, summary FROM tak_sessions
WHERE project = %s AND session_id = %s AND subpath = %s FOR UPDATE
"""
_CREATE_KEY = """
INSERT INTO tak_sessions (project, session_id, subpath) VALUES (%s, %s, %s)
ON CONFLICT DO NOTHING
"""
# Stores the entries whose uuid is not stored yet, numbered on from the
# key's next_seq, and stamps the key, in one statement. The fold of the whole
# batch is sent along and kept when every entry was fresh (the common case);
# otherwise the caller folds the fresh ones and sets the summary again. The
# statement starts after the row lock was taken, so it sees every entry of
# the appends that held the lock before.
_APPEND = """
WITH ins AS (
    INSERT INTO tak_entries (project, session_id, subpath, seq, uuid, entry)
    SELECT %(p)s, %(s)s, %(sub)s, %(base)s + row_number() OVER (ORDER BY t.ord) - 1,
           t.uuid, t.entry::json
    FROM unnest(%(uuids)s::text[], %(entries)s::text[]) WITH ORDINALITY AS t(uuid, entry, ord)
    -- an index probe per uuid of the batch, whatever the table's statistics say
    LEFT JOIN LATERAL (
        SELECT 1 AS hit FROM tak_entries x
        WHERE x.project = %(p)s AND x.session_id = %(s)s AND x.subpath = %(sub)s
          AND x.uuid = t.uuid
        LIMIT 1) known ON true
    WHERE known.hit IS NULL
    RETURNING uuid
), stored AS (SELECT count(*) AS n, array_agg(uuid) AS uuids FROM ins)
UPDATE tak_sessions SET
    next_seq = next_seq + stored.n,
    summary = CASE WHEN stored.n = %(count)s THEN %(summary)s::jsonb ELSE summary END,
    mtime_ms = greatest(
        coalesce(%(clock)s::bigint, floor(extract(epoch FROM clock_timestamp()) * 1000)::bigint),
        mtime_ms + 1)
FROM stored
WHERE project = %(p)s AND session_id = %(s)s AND subpath = %(sub)s
RETURNING stored.n, stored.uuids
"""
_SET_SUMMARY = """
UPDATE tak_sessions SET summary = %s WHERE project = %s AND session_id = %s AND subpath = %s
"""
_SELECT_ENTRIES = """
SELECT seq, entry::text FROM tak_entries
WHERE project = %s AND session_id = %s AND subpath = %s AND seq >= %s
ORDER BY seq LIMIT %s
"""


def _summary_json(data: SummaryData) -> dict[str, Any]:
    return attrs.asdict(data)


def _summary_data(value: object) -> SummaryData | None:
    if not isinstance(value, dict):
        return None
    names = {f.name for f in attrs.fields(SummaryData)}
    return SummaryData(**{k: v for k, v in value.items() if k in names})


def _subpath(key: SessionKey) -> str:
    return "" if key.subpath is None else key.subpath


class _Skipped(Exception):
    """A thread's work not started: its task was cancelled while it waited for a connection."""


class _Running:
    """The connection a store thread is using, so a cancelled task can cancel its query."""

    __slots__ = ("cancelled", "conn", "connected", "lock", "severed")

    def __init__(self) -> None:
        self.conn: Connection[Any] | None = None
        self.cancelled = False  # a thread still waiting for a connection then does nothing
        self.connected = False  # the thread got a connection (for the timeout's message)
        self.severed = False  # its socket was shut down: the thread closes the connection
        # Held while the connection is set and while a cancel is sent, so a
        # cancel never reaches the next user of a connection back in the pool.
        self.lock = threading.Lock()

    def cancel(self) -> None:
        with self.lock:
            self.cancelled = True
            if self.conn is not None:
                try:
                    self.conn.cancel_safe(timeout=CANCEL_GRACE_S)
                except Exception:  # the query ends anyway, by statement_timeout
                    pass

    def sever(self) -> None:
        """Shut the connection's socket down: the thread blocked on it fails at once.

        For a server that does not answer a cancel (frozen, its host gone): the
        socket is shut down, not closed, so its descriptor stays the thread's
        (a closed one could be reused by another file meanwhile); libpq then
        sees the connection lost, and the thread closes it before giving it
        back, so the pool never hands it out again.
        """
        with self.lock:
            self.severed = True
            conn = self.conn
            if conn is None:
                return
            try:
                fd = os.dup(conn.pgconn.socket)
            except Exception:  # closed meanwhile: nothing to wake
                return
            with socket.socket(fileno=fd) as sock, contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)


class _Opening:
    """The pool a connecting thread made, closed if its task gave up on it meanwhile."""

    __slots__ = ("abandoned", "lock", "pool")

    def __init__(self) -> None:
        self.pool: ConnectionPool[Any] | None = None
        self.abandoned = False
        self.lock = threading.Lock()

    def keep(self, pool: ConnectionPool[Any]) -> None:
        """In the thread: hand ``pool`` over, or close it if the task has gone."""
        with self.lock:
            self.pool = pool
            if not self.abandoned:
                return
        pool.close()

    def abandon(self) -> None:
        """On the Trio side, when cancelled: the thread closes the pool it makes."""
        with self.lock:
            self.abandoned = True
            pool = self.pool
        if pool is not None:  # made, but the result came after the cancel: close it aside
            trio.lowlevel.start_thread_soon(pool.close, lambda _: None)


class PostgresStore(ClosableStore):
    """Transcripts in a PostgreSQL database, shared by every process that opens it.

    ``url`` is a libpq URL (``postgresql://user@host:5432/db``). The store
    connects and applies its schema on first use. Tables are ``tak_sessions``,
    ``tak_entries`` and ``tak_schema_version`` (see docs/store.md).

    Args:
        url: where the database is.
        max_connections: connections (and threads) this store uses at most.
        request_timeout_s: longest a call may take, its retries included, before
            it is cancelled and fails with StoreError (guarantee 10).
        statement_timeout_s: longest a statement may run on the server
            (default: ``request_timeout_s``).
        connect_timeout_s: longest an operation waits for a connection (the
            server down or unreachable) before it fails with StoreError (with
            ``retry_lost_connections``: until its deadline).
        clock: for tests, the store clock (epoch ms) instead of the database's.
        retry_lost_connections: wait out a server restart (guarantee 9)
            instead of failing at once.

    Raises:
        UsageError: ``url`` is not a PostgreSQL URL, or psycopg is not installed.
    """

    def __init__(
        self,
        url: str,
        *,
        max_connections: int = 8,
        request_timeout_s: float = DEFAULT_REQUEST_TIMEOUT_S,
        statement_timeout_s: float | None = None,
        connect_timeout_s: float = 10.0,
        clock: Callable[[], int] | None = None,
        retry_lost_connections: bool = False,
    ) -> None:
        self._conninfo = parse_url(url)
        check_positive(max_connections, "max_connections", integer=True)
        _check_seconds("request_timeout_s", request_timeout_s)
        if statement_timeout_s is None:
            statement_timeout_s = request_timeout_s
        _check_seconds("statement_timeout_s", statement_timeout_s)
        _check_seconds("connect_timeout_s", connect_timeout_s)
        self._url = url
        self._where = _describe(self._conninfo)
        self._max = max_connections
        self._timeout_ms = _milliseconds(statement_timeout_s)
        self._connect_timeout_s = float(connect_timeout_s)
        self._request_timeout_s = float(request_timeout_s)
        self._clock = clock
        self._retry = retry_lost_connections
        self._limiter = trio.CapacityLimiter(max_connections)
        # Cancelling a running statement needs a thread of its own: threads hung in
        # other work (trio's shared limiter) must never keep a cancel from being sent.
        self._cancel_limiter = trio.CapacityLimiter(max_connections)
        self._locks: KeyedLocks[str] = KeyedLocks()  # by SessionKey.name
        self._pool: ConnectionPool[Any] | None = None
        self._opening = trio.Lock()
        self._closed = False

    def __repr__(self) -> str:
        return f"PostgresStore({self._where})"

    # -- threads and connections ---------------------------------------------

    async def _open(self) -> ConnectionPool[Any]:
        self._check_open()
        if self._pool is not None:
            return self._pool
        async with self._opening:
            if self._pool is None:
                opening = _Opening()
                # Abandoned on cancel: libpq's connect cannot be interrupted, and a
                # host that drops packets holds it for connect_timeout_s.
                try:
                    pool = await trio.to_thread.run_sync(
                        self._connect, opening, abandon_on_cancel=True
                    )
                except trio.Cancelled:
                    opening.abandon()
                    raise
                if self._closed:  # closed while connecting
                    await trio.to_thread.run_sync(pool.close)
                    self._check_open()
                self._pool = pool
        return self._pool

    def _connect(self, opening: _Opening) -> ConnectionPool[Any]:
        """Apply the schema on a connection of its own, then open the pool.

        Raises:
            StoreError: the database cannot be reached or its schema is too new.
        """
        import psycopg
        from psycopg_pool import ConnectionPool

        timeout_ms = self._timeout_ms

        def configure(conn: Connection[Any]) -> None:
            # Session settings, so every statement of every transaction is bounded.
            conn.execute("SELECT set_config('statement_timeout', %s, false)", (str(timeout_ms),))
            conn.execute(
                "SELECT set_config('idle_in_transaction_session_timeout', %s, false)",
                (str(timeout_ms),),
            )

        try:
            with psycopg.connect(self._url, **self._connection_options()) as conn:
                # Bounded too: a migration lock held elsewhere (a process hung
                # migrating) would hold this thread and its connection forever,
                # abandoned at the call's deadline, and the next call would open one more.
                configure(conn)
                migrate_schema(conn, self._where)
        except psycopg.Error as exc:
            raise StoreError(f"{self._where}: {_first_line(exc)}") from exc

        pool: ConnectionPool[Any] = ConnectionPool(
            self._url,
            kwargs=self._connection_options(),
            min_size=1,
            max_size=self._max,
            timeout=self._connect_timeout_s,
            reconnect_timeout=_RECONNECT_S,
            configure=configure,
            open=False,
            name="tak-store",
        )
        pool.open(wait=False)
        opening.keep(pool)
        return pool

    def _connection_options(self) -> dict[str, Any]:
        """What every connection is opened with (guarantee 10).

        The socket settings are defaults: one the URL sets (``keepalives_idle=60``,
        ``tcp_user_timeout=0``...) is the user's and wins, since psycopg lets
        keyword options override the URL's without a word.
        """
        defaults: dict[str, Any] = {
            # libpq counts whole seconds, and takes less than 2 as 2.
            "connect_timeout": max(2, math.ceil(self._connect_timeout_s)),
            "keepalives": 1,
            "keepalives_idle": KEEPALIVE_IDLE_S,
            "keepalives_interval": KEEPALIVE_INTERVAL_S,
            "keepalives_count": KEEPALIVE_COUNT,
            "tcp_user_timeout": _milliseconds(self._request_timeout_s),
        }
        options = {k: v for k, v in defaults.items() if k not in self._conninfo}
        return {"autocommit": True, **options}

    def _getconn(
        self, pool: ConnectionPool[Any], running: _Running, wait_s: float
    ) -> Connection[Any]:
        """A connection of ``pool``, asked for in slices so a cancel stops the wait.

        Raises:
            _Skipped: the task was cancelled (or reached its deadline) meanwhile.
            StoreError: no connection within ``wait_s``.
        """
        from psycopg_pool import PoolTimeout

        deadline = time.monotonic() + wait_s
        while True:
            if running.cancelled:
                raise _Skipped
            left = deadline - time.monotonic()
            if left <= 0:
                raise StoreError(
                    f"{self._where} unreachable: no connection within {self._connect_timeout_s:g} s"
                )
            try:
                conn: Connection[Any] = pool.getconn(timeout=min(_CONNECTION_SLICE_S, left))
            except PoolTimeout:
                continue
            return conn

    @property
    def request_timeout_s(self) -> float:
        """The longest one call may take, its retries included (guarantee 10)."""
        return self._request_timeout_s

    @property
    def where(self) -> str:
        """The server, as this store's errors name it: ``PostgreSQL host:port/db``."""
        return self._where

    async def run_in_thread(
        self,
        fn: Callable[[Connection[Any]], T],
        *,
        again: Callable[[Connection[Any]], T] | None = None,
        what: str = "a call",
    ) -> T:
        """Run ``fn`` with a pooled connection in a thread (see guarantees 6 and 10).

        For code that keeps tables of its own beside the store's (the batch
        ledger): the store's pool, its limit on threads, its cancellation, its
        deadline and its one-line errors. ``fn`` runs in autocommit mode: a
        transaction is ``with conn.transaction():``. ``again``: what to run when
        ``fn`` lost its connection, made again while it does (guarantee 9;
        ``fn`` itself when it is safe to run twice); ``None``: ``fn`` is not made
        again. ``what`` names the call in a timeout's message (``claim``).

        Raises:
            StoreError: a database error (connection lost, statement timeout...),
                or ``WHERE: WHAT timed out after N s``.
        """
        deadline = trio.current_time() + self._request_timeout_s
        retrying = self._retry and again is not None
        call = fn
        tries = 0
        while True:
            tries += 1
            try:
                return await self._run_once(call, what=what, deadline=deadline, patient=retrying)
            except StoreError as exc:
                if not retrying or not _connection_lost(exc):
                    raise
                delay = RETRY_DELAYS[min(tries, len(RETRY_DELAYS)) - 1]
                if trio.current_time() + delay >= deadline:  # down for longer than a restart
                    raise StoreError(
                        f"{exc} (gave up after {tries} tries in {self._request_timeout_s:g} s)"
                    ) from exc
                logger.warning("%s; trying again in %g s", exc, delay)
            await trio.sleep(delay)
            call = again or fn

    def _timed_out(self, what: str, detail: str = "") -> StoreError:
        return StoreError(
            f"{self._where}: {what} timed out after {self._request_timeout_s:g} s{detail}"
        )

    async def _run_once(
        self,
        fn: Callable[[Connection[Any]], T],
        *,
        what: str = "a call",
        deadline: float | None = None,
        patient: bool = False,
    ) -> T:
        """``fn`` in a thread, once, by ``deadline`` (see guarantees 6 and 10).

        ``patient``: wait for a connection until the deadline (the pool
        reconnecting after a restart), not only ``connect_timeout_s``.

        Raises:
            StoreError: a database error (connection lost, statement timeout...),
                or the deadline reached.
        """
        import psycopg

        if deadline is None:
            deadline = trio.current_time() + self._request_timeout_s
        with trio.move_on_at(deadline) as waiting:
            pool = await self._open()
            await self._limiter.acquire()  # not acquired when it raises Cancelled
        if waiting.cancelled_caught:
            raise self._timed_out(what, ": no connection to the server")
        try:
            running = _Running()
            token = trio.lowlevel.current_trio_token()
            done = trio.Event()
            box: list[outcome.Outcome[T]] = []
            wait_s = math.inf if patient else self._connect_timeout_s

            def work() -> T:
                conn = self._getconn(pool, running, wait_s)  # _Skipped: raises its own
                try:
                    with conn:  # as pool.connection(): ends a transaction left open
                        with running.lock:
                            if running.cancelled:
                                raise _Skipped
                            running.conn = conn
                            running.connected = True
                        try:
                            return fn(conn)
                        finally:
                            with running.lock:
                                running.conn = None
                finally:
                    if running.severed:  # never handed out again (guarantee 6)
                        conn.close()
                    pool.putconn(conn)

            def deliver(result: outcome.Outcome[T]) -> None:
                box.append(result)
                try:
                    token.run_sync_soon(done.set)
                except trio.RunFinishedError:  # nobody waits any more
                    pass

            trio.lowlevel.start_thread_soon(work, deliver)
            try:
                with trio.move_on_at(deadline):
                    await done.wait()
            except trio.Cancelled:
                with trio.CancelScope(shield=True):
                    await self._take_back(running, done)
                result = box[0]
                if isinstance(result, outcome.Value):
                    value: T = result.value
                    return value  # it finished first: it happened
                raise
            if not done.is_set():  # the deadline: cancelled like a Cancelled, then said
                with trio.CancelScope(shield=True):
                    await self._take_back(running, done)
                result = box[0]
                if isinstance(result, outcome.Value):
                    late: T = result.value
                    return late  # it finished as the deadline came: it happened
                detail = "" if running.connected else ": no connection to the server"
                raise self._timed_out(what, detail) from None
            try:
                return box[0].unwrap()
            except psycopg.Error as exc:
                raise StoreError(f"{self._where}: {_first_line(exc)}") from exc
            except _Skipped:  # cancelled on the server side of the race: the deadline
                raise self._timed_out(what, ": no connection to the server") from None
        finally:
            self._limiter.release()

    async def _take_back(self, running: _Running, done: trio.Event) -> None:
        """Stop the thread of a call given up on, and wait until it gave its connection
        back: a cancel on the server, then, if the server does not answer it, the
        connection's socket shut down under the thread (guarantee 6)."""
        if done.is_set():
            return
        # One grace for the cancel and the wait after it: a frozen server holds
        # cancel_safe for its whole timeout, which must not double the bound.
        grace = trio.current_time() + CANCEL_GRACE_S
        await trio.to_thread.run_sync(running.cancel, limiter=self._cancel_limiter)
        with trio.move_on_at(grace):
            await done.wait()
        if not done.is_set():
            await trio.to_thread.run_sync(running.sever, limiter=self._cancel_limiter)
            await done.wait()

    async def _select(self, query: str, params: Sequence[object], what: str) -> list[Any]:
        """The rows of a read, made again while its connection is lost (guarantee 9)."""

        def read(conn: Connection[Any]) -> list[Any]:
            return conn.execute(query, params).fetchall()

        return await self.run_in_thread(read, again=read, what=what)

    # -- the protocol ----------------------------------------------------------

    async def append(self, key: SessionKey, entries: Sequence[Mapping[str, Any]]) -> None:
        """See ``SessionStore.append``."""
        batch = encode_entries(entries)
        await trio.lowlevel.checkpoint()
        self._check_open()
        if not batch:
            return
        # One append per key at a time in this process: it would only wait for
        # the row lock, holding a connection, behind this process's own append.
        async with self._locks.hold(key.name):
            self._check_open()
            clock_ms = self._clock() if self._clock is not None else None

            def append(conn: Connection[Any]) -> None:
                _append(conn, key, batch, clock_ms)

            # With a uuid each, a second try stores only what the first did not.
            twice_safe = all(uuid is not None for _, uuid, _ in batch)
            await self.run_in_thread(
                append, again=append if twice_safe else None, what=f"append to {key.name}"
            )

    async def load(self, key: SessionKey) -> list[dict[str, Any]] | None:
        """See ``SessionStore.load``."""
        entries = [e async for e in self.iter_entries(key)]
        return entries or None

    async def iter_entries(
        self, key: SessionKey, *, start: int = 0
    ) -> AsyncIterator[dict[str, Any]]:
        """See ``SessionStore.iter_entries``: from index ``start`` on, a page per query.

        Raises:
            UsageError: ``start`` is not an int >= 0.
        """
        check_start(start)
        await trio.lowlevel.checkpoint()
        self._check_open()
        params = (key.project, key.session_id, _subpath(key))
        seq = start
        while True:
            rows: list[tuple[int, str]] = await self._select(
                _SELECT_ENTRIES, (*params, seq, _PAGE), f"read of {key.name}"
            )
            for _, text in rows:
                yield json.loads(text)
            if len(rows) < _PAGE:
                return
            seq = rows[-1][0] + 1

    async def list_sessions(self, project: str) -> list[SessionInfo]:
        """See ``SessionStore.list_sessions``."""
        check_name("project", project)
        rows: list[tuple[str, int]] = await self._select(
            "SELECT session_id, mtime_ms FROM tak_sessions"
            " WHERE project = %s AND subpath = '' ORDER BY session_id",
            (project,),
            f"list_sessions of {project}",
        )
        return [SessionInfo(sid, mtime) for sid, mtime in rows]

    async def list_session_summaries(self, project: str) -> list[SessionSummary]:
        """See ``SessionStore.list_session_summaries``."""
        check_name("project", project)
        rows: list[tuple[str, int, object]] = await self._select(
            "SELECT session_id, mtime_ms, summary FROM tak_sessions"
            " WHERE project = %s AND subpath = '' ORDER BY session_id",
            (project,),
            f"list_session_summaries of {project}",
        )
        return [
            SessionSummary(sid, mtime, _summary_data(summary) or SummaryData())
            for sid, mtime, summary in rows
        ]

    async def delete(self, key: SessionKey) -> bool:
        """See ``SessionStore.delete``: one transaction, after appends in flight commit.

        Not made again when its connection is lost: a first try that committed
        would make the second say there was nothing to delete.
        """
        return await self.run_in_thread(
            lambda conn: _delete(conn, key), what=f"delete of {key.name}"
        )

    async def list_subkeys(self, key: SessionKey) -> list[str]:
        """See ``SessionStore.list_subkeys``."""
        prefix = "" if key.subpath is None else key.subpath + "/"
        rows: list[tuple[str]] = await self._select(
            "SELECT subpath FROM tak_sessions WHERE project = %s AND session_id = %s"
            " AND subpath <> '' AND starts_with(subpath, %s) ORDER BY subpath",
            (key.project, key.session_id, prefix),
            f"list_subkeys of {key.name}",
        )
        return [sub for (sub,) in rows]

    async def aclose(self) -> None:
        """Refuse further use and close the connections; finishes even if cancelled."""
        self._closed = True
        with trio.CancelScope(shield=True):
            async with self._opening:
                pool, self._pool = self._pool, None
            if pool is not None:
                await trio.to_thread.run_sync(lambda: pool.close(timeout=10.0))
            else:
                await trio.lowlevel.checkpoint()


# -- what the threads run ----------------------------------------------------


def _append(
    conn: Connection[Any], key: SessionKey, batch: list[EncodedEntry], clock_ms: int | None
) -> None:
    import psycopg
    from psycopg.types.json import Jsonb

    where = (key.project, key.session_id, _subpath(key))
    main = key.subpath is None
    with conn.transaction():
        row = conn.execute(_LOCK_KEY, where).fetchone()
        if row is None:  # the first append to this key: create its row, then lock it
            conn.execute(_CREATE_KEY, where)
            row = conn.execute(_LOCK_KEY, where).fetchone()
            assert row is not None
        next_seq, prev = row
        params = {
            "p": where[0],
            "s": where[1],
            "sub": where[2],
            "base": next_seq,
            "uuids": [u for _, u, _ in batch],
            "entries": [line[:-1].decode() for _, _, line in batch],
            "count": len(batch),
            "summary": Jsonb(_summary_json(_fold(prev, batch))) if main else None,
            "clock": clock_ms,
        }
        result = conn.execute(_APPEND, params).fetchone()
        assert result is not None
        stored, uuids = result
        if stored == 0:
            raise psycopg.Rollback  # nothing new: leave the mtime (and a new row) alone
        if stored < len(batch) and main:  # some uuids were stored already
            known = set(uuids)
            fresh = [e for e in batch if e[1] is None or e[1] in known]
            conn.execute(_SET_SUMMARY, (Jsonb(_summary_json(_fold(prev, fresh))), *where))


def _fold(prev: object, batch: list[EncodedEntry]) -> SummaryData:
    builder = SummaryBuilder(_summary_data(prev))
    builder.add_all(e for e, _, _ in batch)
    return builder.data()


def _delete(conn: Connection[Any], key: SessionKey) -> bool:
    with conn.transaction():
        if key.subpath is None:
            # Locks every row of the session: appends in flight commit first.
            rows = conn.execute(
                "DELETE FROM tak_sessions WHERE project = %s AND session_id = %s RETURNING 1",
                (key.project, key.session_id),
            ).fetchall()
            conn.execute(
                "DELETE FROM tak_entries WHERE project = %s AND session_id = %s",
                (key.project, key.session_id),
            )
            return bool(rows)
        where = (key.project, key.session_id, key.subpath)
        rows = conn.execute(
            "DELETE FROM tak_sessions WHERE project = %s AND session_id = %s AND subpath = %s"
            " RETURNING 1",
            where,
        ).fetchall()
        conn.execute(
            "DELETE FROM tak_entries WHERE project = %s AND session_id = %s AND subpath = %s",
            where,
        )
        return bool(rows)


def migrate_schema(
    conn: Connection[Any],
    where: str,
    migrations: Sequence[Sequence[str]] = _MIGRATIONS,
    *,
    table: str = "tak_schema_version",
    lock: int = _MIGRATION_LOCK,
    what: str = "schema",
) -> None:
    """Bring a schema up to date (see guarantee 8): the store's by default.

    ``migrations[n - 1]`` is version ``n``'s statements, applied in one
    transaction with its number recorded in ``table``, under
    ``pg_advisory_xact_lock(lock)``: processes starting together do not race.
    ``conn`` is in autocommit mode. Tables of other code beside the store's
    (the batch ledger's) use a ``table``, ``lock`` and ``what`` of their own.

    Raises:
        StoreError: ``WHERE: WHAT version N is newer than this tak knows (M): upgrade tak``.
    """
    from psycopg import sql

    versions = sql.Identifier(table)
    with conn.transaction():
        conn.execute("SELECT pg_advisory_xact_lock(%s)", (lock,))
        conn.execute(
            sql.SQL(
                "CREATE TABLE IF NOT EXISTS {} ("
                " version integer PRIMARY KEY,"
                " applied_at timestamptz NOT NULL DEFAULT clock_timestamp())"
            ).format(versions)
        )
        row = conn.execute(
            sql.SQL("SELECT coalesce(max(version), 0) FROM {}").format(versions)
        ).fetchone()
        current = int(row[0]) if row is not None else 0
        if current > len(migrations):
            raise StoreError(
                f"{where}: {what} version {current} is newer than this tak knows "
                f"({len(migrations)}): upgrade tak"
            )
        for version in range(current + 1, len(migrations) + 1):
            for statement in migrations[version - 1]:
                conn.execute(statement)
            conn.execute(
                sql.SQL("INSERT INTO {} (version) VALUES (%s)").format(versions), (version,)
            )


def _connection_lost(error: BaseException) -> bool:
    """Whether ``error`` (a ``StoreError`` of ``run_in_thread``) is the connection to
    the server lost: the server restarted or went away, or the network dropped it.

    The pool drops such a connection, so the call may work when made again. A
    statement timeout, a constraint broken, a server that answered with an
    error are not lost connections: the same call would fail the same way.
    """
    import psycopg

    cause = error.__cause__
    if not isinstance(cause, psycopg.OperationalError) or isinstance(
        cause, psycopg.errors.QueryCanceled
    ):
        return False
    state = cause.sqlstate
    # None: libpq's own error (the socket closed, the server not answering);
    # class 08: connection exception; 57P01-57P03: the server shutting down or
    # starting up.
    return state is None or state.startswith("08") or state in {"57P01", "57P02", "57P03"}


# -- urls --------------------------------------------------------------------


def parse_url(url: str) -> dict[str, Any]:
    """The connection parameters of a ``postgresql://`` URL.

    Raises:
        UsageError: not a ``postgresql://``/``postgres://`` URL libpq accepts,
            or psycopg is missing.
    """
    if not isinstance(url, str) or not url.startswith(("postgresql://", "postgres://")):
        raise UsageError(
            f"store url {_redact(url)!r}: expected postgresql://[user@]host[:port]/database"
        )
    try:
        from psycopg.conninfo import conninfo_to_dict
    except ImportError:
        raise UsageError(
            "PostgresStore needs psycopg: pip install 'trio-agent-kernel[postgres]'"
        ) from None
    try:
        conninfo = dict(conninfo_to_dict(url))
    except Exception as exc:  # psycopg.ProgrammingError, with libpq's reason
        raise UsageError(f"store url {_redact(url)!r}: {_redact(_first_line(exc))}") from None
    # libpq would only find a bad port when connecting, far from the config.
    for port in str(conninfo.get("port") or "5432").split(","):
        if not port.isdigit() or not 0 < int(port) < 65536:
            raise UsageError(f"store url {_redact(url)!r}: port {port!r} is not a port number")
    return conninfo


def _redact(text: object) -> str:
    """``text`` with the password of any URL in it masked (libpq quotes the URL)."""
    return _PASSWORD.sub(r"\1:***@", str(text))


def _describe(conninfo: Mapping[str, Any]) -> str:
    host = conninfo.get("host") or "localhost"
    port = conninfo.get("port") or 5432
    db = conninfo.get("dbname") or conninfo.get("user") or ""
    return f"PostgreSQL {host}:{port}/{db}"


def _check_seconds(name: str, value: object) -> None:
    # bool is an int in Python: refuse it; an endless wait is no limit at all.
    if isinstance(value, bool) or not (isinstance(value, int | float) and 0 < value < math.inf):
        raise UsageError(f"{name}: expected a positive number of seconds, got {value!r}")


#: The longest timeout PostgreSQL and libpq take, in milliseconds (a C int):
#: about 24.8 days. A longer one is that long on the server and the socket;
#: the client's deadline is still the one asked for.
MAX_TIMEOUT_MS = 2**31 - 1


def _milliseconds(seconds: float) -> int:
    """``seconds`` as a timeout setting of the server or libpq: 1 ms to ``MAX_TIMEOUT_MS``."""
    return min(MAX_TIMEOUT_MS, max(1, round(seconds * 1000)))


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
