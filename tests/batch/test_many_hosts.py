"""Many hosts: 4 ``tak batch worker`` processes share one run in a real PostgreSQL,
one of them is SIGKILLed mid-run, and every task still finishes exactly once.

The run is made as a program makes one (``open_postgres_ledger`` with the
settings ``tak batch run`` would store), then worked by the real command.
Each task's prompt makes ``scripted:demo`` call the built-in shell tool once:
it appends ``start`` to ``runs.log`` in the task's workspace, waits a little,
then appends ``end``. The workers share one home, as processes on one host
do, so a task's workspace (never re-seeded once worked in) keeps the lines of
every attempt: they count the executions.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import trio

from kernel.batch import BatchTask, TaskResult, converter
from kernel.batch._postgres import open_postgres_ledger
from tests.store.conftest import db_url, pg  # noqa: F401  (fixtures)

RUN = "many"
TASKS = 60
WORKERS = 4
LEASE_S = 2.0
# A shell command that takes a little time, with a trace of its start and its end.
COMMAND = "echo start >> runs.log; sleep 0.3; echo end >> runs.log"


def psql(url: str, sql: str, *params: Any) -> list[tuple[Any, ...]]:
    import psycopg

    with psycopg.connect(url, autocommit=True) as conn:
        cur = conn.execute(sql, params or None)  # type: ignore[arg-type]
        return cur.fetchall() if cur.description else []


def wait_for(what: str, check: Callable[[], bool], timeout: float = 90.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"gave up waiting for {what}")
        time.sleep(0.02)


@pytest.fixture
def workers(tmp_path: Path) -> Iterator[list[subprocess.Popen[bytes]]]:
    """The worker processes a test starts; any still running at the end are killed."""
    started: list[subprocess.Popen[bytes]] = []
    yield started
    for process in started:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()


async def make_run(url: str) -> None:
    prompt = "/call run_command " + json.dumps({"command": COMMAND})
    # What `tak batch run --model scripted:demo --concurrency 3` stores (kernel/cli/_batch.py).
    settings = {"model": "scripted:demo", "concurrency": 3}
    async with open_postgres_ledger(url, RUN, settings=settings, lease_seconds=LEASE_S) as ledger:
        await ledger.add_tasks([BatchTask(id=f"t{i:02d}", prompt=prompt) for i in range(TASKS)])


def test_four_workers_one_killed_every_task_finishes_exactly_once(
    tmp_path: Path,
    db_url: str,  # noqa: F811
    workers: list[subprocess.Popen[bytes]],
) -> None:
    trio.run(make_run, db_url)
    home = tmp_path / "home"
    tak = [sys.executable, "-m", "kernel.cli", "--home", str(home)]
    for n in range(WORKERS):
        with open(tmp_path / f"worker{n}.log", "wb") as log:
            workers.append(
                subprocess.Popen(
                    [*tak, "batch", "worker", "--run", RUN, "--store", db_url],
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,  # its group: sandbox workers and shells
                )
            )
    victim = workers[0]
    victim_name = f"{socket.gethostname()}:{victim.pid}"  # run_batch's default worker name

    def held_by_victim() -> int:
        ((n,),) = psql(
            db_url,
            "SELECT count(*) FROM tak_batch_tasks"
            " WHERE lease_owner = %s AND NOT finished AND lease_until > now()",
            victim_name,
        )
        return int(n)

    def finished() -> int:
        ((n,),) = psql(db_url, "SELECT count(*) FROM tak_batch_tasks WHERE finished")
        return int(n)

    # Mid-run: some tasks done, and the victim in the middle of some of its own.
    wait_for("the run to get going", lambda: finished() >= 6 and held_by_victim() >= 2)
    victim.send_signal(signal.SIGKILL)
    victim.wait()
    in_flight = {
        task_id
        for (task_id,) in psql(
            db_url,
            "SELECT task_id FROM tak_batch_tasks WHERE lease_owner = %s AND NOT finished",
            victim_name,
        )
    }
    assert in_flight, "the victim finished its tasks before it was killed: no take-over to see"

    for n, process in enumerate(workers[1:], 1):
        try:
            code = process.wait(timeout=120)
        except subprocess.TimeoutExpired:
            code = None
        log = (tmp_path / f"worker{n}.log").read_text(errors="replace")
        assert code == 0, f"worker {n} exited {code}:\n{log[-3000:]}"

    # Every task finished, once: one finished result each, in the tasks and in the history.
    rows = psql(
        db_url,
        "SELECT task_id, attempt, finished, result::text FROM tak_batch_tasks ORDER BY ord",
    )
    assert len(rows) == TASKS
    assert all(done for _, _, done, _ in rows)
    results = {task_id: converter.structure(json.loads(r), TaskResult) for task_id, _, _, r in rows}
    assert {r.reason for r in results.values()} == {"final"}
    history = psql(db_url, "SELECT task_id, result->>'reason' FROM tak_batch_results")
    finished_rows = [task_id for task_id, reason in history if reason != "cancelled"]
    assert sorted(finished_rows) == sorted(results)  # exactly one finished row per task

    # The killed worker's tasks were taken over once its lease lapsed: attempt 2, elsewhere.
    attempts = {task_id: attempt for task_id, attempt, _, _ in rows}
    for task_id in in_flight:
        assert attempts[task_id] == 2, task_id
        assert results[task_id].attempt == 2
        assert results[task_id].worker not in (None, victim_name)
    assert {t for t, a in attempts.items() if a != 1} == in_flight

    # Executions: each task's command ran to its end at most once; every task the
    # victim did not hold, exactly once. (A call the victim had started is recorded
    # without a result: the next attempt answers it "interrupted", never runs it again.)
    workspaces = home / "batch" / RUN / "workspaces"
    for task_id in results:
        log_path = workspaces / task_id / "runs.log"
        lines = log_path.read_text().split() if log_path.exists() else []
        if task_id in in_flight:
            assert lines.count("start") <= 1 and lines.count("end") <= 1, (task_id, lines)
        else:
            assert lines == ["start", "end"], (task_id, lines)
