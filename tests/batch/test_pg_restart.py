"""Guarantee 5 of kernel/batch/_postgres.py (9 of kernel/store/_postgres.py): a worker
outlives a short database restart.

The server is a real one of its own (tests/store/pg_server.py), restarted with
a fast shutdown and a start (``pg_server.restart``) under a ledger, a store and a ``tak batch worker``
process: the restart breaks every connection the pools hold, and the calls
that meet them are made again until the server is back. A reply lost after
its transaction committed (which a restart cannot be timed to hit), and a
server down for good, are made at the store's one-call seam, ``_run_once``.
"""

from __future__ import annotations

import itertools
import json
import logging
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import psycopg
import pytest
import trio

from kernel.batch import BatchTask, TaskResult, converter
from kernel.batch._postgres import PostgresLedger, open_postgres_ledger
from kernel.errors import StoreError
from kernel.store import PostgresStore, SessionKey
from kernel.store._postgres import RETRY_DELAYS
from tests.batch.ledger_conformance import RUN, result, task
from tests.batch.test_many_hosts import COMMAND, psql, wait_for, workers  # noqa: F401
from tests.store import pg_server

T = TypeVar("T")

_databases = itertools.count()


@pytest.fixture
def server(pg_to_break: pg_server.PgServer) -> pg_server.PgServer:
    """A server other tests do not use: restarting it must not cut their connections."""
    return pg_to_break


@pytest.fixture
def url(server: pg_server.PgServer) -> str:
    return pg_server.create_database(server, f"r{next(_databases)}")


def restart(server: pg_server.PgServer) -> None:
    """A fast shutdown and a start: every client connection is terminated."""
    pg_server.restart(server)


def retries_logged(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.name == "tak.store" and "trying again in" in r.getMessage()
    ]


# -- a ledger --------------------------------------------------------------------


