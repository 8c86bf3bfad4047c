"""run_batch: each test names the guarantee of kernel/batch/_run.py it checks."""

from __future__ import annotations

import heapq
import json
import math
import os
import threading
from collections import Counter
from collections.abc import AsyncIterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs
import pytest
import trio
import trio.testing

from kernel import open_kernel, tool
from kernel.batch._directory import RESULTS, DirectoryLedger, open_run_dir
from kernel.batch._records import BatchTask, TaskLimits, TaskResult
from kernel.batch._run import BatchProgress, TaskOutcome, run_batch
from kernel.batch._summary import BatchSummary
from kernel.errors import ModelAPIError, SandboxError, StoreError, UsageError
from kernel.kernel import Kernel
from kernel.messages import Message, Text
from kernel.models import ModelRequest, ScriptedModel, Usage
from kernel.plugin import context
from kernel.store import MemoryStore, SessionKey
from tests.batch import ws_probe

RUN = "run-1"


def task_of(request: ModelRequest) -> str:
    """The task id a request is for: its first user message is ``task <id>``."""
    first = next(m for m in request.messages if m.role == "user")
    return first.text.split()[-1]


def last_observation(request: ModelRequest) -> str | None:
    last = request.messages[-1]
    if last.role != "tool":
        return None
    observation = last.observations[0]
    return observation.error.message if observation.error is not None else observation.content


@tool
def read_question() -> str:
    """Read question.txt of this task's workspace."""
    return context().workspace.read_text("question.txt")


@tool
def read_other(path: str) -> str:
    """Read a path of the workspace (the tests try to leave it).

    Args:
        path: Relative to the workspace.
    """
    return context().workspace.read_text(path)


@tool
def explode() -> str:
    """Raise."""
    raise RuntimeError("the tool broke")


class Script:
    """A model: each task calls ``read_question`` then answers with what it read;
    tasks named in ``hang`` wait forever, ``fail`` raise ModelAPIError, ``boom``
    call ``explode``. It counts requests per task."""

    def __init__(
        self,
        *,
        hang: Sequence[str] = (),
        fail: Sequence[str] = (),
        boom: Sequence[str] = (),
        gate: trio.Event | None = None,
        rendezvous: int | None = None,
    ) -> None:
        self.hang, self.fail, self.boom, self.gate = set(hang), set(fail), set(boom), gate
        # First requests wait for each other in groups of this many.
        self.rendezvous = rendezvous
        self.waiting = 0
        self.together = trio.Event()
        self.requests: Counter[str] = Counter()
        self.first_requests: Counter[str] = Counter()
        self.concurrent = 0
        self.most_concurrent = 0

    async def __call__(self, request: ModelRequest) -> Any:
        task_id = task_of(request)
        self.requests[task_id] += 1
        if request.messages[-1].role == "user":
            self.first_requests[task_id] += 1
        self.concurrent += 1
        self.most_concurrent = max(self.most_concurrent, self.concurrent)
        try:
            if task_id in self.hang:
                await trio.sleep_forever()
            if self.gate is not None:
                await self.gate.wait()
            if self.rendezvous is not None and request.messages[-1].role == "user":
                self.waiting += 1
                together = self.together
                if self.waiting == self.rendezvous:
                    self.waiting, self.together = 0, trio.Event()
                    together.set()
                await together.wait()
            await trio.lowlevel.checkpoint()
        finally:
            self.concurrent -= 1
        if task_id in self.fail:
            raise ModelAPIError("scripted: the provider said no (HTTP 500)")
        seen = last_observation(request)
        if seen is None:
            name = "explode" if task_id in self.boom else "read_question"
            return ScriptedModel.reply(calls=[(name, {})])
        return f"answer: {seen}"


def tasks(n: int, **fields: Any) -> list[BatchTask]:
    return [
        BatchTask(
            id=f"t{i:03d}",
            prompt=f"task t{i:03d}",
            files={"question.txt": f"question {i}"},
            **fields,
        )
        for i in range(n)
    ]


@pytest.fixture
async def kernel(tmp_path: Path) -> AsyncIterator[Kernel]:
    async with open_kernel(
        home=tmp_path / "home",
        model="scripted:echo",
        tools=[read_question, read_other, explode],
        plugins=[],
    ) as k:
        yield k


def use(k: Kernel, script: Script) -> None:
    k.agent.model = ScriptedModel(script, keep_requests=0)


