"""A run's settings and the read-only view at their edges (kernel.batch.RunSettings,
read_run_dir): limits through resume, a PostgreSQL run and its workers, hand-edited
and old manifests, a FIFO in a run directory, reading while a run appends."""

from __future__ import annotations

import errno
import json
import os
import threading
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import trio

from kernel.batch import (
    RunSettings,
    TaskLimits,
    TasksFile,
    open_postgres_ledger,
    open_run_dir,
    read_run_dir,
)
from kernel.batch._directory import RESULTS
from kernel.errors import UsageError
from tests.batch.ledger_conformance import result, task
from tests.cli_kit import tak


def _tasks_file(tmp_path: Path) -> Path:
    path = tmp_path / "evals.jsonl"
    path.write_text('{"id": "a", "prompt": "hello"}\n')
    return path


def test_a_max_steps_past_float_range_is_a_limit_not_an_internal_error(tmp_path: Path) -> None:
    """A whole number, however big, is a positive integer (JSON keeps it): taken as the
    limit it is (``math.isfinite`` of it overflowed: "internal error: OverflowError")."""
    tasks = _tasks_file(tmp_path)
    huge = 10**400
    home = tmp_path / "home"
    done = tak("batch", str(tasks), "--max-steps", str(huge), home=home, demo=True)
    assert done.returncode == 0 and "internal error" not in done.stderr, done.stderr
    manifest = json.loads((home / "batch" / "evals" / "manifest.json").read_text())
    assert manifest["settings"]["limits"] == {"max_steps": huge}


def test_every_limit_survives_resume_and_a_second_run_with_the_same_flags(tmp_path: Path) -> None:
    """--max-tokens and --max-cost too (the fix's own test covers steps and wall time)."""
    tasks = _tasks_file(tmp_path)
    home = tmp_path / "home"
    limits = ("--max-steps", "3", "--max-tokens", "5000", "--max-cost", "1", "--wall-time", "60")
    first = tak("batch", str(tasks), *limits, home=home, demo=True)
    assert first.returncode == 0, first.stderr
    manifest = json.loads((home / "batch" / "evals" / "manifest.json").read_text())
    assert manifest["settings"]["limits"] == {
        "max_steps": 3,
        "max_tokens": 5000,
        "max_cost": 1.0,
        "wall_time": 60.0,
    }
    resumed = tak("batch", "resume", "evals", home=home, demo=True)
    assert resumed.returncode == 0, resumed.stderr
    again = tak("batch", str(tasks), *limits, home=home, demo=True)
    assert again.returncode == 0, again.stderr
    other = tak("batch", str(tasks), "--max-cost", "2", home=home, demo=True)
    assert other.returncode == 2 and "started with other limits" in other.stderr, other.stderr


async def test_a_manifest_of_the_previous_format_still_reads(tmp_path: Path) -> None:
    """What 98f709d's RunCommand wrote (limits as a dict of the flags given)."""
    old = {
        "model": "scripted:demo",
        "fallbacks": [],
        "system": None,
        "plugins": [],
        "tools": None,
        "settings": None,
        "limits": {"max_steps": 2, "wall_time": 60.0},
        "concurrency": 10,
        "tasks_file": None,
    }
    async with open_run_dir(tmp_path / "r", settings=old) as ledger:
        kept = RunSettings.of_ledger(ledger)
    assert kept.limits == TaskLimits(max_steps=2, wall_time=60.0)
    assert isinstance(kept.limits.max_steps, int)
    assert kept.to_json()["limits"] == {"max_steps": 2, "wall_time": 60.0}


@pytest.mark.parametrize(
    "limits",
    [{"max_steps": 2.0}, {"max_steps": -1}, {"max_cost": "1"}, {"wall_time": 0}],
    ids=["float-steps", "negative", "string", "zero"],
)
def test_a_hand_edited_bad_limit_is_named_not_called_a_foreign_run(
    limits: dict[str, Any],
) -> None:
    settings = {"model": "scripted:demo", "limits": limits}
    with pytest.raises(UsageError) as refused:
        RunSettings.of_ledger(SimpleNamespace(settings=settings, run_id="r"))  # type: ignore[arg-type]
    message = str(refused.value)
    assert "not started by" not in message and next(iter(limits)) in message, message


def test_odd_but_valid_limits_in_a_manifest_read_back() -> None:
    """null is no limit; an int for a float limit is taken; a huge step count is a count."""
    settings = {
        "model": "scripted:demo",
        "limits": {"max_steps": None, "max_cost": 1, "max_tokens": 10**30},
    }
    kept = RunSettings.of_ledger(SimpleNamespace(settings=settings, run_id="r"))  # type: ignore[arg-type]
    assert kept.limits == TaskLimits(max_cost=1.0, max_tokens=10**30)
    assert kept.to_json()["limits"] == {"max_cost": 1, "max_tokens": 10**30}


