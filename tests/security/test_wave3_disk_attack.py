"""Wave 3, class 1, attacked again: the disk watchdog against a second engineer.

Each test is one attempt on the budget that ``sandbox._diskwatch`` holds while
workers live (see ``test_wave3_disk.py`` for the first engineer's own attempts);
each must be refused. Real plugins in real confined workers; the tests wait for
what they started, never on a clock.
"""

from __future__ import annotations

from kit import Arena

from kernel.executor import run_tool_calls
from kernel.home import TakHome
from kernel.messages import Observation, ToolCall
from kernel.plugin import use_context
from plugins import PluginHost, open_plugin_host
from sandbox import Workspace

MIB = 1 << 20


def _home(arena: Arena) -> TakHome:
    return TakHome(arena.root / "home").ensure()


async def _python(
    host: PluginHost, code: str, call_id: str, workspace: Workspace | None = None
) -> Observation:
    with use_context(host.context(workspace=workspace)):
        [obs] = await run_tool_calls([ToolCall(call_id, "run_python", {"code": code})], host.tools)
    return obs


# A program that holds an unlinked temporary file (O_TMPFILE in the workspace, as tempfile.TemporaryFile(dir=...)
# makes one) of 40 MiB, within its own workspace's budget, and lives on.
_HOLDER = r"""
import subprocess, sys
holder = '''
import os, tempfile, time
f = tempfile.TemporaryFile(dir='.')
f.write(os.urandom(40 << 20)); f.flush()
open('held', 'w').write('40 MiB held')
time.sleep(600)
'''
import os, time
subprocess.Popen([sys.executable, '-c', holder], stdin=subprocess.DEVNULL)
while not os.path.exists('held'):
    time.sleep(0.05)
print('started')
"""


async def test_a_file_held_in_another_workspace_is_not_charged_to_this_one(
    arena: Arena, confined: None
) -> None:
    """Two workspaces on one file system: a task's worker keeps a 40 MiB temporary file
    (unlinked, within its own 64 MiB budget); a worker of the host's workspace writes
    30 MiB (within its own). The host's walk must not add the task's file to the host's
    usage, kill the host's writers for it, and refuse the host's next calls."""
    task = arena.root / "task"
    task.mkdir()
    config = {"workspace": {"max_bytes": 64 * MIB}}
    async with open_plugin_host(
        arena.workspace, plugins=["python"], config=config, home=_home(arena)
    ) as host:
        async with host.open_workspace(task) as lent:
            held = await _python(host, _HOLDER, "1", lent)
            # Lives long enough for the host's watchdog to walk while it runs.
            wrote = await _python(
                host,
                "import os, time\nopen('mine', 'wb').write(os.urandom(30 << 20))\n"
                "time.sleep(1)\nprint('wrote')",
                "2",
            )
            then = await _python(host, "print('after')", "3")
    assert (task / "held").exists(), held.content
    assert not wrote.is_error and "wrote" in wrote.content, wrote.content
    assert not then.is_error and "after" in then.content, then.content
    arena.assert_nothing_seen([held.content, wrote.content, then.content])
