"""``run_batch``: one agent over many tasks, each in its own session and workspace.

::

    async with open_kernel(model="openai:gpt-4.1-mini") as k, open_run_dir("runs/e1") as ledger:
        summary = await run_batch(k, tasks, ledger=ledger, max_concurrency=50)
        print(summary.table())

Guarantees (each test in tests/batch/test_run.py names the one it checks):

1. Isolation: whatever one task does — raise, hang, exhaust a limit, have its
   model fail, have its scorer raise or hang — ends that task only, with the
   reason recorded (``error``: one line ``ExcType: message``; ``wall_time``;
   the limit; ``model_error``); every other task runs on.
2. Limits per task: ``TaskLimits`` of the task over the run's ``limits``; steps,
   tokens and cost are the turn's ``RunLimits``; ``wall_time`` bounds the whole
   task (seeding, the turn, the scorer).
3. Workspaces: a task's tools work in ``<workspace_root>/<task id>`` (seeded
   from ``task.workspace`` and ``task.files``), in-process tools and plugin
   workers alike (``Kernel.open_workspace``); no task sees another's files.
4. Resume: a task whose session already has entries (its run was killed mid
   turn) continues its transcript (``Kernel.resume_turn``); a finished task is
   never run again (the ledger hands out unfinished tasks only). Its result
   counts the steps, tokens and cost of its whole transcript, every attempt's.
   Sessions are the run's own (``Ledger.session_project``): a new run never
   continues an old run's transcripts.
5. Cancellation: the tasks running when ``run_batch`` is cancelled are
   recorded ``cancelled`` (shielded, for at most ``CANCEL_RECORD_S``; a run
   directory's write, which is not cut short once begun, is bounded by its
   ``WRITE_S`` of real time instead), which releases them for a resume; then
   the cancellation goes on.
6. Leases: a task whose lease this worker lost (``Ledger.renew`` says so: it
   lapsed and another worker took the task over) is stopped at once and
   nothing is recorded for it. A task that another ``run_batch`` of the
   kernel is working on (its workspace open, or its session's turn running,
   in this process) is released (recorded ``cancelled``), not failed, and
   claimed again later.
7. A failing ledger (a full disk, a lost database) stops the run with that
   one error (``OSError``, ``StoreError``), the running tasks recorded
   ``cancelled`` where the ledger still can; later failures are logged. So
   does a failing session store: a task whose turn met a ``StoreError`` (the
   database lost for longer than the store rides out, a call timed out) is
   not the task's failure and never its final result: it is recorded
   ``cancelled`` (released: it runs again, as its next attempt, on resume or
   on another worker) and the run stops with that error. (A damaged
   transcript, ``CorruptTranscript``, is the task's own: an ``error``.)
8. Threads: a sync scorer runs in a thread limiter of the run's own (as many
   threads as ``max_concurrency``), so scorer threads that never return (and
   are abandoned at the task's wall time) hold up neither seeding nor the
   ledger's writes.
9. Scorers see a task's workspace confined: ``TaskOutcome.workspace`` is a
   ``sandbox.Workspace`` of the task's directory, so every path a scorer
   names resolves beneath it (``openat2`` with ``RESOLVE_BENEATH``): a
   symbolic link the task left (to another task's answer, to a file of the
   host) is refused with ``SandboxError``, as a tool's would be. It is open
   while the scorer runs (an abandoned sync scorer's until its thread ends).
"""

from __future__ import annotations

import inspect
import logging
import math
import os
import socket
import time
import weakref
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeAlias

import attrs
import trio

import kernel.tracing as tracing
from kernel.agent import AgentEvent, RunLimits, TurnFinished
from kernel.errors import CorruptTranscript, StoreError, TurnRunning, UsageError
from kernel.models import Usage
from kernel.settings import ModelSettings
from sandbox import Workspace

from ._ledger import Claim, Ledger, LedgerCounts
from ._records import BatchTask, TaskLimits, TaskReason, TaskResult
from ._summary import BatchSummary
from ._workspace import seed_workspace

if TYPE_CHECKING:
    from kernel.kernel import Kernel
    from kernel.session import Session

logger = logging.getLogger("tak.batch")

