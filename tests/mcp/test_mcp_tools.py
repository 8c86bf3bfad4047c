"""MCP servers as a tool source (plugins/_mcp.py), against real servers started here.

Each test names the guarantee of the module docstring it checks (1-5), or the
executor's (E1-E7, kernel/executor.py) that must hold for MCP tools too.
"""

from __future__ import annotations

import contextlib
import functools
import os
import signal
import sys
from collections.abc import AsyncIterator, Callable, Mapping

import pytest
import trio
from mcp_kit import SERVER, stdio_server

from kernel import BatchHandle, CallLimits, ToolCall, ToolRegistry, run_tool_calls, tool
from kernel.home import McpServerConfig
from plugins._mcp import McpServers, open_mcp_servers

#: A hang guard for a server's start, not a measurement: two confined servers importing
#: the SDK took over 10 s on a loaded 2-core machine.
STARTUP_S = 120.0


@pytest.fixture
async def servers() -> AsyncIterator[tuple[McpServers, ToolRegistry]]:
    registry = ToolRegistry([local_echo])
    configs = {
        "t": stdio_server(startup_timeout=STARTUP_S),
        "u": stdio_server(startup_timeout=STARTUP_S),
    }
    async with open_mcp_servers(configs, registry) as mcp:
        await mcp.list_tools()
        yield mcp, registry


@tool
def local_echo(text: str) -> str:
    """An in-process tool beside the MCP ones."""
    return text


async def eventually(condition: Callable[[], bool]) -> None:
    """Wait (up to 5 s) for what another task or process does to show."""
    for _ in range(250):
        if condition():
            return
        await trio.sleep(0.02)
    raise AssertionError("the condition did not come true within 5 s")


def kinds(observations: list) -> list[str | None]:  # type: ignore[type-arg]
    return [o.error.kind if o.error else None for o in observations]


async def test_tools_are_namespaced_with_the_servers_schema(servers) -> None:  # type: ignore[no-untyped-def]
    """4: NAME.tool, the server's JSON Schema as the parameters."""
    mcp, registry = servers
    assert {"t.echo", "t.sleep", "u.echo", "local_echo"} <= set(registry.names())
    echo = registry.get("t.echo")
    assert echo is not None
    assert echo.parameters["properties"]["text"]["type"] == "string"
    assert echo.parameters["required"] == ["text"]
    [t, u] = mcp.info()
    assert (t.name, t.state, t.transport, t.restarts) == ("t", "running", "stdio", 0)
    assert "t.image" in t.tools and u.state == "running"
    # A schema the kernel cannot check leaves its tool out, saying why.
    assert "t.odd_names" not in registry
    [error] = t.errors
    assert error.startswith("tool 'odd_names' left out: ")
    assert "'max-results' is not a Python identifier" in error


async def test_one_batch_across_two_servers_keeps_every_property(servers) -> None:  # type: ignore[no-untyped-def]
    """E2, E3, E4, E6: declared order, failures alone, per-call deadline, cancel by id."""
    _, registry = servers
    calls = [
        ToolCall("a", "t.sleep", {"seconds": 0.3}),
        ToolCall("b", "u.echo", {"text": "from u"}),
        ToolCall("c", "t.fail", {"message": "boom"}),
        ToolCall("d", "t.hang"),
        ToolCall("e", "t.sleep", {"seconds": 30}),
        ToolCall("f", "local_echo", {"text": "local"}),
        ToolCall("g", "t.echo", {"text": 3}),
        ToolCall("h", "t.image"),
    ]
    handle = BatchHandle()

    async def cancel_e() -> None:
        await trio.sleep(0.2)
        assert handle.cancel("e")

    async with trio.open_nursery() as nursery:
        nursery.start_soon(cancel_e)
        observations = await run_tool_calls(
            calls, registry, limits=CallLimits(timeout=1.0), handle=handle
        )
    assert [o.call_id for o in observations] == list("abcdefgh")
    assert kinds(observations) == [
        None, None, "exception", "timeout", "cancelled", None, "bad_arguments", None,
    ]  # fmt: skip
    assert observations[0].content == "slept 0.3"
    assert observations[1].content == "from u"
    assert "boom" in observations[2].content
    assert observations[6].content == "Error (bad_arguments): $.text: expected str, got int"
    assert observations[7].content == ""
    [image] = observations[7].attachments
    assert (image.kind, image.media_type, image.size) == ("image", "image/png", 66)


