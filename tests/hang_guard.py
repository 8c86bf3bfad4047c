"""``with hang_guard():`` fails a synchronous test that is stuck, instead of hanging the run;
and every test's last resort (``pytest_runtest_protocol``, which tests/conftest.py takes in).

A hang guard, not a measurement: its bound is far past anything a loaded machine
needs, so it fails only where the code waits for something that will never come (a
child that sleeps an hour, a pipe nobody closes). Async tests use
``trio.fail_after`` the same way.
"""

from __future__ import annotations

import faulthandler
import os
import signal
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType

import pytest

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


#: Past this, a test waits for what will never come (a trio test blocked in its
#: event loop, which no ``fail_after`` was set around): its process prints every
#: thread's stack and exits, so the run names the test (pytest-xdist: "worker 'gw1'
#: crashed while running ...") instead of waiting for CI's limit. ``make stress``
#: runs bigger rounds: it allows more. ``TAK_TEST_HANG_S`` sets it (0: off).
TEST_HANG_S = 600
STRESS_HANG_S = 3600


def hang_limit_s(config: pytest.Config) -> int:
    given = os.environ.get("TAK_TEST_HANG_S")
    if given is None:
        return STRESS_HANG_S if config.getoption("--stress", default=False) else TEST_HANG_S
    if not given.isdigit():
        raise pytest.UsageError(f"TAK_TEST_HANG_S: expected whole seconds (0: none), got {given!r}")
    return int(given)


#: fd 2 as the run began, before pytest captured it (where the stacks go).
_stderr: int | None = None


#: When the armed dump fires (``time.monotonic``), ``None`` when none is armed.
_deadline: float | None = None


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config: pytest.Config) -> None:
    global _stderr
    if _stderr is None:
        _stderr = os.dup(sys.__stderr__.fileno() if sys.__stderr__ else 2)
        hang_limit_s(config)  # a bad TAK_TEST_HANG_S: one line, before any test
        # A child forked mid-test inherits the armed timer but not the thread that
        # fires it: cancelling it there (its interpreter's exit does) waits forever.
        # So it is disarmed around each fork, and the parent's re-armed after.
        os.register_at_fork(before=_disarm, after_in_parent=_rearm)


def _arm(seconds: float) -> None:
    global _deadline
    _deadline = time.monotonic() + seconds
    faulthandler.dump_traceback_later(seconds, exit=True, file=_stderr)


def _disarm() -> None:
    faulthandler.cancel_dump_traceback_later()


def _rearm() -> None:
    if _deadline is not None:
        _arm(max(1.0, _deadline - time.monotonic()))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> object:
    global _deadline
    seconds = hang_limit_s(item.config)
    if seconds > 0 and _stderr is not None:
        _arm(seconds)
    try:
        return (yield)
    finally:
        _deadline = None
        faulthandler.cancel_dump_traceback_later()
