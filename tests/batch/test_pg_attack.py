"""Attacks on a batch run over PostgreSQL (issue 22, item 8): two workers and a
database restart as slow as one under load (8-12 s down), a lease shorter than
the outage; and a result whose write timed out but committed.

A task may run twice (a lease lapsed: at least once), but it is finished once,
never failed for the database, and nothing is left ``error``. Guarantees 6 and 7
of kernel/batch/_run.py, 5 of kernel/batch/_postgres.py.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import trio

from kernel import open_kernel
from kernel.batch import BatchTask, run_batch
from kernel.batch._postgres import open_postgres_ledger
from kernel.errors import StoreError, UsageError
from kernel.models import ModelRequest, ScriptedModel
from kernel.store import PostgresStore
from tests.batch.test_many_hosts import psql
from tests.store import pg_server

_databases = itertools.count()


@pytest.fixture
def url(pg_to_break: pg_server.PgServer) -> str:
    return pg_server.create_database(pg_to_break, f"a{os.getpid()}_{next(_databases)}")


@pytest.mark.parametrize(
    ("outage", "down_s"), [("restart", 8.0), ("restart", 12.0), ("freeze", 8.0)]
)
async def test_two_workers_ride_out_a_slow_restart_shorter_than_their_calls(
    tmp_path: Path,
    url: str,
    pg_to_break: pg_server.PgServer,
    outage: str,
    down_s: float,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Two workers (two kernels, as two hosts), tasks running, the server down (or
    frozen: its connections kept, nothing answered) for ``down_s``, longer than the
    3 s lease and shorter than the 30 s request timeout: both runs end normally,
    every task is finished ``final`` once (one finished row in the history each),
    none is ``error``."""
    caplog.set_level(logging.WARNING, logger="tak.store")
    tasks = [BatchTask(id=f"t{i}", prompt=f"task t{i}") for i in range(8)]
    requests = 0
    running = trio.Event()

    async def model(request: ModelRequest) -> Any:
        nonlocal requests
        requests += 1
        if requests == 2:
            running.set()
        await trio.sleep(0.3)
        return "done"

    errors: list[BaseException] = []

    async def worker(name: str) -> None:
        store = PostgresStore(url, retry_lost_connections=True)
        async with (
            open_kernel(
                home=tmp_path / name, model=ScriptedModel(model), plugins=[], store=store
            ) as kernel,
            open_postgres_ledger(url, "slow-restart", lease_seconds=3.0) as ledger,
        ):
            try:
                await run_batch(kernel, None, ledger=ledger, max_concurrency=2, worker=name)
            except BaseException as exc:
                errors.append(exc)
                raise

    async with open_postgres_ledger(url, "slow-restart", lease_seconds=3.0) as ledger:
        await ledger.add_tasks(tasks)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(worker, "w1")
        nursery.start_soon(worker, "w2")
        await running.wait()
        before = requests
        if outage == "restart":
            await trio.to_thread.run_sync(lambda: pg_server.restart(pg_to_break, down_s=down_s))
        else:
            freezer = pg_server.Freezer(pg_to_break, thaw_after_s=60.0)
            try:
                freezer.freeze()
                await trio.sleep(down_s)
            finally:
                freezer.thaw()
    assert before < len(tasks), "the run ended before the outage: nothing to ride out"
    assert errors == []
    if outage == "restart":
        assert any("trying again in" in r.getMessage() for r in caplog.records)
    rows = psql(
        url,
        "SELECT task_id, finished, result->>'reason' FROM tak_batch_tasks ORDER BY ord",
    )
    assert rows == [(t.id, True, "final") for t in tasks]
    history = psql(
        url,
        "SELECT task_id, count(*) FROM tak_batch_results WHERE result->>'reason' = 'final'"
        " GROUP BY task_id ORDER BY task_id",
    )
    assert history == [(t.id, 1) for t in tasks]
    errored = psql(url, "SELECT count(*) FROM tak_batch_results WHERE result->>'reason' = 'error'")
    assert errored == [(0,)]


class _CommitFreezes:
    """A connection whose next transaction's COMMIT goes to a frozen server: the
    statements before it ran, the COMMIT waits in the server's socket, the client
    gives up at its deadline and, once thawed, the server commits it anyway."""

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