@pytest.fixture
async def ledger(tmp_path: Path) -> AsyncIterator[DirectoryLedger]:
    async with open_run_dir(tmp_path / RUN) as it:
        yield it


def by_id(summary: BatchSummary) -> dict[str, TaskResult]:
    return {r.id: r for r in summary.results}


async def test_every_task_runs_in_its_own_session_and_workspace(
    kernel: Kernel, ledger: DirectoryLedger
) -> None:
    """3: each task's tools read its own workspace; its session is batch.<run>/<id>."""
    script = Script()
    use(kernel, script)
    summary = await run_batch(kernel, tasks(6), ledger=ledger, max_concurrency=3)
    assert [(r.id, r.reason, r.text) for r in summary.results] == [
        (f"t{i:03d}", "final", f"answer: question {i}") for i in range(6)
    ]
    assert all(r.steps == 2 and r.attempt == 1 and r.error is None for r in summary.results)
    session = kernel.session("t004", project=ledger.session_project)
    assert [m.role for m in await session.messages()] == ["user", "assistant", "tool", "assistant"]
    assert (ledger.workspaces / "t004" / "question.txt").read_text() == "question 4"


async def test_one_tasks_failure_never_touches_another(
    kernel: Kernel, ledger: DirectoryLedger, thread_clock: trio.testing.MockClock
) -> None:
    """1: a task whose model fails, whose tool raises, that hangs past its wall time or
    whose seed is refused ends with that reason; every other task ends final."""
    script = Script(hang=["t001"], fail=["t002"], boom=["t003"])
    use(kernel, script)
    work = tasks(8)
    work[1] = BatchTask(id="t001", prompt="task t001", limits=TaskLimits(wall_time=30))
    work[4] = BatchTask(id="t004", prompt="task t004", files={"../escape.txt": "x"})
    summary = await run_batch(kernel, work, ledger=ledger, max_concurrency=8)
    results = by_id(summary)
    assert results["t001"].reason == "wall_time"
    assert (
        results["t001"].error == "the task was still running at the task's wall time limit (30 s)"
    )
    assert results["t001"].wall_seconds >= 30
    assert (results["t002"].reason, results["t002"].error) == (
        "model_error",
        "scripted: the provider said no (HTTP 500)",
    )
    # A tool's exception is an observation: the model saw it and answered.
    assert results["t003"].reason == "final"
    assert "the tool broke" in results["t003"].text
    assert results["t004"].reason == "error"
    assert results["t004"].error is not None
    assert results["t004"].error.startswith("UsageError: task 't004': files['../escape.txt']: ")
    assert "\n" not in results["t004"].error
    for i in (0, 5, 6, 7):
        assert results[f"t{i:03d}"].reason == "final"
    assert not (ledger.path.parent / "escape.txt").exists()
    assert not (ledger.workspaces / "escape.txt").exists()


async def test_limits_are_the_tasks_over_the_runs(kernel: Kernel, ledger: DirectoryLedger) -> None:
    """2: a run's max_steps stops every task; a task's own limit replaces it."""
    use(kernel, Script())
    work = tasks(3)
    work[2] = BatchTask(
        id="t002", prompt="task t002", files={"question.txt": "q"}, limits=TaskLimits(max_steps=5)
    )
    summary = await run_batch(kernel, work, ledger=ledger, limits=TaskLimits(max_steps=1))
    assert [(r.id, r.reason, r.steps) for r in summary.results] == [
        ("t000", "max_steps", 1),
        ("t001", "max_steps", 1),
        ("t002", "final", 2),
    ]


async def test_a_run_limits_how_many_tasks_run_at_once(
    kernel: Kernel, ledger: DirectoryLedger
) -> None:
    script = Script(rendezvous=4)  # tasks wait until 4 run at once: never more
    use(kernel, script)
    progress: list[BatchProgress] = []
    summary = await run_batch(
        kernel, tasks(20), ledger=ledger, max_concurrency=4, on_progress=progress.append
    )
    assert len(summary.results) == 20
    assert script.most_concurrent == 4
    assert max(p.running for p in progress) == 4
    last = progress[-1]
    assert (last.total, last.done, last.running, last.failed) == (20, 20, 0, 0)
    assert [p.done for p in progress] == sorted(p.done for p in progress)


