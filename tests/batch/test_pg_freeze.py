"""A batch run on PostgreSQL whose database stops answering for longer than the
lease (the whole server frozen: tests/store/pg_server.py's ``Freezer``): the run
stops in bounded time with a ``StoreError``, while the server is still frozen,
rather than hanging with it; no task is failed for it (each is released, or its
lease lapses); a resume once the server is back runs each to its answer, once.

The server is the process's one for tests that break theirs (``pg_to_break``).
Guarantee 7 of kernel/batch/_run.py, guarantee 10 of kernel/store/_postgres.py.
"""

from __future__ import annotations

import itertools
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
from tests.store import pg_server

RUN = "frozen"
TASKS = 6
LEASE_S = 1.0
TIMEOUT_S = 2.0

_databases = itertools.count()


@pytest.fixture
def url(pg_to_break: pg_server.PgServer) -> str:
    return pg_server.create_database(pg_to_break, f"z{os.getpid()}_{next(_databases)}")


@pytest.fixture
def server(pg_to_break: pg_server.PgServer) -> Iterator[pg_server.Freezer]:
    freezer = pg_server.Freezer(pg_to_break, thaw_after_s=60.0)
    try:
        yield freezer
    finally:
        freezer.thaw()


async def test_a_database_frozen_past_the_lease_stops_the_run_and_fails_no_task(
    tmp_path: Path, url: str, server: pg_server.Freezer
) -> None:
    requests = 0

    async def model(request: ModelRequest) -> Any:
        nonlocal requests
        requests += 1
        if requests == 2:  # tasks are running: the database stops answering
            server.freeze()
        await trio.sleep(0.2)
        return "done"

    store = PostgresStore(url, request_timeout_s=TIMEOUT_S, retry_lost_connections=True)
    async with (
        open_kernel(
            home=tmp_path / "home", model=ScriptedModel(model), plugins=[], store=store
        ) as kernel,
        open_postgres_ledger(
            url, RUN, lease_seconds=LEASE_S, request_timeout_s=TIMEOUT_S
        ) as ledger,
    ):
        await ledger.add_tasks([BatchTask(id=f"t{i}", prompt=f"task t{i}") for i in range(TASKS)])
        stopped_frozen: bool | None = None
        with pytest.raises(StoreError) as info:
            try:
                await run_batch(kernel, None, ledger=ledger, max_concurrency=3)
            finally:
                stopped_frozen = server.frozen
        assert stopped_frozen, "run_batch returned only once the server was thawed"
        assert not isinstance(info.value, UsageError)
        assert "timed out after 2 s" in str(info.value)
        server.thaw()
        await trio.sleep(LEASE_S)  # leases the frozen run could not release lapse
        summary = await run_batch(kernel, None, ledger=ledger, max_concurrency=3)
    assert [(r.id, r.reason, r.text) for r in summary.results] == [
        (f"t{i}", "final", "done") for i in range(TASKS)
    ]
