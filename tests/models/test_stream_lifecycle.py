"""A stream that breaks, and a stream the caller leaves: errors raised, responses closed."""

from __future__ import annotations

import functools
import re
from collections.abc import Callable
from typing import Any

import httpx
import pytest
import trio
import trio.testing

from kernel.models import (
    AnthropicModel,
    GeminiModel,
    Model,
    ModelEvent,
    ModelRequest,
    OpenAIModel,
    ProviderError,
    RetryPolicy,
    TextDelta,
    ToolCallDelta,
)

from . import test_anthropic, test_gemini, test_openai
from .wire import TOOLS, FakeServer, FakeStream, sse_response, user

REQUEST = ModelRequest((user("hi"),), tools=TOOLS)
ModelFactory = Callable[[httpx.AsyncClient], Model]


def _openai(client: httpx.AsyncClient) -> Model:
    return OpenAIModel("gpt-4.1-mini", client=client, api_key="k", retry=RetryPolicy())


def _anthropic(client: httpx.AsyncClient) -> Model:
    return AnthropicModel("claude-sonnet-4-5", client=client, api_key="k", retry=RetryPolicy())


def _gemini(client: httpx.AsyncClient) -> Model:
    return GeminiModel("gemini-2.5-flash", client=client, api_key="k", retry=RetryPolicy())


def _halves(body: str) -> str:
    """The first half of a stream's events: well-formed, but no final event."""
    events = body.replace("\r\n", "\n").split("\n\n")
    return "\n\n".join(events[: len(events) // 2]) + "\n\n"


PROVIDERS = [
    pytest.param(_openai, test_openai.THREE_CALLS, id="openai"),
    pytest.param(_anthropic, test_anthropic.TWO_TOOL_USES, id="anthropic"),
    pytest.param(_gemini, test_gemini.TWO_CALLS, id="gemini"),
]


async def _read(model: Model, seen: list[ModelEvent]) -> None:
    async with model.stream(REQUEST) as events:
        async for event in events:
            seen.append(event)


@pytest.mark.parametrize(("make", "body"), PROVIDERS)
async def test_a_stream_that_ends_early_raises_after_what_it_delivered(
    make: ModelFactory, body: str
) -> None:
    server = FakeServer(sse_response(_halves(body)), sse_response(body))
    seen: list[ModelEvent] = []
    async with server.client() as client:
        with pytest.raises(ProviderError, match="ended early") as caught:
            await _read(make(client), seen)
    assert caught.value.error_type == "incomplete_stream"
    assert seen, "the events before the cut were delivered"
    assert all(isinstance(e, TextDelta | ToolCallDelta) for e in seen)
    assert len(server.requests) == 1, "no retry once events were yielded"


@pytest.mark.parametrize(("make", "body"), PROVIDERS)
async def test_a_connection_cut_mid_stream_raises(make: ModelFactory, body: str) -> None:
    cut = httpx.RemoteProtocolError("peer closed connection without sending complete message body")
    stream = FakeStream(_halves(body), fail=cut)
    server = FakeServer(
        httpx.Response(200, headers={"content-type": "text/event-stream"}, stream=stream)
    )
    seen: list[ModelEvent] = []
    async with server.client() as client:
        with pytest.raises(ProviderError, match=r"ended early.*peer closed") as caught:
            await _read(make(client), seen)
    assert isinstance(caught.value.__cause__, httpx.RemoteProtocolError)
    assert seen
    assert stream.closed


async def test_a_cut_before_the_first_event_is_retried(
    autojump_clock: trio.testing.MockClock,
) -> None:
    cut = httpx.ReadError("connection reset")
    first = FakeStream(": keep-alive\n\n", fail=cut)
    server = FakeServer(
        httpx.Response(200, headers={"content-type": "text/event-stream"}, stream=first),
        sse_response(test_openai.THREE_CALLS),
    )
    seen: list[ModelEvent] = []
    async with server.client() as client:
        await _read(_openai(client), seen)
    assert len(server.requests) == 2
    assert first.closed
    assert len(seen[-1].response.message.tool_calls) == 3  # type: ignore[union-attr]


@pytest.mark.parametrize(("make", "body"), PROVIDERS)
async def test_cancelling_mid_stream_closes_the_response(make: ModelFactory, body: str) -> None:
    stream = FakeStream(_halves(body), hang=True)
    server = FakeServer(
        httpx.Response(200, headers={"content-type": "text/event-stream"}, stream=stream)
    )
    seen: list[ModelEvent] = []
    async with server.client() as client:
        with trio.fail_after(5), trio.CancelScope() as scope:
            async with make(client).stream(REQUEST) as events:
                async for event in events:
                    seen.append(event)
                    scope.cancel()  # while the body is still coming
        assert scope.cancelled_caught
        assert stream.closed
    assert len(seen) == 1


async def test_leaving_the_block_early_closes_the_response() -> None:
    stream = FakeStream(test_openai.THREE_CALLS, chunk_size=50)
    server = FakeServer(
        httpx.Response(200, headers={"content-type": "text/event-stream"}, stream=stream)
    )
    async with server.client() as client:
        async with _openai(client).stream(REQUEST) as events:
            async for _ in events:
                break
        assert stream.closed
        assert stream.sent < len(stream.chunks)


async def _serve_one_stream(
    stream: trio.SocketStream, first_event: bytes, closed: trio.Event
) -> None:
    """A minimal HTTP/1.1 server: read the request, send one chunk of events, wait for EOF."""
    data = b""
    while b"\r\n\r\n" not in data:
        data += await stream.receive_some(65536)
    head, _, body = data.partition(b"\r\n\r\n")
    match = re.search(rb"content-length: *(\d+)", head, re.IGNORECASE)
    assert match is not None
    while len(body) < int(match.group(1)):
        body += await stream.receive_some(65536)
    await stream.send_all(
        b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
        b"transfer-encoding: chunked\r\n\r\n"
        + f"{len(first_event):x}\r\n".encode()
        + first_event
        + b"\r\n"
    )
    while await stream.receive_some(65536):
        pass
    closed.set()


async def test_cancelling_closes_the_connection_to_a_real_server() -> None:
    closed = trio.Event()
    first_event = test_openai.chunk({"content": "Hel"}).encode()

    async def handler(stream: trio.SocketStream) -> None:
        await _serve_one_stream(stream, first_event, closed)

    async with trio.open_nursery() as nursery:
        listeners: Any = await nursery.start(
            functools.partial(trio.serve_tcp, handler, 0, host="127.0.0.1")
        )
        port = listeners[0].socket.getsockname()[1]
        seen: list[ModelEvent] = []
        async with httpx.AsyncClient() as client:
            model = OpenAIModel("m", client=client, base_url=f"http://127.0.0.1:{port}/v1")
            with trio.fail_after(10):
                with trio.CancelScope() as scope:
                    async with model.stream(REQUEST) as events:
                        async for event in events:
                            seen.append(event)
                            scope.cancel()
                # The server sees the connection close as soon as the block is left.
                await closed.wait()
        assert seen == [TextDelta("Hel")]
        nursery.cancel_scope.cancel()
