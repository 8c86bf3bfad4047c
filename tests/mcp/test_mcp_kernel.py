"""A kernel with MCP servers: their tools beside the others, in calls and in turns."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import trio
from mcp_kit import ECHO, SERVER, light_server_args, stdio_server

from kernel import ToolCall, open_kernel, tool
from kernel.models import ScriptedModel


@tool
async def note(text: str) -> str:
    """An in-process tool."""
    await trio.sleep(0.1)
    return f"noted: {text}"


async def test_call_tools_with_mcp_tools_and_built_ins(tmp_path: Path) -> None:
    servers = {"t": stdio_server(startup_timeout=10)}
    async with open_kernel(home=tmp_path, tools=[note], plugins=[], mcp_servers=servers) as k:
        assert k.mcp is not None and k.mcp.info()[0].state == "not started"
        calls = [
            ToolCall("a", "t.sleep", {"seconds": 0.2}),
            ToolCall("b", "note", {"text": "x"}),
            ToolCall("c", "t.fail", {"message": "no"}),
        ]
        observations = await k.call_tools(k.session("s"), calls)
        assert [o.content for o in observations[:2]] == ["slept 0.2", "noted: x"]
        assert observations[2].error is not None and observations[2].error.kind == "exception"
        [info] = k.mcp.info()
        assert info.state == "running" and "t.sleep" in k.tools
        messages = await k.session("s").messages()
        assert [m.role for m in messages] == ["assistant", "tool"]


async def test_a_turn_offers_mcp_tools(tmp_path: Path) -> None:
    model = ScriptedModel(
        [
            ScriptedModel.reply(calls=[("t.echo", {"text": "hi"}), ("note", {"text": "y"})]),
            "done",
        ]
    )
    servers = {"t": stdio_server(startup_timeout=10)}
    async with open_kernel(
        home=tmp_path, model=model, tools=[note], plugins=[], mcp_servers=servers
    ) as k:
        result = await k.run_turn(k.session("s"), "go")
        assert result.text == "done"
        offered = {t.name for t in model.requests[0].tools}
        assert {"t.echo", "t.sleep", "note"} <= offered
        messages = await k.session("s").messages()
        tool_message = next(m for m in messages if m.role == "tool")
        assert [o.content for o in tool_message.observations] == ["hi", "noted: y"]


async def test_a_kernel_without_mcp_servers() -> None:
    async with open_kernel(plugins=[]) as k:
        assert k.mcp is None


def test_tak_mcp_ls(tmp_path: Path) -> None:
    """ls shows each server's state, approval and confinement; trust approves one, and
    a server not approved is never started (its line says the command to run)."""
    home = tmp_path / "home"
    (home / "config").mkdir(parents=True)
    # A plain stdio server (the subject is tak's side: tests/mcp/light_server.py).
    served = light_server_args(
        tmp_path, [ECHO, {"name": "pid", "reply": "1"}, {"name": "other", "reply": "x"}]
    )
    (home / "config/tak.toml").write_text(
        "[mcp.servers.t]\n"
        f"command = {json.dumps(sys.executable)}\n"
        f"args = {json.dumps(served)}\n"
        'tools = ["echo", "pid"]\n'
        "[mcp.servers.quits]\n"
        f"command = {json.dumps(sys.executable)}\n"
        'args = ["-c", "raise SystemExit(3)"]\n'
        "[mcp.servers.new]\n"
        f"command = {json.dumps(sys.executable)}\n"
        f"args = {json.dumps(served)}\n"
    )
    env = {**os.environ, "TAK_HOME": str(home)}
    tak = [sys.executable, "-m", "kernel.cli", "mcp"]
    for name in ("t", "quits"):
        trusted = subprocess.run([*tak, "trust", name], capture_output=True, text=True, env=env)
        assert trusted.returncode == 0, trusted.stderr
        assert trusted.stdout.startswith(f"trusted: {name}\n")
    run = [*tak, "ls"]
    text = subprocess.run(run, capture_output=True, text=True, env=env, timeout=60)
    assert text.returncode == 1, text.stderr
    assert "Traceback" not in text.stdout + text.stderr
    lines = text.stdout.splitlines()
    assert lines[0].startswith("t  stdio  running  2 tools")
    assert lines[1] == "  approval: approved"
    assert lines[2].startswith("  confinement: landlock ABI ")
    assert "t.echo" in text.stdout and "t.pid" in text.stdout
    assert any(line.startswith("quits  stdio  failed") for line in lines)
    assert any("failed to start" in line for line in lines)
    assert f"  its stderr: {home / 'data/mcp/quits.log'}" in lines
    assert "new  stdio  not approved  0 tools" in lines
    assert any(line.endswith("mcp trust new") for line in lines)

    as_json = subprocess.run([*run, "--json"], capture_output=True, text=True, env=env, timeout=60)
    servers = json.loads(as_json.stdout)
    assert [s["name"] for s in servers] == ["t", "quits", "new"]
    assert servers[0]["tools"] == ["t.echo", "t.pid"]
    assert servers[0]["approval"] == "approved" and "seccomp" in servers[0]["confinement"]
    assert servers[1]["state"] == "failed" and servers[1]["errors"]
    assert (servers[2]["state"], servers[2]["approval"]) == ("not approved", "not approved")

    untrusted = subprocess.run([*tak, "untrust", "t"], capture_output=True, text=True, env=env)
    assert (untrusted.returncode, untrusted.stdout) == (0, "untrusted: t\n")
    again = subprocess.run([*tak, "untrust", "t"], capture_output=True, text=True, env=env)
    assert (again.returncode, again.stderr) == (2, "tak mcp untrust: t was not trusted\n")


def test_a_servers_environment_is_the_sdks_without_importing_it(tmp_path: Path) -> None:
    """What a stdio server inherits is the SDK's list (kept in step by this test), and
    approving a server does not import the SDK (a second of CPU on every `tak mcp`)."""
    from mcp.client.stdio import DEFAULT_INHERITED_ENV_VARS

    from plugins._mcp import INHERITED_ENV_VARS

    assert list(INHERITED_ENV_VARS) == list(DEFAULT_INHERITED_ENV_VARS)
    probe = (
        "import sys\n"
        "from kernel.home import McpServerConfig\n"
        "from plugins._mcp import mcp_approval, server_environment\n"
        f"config = McpServerConfig(command={sys.executable!r}, args=[{SERVER!r}], env={{'K': 'v'}})\n"
        "mcp_approval('t', config)\n"
        "env = server_environment(config)\n"
        "print(sorted(env), env['K'], 'SHELLFN' in env)\n"
        "print(sorted(m for m in sys.modules if m == 'mcp' or m.startswith('mcp.')))\n"
    )
    environ = {**os.environ, "SHELLFN": "() { :; }", "SECRET_KEY": "k", "HOME": str(tmp_path)}
    environ["USER"] = "() { evil; }"
    out = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, env=environ, timeout=120
    )
    assert out.returncode == 0, out.stderr
    names, imported = out.stdout.splitlines()
    assert "SECRET_KEY" not in names and "'USER'" not in names and "'K'" in names, names
    assert names.endswith("v False"), names
    assert imported == "[]", imported
