"""Anthropic Messages over a fake transport, with payloads shaped as Anthropic documents them."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
import trio

from kernel.messages import Message, Text, ToolCall, ToolError
from kernel.models import AnthropicModel, ModelRequest, ProviderError, RetryPolicy, TextDelta

from .wire import (
    NO_RETRY,
    TOOLS,
    FakeServer,
    collect,
    final,
    json_response,
    sse,
    sse_response,
    tool_results,
    user,
)


def event(data: dict[str, Any]) -> str:
    return sse(data, event=data["type"])


MESSAGE_START = event(
    {
        "type": "message_start",
        "message": {
            "id": "msg_01XFDUDYJgAACzvnptvVoYEL",
            "type": "message",
            "role": "assistant",
            "model": "claude-sonnet-4-5-20250929",
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": {
                "input_tokens": 472,
                "cache_creation_input_tokens": 0,
                "cache_read_input_tokens": 2000,
                "output_tokens": 2,
            },
        },
    }
)


def block_start(index: int, block: dict[str, Any]) -> str:
    return event({"type": "content_block_start", "index": index, "content_block": block})


def block_delta(index: int, delta: dict[str, Any]) -> str:
    return event({"type": "content_block_delta", "index": index, "delta": delta})


def block_stop(index: int) -> str:
    return event({"type": "content_block_stop", "index": index})


def message_end(stop_reason: str, output_tokens: int) -> str:
    return event(
        {
            "type": "message_delta",
            "delta": {"stop_reason": stop_reason, "stop_sequence": None},
            "usage": {"output_tokens": output_tokens},
        }
    ) + event({"type": "message_stop"})


def json_delta(index: int, fragment: str) -> str:
    return block_delta(index, {"type": "input_json_delta", "partial_json": fragment})


TWO_TOOL_USES = "".join(
    [
        MESSAGE_START,
        block_start(0, {"type": "text", "text": ""}),
        sse({"type": "ping"}, event="ping"),
        block_delta(0, {"type": "text_delta", "text": "I'll read"}),
        block_delta(0, {"type": "text_delta", "text": " both files."}),
        block_stop(0),
        block_start(1, {"type": "tool_use", "id": "toolu_01A", "name": "fs__read", "input": {}}),
        json_delta(1, ""),
        json_delta(1, '{"path": "a'),
        json_delta(1, '.md"}'),
        block_stop(1),
        block_start(2, {"type": "tool_use", "id": "toolu_01B", "name": "calc", "input": {}}),
        json_delta(2, '{"expr"'),
        json_delta(2, ': "6*7"}'),
        block_stop(2),
        message_end("tool_use", 89),
    ]
)


def model(client: httpx.AsyncClient, **options: Any) -> AnthropicModel:
    options.setdefault("retry", NO_RETRY)
    return AnthropicModel("claude-sonnet-4-5", client=client, api_key="sk-ant-test", **options)


def first_request() -> ModelRequest:
    return ModelRequest((user("Read a.md and compute."),), system="Be brief.", tools=TOOLS)


async def test_two_tool_use_blocks_stream_into_two_calls() -> None:
    server = FakeServer(sse_response(TWO_TOOL_USES, chunk_size=11))
    async with server.client() as client:
        events = await collect(model(client), first_request())

    response = final(events)
    assert response.message.parts == (
        Text("I'll read both files."),
        ToolCall("toolu_01A", "fs.read", '{"path": "a.md"}', 0),
        ToolCall("toolu_01B", "calc", '{"expr": "6*7"}', 1),
    )
    assert (response.stop_reason, response.raw_stop_reason) == ("tool_use", "tool_use")
    assert response.model == "claude-sonnet-4-5-20250929"
    usage = response.usage
    assert (usage.input_tokens, usage.cache_read_tokens, usage.output_tokens) == (472, 2000, 89)
    assert usage.cost_usd == pytest.approx((472 * 3 + 2000 * 0.3 + 89 * 15) / 1e6)
    assert [e.text for e in events if isinstance(e, TextDelta)] == ["I'll read", " both files."]

    request = server.requests[0]
    assert request.url == "https://api.anthropic.com/v1/messages"
    assert request.headers["x-api-key"] == "sk-ant-test"
    assert request.headers["anthropic-version"] == "2023-06-01"
    body = server.body(0)
    assert body["stream"] is True
    assert body["system"] == "Be brief."
    assert body["max_tokens"] == 4096  # kernel.settings.DEFAULT_MAX_TOKENS
    assert [t["name"] for t in body["tools"]] == ["fs__read", "web__fetch", "calc"]
    assert body["tools"][0]["input_schema"] == TOOLS[0].parameters


async def test_follow_up_puts_every_tool_result_first_with_is_error() -> None:
    server = FakeServer(
        sse_response(TWO_TOOL_USES),
        sse_response(
            MESSAGE_START
            + block_start(0, {"type": "text", "text": ""})
            + block_delta(0, {"type": "text_delta", "text": "It is 42."})
            + block_stop(0)
            + message_end("end_turn", 5)
        ),
    )
    async with server.client() as client:
        m = model(client)
        first = final(await collect(m, first_request()))
        results = tool_results(
            first.message.tool_calls,
            [ToolError("timeout", "Timeout", "took longer than 30 s"), "42"],
        )
        # A user message right after the results joins them, after the tool_result blocks.
        follow_up = ModelRequest(
            (user("Read a.md and compute."), first.message, results, user("Also: hurry.")),
            system="Be brief.",
            tools=TOOLS,
            max_tokens=1000,
        )
        answer = final(await collect(m, follow_up))

    assert answer.message.text == "It is 42."
    assert answer.stop_reason == "end_turn"
    body = server.body(1)
    del body["tools"]
    assert body == {
        "model": "claude-sonnet-4-5",
        "max_tokens": 1000,
        "system": "Be brief.",
        "stream": True,
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "Read a.md and compute."}]},
            {
                "role": "assistant",
                "content": [
                    {"type": "text", "text": "I'll read both files."},
                    {
                        "type": "tool_use",
                        "id": "toolu_01A",
                        "name": "fs__read",
                        "input": {"path": "a.md"},
                    },
                    {
                        "type": "tool_use",
                        "id": "toolu_01B",
                        "name": "calc",
                        "input": {"expr": "6*7"},
                    },
                ],
            },
            {
                "role": "user",
                "content": [
                    {
                        "type": "tool_result",
                        "tool_use_id": "toolu_01A",
                        "content": "Error (timeout): took longer than 30 s",
                        "is_error": True,
                    },
                    {"type": "tool_result", "tool_use_id": "toolu_01B", "content": "42"},
                    {"type": "text", "text": "Also: hurry."},
                ],
            },
        ],
    }


async def test_complete_parses_a_whole_message() -> None:
    body = {
        "id": "msg_01Aq9w938a90dw8q",
        "type": "message",
        "role": "assistant",
        "model": "claude-haiku-4-5-20251001",
        "content": [
            {"type": "text", "text": "Reading."},
            {"type": "tool_use", "id": "toolu_1", "name": "fs__read", "input": {"path": "x"}},
        ],
        "stop_reason": "tool_use",
        "stop_sequence": None,
        "usage": {
            "input_tokens": 100,
            "output_tokens": 20,
            "cache_creation_input_tokens": 1000,
            "cache_read_input_tokens": 0,
        },
    }
    server = FakeServer(json_response(200, body))
    async with server.client() as client:
        response = await model(client).complete(first_request())
    assert response.message.parts == (
        Text("Reading."),
        ToolCall("toolu_1", "fs.read", {"path": "x"}, 0),
    )
    assert response.usage.cache_write_tokens == 1000
    assert response.usage.cost_usd == pytest.approx((100 * 1 + 20 * 5 + 1000 * 1.25) / 1e6)
    assert "stream" not in server.body()


async def test_a_400_is_raised_with_the_providers_type_and_message() -> None:
    error = {
        "type": "error",
        "error": {
            "type": "invalid_request_error",
            "message": "messages.2: `tool_use` ids were found without `tool_result` blocks "
            "immediately after: toolu_01B.",
        },
        "request_id": "req_011CSHoEeqs5C35K2UUqR7Fy",
    }
    server = FakeServer(json_response(400, error, headers={"request-id": "req_011"}))
    async with server.client() as client:
        with pytest.raises(ProviderError) as caught:
            await model(client, retry=RetryPolicy()).complete(first_request())
    exc = caught.value
    assert (exc.status, exc.error_type) == (400, "invalid_request_error")
    assert "without `tool_result` blocks" in exc.message
    assert len(server.requests) == 1


async def test_overloaded_error_event_before_any_output_is_retried(
    autojump_clock: trio.testing.MockClock,
) -> None:
    overloaded = event(
        {"type": "error", "error": {"type": "overloaded_error", "message": "Overloaded"}}
    )
    server = FakeServer(sse_response(MESSAGE_START + overloaded), sse_response(TWO_TOOL_USES))
    async with server.client() as client:
        events = await collect(model(client, retry=RetryPolicy(jitter=0)), first_request())
    assert len(final(events).message.tool_calls) == 2
    assert len(server.requests) == 2
    assert server.times[1] - server.times[0] == pytest.approx(0.5)


async def test_an_error_event_after_output_is_raised_not_retried() -> None:
    overloaded = event(
        {"type": "error", "error": {"type": "overloaded_error", "message": "Overloaded"}}
    )
    body = (
        MESSAGE_START
        + block_start(0, {"type": "text", "text": ""})
        + block_delta(0, {"type": "text_delta", "text": "Hel"})
        + overloaded
    )
    server = FakeServer(sse_response(body), sse_response(TWO_TOOL_USES))
    seen: list[object] = []
    async with server.client() as client:
        m = model(client, retry=RetryPolicy())
        with pytest.raises(ProviderError, match="Overloaded") as caught:
            async with m.stream(first_request()) as events:
                async for e in events:
                    seen.append(e)
    assert seen == [TextDelta("Hel")]
    assert caught.value.error_type == "overloaded_error"
    assert len(server.requests) == 1


async def test_system_messages_join_the_system_prompt() -> None:
    server = FakeServer(
        sse_response(
            MESSAGE_START
            + block_start(0, {"type": "text", "text": "ok"})
            + block_stop(0)
            + message_end("end_turn", 1)
        )
    )
    async with server.client() as client:
        request = ModelRequest(
            (Message("system", (Text("Summary so far: none."),)), user("hi")), system="Be brief."
        )
        events = await collect(model(client), request)
    assert final(events).message.text == "ok"
    body = server.body()
    assert body["system"] == "Be brief.\n\nSummary so far: none."
    assert body["messages"] == [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]
