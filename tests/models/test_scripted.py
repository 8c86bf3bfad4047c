"""The scripted model: canned answers, functions, replay, and the named scripts."""

from __future__ import annotations

import pytest
import trio
import trio.testing

from kernel.errors import UsageError
from kernel.messages import Message, Text, ToolCall, ToolError
from kernel.models import (
    ModelRequest,
    ModelResponse,
    ProviderError,
    ResponseComplete,
    ScriptedModel,
    TextDelta,
    ToolCallDelta,
    resolve_model,
)

from .wire import collect, final, tool_results, user


async def test_reply_builds_calls_and_streams_them() -> None:
    model = ScriptedModel(
        [
            ScriptedModel.reply(
                "Reading two files.",
                calls=[("fs.read", {"path": "a"}), ("fs.read", '{"path": "b"}')],
            ),
            "Both read.",
        ]
    )
    request = ModelRequest((user("go"),))
    events = await collect(model, request)

    assert events[:3] == [TextDelta("Reading"), TextDelta(" two"), TextDelta(" files.")]
    assert events[3:5] == [
        ToolCallDelta(0, "call_0", "fs.read", '{"path": "a"}'),
        ToolCallDelta(1, "call_1", "fs.read", '{"path": "b"}'),
    ]
    response = final(events)
    assert response.message.parts == (
        Text("Reading two files."),
        ToolCall("call_0", "fs.read", {"path": "a"}, 0),
        ToolCall("call_1", "fs.read", '{"path": "b"}', 1),
    )
    assert response.stop_reason == "tool_use"

    answer = await model.complete(request)
    assert (answer.message.text, answer.stop_reason) == ("Both read.", "end_turn")
    assert model.requests == [request, request]


async def test_a_function_answers_every_request_sync_or_async() -> None:
    async def count_messages(request: ModelRequest) -> str:
        await trio.lowlevel.checkpoint()
        return f"{len(request.messages)} message(s)"

    model = ScriptedModel(count_messages)
    assert (await model.complete(ModelRequest((user("a"),)))).message.text == "1 message(s)"
    assert (
        await model.complete(ModelRequest((user("a"), user("b"))))
    ).message.text == "2 message(s)"

    steps = ScriptedModel([lambda r: ScriptedModel.reply(r.messages[-1].text.upper())])
    assert (await steps.complete(ModelRequest((user("shout"),)))).message.text == "SHOUT"


async def test_running_out_of_script_is_a_usage_error() -> None:
    model = ScriptedModel(["only one"])
    await model.complete(ModelRequest((user("a"),)))
    with pytest.raises(UsageError, match="has 1 scripted responses and was asked for response 2"):
        await model.complete(ModelRequest((user("a"),)))


def test_a_lone_string_is_not_a_script() -> None:
    with pytest.raises(UsageError, match=r"ScriptedModel\(\['hi'\]\)"):
        ScriptedModel("hi")


async def test_an_exception_step_is_raised() -> None:
    overloaded = ProviderError("anthropic", "Overloaded", status=529, retryable=True)
    model = ScriptedModel([overloaded, "recovered"])
    with pytest.raises(ProviderError, match="Overloaded"):
        async with model.stream(ModelRequest((user("a"),))) as events:
            async for _ in events:
                pass
    assert (await model.complete(ModelRequest((user("a"),)))).message.text == "recovered"


async def test_ids_used_earlier_in_the_conversation_get_a_turn_suffix() -> None:
    turn = ScriptedModel.reply(calls=[("calc", {"expr": "1"})])
    model = ScriptedModel([turn, turn])
    first = await model.complete(ModelRequest((user("a"),)))
    history = (user("a"), first.message, tool_results(first.message.tool_calls, ["1"]))
    second = await model.complete(ModelRequest(history))
    assert first.message.tool_calls[0].id == "call_0"
    assert second.message.tool_calls[0].id == "call_0-t1"


