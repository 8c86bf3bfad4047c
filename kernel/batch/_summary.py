"""What a batch run came to: every task's latest result, and a plain-text table of them."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence

import attrs

from ._records import TaskResult


def percentile(values: Sequence[float], fraction: float) -> float | None:
    """The nearest-rank percentile (``fraction`` in 0..1) of ``values``; ``None`` when empty."""
    if not values:
        return None
    ordered = sorted(values)
    rank = max(1, math.ceil(fraction * len(ordered)))
    return ordered[rank - 1]


@attrs.frozen
class BatchSummary:
    """A run's results: every task's latest result, in task order."""

    run_id: str
    results: tuple[TaskResult, ...]

    @property
    def by_reason(self) -> dict[str, int]:
        """How many tasks ended each way, most common first."""
        return dict(Counter(r.reason for r in self.results).most_common())

    @property
    def score_mean(self) -> float | None:
        scores = [r.score for r in self.results if r.score is not None]
        return sum(scores) / len(scores) if scores else None

    @property
    def cost_usd(self) -> float | None:
        """The run's cost, or ``None`` when no task's cost is known."""
        costs = [r.cost_usd for r in self.results if r.cost_usd is not None]
        return sum(costs) if costs else None

    @property
    def input_tokens(self) -> int:
        return sum(r.input_tokens for r in self.results)

    @property
    def output_tokens(self) -> int:
        return sum(r.output_tokens for r in self.results)

    def table(self) -> str:
        """Plain text: tasks by reason, score mean, tokens, cost, p50/p95 wall time."""
        width = max([len("reason"), *(len(reason) for reason in self.by_reason)])
        lines = [f"run {self.run_id}: {len(self.results)} tasks", ""]
        lines.append(f"  {'reason':<{width}}  tasks")
        for reason, count in self.by_reason.items():
            lines.append(f"  {reason:<{width}}  {count:>5}")
        scored = [r.score for r in self.results if r.score is not None]
        mean = self.score_mean
        walls = [r.wall_seconds for r in self.results]
        p50, p95 = percentile(walls, 0.5), percentile(walls, 0.95)
        cost = self.cost_usd
        lines += [
            "",
            "  score mean  "
            + (f"{mean:.3f} over {len(scored)} scored" if mean is not None else "-"),
            f"  tokens      {self.input_tokens} in, {self.output_tokens} out",
            "  cost        " + (f"${cost:.4f}" if cost is not None else "unknown"),
            "  wall p50    " + (f"{p50:.2f} s" if p50 is not None else "-"),
            "  wall p95    " + (f"{p95:.2f} s" if p95 is not None else "-"),
        ]
        return "\n".join(lines)


__all__ = ["BatchSummary", "percentile"]
