"""``PostgresLedger``: a run's tasks in PostgreSQL, claimed by workers on any number of hosts.

Every worker (``tak batch worker --run RUN --store URL``) opens the same run
and claims tasks from one table with ``SELECT ... FOR UPDATE SKIP LOCKED``
under a lease: a claim lasts ``lease_seconds`` (the run's, set when it is
made, so every worker agrees) unless its worker renews it (``run_batch``
does, every third of a lease), so a task whose worker died is handed to
another one, as its next attempt, once the lease lapses.

It keeps the four guarantees of ``kernel.batch._ledger`` this way:

1. ``add_tasks`` runs in one transaction under the run row's lock, so
   processes adding the same tasks at once do not race: ids already stored
   with the same content (compared as JSON values) are skipped, with other
   content refused; new ones are numbered on (their task order).
2. ``claim`` is one statement: the first ``limit`` tasks in task order with
   no finished result and no lease, or a lapsed one, that no other
   transaction holds (``SKIP LOCKED``), get this worker's lease and their
   attempt counted up. Lease times come from the database clock
   (``now()``), never a worker's, so hosts with skewed clocks agree on
   when a lease lapses. ``renew`` extends only leases the worker still holds,
   and returns the others (guarantee 5 of ``kernel.batch._ledger``).
3. ``finish`` of a finished result is ``UPDATE ... WHERE NOT finished``: the
   first wins, later ones return False. A ``cancelled`` result releases the
   worker's lease and is kept (as the task's latest result until a finished
   one comes). Every accepted result is also appended to
   ``tak_batch_results``, the run's history. The stored result's
   ``finished_at`` is the database clock's.
4. A result is committed before ``finish`` returns (the server's fsync
   makes it durable).

And one of its own:

5. A worker outlives a database restart shorter than its
   ``request_timeout_s`` (30 s by default): its store is made with
   ``retry_lost_connections`` (the store's guarantee 9), so a call whose
   connection was lost (the server restarting, the network dropping it) is
   made again, after each of the store's ``RETRY_DELAYS``, each retry
   logged, waiting for the server to be back within the call's deadline;
   then it fails with the last one-line ``StoreError``, saying it gave up.
   A server that stops answering (frozen, its host gone) fails the call at
   its deadline: ``StoreError: ... claim of run 'r' timed out after 30 s``
   (the store's guarantee 10). Only a lost connection is retried: a
   statement timeout or an error the server answered would come again.
   Every call is safe to make again: ``add_tasks`` skips what is stored,
   ``renew`` only extends, and ``finish`` made again first looks whether its
   first try committed before its reply was lost (the stored result is this
   one, but for the database's ``finished_at``): then it returns True and
   writes nothing, so a result is never lost nor recorded twice. A ``claim`` whose reply was
   lost after it committed leaves its tasks leased to this worker until the
   lease lapses: they are then claimed again, as their next attempt.

Connections, threads and cancellation are the ``PostgresStore``'s (the
ledger drives one; see kernel/store/_postgres.py): psycopg's sync API in
threads, a statement timeout on every session, a cancelled call cancels its
query on the server, a database error is a one-line ``StoreError`` naming
the server. Tasks and results are stored as ``json`` (the exact text), not
``jsonb``, which refuses ``\\u0000`` in strings.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

import attrs

from kernel._checks import check_positive
from kernel.errors import UsageError
from kernel.store import PostgresStore
from kernel.store._postgres import DEFAULT_REQUEST_TIMEOUT_S, migrate_schema

# The records' boundary, both ways: "WHERE: $.path: reason", and "WHAT cannot be stored".
from ._directory import MAX_LINE_BYTES, _encode, _structure
from ._ledger import Claim, LedgerCounts
from ._records import BatchTask, TaskResult, check_run_id, new_run_nonce, session_project
from ._view import RunView, model_of

if TYPE_CHECKING:
    from psycopg import Connection

T = TypeVar("T")
R = TypeVar("R")

# pg_advisory_xact_lock key of the ledger's schema migrations ("tak" + 2;
# the store's is "tak" + 1).
_MIGRATION_LOCK = 0x74616B02

#: How long a claim lasts unless renewed, for a run made without ``lease_seconds``.
DEFAULT_LEASE_S = 30.0
#: The longest lease a run may have: a year (a lease is renewed every third of it).
MAX_LEASE_S = 365 * 24 * 3600.0

# Connections (and threads) one ledger uses at most: a worker claims, renews
# and finishes, a few statements at a time.
_MAX_CONNECTIONS = 4

# Each version is a list of statements, applied in one transaction. Never
# edit one that has shipped: add the next.
_MIGRATIONS: tuple[tuple[str, ...], ...] = (
    (
        """
        CREATE TABLE tak_batch_runs (
            run_id text COLLATE "C" PRIMARY KEY,
            created timestamptz NOT NULL DEFAULT now(),
            settings json NOT NULL,
            lease_seconds float8 NOT NULL,      -- what a worker's claim lasts unless renewed
            next_ord bigint NOT NULL DEFAULT 0  -- the task order of the next task added
        )
        """,
        """
        CREATE TABLE tak_batch_tasks (
            run_id text COLLATE "C" NOT NULL,
            task_id text COLLATE "C" NOT NULL,
            ord bigint NOT NULL,
            task json NOT NULL,
            attempt integer NOT NULL DEFAULT 0,     -- claims so far
            lease_owner text,
            lease_until timestamptz,
            finished boolean NOT NULL DEFAULT false,
            result json,                            -- the latest result
            PRIMARY KEY (run_id, task_id)
        )
        """,
        "CREATE UNIQUE INDEX tak_batch_tasks_ord ON tak_batch_tasks (run_id, ord)",
        """
        CREATE INDEX tak_batch_tasks_open ON tak_batch_tasks (run_id, ord)
            WHERE NOT finished
        """,
        """
        CREATE TABLE tak_batch_results (
            run_id text COLLATE "C" NOT NULL,
            task_id text COLLATE "C" NOT NULL,
            seq bigint GENERATED ALWAYS AS IDENTITY,
            worker text,
            recorded_at timestamptz NOT NULL DEFAULT now(),
            result json NOT NULL,
            PRIMARY KEY (run_id, task_id, seq)
        )
        """,
    ),
    (
        # What names the run's sessions (batch.<run id>.<nonce>), made with the
        # run: NULL in a run made before, whose sessions are batch.<run id>.
        "ALTER TABLE tak_batch_runs ADD COLUMN nonce text",
    ),
)

_CLAIM = """
WITH picked AS (
    SELECT task_id FROM tak_batch_tasks
    WHERE run_id = %(run)s AND NOT finished AND (lease_until IS NULL OR lease_until <= now())
    ORDER BY ord
    LIMIT %(limit)s
    FOR UPDATE SKIP LOCKED
)
UPDATE tak_batch_tasks t SET
    lease_owner = %(worker)s,
    lease_until = now() + make_interval(secs => %(lease)s),
    attempt = t.attempt + 1
