"""Attacks on PostgresStore's bounded calls (issue 22, items 7 and 8): settings at
their edges and a user's own socket settings, on a real server (tests/store/pg_server.py).

Each test names the guarantee of kernel/store/_postgres.py it attacks.
"""

from __future__ import annotations

import contextlib
import itertools
import os
from collections.abc import Iterator
from typing import Any

import pytest
import trio

from kernel.errors import StoreError
from kernel.store import PostgresStore, SessionKey
from tests.store import pg_server

KEY = SessionKey("p", "s")
_databases = itertools.count()


def entry(n: int) -> dict[str, Any]:
    return {"type": "t", "uuid": f"u{n}", "n": n}


def with_query(url: str, query: str) -> str:
    return url + ("&" if "?" in url else "?") + query


@pytest.mark.parametrize("timeout_s", [3e6, 1e9, 1e300])
async def test_a_request_timeout_longer_than_postgres_counts_still_works(
    db_url: str, timeout_s: float
) -> None:
    """10: a ``request_timeout_s`` that is a positive number of seconds but more
    milliseconds than a C int (about 24.8 days) is accepted, so the store works
    with it: the statement timeout and ``tcp_user_timeout`` it sets are at
    PostgreSQL's longest, not a number libpq refuses on every connection."""
    async with PostgresStore(db_url, request_timeout_s=timeout_s) as store:
        await store.append(KEY, [entry(0)])
        assert await store.load(KEY) == [entry(0)]

        def settings(conn: Any) -> tuple[str, str]:
            row = conn.execute("SHOW statement_timeout").fetchone()
            return row[0], conn.info.get_parameters()["tcp_user_timeout"]

        statement, user_timeout = await store.run_in_thread(settings)
        assert user_timeout == str(2**31 - 1)
        assert statement == f"{2**31 - 1}ms"


async def test_the_urls_own_socket_settings_win(db_url: str) -> None:
    """10: keepalives, ``tcp_user_timeout`` and ``connect_timeout`` set in the URL
    are the user's: the store's defaults fill in only what the URL leaves unset
    (psycopg would let them override the URL's silently)."""
    url = with_query(db_url, "keepalives_idle=77&tcp_user_timeout=1234&connect_timeout=3")
    async with PostgresStore(url, request_timeout_s=9) as store:
        params: dict[str, str] = await store.run_in_thread(lambda c: c.info.get_parameters())
    assert params["keepalives_idle"] == "77"
    assert params["tcp_user_timeout"] == "1234"
    assert params["connect_timeout"] == "3"
    # What the URL leaves unset is still the store's.
    assert params["keepalives"] == "1"
    assert params["keepalives_interval"] == "5" and params["keepalives_count"] == "3"


async def test_keepalives_the_url_turns_off_stay_off(db_url: str) -> None:
    """10: ``keepalives=0`` in the URL is the user's choice (the client's deadline
    still bounds every call)."""
    async with PostgresStore(with_query(db_url, "keepalives=0")) as store:
        params: dict[str, str] = await store.run_in_thread(lambda c: c.info.get_parameters())
        await store.append(KEY, [entry(1)])
    assert params["keepalives"] == "0"
    assert params["tcp_user_timeout"] == "30000"


class _CommitFreezes:
    """A connection whose transaction's COMMIT goes to a frozen server: the client
    gives up at its deadline, and the server, once thawed, commits anyway."""

    def __init__(self, conn: Any, freezer: pg_server.Freezer) -> None:
        self._conn = conn
        self._freezer = freezer

    def __getattr__(self, name: str) -> Any:
        return getattr(self._conn, name)

    @contextlib.contextmanager
    def transaction(self) -> Iterator[Any]:
        with self._conn.transaction() as tx:
            yield tx
            self._freezer.freeze()