#: How long a stopped run may take to record its running tasks as cancelled.
CANCEL_RECORD_S = 5.0
#: How long recording a finished task's result may take (even while the run stops),
#: or longer: a ledger with a ``request_timeout_s`` of its own (PostgreSQL's, which
#: rides out a restart within it) gets that, and the time to take its thread back.
FINISH_S = 60.0
#: How often an idle runner asks the ledger again while other workers hold tasks
#: (their leases may lapse, and the tasks come to this worker).
POLL_S = 1.0
#: The run's limits when none are given: each task's own, else the kernel's.
NO_LIMITS = TaskLimits()
#: Renewal period when a ledger does not say its lease (``lease_seconds``).
DEFAULT_LEASE_S = 30.0
#: Renewals in flight at once: one is started every third of a lease, and a
#: renewal older than a lease no longer matters.
RENEWALS_IN_FLIGHT = 3


class _TurnBusy(Exception):
    """A turn of the task's session is running in this process: release the task."""


# The task workspaces each kernel's run_batch calls are working in: a second
# run_batch of the same run in this process (a lease lapsed, the task handed
# over) releases the task rather than open the workspace a second time
# (guarantee 6), whatever the kernel would say of a second opening.
_WORKING: weakref.WeakKeyDictionary[Kernel, set[Path]] = weakref.WeakKeyDictionary()


class _StoreFailed(Exception):
    """The task's session store failed: release the task and stop the run (guarantee 7)."""

    def __init__(self, error: StoreError) -> None:
        super().__init__(str(error))
        self.error = error


def _store_failure(exc: BaseException) -> StoreError | None:
    """The ``StoreError`` that ended a task's turn, if one did and it is the store's
    (not a ``CorruptTranscript``: a damaged transcript is the task's own)."""
    for leaf in _leaves(exc):
        chain: list[BaseException] = []
        cause: BaseException | None = leaf
        while cause is not None and cause not in chain:
            chain.append(cause)
            cause = cause.__cause__
        if any(isinstance(e, CorruptTranscript) for e in chain):
            continue
        for e in chain:
            if isinstance(e, StoreError):
                return e
    return None


@attrs.frozen
class TaskOutcome:
    """What a scorer sees of a task: its answer, how it ended, where it worked.

    ``workspace`` is the task's directory as a ``sandbox.Workspace`` (guarantee
    9): ``outcome.workspace.read_text("answer.txt")``, ``.exists(path)``,
    ``.list(path)``, ... resolve every path beneath it, links included, and
    refuse what leads out with ``SandboxError``. ``workspace.path`` is its
    place on disk, for a program of the scorer's own (which is not confined).
    """

    text: str
    reason: TaskReason
    workspace: Workspace
    session_id: str


Scorer: TypeAlias = Callable[[BatchTask, TaskOutcome], "Awaitable[float | None] | float | None"]


@attrs.frozen
class BatchProgress:
    """Where a run stands; ``on_progress`` gets one after every change.

    ``done`` and ``failed`` (finished with a reason other than ``final``) count
    every finished task of the run, earlier runs included; tokens and cost are
    those of finished tasks.
    """

    run_id: str
    total: int
    done: int
    running: int
    failed: int
    input_tokens: int
    output_tokens: int
    cost_usd: float | None
    started_at: float  # trio.current_time() when run_batch started


def one_line(exc: BaseException) -> str:
    """``ExcType: message`` on one line (a group: its first failure, and how many)."""
    if isinstance(exc, BaseExceptionGroup):
        leaves = _leaves(exc)
        first = one_line(leaves[0]) if leaves else type(exc).__name__
        return first if len(leaves) == 1 else f"{first} (and {len(leaves) - 1} more)"
    message = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {message}" if message else type(exc).__name__


def _leaves(exc: BaseException) -> list[BaseException]:
    if isinstance(exc, BaseExceptionGroup):
        return [leaf for e in exc.exceptions for leaf in _leaves(e)]
    return [exc]


def _only_cancelled(exc: BaseException) -> bool:
    return all(isinstance(e, trio.Cancelled) for e in _leaves(exc))


def _failures(exc: BaseException) -> BaseException | None:
    """What of ``exc`` is the task's own failure (an ``Exception``); ``None`` when it is
    a cancellation (or KeyboardInterrupt, SystemExit): the caller re-raises those."""
    if isinstance(exc, Exception):
        return exc
    if isinstance(exc, BaseExceptionGroup):
        _, rest = exc.split(trio.Cancelled)
        # A pending cancellation fires again at the next checkpoint: nothing is lost.
        if rest is not None and all(isinstance(e, Exception) for e in _leaves(rest)):
            return rest
    return None