FROM picked
WHERE t.run_id = %(run)s AND t.task_id = picked.task_id
RETURNING t.ord, t.task_id, t.task::text, t.attempt
"""
_RENEW = """
UPDATE tak_batch_tasks SET lease_until = now() + make_interval(secs => %(lease)s)
WHERE run_id = %(run)s AND task_id = ANY(%(ids)s) AND lease_owner = %(worker)s AND NOT finished
RETURNING task_id
"""
# A finished result: written once, and the lease is gone with it.
_FINISH = """
UPDATE tak_batch_tasks SET finished = true, result = %(result)s::json,
    lease_owner = NULL, lease_until = NULL
WHERE run_id = %(run)s AND task_id = %(task)s AND NOT finished
RETURNING 1
"""
# A cancelled one: the task's latest result, and this worker's lease released.
_CANCEL = """
UPDATE tak_batch_tasks SET result = %(result)s::json,
    lease_owner = CASE WHEN lease_owner = %(worker)s THEN NULL ELSE lease_owner END,
    lease_until = CASE WHEN lease_owner = %(worker)s THEN NULL ELSE lease_until END
WHERE run_id = %(run)s AND task_id = %(task)s AND NOT finished
RETURNING 1
"""
_HISTORY = """
INSERT INTO tak_batch_results (run_id, task_id, worker, result)
VALUES (%(run)s, %(task)s, %(worker)s, %(result)s::json)
"""
_COUNTS = """
SELECT count(*), count(*) FILTER (WHERE finished),
       count(*) FILTER (WHERE NOT finished AND lease_until > now())