async def test_an_append_that_timed_out_but_committed_is_not_stored_twice_by_its_retry(
    pg_to_break: pg_server.PgServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """3 and 10: an append whose COMMIT reached the server as it froze fails at its
    deadline (the caller is told it failed), whether or not the server commits it
    once thawed (here its idle-in-transaction timeout ends that session first; over
    a slow network it may commit): the caller's retry of the same entries (same
    uuids) stores them once, and the summary counts them once."""
    from kernel.store import _postgres

    url = pg_server.create_database(pg_to_break, f"atk{os.getpid()}_{next(_databases)}")
    freezer = pg_server.Freezer(pg_to_break, thaw_after_s=60.0)
    real_append = _postgres._append
    armed = [False]

    def append(conn: Any, key: SessionKey, batch: Any, clock_ms: Any) -> None:
        if armed[0]:
            armed[0] = False
            conn = _CommitFreezes(conn, freezer)
        real_append(conn, key, batch, clock_ms)

    monkeypatch.setattr(_postgres, "_append", append)
    try:
        async with PostgresStore(url, request_timeout_s=2) as store:
            await store.append(KEY, [entry(0)])  # connected; the next append is armed
            armed[0] = True
            with pytest.raises(StoreError, match=r"append to p/s timed out after 2 s"):
                await store.append(KEY, [entry(1), entry(2)])
            freezer.thaw()
            await store.append(KEY, [entry(1), entry(2)])  # the caller's retry
            assert await store.load(KEY) == [entry(0), entry(1), entry(2)]
            [summary] = await store.list_session_summaries("p")
            assert summary.data.entry_count == 3 and summary.data.type_counts == {"t": 3}
    finally:
        freezer.thaw()


async def test_more_calls_than_connections_on_a_frozen_server_each_end_at_its_deadline(
    pg_to_break: pg_server.PgServer,
) -> None:
    """10 and 6: six calls at once on a store of two connections, the server frozen:
    the two that hold a connection and the four that wait for one all fail at their
    deadlines while the server is still frozen (none waits for a frozen
    connection past its own deadline); once thawed, the store works."""
    url = pg_server.create_database(pg_to_break, f"atk{os.getpid()}_{next(_databases)}")
    freezer = pg_server.Freezer(pg_to_break, thaw_after_s=60.0)
    outcomes: dict[int, str] = {}
    try:
        async with PostgresStore(url, max_connections=2, request_timeout_s=2) as store:
            await store.append(KEY, [entry(0)])
            freezer.freeze()

            async def call(n: int) -> None:
                try:
                    await store.append(SessionKey("p", f"s{n}"), [entry(n)])
                except StoreError as exc:
                    outcomes[n] = "timed out" if "timed out after 2 s" in str(exc) else str(exc)
                else:
                    outcomes[n] = "stored"
                if freezer.frozen:
                    outcomes[n] += " while frozen"

            async with trio.open_nursery() as nursery:
                for n in range(1, 7):
                    nursery.start_soon(call, n)
            freezer.thaw()
            await store.append(KEY, [entry(7)])
            assert await store.load(KEY) == [entry(0), entry(7)]
    finally:
        freezer.thaw()
    assert outcomes == {n: "timed out while frozen" for n in range(1, 7)}


async def test_a_migration_lock_held_elsewhere_leaves_no_connection_waiting_on_it(
    db_url: str,
) -> None:
    """10: the first use applies the schema under an advisory lock; another process
    holding it (a migration hung, a frozen host that took it) made each call's
    connecting thread wait on the server forever, abandoned at the call's deadline,
    and the next call start one more: connections to the server and threads grew
    with every call. The schema's statements are bounded like every other: while
    the lock is still held, every waiting connection ends, and once it is free the
    store works."""
    import psycopg

    from kernel.store._postgres import _MIGRATION_LOCK

    def waiting(conn: psycopg.Connection[Any]) -> int:
        row = conn.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()"
            " AND wait_event_type = 'Lock' AND pid <> pg_backend_pid()"
        ).fetchone()
        assert row is not None
        return int(row[0])

    with psycopg.connect(db_url, autocommit=True) as holder:
        holder.execute("SELECT pg_advisory_lock(%s)", (_MIGRATION_LOCK,))
        async with PostgresStore(db_url, request_timeout_s=1) as store:
            for n in range(4):
                # The call's deadline, or (on a loaded machine, where it is seen late)
                # the schema's statement timeout: both one line.
                with pytest.raises(
                    StoreError, match=r"timed out after 1 s|canceling statement due to"
                ):
                    await store.append(KEY, [entry(n)])
            with trio.fail_after(30):  # a hang guard: unbounded, they never end
                while await trio.to_thread.run_sync(waiting, holder):  # noqa: ASYNC110
                    await trio.sleep(0.1)
            holder.execute("SELECT pg_advisory_unlock(%s)", (_MIGRATION_LOCK,))
            await store.append(KEY, [entry(9)])
            assert await store.load(KEY) == [entry(9)]


async def test_streaming_a_transcript_from_a_server_that_freezes_midway_fails_at_the_deadline(
    pg_to_break: pg_server.PgServer,
) -> None:
    """10: ``iter_entries`` reads a page per query; the server frozen after the
    first page was yielded, the next page fails with the read's StoreError while
    the server is still frozen (the consumer is not held); ``list_sessions`` too.
    Once thawed, a new stream reads everything."""
    url = pg_server.create_database(pg_to_break, f"atk{os.getpid()}_{next(_databases)}")
    freezer = pg_server.Freezer(pg_to_break, thaw_after_s=60.0)
    entries = [entry(n) for n in range(1200)]  # three pages
    try:
        async with PostgresStore(url, request_timeout_s=2) as store:
            await store.append(KEY, entries)
            seen: list[dict[str, Any]] = []
            with pytest.raises(StoreError, match=r"read of p/s timed out after 2 s"):
                async for e in store.iter_entries(KEY):
                    seen.append(e)
                    if len(seen) == 1:
                        freezer.freeze()
            assert freezer.frozen and seen == entries[:500]
            with pytest.raises(StoreError, match=r"list_sessions of p timed out after 2 s"):
                await store.list_sessions("p")
            assert freezer.frozen
            freezer.thaw()
            assert [e async for e in store.iter_entries(KEY)] == entries
    finally:
        freezer.thaw()
