"""A test run that is SIGKILLed leaves nothing it started running (tests/reaper.py)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from tests.hang_guard import hang_guard
from tests.reaper import NOTES_ENV

ROOT = Path(__file__).resolve().parent.parent

# A test that starts a process the way a leftover escapes everything else: in a
# session of its own (no process-group kill reaches it) and without PDEATHSIG.
_LEAVES_ONE = """
import subprocess, sys, time
from pathlib import Path

def test_leaves_a_process(tmp_path):
    child = subprocess.Popen(["sleep", "3600"], start_new_session=True)
    Path("PIDFILE").write_text(str(child.pid))
    time.sleep(3600)
"""


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] not in ("Z", "X")
    except FileNotFoundError:
        return False


def _wait_for(condition: Callable[[], bool]) -> None:
    with hang_guard():
        while not condition():
            time.sleep(0.05)


def test_a_killed_run_leaves_no_process_behind(tmp_path: Path) -> None:
    pidfile, notes = tmp_path / "sleep.pid", tmp_path / "noted"
    test = tmp_path / "test_leaves_one.py"
    test.write_text(_LEAVES_ONE.replace("PIDFILE", str(pidfile)))
    run = subprocess.Popen(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "tests.conftest",
         "--rootdir", str(tmp_path), "-c", "/dev/null", str(test)],
        cwd=ROOT, env={**os.environ, NOTES_ENV: str(notes), "PYTHONPATH": str(ROOT)},
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    leftover = 0
    try:
        _wait_for(lambda: pidfile.exists() and pidfile.read_text() != "")
        leftover = int(pidfile.read_text())
        # Once the reaper has noted it (waited for, not guessed).
        _wait_for(lambda: notes.exists() and str(leftover) in notes.read_text().split())
        run.send_signal(signal.SIGKILL)  # as a CI timeout does: nothing runs in the run
        run.wait()
        _wait_for(lambda: not _alive(leftover))  # the reaper kills it at once
    finally:
        run.kill()
        if leftover and _alive(leftover):
            os.kill(leftover, signal.SIGKILL)
