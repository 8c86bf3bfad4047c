"""The Ledger conformance suite against each ledger, and what only PostgresLedger does.

PostgreSQL is the real server tests/store starts (tests/store/pg_server.py); a
restart under a ledger is in tests/batch/test_pg_restart.py.
"""

from __future__ import annotations

import json
import socket
from pathlib import Path

import pytest
import trio

from kernel.batch import Ledger
from kernel.batch._directory import open_run_dir
from kernel.batch._postgres import open_postgres_ledger
from kernel.errors import StoreError, UsageError
from tests.batch.ledger_conformance import RUN, LedgerConformance, OpenLedger, result, task
from tests.batch.test_many_hosts import psql


class TestPostgresLedger(LedgerConformance):
    @pytest.fixture
    def open_ledger(self, db_url: str) -> OpenLedger:
        return lambda run_id, **options: open_postgres_ledger(db_url, run_id, **options)


class TestDirectoryLedger(LedgerConformance):
    leases = False  # one process holds the run: its claims last as long as it does

    @pytest.fixture
    def open_ledger(self, tmp_path: Path) -> OpenLedger:
        return lambda run_id, **options: open_run_dir(tmp_path / run_id)

    @pytest.fixture
    async def peer(self, ledger: Ledger) -> Ledger:
        return ledger  # a second process is refused: workers share the one handle


async def test_workers_starting_together_make_the_tables_once(db_url: str) -> None:
    """Tables are made under an advisory lock: 6 first opens at once all succeed."""
    counts: list[int] = []

    async def worker(n: int) -> None:
        async with open_postgres_ledger(db_url, RUN) as ledger:
            await ledger.add_tasks([task(i) for i in range(10)])
            counts.append((await ledger.counts()).total)

    async with trio.open_nursery() as nursery:
        for n in range(6):
            nursery.start_soon(worker, n)
    assert counts == [10] * 6
    assert psql(db_url, "SELECT version FROM tak_batch_schema_version") == [(1,), (2,)]


async def test_a_ledger_schema_newer_than_this_tak_is_refused(db_url: str) -> None:
    async with open_postgres_ledger(db_url, RUN):
        pass
    psql(db_url, "INSERT INTO tak_batch_schema_version (version) VALUES (99)")
    with pytest.raises(StoreError, match=r"batch ledger schema version 99 is newer .*upgrade tak"):
        async with open_postgres_ledger(db_url, RUN):
            pass


async def test_the_run_row_keeps_the_first_settings_and_lease(db_url: str) -> None:
    settings = {"model": "scripted:x", "concurrency": 4, "limits": {"max_steps": 3}}
    async with open_postgres_ledger(db_url, RUN, settings=settings, lease_seconds=5) as first:
        assert first.settings == settings
    async with open_postgres_ledger(db_url, RUN, settings={"model": "other"}) as again:
        assert again.settings == settings
        assert again.created == first.created
        assert again.lease_seconds == 5.0  # the run's
    async with open_postgres_ledger(db_url, RUN, create=False, lease_seconds=7) as worker:
        assert worker.settings == settings
        assert worker.lease_seconds == 7.0  # its own
    async with open_postgres_ledger(db_url, "other") as other:
        assert (other.settings, other.lease_seconds) == ({}, 30.0)
    ((created_db,),) = psql(
        db_url,
        "SELECT extract(epoch FROM created)::float8 FROM tak_batch_runs WHERE run_id = %s",
        RUN,
    )
    assert created_db == first.created


async def test_a_worker_of_an_unknown_run_is_refused(db_url: str) -> None:
    with pytest.raises(UsageError, match=r"^run 'nope': no such run in PostgreSQL 127\.0\.0\.1"):
        async with open_postgres_ledger(db_url, "nope", create=False):
            pass


async def test_bad_arguments_are_refused_before_connecting() -> None:
    url = "postgresql://nobody@127.0.0.1:1/none"
    for kwargs, match in [
        ({"run_id": "../x"}, "run_id"),
        ({"run_id": "r", "lease_seconds": 0}, "lease_seconds"),
        ({"run_id": "r", "lease_seconds": float("inf")}, "lease_seconds"),
        ({"run_id": "r", "settings": {"x": float("nan")}}, "settings"),
    ]:
        with pytest.raises(UsageError, match=match):
            async with open_postgres_ledger(url, **kwargs):
                pass
    with pytest.raises(UsageError, match="postgresql://"):
        async with open_postgres_ledger("sqlite:///x", "r"):
            pass


async def test_a_stored_record_this_tak_cannot_read_is_named(db_url: str) -> None:
    """A row a newer tak wrote (an unknown field): one line naming the run, task and field."""
    async with open_postgres_ledger(db_url, RUN) as ledger:
        await ledger.add_tasks([task(1)])
        psql(
            db_url, """UPDATE tak_batch_tasks SET task = '{"id": "t001", "prompt": "p", "x": 1}'"""
        )
        with pytest.raises(UsageError) as info:
            await ledger.claim("w", 1)
        message = str(info.value)
        assert message.startswith("PostgreSQL 127.0.0.1:") and "\n" not in message
        assert message.endswith("run 'run-1', task 't001': $: extra fields found (x)")


