"""The plugin host: loading, namespacing, workers, denials, crashes, context."""

from __future__ import annotations

import json
import logging
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

from kernel import ToolCall, open_kernel
from kernel.executor import run_tool_calls
from kernel.plugin import use_context
from kernel.testing import plugin_harness
from plugins import open_plugin_host
from tests.plugins.fixture_kit import fixture_plugin, import_fixture


async def test_bad_plugins_are_reported_and_skipped(workspace: Path) -> None:
    names = ["crash_on_import", "duplicate_tools", "bad_schema", "weather"]
    async with open_plugin_host(workspace, plugins=[fixture_plugin(n) for n in names]) as host:
        assert [p.name for p in host.plugins] == ["weather"]
        reasons = {Path(e.source.target).stem: e.reason for e in host.errors}
        assert "RuntimeError: this plugin crashes on import" in reasons["crash_on_import"]
        assert "two tools are named 'look'" in reasons["duplicate_tools"]
        assert "parameter 'values'" in reasons["bad_schema"]
        [observation] = await run_tool_calls(
            [ToolCall("1", "forecast", {"city": "Oslo"}, 0)], host.tools
        )
        assert observation.content == "sunny in Oslo"


async def test_a_taken_name_is_namespaced(workspace: Path) -> None:
    plugins = [fixture_plugin("weather"), fixture_plugin("climate")]
    async with open_plugin_host(workspace, plugins=plugins) as host:
        assert host.tools.names() == ["forecast", "climate.forecast"]
        assert dict(host.plugins[1].tools) == {"climate.forecast": "forecast"}
        observations = await run_tool_calls(
            [
                ToolCall("1", "forecast", {"city": "Oslo"}, 0),
                ToolCall("2", "climate.forecast", {"city": "Oslo"}, 1),
            ],
            host.tools,
        )
    assert [o.content for o in observations] == ["sunny in Oslo", "temperate in Oslo"]


async def test_a_namespaced_name_too_long_skips_that_plugin_only(workspace: Path) -> None:
    from kernel import Plugin

    mine = Plugin("short")
    long = Plugin("p" * 60)
    for plugin in (mine, long):

        @plugin.tool(name="read")
        def read() -> str:
            """Read."""
            return "r"

    async with open_plugin_host(workspace, plugins=[mine, long]) as host:
        assert host.tools.names() == ["read"]
        [error] = host.errors
    assert "not a valid tool name" in error.reason


@pytest.fixture
def listening_port() -> Iterator[int]:
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        yield server.getsockname()[1]


async def test_each_undeclared_permission_is_denied_by_name(
    workspace: Path, listening_port: int
) -> None:
    async with plugin_harness(fixture_plugin("misbehave"), workspace) as h:
        assert h.plugin.isolation.startswith("worker")
        network, spawn, write, via_workspace, outside = await h.call_many(
            [
                ("connect", {"port": listening_port}),
                ("spawn", {}),
                ("write", {"name": "x.txt"}),
                ("write_via_workspace", {"name": "y.txt"}),
                ("read_outside", {}),
            ]
        )
    assert network.error is not None and network.error.kind == "denied"
    assert "needs permission network" in network.content
    assert spawn.error is not None and spawn.error.kind == "denied"
    assert "needs permission subprocess" in spawn.content
    assert write.error is not None and write.error.kind == "denied"
    assert "x.txt: needs permission workspace: write" in write.content
    assert via_workspace.error is not None and via_workspace.error.kind == "denied"
    assert "needs permission workspace: write" in via_workspace.content
    assert outside.error is not None and outside.error.kind == "denied"
    assert "outside the workspace" in outside.content
    assert not (workspace / "x.txt").exists() and not (workspace / "y.txt").exists()