async def test_parallel_calls_to_one_server_run_at_once(servers) -> None:  # type: ignore[no-untyped-def]
    """1: many calls share one session, from their own tasks."""
    _, registry = servers
    # Eight calls that each answer only when all eight are in the server at once.
    calls = [ToolCall(str(i), "t.meet", {"parties": 8}) for i in range(8)]
    observations = await run_tool_calls(calls, registry)
    assert kinds(observations) == [None] * 8
    assert [o.content for o in observations] == ["met"] * 8


async def test_a_killed_server_crashes_its_calls_alone_and_restarts(servers) -> None:  # type: ignore[no-untyped-def]
    """3: calls in flight when the process dies get `crashed`; siblings are unaffected;
    the next call starts it again."""
    mcp, registry = servers
    [pid] = await run_tool_calls([ToolCall("p", "t.pid")], registry)
    first = int(pid.content)

    async def kill() -> None:
        await trio.sleep(0.3)
        os.kill(first, signal.SIGKILL)

    calls = [
        ToolCall("a", "t.sleep", {"seconds": 5}),
        ToolCall("b", "u.sleep", {"seconds": 0.6}),
        ToolCall("c", "t.sleep", {"seconds": 5}),
        ToolCall("d", "local_echo", {"text": "x"}),
    ]
    async with trio.open_nursery() as nursery:
        nursery.start_soon(kill)
        observations = await run_tool_calls(calls, registry, limits=CallLimits(timeout=4))
    assert kinds(observations) == ["crashed", None, "crashed", None]
    assert "closed the connection" in observations[0].content
    assert mcp.servers["t"].info().state == "crashed"

    [again] = await run_tool_calls([ToolCall("p", "t.pid")], registry)
    assert again.error is None and int(again.content) != first
    assert mcp.servers["t"].info().restarts == 1


async def test_a_server_dying_while_idle_is_restarted_by_the_next_call(servers) -> None:  # type: ignore[no-untyped-def]
    """3: its connection's end is seen at once; no call pays for it."""
    mcp, registry = servers
    [pid] = await run_tool_calls([ToolCall("p", "t.pid")], registry)
    os.kill(int(pid.content), signal.SIGKILL)
    await eventually(lambda: mcp.servers["t"].info().state == "crashed")
    [again] = await run_tool_calls([ToolCall("p", "t.pid")], registry)
    assert again.error is None and again.content != pid.content


async def test_the_tool_list_is_cached_until_the_server_says_it_changed(servers) -> None:  # type: ignore[no-untyped-def]
    """4: notifications/tools/list_changed: the next listing registers the new tool."""
    mcp, registry = servers
    await mcp.list_tools()  # cached: no request
    [added] = await run_tool_calls([ToolCall("a", "t.add_tool", {"name": "shout"})], registry)
    assert added.content == "added shout"
    await eventually(lambda: not mcp.servers["t"]._listed)
    await mcp.list_tools()
    [obs] = await run_tool_calls([ToolCall("s", "t.shout", {"text": "hey"})], registry)
    assert obs.content == "hey"


async def test_a_server_exiting_mid_call(servers) -> None:  # type: ignore[no-untyped-def]
    """3: the process ends by itself during a call."""
    _, registry = servers
    observations = await run_tool_calls(
        [ToolCall("a", "t.exit_now", {"after": 0.1}), ToolCall("b", "u.echo", {"text": "ok"})],
        registry,
    )
    assert kinds(observations) == ["crashed", None]
    [after] = await run_tool_calls([ToolCall("c", "t.echo", {"text": "back"})], registry)
    assert after.content == "back"