async def test_a_result_whose_commit_went_unanswered_is_recorded_once(
    tmp_path: Path,
    url: str,
    pg_to_break: pg_server.PgServer,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The first task's finished result is written, and its COMMIT reaches the
    server as it freezes: ``finish`` times out (a StoreError: the run stops),
    whether or not the server commits it once thawed. A resume must neither ask
    the model for that task again nor record it twice; every other task is
    finished once too."""
    from kernel.batch import _postgres

    freezer = pg_server.Freezer(pg_to_break, thaw_after_s=60.0)
    real_finish = _postgres._finish
    armed = [True]

    def finish(conn: Any, run_id: str, worker: str, result: Any, *, again: bool) -> bool:
        if armed[0] and result.finished:
            armed[0] = False
            return real_finish(_CommitFreezes(conn, freezer), run_id, worker, result, again=again)
        return real_finish(conn, run_id, worker, result, again=again)

    monkeypatch.setattr(_postgres, "_finish", finish)
    calls: dict[str, int] = {}

    async def model(request: ModelRequest) -> Any:
        task_id = next(m for m in request.messages if m.role == "user").text.split()[-1]
        calls[task_id] = calls.get(task_id, 0) + 1
        return "done"

    tasks = [BatchTask(id=f"t{i}", prompt=f"task t{i}") for i in range(3)]
    try:
        store = PostgresStore(url, request_timeout_s=2, retry_lost_connections=True)
        async with (
            open_kernel(
                home=tmp_path / "home", model=ScriptedModel(model), plugins=[], store=store
            ) as kernel,
            open_postgres_ledger(
                url, "lost-reply", lease_seconds=1.0, request_timeout_s=2
            ) as ledger,
        ):
            with pytest.raises(StoreError, match="timed out after 2 s"):
                await run_batch(kernel, tasks, ledger=ledger, max_concurrency=1)
            freezer.thaw()
            await trio.sleep(1.0)  # leases the frozen run could not release lapse
            summary = await run_batch(kernel, None, ledger=ledger, max_concurrency=1)
    finally:
        freezer.thaw()
    assert [(r.id, r.reason) for r in summary.results] == [(t.id, "final") for t in tasks]
    assert calls["t0"] == 1, calls  # its committed result stood: it did not run again
    history = psql(
        url,
        "SELECT task_id, count(*) FROM tak_batch_results WHERE result->>'reason' = 'final'"
        " GROUP BY task_id ORDER BY task_id",
    )
    assert history == [(t.id, 1) for t in tasks]


@pytest.mark.parametrize("lease", [1e13, 1e300, 365 * 24 * 3600.0 + 1])
async def test_a_lease_past_what_the_database_can_time_is_refused_when_the_run_is_opened(
    url: str, lease: float
) -> None:
    """A lease of 1e13 s passed the check (positive, finite), and every claim then
    failed with ``StoreError: timestamp out of range``: the run stopped as if the
    database had failed. A lease is at most a year, refused in one line at open."""
    with pytest.raises(UsageError) as info:
        async with open_postgres_ledger(url, "too-long", lease_seconds=lease):
            pass
    assert str(info.value) == (
        f"lease_seconds: expected a positive number of seconds up to 3.1536e+07 (a year), "
        f"got {lease!r}"
    )


async def test_a_lease_of_a_year_claims_and_renews(url: str) -> None:
    async with open_postgres_ledger(url, "a-year", lease_seconds=365 * 24 * 3600.0) as ledger:
        await ledger.add_tasks([BatchTask(id="a", prompt="x")])
        [claim] = await ledger.claim("w", 1)
        assert claim.task.id == "a"
        assert await ledger.renew("w", ["a"]) == []


async def test_a_result_is_waited_for_as_long_as_the_ledger_rides_an_outage_out(
    tmp_path: Path,
    url: str,
    pg_to_break: pg_server.PgServer,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """run_batch gave a result's write ``FINISH_S`` (60 s) whatever the ledger's
    ``request_timeout_s``: with ``[store] request_timeout_s = 120`` a database
    frozen for 70 s during the write had the result given up on ("could not be
    recorded"), the task claimed again once its lease lapsed and scored twice,
    though the ledger would have recorded it. Here ``FINISH_S`` is made 1 s, the
    ledger's timeout 20 s, and the database freezes for 3 s as the first result is
    written: it is recorded by that attempt, each task is scored once."""
    from kernel.batch import _postgres, _run

    monkeypatch.setattr(_run, "FINISH_S", 1.0)
    freezer = pg_server.Freezer(pg_to_break, thaw_after_s=3.0)
    real_finish = _postgres._finish
    armed = [True]

    def finish(conn: Any, run_id: str, worker: str, result: Any, *, again: bool) -> bool:
        if armed[0] and result.finished:
            armed[0] = False
            freezer.freeze()  # thawed by its timer, 3 s on
        return real_finish(conn, run_id, worker, result, again=again)

    monkeypatch.setattr(_postgres, "_finish", finish)
    scored: list[str] = []

    async def model(request: ModelRequest) -> Any:
        return "done"

    def scorer(task: BatchTask, outcome: Any) -> float:
        scored.append(task.id)
        return 1.0

    tasks = [BatchTask(id=f"t{i}", prompt=f"task t{i}") for i in range(2)]
    try:
        store = PostgresStore(url, request_timeout_s=20, retry_lost_connections=True)
        async with (
            open_kernel(
                home=tmp_path / "home", model=ScriptedModel(model), plugins=[], store=store
            ) as kernel,
            open_postgres_ledger(url, "patient", lease_seconds=1.0, request_timeout_s=20) as ledger,
        ):
            summary = await run_batch(
                kernel, tasks, ledger=ledger, max_concurrency=1, scorer=scorer
            )
    finally:
        freezer.thaw()
    assert not armed[0], "no result was written through the freeze"
    assert [(r.id, r.reason, r.attempt) for r in summary.results] == [
        ("t0", "final", 1),
        ("t1", "final", 1),
    ]
    assert sorted(scored) == ["t0", "t1"]
