"""PostgresStore against a server that stops answering or restarts: guarantees 6, 9
and 10 of kernel/store/_postgres.py, on a real server (``pg_to_break``: the
process's server for tests that break theirs, tests/store/pg_server.py).

A frozen server is ``SIGSTOP`` of the whole server (the postmaster and every
process it started), as a host that stops answering looks to a client: TCP still
accepts (the kernel's backlog) and acknowledges, nothing replies. A watchdog
thaws it after ``THAW_S``, so the code before the deadline existed returns
then instead of hanging the suite, and the test fails on what it got.
"""

from __future__ import annotations

import itertools
import logging
import os
import socket
from collections import Counter
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
import trio

from kernel.errors import StoreError
from kernel.store import PostgresStore, SessionKey
from kernel.store._postgres import KEEPALIVE_COUNT, KEEPALIVE_IDLE_S, KEEPALIVE_INTERVAL_S
from tests.store import pg_server

KEY = SessionKey("p", "s")
# Real seconds after which a frozen server is thawed whatever happened (a hang guard,
# not a measure: nothing here compares a duration with anything).
THAW_S = 60.0

_databases = itertools.count()


@pytest.fixture
def url(pg_to_break: pg_server.PgServer) -> str:
    return pg_server.create_database(pg_to_break, f"f{os.getpid()}_{next(_databases)}")


def entry(n: int) -> dict[str, Any]:
    return {"type": "t", "uuid": f"u{n}", "n": n}


@pytest.fixture
def server(pg_to_break: pg_server.PgServer) -> Iterator[pg_server.Freezer]:
    freezer = pg_server.Freezer(pg_to_break, thaw_after_s=THAW_S)
    try:
        yield freezer
    finally:
        freezer.thaw()


async def test_a_frozen_server_fails_each_call_at_its_deadline_then_works_again(
    url: str, server: pg_server.Freezer
) -> None:
    """10 and 6: with the whole server stopped, an append and a read each fail with a
    StoreError naming the call and its deadline, not a hang until the server comes
    back. Their threads were taken back (their connections cut, never used again):
    once the server answers, the append that failed has stored nothing (its
    transaction never got its COMMIT), and the same store works again."""
    async with PostgresStore(url, max_connections=1, request_timeout_s=2) as store:
        await store.append(KEY, [entry(0)])
        server.freeze()
        with pytest.raises(StoreError) as appended:
            await store.append(KEY, [entry(1)])
        assert str(appended.value) == f"{store.where}: append to p/s timed out after 2 s"
        with pytest.raises(StoreError, match=r"read of p/s timed out after 2 s"):
            await store.load(KEY)
        server.thaw()
        await store.append(KEY, [entry(2)])
        assert [e["n"] for e in await store.load(KEY) or []] == [0, 2]


async def test_calls_to_a_frozen_server_time_out_one_after_another(
    url: str, server: pg_server.Freezer
) -> None:
    """6: a call that timed out gives its connection slot back (its thread's socket
    shut down: the server did not answer the cancel), so the next call on a store
    of one connection times out on its own deadline, and so on."""
    async with PostgresStore(url, max_connections=1, request_timeout_s=2) as store:
        await store.append(KEY, [entry(0)])
        server.freeze()
        for n in (1, 2, 3):
            with pytest.raises(StoreError) as info:
                await store.append(KEY, [entry(n)])
            assert str(info.value).startswith(f"{store.where}: append to p/s timed out after 2 s")
        server.thaw()


async def test_connections_have_keepalives_and_a_user_timeout(url: str) -> None:
    """10: an idle connection to a host gone silent is dropped by the operating
    system (keepalives), and so is one whose data goes unacknowledged for longer
    than the request timeout (``TCP_USER_TIMEOUT``)."""

    def options(conn: psycopg.Connection[Any]) -> tuple[int, ...]:
        with socket.socket(fileno=os.dup(conn.pgconn.socket)) as sock:
            return tuple(
                sock.getsockopt(level, name)
                for level, name in (
                    (socket.SOL_SOCKET, socket.SO_KEEPALIVE),
                    (socket.IPPROTO_TCP, socket.TCP_KEEPIDLE),
                    (socket.IPPROTO_TCP, socket.TCP_KEEPINTVL),
                    (socket.IPPROTO_TCP, socket.TCP_KEEPCNT),
                    (socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT),
                )
            )

    async with PostgresStore(url, request_timeout_s=7.5) as store:
        got = await store.run_in_thread(options)
    assert got == (1, KEEPALIVE_IDLE_S, KEEPALIVE_INTERVAL_S, KEEPALIVE_COUNT, 7500)


