"""What is not retried (issue 22, item 12): an error saying the model's output could
not be parsed, in each server's documented words, and a connection refused by a
loopback address (a local server that is not running: refused at once, with its URL)."""

from __future__ import annotations

import socket
from typing import Any

import pytest
import trio
import trio.testing

from kernel.models import (
    FallbackModel,
    ModelRequest,
    OpenAIModel,
    ProviderError,
    RetryPolicy,
    ScriptedModel,
    open_http_client,
)

from .test_openai import THREE_CALLS
from .wire import FakeServer, collect, final, json_response, sse_response, user

REQUEST = ModelRequest((user("hi"),))

MALFORMED = [
    pytest.param(
        # llama.cpp's llama-server: a call's arguments in the history are not JSON.
        {
            "error": {
                "code": 500,
                "message": "Failed to parse tool call arguments as JSON: "
                "[json.exception.parse_error.101] parse error at line 1, column 13: "
                "syntax error while parsing value - invalid string: missing closing quote",
                "type": "server_error",
            }
        },
        id="llama-server",
    ),
    pytest.param(
        # llama-server's PEG parser (--jinja): the reply itself fits no tool-call format
        # (seen from SmolLM2 in `make interop`, the step after a forced call).
        {
            "error": {
                "code": 500,
                "message": "The model produced output that does not match the expected "
                "peg-native format",
                "type": "server_error",
            }
        },
        id="llama-server-peg",
    ),
    pytest.param(
        {
            "error": 'error parsing tool call: raw=\'{"term": "ab\', err=unexpected end of JSON input'
        },
        id="ollama",
    ),
    pytest.param(
        {
            "error": {
                "message": "The model produced invalid content. Consider modifying your "
                "prompt if you are seeing this error persistently.",
                "type": "model_error",
                "param": None,
                "code": None,
            }
        },
        id="openai",
    ),
]


@pytest.mark.parametrize("body", MALFORMED)
@pytest.mark.parametrize("streamed", [True, False], ids=["stream", "complete"])
async def test_a_500_saying_the_output_could_not_be_parsed_is_not_retried(
    body: dict[str, Any], streamed: bool, autojump_clock: trio.testing.MockClock
) -> None:
    server = FakeServer(*[json_response(500, body) for _ in range(5)])
    async with server.client() as client:
        model = OpenAIModel("local", client=client, base_url="http://127.0.0.1:8080/v1")
        with pytest.raises(ProviderError) as caught:
            if streamed:
                await collect(model, REQUEST)
            else:
                await model.complete(REQUEST)
    assert len(server.requests) == 1
    error = caught.value
    assert (error.status, error.retryable, error.attempts) == (500, False, 1)
    assert "the model's output could not be parsed" in str(error)
    # Any other 500 is still retried.
    failed = {"error": {"code": 500, "message": "slot unavailable", "type": "server_error"}}
    server = FakeServer(json_response(500, failed), sse_response(THREE_CALLS))
    async with server.client() as client:
        events = await collect(OpenAIModel("local", client=client), REQUEST)
    assert len(final(events).message.tool_calls) == 3 and len(server.requests) == 2


def dead_port() -> int:
    """A loopback port nothing listens on (bound, then closed)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.parametrize("host", ["127.0.0.1", "localhost"])
async def test_a_refused_loopback_server_fails_at_once_naming_its_url(host: str) -> None:
    url = f"http://{host}:{dead_port()}/v1"
    async with open_http_client() as client:
        model = OpenAIModel("local", client=client, base_url=url, retry=RetryPolicy())
        for ask in (model.complete(REQUEST), collect(model, REQUEST)):
            with pytest.raises(ProviderError) as caught:
                await ask
            error = caught.value
            assert (error.attempts, error.retryable) == (1, False)
            assert str(error).splitlines() == [
                f"openai: connection_error: nothing listens at {url} (connection refused); "
                "start the server or point the base URL elsewhere"
            ]
        # Not retried, yet a fallback still moves on to the next model.
        fallback = FallbackModel([model, ScriptedModel(["from the next one"])])
        assert (await fallback.complete(REQUEST)).message.text == "from the next one"