async def test_a_bad_worker_name_is_refused_in_one_line(db_url: str) -> None:
    async with open_postgres_ledger(db_url, RUN) as ledger:
        await ledger.add_tasks([task(1)])
        for bad in ("", "nul\x00", "x" * 257, None):
            with pytest.raises(UsageError, match=r"^worker: expected 1 to 256 characters"):
                await ledger.claim(bad, 1)  # type: ignore[arg-type]
            with pytest.raises(UsageError, match=r"^worker: "):
                await ledger.renew(bad, ["t001"])  # type: ignore[arg-type]
            with pytest.raises(UsageError, match=r"^worker: "):
                await ledger.finish(bad, result("t001"))  # type: ignore[arg-type]
        assert len(await ledger.claim("w" * 256, 1)) == 1


async def test_an_unreachable_server_is_one_line_naming_it() -> None:
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(StoreError) as info:
        # The lost connection is retried until the deadline: 1 s, not the 30 s default.
        url = f"postgresql://tak@127.0.0.1:{port}/tak"
        async with open_postgres_ledger(url, RUN, request_timeout_s=1.0):
            pass
    message = str(info.value)
    assert message.startswith(f"PostgreSQL 127.0.0.1:{port}/tak: ") and "\n" not in message


async def test_leases_and_finish_times_come_from_the_database_clock(
    db_url: str,
) -> None:
    """A worker's clock plays no part: lease_until is now() + lease, finished_at is now()."""
    async with open_postgres_ledger(db_url, RUN, lease_seconds=600) as ledger:
        await ledger.add_tasks([task(1), task(2)])
        await ledger.claim("w", 1)
        ((left,),) = psql(
            db_url,
            "SELECT extract(epoch FROM lease_until - now()) FROM tak_batch_tasks"
            " WHERE task_id = 't001'",
        )
        assert 500 < left <= 600
        await ledger.finish("w", result("t001", finished_at=12.0))  # a worker's bad clock
        ((db_now,),) = psql(db_url, "SELECT extract(epoch FROM now())::float8")
        (stored,) = await ledger.results()
        assert db_now - 600 < stored.finished_at <= db_now


async def test_every_accepted_result_is_kept_as_history(db_url: str) -> None:
    async with open_postgres_ledger(db_url, RUN) as ledger:
        await ledger.add_tasks([task(1)])
        await ledger.claim("a", 1)
        await ledger.finish("a", result("t001", "cancelled", attempt=1))
        await ledger.claim("b", 1)
        await ledger.finish("b", result("t001", text="done", attempt=2))
        await ledger.finish("c", result("t001", text="late", attempt=3))  # refused: not kept
    rows = psql(db_url, "SELECT worker, result::text FROM tak_batch_results ORDER BY seq")
    assert [(w, json.loads(r)["reason"]) for w, r in rows] == [("a", "cancelled"), ("b", "final")]


async def test_a_claim_skips_rows_another_claim_holds(db_url: str) -> None:
    """SKIP LOCKED: a claim never waits behind another worker's transaction, and
    never hands out a task that transaction holds."""
    import psycopg

    async with open_postgres_ledger(db_url, RUN) as ledger:
        await ledger.add_tasks([task(1), task(2)])
        with psycopg.connect(db_url) as other:  # a worker's claim, in the middle of it
            other.execute("SELECT 1 FROM tak_batch_tasks WHERE task_id = 't001' FOR UPDATE")
            with trio.fail_after(10):
                claims = await ledger.claim("w", 2)
            other.rollback()
        assert [c.task.id for c in claims] == ["t002"]
        assert [c.task.id for c in await ledger.claim("w", 2)] == ["t001"]


async def test_many_handles_claiming_at_once_never_share_a_task(db_url: str) -> None:
    """4 handles (as 4 hosts), each claiming from 4 tasks at once: every task once, attempt 1."""
    n = 120
    got: list[tuple[str, int]] = []
    async with open_postgres_ledger(db_url, RUN) as first:
        await first.add_tasks([task(i) for i in range(n)])

    async def host(name: str) -> None:
        async with open_postgres_ledger(db_url, RUN) as ledger:

            async def worker() -> None:
                while claims := await ledger.claim(name, 1):
                    got.extend((c.task.id, c.attempt) for c in claims)

            async with trio.open_nursery() as nursery:
                for _ in range(4):
                    nursery.start_soon(worker)

    async with trio.open_nursery() as nursery:
        for h in range(4):
            nursery.start_soon(host, f"host{h}")
    assert sorted(got) == [(f"t{i:03d}", 1) for i in range(n)]
