"""``_cgroup.join``: the whole process lands in every cgroup of its set.

A process with one thread moves by its thread (v1 ``tasks``: no RCU grace period
per hierarchy); one with more threads moves whole (``cgroup.procs``), so that no
thread stays outside its limits either way.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator

import pytest

from sandbox import _cgroup

_PARENTS = _cgroup.find_parents()

pytestmark = pytest.mark.skipif(_PARENTS.version == 0, reason="no writable cgroup hierarchy here")


@pytest.fixture
def cgroups() -> Iterator[list[str]]:
    paths = _cgroup.create(_PARENTS, memory_bytes=256 << 20, max_pids=64)
    assert paths
    try:
        yield paths
    finally:
        _cgroup.destroy(paths)


def _members(path: str, kind: str) -> set[int]:
    with open(os.path.join(path, kind)) as f:
        return {int(line) for line in f if line.strip()}


def _join_in_child(paths: list[str], *, threads: int) -> tuple[int, list[int]]:
    """Fork a child that starts ``threads`` extra threads, then joins ``paths``.

    Returns its pid and thread ids; it waits (joined) until killed.
    """
    ready_r, ready_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: only async-signal-safe-ish work, then _exit
        try:
            os.close(ready_r)
            stop = threading.Event()
            for _ in range(threads):
                threading.Thread(target=stop.wait, daemon=True).start()
            _cgroup.join(paths)
            tids = os.listdir("/proc/self/task")
            os.write(ready_w, (" ".join(tids) + "\n").encode())
            stop.wait(30)
        finally:
            os._exit(0)
    os.close(ready_w)
    with os.fdopen(ready_r) as ready:
        tids = [int(t) for t in ready.readline().split()]
    return pid, tids


@pytest.mark.parametrize("threads", [0, 3], ids=["one-thread", "four-threads"])
def test_join_moves_every_thread_into_every_cgroup(cgroups: list[str], threads: int) -> None:
    pid, tids = _join_in_child(cgroups, threads=threads)
    try:
        assert len(tids) == threads + 1
        for path in cgroups:
            assert pid in _members(path, "cgroup.procs"), path
            if os.path.exists(os.path.join(path, "tasks")):
                assert set(tids) <= _members(path, "tasks"), path
    finally:
        os.kill(pid, 9)
        os.waitpid(pid, 0)