def merge_limits(task: TaskLimits | None, run: TaskLimits) -> TaskLimits:
    """The task's own limits over the run's, field by field."""
    if task is None:
        return run
    return TaskLimits(
        max_steps=task.max_steps if task.max_steps is not None else run.max_steps,
        max_tokens=task.max_tokens if task.max_tokens is not None else run.max_tokens,
        max_cost=task.max_cost if task.max_cost is not None else run.max_cost,
        wall_time=task.wall_time if task.wall_time is not None else run.wall_time,
    )


def _run_limits(limits: TaskLimits, base: RunLimits) -> RunLimits:
    """The turn's limits: the task's, else the kernel's. Wall time is the task's own
    scope (it covers the scorer too), so the turn gets none unless the task has none."""
    return RunLimits(
        max_steps=limits.max_steps if limits.max_steps is not None else base.max_steps,
        max_tokens=limits.max_tokens if limits.max_tokens is not None else base.max_tokens,
        max_cost=limits.max_cost if limits.max_cost is not None else base.max_cost,
        wall_time=None if limits.wall_time is not None else base.wall_time,
    )


def _score_value(value: Any) -> float | None:
    if value is None:
        return None
    # bool is an int in Python: a scorer returning True meant something else.
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise TypeError(f"the scorer returned {value!r}; expected a finite number or None")
    return float(value)


def _is_async(fn: Callable[..., Any]) -> bool:
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(
        getattr(fn, "__call__", None)  # noqa: B004 (an object with an async __call__)
    )


@attrs.define
class _Turn:
    """The last ``TurnFinished`` a task's turn emitted (a cancelled turn emits one too)."""

    finished: TurnFinished | None = None

    def __call__(self, event: AgentEvent) -> None:
        if isinstance(event, TurnFinished):
            self.finished = event


def _task_totals(entries: Sequence[Any]) -> tuple[int, Usage]:
    """The steps and usage of the task's turn, from its transcript: the model
    responses recorded since its prompt (the last user entry), every attempt's."""
    steps, input_tokens, output_tokens = 0, 0, 0
    cost: float | None = None
    start = max((i for i, e in enumerate(entries) if e.get("type") == "user"), default=-1)
    for entry in entries[start + 1 :]:
        if entry.get("type") != "assistant":
            continue
        steps += not entry.get("partial", False)
        usage = entry.get("usage")
        if isinstance(usage, dict):
            input_tokens += _count(usage.get("input_tokens"))
            output_tokens += _count(usage.get("output_tokens"))
        price = entry.get("cost_usd")
        if isinstance(price, int | float) and not isinstance(price, bool):
            cost = (cost or 0.0) + float(price)
    usage_of = Usage(input_tokens=input_tokens, output_tokens=output_tokens, cost_usd=cost)
    return steps, usage_of