FROM tak_batch_tasks WHERE run_id = %s
"""


def _json_text(record: object, what: str) -> str:
    """``record`` as the JSON text the directory ledger writes, which PostgreSQL
    stores as sent.

    Raises:
        UsageError: ``WHAT cannot be stored: reason`` (NaN, a lone surrogate, an
            object that is not data).
    """
    return _encode(record, what)[:-1].decode()


class PostgresLedger:
    """A run's tasks and results in PostgreSQL (see the module docstring).

    Made by ``open_postgres_ledger``; tables are ``tak_batch_runs``,
    ``tak_batch_tasks`` and ``tak_batch_results`` (and
    ``tak_batch_schema_version``), beside the store's: the ledger drives a
    ``PostgresStore`` of its own, which applies the store's schema too.
    """

    def __init__(
        self,
        store: PostgresStore,
        run_id: str,
        *,
        lease_seconds: float,
        created: float,
        settings: Mapping[str, Any],
        nonce: str | None = None,
    ) -> None:
        self._store = store
        self._run_id = run_id
        self._nonce = nonce
        self._lease = lease_seconds
        self._created = created
        self._settings = dict(settings)

    def __repr__(self) -> str:
        return f"PostgresLedger({self._run_id!r}, {self._store!r})"

    @property
    def run_id(self) -> str:
        return self._run_id

    @property
    def session_project(self) -> str:
        """The store project of the run's task sessions (``Ledger`` guarantee 6)."""
        return session_project(self._run_id, self._nonce)

    @property
    def lease_seconds(self) -> float:
        return self._lease

    @property
    def request_timeout_s(self) -> float:
        """The longest one ledger call may take, its retries included."""
        return self._store.request_timeout_s

    @property
    def created(self) -> float:
        """When the run was first opened: Unix time, by the database clock."""
        return self._created

    @property
    def settings(self) -> dict[str, Any]:
        """The run's settings, as given by whoever opened it first."""
        return dict(self._settings)

    def _structure(self, text: str, cls: type[R], task_id: str) -> R:
        """A stored task or result as its record (one a newer tak wrote may not be).

        Raises:
            UsageError: ``PostgreSQL host:port/db: run R, task T: $.path: reason``.
        """
        kind = "task" if cls is BatchTask else "result of task"
        where = f"{self._store.where}: run {self._run_id!r}, {kind} {task_id!r}"
        record: R = _structure(json.loads(text), cls, where)
        return record

    async def _run(
        self,
        what: str,
        fn: Callable[[Connection[Any]], T],
        *,
        again: Callable[[Connection[Any]], T] | None = None,
    ) -> T:
        """``fn`` in the store's thread (its pool, cancellation, deadline and errors),
        made again (``again`` instead, if given) while its connection is lost
        (guarantee 5). ``what`` names the call in a timeout's message.

        Raises:
            StoreError: a database error, the connection lost on every try, or
                ``WHERE: WHAT of run R timed out after N s``.
        """
        return await self._store.run_in_thread(
            fn, again=again or fn, what=f"{what} of run {self._run_id!r}"
        )

    async def add_tasks(self, tasks: Sequence[BatchTask]) -> None:
        """See ``Ledger.add_tasks`` (guarantee 1).

        Raises:
            UsageError: a task is not a BatchTask, is not storable as JSON, is
                longer than ``MAX_LINE_BYTES`` as JSON (as for a run directory), or
                has the id of a stored (or earlier given) task with other content.
        """
        encoded: dict[str, str] = {}
        for i, task in enumerate(tasks):
            if not isinstance(task, BatchTask):
                raise UsageError(f"tasks[{i}]: expected a BatchTask, got {type(task).__name__}")
            text = _json_text(task, f"task {task.id!r}")
            size = len(text.encode())
            if size > MAX_LINE_BYTES:
                raise UsageError(
                    f"tasks[{i}]: task {task.id!r} is {size} bytes as JSON; a task may be "
                    f"at most {MAX_LINE_BYTES}"
                )
            known = encoded.setdefault(task.id, text)
            if known != text and json.loads(known) != json.loads(text):
                raise UsageError(f"tasks[{i}]: task {task.id!r} is given twice, differently")
        if encoded:
            await self._run("add_tasks", lambda conn: _add_tasks(conn, self._run_id, encoded))

    async def claim(self, worker: str, limit: int) -> list[Claim]:
        """See ``Ledger.claim`` (guarantee 2)."""
        _check_worker(worker)
        check_positive(limit, "claim: limit", integer=True)
        params = {"run": self._run_id, "limit": limit, "worker": worker, "lease": self._lease}
        rows: list[tuple[int, str, str, int]] = await self._run(
            "claim", lambda conn: conn.execute(_CLAIM, params).fetchall()
        )
        rows.sort()
        return [
            Claim(task=self._structure(text, BatchTask, task_id), attempt=attempt)
            for _, task_id, text, attempt in rows
        ]

    async def renew(self, worker: str, task_ids: Sequence[str]) -> list[str]:
        """See ``Ledger.renew`` (guarantee 5): leases another worker took over are
        left alone, and returned, with the tasks finished meanwhile."""
        _check_worker(worker)
        ids = list(task_ids)
        if not ids:
            return []
        params = {"run": self._run_id, "ids": ids, "worker": worker, "lease": self._lease}
        rows: list[tuple[str]] = await self._run(
            "renew", lambda conn: conn.execute(_RENEW, params).fetchall()
        )
        held = {task_id for (task_id,) in rows}
        return [task_id for task_id in ids if task_id not in held]

    async def finish(self, worker: str, result: TaskResult) -> bool:
        """See ``Ledger.finish`` (guarantees 3 and 4).

        Raises:
            UsageError: ``result`` is not a TaskResult, or names a task not in the run.
        """
        _check_worker(worker)
        if not isinstance(result, TaskResult):
            raise UsageError(f"finish: expected a TaskResult, got {type(result).__name__}")
        # finished_at is set to the database clock's in the transaction; the rest
        # is checked here, so a bad result fails before any round trip.
        _json_text(result, f"the result of task {result.id!r}")
        return await self._run(
            f"finish of task {result.id!r}",
            lambda conn: _finish(conn, self._run_id, worker, result, again=False),
            again=lambda conn: _finish(conn, self._run_id, worker, result, again=True),
        )

    async def results(self) -> list[TaskResult]:
        """See ``Ledger.results``."""
        rows: list[tuple[str, str]] = await self._run(
            "results",
            lambda conn: conn.execute(
                "SELECT task_id, result::text FROM tak_batch_tasks"
                " WHERE run_id = %s AND result IS NOT NULL ORDER BY ord",
                (self._run_id,),
            ).fetchall(),
        )
        return [self._structure(text, TaskResult, task_id) for task_id, text in rows]

    async def counts(self) -> LedgerCounts:
        """See ``Ledger.counts``: running is the tasks under a live lease."""
        row: tuple[int, int, int] | None = await self._run(
            "counts", lambda conn: conn.execute(_COUNTS, (self._run_id,)).fetchone()
        )
        assert row is not None
        total, finished, running = row
        return LedgerCounts(total=total, finished=finished, running=running)

    async def aclose(self) -> None:
        """Close the connections; finishes even if cancelled."""
        await self._store.aclose()


