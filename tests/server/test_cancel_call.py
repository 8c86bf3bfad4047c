"""``cancel`` with a ``call``: one call of a running request, the rest of its batch goes on."""

from __future__ import annotations

from kernel import ToolCall
from kernel.wire import (
    CallFinishedEvent,
    CallStartedEvent,
    CallTools,
    Reply,
    Run,
    TurnFinishedEvent,
)

from .wsclient import open_test_client


async def test_one_call_of_a_batch_is_cancelled_and_the_others_finish(url: str) -> None:
    calls = (
        ToolCall("slow", "sleep", {"seconds": 30}),
        ToolCall("quick", "sleep", {"seconds": 0.2}),
    )
    async with open_test_client(url) as client:
        async with client.request(CallTools(id="b", session="one-call", calls=calls)) as exchange:
            async for event in exchange.events():
                if isinstance(event, CallStartedEvent) and event.call.id == "slow":
                    assert await client.cancel("b", call="slow")
            reply = await exchange.reply()
        assert isinstance(reply, Reply) and reply.status == "ok"
        assert reply.result is not None
        slow, quick = reply.result["observations"]
        assert slow["error"]["kind"] == "cancelled"
        assert not quick["is_error"]
        # Not running any more: not found.
        assert not await client.cancel("b", call="slow")


async def test_a_call_of_a_turn_is_cancelled_and_the_turn_goes_on(url: str) -> None:
    prompt = '/call sleep {"seconds": 30}\n/call add {"a": 1, "b": 2}'
    finished: list[TurnFinishedEvent] = []
    async with open_test_client(url) as client:
        async with client.request(Run(id="t", session="one-call-turn", prompt=prompt)) as exchange:
            async for event in exchange.events():
                if isinstance(event, CallStartedEvent) and event.call.name == "sleep":
                    assert not await client.cancel("t", call="no-such-call")
                    assert await client.cancel("t", call=event.call.id)
                if isinstance(event, CallFinishedEvent) and event.index == 0:
                    assert event.observation.error is not None
                    assert event.observation.error.kind == "cancelled"
                if isinstance(event, TurnFinishedEvent):
                    finished.append(event)
            reply = await exchange.reply()
        assert isinstance(reply, Reply) and reply.status == "ok"
        assert [f.reason for f in finished] == ["final"]
