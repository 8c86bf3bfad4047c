"""Where a run's tasks and results live, and who runs which task.

``Ledger`` is the seam between the runner (``run_batch``) and its storage:
``DirectoryLedger`` (one process, files under the run's directory) and
``PostgresLedger`` (any number of worker processes on any number of hosts,
claiming tasks with ``SELECT ... FOR UPDATE SKIP LOCKED`` under a lease).

Guarantees every ledger keeps:

1. ``add_tasks`` is idempotent: adding the same tasks again does nothing;
   a task whose id exists with other content is refused (UsageError).
2. ``claim`` hands out only tasks with no finished result and no live claim;
   a claim whose lease lapsed (its worker died or stopped renewing) may be
   handed to another worker, as the next attempt.
3. ``finish`` records a finished result at most once per task: the first
   wins, a later one returns False. A ``cancelled`` result only releases the
   claim (the task runs again on resume) and is kept as history.
4. A result ``finish`` returned True for is durable: a SIGKILL right after
   loses nothing; and what ``counts`` and ``results`` say never runs ahead
   of it (a task counts as finished once its result is durable, not before).
5. ``renew`` extends the worker's leases it still holds and returns the
   ids of the others: the tasks it no longer holds (the lease lapsed and
   another worker took the task, or it finished elsewhere). ``run_batch``
   stops running those at once, recording nothing: they are another's now.
6. ``session_project`` is the store project of the run's task sessions,
   ``batch.<run id>.<nonce>``: the nonce is made once, when the run is
   created, and kept with it (the manifest, the run row), so a resume and
   every worker of the run use the same sessions, and a new run of the same
   id (a directory made again) never finds an old run's transcripts.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import attrs

from ._records import BatchTask, TaskResult


@attrs.frozen(kw_only=True)
class Claim:
    """A task handed to a worker, with the attempt it is (1 for the first run)."""

    task: BatchTask
    attempt: int


@attrs.frozen(kw_only=True)
class LedgerCounts:
    total: int
    finished: int
    running: int


class Ledger(Protocol):
    """A run's tasks and results (see the module docstring for the guarantees)."""

    @property
    def run_id(self) -> str: ...

    @property
    def session_project(self) -> str:
        """The store project of the run's task sessions (guarantee 6)."""
        ...

    @property
    def settings(self) -> dict[str, Any]:
        """The settings the run was created with (JSON; a later open keeps the first)."""
        ...

    @property
    def created(self) -> float:
        """When the run was created (Unix time)."""
        ...

    async def add_tasks(self, tasks: Sequence[BatchTask]) -> None: ...

    async def claim(self, worker: str, limit: int) -> list[Claim]:
        """Up to ``limit`` tasks for ``worker`` to run, in task order."""
        ...

    async def renew(self, worker: str, task_ids: Sequence[str]) -> list[str]:
        """Extend ``worker``'s leases on these tasks (called well within a lease);
        return those of ``task_ids`` it no longer holds (guarantee 5)."""
        ...

    async def finish(self, worker: str, result: TaskResult) -> bool:
        """Record ``result``; False when the task already had a finished result."""
        ...

    async def results(self) -> list[TaskResult]:
        """The latest result of every task that has one, in task order."""
        ...

    async def counts(self) -> LedgerCounts: ...

    async def aclose(self) -> None: ...
