"""DirectoryLedger: what only a run directory does (one process at a time, torn lines,
the task file's errors). The Ledger conformance suite runs against it in
tests/batch/test_ledger_conformance.py."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import trio

from kernel.batch._directory import (
    RESULTS,
    TASKS,
    load_tasks,
    open_run_dir,
)
from kernel.batch._records import MAX_RUN_ID, BatchTask
from kernel.errors import UsageError
from tests.batch.ledger_conformance import result, task


async def test_the_files_of_a_run(tmp_path: Path) -> None:
    """manifest.json, tasks.jsonl and results.jsonl hold what a user expects to read."""
    run = tmp_path / "eval-1"
    settings = {"model": "scripted:x", "concurrency": 4}
    async with open_run_dir(run, settings=settings) as ledger:
        assert ledger.run_id == "eval-1"  # the directory's name
        await ledger.add_tasks([task(1), task(2)])
        await ledger.claim("w", 1)
        assert await ledger.finish("w", result("t001", text="yes", score=1.0))
    manifest = json.loads((run / "manifest.json").read_text())
    assert manifest["run_id"] == "eval-1" and manifest["settings"] == settings
    assert [json.loads(line)["id"] for line in (run / TASKS).read_text().splitlines()] == [
        "t001",
        "t002",
    ]
    (line,) = (run / RESULTS).read_text().splitlines()
    assert json.loads(line)["text"] == "yes" and json.loads(line)["score"] == 1.0
    assert (run / "workspaces").is_dir()
    async with open_run_dir(run, settings={"model": "other"}) as again:
        assert again.settings == settings  # the run keeps its own


async def test_a_run_id_that_cannot_name_a_run_is_refused(tmp_path: Path) -> None:
    with pytest.raises(UsageError, match="run id"):
        async with open_run_dir(tmp_path / "has space"):
            pass
    async with open_run_dir(tmp_path / "has space", run_id="named"):
        pass
    with pytest.raises(UsageError, match="holds run 'named', not 'other'"):
        async with open_run_dir(tmp_path / "has space", run_id="other"):
            pass
    with pytest.raises(UsageError, match="no such run directory"):
        async with open_run_dir(tmp_path / "missing", create=False):
            pass


HOLDER = textwrap.dedent(
    """
    import sys, trio
    from kernel.batch._directory import open_run_dir

    async def main():
        async with open_run_dir(sys.argv[1]):
            print("holding", flush=True)
            sys.stdin.readline()

    trio.run(main)
    """
)


async def test_a_second_process_on_the_run_is_refused_naming_the_pid(tmp_path: Path) -> None:
    """One process runs a directory: another gets a one-line error with the holder's pid;
    once the holder is gone (even SIGKILLed) the run opens again."""
    run = tmp_path / "run"
    holder = await trio.to_thread.run_sync(
        lambda: subprocess.Popen(
            [sys.executable, "-c", HOLDER, str(run)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
    )
    try:
        assert holder.stdout is not None
        assert await trio.to_thread.run_sync(holder.stdout.readline) == "holding\n"
        with pytest.raises(UsageError) as info:
            async with open_run_dir(run):
                pass
        message = str(info.value)
        assert f"in use by process {holder.pid}" in message and "\n" not in message
    finally:
        holder.kill()
        await trio.to_thread.run_sync(holder.wait)
    async with open_run_dir(run) as ledger:
        assert ledger.run_id == "run"


async def test_a_torn_last_line_is_cut_off_and_said(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """4: a line half written when the process died was never acknowledged: cut, logged;
    every whole line before it is kept."""
    run = tmp_path / "run"
    async with open_run_dir(run) as ledger:
        await ledger.add_tasks([task(1), task(2), task(3)])
        assert await ledger.finish("w", result("t001"))
        assert await ledger.finish("w", result("t002"))
    results = run / RESULTS
    whole = results.read_bytes()
    results.write_bytes(whole + b'{"id": "t003", "reason": "fin')
    with caplog.at_level(logging.WARNING, logger="tak.batch"):
        async with open_run_dir(run) as ledger:
            assert [r.id for r in await ledger.results()] == ["t001", "t002"]
            assert [c.task.id for c in await ledger.claim("w", 5)] == ["t003"]
            assert await ledger.finish("w", result("t003"))
    assert "torn last line" in caplog.text and str(results) in caplog.text
    assert results.read_bytes().startswith(whole)
    assert len(results.read_bytes().splitlines()) == 3


async def test_a_damaged_line_is_an_error_naming_file_and_line(tmp_path: Path) -> None:
    run = tmp_path / "run"
    async with open_run_dir(run) as ledger:
        await ledger.add_tasks([task(1)])
        assert await ledger.finish("w", result("t001"))
    results = run / RESULTS
    results.write_bytes(results.read_bytes() + b'{"id": "t001", "reason": "great"}\n')
    with pytest.raises(UsageError, match=rf"^{results}:2: \$\.reason: "):
        async with open_run_dir(run):
            pass


def write_lines(path: Path, *lines: str) -> Path:
    path.write_text("".join(line + "\n" for line in lines))
    return path


def test_load_tasks_reads_every_field(tmp_path: Path) -> None:
    path = write_lines(
        tmp_path / "tasks.jsonl",
        json.dumps({"id": "a", "prompt": "hi", "expected": 4, "metadata": {"k": 1}}),
        "",
        json.dumps(
            {
                "id": "b",
                "messages": [
                    {"role": "user", "parts": [{"type": "text", "text": "q"}]},
                ],
                "files": {"x.txt": "x"},
                "limits": {"max_steps": 3, "wall_time": 1.5},
            }
        ),
    )
    a, b = load_tasks(path)
    assert a == BatchTask(id="a", prompt="hi", expected=4, metadata={"k": 1})
    assert b.messages is not None and b.messages[-1].text == "q"
    assert b.limits is not None and (b.limits.max_steps, b.limits.wall_time) == (3, 1.5)


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("{not json", r"tasks.jsonl:2: not valid JSON"),
        ("[1, 2]", r"tasks.jsonl:2: \$: expected a JSON object, got list"),
        ('{"id": "x", "prompt": "p", "colour": 1}', r"tasks.jsonl:2: .*colour"),
        ('{"id": "x", "prompt": 3}', r"tasks.jsonl:2: \$\.prompt: "),
        ('{"id": "x", "prompt": "p", "limits": {"max_steps": 0}}', r"tasks.jsonl:2: .*max_steps"),
        ('{"id": "../x", "prompt": "p"}', r"tasks.jsonl:2: BatchTask\.id: .*'\.\./x'"),
        ('{"id": "/abs", "prompt": "p"}', r"tasks.jsonl:2: BatchTask\.id: "),
        ('{"id": "x"}', r"tasks.jsonl:2: task 'x': set exactly one of prompt and messages"),
        ('{"id": "x", "prompt": "p", "metadata": {"v": NaN}}', r"tasks.jsonl:2: not valid JSON"),
    ],
)
def test_a_bad_task_line_says_file_line_and_what(tmp_path: Path, line: str, message: str) -> None:
    path = write_lines(tmp_path / "tasks.jsonl", '{"id": "ok", "prompt": "fine"}', line)
    with pytest.raises(UsageError, match=message) as info:
        load_tasks(path)
    assert "\n" not in str(info.value)


def test_a_duplicate_task_id_names_both_lines(tmp_path: Path) -> None:
    path = write_lines(
        tmp_path / "tasks.jsonl",
        '{"id": "a", "prompt": "1"}',
        '{"id": "b", "prompt": "2"}',
        '{"id": "a", "prompt": "3"}',
    )
    with pytest.raises(
        UsageError, match=r"tasks.jsonl:3: duplicate task id 'a' \(first at line 1\)"
    ):
        load_tasks(path)


def test_a_missing_task_file_is_one_line(tmp_path: Path) -> None:
    with pytest.raises(UsageError, match="cannot read the task file"):
        load_tasks(tmp_path / "nope.jsonl")


async def test_many_finishes_at_once_are_each_written_whole(tmp_path: Path) -> None:
    """4: finishes arriving together share writes; every line is whole and parses."""
    run = tmp_path / "run"
    async with open_run_dir(run) as ledger:
        await ledger.add_tasks([task(i) for i in range(200)])
        await ledger.claim("w", 200)
        accepted: list[bool] = []

        async def finish(i: int) -> None:
            accepted.append(await ledger.finish("w", result(f"t{i:03d}", text="x" * i)))

        async with trio.open_nursery() as nursery:
            for i in range(200):
                nursery.start_soon(finish, i)
    assert accepted == [True] * 200
    lines = (run / RESULTS).read_text().splitlines()
    assert sorted(json.loads(line)["id"] for line in lines) == [f"t{i:03d}" for i in range(200)]
    async with open_run_dir(run) as ledger:
        assert (await ledger.counts()).finished == 200


def test_a_relative_seed_is_the_task_files(tmp_path: Path) -> None:
    """A relative ``workspace`` is made absolute against the task file's directory
    (whoever runs or resumes, from wherever); absolute and ``~`` ones are left."""
    here = tmp_path / "evals"
    here.mkdir()
    path = write_lines(
        here / "tasks.jsonl",
        '{"id": "a", "prompt": "p", "workspace": "seeds/../seeds/s1"}',
        '{"id": "b", "prompt": "p", "workspace": "/abs/s2"}',
        '{"id": "c", "prompt": "p", "workspace": "~/s3"}',
    )
    assert [t.workspace for t in load_tasks(path)] == [str(here / "seeds/s1"), "/abs/s2", "~/s3"]


async def test_a_run_id_too_long_to_name_its_sessions_is_refused(tmp_path: Path) -> None:
    """The run's sessions are project batch.<run id>.<nonce>: at most 128 characters."""
    with pytest.raises(UsageError, match=f"at most {MAX_RUN_ID} characters"):
        async with open_run_dir(tmp_path / "run", run_id="r" * (MAX_RUN_ID + 1)):
            pass
    async with open_run_dir(tmp_path / "run", run_id="r" * MAX_RUN_ID) as ledger:
        assert len(ledger.session_project) == 128


async def test_a_run_made_before_nonces_keeps_its_sessions(tmp_path: Path) -> None:
    """A manifest without a nonce (an older run) names its sessions batch.<run id>,
    as it did, so a resume finds them."""
    run = tmp_path / "old"
    run.mkdir()
    (run / "manifest.json").write_text('{"run_id": "old", "created": 1.0, "settings": {}}')
    async with open_run_dir(run) as ledger:
        assert ledger.session_project == "batch.old"
