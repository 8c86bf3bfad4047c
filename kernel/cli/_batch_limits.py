"""The bounds of ``tak batch``'s options: read by the parser (``kernel.cli.batch``, whose
help names them without importing the command's body) and checked by the command
(``kernel.cli._batch``), neither importing the other."""

from __future__ import annotations

from ..errors import UsageError

#: The most tasks at once ``--concurrency`` may ask for: each is a Trio task from the
#: start, whatever the run's size (a typo's extra zeros would exhaust memory first).
MAX_CONCURRENCY = 10_000


def check_concurrency(value: int | None) -> None:
    """Raises: UsageError: ``value`` (``--concurrency``) is below 1 or above the bound."""
    if value is not None and value < 1:
        raise UsageError(f"--concurrency: expected 1 or more, got {value}")
    if value is not None and value > MAX_CONCURRENCY:
        raise UsageError(f"--concurrency: expected at most {MAX_CONCURRENCY:,}, got {value:,}")
