"""A test run that is killed leaves nothing running: the reaper beside the test process.

tests/conftest.py starts ``python tests/reaper.py PID`` from the top test process
(pytest, or pytest-xdist's controller: its workers are descendants). The reaper arms
``PR_SET_PDEATHSIG`` (it learns of the run's end however it ends: SIGKILL of a CI
timeout, Ctrl-C twice, a normal exit) and, meanwhile, notes the run's descendants
every ``POLL_S`` by reading /proc. When the run is gone, every process it noted that
still lives (same pid, same start time: not a recycled pid) is SIGKILLed: a ``tak
serve`` a test left, a ``tak batch worker``, a Chromium, a PostgreSQL server. A
process started and orphaned within the last ``POLL_S`` can escape, which is why
children the tests start also get ``PR_SET_PDEATHSIG`` where they are started from
the thread that owns them (tests/cli_kit.py ``die_with_parent``).

A sweep at exit in the test process (atexit, a session-finish hook) cannot do this:
a SIGKILLed process runs nothing.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import time

#: How often the run's descendants are noted.
POLL_S = 0.5
#: Set to a path, the reaper writes there the pids it noted, each round (for its test).
NOTES_ENV = "TAK_TEST_REAPER_NOTES"
_PR_SET_PDEATHSIG = 1


def _stat(pid: int) -> tuple[int, int] | None:
    """(parent pid, start time in clock ticks) of ``pid``, or None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rpartition(b")")[2].split()
    except OSError:
        return None
    return int(fields[1]), int(fields[19])


def descendants(root: int) -> dict[int, int]:
    """The processes below ``root`` now: pid -> start time."""
    children: dict[int, list[int]] = {}
    started: dict[int, int] = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            stat = _stat(int(name))
            if stat is not None:
                children.setdefault(stat[0], []).append(int(name))
                started[int(name)] = stat[1]
    found: dict[int, int] = {}
    todo = list(children.get(root, []))
    while todo:
        pid = todo.pop()
        if pid != os.getpid() and pid in started and pid not in found:
            found[pid] = started[pid]
            todo.extend(children.get(pid, []))
    return found


def _kill_leftovers(noted: dict[int, int]) -> None:
    for pid, start in noted.items():
        stat = _stat(pid)
        if stat is not None and stat[1] == start:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def main(run: int) -> None:
    done = False

    def run_ended(signum: int, frame: object) -> None:
        nonlocal done
        done = True

    signal.signal(signal.SIGTERM, run_ended)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the run's to handle
    ctypes.CDLL(None).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    notes = os.environ.get(NOTES_ENV)
    noted: dict[int, int] = {}
    while not done and os.getppid() == run:
        for pid, start in descendants(run).items():
            noted[pid] = start
        # Forget the ones that ended: their pids may be someone else's later.
        noted = {pid: s for pid, s in noted.items() if (st := _stat(pid)) and st[1] == s}
        if notes:
            with open(notes + ".new", "w") as f:
                f.write(" ".join(map(str, noted)))
            os.replace(notes + ".new", notes)
        time.sleep(POLL_S)
    _kill_leftovers(noted)


if __name__ == "__main__":
    main(int(sys.argv[1]))
