"""A run as its ledger holds it now, read without taking the run (``RunView``):
what ``tak batch ls`` and ``show`` print.

Each ledger reads its own: ``read_run_dir`` (``kernel.batch._directory``) a directory
by the ledger's rules without its lock, so the run may be going on;
``read_postgres_run`` (``kernel.batch._postgres``) opens the run's PostgreSQL ledger
without creating it.
"""

from __future__ import annotations

import os
from collections import Counter
from typing import Any

import attrs

from ._records import TaskResult


@attrs.frozen(kw_only=True)
class RunView:
    """A run's totals and each task's latest result."""

    run_id: str
    where: str  # its directory, or the PostgreSQL store
    created: float | None  # Unix time
    model: str | None  # the settings' model, if they name one
    session_project: str  # where its tasks' sessions are (tak sessions ls --project)
    total: int
    results: tuple[TaskResult, ...]  # each task's latest, in task order

    @property
    def finished(self) -> int:
        return sum(r.finished for r in self.results)

    @property
    def failed(self) -> int:
        return sum(r.finished and r.reason != "final" for r in self.results)

    @property
    def cost_usd(self) -> float | None:
        costs = [r.cost_usd for r in self.results if r.cost_usd is not None]
        return sum(costs) if costs else None

    def totals(self) -> dict[str, Any]:
        """The run's totals as JSON (``tak batch ls --json``)."""
        scores = [r.score for r in self.results if r.score is not None]
        return {
            "run_id": self.run_id,
            "where": self.where,
            "created": self.created,
            "model": self.model,
            "session_project": self.session_project,
            "total": self.total,
            "finished": self.finished,
            "failed": self.failed,
            "unfinished": self.total - self.finished,
            "reasons": dict(sorted(Counter(r.reason for r in self.results).items())),
            "input_tokens": sum(r.input_tokens for r in self.results),
            "output_tokens": sum(r.output_tokens for r in self.results),
            "cost_usd": self.cost_usd,
            "score_mean": sum(scores) / len(scores) if scores else None,
        }


def model_of(settings: object) -> str | None:
    """The model a run's settings name (a ``RunSettings``'s), else ``None``."""
    model = settings.get("model") if isinstance(settings, dict) else None
    return model if isinstance(model, str) else None


def where_of(path: str | os.PathLike[str]) -> str:
    """A run directory as a view names it: its own path (``--out``), not its link."""
    return os.path.realpath(path)


__all__ = ["RunView", "model_of", "where_of"]
