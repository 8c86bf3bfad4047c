"""Review of issue 16's batch runs: attacks as a hostile task file, a careless
second caller, a killed process and a full disk would make them.

The tests of the nine bugs found were strict xfails; they pass since the
fixes (each names what it caught). The others are guarantees that held, kept
as coverage.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import subprocess
import sys
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import attrs
import pytest
import trio
import trio.testing

from kernel import open_kernel, tool
from kernel.batch._directory import RESULTS, open_run_dir
from kernel.batch._records import BatchTask, TaskLimits, TaskResult
from kernel.batch._run import TaskOutcome, run_batch
from kernel.errors import UsageError
from kernel.kernel import Kernel
from kernel.messages import Message
from kernel.models import ModelRequest, ScriptedModel, Usage
from tests.batch.test_example import table_counts

RUN = "review-run"


def task_of(request: ModelRequest) -> str:
    first = next(m for m in request.messages if m.role == "user")
    return first.text.split()[-1]


def observations(message: Message) -> list[str]:
    return [
        o.content if o.error is None else f"ERROR {o.error.message}" for o in message.observations
    ]


# -- a hostile task file -------------------------------------------------------


async def test_a_task_the_run_accepted_can_be_reopened(tmp_path: Path) -> None:
    big = BatchTask(id="big", prompt="x" * (16 * 1024 * 1024 + 1))
    async with open_run_dir(tmp_path / RUN) as ledger:
        try:
            await ledger.add_tasks([big])
        except UsageError:
            return  # refused up front, saying so: as good as a fix
    async with open_run_dir(tmp_path / RUN) as ledger:
        assert (await ledger.counts()).total == 1


async def test_tasks_tools_never_reach_another_tasks_files(tmp_path: Path) -> None:
    """The built-in shell and python workers and the in-process fs tools of one task
    reach neither another task's workspace (by .., by absolute path, by a link or a
    hard link made from inside) nor the run's own files (tasks.jsonl holds every
    task's expected answer)."""
    run = tmp_path / RUN
    both = trio.Event()
    arrived = 0

    async def script(request: ModelRequest) -> Any:
        nonlocal arrived
        me = task_of(request)
        other = "b" if me == "a" else "a"
        step = sum(m.role == "assistant" for m in request.messages)
        if step == 0:
            arrived += 1
            if arrived == 2:
                both.set()
            await both.wait()  # both workspaces exist and both tasks run
            peek = (
                f"cat ../{other}/secret.txt; cat {run}/workspaces/{other}/secret.txt; "
                f"cat {run}/tasks.jsonl; ls {run}; ln ../{other}/secret.txt hard; "
                f"ln -s ../{other}/secret.txt soft; echo mine=$(cat secret.txt)"
            )
            code = (
                "for p in ['../OTHER/secret.txt', 'RUN/tasks.jsonl', 'RUN/workspaces/OTHER']:\n"
                "    try:\n"
                "        print(open(p).read())\n"
                "    except OSError as e:\n"
                "        print('denied', e.errno)\n"
            )
            code = code.replace("OTHER", other).replace("RUN", str(run))
            return ScriptedModel.reply(
                calls=[
                    ("run_command", {"command": peek}),
                    ("run_python", {"code": code}),
                ]
            )
        if step == 1:
            paths = [f"../{other}/secret.txt", f"{run}/tasks.jsonl", "soft", "hard"]
            return ScriptedModel.reply(
                calls=[("read_file", {"path": p}) for p in paths]
                + [("list_dir", {"path": ".."}), ("grep", {"pattern": "SECRET", "path": ".."})]
            )
        seen = [o for m in request.messages if m.role == "tool" for o in observations(m)]
        return json.dumps(seen)

    work = [
        BatchTask(id=i, prompt=f"task {i}", files={"secret.txt": f"SECRET-{i}"}, expected=i)
        for i in ("a", "b")
    ]
    (tmp_path / "kws").mkdir()
    async with open_kernel(
        home=tmp_path / "home", model=ScriptedModel(script), workspace=tmp_path / "kws"
    ) as k:
        try:
            await k.check_run(tools=["run_command", "run_python"])
        except UsageError:
            pytest.skip("the shell and python built-ins did not load here")
        if any("unconfined" in p.isolation for p in k.plugins.plugins):
            pytest.skip("plugin workers are not confined on this machine")
        async with open_run_dir(run) as ledger:
            summary = await run_batch(
                k,
                work,
                ledger=ledger,
                max_concurrency=2,
                tools=["run_command", "run_python", "read_file", "list_dir", "grep"],
            )
    for result in summary.results:
        assert result.reason == "final", result
        other = "b" if result.id == "a" else "a"
        seen = json.loads(result.text)
        assert f"mine=SECRET-{result.id}" in seen[0]
        assert all(f"SECRET-{other}" not in s and '"expected"' not in s for s in seen), seen
        assert seen[2:] == [s for s in seen[2:] if s.startswith("ERROR")], seen[2:]
        workspace = run / "workspaces" / result.id
        assert not (workspace / "hard").exists()  # a link may be made; read through, refused


