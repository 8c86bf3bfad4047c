"""The progress of a ``tak batch`` run on the terminal (``ProgressView``)."""

from __future__ import annotations

import math
import os
from typing import IO, TYPE_CHECKING

from ..terminal import escape_terminal

if TYPE_CHECKING:
    from ..batch import BatchProgress
    from ..kernel import Kernel

#: How often progress is redrawn on a terminal, at most (seconds).
TTY_REDRAW_S = 0.1


class ProgressView:
    """A run's progress on ``out``: on a terminal one line redrawn (at most every
    ``TTY_REDRAW_S``); else a plain line every ``every`` seconds when something
    changed, and one at the end."""

    def __init__(self, out: IO[str], kernel: Kernel, *, every: float) -> None:
        self.out = out
        self.tty = out.isatty()
        self.kernel = kernel
        self.every = TTY_REDRAW_S if self.tty else max(every, TTY_REDRAW_S)
        self.latest: BatchProgress | None = None
        self.first: tuple[float, int] | None = None  # (time, done) at the first update
        self.shown: object = None  # what the last plain line showed
        self.drawn = False

    def update(self, progress: BatchProgress) -> None:
        """``run_batch``'s ``on_progress``: kept for the next redraw (never blocks)."""
        import trio

        if self.first is None:
            self.first = (trio.current_time(), progress.done)
        self.latest = progress

    async def redraw(self) -> None:
        import trio

        while True:
            await trio.sleep(self.every)
            self._show()

    def note(self, text: str) -> None:
        """A line of its own (the progress line is drawn again below it)."""
        self._clear()
        self.out.write(f"{escape_terminal(text)}\n")
        self.out.flush()

    def finish(self, *, show: bool = True) -> None:
        """The last line (``show``), and the terminal's cursor left below it."""
        if show:
            self._show(last=True)
        if self.drawn:
            self.out.write("\n")
            self.drawn = False
        self.out.flush()

    def _clear(self) -> None:
        if self.drawn:
            self.out.write("\r\x1b[2K")
            self.drawn = False

    def _show(self, *, last: bool = False) -> None:
        line = self.line()
        if line is None:
            return
        # Not a terminal: a line when the run moved (the ETA alone moves with the clock).
        moved = (self.latest, self._budget())
        if not self.tty and not last and moved == self.shown:
            return
        self.shown = moved
        if self.tty:
            self._clear()
            self.out.write(line[: _columns(self.out) - 1])
            self.drawn = True
        else:
            self.out.write(line + "\n")
        self.out.flush()

    def line(self) -> str | None:
        """The progress in one line (``None`` before the first update)."""
        import trio

        p = self.latest
        if p is None:
            return None
        parts = [
            f"{p.done}/{p.total} done",
            f"{p.running} running",
            f"{p.failed} failed",
            f"{p.input_tokens:,} in / {p.output_tokens:,} out tokens",
        ]
        if p.cost_usd is not None:
            parts.append(f"${p.cost_usd:.4f}")
        eta = self._eta(p, trio.current_time())
        if eta is not None:
            parts.append(f"ETA {eta}")
        line = f"{p.run_id}: " + ", ".join(parts)
        load = self._budget()
        return escape_terminal(f"{line} | {load}" if load else line)

    def _eta(self, p: BatchProgress, now: float) -> str | None:
        """From the pace since this command started (earlier runs' tasks aside)."""
        if self.first is None or p.done >= p.total:
            return None
        since, done_then = self.first
        done = p.done - done_then
        if done <= 0 or now <= since:
            return None
        return _duration((p.total - p.done) * (now - since) / done)

    def _budget(self) -> str:
        """The shared model budget's load per provider: in flight (of its limit), waiting."""
        budget = getattr(self.kernel, "budget", None)  # once the kernel has one
        snapshot = getattr(budget, "snapshot", None)
        if snapshot is None:
            return ""
        shown = []
        for load in snapshot():
            if load.model is not None:  # a provider's models are in its row
                continue
            in_flight = f"{load.in_flight}/{load.limit}" if load.limit else f"{load.in_flight}"
            text = f"{load.provider} {in_flight} in flight, {load.waiting} waiting"
            if load.paused_for > 0:
                text += f", paused {math.ceil(load.paused_for)}s"
            shown.append(text)
        return "; ".join(shown)


def _columns(out: IO[str]) -> int:
    """The terminal's width (``out``'s own: stdout may be a file meanwhile)."""
    try:
        columns = os.get_terminal_size(out.fileno()).columns
    except (OSError, ValueError, AttributeError):
        columns = 0
    return columns if columns > 0 else 100


def _duration(seconds: float) -> str:
    whole = max(0, math.ceil(seconds))
    if whole < 60:
        return f"{whole}s"
    minutes, whole = divmod(whole, 60)
    if minutes < 60:
        return f"{minutes}m{whole:02d}s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m"


__all__ = ["TTY_REDRAW_S", "ProgressView"]
