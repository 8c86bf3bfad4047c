"""Class 9: what a SIGKILLed kernel's workers leave behind is swept at the next pool start.

A kernel killed with SIGKILL runs no clean-up: its worker dies by its
parent-death signal, but a program the worker left in the background (here
``run_command("sleep 1000 &")``) is reparented and lives on, in the worker's
cgroups. The next ``open_worker_pool`` finds the ``tak-worker-<pid>-*``
cgroups whose kernel is gone, kills what is in them and removes them.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import trio
from kit import Arena
from responsive import dirs_removed, pid_alive, wait_gone

from sandbox import open_worker_pool, probe_isolation

pytestmark = pytest.mark.usefixtures("confined")

_KERNEL = Path(__file__).parent / "leftover_kernel.py"


def _kill(process: subprocess.Popen[bytes], pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    process.kill()
    process.wait()


async def test_a_killed_kernels_background_programs_are_swept(arena: Arena) -> None:
    if probe_isolation().cgroup_parents().directories() == []:
        pytest.skip("no writable cgroup here: nothing to sweep")
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parent)}
    kernel = subprocess.Popen(  # noqa: ASYNC220 (a start is quick; it is read from a thread)
        [sys.executable, str(_KERNEL), str(arena.workspace)], stdout=subprocess.PIPE, env=env
    )
    sleep_pid = 0
    try:
        assert kernel.stdout is not None
        with trio.fail_after(20):
            line = await trio.to_thread.run_sync(kernel.stdout.readline, abandon_on_cancel=True)
        report = json.loads(line)
        sleep_pid, dirs = report["sleep"], report["cgroups"]
        assert pid_alive(sleep_pid) and dirs
        kernel.kill()
        kernel.wait()
        await wait_gone(report["worker"])  # its parent-death signal
        # The bug this sweep exists for: nobody removes the cgroups, and unless the
        # worker saw its channel close before the parent-death signal landed (a
        # race), nobody killed the background program either.
        assert not dirs_removed(dirs)
        async with open_worker_pool(arena.workspace, spare=False):
            pass  # starting a pool is what sweeps
        await wait_gone(sleep_pid)
        assert dirs_removed(dirs), dirs
    finally:
        if sleep_pid:
            _kill(kernel, sleep_pid)
    arena.assert_nothing_seen()


async def test_a_stale_cgroups_members_are_killed_and_it_is_removed(arena: Arena) -> None:
    # Deterministic: a cgroup named for a kernel that is gone, holding a live program.
    parents = probe_isolation().cgroup_parents()
    if not parents.directories():
        pytest.skip("no writable cgroup here: nothing to sweep")
    gone = subprocess.Popen(["true"])  # noqa: ASYNC220 (a pid that is surely dead)
    gone.wait()
    sleeper = subprocess.Popen(["sleep", "1000"])  # noqa: ASYNC220
    try:
        dirs = await trio.to_thread.run_sync(_plant, parents.directories(), gone.pid, sleeper.pid)
        async with open_worker_pool(arena.workspace, spare=False):
            pass
        await trio.to_thread.run_sync(sleeper.wait)
        assert sleeper.returncode == -signal.SIGKILL
        assert dirs_removed(dirs), dirs
    finally:
        sleeper.kill()
        sleeper.wait()
    arena.assert_nothing_seen()


def _plant(parents: list[str], dead_pid: int, member: int) -> list[str]:
    dirs = []
    for parent in parents:
        path = os.path.join(parent, f"tak-worker-{dead_pid}-{os.urandom(4).hex()}")
        os.mkdir(path)
        dirs.append(path)
        with open(os.path.join(path, "cgroup.procs"), "w") as f:
            f.write(str(member))
    return dirs
