"""ModelSettings: validated once, merged by level, and each field as each provider
spells it on the wire — or refused before anything is sent."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from kernel import tool
from kernel.errors import UsageError
from kernel.messages import Message, Text
from kernel.models import (
    AnthropicModel,
    FallbackModel,
    GeminiModel,
    ModelRequest,
    OpenAIModel,
    ProviderError,
    ScriptedModel,
)
from kernel.settings import DEFAULT_MAX_TOKENS, ModelSettings, merge, settings_from_mapping

from .wire import NO_RETRY, FakeServer, json_response, schema_tool, user

TOOLS = (schema_tool("fs.read", "path"), schema_tool("calc", "expr"))
ALL = ModelSettings(
    temperature=0.3,
    top_p=0.9,
    max_tokens=64,
    stop=("END",),
    seed=7,
    tool_choice="fs.read",
    parallel_tool_calls=False,
    reasoning_effort="low",
    extra={"user": "u1"},
)


def request(settings: ModelSettings | None, *, tools: bool = True) -> ModelRequest:
    return ModelRequest((user("hi"),), tools=TOOLS if tools else (), settings=settings)


def build(model: Any, settings: ModelSettings | None, *, tools: bool = True) -> Any:
    _, _, body = model.build(request(settings, tools=tools), stream=False)
    return body


CLIENT = httpx.AsyncClient()
OPENAI = OpenAIModel("gpt-4.1-mini", client=CLIENT, api_key="k", retry=NO_RETRY)
LOCAL = OpenAIModel("local", client=CLIENT, base_url="http://127.0.0.1:9/v1", retry=NO_RETRY)
ANTHROPIC = AnthropicModel("claude-sonnet-4-5", client=CLIENT, api_key="k", retry=NO_RETRY)
GEMINI = GeminiModel("gemini-2.5-flash", client=CLIENT, api_key="k", retry=NO_RETRY)


# -- the record --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"temperature": 7}, "temperature: expected a number from 0 to 2, got 7"),
        ({"temperature": True}, "temperature: expected a number"),
        ({"top_p": 0}, "top_p: expected a number above 0"),
        ({"max_tokens": 0}, "max_tokens: expected a whole number of at least 1, got 0"),
        ({"max_tokens": 1.5}, "max_tokens: expected a whole number"),
        ({"seed": "7"}, "seed: expected a whole number"),
        ({"tool_choice": ""}, "tool_choice: expected 'auto', 'required', 'none' or a tool"),
        ({"parallel_tool_calls": 1}, "parallel_tool_calls: expected true or false"),
        ({"reasoning_effort": "max"}, "reasoning_effort: expected one of minimal, low"),
        ({"stop": []}, "stop: expected 1 to 16 non-empty strings"),
        ({"stop": [""]}, "stop: expected 1 to 16 non-empty strings"),
        ({"extra": {"": 1}}, "extra: expected a mapping"),
    ],
)
def test_bad_values_are_one_line_naming_the_field(fields: dict[str, Any], message: str) -> None:
    with pytest.raises(UsageError, match="^" + message.replace("(", r"\(")):
        ModelSettings(**fields)


def test_levels_merge_field_by_field_the_nearer_winning() -> None:
    kernel = ModelSettings(temperature=0.1, max_tokens=100, extra={"a": 1, "b": 1})
    turn = ModelSettings(max_tokens=10, tool_choice="none", extra={"b": 2})
    merged = merge(kernel, None, turn)
    assert merged == ModelSettings(
        temperature=0.1, max_tokens=10, tool_choice="none", extra={"a": 1, "b": 2}
    )
    assert merge() == ModelSettings()


def test_settings_from_json_name_their_path() -> None:
    assert settings_from_mapping({"stop": "X", "seed": 3}) == ModelSettings(stop=("X",), seed=3)
    with pytest.raises(UsageError, match=r"^\$\.settings\.temperature: expected a number"):
        settings_from_mapping({"temperature": "hot"}, "$.settings")
    with pytest.raises(UsageError, match=r"^\$\.settings\.tempreature: unknown model setting"):
        settings_from_mapping({"tempreature": 1}, "$.settings")
    with pytest.raises(UsageError, match=r"^\$\.settings: expected an object"):
        settings_from_mapping([1], "$.settings")


def test_a_default_max_tokens_is_always_sent() -> None:
    assert build(OPENAI, None)["max_completion_tokens"] == DEFAULT_MAX_TOKENS
    assert build(LOCAL, None)["max_tokens"] == DEFAULT_MAX_TOKENS
    assert build(ANTHROPIC, None)["max_tokens"] == DEFAULT_MAX_TOKENS
    assert build(GEMINI, None)["generationConfig"]["maxOutputTokens"] == DEFAULT_MAX_TOKENS
    # The request's own max_tokens / temperature still count, under settings.
    legacy = ModelRequest((user("hi"),), max_tokens=5, temperature=0.5)
    assert OPENAI.build(legacy, stream=False)[2]["max_completion_tokens"] == 5
    both = ModelRequest((user("hi"),), max_tokens=5, settings=ModelSettings(max_tokens=9))
    assert OPENAI.build(both, stream=False)[2]["max_completion_tokens"] == 9


@pytest.mark.parametrize(
    ("text", "field"),
    [
        ('{"temperature": NaN}', "temperature"),
        ('{"temperature": Infinity}', "temperature"),
        ('{"temperature": 1e999}', "temperature"),
        ('{"top_p": -Infinity}', "top_p"),
        ('{"max_tokens": true}', "max_tokens"),
        ('{"max_tokens": 64.0}', "max_tokens"),
        ('{"seed": 9223372036854775808}', "seed"),
        ('{"parallel_tool_calls": 1}', "parallel_tool_calls"),
        ('{"tool_choice": " required"}', "tool_choice"),
        ('{"stop": ["ok", ""]}', "stop"),
        ('{"extra": {"": 1}}', "extra"),
        ('{"extra": [1]}', "extra"),
    ],
)
def test_non_finite_bool_as_int_and_out_of_range_values_are_refused_by_name(
    text: str, field: str
) -> None:
    # json.loads (as the CLI's --set and a WebSocket frame read them) accepts NaN/Infinity.
    with pytest.raises(UsageError, match=rf"^\$\.settings\.{field}: "):
        settings_from_mapping(json.loads(text), "$.settings")


def test_stop_given_as_an_object_is_refused() -> None:
    with pytest.raises(UsageError, match=r"^\$\.settings\.stop: "):
        settings_from_mapping({"stop": {"a": 1}}, "$.settings")


def test_stop_given_as_a_number_is_a_usage_error_naming_stop() -> None:
    with pytest.raises(UsageError, match=r"^stop: "):
        ModelSettings(stop=5)  # type: ignore[arg-type]
    with pytest.raises(UsageError, match=r"^\$\.settings\.stop: "):
        settings_from_mapping({"stop": 5}, "$.settings")


# -- each provider's wire names ----------------------------------------------------------


def test_openai_spells_every_field() -> None:
    body = build(OPENAI, ALL)
    assert {k: v for k, v in body.items() if k not in ("model", "messages", "tools")} == {
        "max_completion_tokens": 64,
        "temperature": 0.3,
        "top_p": 0.9,
        "stop": ["END"],
        "seed": 7,
        "tool_choice": {"type": "function", "function": {"name": "fs__read"}},
        "parallel_tool_calls": False,
        "reasoning_effort": "low",
        "user": "u1",
    }
    for choice in ("auto", "required", "none"):
        assert build(OPENAI, ModelSettings(tool_choice=choice))["tool_choice"] == choice


def test_openai_without_tools_sends_no_tool_fields() -> None:
    body = build(OPENAI, ModelSettings(tool_choice="auto", parallel_tool_calls=True), tools=False)
    assert "tool_choice" not in body and "parallel_tool_calls" not in body


def test_anthropic_spells_what_it_can_and_refuses_the_rest() -> None:
    fields = ALL.set_fields()
    del fields["seed"], fields["reasoning_effort"]
    body = build(ANTHROPIC, ModelSettings(**fields))
    assert {k: v for k, v in body.items() if k not in ("model", "messages", "tools")} == {
        "max_tokens": 64,
        "temperature": 0.3,
        "top_p": 0.9,
        "stop_sequences": ["END"],
        "tool_choice": {"type": "tool", "name": "fs__read", "disable_parallel_tool_use": True},
        "user": "u1",
    }
    spelled = {
        "auto": {"type": "auto"},
        "required": {"type": "any"},
        "none": {"type": "none"},
    }
    for choice, wire in spelled.items():
        assert build(ANTHROPIC, ModelSettings(tool_choice=choice))["tool_choice"] == wire
    no_parallel = build(ANTHROPIC, ModelSettings(parallel_tool_calls=False))
    assert no_parallel["tool_choice"] == {"type": "auto", "disable_parallel_tool_use": True}
    with pytest.raises(UsageError, match=r"^anthropic: seed, reasoning_effort cannot be expressed"):
        build(ANTHROPIC, ALL)


def test_gemini_spells_what_it_can_and_refuses_the_rest() -> None:
    fields = ALL.set_fields()
    del fields["reasoning_effort"], fields["parallel_tool_calls"]
    body = build(GEMINI, ModelSettings(**fields))
    assert body["generationConfig"] == {
        "maxOutputTokens": 64,
        "temperature": 0.3,
        "topP": 0.9,
        "seed": 7,
        "stopSequences": ["END"],
    }
    assert body["toolConfig"] == {
        "functionCallingConfig": {"mode": "ANY", "allowedFunctionNames": ["fs.read"]}
    }
    assert body["user"] == "u1"
    for choice, mode in (("auto", "AUTO"), ("required", "ANY"), ("none", "NONE")):
        config = build(GEMINI, ModelSettings(tool_choice=choice))["toolConfig"]
        assert config == {"functionCallingConfig": {"mode": mode}}
    with pytest.raises(UsageError, match=r"^gemini: reasoning_effort cannot be expressed"):
        build(GEMINI, ModelSettings(reasoning_effort="low"))
    with pytest.raises(UsageError, match=r"^gemini: parallel_tool_calls false cannot"):
        build(GEMINI, ModelSettings(parallel_tool_calls=False))


@pytest.mark.parametrize("model", [OPENAI, ANTHROPIC, GEMINI], ids=lambda m: m.provider)
def test_a_tool_choice_the_tools_cannot_meet_is_refused(model: Any) -> None:
    with pytest.raises(UsageError, match=r"^tool_choice 'web\.fetch': no such tool"):
        build(model, ModelSettings(tool_choice="web.fetch"))
    with pytest.raises(UsageError, match=r"^tool_choice 'required': the request has no tools"):
        build(model, ModelSettings(tool_choice="required"), tools=False)


async def test_settings_reach_the_wire_and_a_refusal_sends_nothing() -> None:
    answer = {
        "id": "x",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"}}],
        "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
    }
    server = FakeServer(json_response(200, answer))
    async with server.client() as client:
        local = OpenAIModel("local", client=client, base_url="http://127.0.0.1:9/v1")
        await local.complete(request(ModelSettings(tool_choice="required", max_tokens=64)))
        assert server.body()["tool_choice"] == "required"
        assert server.body()["max_tokens"] == 64
        anthropic = AnthropicModel("claude-sonnet-4-5", client=client, api_key="k")
        with pytest.raises(UsageError):
            await anthropic.complete(request(ModelSettings(seed=1)))
    assert len(server.requests) == 1


class Down:
    name = "down:model"

    async def complete(self, request: ModelRequest) -> Any:
        raise ProviderError("down", "unavailable", status=503, retryable=True)

    def stream(self, request: ModelRequest) -> Any:
        raise ProviderError("down", "unavailable", status=503, retryable=True)


async def test_a_fallback_models_own_settings_go_under_the_requests() -> None:
    backup = ScriptedModel(["ok"])
    chain = FallbackModel(
        [Down(), backup],
        settings=[ModelSettings(seed=1), ModelSettings(max_tokens=5, temperature=0.9)],
    )
    request = ModelRequest((user("hi"),), settings=ModelSettings(temperature=0.1))
    await chain.complete(request)
    (sent,) = backup.requests
    assert sent.settings == ModelSettings(max_tokens=5, temperature=0.1)  # the request's wins
    with pytest.raises(UsageError, match="settings has 1 entries for 2 models"):
        FallbackModel([Down(), backup], settings=[None])


@tool
async def lookup(term: str) -> str:
    """Look a term up."""
    return f"{term}: found"


def openai_body(settings: ModelSettings, *, stream: bool = False) -> dict[str, Any]:
    request = ModelRequest((Message("user", [Text("hi")]),), tools=[lookup], settings=settings)
    _, _, body = LOCAL.build(request, stream=stream)
    return body  # type: ignore[no-any-return]


def test_a_huge_max_tokens_and_a_long_stop_string_go_on_the_wire_as_given() -> None:
    # No upper bound is the kernel's to know (the server refuses what it cannot do);
    # a 10 MB stop string is the caller's own business. Both reach the body unchanged.
    long = "x" * 10_000_000
    body = openai_body(ModelSettings(max_tokens=10**30, stop=long))
    assert body["max_tokens"] == 10**30
    assert body["stop"] == [long]


def test_extra_cannot_put_a_non_finite_number_on_the_wire() -> None:
    # tak run --set extra.temperature=NaN, or [model.settings] extra = {x = nan} in tak.toml.
    with pytest.raises(UsageError, match="extra"):
        body = openai_body(ModelSettings(extra={"temperature": float("nan")}))
        json.dumps(body, allow_nan=False)  # what a provider can parse


@pytest.mark.parametrize(
    ("key", "value"),
    [("messages", []), ("model", "another-model"), ("tools", []), ("stream", True)],
)
def test_extra_cannot_replace_the_keys_the_adapter_owns(key: str, value: object) -> None:
    try:
        body = openai_body(ModelSettings(extra={key: value}), stream=False)
    except UsageError:
        return  # refused before sending: fine
    assert body[key] != value, f"extra replaced {key!r}"


def test_extra_cannot_turn_a_streamed_request_into_a_plain_one() -> None:
    with pytest.raises(UsageError, match="extra: stream is built from the request"):
        openai_body(ModelSettings(extra={"stream": False}), stream=True)


async def test_a_fallback_chains_settings_stay_under_the_requests_max_tokens() -> None:
    inner = ScriptedModel(["ok"])
    chain = FallbackModel([inner], settings=[ModelSettings(max_tokens=2000, temperature=0.5)])
    await chain.complete(ModelRequest((Message("user", [Text("hi")]),), max_tokens=100))
    sent = inner.requests[0].effective_settings()
    assert (sent.max_tokens, sent.temperature) == (100, 0.5)