async def test_scorers_are_isolated_too(
    kernel: Kernel, ledger: DirectoryLedger, thread_clock: trio.testing.MockClock
) -> None:
    """1: a scorer that raises gives no score and says why; one that hangs meets the
    task's wall time; a sync scorer runs in a thread; a bad return value is refused."""
    use(kernel, Script())
    seen: list[TaskOutcome] = []

    async def scorer(task: BatchTask, outcome: TaskOutcome) -> float | None:
        seen.append(outcome)
        if task.id == "t001":
            raise ValueError("cannot score\nthis")
        if task.id == "t002":
            await trio.sleep_forever()
        if task.id == "t003":
            return True  # type: ignore[return-value]
        return 1.0 if outcome.text.endswith(str(task.expected)) else 0.0

    work = [
        BatchTask(
            id=f"t{i:03d}",
            prompt=f"task t{i:03d}",
            files={"question.txt": f"question {i}"},
            expected=i if i != 4 else 99,
            limits=TaskLimits(wall_time=60) if i == 2 else None,
        )
        for i in range(5)
    ]
    summary = await run_batch(kernel, work, ledger=ledger, scorer=scorer)
    results = by_id(summary)
    assert (results["t000"].score, results["t000"].error) == (1.0, None)
    assert (results["t001"].score, results["t001"].error) == (
        None,
        "scorer: ValueError: cannot score this",
    )
    assert results["t002"].reason == "wall_time"
    assert (
        results["t002"].error == "the scorer was still running at the task's wall time limit (60 s)"
    )
    assert results["t002"].text == "answer: question 2"  # the answer is kept
    assert results["t003"].score is None
    assert results["t003"].error is not None and "expected a finite number" in results["t003"].error
    assert results["t004"].score == 0.0
    assert {o.session_id for o in seen} == {f"t{i:03d}" for i in range(5)}
    assert seen[0].workspace.path == ledger.workspaces / seen[0].session_id

    def sync_scorer(task: BatchTask, outcome: TaskOutcome) -> float:
        assert trio.lowlevel.in_trio_run() is False  # in a worker thread
        return 0.5

    async with open_run_dir(ledger.path.parent / "second") as other:
        summary = await run_batch(kernel, work[:2], ledger=other, scorer=sync_scorer)
    assert [r.score for r in summary.results] == [0.5, 0.5]


async def test_rerunning_a_finished_run_does_nothing(
    kernel: Kernel, ledger: DirectoryLedger
) -> None:
    """4: finished tasks are never run again, by the same call or a resume (tasks=None)."""
    script = Script(fail=["t001"])
    use(kernel, script)
    first = await run_batch(kernel, tasks(5), ledger=ledger)
    asked = sum(script.requests.values())
    again = await run_batch(kernel, tasks(5), ledger=ledger)
    resumed = await run_batch(kernel, None, ledger=ledger)
    assert sum(script.requests.values()) == asked
    assert again == resumed == first


async def test_cancelled_tasks_are_recorded_then_resumed_from_their_transcripts(
    tmp_path: Path, kernel: Kernel
) -> None:
    """5 and 4: cancelling the run records its running tasks as cancelled (released);
    a resume finishes them, continuing each transcript (the prompt sent once) as attempt 2."""
    gate = trio.Event()
    script = Script(gate=gate)
    use(kernel, script)
    work = tasks(6)
    async with open_run_dir(tmp_path / RUN) as ledger:
        with trio.move_on_after(5) as stopped:  # the model waits on the gate: never returns
            await run_batch(kernel, work, ledger=ledger, max_concurrency=3)
        assert stopped.cancelled_caught
        results = await ledger.results()
        assert [(r.id, r.reason, r.attempt) for r in results] == [
            ("t000", "cancelled", 1),
            ("t001", "cancelled", 1),
            ("t002", "cancelled", 1),
        ]
        assert (await ledger.counts()).running == 0
    gate.set()
    async with open_run_dir(tmp_path / RUN) as ledger:
        summary = await run_batch(kernel, None, ledger=ledger, max_concurrency=3)
    assert [(r.id, r.reason) for r in summary.results] == [(t.id, "final") for t in work]
    assert [r.attempt for r in summary.results] == [2, 2, 2, 1, 1, 1]
    assert all(script.first_requests[t.id] == 2 for t in work[:3])  # cut, then continued
    for t in work[:3]:
        session = kernel.session(t.id, project=ledger.session_project)
        roles = [m.role for m in await session.messages()]
        assert roles.count("user") == 1, roles  # resumed, not started over
    lines = (tmp_path / RUN / "results.jsonl").read_text().splitlines()
    assert Counter(json.loads(line)["reason"] for line in lines) == {"cancelled": 3, "final": 6}


