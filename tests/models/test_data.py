"""Usage, prices, server-sent events and the package's public surface."""

from __future__ import annotations

import subprocess
import sys

import pytest

import kernel.models
from kernel.models import PRICES, Price, Usage, find_price
from kernel.models._prices import cost_of
from kernel.models._sse import SSEDecoder, SSEEvent


def test_usage_adds_up_and_unknown_cost_is_no_cost() -> None:
    a = Usage(10, 5, cache_read_tokens=100, cost_usd=None)
    b = Usage(1, 2, cache_write_tokens=3, cost_usd=0.25)
    total = a + b
    assert total == Usage(11, 7, 100, 3, 0.25)
    assert total.total_input_tokens == 114
    assert total.total_tokens == 121
    assert (total + Usage(cost_usd=0.5)).cost_usd == 0.75
    assert (Usage() + Usage()).cost_usd is None


def test_prices_match_dated_snapshots_but_nothing_looser() -> None:
    assert find_price("claude-sonnet-4-5-20250929") == PRICES["claude-sonnet-4-5"]
    assert find_price("gpt-4.1-mini-2025-04-14") == PRICES["gpt-4.1-mini"]
    assert find_price("gpt-4o-audio-preview") is None
    assert find_price("my-model") is None
    mine = Price(1.0, 2.0)
    assert find_price("my-model", {"my-model": mine}) is mine
    assert find_price("gpt-4o", {"gpt-4o": mine}) is mine  # overrides the table
    # A cache price left out is the input price.
    assert cost_of(Usage(0, 0, 1_000_000, 1_000_000), mine) == pytest.approx(2.0)
    assert cost_of(Usage(1), None) is None


def feed(lines: list[str]) -> list[SSEEvent]:
    decoder = SSEDecoder()
    return [e for line in lines if (e := decoder.feed(line)) is not None]


def test_sse_events_follow_the_spec() -> None:
    lines = [
        ": a comment",
        "event: content_block_delta",
        'data: {"a":',
        "data:  1}",
        "id: 7",
        "retry: 1000",
        "",
        "data:no space",
        "",
        "event: lonely",  # no data: nothing is dispatched
        "",
        "data: cut off at the end",
    ]
    assert feed(lines) == [
        SSEEvent("content_block_delta", '{"a":\n 1}', "7"),
        SSEEvent("message", "no space", "7"),
    ]


def test_public_names() -> None:
    assert set(kernel.models.__all__) == {
        "PRICES", "PROVIDERS", "STOP_REASONS",
        "AnthropicModel", "FallbackModel", "GeminiModel", "OpenAIModel", "ScriptedModel",
        "Model", "ModelEvent", "ModelRequest", "ModelResponse", "ProviderError",
        "ResponseComplete", "RetryPolicy", "StopReason", "TextDelta", "ToolCallDelta",
        "Usage", "Price", "find_price", "open_http_client", "register_scripted_model",
        "resolve_model", "openai_tools", "anthropic_tools", "gemini_tools",
        "BudgetLimits", "Grant", "ModelBudget", "ProviderLoad", "ReplayModel",
    }  # fmt: skip
    for name in kernel.models.__all__:
        assert getattr(kernel.models, name) is not None
    assert issubclass(kernel.models.ProviderError, kernel.ModelAPIError)


def test_import_kernel_does_not_load_the_models() -> None:
    code = "import sys, kernel; print('httpx' in sys.modules, 'kernel.models' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "False"]


async def test_open_http_client_sets_timeouts_and_closes() -> None:
    async with kernel.models.open_http_client() as client:
        assert (client.timeout.connect, client.timeout.read) == (15.0, 300.0)
    assert client.is_closed