async def test_limits_round_trip_through_a_postgresql_run(tmp_path: Path, db_url: str) -> None:
    given = RunSettings(
        model="scripted:demo",
        limits=TaskLimits(max_steps=2, max_tokens=1000, max_cost=0.5, wall_time=60.0),
        tasks_file=TasksFile.of(_tasks_file(tmp_path)),
    )
    with trio.fail_after(60):  # a hang guard
        async with open_postgres_ledger(db_url, "pgr", settings=given.to_json()) as ledger:
            pass
        async with open_postgres_ledger(db_url, "pgr", create=False) as ledger:
            kept = RunSettings.of_ledger(ledger)
    assert kept == given and given.differences(kept) == []
    assert isinstance(kept.limits.max_steps, int) and isinstance(kept.limits.max_tokens, int)


def test_a_postgresql_worker_runs_with_the_limits_of_the_run(tmp_path: Path, db_url: str) -> None:
    tasks = _tasks_file(tmp_path)
    home = tmp_path / "home"
    limits = ("--max-steps", "2", "--max-tokens", "900", "--max-cost", "0.5", "--wall-time", "30")
    command = ("batch", str(tasks), "--store", db_url, "--run-id", "lim", *limits)
    first = tak(*command, home=home, demo=True)
    assert first.returncode == 0, first.stderr
    worker = tak("batch", "worker", "--run", "lim", "--store", db_url, home=home, demo=True)
    assert worker.returncode == 0, worker.stderr
    again = tak(*command, home=home, demo=True)
    assert again.returncode == 0, again.stderr


async def test_a_view_read_while_results_are_appended_only_grows(tmp_path: Path) -> None:
    """A reader in another thread, while the holder finishes tasks: never an error,
    never a result without its task, the counts never go back."""
    run = tmp_path / "r"
    seen: list[tuple[int, int]] = []
    problems: list[BaseException] = []
    stop = threading.Event()

    def read_forever() -> None:
        while not stop.is_set():
            try:
                view = read_run_dir(run)
            except BaseException as exc:  # recorded, asserted below
                problems.append(exc)
                return
            seen.append((view.total, view.finished))

    n = 40
    with trio.fail_after(60):  # a hang guard
        async with open_run_dir(run, settings={"model": "scripted:x"}) as ledger:
            await ledger.add_tasks([task(i) for i in range(n)])
            await ledger.claim("w", n)
            reader = threading.Thread(target=read_forever)
            reader.start()
            try:
                for i in range(n):
                    await ledger.finish("w", result(f"t{i:03d}", text="x" * 5000))
                    await trio.lowlevel.checkpoint()
            finally:
                stop.set()
                await trio.to_thread.run_sync(reader.join)
    assert problems == []
    assert all(total == n for total, _ in seen)
    finished = [f for _, f in seen]
    assert finished == sorted(finished)
    assert read_run_dir(run).finished == n


def test_a_fifo_in_a_run_directory_is_refused_not_waited_on(tmp_path: Path) -> None:
    run = tmp_path / "r"
    trio.run(_make_run, run)
    (run / RESULTS).unlink()
    os.mkfifo(run / RESULTS)
    outcome: list[BaseException | None] = []

    def read() -> None:
        try:
            read_run_dir(run)
            outcome.append(None)
        except BaseException as exc:  # asserted below
            outcome.append(exc)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    opened_by_reader = False
    # Deterministic: a non-blocking open for writing succeeds only once a reader has
    # the FIFO open (ENXIO before); closing it gives that reader EOF, so nothing hangs.
    for _ in range(100_000):
        if not reader.is_alive():
            break
        try:
            fd = os.open(run / RESULTS, os.O_WRONLY | os.O_NONBLOCK)
        except OSError as exc:
            assert exc.errno == errno.ENXIO
            reader.join(0.001)
            continue
        opened_by_reader = True
        os.close(fd)
        break
    reader.join(30)  # a hang guard
    assert not opened_by_reader, "read_run_dir opened the FIFO and waited for a writer"
    assert outcome and isinstance(outcome[0], UsageError | OSError)


async def _make_run(run: Path) -> None:
    async with open_run_dir(run, settings={"model": "scripted:x"}) as ledger:
        await ledger.add_tasks([task(1)])


def test_a_result_whose_task_line_is_torn_is_named_in_one_line(tmp_path: Path) -> None:
    """A hand-made damage (no writer leaves it): the reader says which line, and
    leaves the files as they were."""
    run = tmp_path / "r"
    trio.run(_make_run, run)
    with open(run / "tasks.jsonl", "ab") as f:
        f.write(b'{"id": "t002", "pro')
    with open(run / RESULTS, "ab") as f:
        f.write(b'{"id": "t002", "reason": "final"}\n')
    before = (run / "tasks.jsonl").read_bytes()
    with pytest.raises(UsageError, match=r"results.jsonl:1: a result for task 't002'"):
        read_run_dir(run)
    assert (run / "tasks.jsonl").read_bytes() == before