async def test_a_call_after_a_restart_waits_it_out(
    server: pg_server.PgServer, url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The calls after a restart meet the connections it broke: each is made again
    (logged in one line naming the server) until it reaches the server again."""
    caplog.set_level(logging.WARNING, logger="tak.store")
    with trio.fail_after(60):
        async with open_postgres_ledger(url, RUN) as ledger:
            await ledger.add_tasks([task(1), task(2), task(3)])
            # Both connections busy at once, so the pool holds two the restart breaks.
            async with trio.open_nursery() as nursery:
                nursery.start_soon(ledger.claim, "w", 1)
                nursery.start_soon(ledger.counts)
            await trio.to_thread.run_sync(restart, server)
            claims = await ledger.claim("w", 1)
            assert [c.task.id for c in claims] == ["t002"]
            await ledger.renew("w", ["t001", "t002"])
            assert await ledger.finish("w", result("t001")) is True
            assert (await ledger.counts()).finished == 1
    logged = retries_logged(caplog)
    assert logged, "the restart broke no connection: nothing was waited out"
    for line in logged:
        assert line.startswith(f"PostgreSQL 127.0.0.1:{server.port}/{url.rsplit('/', 1)[1]}: ")
        assert "\n" not in line


async def test_the_store_made_to_waits_out_a_restart(
    server: pg_server.PgServer, url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The store of a worker's sessions (``retry_lost_connections``): after a restart,
    reads and appends of entries with uuids go on; an append without uuids, which a
    second try could store twice, fails at once."""
    caplog.set_level(logging.WARNING, logger="tak.store")
    key = SessionKey("p", "s")
    with trio.fail_after(60):
        async with PostgresStore(url, max_connections=2, retry_lost_connections=True) as store:
            await store.append(key, [{"type": "t", "uuid": "u0"}])
            async with trio.open_nursery() as nursery:  # two connections in the pool
                for _ in range(2):
                    nursery.start_soon(
                        store.run_in_thread, lambda conn: conn.execute("SELECT pg_sleep(0.2)")
                    )
            await trio.to_thread.run_sync(restart, server)
            with pytest.raises(StoreError, match=r"^PostgreSQL 127\.0\.0\.1:\d+/\w+: "):
                await store.append(key, [{"type": "t", "n": 1}])
            assert retries_logged(caplog) == []
            await store.append(key, [{"type": "t", "uuid": "u2"}])
            assert retries_logged(caplog)
            assert [e.get("uuid") for e in await store.load(key) or []] == ["u0", "u2"]


class ReplyLost(PostgresStore):
    """A store whose next ``lose`` calls commit, then lose their connection."""

    lose = 0

    async def _run_once(self, fn: Callable[[psycopg.Connection[Any]], T], **kwargs: Any) -> T:
        if self.lose:
            self.lose -= 1
            await super()._run_once(fn, **kwargs)  # it happened, but nobody hears of it
            raise StoreError(f"{self.where}: server closed the connection unexpectedly") from (
                psycopg.OperationalError("server closed the connection unexpectedly")
            )
        return await super()._run_once(fn, **kwargs)


async def test_a_finish_whose_reply_was_lost_counts_once(url: str) -> None:
    """A finish made again after its first try committed: True (the result is ours,
    not "finished elsewhere"), and recorded once, in the task and in its history."""
    async with open_postgres_ledger(url, RUN) as opened:
        await opened.add_tasks([task(1), task(2)])
        async with ReplyLost(url, retry_lost_connections=True) as store:
            ledger = PostgresLedger(
                store,
                RUN,
                lease_seconds=opened.lease_seconds,
                created=opened.created,
                settings=opened.settings,
            )
            assert len(await ledger.claim("w", 2)) == 2
            store.lose = 1
            assert await ledger.finish("w", result("t001", text="done", attempt=1)) is True
            store.lose = 1
            assert await ledger.finish("w", result("t002", "cancelled", attempt=1)) is True
            assert store.lose == 0
            # A later, other result is still refused: the first one won.
            assert await ledger.finish("x", result("t001", text="late", attempt=2)) is False
            stored = {r.id: (r.reason, r.text) for r in await ledger.results()}
            assert stored == {"t001": ("final", "done"), "t002": ("cancelled", "")}
    history = psql(url, "SELECT task_id, result->>'reason' FROM tak_batch_results ORDER BY seq")
    assert history == [("t001", "final"), ("t002", "cancelled")]


class Down(PostgresStore):
    """A store whose every call meets ``cause``, counted."""

    def __init__(self, cause: BaseException | None) -> None:
        super().__init__("postgresql://tak@127.0.0.1:1/tak", retry_lost_connections=True)
        self.cause = cause
        self.calls = 0

    async def _run_once(self, fn: Callable[[psycopg.Connection[Any]], T], **kwargs: Any) -> T:
        self.calls += 1
        await trio.lowlevel.checkpoint()
        raise StoreError(f"{self.where}: {self.cause or 'unreachable'}") from self.cause


def ledger_on(store: PostgresStore) -> PostgresLedger:
    return PostgresLedger(store, RUN, lease_seconds=30.0, created=0.0, settings={})


async def test_a_server_down_for_longer_gives_up_in_one_line(
    autojump_clock: trio.abc.Clock, caplog: pytest.LogCaptureFixture
) -> None:
    """The retries of a call share its deadline (``request_timeout_s``): it gives up
    before a retry would start past it, saying so in one line."""
    caplog.set_level(logging.WARNING, logger="tak.store")
    store = Down(psycopg.OperationalError("server closed the connection unexpectedly"))
    started = trio.current_time()
    with pytest.raises(StoreError) as info:
        await ledger_on(store).claim("w", 1)
    tries = store.calls
    assert str(info.value) == (
        "PostgreSQL 127.0.0.1:1/tak: server closed the connection unexpectedly"
        f" (gave up after {tries} tries in 30 s)"
    )
    # Backing off to every 2 s, the last retry within the 30 s (virtual) deadline.
    assert tries > len(RETRY_DELAYS) + 1
    assert 30 - RETRY_DELAYS[-1] <= trio.current_time() - started < 30
    assert len(retries_logged(caplog)) == tries - 1


@pytest.mark.parametrize(
    "cause",
    [
        psycopg.errors.QueryCanceled("canceling statement due to statement timeout"),
        psycopg.errors.UniqueViolation("duplicate key value"),
        psycopg.errors.InsufficientPrivilege("permission denied for table tak_batch_tasks"),
        None,  # no connection within connect_timeout_s: waited for already
    ],
)
async def test_only_a_lost_connection_is_made_again(cause: BaseException | None) -> None:
    store = Down(cause)
    with pytest.raises(StoreError) as info:
        await ledger_on(store).finish("w", result("t001"))
    assert store.calls == 1
    assert "gave up" not in str(info.value)


# -- a worker process --------------------------------------------------------------

TASKS = 12


async def make_run(url: str) -> None:
    prompt = "/call run_command " + json.dumps({"command": COMMAND})
    # What `tak batch run --model scripted:demo --concurrency 3` stores (kernel/cli/_batch.py).
    settings = {"model": "scripted:demo", "concurrency": 3}
    async with open_postgres_ledger(url, RUN, settings=settings) as ledger:
        await ledger.add_tasks([BatchTask(id=f"t{i:02d}", prompt=prompt) for i in range(TASKS)])


def test_a_worker_process_outlives_a_database_restart(
    tmp_path: Path,
    server: pg_server.PgServer,
    url: str,
    workers: list[subprocess.Popen[bytes]],  # noqa: F811
) -> None:
    """``tak batch worker`` with its database restarted mid-run: it goes on, and
    exits 0 with every task finished once, each command run once."""
    trio.run(make_run, url)
    home = tmp_path / "home"
    tak = [sys.executable, "-m", "kernel.cli", "--home", str(home)]
    log_path = tmp_path / "worker.log"
    with open(log_path, "wb") as log:
        workers.append(
            subprocess.Popen(
                [*tak, "batch", "worker", "--run", RUN, "--store", url],
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # its group: sandbox workers and shells
            )
        )
    (worker,) = workers

    def finished() -> int:
        ((n,),) = psql(url, "SELECT count(*) FROM tak_batch_tasks WHERE finished")
        return int(n)

    wait_for("some tasks to finish", lambda: finished() >= 3)
    restart(server)
    assert finished() < TASKS, "the run ended before the restart: nothing to outlive"
    try:
        code = worker.wait(timeout=120)
    except subprocess.TimeoutExpired:
        code = None
    output = log_path.read_text(errors="replace")
    assert code == 0, f"the worker exited {code}:\n{output[-3000:]}"
    assert "trying again in" in output  # it met the restart, and waited it out

    rows = psql(url, "SELECT task_id, finished, result::text FROM tak_batch_tasks ORDER BY ord")
    assert len(rows) == TASKS and all(done for _, done, _ in rows)
    results = [converter.structure(json.loads(text), TaskResult) for _, _, text in rows]
    assert {r.reason for r in results} == {"final"}, [(r.id, r.error) for r in results]
    history = psql(url, "SELECT task_id FROM tak_batch_results WHERE result->>'reason' = 'final'")
    assert sorted(history) == sorted((r.id,) for r in results)  # one finished row each
    for r in results:
        runs = home / "batch" / RUN / "workspaces" / r.id / "runs.log"
        assert runs.read_text().split() == ["start", "end"], r.id
