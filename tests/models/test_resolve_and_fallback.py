"""Model strings, API keys from the environment, and fallback chains."""

from __future__ import annotations

import httpx
import pytest
import trio
import trio.testing

from kernel.errors import UsageError
from kernel.models import (
    AnthropicModel,
    FallbackModel,
    GeminiModel,
    ModelRequest,
    OpenAIModel,
    ProviderError,
    RetryPolicy,
    ScriptedModel,
    TextDelta,
    _scripted,
    register_scripted_model,
    resolve_model,
)

from . import test_openai
from .wire import FakeServer, collect, final, json_response, sse_response, user

REQUEST = ModelRequest((user("hi"),))
KEYS = {"OPENAI_API_KEY": "sk-o", "ANTHROPIC_API_KEY": "sk-a", "GEMINI_API_KEY": "g"}


async def test_each_provider_resolves_with_its_key_and_base_url() -> None:
    async with httpx.AsyncClient() as client:
        openai = resolve_model("openai:gpt-4.1-mini", client=client, env=KEYS)
        anthropic = resolve_model("anthropic:claude-sonnet-4-5", client=client, env=KEYS)
        gemini = resolve_model("gemini:gemini-2.5-flash", client=client, env=KEYS)
        local = resolve_model(
            "openai:llama3:8b",
            client=client,
            env={"OPENAI_BASE_URL": "http://localhost:11434/v1"},
        )
    assert isinstance(openai, OpenAIModel) and openai.api_key == "sk-o"
    assert openai.base_url == "https://api.openai.com/v1"
    assert isinstance(anthropic, AnthropicModel) and anthropic.api_key == "sk-a"
    assert isinstance(gemini, GeminiModel) and gemini.name == "gemini:gemini-2.5-flash"
    # A local server needs no key, and a model name may hold ":".
    assert isinstance(local, OpenAIModel) and local.api_key is None
    assert (local.model, local.base_url) == ("llama3:8b", "http://localhost:11434/v1")


async def test_unknown_provider_lists_the_known_ones() -> None:
    with pytest.raises(
        UsageError, match=r"unknown provider 'mistral'.*openai, anthropic, gemini, scripted"
    ):
        resolve_model("mistral:large", env=KEYS)
    with pytest.raises(UsageError, match="write provider:model"):
        resolve_model("gpt-4.1-mini", env=KEYS)


async def test_missing_key_names_the_variable() -> None:
    async with httpx.AsyncClient() as client:
        with pytest.raises(UsageError, match="set ANTHROPIC_API_KEY"):
            resolve_model("anthropic:claude-sonnet-4-5", client=client, env={})
        with pytest.raises(UsageError, match="set GEMINI_API_KEY"):
            resolve_model(
                "gemini:gemini-2.5-flash",
                client=client,
                env={"GEMINI_BASE_URL": "https://proxy.example.com/v1beta"},
            )
        with pytest.raises(UsageError, match="OPENAI_BASE_URL='ftp://x' is not an http"):
            resolve_model("openai:m", client=client, env={"OPENAI_BASE_URL": "ftp://x"})
    with pytest.raises(UsageError, match=r"needs an httpx\.AsyncClient"):
        resolve_model("openai:gpt-4.1-mini", env=KEYS)


def test_scripted_models_by_name(monkeypatch: pytest.MonkeyPatch) -> None:
    # Registration is process-wide: give this test its own table.
    monkeypatch.setattr(_scripted, "_SCRIPTS", dict(_scripted._SCRIPTS))
    assert resolve_model("scripted:demo").name == "scripted:demo"
    with pytest.raises(UsageError, match="known: scripted:demo, scripted:echo"):
        resolve_model("scripted:nope")
    register_scripted_model(
        "test-hello", lambda: ScriptedModel(["hello"], name="scripted:test-hello")
    )
    assert resolve_model("scripted:test-hello").name == "scripted:test-hello"
    with pytest.raises(UsageError, match="already registered"):
        register_scripted_model("test-hello", lambda: ScriptedModel(["again"]))


async def test_fallbacks_make_a_chain() -> None:
    model = resolve_model("scripted:echo", fallbacks=["scripted:demo"])
    assert isinstance(model, FallbackModel)
    assert [m.name for m in model.models] == ["scripted:echo", "scripted:demo"]
    assert model.name == "scripted:echo"


async def test_a_provider_that_stays_down_falls_back_to_the_next(
    autojump_clock: trio.testing.MockClock,
) -> None:
    server = FakeServer(*(json_response(503, {"error": {"message": "down"}}) for _ in range(2)))
    async with server.client() as client:
        primary = OpenAIModel(
            "gpt-4.1-mini", client=client, api_key="k", retry=RetryPolicy(max_attempts=2)
        )
        model = FallbackModel([primary, ScriptedModel(["from the fallback"] * 2)])
        response = await model.complete(REQUEST)
        assert response.message.text == "from the fallback"
        assert len(server.requests) == 2  # the primary's own retries came first

        server.answers = [json_response(503, {"error": {"message": "down"}})] * 2
        events = await collect(model, REQUEST)
    assert final(events).message.text == "from the fallback"


async def test_a_bad_request_does_not_fall_back() -> None:
    server = FakeServer(
        json_response(400, {"error": {"message": "bad", "type": "invalid_request_error"}})
    )
    backup = ScriptedModel(["never"])
    async with server.client() as client:
        primary = OpenAIModel("gpt-4.1-mini", client=client, api_key="k")
        with pytest.raises(ProviderError, match="bad"):
            await FallbackModel([primary, backup]).complete(REQUEST)
    assert backup.requests == []


async def test_when_every_model_fails_the_last_error_carries_the_others() -> None:
    first = ProviderError("openai", "rate limited", status=429, retryable=True)
    last = ProviderError("anthropic", "overloaded", status=529, retryable=True)
    model = FallbackModel(
        [ScriptedModel([first], name="scripted:a"), ScriptedModel([last], name="scripted:b")]
    )
    with pytest.raises(ProviderError) as caught:
        async with model.stream(REQUEST) as events:
            async for _ in events:
                pass
    assert caught.value is last
    assert caught.value.__notes__ == ["scripted:a failed first: openai: HTTP 429: rate limited"]


async def test_a_stream_does_not_fall_back_after_its_first_event() -> None:
    cut = test_openai.chunk({"content": "Hel"})  # and then the body ends
    server = FakeServer(sse_response(cut))
    backup = ScriptedModel(["never"])
    seen: list[object] = []
    async with server.client() as client:
        primary = OpenAIModel("m", client=client, api_key="k", retry=RetryPolicy(max_attempts=1))
        with pytest.raises(ProviderError, match="ended early"):
            async with FallbackModel([primary, backup]).stream(REQUEST) as events:
                async for event in events:
                    seen.append(event)
    assert seen == [TextDelta("Hel")]
    assert backup.requests == []
