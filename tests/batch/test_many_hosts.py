"""Many hosts: 4 ``tak batch worker`` processes share one run in a real PostgreSQL,
one of them is SIGKILLed mid-run, and every task still finishes exactly once.

The run is made as a program makes one (``open_postgres_ledger`` with the
settings ``tak batch run`` would store), then worked by the real command.
Each task's prompt makes ``scripted:demo`` call the built-in shell tool once:
it appends ``start`` to ``runs.log`` in the task's workspace, waits a little,
then appends ``end``. Each worker has a home of its own, as on its own host
(each host keeps its tasks' workspaces); the lines in every home's copy of a
task's workspace count the task's executions. A task taken over continues
its transcript from the database, so a call the dead worker had started is
not run again.
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

RUN = "many"
#: Tasks in the run: make stress's, and make test's (12 run at once either way).
TASKS, BOUNDED_TASKS = 60, 36
WORKERS = 4
LEASE_S = 2.0
# A shell command that takes a little time, with a trace of its start and its end.
COMMAND = "echo start >> runs.log; sleep 0.5; echo end >> runs.log"


def tak(home: Path) -> list[str]:
    return [sys.executable, "-m", "kernel.cli", "--home", str(home)]


def runs_log(home: Path, task_id: str) -> list[str]:
    """What ``COMMAND`` wrote in ``home``'s copy of the task's workspace."""
    path = home / "batch" / RUN / "workspaces" / task_id / "runs.log"
    return path.read_text().split() if path.exists() else []


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


async def make_run(url: str, tasks: int) -> None:
    prompt = "/call run_command " + json.dumps({"command": COMMAND})
    # What `tak batch run --model scripted:demo --concurrency 3` stores (kernel/cli/_batch.py).
    settings = {"model": "scripted:demo", "concurrency": 3}
    async with open_postgres_ledger(url, RUN, settings=settings, lease_seconds=LEASE_S) as ledger:
        await ledger.add_tasks([BatchTask(id=f"t{i:02d}", prompt=prompt) for i in range(tasks)])


def test_four_workers_one_killed_every_task_finishes_exactly_once(
    tmp_path: Path,
    db_url: str,
    workers: list[subprocess.Popen[bytes]],
    stress: bool,
) -> None:
    tasks = TASKS if stress else BOUNDED_TASKS
    trio.run(make_run, db_url, tasks)
    homes = [tmp_path / f"host{n}" for n in range(WORKERS)]
    for n, home in enumerate(homes):
        with open(tmp_path / f"worker{n}.log", "wb") as log:
            workers.append(
                subprocess.Popen(
                    [*tak(home), "batch", "worker", "--run", RUN, "--store", db_url],
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,  # its group: sandbox workers and shells
                )
            )
    victim = workers[0]
    victim_name = f"{socket.gethostname()}:{victim.pid}"  # run_batch's default worker name

    def held_by_victim() -> list[str]:
        rows = psql(
            db_url,
            "SELECT task_id FROM tak_batch_tasks"
            " WHERE lease_owner = %s AND NOT finished AND lease_until > now()",
            victim_name,
        )
        return [task_id for (task_id,) in rows]

    def finished() -> int:
        ((n,),) = psql(db_url, "SELECT count(*) FROM tak_batch_tasks WHERE finished")
        return int(n)

    def mid_run() -> bool:
        # Some tasks done, and the victim in the middle of some of its own, one of
        # them inside its call (the command started).
        if finished() < 6:
            return False
        held = held_by_victim()
        return len(held) >= 2 and any(runs_log(homes[0], t) == ["start"] for t in held)

    wait_for("the victim to be inside a call, mid-run", mid_run)
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
    assert len(rows) == tasks
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

    # Executions, over every host: each task's command ran at most once; every task
    # the victim did not hold, exactly once, to its end. (A call the victim had
    # started is in the shared transcript without a result: the next attempt
    # answers it "interrupted" and never runs it again.)
    for task_id in results:
        runs = [(home.name, line) for home in homes for line in runs_log(home, task_id)]
        lines = [line for _, line in runs]
        if task_id in in_flight:
            assert lines.count("start") <= 1 and lines.count("end") <= 1, (task_id, runs)
        else:
            assert lines == ["start", "end"], (task_id, runs)
    started = [t for t in in_flight if "start" in runs_log(homes[0], t)]
    assert started, "no call of the victim was cut short: nothing to see not run again"
