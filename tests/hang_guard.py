"""``with hang_guard():`` fails a synchronous test that is stuck, instead of hanging the run.

A hang guard, not a measurement: its bound is far past anything a loaded machine
needs, so it fails only where the code waits for something that will never come (a
child that sleeps an hour, a pipe nobody closes). Async tests use
``trio.fail_after`` the same way.
"""

from __future__ import annotations

import signal
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType

#: Past this, a call that should have ended at its own deadline never will.
HANG_GUARD_S = 120


@contextmanager
def hang_guard(seconds: int = HANG_GUARD_S) -> Iterator[None]:
    """Raise ``TimeoutError`` in the main thread if the block runs past ``seconds``."""

    def stuck(signum: int, frame: FrameType | None) -> None:
        raise TimeoutError(f"still running after {seconds} s: it waits for what never ends")

    previous = signal.signal(signal.SIGALRM, stuck)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
