"""Gemini over a fake transport, with payloads shaped as Google documents them."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
import trio

from kernel.messages import Text, ToolCall, ToolError
from kernel.models import GeminiModel, ModelRequest, ProviderError, RetryPolicy, ToolCallDelta

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

SIGNATURE = "CiQB0e2Kb7sRnYbU3mF0cKq1BbdW9tAmG3h2kX0VQ3V9Gd1pIJ0="


def gemini_chunk(parts: list[dict[str, Any]], finish: str | None = None, **usage: int) -> str:
    candidate: dict[str, Any] = {"content": {"parts": parts, "role": "model"}, "index": 0}
    if finish:
        candidate["finishReason"] = finish
    body = {
        "candidates": [candidate],
        "usageMetadata": {"promptTokenCount": 50, "totalTokenCount": 50, **usage},
        "modelVersion": "gemini-2.5-flash",
        "responseId": "mJbmaJ-4DaS0qtsPzbGcgAk",
    }
    return sse(body, newline="\r\n")


TWO_CALLS = gemini_chunk([{"text": "Checking both."}]) + gemini_chunk(
    [
        {
            "functionCall": {"name": "fs.read", "args": {"path": "a.md"}},
            "thoughtSignature": SIGNATURE,
        },
        {"functionCall": {"name": "calc", "args": {"expr": "6*7"}}},
    ],
    finish="STOP",
    candidatesTokenCount=20,
    thoughtsTokenCount=30,
)


def model(client: httpx.AsyncClient, **options: Any) -> GeminiModel:
    options.setdefault("retry", NO_RETRY)
    return GeminiModel("gemini-2.5-flash", client=client, api_key="AIza-test", **options)


def first_request() -> ModelRequest:
    return ModelRequest((user("Read a.md and compute."),), system="Be brief.", tools=TOOLS)


async def test_two_function_calls_get_kernel_ids_in_order() -> None:
    server = FakeServer(sse_response(TWO_CALLS, chunk_size=13))
    async with server.client() as client:
        events = await collect(model(client), first_request())

    response = final(events)
    text, first, second = response.message.parts
    assert text == Text("Checking both.")
    assert isinstance(first, ToolCall) and isinstance(second, ToolCall)
    assert (first.name, first.arguments, first.index) == ("fs.read", {"path": "a.md"}, 0)
    assert (second.name, second.arguments, second.index) == ("calc", {"expr": "6*7"}, 1)
    assert first.id.startswith("gemini-") and first.id.endswith("-0")
    assert second.id == first.id[:-1] + "1"
    assert response.stop_reason == "tool_use"  # Gemini says STOP for a turn of calls
    assert response.raw_stop_reason == "STOP"
    assert (response.usage.input_tokens, response.usage.output_tokens) == (50, 50)
    assert response.usage.cost_usd == pytest.approx((50 * 0.30 + 50 * 2.50) / 1e6)
    started = [e for e in events if isinstance(e, ToolCallDelta) and e.id]
    assert [(e.index, e.id, e.name) for e in started] == [
        (0, first.id, "fs.read"),
        (1, second.id, "calc"),
    ]

    request = server.requests[0]
    assert request.url == (
        "https://generativelanguage.googleapis.com/v1beta/models/"
        "gemini-2.5-flash:streamGenerateContent?alt=sse"
    )
    assert request.headers["x-goog-api-key"] == "AIza-test"
    body = server.body(0)
    assert body["systemInstruction"] == {"parts": [{"text": "Be brief."}]}
    assert [d["name"] for d in body["tools"][0]["functionDeclarations"]] == [
        "fs.read",
        "web.fetch",
        "calc",
    ]


async def test_follow_up_returns_function_responses_in_order_with_signature() -> None:
    server = FakeServer(
        sse_response(TWO_CALLS),
        sse_response(gemini_chunk([{"text": "It is 42."}], finish="STOP")),
    )
    async with server.client() as client:
        m = model(client)
        first = final(await collect(m, first_request()))
        results = tool_results(
            first.message.tool_calls, [ToolError("denied", "Denied", "outside the workspace"), "42"]
        )
        follow_up = ModelRequest(
            (user("Read a.md and compute."), first.message, results),
            system="Be brief.",
            tools=TOOLS,
            temperature=0.2,
        )
        answer = final(await collect(m, follow_up))

    assert answer.message.text == "It is 42."
    assert answer.stop_reason == "end_turn"
    body = server.body(1)
    del body["tools"]
    assert body == {
        "contents": [
            {"role": "user", "parts": [{"text": "Read a.md and compute."}]},
            {
                "role": "model",
                "parts": [
                    {"text": "Checking both."},
                    {
                        "functionCall": {"name": "fs.read", "args": {"path": "a.md"}},
                        "thoughtSignature": SIGNATURE,
                    },
                    {"functionCall": {"name": "calc", "args": {"expr": "6*7"}}},
                ],
            },
            {
                "role": "user",
                "parts": [
                    {
                        "functionResponse": {
                            "name": "fs.read",
                            "response": {"error": "Error (denied): outside the workspace"},
                        }
                    },
                    {"functionResponse": {"name": "calc", "response": {"result": "42"}}},
                ],
            },
        ],
        "systemInstruction": {"parts": [{"text": "Be brief."}]},
        "generationConfig": {"maxOutputTokens": 4096, "temperature": 0.2},
    }


async def test_provider_ids_go_back_and_unknown_signatures_get_the_placeholder() -> None:
    # A history this model instance never saw (reloaded, or from another model).
    calls = (
        ToolCall("fc_1", "fs.read", {"path": "a"}, 0),
        ToolCall("fc_2", "calc", '{"expr": "1"}', 1),
    )
    from kernel.messages import Message

    history = (user("go"), Message("assistant", calls), tool_results(calls, ["A", "1"]))
    server = FakeServer(sse_response(gemini_chunk([{"text": "ok"}], finish="STOP")))
    async with server.client() as client:
        await collect(model(client), ModelRequest(history))
    contents = server.body()["contents"]
    assert contents[1]["parts"] == [
        {
            "functionCall": {"name": "fs.read", "args": {"path": "a"}, "id": "fc_1"},
            "thoughtSignature": "skip_thought_signature_validator",
        },
        {"functionCall": {"name": "calc", "args": {"expr": "1"}, "id": "fc_2"}},
    ]
    assert contents[2]["parts"] == [
        {"functionResponse": {"name": "fs.read", "response": {"result": "A"}, "id": "fc_1"}},
        {"functionResponse": {"name": "calc", "response": {"result": "1"}, "id": "fc_2"}},
    ]


async def test_complete_uses_generate_content() -> None:
    body = {
        "candidates": [
            {
                "content": {
                    "parts": [
                        {"functionCall": {"name": "fs.read", "args": {"path": "x"}}},
                        {"functionCall": {"name": "fs.read", "args": {"path": "y"}}},
                    ],
                    "role": "model",
                },
                "finishReason": "STOP",
                "index": 0,
            }
        ],
        "usageMetadata": {
            "promptTokenCount": 1000,
            "candidatesTokenCount": 10,
            "cachedContentTokenCount": 800,
            "totalTokenCount": 1010,
        },
        "modelVersion": "gemini-2.5-flash",
    }
    server = FakeServer(json_response(200, body))
    async with server.client() as client:
        response = await model(client).complete(first_request())
    assert [c.arguments for c in response.message.tool_calls] == [{"path": "x"}, {"path": "y"}]
    assert (response.usage.input_tokens, response.usage.cache_read_tokens) == (200, 800)
    assert str(server.requests[0].url).endswith("/models/gemini-2.5-flash:generateContent")


async def test_a_400_is_raised_with_googles_status_and_message() -> None:
    error = {
        "error": {
            "code": 400,
            "message": "* GenerateContentRequest.contents: contents is not specified\n",
            "status": "INVALID_ARGUMENT",
        }
    }
    server = FakeServer(json_response(400, error))
    async with server.client() as client:
        with pytest.raises(ProviderError) as caught:
            await model(client, retry=RetryPolicy()).complete(first_request())
    exc = caught.value
    assert (exc.status, exc.error_type) == (400, "INVALID_ARGUMENT")
    assert "contents is not specified" in exc.message


async def test_a_429_waits_for_googles_retry_delay(autojump_clock: trio.testing.MockClock) -> None:
    error = {
        "error": {
            "code": 429,
            "message": "You exceeded your current quota.",
            "status": "RESOURCE_EXHAUSTED",
            "details": [{"@type": "type.googleapis.com/google.rpc.RetryInfo", "retryDelay": "7s"}],
        }
    }
    server = FakeServer(json_response(429, error), sse_response(TWO_CALLS))
    async with server.client() as client:
        events = await collect(model(client, retry=RetryPolicy()), first_request())
    assert len(final(events).message.tool_calls) == 2
    assert server.times[1] - server.times[0] == pytest.approx(7.0)


async def test_a_blocked_prompt_ends_with_content_filter() -> None:
    blocked = sse({"promptFeedback": {"blockReason": "SAFETY"}, "modelVersion": "gemini-2.5-flash"})
    server = FakeServer(sse_response(blocked))
    async with server.client() as client:
        response = final(await collect(model(client), first_request()))
    assert (response.stop_reason, response.raw_stop_reason) == ("content_filter", "SAFETY")
    assert response.message.parts == ()