async def test_a_task_cut_mid_call_is_resumed_without_running_the_call_again(
    tmp_path: Path,
) -> None:
    """4: a transcript whose last call has no result (the process died) is continued:
    the call is answered as interrupted, never re-run."""
    runs: list[str] = []

    @tool
    def side_effect() -> str:
        """Count a run."""
        runs.append("ran")
        return "done"

    def script(request: ModelRequest) -> Any:
        seen = last_observation(request)
        return f"saw: {seen}"

    async with open_kernel(
        home=tmp_path / "home", model=ScriptedModel(script), tools=[side_effect], plugins=[]
    ) as k:
        async with open_run_dir(tmp_path / RUN) as ledger:
            session = k.session("t000", project=ledger.session_project)
            # What a SIGKILL during the call leaves: the prompt, the call, no result.
            await session.append(Message("user", [Text("task t000")]))
            await session.record_calls(
                ScriptedModel.reply(calls=[("side_effect", {})]).message, model="scripted"
            )
            summary = await run_batch(k, tasks(1), ledger=ledger)
    (result,) = summary.results
    assert result.reason == "final"
    assert "interrupted" in result.text
    assert runs == []


async def test_task_workspaces_are_walled_off_for_plugin_workers(
    tmp_path: Path, ledger: DirectoryLedger
) -> None:
    """3: a plugin run in a sandbox worker works in the task's directory (its cwd and
    its Landlock domain); another task's files are out of its reach; the workers of a
    task are gone when it ends."""

    def script(request: ModelRequest) -> Any:
        task_id = task_of(request)
        seen = last_observation(request)
        if seen is None:
            other = "t001" if task_id == "t000" else "t000"
            return ScriptedModel.reply(
                calls=[
                    ("read_here", {"path": "question.txt"}),
                    ("read_raw", {"path": "question.txt"}),
                    ("read_raw", {"path": str(ledger.workspaces / other / "question.txt")}),
                ]
            )
        observations = request.messages[-1].observations
        return json.dumps(
            [o.content if o.error is None else f"ERROR {o.error.message}" for o in observations]
        )

    async with open_kernel(
        home=tmp_path / "home", model=ScriptedModel(script), plugins=[ws_probe]
    ) as k:
        if k.plugins.errors:
            pytest.skip(f"the probe plugin did not load: {k.plugins.errors[0].reason}")
        isolation = k.plugins.plugins[0].isolation
        summary = await run_batch(k, tasks(2), ledger=ledger, max_concurrency=2)
        assert k.plugins.pool.workers == [k.plugins._declared["wsprobe"][1]]  # reaped
    for i, result in enumerate(summary.results):
        assert result.reason == "final", result
        here, raw, other = json.loads(result.text)
        assert here == f"question {i}"
        assert raw == f"{ledger.workspaces / result.id}|question {i}"
        if "unconfined" not in isolation:
            assert other.startswith("ERROR"), other


async def test_hostile_seeds_stay_inside(
    kernel: Kernel, ledger: DirectoryLedger, tmp_path: Path
) -> None:
    """3: a seed's link out of it is not followed (nor copied: a files= path through
    it stays inside); paths of files= that leave the workspace (.., absolute) fail
    the task, and nothing is written outside."""
    use(kernel, Script())
    secret = tmp_path / "secret.txt"
    secret.write_text("secret")
    seed = tmp_path / "seed"
    (seed / "sub").mkdir(parents=True)
    (seed / "question.txt").write_text("seeded")
    (seed / "sub" / "inner.txt").write_text("inner")
    os.symlink(secret, seed / "leak.txt")
    os.symlink("sub/inner.txt", seed / "alias.txt")
    os.symlink(tmp_path, seed / "up")
    work = [
        BatchTask(id="good", prompt="task good", workspace=str(seed)),
        BatchTask(id="dots", prompt="task dots", files={"a/../../x.txt": "x"}),
        BatchTask(id="abs", prompt="task abs", files={str(tmp_path / "abs.txt"): "x"}),
        BatchTask(id="link", prompt="task link", workspace=str(seed), files={"up/y.txt": "y"}),
    ]
    summary = await run_batch(kernel, work, ledger=ledger)
    results = by_id(summary)
    assert (results["good"].reason, results["good"].text) == ("final", "answer: seeded")
    good = ledger.workspaces / "good"
    assert (good / "alias.txt").read_text() == "inner"  # a link inside the seed: copied
    assert (good / "sub" / "inner.txt").read_text() == "inner"
    assert not (good / "leak.txt").exists() and not (good / "up").exists()
    assert results["link"].reason == "final"
    assert (ledger.workspaces / "link" / "up" / "y.txt").read_text() == "y"
    assert not (ledger.workspaces / "link" / "up").is_symlink()
    for name in ("dots", "abs"):
        assert results[name].reason == "error", results[name]
        assert f"task {name!r}: files[" in (results[name].error or "")
    assert not (tmp_path / "abs.txt").exists() and not (tmp_path / "y.txt").exists()
    assert not (ledger.workspaces.parent / "x.txt").exists()
    with pytest.raises(UsageError, match=r"BatchTask\.id"):
        BatchTask(id="../t", prompt="p")