# -- a scorer that never returns ------------------------------------------------


async def test_sync_scorers_that_never_return_do_not_hang_the_run(
    tmp_path: Path, thread_clock: trio.testing.MockClock
) -> None:
    release = threading.Event()
    hung = int(trio.to_thread.current_default_thread_limiter().total_tokens)

    def scorer(task: BatchTask, outcome: TaskOutcome) -> float:
        if task.id.startswith("hang"):
            release.wait()  # a scorer stuck in a C call, a lock, a socket
        return 1.0

    work = [BatchTask(id=f"hang{i:02d}", prompt="p") for i in range(hung)]
    work.append(BatchTask(id="good", prompt="p"))
    stuck = False

    async def watchdog() -> None:
        nonlocal stuck
        await trio.sleep(3600)  # virtual: 360 wall times
        stuck = True
        release.set()  # let the threads go, so the run (and this test) ends

    try:
        async with open_kernel(
            home=tmp_path / "home", model=ScriptedModel(lambda r: "ok"), plugins=[]
        ) as k:
            async with open_run_dir(tmp_path / RUN) as ledger, trio.open_nursery() as nursery:
                nursery.start_soon(watchdog)
                summary = await run_batch(
                    k,
                    work,
                    ledger=ledger,
                    max_concurrency=hung + 1,
                    scorer=scorer,
                    limits=TaskLimits(wall_time=10),
                )
                nursery.cancel_scope.cancel()
    finally:
        release.set()
    assert not stuck, "the run went on an hour past its tasks' 10 s wall time"
    results = {r.id: r for r in summary.results}
    assert (results["good"].reason, results["good"].score) == ("final", 1.0)
    assert {r.reason for r in summary.results if r.id != "good"} == {"wall_time"}


# -- a process killed between its transcript and its result ------------------------


def answering_with_usage(calls: list[str]) -> ScriptedModel:
    def script(request: ModelRequest) -> Any:
        calls.append(task_of(request))
        return ScriptedModel.reply("the answer", usage=Usage(input_tokens=100, output_tokens=7))

    return ScriptedModel(script)


async def test_a_task_answered_before_a_kill_is_not_asked_again(tmp_path: Path) -> None:
    """SIGKILL after the final answer reached the transcript but before results.jsonl
    (the same state: the result line never written): the resume asks no model."""
    calls: list[str] = []
    async with open_kernel(
        home=tmp_path / "home", model=answering_with_usage(calls), plugins=[]
    ) as k:
        async with open_run_dir(tmp_path / RUN) as ledger:
            await run_batch(k, [BatchTask(id="t1", prompt="task t1")], ledger=ledger)
        (tmp_path / RUN / RESULTS).write_bytes(b"")  # killed before the line was written
        async with open_run_dir(tmp_path / RUN) as ledger:
            summary = await run_batch(k, None, ledger=ledger)
    assert calls == ["t1"]
    (result,) = summary.results
    assert (result.reason, result.text, result.attempt) == ("final", "the answer", 2)


async def test_a_task_answered_before_a_kill_keeps_its_usage(tmp_path: Path) -> None:
    calls: list[str] = []
    async with open_kernel(
        home=tmp_path / "home", model=answering_with_usage(calls), plugins=[]
    ) as k:
        async with open_run_dir(tmp_path / RUN) as ledger:
            first = await run_batch(k, [BatchTask(id="t1", prompt="task t1")], ledger=ledger)
        (tmp_path / RUN / RESULTS).write_bytes(b"")
        async with open_run_dir(tmp_path / RUN) as ledger:
            again = await run_batch(k, None, ledger=ledger)
    before, after = first.results[0], again.results[0]
    assert (before.input_tokens, before.output_tokens, before.steps) == (100, 7, 1)
    assert (after.input_tokens, after.output_tokens, after.steps) == (100, 7, 1)


