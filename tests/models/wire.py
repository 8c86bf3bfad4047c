"""Wire-level fakes: an ``httpx.MockTransport`` that answers from a queue and records requests."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable, Iterable
from typing import Any

import httpx
import trio

from kernel.messages import Message, Observation, Text, ToolCall, ToolError
from kernel.models import ModelEvent, ModelRequest, ModelResponse, ResponseComplete, RetryPolicy
from kernel.tools import Tool

NO_RETRY = RetryPolicy(max_attempts=1)
FAST_RETRY = RetryPolicy(jitter=0.0)


def sse(data: Any, event: str | None = None, *, newline: str = "\n") -> str:
    """One server-sent event; ``data`` other than a string is sent as JSON."""
    text = data if isinstance(data, str) else json.dumps(data)
    head = f"event: {event}{newline}" if event else ""
    return f"{head}data: {text}{newline}{newline}"


class FakeStream(httpx.AsyncByteStream):
    """A response body sent in pieces, that remembers whether it was closed.

    After the pieces, the body ends, raises ``fail`` (a cut connection), or
    waits forever (``hang``) so a test can cancel the reader mid-stream.
    """

    def __init__(
        self,
        body: str | bytes,
        *,
        chunk_size: int = 0,
        fail: Exception | None = None,
        hang: bool = False,
    ) -> None:
        data = body.encode() if isinstance(body, str) else body
        size = chunk_size or len(data) or 1
        self.chunks = [data[i : i + size] for i in range(0, len(data), size)]
        self.fail = fail
        self.hang = hang
        self.closed = False
        self.sent = 0

    async def __aiter__(self) -> AsyncIterator[bytes]:
        for chunk in self.chunks:
            await trio.lowlevel.checkpoint()
            self.sent += 1
            yield chunk
        if self.fail is not None:
            raise self.fail
        if self.hang:
            await trio.sleep_forever()

    async def aclose(self) -> None:
        self.closed = True


def sse_response(body: str, **options: Any) -> httpx.Response:
    return httpx.Response(
        200, headers={"content-type": "text/event-stream"}, stream=FakeStream(body, **options)
    )


def json_response(status: int, body: Any, headers: dict[str, str] | None = None) -> httpx.Response:
    return httpx.Response(status, json=body, headers=headers)


Answer = httpx.Response | Exception | Callable[[httpx.Request], httpx.Response]


class FakeServer:
    """Answers requests with the queued responses, in order, and records each request."""

    def __init__(self, *answers: Answer) -> None:
        self.answers = list(answers)
        self.requests: list[httpx.Request] = []
        self.times: list[float] = []

    def handler(self, request: httpx.Request) -> httpx.Response:
        self.requests.append(request)
        self.times.append(trio.current_time())
        if not self.answers:
            raise AssertionError(f"unexpected request {len(self.requests)}: {request.url}")
        answer = self.answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        if callable(answer):
            return answer(request)
        return answer

    def client(self) -> httpx.AsyncClient:
        return httpx.AsyncClient(transport=httpx.MockTransport(self.handler))

    def body(self, n: int = -1) -> Any:
        return json.loads(self.requests[n].content)


async def collect(model: Any, request: ModelRequest) -> list[ModelEvent]:
    async with model.stream(request) as events:
        return [event async for event in events]


def final(events: list[ModelEvent]) -> ModelResponse:
    assert isinstance(events[-1], ResponseComplete)
    return events[-1].response


def user(text: str) -> Message:
    return Message("user", (Text(text),))


def tool_results(calls: Iterable[ToolCall], contents: list[str | ToolError]) -> Message:
    """The tool message for ``calls``: a string is a result, a ``ToolError`` a failure."""
    parts: list[Observation] = []
    for index, (call, content) in enumerate(zip(calls, contents, strict=True)):
        if isinstance(content, ToolError):
            parts.append(Observation.failure(call, index, content))
        else:
            parts.append(Observation(call.id, call.name, index, content))
    return Message("tool", tuple(parts))


def schema_tool(name: str, *required: str) -> Tool:
    """A tool that takes the named string arguments."""
    return Tool(
        name=name,
        description=f"The {name} tool.",
        parameters={
            "type": "object",
            "properties": {p: {"type": "string"} for p in required},
            "required": list(required),
            "additionalProperties": False,
        },
        fn=None,
        is_async=True,
    )


TOOLS = (
    schema_tool("fs.read", "path"),
    schema_tool("web.fetch", "url"),
    schema_tool("calc", "expr"),
)