async def test_from_messages_replays_a_recorded_conversation() -> None:
    calls = (ToolCall("toolu_9", "fs.read", '{"path": "x"}', 0),)
    recorded = [
        user("go"),
        Message("assistant", (Text("Reading."), *calls)),
        tool_results(calls, ["x"]),
        Message("assistant", (Text("Done."),)),
    ]
    model = ScriptedModel.from_messages(recorded)
    first = await model.complete(ModelRequest(tuple(recorded[:1])))
    second = await model.complete(ModelRequest(tuple(recorded[:3])))
    assert first.message == recorded[1]
    assert second.message == recorded[3]
    assert model.name == "scripted:replay"


async def test_stream_can_be_cancelled_between_chunks(
    autojump_clock: trio.testing.MockClock,
) -> None:
    model = ScriptedModel(["one two three four"], chunk_delay=1.0)
    seen: list[object] = []
    with trio.move_on_after(2.5):
        async with model.stream(ModelRequest((user("a"),))) as events:
            async for event in events:
                seen.append(event)
    assert seen == [TextDelta("one"), TextDelta(" two")]


async def test_demo_script_calls_the_tools_a_prompt_names_then_reports() -> None:
    model = resolve_model("scripted:demo")
    prompt = user(
        'Please:\n/call fs.read {"path": "notes.md"}\n/call web.fetch not json\n/call calc'
    )
    first = await model.complete(ModelRequest((prompt,)))
    assert first.message.tool_calls == (
        ToolCall("call_0", "fs.read", {"path": "notes.md"}, 0),
        ToolCall("call_1", "web.fetch", "not json", 1),
        ToolCall("call_2", "calc", {}, 2),
    )
    results = tool_results(
        first.message.tool_calls,
        ["# Notes\nline two", ToolError("bad_arguments", "ArgumentError", "not JSON"), "4"],
    )
    report = await model.complete(ModelRequest((prompt, first.message, results)))
    assert report.message.text == (
        "3 call(s) finished:\n"
        "- fs.read: ok (16 chars) # Notes\n"
        "- web.fetch: failed: Error (bad_arguments): not JSON\n"
        "- calc: ok (1 chars) 4"
    )
    assert report.stop_reason == "end_turn"


async def test_echo_script() -> None:
    model = resolve_model("scripted:echo")
    events = await collect(model, ModelRequest((user("hello there"),)))
    assert isinstance(events[-1], ResponseComplete)
    assert final(events).message.text == "You said: hello there"
    assert model.name == "scripted:echo"


def test_a_response_must_be_an_assistant_message() -> None:
    with pytest.raises(ValueError, match="role 'assistant'"):
        ModelResponse(user("hi"))


async def test_only_the_latest_requests_are_kept() -> None:
    model = ScriptedModel(lambda request: "ok", keep_requests=3)
    requests = [ModelRequest((user(f"q{i}"),)) for i in range(10)]
    for request in requests:
        await model.complete(request)
    assert model.requests == requests[-3:]
    assert ScriptedModel(lambda request: "ok").requests == []
    with pytest.raises(UsageError):
        ScriptedModel(["a"], keep_requests=-1)


async def test_scripted_steps_are_served_in_order_past_the_kept_requests() -> None:
    model = ScriptedModel(["a", "b", "c"], keep_requests=1)
    answers = [(await model.complete(ModelRequest((user("q"),)))).message.text for _ in range(3)]
    assert answers == ["a", "b", "c"]
    assert len(model.requests) == 1


async def test_call_ids_stay_unique_across_turns_of_one_conversation() -> None:
    model = ScriptedModel(lambda request: ScriptedModel.reply(calls=[("t", {})]))
    history: list[Message] = [user("go")]
    seen = []
    for _ in range(3):
        response = await model.complete(ModelRequest(tuple(history)))
        seen += [c.id for c in response.message.tool_calls]
        calls = response.message.tool_calls
        history += [response.message, tool_results(calls, ["r"] * len(calls))]
    assert len(set(seen)) == 3
