"""OpenAI Chat Completions over a fake transport, with payloads shaped as OpenAI documents them."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from kernel.messages import Text, ToolCall, ToolError
from kernel.models import (
    ModelRequest,
    OpenAIModel,
    ProviderError,
    TextDelta,
    ToolCallDelta,
    Usage,
)

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

CHUNK = {
    "id": "chatcmpl-9xYz",
    "object": "chat.completion.chunk",
    "created": 1727000000,
    "model": "gpt-4.1-mini-2025-04-14",
    "system_fingerprint": "fp_6b68a8204b",
}


def chunk(delta: dict[str, Any], finish_reason: str | None = None) -> str:
    choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
    return sse({**CHUNK, "choices": [choice], "usage": None})


def call_start(index: int, id: str, name: str) -> str:
    call = {
        "index": index,
        "id": id,
        "type": "function",
        "function": {"name": name, "arguments": ""},
    }
    return chunk({"tool_calls": [call]})


def call_args(index: int, fragment: str) -> str:
    return chunk({"tool_calls": [{"index": index, "function": {"arguments": fragment}}]})


USAGE_CHUNK = sse(
    {
        **CHUNK,
        "choices": [],
        "usage": {
            "prompt_tokens": 1200,
            "completion_tokens": 60,
            "total_tokens": 1260,
            "prompt_tokens_details": {"cached_tokens": 1000, "audio_tokens": 0},
            "completion_tokens_details": {"reasoning_tokens": 0, "audio_tokens": 0},
        },
    }
)

# Three parallel calls: ids and names once each, argument fragments interleaved.
THREE_CALLS = "".join(
    [
        chunk({"role": "assistant", "content": "", "refusal": None}),
        chunk({"content": "Let me check."}),
        call_start(0, "call_A", "fs__read"),
        call_start(1, "call_B", "web__fetch"),
        call_args(0, '{"pa'),
        call_start(2, "call_C", "calc"),
        call_args(1, '{"url": "http'),
        call_args(2, '{"expr":'),
        call_args(0, 'th": "notes.md"}'),
        call_args(1, '://a.test/"}'),
        call_args(2, ' "2+2"}'),
        chunk({}, finish_reason="tool_calls"),
        USAGE_CHUNK,
        sse("[DONE]"),
    ]
)


def model(server: FakeServer, client: httpx.AsyncClient, **options: Any) -> OpenAIModel:
    options.setdefault("retry", NO_RETRY)
    return OpenAIModel("gpt-4.1-mini", client=client, api_key="sk-test", **options)


def first_request() -> ModelRequest:
    return ModelRequest((user("Research the notes."),), system="Be brief.", tools=TOOLS)


async def test_three_parallel_calls_with_interleaved_fragments_are_assembled_by_index() -> None:
    # Split the body every 7 bytes: events straddle network reads.
    server = FakeServer(sse_response(THREE_CALLS, chunk_size=7))
    async with server.client() as client:
        events = await collect(model(server, client), first_request())

    response = final(events)
    assert response.message.parts == (
        Text("Let me check."),
        ToolCall("call_A", "fs.read", '{"path": "notes.md"}', 0),
        ToolCall("call_B", "web.fetch", '{"url": "http://a.test/"}', 1),
        ToolCall("call_C", "calc", '{"expr": "2+2"}', 2),
    )
    assert response.stop_reason == "tool_use"
    assert response.raw_stop_reason == "tool_calls"
    assert response.model == "gpt-4.1-mini-2025-04-14"
    # Cached prompt tokens are counted apart from the rest; the snapshot is priced as its alias.
    assert response.usage.input_tokens == 200
    assert response.usage.cache_read_tokens == 1000
    assert response.usage.output_tokens == 60
    assert response.usage.cost_usd == pytest.approx((200 * 0.40 + 1000 * 0.10 + 60 * 1.60) / 1e6)

    deltas = [e for e in events if isinstance(e, ToolCallDelta)]
    assert [(d.index, d.id, d.name) for d in deltas if d.id] == [
        (0, "call_A", "fs.read"),
        (1, "call_B", "web.fetch"),
        (2, "call_C", "calc"),
    ]
    fragments = ["", "", "", "", "", ""]
    for d in deltas:
        fragments[d.index] += d.arguments_fragment
    assert fragments[:3] == ['{"path": "notes.md"}', '{"url": "http://a.test/"}', '{"expr": "2+2"}']
    assert [e.text for e in events if isinstance(e, TextDelta)] == ["Let me check."]

    body = server.body(0)
    assert body["stream"] is True
    assert body["stream_options"] == {"include_usage": True}
    assert [t["function"]["name"] for t in body["tools"]] == ["fs__read", "web__fetch", "calc"]
    assert server.requests[0].url == "https://api.openai.com/v1/chat/completions"
    assert server.requests[0].headers["authorization"] == "Bearer sk-test"


async def test_follow_up_carries_tool_results_in_declared_order() -> None:
    server = FakeServer(
        sse_response(THREE_CALLS),
        sse_response(chunk({"content": "Done."}) + chunk({}, "stop") + USAGE_CHUNK + sse("[DONE]")),
    )
    async with server.client() as client:
        m = model(server, client)
        first = final(await collect(m, first_request()))
        calls = first.message.tool_calls
        results = tool_results(
            calls, ["the notes", ToolError("exception", "HTTPError", "404 Not Found"), "4"]
        )
        follow_up = ModelRequest(
            (user("Research the notes."), first.message, results), system="Be brief.", tools=TOOLS
        )
        answer = final(await collect(m, follow_up))

    assert answer.message.text == "Done."
    assert answer.stop_reason == "end_turn"
    body = server.body(1)
    tools = body.pop("tools")
    assert [t["function"]["name"] for t in tools] == ["fs__read", "web__fetch", "calc"]
    assert body == {
        "model": "gpt-4.1-mini",
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Research the notes."},
            {
                "role": "assistant",
                "content": "Let me check.",
                "tool_calls": [
                    {
                        "id": "call_A",
                        "type": "function",
                        "function": {"name": "fs__read", "arguments": '{"path": "notes.md"}'},
                    },
                    {
                        "id": "call_B",
                        "type": "function",
                        "function": {
                            "name": "web__fetch",
                            "arguments": '{"url": "http://a.test/"}',
                        },
                    },
                    {
                        "id": "call_C",
                        "type": "function",
                        "function": {"name": "calc", "arguments": '{"expr": "2+2"}'},
                    },
                ],
            },
            {"role": "tool", "tool_call_id": "call_A", "content": "the notes"},
            {
                "role": "tool",
                "tool_call_id": "call_B",
                "content": "Error (exception): 404 Not Found",
            },
            {"role": "tool", "tool_call_id": "call_C", "content": "4"},
        ],
        "max_completion_tokens": 4096,  # the default: always sent
        "stream": True,
        "stream_options": {"include_usage": True},
    }


async def test_complete_parses_a_whole_response() -> None:
    body = {
        "id": "chatcmpl-123",
        "object": "chat.completion",
        "created": 1727000000,
        "model": "gpt-4.1-mini-2025-04-14",
        "choices": [
            {
                "index": 0,
                "message": {
                    "role": "assistant",
                    "content": None,
                    "refusal": None,
                    "tool_calls": [
                        {
                            "id": "call_1",
                            "type": "function",
                            "function": {"name": "fs__read", "arguments": '{"path": "a"}'},
                        },
                        {
                            "id": "call_2",
                            "type": "function",
                            "function": {"name": "calc", "arguments": '{"expr": "1"}'},
                        },
                    ],
                },
                "logprobs": None,
                "finish_reason": "tool_calls",
            }
        ],
        "usage": {"prompt_tokens": 82, "completion_tokens": 17, "total_tokens": 99},
    }
    server = FakeServer(json_response(200, body))
    async with server.client() as client:
        request = ModelRequest((user("hi"),), tools=TOOLS, max_tokens=100, temperature=0.5)
        response = await model(server, client).complete(request)

    assert response.message.parts == (
        ToolCall("call_1", "fs.read", '{"path": "a"}', 0),
        ToolCall("call_2", "calc", '{"expr": "1"}', 1),
    )
    assert response.usage == Usage(82, 17, cost_usd=response.usage.cost_usd)
    assert response.usage.cost_usd == pytest.approx((82 * 0.4 + 17 * 1.6) / 1e6)
    sent = server.body()
    assert "stream" not in sent
    # api.openai.com wants max_completion_tokens; other servers get max_tokens.
    assert sent["max_completion_tokens"] == 100
    assert sent["temperature"] == 0.5


async def test_a_local_server_gets_max_tokens_and_no_key() -> None:
    server = FakeServer(
        json_response(
            200,
            {
                "model": "llama3",
                "choices": [{"index": 0, "message": {"content": "hi"}, "finish_reason": "stop"}],
            },
        )
    )
    async with server.client() as client:
        m = OpenAIModel("llama3", client=client, base_url="http://127.0.0.1:8080/v1")
        response = await m.complete(ModelRequest((user("hi"),), max_tokens=5))
    assert response.message.text == "hi"
    assert response.usage.cost_usd is None  # not in the price table
    assert server.requests[0].url == "http://127.0.0.1:8080/v1/chat/completions"
    assert "authorization" not in server.requests[0].headers
    assert server.body()["max_tokens"] == 5


async def test_a_400_is_raised_with_the_providers_type_and_message() -> None:
    error = {
        "error": {
            "message": "Invalid parameter: messages with role 'tool' must be a response to a "
            "preceeding message with 'tool_calls'.",
            "type": "invalid_request_error",
            "param": "messages.[2].role",
            "code": None,
        }
    }
    server = FakeServer(json_response(400, error))
    async with server.client() as client:
        m = OpenAIModel("gpt-4.1-mini", client=client, api_key="k")  # default retries
        with pytest.raises(ProviderError) as caught:
            await m.complete(ModelRequest((user("hi"),)))

    exc = caught.value
    assert len(server.requests) == 1  # a 400 is not retried
    assert (exc.status, exc.error_type, exc.provider) == (400, "invalid_request_error", "openai")
    assert exc.message.startswith("Invalid parameter: messages with role 'tool'")
    assert str(exc).startswith("openai: HTTP 400 invalid_request_error: Invalid parameter")


async def test_an_error_chunk_in_the_stream_is_raised() -> None:
    body = chunk({"content": "Hel"}) + sse(
        {"error": {"message": "The model produced invalid content.", "type": "model_error"}}
    )
    server = FakeServer(sse_response(body))
    async with server.client() as client:
        with pytest.raises(ProviderError, match="invalid content") as caught:
            await collect(model(server, client), ModelRequest((user("hi"),)))
    assert caught.value.error_type == "model_error"


async def test_a_server_that_ignores_stream_true_still_streams() -> None:
    body = {
        "model": "qwen",
        "choices": [{"index": 0, "message": {"content": "whole"}, "finish_reason": "stop"}],
    }
    server = FakeServer(json_response(200, body))
    async with server.client() as client:
        events = await collect(model(server, client), ModelRequest((user("hi"),)))
    assert events[0] == TextDelta("whole")
    assert final(events).message.text == "whole"


async def test_tool_names_that_collide_on_the_wire_are_refused_before_sending() -> None:
    from kernel.errors import UsageError

    from .wire import schema_tool

    server = FakeServer()
    async with server.client() as client:
        request = ModelRequest(
            (user("hi"),), tools=(schema_tool("fs.read"), schema_tool("fs__read"))
        )
        with pytest.raises(UsageError, match="same name on the wire"):
            await model(server, client).complete(request)
    assert server.requests == []


async def test_calls_without_ids_get_deterministic_ones() -> None:
    body = "".join(
        [
            chunk({"tool_calls": [{"index": 0, "function": {"name": "calc", "arguments": "{}"}}]}),
            chunk({}, "tool_calls"),
            sse("[DONE]"),
        ]
    )
    server = FakeServer(sse_response(body), sse_response(body))
    async with server.client() as client:
        m = model(server, client)
        one = final(await collect(m, ModelRequest((user("hi"),), tools=TOOLS)))
        two = final(await collect(m, ModelRequest((user("hi"),), tools=TOOLS)))
    (call,) = one.message.tool_calls
    assert call.id.startswith("openai-") and call.id.endswith("-0")
    assert two.message.tool_calls[0].id == call.id  # same request, same id
    assert json.loads(server.requests[0].content) == json.loads(server.requests[1].content)
