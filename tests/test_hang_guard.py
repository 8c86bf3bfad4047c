"""The suite's last hang guard (tests/hang_guard.py) and a child forked under it."""

from __future__ import annotations

import faulthandler
import os
import select
import signal

import pytest

from tests.hang_guard import hang_limit_s


def test_a_child_forked_under_the_hang_guard_can_finish(request: pytest.FixtureRequest) -> None:
    if hang_limit_s(request.config) <= 0:
        pytest.skip("TAK_TEST_HANG_S=0: no guard armed")
    ready, done = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never back into pytest
        try:
            os.close(ready)
            faulthandler.cancel_dump_traceback_later()  # Py_Finalize does this too
            os.write(done, b"x")
        finally:
            os._exit(0)
    os.close(done)
    try:
        finished, _, _ = select.select([ready], [], [], 3)  # a hang guard
    finally:
        if not finished:
            os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        os.close(ready)
    assert finished, "the forked child hung cancelling the inherited hang guard"