async def test_a_segfault_is_crashed_and_the_others_keep_working(workspace: Path) -> None:
    plugins = [fixture_plugin("misbehave"), fixture_plugin("weather")]
    async with open_plugin_host(workspace, plugins=plugins) as host:
        crashed, other = await run_tool_calls(
            [ToolCall("1", "segfault", {}, 0), ToolCall("2", "forecast", {"city": "Rome"}, 1)],
            host.tools,
        )
        assert crashed.error is not None and crashed.error.kind == "crashed"
        assert "SIGSEGV" in crashed.content
        assert other.content == "sunny in Rome"
        # The plugin's worker starts again for its next call.
        [again] = await run_tool_calls([ToolCall("3", "ping", {}, 0)], host.tools)
        assert again.content == "pong"


async def test_a_hang_is_a_timeout_and_the_others_keep_working(workspace: Path) -> None:
    plugins = [fixture_plugin("misbehave"), fixture_plugin("weather")]
    async with open_plugin_host(workspace, plugins=plugins) as host:
        hung, other = await run_tool_calls(
            [ToolCall("1", "hang", {}, 0), ToolCall("2", "forecast", {"city": "Rome"}, 1)],
            host.tools,
        )
        assert hung.error is not None and hung.error.kind == "timeout"
        assert other.content == "sunny in Rome"
        [again] = await run_tool_calls([ToolCall("3", "ping", {}, 0)], host.tools)
        assert again.content == "pong"


async def test_workers_get_session_config_and_a_logger_to_the_kernel_log(
    workspace: Path, caplog: pytest.LogCaptureFixture
) -> None:
    config = {"plugins": {"misbehave": {"units": "metric"}}}
    caplog.set_level(logging.INFO, logger="tak.plugin")
    async with open_plugin_host(
        workspace, plugins=[fixture_plugin("misbehave")], config=config
    ) as host:
        with use_context(host.context("proj/s1")):
            [observation] = await run_tool_calls([ToolCall("1", "whoami", {}, 0)], host.tools)
    assert json.loads(observation.content) == {
        "session": "proj/s1",
        "config": {"units": "metric"},
        "workspace": True,
    }
    assert any(
        r.name == "tak.plugin.misbehave" and r.getMessage() == "whoami called in proj/s1"
        for r in caplog.records
    )


async def test_the_kernel_sets_the_session_for_in_process_and_worker_tools(
    tmp_path: Path,
) -> None:
    inproc = import_fixture("inproc").plugin
    async with open_kernel(
        home=tmp_path / "home", plugins=[inproc, fixture_plugin("misbehave"), "fs"]
    ) as k:
        assert {"where", "whoami", "read_file"} <= set(k.tools.names())
        session = k.session("s1", project="p")
        where, whoami = await k.call_tools(
            session, [ToolCall("a", "where", {}, 0), ToolCall("b", "whoami", {}, 1)]
        )
    assert json.loads(where.content)["session"] == "p/s1"
    assert json.loads(where.content)["logger"] == "tak.plugin.inproc"
    assert json.loads(whoami.content)["session"] == "p/s1"


async def test_third_party_plugins_never_run_in_process(workspace: Path) -> None:
    async with open_plugin_host(workspace, plugins=[fixture_plugin("inproc")]) as host:
        assert host.plugins[0].isolation.startswith("worker")
        [observation] = await run_tool_calls([ToolCall("1", "where", {}, 0)], host.tools)
    assert json.loads(observation.content)["logger"] == "tak.plugin.inproc"


async def test_fail_closed_without_isolation(workspace: Path) -> None:
    from sandbox import IsolationSupport

    none = IsolationSupport(
        landlock_abi=0, seccomp=False, openat2=True, uid=0, capabilities=0, process_limit="none"
    )
    async with open_plugin_host(
        workspace, plugins=[fixture_plugin("weather"), "fs"], isolation=none
    ) as host:
        assert [p.name for p in host.plugins] == ["fs"]  # in process: the Workspace confines it
        assert "Landlock is not available" in host.errors[0].reason
