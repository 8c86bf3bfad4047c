"""A `run` request's `settings` and `tools` (issue 14, items 1 and 2): checked with `$.path`
errors, and what reaches the model's request."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from kernel.errors import UsageError
from kernel.models import (
    ModelRequest,
    ScriptedModel,
)
from kernel.settings import ModelSettings
from kernel.wire import Run
from kernel.wire._codec import decode_request, encode
from kernel.wire._frames import FrameError

from .wsclient import connect, open_test_client, open_test_kernel, running_server

ADD = ScriptedModel.reply(calls=[("add", {"a": 2, "b": 40})])


def offered(request: ModelRequest) -> list[str]:
    return [t.name for t in request.tools]


async def test_settings_and_tools_reach_every_model_request_of_the_turn(tmp_path: Path) -> None:
    model = ScriptedModel([ADD, "42"])
    settings = ModelSettings(
        temperature=0.2,
        max_tokens=64,
        stop=("END",),
        seed=7,
        tool_choice="required",
        parallel_tool_calls=False,
        extra={"cache_prompt": True},
    )
    async with open_test_kernel(tmp_path, model=model) as kernel, running_server(kernel) as url:
        async with open_test_client(url) as client:
            result = await client.run("s", "add 2 and 40", settings=settings, tools=["add"])
            entries = (await client.history("s")).entries
    assert result.reason == "final" and result.text == "42" and result.steps == 2
    assert len(model.requests) == 2
    for step, request in enumerate(model.requests):
        assert request.settings is not None
        for name, value in settings.set_fields().items():
            if name == "tool_choice" and step > 0:
                value = "auto"  # a forced choice is met once
            assert getattr(request.settings, name) == value, name
        assert offered(request) == ["add"]
    assert [e["type"] for e in entries] == ["user", "assistant", "tool", "assistant"]


async def test_tools_patterns_select_tools_and_without_them_every_tool_is_offered(
    tmp_path: Path,
) -> None:
    model = ScriptedModel(["one", "two", "three"])
    async with open_test_kernel(tmp_path, model=model) as kernel, running_server(kernel) as url:
        async with open_test_client(url) as client:
            await client.run("s", "hi", tools=["div*", "echo"])
            await client.run("s", "hi", tools=[])
            await client.run("s", "hi")
    assert sorted(offered(model.requests[0])) == ["divide", "echo"]
    assert offered(model.requests[1]) == []
    assert set(offered(model.requests[2])) >= {"add", "divide", "echo", "sleep"}
    # no settings given: the server's own (none here)
    assert model.requests[2].settings in (None, ModelSettings())


async def test_a_reply_cut_by_the_token_limit_ends_the_turn_with_max_tokens(
    tmp_path: Path,
) -> None:
    model = ScriptedModel([ScriptedModel.reply("The files are", stop_reason="max_tokens")])
    async with open_test_kernel(tmp_path, model=model) as kernel, running_server(kernel) as url:
        async with open_test_client(url) as client:
            result = await client.run("s", "list", settings=ModelSettings(max_tokens=3))
    assert result.reason == "max_tokens" and result.text == "The files are"


async def test_bad_settings_and_tools_are_refused_with_their_path_and_nothing_is_recorded(
    tmp_path: Path,
) -> None:
    model = ScriptedModel(["never"])
    run: dict[str, Any] = {"type": "run", "session": "s", "prompt": "hi"}
    cases: list[tuple[dict[str, Any], str, str]] = [
        (
            {"settings": {"temperature": 7}},
            "invalid_request",
            "$.settings.temperature: expected a number from 0 to 2, got 7",
        ),
        ({"settings": {"warmth": 1}}, "invalid_request", "$.settings.warmth: unknown model"),
        ({"settings": {"stop": []}}, "invalid_request", "$.settings.stop: expected 1 to 16"),
        ({"settings": [1]}, "bad_message", "$.settings: expected a mapping"),
        ({"tools": "add"}, "bad_message", "$.tools: invalid value"),
        ({"tools": ["add", 3]}, "bad_message", "$.tools[1]: invalid value for type, expected str"),
        ({"tools": ["nope*"]}, "invalid_request", "tools: no tool matches 'nope*'"),
        (
            {"tools": [], "settings": {"tool_choice": "required"}},
            "invalid_request",
            "tool_choice 'required': the request has no tools",
        ),
        (
            {"tools": ["echo"], "settings": {"tool_choice": "add"}},
            "invalid_request",
            "tool_choice 'add': no such tool in the request (tools: echo)",
        ),
    ]
    async with open_test_kernel(tmp_path, model=model) as kernel, running_server(kernel) as url:
        async with connect(url) as client:
            for number, (fields, code, message) in enumerate(cases):
                _, answer = await client.request({**run, "id": f"r{number}", **fields})
                error = answer["error"]
                assert (error["code"], error["message"][: len(message)]) == (code, message)
                assert answer["type"] == ("error" if code == "bad_message" else "reply")
            _, history = await client.request({"type": "history", "id": "h", "session": "s"})
    assert model.requests == []
    assert history["status"] != "ok" or history["result"]["entries"] == []


def test_a_run_without_settings_or_tools_is_the_same_frame_as_before() -> None:
    plain = Run(id="r1", session="s", prompt="hi")
    assert encode(plain) == '{"v":1,"type":"run","id":"r1","session":"s","prompt":"hi"}'
    full = Run(
        id="r1",
        session="s",
        prompt="hi",
        settings={"max_tokens": 64, "stop": ["END"]},
        tools=("read_*",),
    )
    assert encode(full) == (
        '{"v":1,"type":"run","id":"r1","session":"s","prompt":"hi",'
        '"settings":{"max_tokens":64,"stop":["END"]},"tools":["read_*"]}'
    )


RUN = {"type": "run", "id": "r1", "session": "s", "prompt": "hi", "v": 1}


def run_request(fields: dict[str, Any]) -> Run:
    request = decode_request(json.dumps({**RUN, **fields}))
    assert isinstance(request, Run)
    return request


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"settings": []}, "bad_message: $.settings: expected a mapping"),
        (
            {"settings": {"extra": {"a": {"b": [float("nan")]}}}},
            "bad_message: $.settings.extra.a.b[0]: NaN is not a JSON number",
        ),
        ({"tools": "lookup"}, "bad_message: $.tools: "),
        ({"tools": [1]}, "bad_message: $.tools[0]: "),
        ({"settings": {"extra": {"a": [[[[[[[[1]]]]]]]]}}}, None),
    ],
)
def test_a_ws_run_with_settings_or_tools_of_the_wrong_shape_is_refused_by_path(
    fields: dict[str, Any], message: str | None
) -> None:
    if message is None:  # nested, but within the codec's depth: it decodes
        assert run_request(fields).model_settings() is not None
        return
    with pytest.raises(FrameError) as caught:
        decode_request(json.dumps({**RUN, **fields}))
    assert str(caught.value).startswith(message)


def test_a_ws_run_nested_past_the_codecs_depth_is_refused() -> None:
    deep: Any = 1
    for _ in range(200):
        deep = [deep]
    with pytest.raises(FrameError, match="nested deeper than"):
        decode_request(json.dumps({**RUN, "settings": {"extra": {"a": deep}}}))


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"temperature": "0.5"}, r"^\$\.settings\.temperature: expected a number"),
        ({"extra": {"": 1}}, r"^\$\.settings\.extra: "),
        ({"tool_choice": 3}, r"^\$\.settings\.tool_choice: "),
    ],
)
def test_a_ws_runs_bad_setting_is_named_by_its_path(settings: dict[str, Any], message: str) -> None:
    request = run_request({"settings": settings})
    with pytest.raises(UsageError, match=message):
        request.model_settings()
