"""A kernel in its own process, to be SIGKILLed: its shell worker leaves ``sleep 1000``
running in the background; it prints the worker's pid, the sleep's pid and the
cgroup directories they are in, then waits to be killed."""

# ruff: noqa: E402 (the plugins package is imported before this directory is on the path)

from __future__ import annotations

import json
import os
import sys

# This directory's plugins/ (the attack plugins) is on sys.path (the script's directory,
# PYTHONPATH) and would shadow the plugins package as a namespace package: the real
# one is found by the editable install's finder, which comes after the path.
_PATH = list(sys.path)
_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in _PATH if os.path.abspath(p or ".") != _HERE]
import plugins  # noqa: F401

sys.path[:] = _PATH

import trio
from responsive import cgroup_dirs_of

from kernel.executor import run_tool_calls
from kernel.messages import ToolCall
from plugins import remote_tools
from sandbox import Policy, open_worker_pool


async def main(workspace: str) -> None:
    async with open_worker_pool(workspace, spare=False) as pool:
        worker = await pool.start("plugins.shell", policy=Policy(subprocess=True))
        command = "sleep 1000 >/dev/null 2>&1 & echo $!"
        call = ToolCall("c", "run_command", {"command": command})
        [observation] = await run_tool_calls([call], remote_tools(worker))
        # "exit code 0\nstdout:\n<pid>\n"
        sleep_pid = int(observation.content.split("stdout:")[1].split()[0])
        report = {"worker": worker.pid, "sleep": sleep_pid, "cgroups": cgroup_dirs_of(sleep_pid)}
        print(json.dumps(report), flush=True)
        await trio.sleep_forever()


if __name__ == "__main__":
    trio.run(main, sys.argv[1])