@contextlib.asynccontextmanager
async def open_postgres_ledger(
    url: str,
    run_id: str,
    *,
    lease_seconds: float | None = None,
    settings: Mapping[str, Any] | None = None,
    create: bool = True,
    request_timeout_s: float = DEFAULT_REQUEST_TIMEOUT_S,
) -> AsyncIterator[PostgresLedger]:
    """Open run ``run_id`` in the PostgreSQL database at ``url``; close it on exit.

    The ledger's tables are made if missing (under an advisory lock, so
    workers starting together do not race). The run's row is made on first
    open, with ``settings`` (the run's model, concurrency, limits...: any
    JSON object), ``lease_seconds`` (default ``DEFAULT_LEASE_S``) and a nonce
    (which names the run's sessions: ``session_project``); later opens keep the
    first settings and nonce, and take the run's lease unless given their own.
    ``request_timeout_s`` bounds each ledger call, its retries included
    (``[store] request_timeout_s`` of tak.toml; guarantee 10 of the store).

    Raises:
        UsageError: a bad ``url``, ``run_id``, ``lease_seconds`` or
            ``request_timeout_s``; settings not
            storable as JSON; ``create=False`` and no such run.
        StoreError: the database cannot be reached, or its ledger schema is
            newer than this code.
    """
    check_run_id(run_id, "run_id")
    if lease_seconds is not None and (
        isinstance(lease_seconds, bool)
        or not (isinstance(lease_seconds, int | float) and 0 < lease_seconds <= MAX_LEASE_S)
    ):
        # Past the database's timestamps, every claim would fail ("timestamp out of
        # range") far from the setting: refused here, with the bound.
        raise UsageError(
            f"lease_seconds: expected a positive number of seconds up to {MAX_LEASE_S:g}"
            f" (a year), got {lease_seconds!r}"
        )
    new_lease = DEFAULT_LEASE_S if lease_seconds is None else float(lease_seconds)
    settings_text = _json_text(dict(settings or {}), "settings")
    store = PostgresStore(
        url,
        max_connections=_MAX_CONNECTIONS,
        request_timeout_s=request_timeout_s,
        retry_lost_connections=True,
    )
    async with store:
        where = store.where  # "PostgreSQL host:port/db", as the store's errors say

        def open_run(conn: Connection[Any]) -> tuple[float, dict[str, Any], float, str | None]:
            return _open_run(conn, where, run_id, settings_text, new_lease, create=create)

        row = await store.run_in_thread(open_run, again=open_run, what=f"opening run {run_id!r}")
        created, stored_settings, run_lease, nonce = row
        yield PostgresLedger(
            store,
            run_id,
            lease_seconds=run_lease if lease_seconds is None else float(lease_seconds),
            created=created,
            settings=stored_settings,
            nonce=nonce,
        )


