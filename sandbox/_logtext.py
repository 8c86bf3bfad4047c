"""Worker text made safe for the kernel's log: one record, one line, no terminal escapes.

A plugin's log records and its stdout/stderr are hostile text. Passed to the
kernel's logger as they are, a ``\\n`` starts what looks like a kernel line
(``2025-01-01 INFO kernel: plugin trusted``), a ``\\r`` overwrites the line
on a terminal, and ``ESC [`` sequences recolour, hide or retitle it. Every
path from worker text to the log goes through ``escape_log_text``, and every
line of a worker takes from its ``LogBudget``.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from kernel.terminal import ESCAPES

#: Longest text one record may carry, in characters, after escaping.
MAX_LOG_TEXT = 8192

# One table with the terminal's (kernel.terminal): what a terminal acts on, a log
# reader does too.
_TABLE = ESCAPES


def escape_log_text(text: str, *, limit: int = MAX_LOG_TEXT) -> str:
    """``text`` with control characters written as escapes (tab kept), cut to ``limit``.

    The result has no character a terminal or a line-based log reader acts on,
    so one call's text is exactly one line of the log.
    """
    escaped = text[: limit + 1].translate(_TABLE)
    if len(escaped) <= limit and len(text) <= limit:
        return escaped
    return f"{escaped[:limit]} [... cut at {limit} characters]"


class LogBudget:
    """How much of one worker's text reaches the kernel's log: token buckets.

    A worker writes to its stdout pipe, or sends log frames, far faster than a log
    should take (100 000 lines in one call), and every line costs the kernel's
    Trio thread and its log's disk. Each line takes one line token and its length
    in byte tokens; past the budget it is dropped, not queued, so the pipe keeps
    draining and the worker never blocks on it. ``summary()`` says how many were
    dropped, at most once per ``summary_every_s``.
    """

    def __init__(
        self,
        *,
        burst_lines: int = 1000,
        lines_per_s: float = 100.0,
        burst_bytes: int = 1024 * 1024,
        bytes_per_s: float = 100 * 1024,
        summary_every_s: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.burst_lines, self.lines_per_s = burst_lines, lines_per_s
        self.burst_bytes, self.bytes_per_s = burst_bytes, bytes_per_s
        self.summary_every_s = summary_every_s
        self._clock = clock
        self._lines = float(burst_lines)
        self._bytes = float(burst_bytes)
        self._at = clock()
        self._next_summary = self._at
        self.dropped = 0

    def admit(self, size: int) -> bool:
        """Whether a line of ``size`` bytes may be logged now (it is counted as dropped if not)."""
        now = self._clock()
        elapsed, self._at = max(0.0, now - self._at), now
        self._lines = min(self.burst_lines, self._lines + elapsed * self.lines_per_s)
        self._bytes = min(self.burst_bytes, self._bytes + elapsed * self.bytes_per_s)
        if self._lines >= 1 and self._bytes >= size:
            self._lines -= 1
            self._bytes -= size
            return True
        self.dropped += 1
        return False

    def drop(self, lines: int) -> None:
        """Count ``lines`` dropped without asking (they came with one that was refused)."""
        self.dropped += lines

    def summary(self, *, final: bool = False) -> str | None:
        """``"N lines dropped ..."`` when lines were dropped and the interval has passed
        (or ``final``), counting afresh; else None."""
        now = self._clock()
        if not self.dropped or (now < self._next_summary and not final):
            return None
        dropped, self.dropped = self.dropped, 0
        self._next_summary = now + self.summary_every_s
        return (
            f"{dropped} lines dropped (log budget: {self.burst_lines} lines at once, then "
            f"{self.lines_per_s:g} lines and {self.bytes_per_s / 1024:g} KiB a second)"
        )