async def test_leases_are_renewed_while_tasks_run(
    kernel: Kernel, tmp_path: Path, thread_clock: trio.testing.MockClock
) -> None:
    """A ledger with a lease hears from the run every lease/3 for its running tasks."""
    gate = trio.Event()
    use(kernel, Script(gate=gate))
    renewals: list[tuple[float, list[str]]] = []

    async with open_run_dir(tmp_path / RUN) as inner:

        class Leased:
            lease_seconds = 3.0
            run_id = inner.run_id
            workspaces = inner.workspaces

            def __getattr__(self, name: str) -> Any:
                return getattr(inner, name)

            async def renew(self, worker: str, task_ids: Sequence[str]) -> None:
                renewals.append((trio.current_time(), list(task_ids)))

        async def open_gate() -> None:
            await trio.sleep(10)
            gate.set()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(open_gate)
            start = trio.current_time()
            await run_batch(kernel, tasks(2), ledger=Leased(), worker="w")  # type: ignore[arg-type]
    while_waiting = [(round(t - start), ids) for t, ids in renewals if t - start < 9.5]
    assert while_waiting == [(n, ["t000", "t001"]) for n in range(1, 10)]


async def test_bad_arguments_are_refused_before_any_task(
    kernel: Kernel, ledger: DirectoryLedger
) -> None:
    for bad in (0, -1, True):
        with pytest.raises(UsageError, match="max_concurrency"):
            await run_batch(kernel, tasks(1), ledger=ledger, max_concurrency=bad)
    with pytest.raises(UsageError):
        await run_batch(kernel, tasks(1), ledger=ledger, model="nope:x")
    with pytest.raises(UsageError, match="nothing"):
        await run_batch(kernel, tasks(1), ledger=ledger, tools=["nothing*"])
    assert (await ledger.counts()).total == 0
    # Task workspaces may not go where a workspace may not (the kernel's data).
    with pytest.raises(SandboxError, match="lies inside"):
        await run_batch(
            kernel, tasks(1), ledger=ledger, workspace_root=kernel.home.data / "workspaces"
        )
    assert (await ledger.counts()).total == 0


def test_the_summary_table() -> None:
    results = tuple(
        TaskResult(
            id=f"t{i}",
            reason="final" if i < 7 else "model_error",
            score=1.0 if i < 3 else (0.0 if i < 6 else None),
            input_tokens=10,
            output_tokens=2,
            cost_usd=0.01 if i < 5 else None,
            wall_seconds=float(i + 1),
        )
        for i in range(10)
    )
    summary = BatchSummary("r", results)
    table = summary.table()
    assert "run r: 10 tasks" in table
    assert [
        line.split()
        for line in table.splitlines()
        if line.strip().startswith(("final", "model_error"))
    ] == [
        ["final", "7"],
        ["model_error", "3"],
    ]
    assert "score mean  0.500 over 6 scored" in table
    assert "100 in, 20 out" in table
    assert "$0.0500" in table
    assert "wall p50    5.00 s" in table and "wall p95    10.00 s" in table
    assert math.isclose(summary.cost_usd or 0, 0.05)
    assert BatchSummary("empty", ()).table().count("-") >= 3


