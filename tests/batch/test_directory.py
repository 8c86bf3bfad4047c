"""DirectoryLedger: what only a run directory does (one process at a time, torn lines,
the task file's errors). The Ledger conformance suite runs against it in
tests/batch/test_ledger_conformance.py."""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import subprocess
import sys
import textwrap
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import attrs
import pytest
import trio
import trio.testing

from kernel import open_kernel
from kernel.batch._directory import (
    RESULTS,
    TASKS,
    load_tasks,
    open_run_dir,
)
from kernel.batch._records import MAX_RUN_ID, BatchTask, TaskResult
from kernel.batch._run import run_batch
from kernel.errors import UsageError
from kernel.kernel import Kernel
from kernel.models import ModelRequest, ScriptedModel
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


RUN = "run-1"


async def test_a_task_the_run_accepted_can_be_reopened(tmp_path: Path) -> None:
    big = BatchTask(id="big", prompt="x" * (16 * 1024 * 1024 + 1))
    async with open_run_dir(tmp_path / RUN) as ledger:
        try:
            await ledger.add_tasks([big])
        except UsageError:
            return  # refused up front, saying so: as good as a fix
    async with open_run_dir(tmp_path / RUN) as ledger:
        assert (await ledger.counts()).total == 1


async def test_counts_never_run_ahead_of_results(tmp_path: Path) -> None:
    """What another run_batch on the same ledger reads while a result is being
    written: counts() must not say finished what results() does not hold yet.
    (Seen end to end: of two run_batch sharing a ledger, the one that ends first
    often returns 11 results of 12.)"""
    async with open_run_dir(tmp_path / RUN) as ledger:
        await ledger.add_tasks([BatchTask(id="t1", prompt="p")])
        await ledger.claim("w2", 1)
        writing = getattr(getattr(ledger, "_results_file", None), "_lock", None)
        if not isinstance(writing, trio.Lock):
            pytest.skip("the ledger's writes are no longer behind a trio.Lock")
        async with trio.open_nursery() as nursery:
            async with writing:  # the line is on its way to the disk (a slow fsync)
                nursery.start_soon(ledger.finish, "w2", TaskResult(id="t1", reason="final"))
                await trio.testing.wait_all_tasks_blocked()
                counts, results = await ledger.counts(), await ledger.results()
    assert counts.finished == len(results), (counts, results)


@contextlib.contextmanager
def small_disk(where: Path) -> Iterator[Path]:
    """A 1 MiB tmpfs at ``where`` (root only), unmounted after."""
    where.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root")
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(where)],
        capture_output=True,
        check=False,
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)


def fill(disk: Path) -> None:
    with open(disk / "filler", "wb") as f, contextlib.suppress(OSError):
        while True:
            f.write(b"\0" * 65536)
            f.flush()


@attrs.frozen
class FullDisk:
    run: Path
    go: Callable[[], Awaitable[None]]  # run_batch over the four tasks
    kernel: Kernel
    work: list[BatchTask]
    disk: Path


@contextlib.asynccontextmanager
async def four_tasks_finishing_on_a_full_disk(tmp_path: Path) -> AsyncIterator[FullDisk]:
    """Four tasks claimed on a 1 MiB disk that fills up while they run: every result
    append fails with ENOSPC."""
    with small_disk(tmp_path / "disk") as disk:
        run = disk / RUN
        arrived = 0
        together = trio.Event()

        async def script(request: ModelRequest) -> Any:
            nonlocal arrived
            arrived += 1
            if arrived == 4:
                await trio.to_thread.run_sync(fill, disk)
                together.set()
            await together.wait()
            return "done"

        async with open_kernel(
            home=tmp_path / "home", model=ScriptedModel(script), plugins=[]
        ) as k:
            work = [BatchTask(id=f"t{i}", prompt=f"task t{i}") for i in range(4)]

            async def go() -> None:
                async with open_run_dir(run) as ledger:
                    await run_batch(
                        k,
                        work,
                        ledger=ledger,
                        max_concurrency=4,
                        workspace_root=tmp_path / "workspaces",
                    )

            yield FullDisk(run, go, k, work, disk)


async def test_a_full_disk_loses_no_result_and_tears_no_line(tmp_path: Path) -> None:
    """ENOSPC while appending results: the run stops with the error; results.jsonl
    holds whole lines only; once there is room, the resume finishes every task
    from its transcript (no model asked again)."""
    async with four_tasks_finishing_on_a_full_disk(tmp_path) as full:
        run, k = full.run, full.kernel
        with pytest.raises(BaseException) as caught:
            await full.go()
        leaves = [caught.value]
        while isinstance(leaves[0], BaseExceptionGroup):
            leaves = [leaf for group in leaves for leaf in group.exceptions]  # type: ignore[attr-defined]
        assert all(isinstance(e, OSError) and e.errno == errno.ENOSPC for e in leaves), leaves
        data = (run / RESULTS).read_bytes()
        assert data == b"" or data.endswith(b"\n")
        for line in data.splitlines():
            assert json.loads(line)["reason"] == "cancelled"  # never a torn or a lost one
        (full.disk / "filler").unlink()
        k.agent.model = ScriptedModel(lambda r: pytest.fail("a finished turn asked again"))
        async with open_run_dir(run) as ledger:
            summary = await run_batch(
                k, None, ledger=ledger, workspace_root=tmp_path / "workspaces"
            )
    assert [(r.id, r.reason, r.text) for r in summary.results] == [
        (t.id, "final", "done") for t in full.work
    ]


async def test_a_full_disk_is_one_error(tmp_path: Path) -> None:
    async with four_tasks_finishing_on_a_full_disk(tmp_path) as full:
        with pytest.raises(OSError, match="No space left on device"):
            await full.go()


async def test_a_hand_edited_bad_line_in_the_middle_is_named_and_nothing_is_cut(
    tmp_path: Path,
) -> None:
    """results.jsonl edited by hand, a bad line between good ones: reopening names
    the file and line, and leaves the file as it was (only a torn *last* line is cut)."""
    run = tmp_path / RUN
    async with open_run_dir(run) as ledger:
        await ledger.add_tasks([BatchTask(id=f"t{i}", prompt="p") for i in range(3)])
        for i in range(3):
            await ledger.claim("w", 1)
            assert await ledger.finish("w", TaskResult(id=f"t{i}", reason="final"))
    path = run / RESULTS
    lines = path.read_bytes().splitlines(keepends=True)
    edited = lines[0] + b'{"id": "t1", "reason": "final", "score": "high"}\n' + lines[2]
    path.write_bytes(edited)
    with pytest.raises(UsageError, match=rf"^{path}:2: \$\.score: "):
        async with open_run_dir(run):
            pass
    assert path.read_bytes() == edited
