"""What ``tak batch ls`` and ``show`` read: ``RunView`` of a run directory read by the
ledger's own rules without taking the run (``read_run_dir``), and the run's settings
as the ledger keeps them (``RunSettings``)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kernel.batch import RunSettings, TaskLimits, TasksFile, open_run_dir, read_run_dir
from kernel.batch._directory import RESULTS, TASKS
from kernel.errors import UsageError
from kernel.settings import ModelSettings
from tests.batch.ledger_conformance import result, task


def append(path: Path, data: bytes) -> None:
    with open(path, "ab") as f:
        f.write(data)


async def test_a_view_is_what_the_ledger_holds_while_the_run_is_held(tmp_path: Path) -> None:
    run = tmp_path / "r"
    async with open_run_dir(run, settings={"model": "scripted:x"}) as ledger:
        await ledger.add_tasks([task(1), task(2), task(3)])
        await ledger.claim("w", 3)
        await ledger.finish("w", result("t002", "cancelled"))  # not finished: a later one wins
        await ledger.finish("w", result("t002", text="second"))
        await ledger.finish("w", result("t002", text="third"))  # refused: finished already
        await ledger.finish("w", result("t001", text="first"))
        view = read_run_dir(run)  # no lock taken: the run is held by this process
        assert list(view.results) == await ledger.results()
    assert (view.run_id, view.model, view.total) == ("r", "scripted:x", 3)
    assert [(r.id, r.text) for r in view.results] == [("t001", "first"), ("t002", "second")]
    assert view.session_project == ledger.session_project
    assert (view.finished, view.failed) == (2, 0)


async def test_a_torn_last_line_is_left_out_and_left_alone(tmp_path: Path) -> None:
    """The process holding the run cuts a torn line off on reopening; a reader only
    leaves it out: the line may be being written."""
    run = tmp_path / "r"
    async with open_run_dir(run) as ledger:
        await ledger.add_tasks([task(1), task(2)])
        await ledger.claim("w", 2)
        await ledger.finish("w", result("t001"))
    torn_result = b'{"id": "t002", "rea'
    torn_task = b'{"id": "t003", "prom'
    append(run / RESULTS, torn_result)
    append(run / TASKS, torn_task)
    before = {name: (run / name).read_bytes() for name in (RESULTS, TASKS)}
    view = read_run_dir(run)
    assert [r.id for r in view.results] == ["t001"] and view.total == 2
    assert {name: (run / name).read_bytes() for name in (RESULTS, TASKS)} == before


async def test_a_damaged_file_is_the_ledgers_one_line(tmp_path: Path) -> None:
    run = tmp_path / "r"
    async with open_run_dir(run) as ledger:
        await ledger.add_tasks([task(1)])
    append(run / RESULTS, b'{"id": "t001", "reason": "final", "cost_usd": NaN}\n')
    with pytest.raises(UsageError, match=r"results.jsonl:1: not valid JSON") as read:
        read_run_dir(run)
    with pytest.raises(UsageError) as opened:
        async with open_run_dir(run):
            pass
    assert str(read.value) == str(opened.value)  # one rule, said the same way
    (run / "manifest.json").write_text('{"run_id": "r"}')
    with pytest.raises(UsageError, match=r"manifest.json: \$.created"):
        read_run_dir(run)
    with pytest.raises(UsageError, match="not a run directory"):
        read_run_dir(tmp_path)


async def test_run_settings_round_trip_through_the_ledger(tmp_path: Path) -> None:
    tasks_file = tmp_path / "tasks.jsonl"
    tasks_file.write_text('{"id": "a", "prompt": "hi"}\n')
    given = RunSettings(
        model="scripted:x",
        fallbacks=("scripted:y",),
        tools=("fs.*",),
        settings=RunSettings.settings_json(ModelSettings(temperature=0.5, stop=["END"])),
        limits=TaskLimits(max_steps=3, wall_time=60),
        tasks_file=TasksFile.of(tasks_file),
    )
    assert given.settings == {"temperature": 0.5, "stop": ["END"]}
    async with open_run_dir(tmp_path / "r", settings=given.to_json()) as ledger:
        kept = RunSettings.of_ledger(ledger)
    assert kept == given
    assert kept.model_settings() == ModelSettings(temperature=0.5, stop=("END",))
    assert kept.limits == TaskLimits(max_steps=3, wall_time=60.0)
    assert given.to_json()["limits"] == {"max_steps": 3, "wall_time": 60}  # those given
    assert given.differences(kept) == []
    assert given.differences(RunSettings(model="scripted:x")) == [
        "fallbacks",
        "tools",
        "settings",
        "limits",
    ]
    json.dumps(given.to_json(), allow_nan=False)  # what a manifest can hold


async def test_a_run_a_program_started_is_not_a_tak_batch_run(tmp_path: Path) -> None:
    async with open_run_dir(tmp_path / "r", settings={"concurrency": 4}) as ledger:
        with pytest.raises(UsageError, match="'r' was not started by `tak batch run`"):
            RunSettings.of_ledger(ledger)