async def test_a_task_given_as_messages_starts_from_them(
    kernel: Kernel, ledger: DirectoryLedger
) -> None:
    """A task's conversation is recorded before its last (user) message is sent."""
    use(kernel, Script())
    earlier = [
        Message("user", [Text("task t000")]),
        Message("assistant", [Text("ready")]),
    ]
    task = BatchTask(
        id="t000",
        messages=(*earlier, Message("user", [Text("go on")])),
        files={"question.txt": "q"},
    )
    (result,) = (await run_batch(kernel, [task], ledger=ledger)).results
    assert (result.reason, result.text) == ("final", "answer: q")
    session = kernel.session("t000", project=ledger.session_project)
    texts = [(m.role, m.text) for m in await session.messages()][:3]
    assert texts == [("user", "task t000"), ("assistant", "ready"), ("user", "go on")]
    # Stopped after the conversation was recorded, before its last message: the
    # next attempt sends that message (it does not take "ready" for the answer).
    again = attrs.evolve(task, id="t001")
    cut = kernel.session("t001", project=ledger.session_project)
    await cut.append(*earlier)
    (_, result) = (await run_batch(kernel, [task, again], ledger=ledger)).results
    assert (result.reason, result.text) == ("final", "answer: q")
    texts = [(m.role, m.text) for m in await cut.messages()][:3]
    assert texts == [("user", "task t000"), ("assistant", "ready"), ("user", "go on")]


async def test_an_idle_worker_waits_for_tasks_held_elsewhere_and_takes_a_lapsed_one(
    kernel: Kernel, tmp_path: Path, thread_clock: trio.testing.MockClock
) -> None:
    """4: with nothing to claim while another worker holds a task, a run waits (one
    poll at a time) and runs the task when its lease lapses to this worker."""
    use(kernel, Script())
    polls: list[float] = []
    async with open_run_dir(tmp_path / RUN) as inner:
        await inner.add_tasks(tasks(2))
        (held,) = await inner.claim("elsewhere", 1)  # t000: another worker's, for now

        class Shared:
            lease_seconds = None
            run_id = inner.run_id
            workspaces = inner.workspaces

            def __getattr__(self, name: str) -> Any:
                return getattr(inner, name)

            async def claim(self, worker: str, limit: int) -> list[Any]:
                if trio.current_time() >= 10 and inner._running.get("t000") == "elsewhere":
                    del inner._running["t000"]  # the other worker's lease lapsed
                    heapq.heappush(inner._free, 0)
                return await inner.claim(worker, limit)

            async def counts(self) -> Any:
                polls.append(trio.current_time())
                return await inner.counts()

        summary = await run_batch(kernel, None, ledger=Shared(), max_concurrency=5)  # type: ignore[arg-type]
    assert [(r.id, r.reason, r.attempt) for r in summary.results] == [
        ("t000", "final", 2),
        ("t001", "final", 1),
    ]
    assert held.attempt == 1
    # About one a second while waiting, not one per idle runner (5 would make ~35).
    assert 5 <= len([t for t in polls if 2 <= t < 9]) <= 8


async def test_the_kernels_model_budget_is_the_one_given(tmp_path: Path) -> None:
    from kernel.models import ModelBudget

    budget = ModelBudget()
    async with open_kernel(home=tmp_path / "home", plugins=[], budget=budget) as k:
        assert k.budget is budget
    # Without one given: tak.toml's [budget], else one without limits, so that a
    # provider's Retry-After still pauses every session of the kernel.
    async with open_kernel(home=tmp_path / "home", plugins=[]) as k:
        assert k.budget is not None and k.budget.providers == {}


class LosingLeases:
    """A ledger with leases whose first renewal finds the task taken over and
    finished by another worker (its own lease lapsed meanwhile)."""

    lease_seconds = 3.0

    def __init__(self, inner: DirectoryLedger) -> None:
        self.inner = inner
        self.renewals = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    @property
    def run_id(self) -> str:
        return self.inner.run_id

    @property
    def session_project(self) -> str:
        return self.inner.session_project

    async def renew(self, worker: str, task_ids: Sequence[str]) -> list[str]:
        self.renewals += 1
        for task_id in task_ids:
            await self.inner.finish(
                "other", TaskResult(id=task_id, reason="final", text="theirs", worker="other")
            )
        return await self.inner.renew(worker, task_ids)