async def run_one(
    configs: Mapping[str, McpServerConfig], call: ToolCall, **limits: float
) -> tuple[str | None, str, McpServers]:
    registry = ToolRegistry()
    async with open_mcp_servers(configs, registry) as mcp:
        await mcp.list_tools_for([call.name])
        # An unknown tool is the executor's answer when the server never listed any.
        [obs] = await run_tool_calls([call], registry, limits=CallLimits(**limits))
        return (obs.error.kind if obs.error else None), obs.content, mcp


async def test_a_server_that_cannot_start_is_an_observation_then_a_backoff() -> None:
    """3: a failed start never raises into the kernel; the error is in its state."""
    config = McpServerConfig(command="/nonexistent/mcp-server", startup_timeout=5)
    registry = ToolRegistry()
    async with open_mcp_servers({"gone": config}, registry) as mcp:
        await mcp.list_tools()  # recorded, not raised
        [info] = mcp.info()
        assert info.state == "failed" and info.tools == ()
        assert "failed to start" in info.errors[0]
        with pytest.raises(Exception, match="next try in"):
            await mcp.servers["gone"].call("gone.echo", {"text": "x"})


async def test_a_server_that_does_not_greet_in_time() -> None:
    """3: startup_timeout bounds the start."""
    config = McpServerConfig(
        command=sys.executable, args=["-c", "import time; time.sleep(3600)"], startup_timeout=0.5
    )
    registry = ToolRegistry()
    with trio.fail_after(120):  # a hang guard: the server would take an hour to greet
        async with open_mcp_servers({"slow": config}, registry) as mcp:
            await mcp.list_tools()
            [info] = mcp.info()
    assert info.state == "failed"
    assert info.errors == ("did not start within 0.5 s",)


async def test_closing_leaves_no_child_process() -> None:
    """5: leaving open_mcp_servers ends every server, in bounded time."""
    registry = ToolRegistry()
    pids = []
    # t.hang never answers: a close that waited for it would hang (a hang guard).
    with trio.fail_after(120):
        async with open_mcp_servers({"t": stdio_server(), "u": stdio_server()}, registry) as mcp:
            await mcp.list_tools()
            for name in ("t", "u"):
                [obs] = await run_tool_calls([ToolCall("p", f"{name}.pid")], registry)
                pids.append(int(obs.content))
            # A call still running when the kernel closes does not hold the close.
            async with trio.open_nursery() as nursery:
                nursery.start_soon(run_tool_calls, [ToolCall("h", "t.hang")], registry)
                await trio.sleep(0.2)
                nursery.cancel_scope.cancel()
            assert [s.state for s in mcp.info()] == ["running", "running"]
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


async def test_allow_list_and_explicit_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """4: `tools` picks the tools; a stdio server sees its `env`, not the kernel's."""
    monkeypatch.setenv("TAK_TEST_SECRET", "kernel-only")
    config = stdio_server(tools=["env", "echo", "nope"], env={"TAK_TEST_GIVEN": "given"})
    registry = ToolRegistry()
    async with open_mcp_servers({"t": config}, registry) as mcp:
        await mcp.list_tools()
        assert registry.names() == ["t.echo", "t.env"]
        assert mcp.info()[0].errors == ("tool 'nope' (in tools) is not offered by the server",)
        observations = await run_tool_calls(
            [
                ToolCall("a", "t.env", {"name": "TAK_TEST_GIVEN"}),
                ToolCall("b", "t.env", {"name": "TAK_TEST_SECRET"}),
            ],
            registry,
        )
    assert [o.content for o in observations] == ["given", ""]


async def test_eager_start_lists_at_open() -> None:
    """2: start = "eager" starts and lists before open_mcp_servers yields."""
    registry = ToolRegistry()
    async with open_mcp_servers({"t": stdio_server(start="eager", tools=["echo"])}, registry) as m:
        assert registry.names() == ["t.echo"]
        assert m.info()[0].state == "running"


