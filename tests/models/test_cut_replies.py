"""A reply cut by the token limit inside its tool calls (issue 22, item 12), for every
adapter, streamed and whole, faked at the wire in each provider's documented format:
the turn ends ``max_tokens`` saying so, and no call runs with cut arguments.

"Whole" is a server that answers the agent's streamed request with one JSON body
(as some OpenAI-compatible servers do, and as ``complete`` parses it).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import httpx
import pytest

from kernel import tool
from kernel.agent import Agent
from kernel.messages import Message, ToolCall, ToolError
from kernel.models import AnthropicModel, GeminiModel, ModelRequest, OpenAIModel
from kernel.session import Session
from kernel.settings import ModelSettings
from kernel.store import MemoryStore, SessionKey

from .test_anthropic import MESSAGE_START, block_start, block_stop, json_delta, message_end
from .test_gemini import gemini_chunk
from .test_openai import USAGE_CHUNK, call_args, call_start, chunk
from .wire import NO_RETRY, FakeServer, json_response, sse, sse_response, tool_results, user

RAN: list[str] = []


@tool
async def lookup(term: str) -> str:
    """Look a term up."""
    RAN.append(term)
    return f"{term}: found"


# -- the cut replies, as each provider sends them ---------------------------------------

OPENAI_STREAMED = "".join(
    [
        chunk({"role": "assistant", "content": None}),
        call_start(0, "call_1", "lookup"),
        call_args(0, '{"term": "ab'),
        chunk({}, finish_reason="length"),
        USAGE_CHUNK,
        sse("[DONE]"),
    ]
)
OPENAI_WHOLE = {
    "id": "chatcmpl-1",
    "object": "chat.completion",
    "model": "gpt-4.1-mini",
    "choices": [
        {
            "index": 0,
            "message": {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": "call_1",
                        "type": "function",
                        "function": {"name": "lookup", "arguments": '{"term": "ab'},
                    }
                ],
            },
            "finish_reason": "length",
        }
    ],
    "usage": {"prompt_tokens": 50, "completion_tokens": 64, "total_tokens": 114},
}
ANTHROPIC_STREAMED = "".join(
    [
        MESSAGE_START,
        block_start(0, {"type": "tool_use", "id": "toolu_1", "name": "lookup", "input": {}}),
        json_delta(0, '{"term": "ab'),
        block_stop(0),
        message_end("max_tokens", 64),
    ]
)
ANTHROPIC_WHOLE = {
    "id": "msg_1",
    "type": "message",
    "role": "assistant",
    "model": "claude-sonnet-4-5-20250929",
    "content": [{"type": "tool_use", "id": "toolu_1", "name": "lookup", "input": {"term": "ab"}}],
    "stop_reason": "max_tokens",
    "stop_sequence": None,
    "usage": {"input_tokens": 50, "output_tokens": 64},
}
GEMINI_PARTS = [{"functionCall": {"name": "lookup", "args": {"term": "ab"}}}]
GEMINI_STREAMED = gemini_chunk(GEMINI_PARTS, finish="MAX_TOKENS", candidatesTokenCount=64)
GEMINI_WHOLE = {
    "candidates": [
        {"content": {"parts": GEMINI_PARTS, "role": "model"}, "finishReason": "MAX_TOKENS"}
    ],
    "usageMetadata": {"promptTokenCount": 50, "candidatesTokenCount": 64},
    "modelVersion": "gemini-2.5-flash",
}

# What each provider answers after a tool result (the code before this fix asked).
OPENAI_DONE = {
    **OPENAI_WHOLE,
    "choices": [
        {"index": 0, "message": {"role": "assistant", "content": "done"}, "finish_reason": "stop"}
    ],
}
ANTHROPIC_DONE = {
    **ANTHROPIC_WHOLE,
    "content": [{"type": "text", "text": "done"}],
    "stop_reason": "end_turn",
}
GEMINI_DONE = {
    **GEMINI_WHOLE,
    "candidates": [
        {"content": {"parts": [{"text": "done"}], "role": "model"}, "finishReason": "STOP"}
    ],
}

Make = Callable[[httpx.AsyncClient], Any]


def openai(client: httpx.AsyncClient) -> OpenAIModel:
    return OpenAIModel("gpt-4.1-mini", client=client, api_key="k", retry=NO_RETRY)


def anthropic(client: httpx.AsyncClient) -> AnthropicModel:
    return AnthropicModel("claude-sonnet-4-5", client=client, api_key="k", retry=NO_RETRY)


def gemini(client: httpx.AsyncClient) -> GeminiModel:
    return GeminiModel("gemini-2.5-flash", client=client, api_key="k", retry=NO_RETRY)


CASES = [
    pytest.param(openai, sse_response(OPENAI_STREAMED), OPENAI_DONE, id="openai-streamed"),
    pytest.param(openai, json_response(200, OPENAI_WHOLE), OPENAI_DONE, id="openai-whole"),
    pytest.param(
        anthropic, sse_response(ANTHROPIC_STREAMED), ANTHROPIC_DONE, id="anthropic-streamed"
    ),
    pytest.param(
        anthropic, json_response(200, ANTHROPIC_WHOLE), ANTHROPIC_DONE, id="anthropic-whole"
    ),
    pytest.param(gemini, sse_response(GEMINI_STREAMED), GEMINI_DONE, id="gemini-streamed"),
    pytest.param(gemini, json_response(200, GEMINI_WHOLE), GEMINI_DONE, id="gemini-whole"),
]


@pytest.mark.parametrize(("make", "cut", "done"), CASES)
async def test_a_reply_cut_inside_a_tool_call_ends_the_turn_max_tokens_and_runs_nothing(
    make: Make, cut: httpx.Response, done: dict[str, Any]
) -> None:
    RAN.clear()
    server = FakeServer(cut, json_response(200, done))
    session = Session(MemoryStore(), SessionKey("p", "cut"))
    async with server.client() as client:
        agent = Agent(make(client), [lookup], settings=ModelSettings(max_tokens=64))
        finished = await agent.run_turn(session, "look up ab")
        assert finished.reason == "max_tokens", finished
        assert finished.error is not None
        assert "cut by the token limit (max_tokens 64) inside its tool calls (lookup)" in (
            finished.error
        )
        assert "none ran" in finished.error
        assert RAN == [] and len(server.requests) == 1  # nothing ran, nothing sent back
        # Recorded: the reply as cut, without the calls (no call waits for a result).
        entries = await session.entries()
        assert [e["type"] for e in entries] == ["user", "assistant"]
        assert entries[1]["stop_reason"] == "max_tokens"
        assert all(p["type"] != "tool_call" for p in entries[1]["message"]["parts"])
        # A resume says the same, and asks nothing.
        resumed = await agent.resume_turn(session)
        assert (resumed.reason, resumed.steps) == ("max_tokens", 0)
    assert len(server.requests) == 1


async def test_text_before_the_cut_calls_is_kept() -> None:
    body = "".join(
        [
            chunk({"role": "assistant", "content": "Let me look."}),
            call_start(0, "call_1", "lookup"),
            call_args(0, '{"te'),
            chunk({}, finish_reason="length"),
            sse("[DONE]"),
        ]
    )
    RAN.clear()
    server = FakeServer(sse_response(body), json_response(200, OPENAI_DONE))
    session = Session(MemoryStore(), SessionKey("p", "cut"))
    async with server.client() as client:
        finished = await Agent(openai(client), [lookup]).run_turn(session, "look up ab")
    assert (finished.reason, finished.text) == ("max_tokens", "Let me look.")
    entries = await session.entries()
    assert entries[-1]["message"]["parts"] == [{"type": "text", "text": "Let me look."}]
    assert json.dumps(entries).count("call_1") == 0 and RAN == []


async def test_arguments_that_are_not_json_go_back_to_openai_as_an_empty_object() -> None:
    """A call the executor refused as not JSON (a model's slip, an older transcript's
    cut call): llama-server parses the history's arguments and refused the whole
    request (HTTP 500) when they went back as sent."""
    call = ToolCall("call_1", "lookup", '{"term": "ab', 0)
    history = (
        user("look up ab"),
        Message("assistant", (call,)),
        tool_results([call], [ToolError("bad_arguments", "JSONDecodeError", "not JSON")]),
    )
    server = FakeServer(json_response(200, OPENAI_DONE))
    async with server.client() as client:
        await openai(client).complete(ModelRequest(history, tools=(lookup,)))
    sent = server.body()["messages"][1]["tool_calls"][0]["function"]["arguments"]
    assert sent == "{}"