async def test_a_task_whose_lease_was_lost_stops_and_records_nothing(
    tmp_path: Path, thread_clock: trio.testing.MockClock
) -> None:
    """6: the renewal says another worker has the task now: this worker stops it at
    once (no waiting for its turn to end) and records no result of its own."""
    stopped_at: list[float] = []

    async def script(request: ModelRequest) -> Any:
        try:
            await trio.sleep(100)
        except trio.Cancelled:
            stopped_at.append(trio.current_time())
            raise
        return "mine"

    async with open_kernel(home=tmp_path / "home", model=ScriptedModel(script), plugins=[]) as k:
        async with open_run_dir(tmp_path / RUN) as inner:
            ledger = LosingLeases(inner)
            start = trio.current_time()
            summary = await run_batch(k, tasks(1), ledger=ledger, worker="me")  # type: ignore[arg-type]
    assert ledger.renewals >= 1
    assert stopped_at and stopped_at[0] - start == pytest.approx(1.0)  # the first renewal
    assert [(r.reason, r.text, r.worker) for r in summary.results] == [("final", "theirs", "other")]
    lines = (tmp_path / RUN / "results.jsonl").read_text().splitlines()
    assert [json.loads(line)["worker"] for line in lines] == ["other"]


async def test_a_failing_ledger_stops_the_run_with_its_one_error(
    kernel: Kernel, tmp_path: Path
) -> None:
    """7: every task's result write fails: run_batch raises that error, once, not a
    group of every task's copy of it."""
    use(kernel, Script())

    class Failing:
        def __init__(self, inner: DirectoryLedger) -> None:
            self.inner = inner

        def __getattr__(self, name: str) -> Any:
            return getattr(self.inner, name)

        @property
        def run_id(self) -> str:
            return self.inner.run_id

        async def finish(self, worker: str, result: TaskResult) -> bool:
            await trio.lowlevel.checkpoint()
            raise OSError(28, "No space left on device", "results.jsonl")

    async with open_run_dir(tmp_path / "failing") as inner:
        with pytest.raises(OSError, match="No space left on device"):
            await run_batch(
                kernel,
                tasks(6),
                ledger=Failing(inner),  # type: ignore[arg-type]
                max_concurrency=6,
            )


class StoreDown(MemoryStore):
    """A session store whose appends fail while ``down`` (a database gone past its
    ride-out, a call past its deadline), as PostgresStore says it."""

    down = True

    async def append(self, key: SessionKey, entries: Sequence[Mapping[str, Any]]) -> None:
        if self.down and entries:
            await trio.lowlevel.checkpoint()
            raise StoreError(f"PostgreSQL db:5432/tak: append to {key.name} timed out after 30 s")
        await super().append(key, entries)


async def test_a_failing_session_store_releases_its_tasks_and_stops_the_run(
    tmp_path: Path,
) -> None:
    """7: a task whose transcript cannot be written is not failed for good: it is
    recorded cancelled (released, saying why) and run_batch raises the StoreError
    (not a UsageError: bad input it is not); a resume once the store is back runs
    it again as its next attempt, to its answer."""
    store = StoreDown()
    async with open_kernel(
        home=tmp_path / "home",
        model="scripted:echo",
        tools=[read_question],
        plugins=[],
        store=store,
    ) as k:
        use(k, Script())
        async with open_run_dir(tmp_path / RUN) as ledger:
            with pytest.raises(StoreError, match="timed out after 30 s") as info:
                await run_batch(k, tasks(3), ledger=ledger, max_concurrency=1)
            assert not isinstance(info.value, UsageError)
            recorded = await ledger.results()
            assert recorded and {r.reason for r in recorded} == {"cancelled"}
            assert all(r.finished is False for r in recorded)
            first = recorded[0].error
            assert first is not None and first.startswith(
                "released: the session store failed (StoreError: PostgreSQL db:5432/tak: "
            )
            store.down = False
            summary = await run_batch(k, None, ledger=ledger, max_concurrency=1)
    results = by_id(summary)
    assert {r.reason for r in results.values()} == {"final"}
    assert results["t000"].attempt == 2
    assert results["t000"].text == "answer: question 0"


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


async def test_two_runs_on_one_ledger_in_one_process_run_each_task_once(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    """Two run_batch on the same DirectoryLedger at once: every task runs once, in
    one of them or the other."""
    summaries = await two_runs_on_one_ledger(tmp_path)
    assert {r.worker for r in summaries[1].results} == {"w1", "w2"}


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
