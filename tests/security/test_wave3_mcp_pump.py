"""Third wave, class 6: a stdio MCP server attacking the kernel through its stdout.

A hostile server (tests/mcp/hostile_server.py: its tool runs the code it is given,
confined) writes on its protocol pipe what no honest server sends: a line past
``MAX_LINE_BYTES`` in one write, in a slow drip of small writes, or as a
well-formed JSON-RPC message. Each attempt is refused when the server is stopped
at the bound, named, with the call failing ``crashed`` at once (not at its
deadline, which is what a kernel buffering without bound gave: it waited for
the newline), and the server usable again on the next call.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from kernel import ToolCall, ToolRegistry, run_tool_calls
from kernel.executor import CallLimits
from kernel.home import McpServerConfig
from plugins._mcp import MAX_LINE_BYTES, open_mcp_servers
from sandbox import landlock, seccomp

pytestmark = pytest.mark.skipif(
    landlock.abi_version() < 6 or not seccomp.available(),
    reason="needs Landlock with TCP rules and scopes (ABI 6+) and seccomp",
)

HOSTILE = str(Path(__file__).parents[1] / "mcp" / "hostile_server.py")

#: The server's protocol pipe (the SDK moved it off fd 1): the one pipe it writes to.
WIRE = (
    "import fcntl, os, stat, time\n"
    "def writes_pipe(fd):\n"
    "    try:\n"
    "        mode, flags = os.fstat(fd).st_mode, fcntl.fcntl(fd, fcntl.F_GETFL)\n"
    "    except OSError:\n"
    "        return False\n"
    "    return stat.S_ISFIFO(mode) and flags & os.O_ACCMODE == os.O_WRONLY\n"
    "wire = next(fd for fd in range(3, 1024) if writes_pipe(fd))\n"
)
PAST = MAX_LINE_BYTES + 1


async def attempt(tmp_path: Path, attack: str) -> None:
    """Run ``attack`` (after ``WIRE``) in the hostile server; assert it was refused."""
    workspace = tmp_path / "ws"
    workspace.mkdir()
    config = McpServerConfig(command=sys.executable, args=[HOSTILE], startup_timeout=30)
    registry = ToolRegistry()
    async with open_mcp_servers({"evil": config}, registry, workspace=workspace) as mcp:
        await mcp.list_tools_for(["evil.probe"])
        [obs] = await run_tool_calls(
            [ToolCall("1", "evil.probe", {"code": WIRE + attack})],
            registry,
            limits=CallLimits(timeout=120),
        )
        said = f"MCP server 'evil' sent a line longer than {MAX_LINE_BYTES} bytes: it was stopped"
        assert obs.error is not None and obs.error.kind == "crashed", obs.content
        assert obs.content.startswith(f"Error (crashed): {said}"), obs.content
        [info] = mcp.info()
        assert said in info.errors, info
        [again] = await run_tool_calls(
            [ToolCall("2", "evil.probe", {"code": "result = 'fresh'"})], registry
        )
        assert (again.error, again.content) == (None, "fresh")


async def test_wave3_a_line_past_the_bound_never_ended(tmp_path: Path) -> None:
    await attempt(tmp_path, f"os.write(wire, b'x' * {PAST})\ntime.sleep(600)\n")


async def test_wave3_a_line_past_the_bound_in_a_drip_of_small_writes(tmp_path: Path) -> None:
    drip = (
        "piece = b'y' * 4096\n"
        f"for _ in range({PAST // 4096 + 1}):\n"
        "    os.write(wire, piece)\n"
        "time.sleep(600)\n"
    )
    await attempt(tmp_path, drip)


async def test_wave3_a_well_formed_message_past_the_bound(tmp_path: Path) -> None:
    """A JSON-RPC notification with a 32 MiB string, newline and all: never parsed."""
    message = (
        "import json\n"
        "note = {'jsonrpc': '2.0', 'method': 'notifications/message',"
        f" 'params': {{'level': 'info', 'data': 'z' * {PAST}}}}}\n"
        "os.write(wire, json.dumps(note).encode() + b'\\n')\n"
        "time.sleep(600)\n"
    )
    await attempt(tmp_path, message)