# -- a careless second caller ---------------------------------------------------


async def test_two_runs_on_one_ledger_in_one_process_run_each_task_once(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    """Two run_batch on the same DirectoryLedger at once: every task runs once, in
    one of them or the other."""
    summaries = await two_runs_on_one_ledger(tmp_path)
    assert {r.worker for r in summaries[1].results} == {"w1", "w2"}


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


async def two_runs_on_one_ledger(tmp_path: Path) -> list[Any]:
    asked: list[str] = []

    async def script(request: ModelRequest) -> Any:
        asked.append(task_of(request))
        await trio.sleep(1)
        return "done"

    work = [BatchTask(id=f"t{i:02d}", prompt=f"task t{i:02d}") for i in range(12)]
    summaries: list[Any] = []
    async with open_kernel(home=tmp_path / "home", model=ScriptedModel(script), plugins=[]) as k:
        async with open_run_dir(tmp_path / RUN) as ledger:

            async def one(worker: str) -> None:
                summaries.append(
                    await run_batch(k, work, ledger=ledger, max_concurrency=2, worker=worker)
                )

            async with trio.open_nursery() as nursery:
                nursery.start_soon(one, "w1")
                nursery.start_soon(one, "w2")
    assert sorted(asked) == [t.id for t in work]
    async with open_run_dir(tmp_path / RUN) as ledger:
        assert [r.reason for r in await ledger.results()] == ["final"] * 12
    return summaries


# -- a full disk -------------------------------------------------------------------


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


# -- a hostile or careless seed ----------------------------------------------------


async def test_odd_seeds_neither_hang_nor_leak(tmp_path: Path) -> None:
    """A seed given as a link to a directory is copied; in it, a FIFO (whose open
    would block a reader forever) and a link to a directory outside are left out;
    a hard link to a file outside is copied as the data it is, not as a link."""
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret.txt").write_text("secret")
    real = tmp_path / "real-seed"
    real.mkdir()
    (real / "question.txt").write_text("seeded")
    os.mkfifo(real / "pipe")
    os.symlink(outside, real / "out")
    os.link(outside / "secret.txt", real / "hard.txt")
    seed = tmp_path / "seed-link"
    os.symlink(real, seed)

    def script(request: ModelRequest) -> Any:
        return "done"

    async with open_kernel(home=tmp_path / "home", model=ScriptedModel(script), plugins=[]) as k:
        async with open_run_dir(tmp_path / RUN) as ledger:
            summary = await run_batch(
                k, [BatchTask(id="t1", prompt="p", workspace=str(seed))], ledger=ledger
            )
    (result,) = summary.results
    assert result.reason == "final", result
    workspace = tmp_path / RUN / "workspaces" / "t1"
    assert (workspace / "question.txt").read_text() == "seeded"
    assert not (workspace / "pipe").exists() and not (workspace / "out").exists()
    assert (workspace / "hard.txt").read_text() == "secret"
    assert os.stat(workspace / "hard.txt").st_nlink == 1  # a copy: editing it leaves the seed


def test_a_relative_seed_is_the_task_files(tmp_path: Path) -> None:
    here = tmp_path / "evals"
    (here / "seeds" / "s1").mkdir(parents=True)
    (here / "seeds" / "s1" / "question.txt").write_text("seeded")
    (here / "tasks.jsonl").write_text(
        json.dumps({"id": "t1", "prompt": "hello", "workspace": "seeds/s1"}) + "\n"
    )
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    out = tmp_path / "out"
    tak = [sys.executable, "-m", "kernel.cli", "--home", str(tmp_path / "home"), "batch"]
    done = subprocess.run(
        [*tak, str(here / "tasks.jsonl"), "--model", "scripted:echo", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=elsewhere,
        check=False,
    )
    line = json.loads((out / RESULTS).read_text().splitlines()[0])
    assert (line["reason"], line["error"]) == ("final", None), done.stdout + done.stderr
    assert (out / "workspaces" / "t1" / "question.txt").read_text() == "seeded"


async def test_a_run_id_accepted_can_name_its_sessions(tmp_path: Path) -> None:
    async with open_kernel(
        home=tmp_path / "home", model=ScriptedModel(lambda r: "done"), plugins=[]
    ) as k:
        try:
            async with open_run_dir(tmp_path / "run", run_id="r" * 128) as ledger:
                summary = await run_batch(k, [BatchTask(id="t1", prompt="p")], ledger=ledger)
        except UsageError:
            return  # refused up front, saying so: as good as a fix
    assert [(r.reason, r.error) for r in summary.results] == [("final", None)]


# -- a task escaping its wall time ---------------------------------------------------


@tool
def stuck(marker: str) -> str:
    """Block forever, as a sync tool stuck in a C call would.

    Args:
        marker: Which test's event to wait on.
    """
    STUCK[marker].wait()
    return "released"


STUCK: dict[str, threading.Event] = {}


async def test_sync_tools_that_never_return_end_at_the_wall_time(
    tmp_path: Path, thread_clock: trio.testing.MockClock
) -> None:
    """More hung sync-tool threads than Trio's default thread limiter holds: each task
    ends at its wall time, and the rest of the run (seeding, result lines) goes on."""
    marker = str(tmp_path)
    STUCK[marker] = threading.Event()
    hung = int(trio.to_thread.current_default_thread_limiter().total_tokens) + 1

    def script(request: ModelRequest) -> Any:
        if task_of(request).startswith("hang") and request.messages[-1].role == "user":
            return ScriptedModel.reply(calls=[("stuck", {"marker": marker})])
        return "done"

    work = [BatchTask(id=f"hang{i:02d}", prompt=f"task hang{i:02d}") for i in range(hung)]
    work.append(BatchTask(id="good", prompt="task good"))
    try:
        async with open_kernel(
            home=tmp_path / "home", model=ScriptedModel(script), tools=[stuck], plugins=[]
        ) as k:
            async with open_run_dir(tmp_path / RUN) as ledger:
                with trio.fail_after(3600):
                    summary = await run_batch(
                        k,
                        work,
                        ledger=ledger,
                        max_concurrency=hung + 1,
                        limits=TaskLimits(wall_time=10),
                    )
    finally:
        STUCK.pop(marker).set()
    results = {r.id: r.reason for r in summary.results}
    assert results.pop("good") == "final"
    assert set(results.values()) == {"wall_time"} and len(results) == hung


async def test_plugin_calls_that_ignore_signals_end_at_the_wall_time(tmp_path: Path) -> None:
    """A python or shell call that ignores SIGTERM and SIGINT (and a background
    child) still ends at the task's wall time, and leaves no process behind."""
    marker = f"brk{os.getpid()}x{abs(hash(str(tmp_path))) % 10**8}"
    code = (
        "import signal, time\n"
        "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
        "signal.signal(signal.SIGINT, signal.SIG_IGN)\n"
        "while True:\n"
        "    try:\n"
        f"        time.sleep(1000)  # {marker}\n"
        "    except BaseException:\n"
        "        pass\n"
    )
    shell = f"trap '' TERM INT; (exec -a {marker} sleep 1000) & wait; sleep 1000"

    def script(request: ModelRequest) -> Any:
        if request.messages[-1].role != "user":
            return "over"
        if task_of(request) == "py":
            return ScriptedModel.reply(calls=[("run_python", {"code": code, "timeout": 300})])
        return ScriptedModel.reply(calls=[("run_command", {"command": shell, "timeout": 300})])

    (tmp_path / "kws").mkdir()
    async with open_kernel(
        home=tmp_path / "home", model=ScriptedModel(script), workspace=tmp_path / "kws"
    ) as k:
        try:
            await k.check_run(tools=["run_command", "run_python"])
        except UsageError:
            pytest.skip("the shell and python built-ins did not load here")
        async with open_run_dir(tmp_path / RUN) as ledger:
            with trio.fail_after(120):
                summary = await run_batch(
                    k,
                    [BatchTask(id="py", prompt="task py"), BatchTask(id="sh", prompt="task sh")],
                    ledger=ledger,
                    tools=["run_command", "run_python"],
                    limits=TaskLimits(wall_time=3),
                )
    assert [(r.id, r.reason) for r in summary.results] == [("py", "wall_time"), ("sh", "wall_time")]
    left = await trio.run_process(["pgrep", "-f", marker], capture_stdout=True, check=False)
    assert left.stdout == b"", f"processes left behind: {left.stdout!r}"


# -- a careless user ------------------------------------------------------------------


async def test_a_new_run_never_takes_an_old_runs_answers(tmp_path: Path) -> None:
    asked: list[str] = []

    def script(request: ModelRequest) -> Any:
        question = request.messages[0].text
        asked.append(question)
        return f"answer to {question}"

    async with open_kernel(home=tmp_path / "home", model=ScriptedModel(script), plugins=[]) as k:
        for project, question in (("project-a", "what is 2+2?"), ("project-b", "what is 3+3?")):
            async with open_run_dir(tmp_path / project / "out") as ledger:
                summary = await run_batch(k, [BatchTask(id="t1", prompt=question)], ledger=ledger)
    assert asked == ["what is 2+2?", "what is 3+3?"]
    assert summary.results[0].text == "answer to what is 3+3?"


# -- a stopped process ------------------------------------------------------------------


async def test_stopped_at_any_moment_and_resumed_every_task_ends_once(
    tmp_path: Path, autojump_clock: trio.testing.MockClock, stress: bool
) -> None:
    """The run cancelled at each of 40 moments (a claim, a seed, a model request, a
    tool call, a result being written), then resumed: every task ends ``final``,
    with one prompt in its transcript and one final answer; the resume keeps to its
    max_concurrency. ``make test`` takes every third moment (each phase of a step,
    0.3 s apart, still falls in it); ``make stress`` all 40."""
    for moment in range(1, 41, 1 if stress else 3):
        await stopped_then_resumed(tmp_path / f"home{moment}", moment * 0.05)


async def stopped_then_resumed(home: Path, stop_at: float) -> None:
    finals: dict[str, int] = {}
    running = most = 0

    async def script(request: ModelRequest) -> Any:
        nonlocal running, most
        running += 1
        most = max(most, running)
        try:
            await trio.sleep(0.3)
        finally:
            running -= 1
        me = task_of(request)
        if sum(m.role == "assistant" for m in request.messages) < 2:
            return ScriptedModel.reply(calls=[("read_file", {"path": "q.txt"})])
        finals[me] = finals.get(me, 0) + 1
        return f"done {me}"

    work = [BatchTask(id=f"t{i}", prompt=f"task t{i}", files={"q.txt": "q"}) for i in range(6)]
    async with open_kernel(home=home, model=ScriptedModel(script), plugins=[]) as k:
        async with open_run_dir(home / RUN) as ledger:
            await ledger.add_tasks(work)
            with trio.move_on_after(stop_at):
                await run_batch(k, work, ledger=ledger, max_concurrency=3)
        most = 0
        async with open_run_dir(home / RUN) as ledger:
            summary = await run_batch(k, None, ledger=ledger, max_concurrency=2)
        prompts = []
        for t in work:
            messages = await k.session(t.id, project=ledger.session_project).messages()
            prompts.append(sum(m.role == "user" for m in messages))
    assert [r.reason for r in summary.results] == ["final"] * 6, stop_at
    assert prompts == [1] * 6, stop_at
    assert finals == {t.id: 1 for t in work}, stop_at
    assert most <= 2, stop_at


EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "batch_eval.py"
FINISHED = {"final", "max_steps", "max_tokens", "max_cost", "wall_time", "model_error", "error"}


def example_results(out: Path) -> list[dict[str, Any]]:
    path = out / "run" / "results.jsonl"
    if not path.exists():
        return []
    return [
        json.loads(line)
        for line in path.read_bytes().splitlines(keepends=True)
        if line.endswith(b"\n")
    ]


@pytest.mark.parametrize(
    "kill_after", [-1, 0, 37, 79], ids=["writing_tasks", "no_result", "midway", "last_left"]
)
def test_sigkilled_at_any_point_then_resumed_no_task_runs_twice_or_is_lost(
    tmp_path: Path, kill_after: int
) -> None:
    """A real SIGKILL at several points of the example's run (as its task file is
    being written: -1; before any result; midway, with tasks in flight; one task
    left): the resume finishes every task once, with the outcomes of a run never
    killed, keeps every line written before the kill, sends each prompt once (tasks
    go on from their transcripts, never start over) and runs no task's tool twice;
    a third run has nothing to do. (The one "killed, resumed, exactly once" test of
    the example: tests/batch/test_example.py runs it whole.)"""
    import signal
    import time

    argv = [sys.executable, str(EXAMPLE), str(tmp_path), "--tasks", "80", "--concurrency", "20"]
    process = subprocess.Popen([*argv, "--delay", "0.2"], stdout=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while not (
            (tmp_path / "run" / "tasks.jsonl").exists()
            if kill_after < 0
            else (tmp_path / "run" / "claims.jsonl").exists()
            and len(example_results(tmp_path)) >= kill_after
        ):
            assert process.poll() is None, "the example ended before it could be killed"
            assert time.monotonic() < deadline, "nothing within 120 s"
            time.sleep(0.005)
    finally:
        process.send_signal(signal.SIGKILL)
        process.wait()
    results = tmp_path / "run" / "results.jsonl"
    before = results.read_bytes() if results.exists() else b""
    acknowledged = before[: before.rfind(b"\n") + 1]

    resumed = subprocess.run(argv, capture_output=True, text=True, timeout=300, check=False)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    if kill_after == 37:  # results written, tasks in flight: it says it goes on
        assert "resuming: " in resumed.stdout, resumed.stdout
    # As a run never killed ends: 80 tasks, every 20th one's model failing.
    assert table_counts(resumed.stdout) == {"final": 76, "model_error": 4}, resumed.stdout
    assert results.read_bytes().startswith(acknowledged)
    finished: dict[str, int] = {}
    for line in example_results(tmp_path):
        if line["reason"] in FINISHED:
            finished[line["id"]] = finished.get(line["id"], 0) + 1
    assert len(finished) == 80 and set(finished.values()) == {1}
    (sessions,) = (tmp_path / "home" / "data" / "sessions").glob("batch.batch-eval.*")
    for i in range(80):
        task_id = f"q{i:03d}"
        transcript = (sessions / task_id / "transcript.jsonl").read_text().splitlines()
        assert sum(json.loads(line)["type"] == "user" for line in transcript) == 1, task_id
        ran = tmp_path / "run" / "workspaces" / task_id / "ran.txt"
        assert (ran.read_text().count("read_question") if ran.exists() else 0) <= 1, task_id
    written = len(example_results(tmp_path))
    again = subprocess.run(argv, capture_output=True, text=True, timeout=300, check=False)
    assert "nothing to do" in again.stdout, again.stdout + again.stderr
    assert len(example_results(tmp_path)) == written


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


# -- a slow ledger --------------------------------------------------------------------


class SlowRenewal:
    """A ledger whose renewals take longer than its lease (a slow or stalled database)."""

    def __init__(self, inner: Any, delay: float) -> None:
        self.inner, self.delay = inner, delay
        self.lease_seconds = inner.lease_seconds

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    @property
    def run_id(self) -> str:
        return str(self.inner.run_id)

    async def renew(self, worker: str, task_ids: Any) -> Any:
        await trio.sleep(self.delay)
        return await self.inner.renew(worker, task_ids)


async def test_a_lapsed_lease_does_not_turn_a_running_task_into_an_error(
    tmp_path: Path,
    db_url: str,
) -> None:
    from kernel.batch._postgres import open_postgres_ledger

    async def script(request: ModelRequest) -> Any:
        await trio.sleep(3)  # longer than the lease
        return "done"

    async with open_kernel(home=tmp_path / "home", model=ScriptedModel(script), plugins=[]) as k:
        async with (
            open_postgres_ledger(db_url, RUN, lease_seconds=1.0) as a,
            open_postgres_ledger(db_url, RUN, lease_seconds=1.0) as b,
        ):
            await a.add_tasks([BatchTask(id="t1", prompt="task t1")])

            async def second_worker() -> None:
                await trio.sleep(0.5)  # the first has claimed t1 by now
                await run_batch(k, None, ledger=b, worker="B")

            async with trio.open_nursery() as nursery:
                nursery.start_soon(second_worker)
                await run_batch(k, None, ledger=SlowRenewal(a, 5.0), worker="A")
            results = await a.results()
    assert [(r.reason, r.text) for r in results] == [("final", "done")], results