def _check_worker(worker: object) -> None:
    # PostgreSQL text cannot hold NUL: refused here, in the caller's words.
    if not isinstance(worker, str) or not 0 < len(worker) <= 256 or "\x00" in worker:
        raise UsageError(f"worker: expected 1 to 256 characters without NUL, got {worker!r}")


# -- what the threads run ----------------------------------------------------


def _open_run(
    conn: Connection[Any], where: str, run_id: str, settings: str, lease: float, *, create: bool
) -> tuple[float, dict[str, Any], float, str | None]:
    migrate_schema(
        conn,
        where,
        _MIGRATIONS,
        table="tak_batch_schema_version",
        lock=_MIGRATION_LOCK,
        what="batch ledger schema",
    )
    if create:
        conn.execute(
            "INSERT INTO tak_batch_runs (run_id, settings, lease_seconds, nonce)"
            " VALUES (%s, %s::json, %s, %s) ON CONFLICT DO NOTHING",
            (run_id, settings, lease, new_run_nonce()),
        )
    row = conn.execute(
        "SELECT extract(epoch FROM created)::float8, settings::text, lease_seconds, nonce"
        " FROM tak_batch_runs WHERE run_id = %s",
        (run_id,),
    ).fetchone()
    if row is None:
        raise UsageError(f"run {run_id!r}: no such run in {where}")
    created, text, run_lease, nonce = row
    stored = json.loads(text)
    settings_of = stored if isinstance(stored, dict) else {}
    return float(created), settings_of, float(run_lease), nonce