async def test_writers_ride_out_a_ten_second_restart(
    url: str, pg_to_break: pg_server.PgServer, caplog: pytest.LogCaptureFixture
) -> None:
    """9: writers made with ``retry_lost_connections`` (a batch worker's store) go on
    through a server down for 10 s (stopped, 10 s, started: a restart as slow as
    one under load, a checkpoint, a crash recovery): no append fails, every acknowledged one is
    stored once; the waits were retries, logged."""
    caplog.set_level(logging.WARNING, logger="tak.store")
    acked: list[int] = []
    failed: list[str] = []
    restarted = trio.Event()
    async with PostgresStore(url, max_connections=4, retry_lost_connections=True) as store:

        async def writer(w: int) -> None:
            for i in itertools.count():
                n = w * 100_000 + i
                try:
                    await store.append(SessionKey("p", f"s{w}"), [entry(n)])
                except StoreError as exc:
                    failed.append(str(exc))
                    return
                acked.append(n)
                if restarted.is_set():
                    return
                await trio.sleep(0.05)

        async with trio.open_nursery() as nursery:
            for w in range(3):
                nursery.start_soon(writer, w)
            await trio.sleep(0.3)
            await trio.to_thread.run_sync(lambda: pg_server.restart(pg_to_break, down_s=10.0))
            restarted.set()
        assert failed == []
        stored = [
            e["n"] for w in range(3) for e in await store.load(SessionKey("p", f"s{w}")) or []
        ]
    assert sorted(stored) == sorted(acked)
    assert any("trying again in" in r.getMessage() for r in caplog.records)


def e(n: int, **extra: Any) -> dict[str, Any]:
    return {"type": "t", "uuid": f"u{n}", "n": n, **extra}


@pytest.fixture
def own_server(pg_to_break: pg_server.PgServer) -> pg_server.PgServer:
    """A server other tests do not use, to kill (running again after the test)."""
    return pg_to_break


async def test_pg_killed_server_mid_append_is_a_store_error_and_loses_nothing(
    own_server: pg_server.PgServer,
) -> None:
    """Appends running when the server is killed (-m immediate): a StoreError, not a hang
    or an acknowledgement; after a restart every acknowledged batch is there, whole, and
    the same store works again."""
    url = own_server.url()
    acked: list[int] = []
    errors: list[str] = []
    async with PostgresStore(url, max_connections=2) as store:
        await store.append(KEY, [e(-1)])

        async def writer(t: int) -> None:
            n = t
            while True:
                try:
                    await store.append(KEY, [e(n * 10 + j, b=n) for j in range(3)])
                except StoreError as exc:
                    errors.append(str(exc))
                    return
                acked.append(n)
                n += 2

        with trio.fail_after(15):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(writer, 0)
                nursery.start_soon(writer, 1)
                await trio.sleep(0.3)
                await trio.to_thread.run_sync(pg_server.stop, own_server, "immediate")
        assert len(errors) == 2 and all(x.startswith("PostgreSQL 127.0.0.1:") for x in errors)
        await trio.to_thread.run_sync(pg_server.start, own_server)
        with trio.fail_after(20):
            while True:  # the pool reconnects in the background
                try:
                    await store.append(KEY, [e(-2)])
                    break
                except StoreError:
                    await trio.sleep(0.2)
        stored = Counter(x["b"] for x in await store.load(KEY) or [] if "b" in x)
    assert acked
    for n in acked:
        assert stored[n] == 3, f"batch {n} acknowledged, then lost"
    assert all(c == 3 for c in stored.values())
