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
   loses nothing.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

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

    async def add_tasks(self, tasks: Sequence[BatchTask]) -> None: ...

    async def claim(self, worker: str, limit: int) -> list[Claim]:
        """Up to ``limit`` tasks for ``worker`` to run, in task order."""
        ...

    async def renew(self, worker: str, task_ids: Sequence[str]) -> None:
        """Extend ``worker``'s leases on these tasks (called well within a lease)."""
        ...

    async def finish(self, worker: str, result: TaskResult) -> bool:
        """Record ``result``; False when the task already had a finished result."""
        ...

    async def results(self) -> list[TaskResult]:
        """The latest result of every task that has one, in task order."""
        ...

    async def counts(self) -> LedgerCounts: ...

    async def aclose(self) -> None: ...
