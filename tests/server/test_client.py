"""kernel.wire.open_client: typed requests, events and results against a real server."""

from __future__ import annotations

import subprocess
import sys

import pytest
import trio

from kernel import Kernel, Observation, ToolCall, converter
from kernel.wire import (
    CallFinishedEvent,
    CallStartedEvent,
    CallTools,
    ConnectionLost,
    EventData,
    HandshakeRefused,
    ModelDeltaEvent,
    Reply,
    RequestFailed,
    Run,
    ServerLimits,
    TurnFinishedEvent,
    wire_converter,
)

from .wsclient import TOKEN, bare, open_test_client, running_server


async def test_call_tools_gives_typed_events_and_observations(url: str) -> None:
    events: list[EventData] = []
    async with open_test_client(url) as client:
        assert (client.info.server, client.info.model) == ("tak", "scripted:demo")
        result = await client.call_tools(
            "typed",
            [ToolCall("a", "add", {"a": 2, "b": 40}), ToolCall("b", "divide", {"a": 1, "b": 0})],
            on_event=events.append,
        )
    assert [o.content for o in result.observations] == [
        "42",
        "Error (exception): float division by zero",
    ]
    assert all(isinstance(o, Observation) for o in result.observations)
    started = [e for e in events if isinstance(e, CallStartedEvent)]
    finished = [e for e in events if isinstance(e, CallFinishedEvent)]
    assert sorted(e.call.name for e in started) == ["add", "divide"]
    assert {e.index: e.observation.is_error for e in finished} == {0: False, 1: True}


async def test_a_run_streams_its_events_then_its_reply(url: str) -> None:
    async with open_test_client(url) as client:
        request = Run(id=client.new_id(), session="typed", prompt="hello")
        async with client.request(request) as run:
            events = [event async for event in run.events()]
            reply = await run.reply()
        assert isinstance(reply, Reply) and reply.status == "ok"
        text = "".join(e.text for e in events if isinstance(e, ModelDeltaEvent))
        assert text == "You said: hello"
        assert isinstance(events[-1], TurnFinishedEvent) and events[-1].reason == "final"
        result = await client.run("typed", "again")
        assert (result.session, result.reason, result.text) == ("typed", "final", "You said: again")


async def test_sessions_history_and_tools_are_records(url: str) -> None:
    async with open_test_client(url) as client:
        await client.call_tools("h", [ToolCall("a", "add", {"a": 1, "b": 2})])
        sessions = await client.sessions()
        history = await client.history("h")
        tools = await client.tools()
    assert [(s.session_id, s.data.entry_count > 0) for s in sessions.sessions] == [("h", True)]
    assert history.entries and all("uuid" in e for e in history.entries)
    assert {"add", "divide", "echo", "sleep"} <= {t["name"] for t in tools.tools}


async def test_cancel_while_a_request_streams(url: str) -> None:
    async with open_test_client(url) as client:
        sleepy = CallTools(
            id="sleepy", session="c", calls=(ToolCall("s", "sleep", {"seconds": 30}),)
        )
        async with client.request(sleepy) as exchange:
            async for event in exchange.events():
                if isinstance(event, CallStartedEvent):
                    assert await client.cancel("sleepy")
            reply = await exchange.reply()
        assert isinstance(reply, Reply) and reply.status == "cancelled"
        assert not await client.cancel("sleepy")
        failed: list[RequestFailed] = []

        async def sleep_call() -> None:
            with pytest.raises(RequestFailed) as caught:
                await client.call_tools("c", [ToolCall("s", "sleep", {"seconds": 30})])
            failed.append(caught.value)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(sleep_call)
            await trio.sleep(0.2)
            # the ids so far: hello1, cancel2, cancel3; so the call is r4
            assert await client.cancel("r4")
    assert (failed[0].status, str(failed[0])) == ("cancelled", "request 'r4': cancelled")


async def test_a_refused_request_raises_request_failed_with_the_servers_code(url: str) -> None:
    async with open_test_client(url) as client:
        with pytest.raises(RequestFailed, match=r"\(invalid_request\)") as caught:
            await client.history("h", after="no-such-uuid")
    assert caught.value.error is not None and caught.value.error.code == "invalid_request"


async def test_a_wrong_token_is_refused_in_the_handshake_or_in_hello(url: str) -> None:
    with pytest.raises(HandshakeRefused, match="refused: HTTP 401 wrong token") as caught:
        async with open_test_client(url.replace(TOKEN, "wrong")):
            pass
    assert caught.value.status_code == 401
    with pytest.raises(RequestFailed, match=r"\(unauthorized\): wrong token"):
        async with open_test_client(bare(url), token="wrong"):
            pass
    async with open_test_client(bare(url), token=TOKEN) as client:
        assert client.info.protocol == 1


async def test_a_closed_connection_ends_requests_with_connection_lost(kernel: Kernel) -> None:
    async with running_server(kernel, limits=ServerLimits(idle_timeout=0.3)) as url:
        async with open_test_client(url) as client:
            await client.wait_closed()
            assert client.closed == "1000 idle for 0.3 s"
            with pytest.raises(ConnectionLost):
                await client.tools()


def test_the_protocol_has_its_own_converter() -> None:
    """Hooks go on a copy: the shared converter still writes every field of a record."""
    assert wire_converter is not converter
    assert wire_converter.unstructure(Reply(re="r", status="cancelled")) == {
        "v": 1,
        "re": "r",
        "status": "cancelled",
        "seq": 0,
    }
    assert converter.unstructure(Reply(re="r", status="cancelled"))["error"] is None


def test_the_copy_structures_string_arguments_in_a_fresh_interpreter() -> None:
    """cattrs' own ``copy()`` drops union hooks; the kernel's converter keeps them."""
    frame = (
        '{"v":1,"type":"call_tools","id":"a","session":"s",'
        '"calls":[{"id":"c","name":"x","arguments":"{}"}]}'
    )
    code = f"from kernel.wire import decode_request; print(decode_request({frame!r}).calls)"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout
    assert "arguments='{}'" in out