async def test_lazy_servers_start_on_first_need() -> None:
    """2: nothing runs until a call (or a turn) needs the server's tools."""
    registry = ToolRegistry()
    async with open_mcp_servers({"t": stdio_server()}, registry) as mcp:
        assert mcp.info()[0].state == "not started" and registry.names() == []
        await mcp.list_tools_for(["t.echo", "other"])
        assert mcp.info()[0].state == "running" and "t.echo" in registry


async def test_per_call_timeout_of_the_server(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """3: `timeout` is each call's deadline (over the batch's)."""
    registry = ToolRegistry()
    async with open_mcp_servers({"t": stdio_server(timeout=0.5)}, registry) as mcp:
        await mcp.list_tools()
        [obs] = await run_tool_calls([ToolCall("h", "t.hang")], registry)
        assert obs.error is not None and obs.error.kind == "timeout"
        assert "0.5 s" in obs.content, obs.content  # the server's deadline, not the batch's
        # The server still answers a ping: it stays; the next call works.
        [ok] = await run_tool_calls([ToolCall("e", "t.echo", {"text": "x"})], registry)
        assert ok.content == "x" and mcp.info()[0].restarts == 0


async def test_a_server_that_stops_answering_is_restarted(monkeypatch: pytest.MonkeyPatch) -> None:
    """3: after a timeout, a server that does not answer a ping is started again."""
    monkeypatch.setattr("plugins._mcp.PING_TIMEOUT", 0.3)
    registry = ToolRegistry()
    async with open_mcp_servers({"t": stdio_server(startup_timeout=STARTUP_S)}, registry) as mcp:
        await mcp.list_tools()
        [pid] = await run_tool_calls([ToolCall("p", "t.pid")], registry)
        os.kill(int(pid.content), signal.SIGSTOP)  # alive, deaf
        try:
            [obs] = await run_tool_calls(
                [ToolCall("e", "t.echo", {"text": "x"})], registry, limits=CallLimits(timeout=0.3)
            )
            assert obs.error is not None and obs.error.kind == "timeout"
            [again] = await run_tool_calls([ToolCall("p", "t.pid")], registry)
        finally:
            with contextlib.suppress(ProcessLookupError):  # killed by the restart
                os.kill(int(pid.content), signal.SIGCONT)
        assert again.error is None and again.content != pid.content
        assert mcp.info()[0].restarts == 1


async def test_over_streamable_http(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """1, 4: the same tools over streamable HTTP (hypercorn's Trio worker, 127.0.0.1)."""
    with trio.socket.socket() as sock:
        await sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    async with trio.open_nursery() as nursery:
        command = [sys.executable, SERVER, "--http", str(port)]
        process = await nursery.start(functools.partial(trio.run_process, command, check=False))
        try:
            with trio.fail_after(STARTUP_S):
                while True:
                    try:
                        stream = await trio.open_tcp_stream("127.0.0.1", port)
                    except OSError:
                        await trio.sleep(0.05)
                    else:
                        await stream.aclose()
                        break
            config = McpServerConfig(url=f"http://127.0.0.1:{port}/mcp", startup_timeout=STARTUP_S)
            registry = ToolRegistry()
            async with open_mcp_servers({"web": config}, registry) as mcp:
                calls = [ToolCall(str(i), "web.meet", {"parties": 6}) for i in range(6)]
                calls.append(ToolCall("f", "web.fail", {"message": "over http"}))
                await mcp.list_tools()
                assert mcp.info()[0].transport == "http"
                observations = await run_tool_calls(calls, registry)
                assert kinds(observations) == [None] * 6 + ["exception"]
                assert [o.content for o in observations[:6]] == ["met"] * 6  # at once
                assert "over http" in observations[-1].content
        finally:
            process.terminate()
