"""Retries: which failures, how long between them, and when to stop (on a mock clock)."""

from __future__ import annotations

import email.utils
import json
import time

import httpx
import pytest
import trio
import trio.testing

from kernel.errors import ModelAPIError, UsageError
from kernel.models import ModelRequest, OpenAIModel, ProviderError, RetryPolicy

from .test_openai import THREE_CALLS
from .wire import FakeServer, collect, final, json_response, sse_response, user

SERVER_ERROR = {"error": {"message": "The server had an error.", "type": "server_error"}}
RATE_LIMITED = {
    "error": {
        "message": "Rate limit reached for gpt-4.1-mini.",
        "type": "requests",
        "code": "rate_limit_exceeded",
    }
}
REQUEST = ModelRequest((user("hi"),))


def model(client: httpx.AsyncClient, retry: RetryPolicy) -> OpenAIModel:
    return OpenAIModel("gpt-4.1-mini", client=client, api_key="k", retry=retry)


def waits(server: FakeServer) -> list[float]:
    return [round(b - a, 6) for a, b in zip(server.times, server.times[1:], strict=False)]


async def test_a_429_with_retry_after_waits_that_long_then_succeeds(
    autojump_clock: trio.testing.MockClock,
) -> None:
    server = FakeServer(
        json_response(429, RATE_LIMITED, headers={"retry-after": "3"}),
        sse_response(THREE_CALLS),
    )
    async with server.client() as client:
        events = await collect(model(client, RetryPolicy()), REQUEST)
    assert len(final(events).message.tool_calls) == 3
    assert waits(server) == [3.0]


async def test_retry_after_as_an_http_date(autojump_clock: trio.testing.MockClock) -> None:
    when = email.utils.formatdate(time.time() + 10, usegmt=True)
    server = FakeServer(
        json_response(503, SERVER_ERROR, headers={"retry-after": when}),
        sse_response(THREE_CALLS),
    )
    async with server.client() as client:
        await collect(model(client, RetryPolicy()), REQUEST)
    # An HTTP date has whole seconds.
    assert 8.5 <= waits(server)[0] <= 10.0


async def test_retry_after_is_capped_by_max_delay(autojump_clock: trio.testing.MockClock) -> None:
    server = FakeServer(
        json_response(429, RATE_LIMITED, headers={"retry-after": "3600"}),
        json_response(200, {"choices": [{"message": {"content": "ok"}, "finish_reason": "stop"}]}),
    )
    async with server.client() as client:
        response = await model(client, RetryPolicy(max_delay=2.0)).complete(REQUEST)
    assert response.message.text == "ok"
    assert waits(server) == [2.0]


async def test_a_500_storm_exhausts_the_retries(autojump_clock: trio.testing.MockClock) -> None:
    server = FakeServer(*(json_response(500, SERVER_ERROR) for _ in range(5)))
    async with server.client() as client:
        with pytest.raises(ModelAPIError) as caught:
            await collect(model(client, RetryPolicy(jitter=0)), REQUEST)
    exc = caught.value
    assert isinstance(exc, ProviderError)
    assert (exc.status, exc.error_type, exc.attempts) == (500, "server_error", 5)
    assert str(exc) == (
        "openai: HTTP 500 server_error: The server had an error. (gave up after 5 attempts)"
    )
    assert waits(server) == [0.5, 1.0, 2.0, 4.0]  # exponential backoff


async def test_retrying_stops_before_the_total_time_is_spent(
    autojump_clock: trio.testing.MockClock,
) -> None:
    server = FakeServer(*(json_response(502, SERVER_ERROR) for _ in range(5)))
    async with server.client() as client:
        with pytest.raises(ProviderError) as caught:
            await model(client, RetryPolicy(jitter=0, max_total=3.0)).complete(REQUEST)
    # Waits 0.5 and 1; the next (2 s) would end 3.5 s after the start.
    assert caught.value.attempts == 3
    assert waits(server) == [0.5, 1.0]


async def test_jitter_shortens_waits_at_random_within_its_fraction() -> None:
    policy = RetryPolicy(base_delay=1.0, jitter=0.5)
    delays = [policy.delay(3) for _ in range(200)]
    assert all(2.0 <= d <= 4.0 for d in delays)
    assert len(set(delays)) > 100


async def test_connection_errors_are_retried(autojump_clock: trio.testing.MockClock) -> None:
    server = FakeServer(httpx.ConnectError("connection refused"), sse_response(THREE_CALLS))
    async with server.client() as client:
        events = await collect(model(client, RetryPolicy()), REQUEST)
    assert len(final(events).message.tool_calls) == 3
    assert len(server.requests) == 2


async def test_connection_errors_that_persist_are_raised(
    autojump_clock: trio.testing.MockClock,
) -> None:
    server = FakeServer(*(httpx.ConnectError("connection refused") for _ in range(3)))
    async with server.client() as client:
        with pytest.raises(ProviderError) as caught:
            await model(client, RetryPolicy(max_attempts=3)).complete(REQUEST)
    exc = caught.value
    assert (exc.status, exc.error_type, exc.attempts) == (None, "connection_error", 3)
    assert isinstance(exc.__cause__, httpx.ConnectError)


async def test_x_should_retry_false_is_obeyed() -> None:
    server = FakeServer(json_response(503, SERVER_ERROR, headers={"x-should-retry": "false"}))
    async with server.client() as client:
        with pytest.raises(ProviderError):
            await model(client, RetryPolicy()).complete(REQUEST)
    assert len(server.requests) == 1


def test_policies_are_checked() -> None:
    with pytest.raises(UsageError, match="max_attempts"):
        RetryPolicy(max_attempts=0)
    with pytest.raises(UsageError, match="jitter"):
        RetryPolicy(jitter=2)


async def test_an_in_band_refusal_before_the_first_event_is_not_retried(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A 200 stream whose first event is an error with a plain 500 is the server's
    deterministic answer (llama-server: the output does not match the expected
    format): asking again doubles the wait for the same refusal."""
    refusal = {
        "error": {
            "code": 500,
            "message": "the output does not match the expected format",
            "type": "server_error",
        }
    }
    server = FakeServer(sse_response(f"data: {json.dumps(refusal)}\n\n"), sse_response(THREE_CALLS))
    async with server.client() as client:
        with pytest.raises(ProviderError, match="does not match the expected format") as caught:
            await collect(model(client, RetryPolicy()), REQUEST)
    assert len(server.requests) == 1 and not caught.value.retryable


@pytest.mark.parametrize("code", [503, "429"])
async def test_an_in_band_busy_code_is_retried(
    autojump_clock: trio.testing.MockClock, code: int | str
) -> None:
    busy = {"error": {"code": code, "message": "busy", "type": "server_error"}}
    server = FakeServer(sse_response(f"data: {json.dumps(busy)}\n\n"), sse_response(THREE_CALLS))
    async with server.client() as client:
        events = await collect(model(client, RetryPolicy()), REQUEST)
    assert len(final(events).message.tool_calls) == 3 and len(server.requests) == 2


async def test_a_409_is_retried(autojump_clock: trio.testing.MockClock) -> None:
    conflict = {"error": {"message": "try again", "type": "conflict"}}
    server = FakeServer(json_response(409, conflict), sse_response(THREE_CALLS))
    async with server.client() as client:
        events = await collect(model(client, RetryPolicy()), REQUEST)
    assert len(final(events).message.tool_calls) == 3 and len(server.requests) == 2