def _count(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 0


@attrs.define
class _Totals:
    done: int = 0
    failed: int = 0
    input_tokens: int = 0
    output_tokens: int = 0
    cost_usd: float | None = None

    def add(self, result: TaskResult) -> None:
        self.done += 1
        self.failed += result.reason != "final"
        self.input_tokens += result.input_tokens
        self.output_tokens += result.output_tokens
        if result.cost_usd is not None:
            self.cost_usd = (self.cost_usd or 0.0) + result.cost_usd


class _Runner:
    def __init__(
        self,
        kernel: Kernel,
        ledger: Ledger,
        *,
        worker: str,
        root: Path,
        model: str | None,
        settings: ModelSettings | None,
        tools: Sequence[str] | None,
        limits: TaskLimits,
        scorer: Scorer | None,
        on_progress: Callable[[BatchProgress], None] | None,
        max_concurrency: int,
    ) -> None:
        self.kernel = kernel
        self.ledger = ledger
        self.worker = worker
        self.root = root
        self.model = model
        self.settings = settings
        self.tools = tools
        self.limits = limits
        self.scorer = scorer
        self.on_progress = on_progress
        self.project = ledger.session_project
        # task id -> (its attempt, the scope that stops it when its lease is lost)
        self.running: dict[str, tuple[int, trio.CancelScope]] = {}
        self.idle = trio.Lock()
        self.scorer_threads = trio.CapacityLimiter(max_concurrency)
        self.renewing = 0
        self.failure: Exception | None = None
        self.stop = trio.CancelScope()  # the runners' scope, set by run_batch
        self.totals = _Totals()
        self.total = 0
        self.started_at = trio.current_time()

    async def load(self) -> None:
        for result in await self.ledger.results():
            if result.finished:
                self.totals.add(result)
        self.total = (await self.ledger.counts()).total
        self.progress()

    def progress(self) -> None:
        if self.on_progress is None:
            return
        t = self.totals
        self.on_progress(
            BatchProgress(
                run_id=self.ledger.run_id,
                total=self.total,
                done=t.done,
                running=len(self.running),
                failed=t.failed,
                input_tokens=t.input_tokens,
                output_tokens=t.output_tokens,
                cost_usd=t.cost_usd,
                started_at=self.started_at,
            )
        )

    async def work(self) -> None:
        """Claim and run tasks one at a time until none is left for this worker."""
        try:
            while self.failure is None:  # a stopping run claims nothing more
                claims = await self.ledger.claim(self.worker, 1)
                if not claims:
                    async with self.idle:  # one idle runner polls; the others wait their turn
                        claims = await self.wait_for_claim()
                    if not claims:
                        return
                await self.run_task(claims[0])
        except Exception as exc:  # the ledger failing, on_progress raising: the run stops
            self.fail(exc)

    def fail(self, exc: Exception) -> None:
        """Stop the run for ``exc``: the first failure is what ``run_batch`` raises
        (the others are often its echoes: every task's write to a full disk)."""
        if self.failure is None:
            self.failure = exc
            self.stop.cancel()
        else:
            logger.error("while the run stops for %s: %s", one_line(self.failure), one_line(exc))

    async def wait_for_claim(self) -> list[Claim]:
        """Nothing to claim now: wait while other workers hold tasks (a lease that
        lapses hands one here); ``[]`` once none is left for this worker."""
        while True:
            claims = await self.ledger.claim(self.worker, 1)
            if claims:
                return claims
            counts: LedgerCounts = await self.ledger.counts()
            self.total = counts.total
            if counts.finished >= counts.total or counts.running <= len(self.running):
                return []
            await trio.sleep(POLL_S)

    async def renew(self, period: float) -> None:
        """Every ``period``, renew the running tasks' leases. Each renewal runs on its
        own: a slow one does not push the next back (a lease is three periods)."""
        async with trio.open_nursery() as renewals:
            tick = trio.current_time()
            while True:
                tick += period
                await trio.sleep_until(tick)
                if self.running and self.renewing < RENEWALS_IN_FLIGHT:
                    held = {task_id: attempt for task_id, (attempt, _) in self.running.items()}
                    renewals.start_soon(self.renew_once, held)

    async def renew_once(self, held: dict[str, int]) -> None:
        self.renewing += 1
        try:
            lost = await self.ledger.renew(self.worker, sorted(held))
        except Exception as exc:  # the next renewal may work; the lease is 3 periods
            logger.warning("could not renew the leases of %s: %s", self.worker, one_line(exc))
            return
        finally:
            self.renewing -= 1
        for task_id in lost or ():
            running = self.running.get(task_id)
            # The same attempt still running: a task released and claimed again
            # meanwhile has a lease of its own.
            if (
                running is not None
                and running[0] == held.get(task_id)
                and not running[1].cancel_called
            ):
                logger.warning(
                    "task %s: this worker's lease on it lapsed and it was taken over "
                    "(or finished) elsewhere; stopping it here, recording nothing",
                    task_id,
                )
                running[1].cancel()

    async def run_task(self, claim: Claim) -> None:
        task = claim.task
        lease = trio.CancelScope()
        earlier = self.running.get(task.id)
        if earlier is not None:
            # This worker's earlier attempt, whose lease lapsed before a renewal could
            # say so: the ledger gave the task out again (here), so that attempt is
            # lost, stopped as a lost lease stops it, recording nothing.
            earlier[1].cancel()
        self.running[task.id] = (claim.attempt, lease)
        self.progress()
        attributes = {"tak.batch.run_id": self.ledger.run_id, "tak.batch.task_id": task.id}
        turn = _Turn()
        started = trio.current_time()
        result: TaskResult | None = None
        busy = False
        store_failed: StoreError | None = None
        try:
            with tracing.span("batch_task", attributes) as span:
                try:
                    with lease:
                        result = await self.attempt(claim, turn, started)
                except _TurnBusy as exc:
                    span.set_error("released")
                    busy = True
                    result = self.result(task, "cancelled", turn, claim, started, error=str(exc))
                except _StoreFailed as exc:
                    span.set_error("store failed")
                    store_failed = exc.error
                    error = (
                        f"released: the session store failed ({one_line(exc.error)}); "
                        "it runs again as its next attempt"
                    )
                    result = self.result(task, "cancelled", turn, claim, started, error=error)
                except BaseException as exc:
                    if _only_cancelled(exc):
                        span.set_error("cancelled")
                        cancelled = self.result(task, "cancelled", turn, claim, started)
                        with trio.CancelScope(shield=True), trio.move_on_after(CANCEL_RECORD_S):
                            await self.ledger.finish(self.worker, cancelled)
                    raise
                if result is None:  # the lease was lost: the task is another worker's
                    span.set_error("lease lost")
                    return
                if result.reason != "final":
                    span.set_error(result.reason)
                span.set_attribute("tak.batch.reason", result.reason)
        finally:
            if self.running.get(task.id, (0, None))[1] is lease:  # not a later attempt's
                del self.running[task.id]
            if result is None:
                self.progress()
        # Work done is recorded even when the run is being stopped meanwhile: a
        # cancellation arrives at the next checkpoint. Bounded: a ledger that hangs
        # must not hold a stopping run forever (the task then runs again on resume).
        accepted: bool | None = None
        finish_s = _finish_s(self.ledger)
        with trio.CancelScope(shield=True), trio.move_on_after(finish_s):
            accepted = await self.ledger.finish(self.worker, result)
        if accepted is None:
            logger.error(
                "task %s: its result (%s) could not be recorded within %g s; it runs again "
                "on resume",
                task.id,
                result.reason,
                finish_s,
            )
        elif accepted and result.finished:
            self.totals.add(result)
        elif not accepted:
            logger.warning(
                "task %s had finished elsewhere already; this attempt's result (%s) is dropped",
                task.id,
                result.reason,
            )
        self.progress()
        if store_failed is not None:  # the run stops with it (guarantee 7)
            self.fail(store_failed)
            return
        if busy:  # the turn running here goes on; this runner comes back later
            logger.info("task %s: %s", task.id, result.error)
            await trio.sleep(POLL_S)

    def result(
        self,
        task: BatchTask,
        reason: TaskReason,
        turn: _Turn,
        claim: Claim,
        started: float,
        *,
        error: str | None = None,
        score: float | None = None,
    ) -> TaskResult:
        finished = turn.finished
        usage = finished.usage if finished is not None else None
        return TaskResult(
            id=task.id,
            reason=reason,
            score=score,
            input_tokens=usage.total_input_tokens if usage is not None else 0,
            output_tokens=usage.output_tokens if usage is not None else 0,
            cost_usd=usage.cost_usd if usage is not None else None,
            wall_seconds=trio.current_time() - started,
            error=error,
            text=finished.text if finished is not None else "",
            steps=finished.steps if finished is not None else 0,
            attempt=claim.attempt,
            worker=self.worker,
            finished_at=time.time(),
            metadata=task.metadata,
        )

    async def attempt(self, claim: Claim, turn: _Turn, started: float) -> TaskResult:
        """Run one task to its result; only a cancellation from outside escapes."""
        task = claim.task
        limits = merge_limits(task.limits, self.limits)
        wall = limits.wall_time if limits.wall_time is not None else math.inf
        reason: TaskReason = "error"
        error: str | None = None
        score: float | None = None
        scoring = False
        with trio.move_on_after(wall) as wall_scope:
            try:
                path = await seed_workspace(self.root, task)
                finished = await self.turn(task, path, limits, turn)
                reason, error = finished.reason, finished.error
            except BaseException as exc:
                if isinstance(exc, _TurnBusy):
                    raise
                failure = _failures(exc)
                if failure is None:
                    raise
                store_error = _store_failure(failure)
                if store_error is not None:
                    raise _StoreFailed(store_error) from None
                reason, error = "error", one_line(failure)
            if self.scorer is not None and reason != "error":
                scoring = True
                score, scorer_error = await self.score(
                    task, turn.finished.text if turn.finished is not None else "", reason
                )
                if scorer_error is not None:
                    error = f"{error}; {scorer_error}" if error else scorer_error
                scoring = False
        if wall_scope.cancelled_caught:
            reason = "wall_time"
            where = "the scorer was still running" if scoring else "the task was still running"
            error = f"{where} at the task's wall time limit ({limits.wall_time:g} s)"
        return self.result(task, reason, turn, claim, started, error=error, score=score)

    async def turn(
        self, task: BatchTask, path: Path, limits: TaskLimits, turn: _Turn
    ) -> TurnFinished:
        kernel = self.kernel
        session = kernel.session(task.id, project=self.project)
        run_limits = _run_limits(limits, kernel.agent.limits)
        common: dict[str, Any] = {
            "on_event": turn,
            "model": self.model,
            "settings": self.settings,
            "tools": self.tools,
            "limits": run_limits,
        }
        working = _WORKING.setdefault(kernel, set())
        if path in working:
            raise _TurnBusy(
                "released: another run_batch of this process is working on the task; "
                "it is claimed again later"
            )
        working.add(path)
        try:
            return await self.turn_in(task, path, turn, session, common)
        finally:
            working.discard(path)

    async def turn_in(
        self,
        task: BatchTask,
        path: Path,
        turn: _Turn,
        session: Session,
        common: dict[str, Any],
    ) -> TurnFinished:
        """The task's turn, in its workspace: a new one, or its transcript resumed."""
        kernel = self.kernel
        earlier = task.messages[:-1] if task.messages is not None else ()
        prompt = task.messages[-1].text if task.messages is not None else task.prompt
        assert prompt is not None
        async with kernel.open_workspace(path) as workspace:
            recorded = await session.messages()
            if len(recorded) > len(earlier):
                # A run stopped mid-task: go on from its transcript, never from scratch.
                try:
                    finished = await kernel.resume_turn(session, workspace=workspace, **common)
                except TurnRunning as exc:
                    # Another run_batch of this process holds the task's session.
                    raise _TurnBusy(
                        f"released: {one_line(exc)} (another run_batch holds the task's "
                        "session); it is claimed again later"
                    ) from None
                # What the task used is its whole transcript's, the attempts before
                # this one included (one killed after its answer made no request now).
                steps, usage = _task_totals(await session.entries())
                turn.finished = attrs.evolve(finished, steps=steps, usage=usage)
                return turn.finished
            if earlier and not recorded:
                await session.append(*earlier)
            return await kernel.run_turn(session, prompt, workspace=workspace, **common)

    async def score(
        self, task: BatchTask, text: str, reason: TaskReason
    ) -> tuple[float | None, str | None]:
        """The scorer's score of the task and what went wrong, if anything (guarantee 9)."""
        scorer = self.scorer
        assert scorer is not None
        try:
            # Opened in a thread: a directory on a slow disk must not stall the run.
            workspace = await trio.to_thread.run_sync(
                Workspace, self.root / task.id, limiter=self.scorer_threads
            )
            outcome = TaskOutcome(text=text, reason=reason, workspace=workspace, session_id=task.id)
            if _is_async(scorer):
                try:
                    value = await scorer(task, outcome)  # type: ignore[misc]
                finally:
                    workspace.close()
            else:

                def run() -> Any:
                    # Closed by the thread when the scorer returns, not before: a
                    # scorer abandoned at the wall time still reads through it, and a
                    # descriptor closed under it could be reused by another file.
                    try:
                        return scorer(task, outcome)
                    finally:
                        workspace.close()

                value = await trio.to_thread.run_sync(
                    run, abandon_on_cancel=True, limiter=self.scorer_threads
                )
                if inspect.isawaitable(value):
                    value = await value
            return _score_value(value), None
        except BaseException as exc:
            failure = _failures(exc)
            if failure is None:
                raise
            return None, f"scorer: {one_line(failure)}"


def _finish_s(ledger: Ledger) -> float:
    """How long recording a result may take: ``FINISH_S``, or the ledger's own bound
    on a call (its ``request_timeout_s``, plus the time to take its thread back) when
    longer, so a result the ledger would still record is not given up on."""
    from kernel.store._postgres import CANCEL_GRACE_S

    own = getattr(ledger, "request_timeout_s", None)
    if isinstance(own, int | float) and not isinstance(own, bool):
        return max(FINISH_S, float(own) + 2 * CANCEL_GRACE_S)
    return FINISH_S


def default_worker() -> str:
    """This process as a worker name: ``host:pid``."""
    return f"{socket.gethostname()}:{os.getpid()}"


async def run_batch(
    kernel: Kernel,
    tasks: Sequence[BatchTask] | None,
    *,
    ledger: Ledger,
    model: str | None = None,
    settings: ModelSettings | None = None,
    tools: Sequence[str] | None = None,
    max_concurrency: int = 10,
    limits: TaskLimits = NO_LIMITS,
    scorer: Scorer | None = None,
    worker: str | None = None,
    workspace_root: Path | None = None,
    on_progress: Callable[[BatchProgress], None] | None = None,
) -> BatchSummary:
    """Run every unfinished task of ``ledger`` (after adding ``tasks``), at most
    ``max_concurrency`` at once, and return the run's summary (see the module docstring).

    Args:
        tasks: added to the ledger first (idempotent); ``None`` when it holds them
            already (a resume, a worker of a many-host run).
        model, settings, tools: as ``Kernel.run_turn`` takes them, for every task.
        limits: each task's, under its own ``task.limits``.
        scorer: ``scorer(task, outcome) -> float | None``, sync (run in a thread) or
            async; run after the task, within its wall time.
        worker: this worker's name in the ledger (default ``host:pid``).
        workspace_root: where task workspaces go (default: the ledger's
            ``workspaces`` directory, else ``$TAK_HOME/batch/<run id>/workspaces``).
        on_progress: called after every change; it must neither block nor raise
            (an exception from it stops the run, as a bug of the caller's).

    Raises:
        UsageError: ``max_concurrency`` below 1, a bad model string, tool pattern
            or setting, a task that conflicts with the ledger's.
        SandboxError: ``workspace_root`` is where a workspace may not be.
        OSError, StoreError: the ledger failed (a full disk, a lost database):
            the first such error, once (guarantee 7).
        trio.Cancelled: the run was cancelled; running tasks were recorded ``cancelled``.
    """
    if (
        isinstance(max_concurrency, bool)
        or not isinstance(max_concurrency, int)
        or max_concurrency < 1
    ):
        raise UsageError(f"max_concurrency must be 1 or more, got {max_concurrency!r}")
    # A bad model string, tool pattern or setting is refused once, before any task.
    await kernel.check_run(model=model, settings=settings, tools=tools)
    root = workspace_root
    if root is None:
        found = getattr(ledger, "workspaces", None)
        root = (
            Path(found)
            if found is not None
            else kernel.home.root / "batch" / ledger.run_id / "workspaces"
        )
    root = Path(await trio.to_thread.run_sync(os.path.abspath, root))
    # Where every task's workspace goes, refused once rather than by each task.
    await kernel.check_workspace(root / "task")
    if tasks is not None:
        await ledger.add_tasks(tasks)
    runner = _Runner(
        kernel,
        ledger,
        worker=worker or default_worker(),
        root=root,
        model=model,
        settings=settings,
        tools=tools,
        limits=limits,
        scorer=scorer,
        on_progress=on_progress,
        max_concurrency=max_concurrency,
    )
    await runner.load()
    lease = getattr(ledger, "lease_seconds", DEFAULT_LEASE_S)
    try:
        async with trio.open_nursery() as nursery:
            if lease is not None:
                nursery.start_soon(runner.renew, lease / 3)
            async with trio.open_nursery() as runners:
                runner.stop = runners.cancel_scope
                for _ in range(max_concurrency):
                    runners.start_soon(runner.work)
            nursery.cancel_scope.cancel()
    except BaseExceptionGroup as group:
        if _only_cancelled(group):
            # The Cancelled of the runners came from a scope around us, still
            # cancelled: this checkpoint raises the caller's own, bare.
            await trio.lowlevel.checkpoint()
        leaves = _leaves(group)
        if len(leaves) == 1:
            raise leaves[0] from None
        raise
    if runner.failure is not None:
        raise runner.failure
    return BatchSummary(ledger.run_id, tuple(await ledger.results()))


__all__ = [
    "BatchProgress",
    "BatchSummary",
    "Scorer",
    "TaskOutcome",
    "default_worker",
    "merge_limits",
    "one_line",
    "run_batch",
]