def _add_tasks(conn: Connection[Any], run_id: str, encoded: dict[str, str]) -> None:
    with conn.transaction():
        # The run row's lock orders concurrent add_tasks of a run.
        row = conn.execute(
            "SELECT next_ord FROM tak_batch_runs WHERE run_id = %s FOR UPDATE", (run_id,)
        ).fetchone()
        if row is None:
            raise UsageError(f"run {run_id!r}: no such run (was it deleted?)")
        (next_ord,) = row
        ids = list(encoded)
        stored = conn.execute(
            "SELECT task_id, task::text FROM tak_batch_tasks"
            " WHERE run_id = %s AND task_id = ANY(%s)",
            (run_id, ids),
        ).fetchall()
        for task_id, text in stored:
            if text != encoded[task_id] and json.loads(text) != json.loads(encoded[task_id]):
                raise UsageError(
                    f"task {task_id!r}: run {run_id!r} already holds a task with this id"
                    " and other content"
                )
        known = {task_id for task_id, _ in stored}
        fresh = [task_id for task_id in ids if task_id not in known]
        if not fresh:
            return
        conn.execute(
            "INSERT INTO tak_batch_tasks (run_id, task_id, ord, task)"
            " SELECT %s, t.id, %s + t.n - 1, t.task::json"
            " FROM unnest(%s::text[], %s::text[]) WITH ORDINALITY AS t(id, task, n)",
            (run_id, next_ord, fresh, [encoded[task_id] for task_id in fresh]),
        )
        conn.execute(
            "UPDATE tak_batch_runs SET next_ord = %s WHERE run_id = %s",
            (next_ord + len(fresh), run_id),
        )


def _finish(
    conn: Connection[Any], run_id: str, worker: str, result: TaskResult, *, again: bool
) -> bool:
    with conn.transaction():
        if again:  # the first try may have committed before its reply was lost
            stored = conn.execute(
                "SELECT result::text FROM tak_batch_tasks"
                " WHERE run_id = %s AND task_id = %s FOR UPDATE",
                (run_id, result.id),
            ).fetchone()
            if stored is not None and stored[0] is not None and _same_result(stored[0], result):
                return True
        row = conn.execute("SELECT extract(epoch FROM now())::float8").fetchone()
        assert row is not None
        stamped = attrs.evolve(result, finished_at=float(row[0]))
        params = {
            "run": run_id,
            "task": result.id,
            "worker": worker,
            "result": _json_text(stamped, f"the result of task {result.id!r}"),
        }
        done = conn.execute(_FINISH if result.finished else _CANCEL, params).fetchone()
        if done is None:
            exists = conn.execute(
                "SELECT 1 FROM tak_batch_tasks WHERE run_id = %s AND task_id = %s",
                (run_id, result.id),
            ).fetchone()
            if exists is None:
                raise UsageError(f"finish: task {result.id!r} is not in run {run_id!r}")
            return False
        conn.execute(_HISTORY, params)
        return True


def _same_result(stored: str, result: TaskResult) -> bool:
    """Whether ``stored`` is ``result`` but for ``finished_at`` (the database's)."""
    ours = json.loads(_json_text(result, f"the result of task {result.id!r}"))
    theirs = json.loads(stored)
    if not isinstance(theirs, dict):
        return False
    ours.pop("finished_at", None)
    theirs.pop("finished_at", None)
    return bool(ours == theirs)


async def read_postgres_run(url: str, run_id: str, *, request_timeout_s: float) -> RunView:
    """The run ``run_id`` of the PostgreSQL store at ``url``.

    Raises:
        UsageError: not a valid run id, or no such run.
        StoreError: the store cannot be reached (one line naming it).
    """
    check_run_id(run_id, "RUN")
    async with open_postgres_ledger(
        url, run_id, create=False, request_timeout_s=request_timeout_s
    ) as ledger:
        results = await ledger.results()
        counts = await ledger.counts()
        return RunView(
            run_id=run_id,
            where=repr(ledger),
            created=ledger.created,
            model=model_of(ledger.settings),
            session_project=ledger.session_project,
            total=counts.total,
            results=tuple(results),
        )


__all__ = [
    "DEFAULT_LEASE_S",
    "MAX_LEASE_S",
    "PostgresLedger",
    "open_postgres_ledger",
    "read_postgres_run",
]
