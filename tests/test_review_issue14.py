"""Review of issue 14 (model settings, tools per run, honest outcomes, the front door):
what a hostile or careless user can do to it. A test marked ``xfail(strict=True)``
exposes a bug (its reason says which); the plain ones show a guarantee that holds."""

from __future__ import annotations

import argparse
import contextlib
import errno
import json
import shlex
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

from kernel import cli, tool
from kernel.agent import Agent, AgentEvent, RunLimits, TurnFinished
from kernel.errors import StoreError, UsageError
from kernel.messages import Message, Text
from kernel.models import (
    FallbackModel,
    ModelEvent,
    ModelRequest,
    ModelResponse,
    OpenAIModel,
    ScriptedModel,
    TextDelta,
    ToolCallDelta,
)
from kernel.session import Session
from kernel.settings import ModelSettings, settings_from_mapping
from kernel.store import MemoryStore, SessionKey
from kernel.wire._codec import decode_request
from kernel.wire._frames import FrameError, Run

reply = ScriptedModel.reply


@tool
async def lookup(term: str) -> str:
    """Look a term up."""
    return f"{term}: found"


@tool
async def wipe(path: str) -> str:
    """Delete everything below a path."""
    return f"wiped {path}"


def session() -> Session:
    return Session(MemoryStore(), SessionKey("p", "s1"))


LOCAL = OpenAIModel("local", client=httpx.AsyncClient(), base_url="http://127.0.0.1:9/v1")


def openai_body(settings: ModelSettings, *, stream: bool = False) -> dict[str, Any]:
    request = ModelRequest((Message("user", [Text("hi")]),), tools=[lookup], settings=settings)
    _, _, body = LOCAL.build(request, stream=stream)
    return body  # type: ignore[no-any-return]


# -- settings values at the edges ----------------------------------------------------------


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


def test_tak_run_set_stop_to_a_number_is_one_line_naming_the_flag(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code = cli.main(["--home", str(tmp_path / "home"), "run", "hi", "--set", "stop=5"])
    err = capsys.readouterr().err
    assert code == 2
    assert err.startswith("tak run: --set stop: ") and "internal error" not in err


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


# -- tak run flags --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("argv", "start"),
    [
        (["--set", "temperature"], "tak run: --set: expected KEY=VALUE, got 'temperature'"),
        (["--set", "=1"], "tak run: --set: expected KEY=VALUE, got '=1'"),
        (["--set", "extra.=1"], "tak run: --set extra.: "),
        (["--set", "bogus=1"], "tak run: --set bogus: unknown model setting"),
        (["--temperature", "NaN"], "tak run: --temperature: expected a number from 0 to 2"),
        (["--temperature", "Infinity"], "tak run: --temperature: expected a number"),
        (["--max-tokens", "true"], "tak run: --max-tokens: expected a whole number"),
        (["--max-tokens", "1e400"], "tak run: --max-tokens: expected a whole number"),
        (["--seed", "1.5"], "tak run: --seed: expected a whole number"),
        (["--tools", "["], "tak run: tools: no tool matches '['"),
        (["--tools", "", "--tool-choice", "required"], "tak run: tool_choice 'required'"),
    ],
)
def test_odd_flags_are_one_line_with_exit_2_and_nothing_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str], start: str
) -> None:
    code = cli.main(["--home", str(tmp_path / "home"), "run", "hi", *argv])
    out, err = capsys.readouterr()
    assert code == 2
    assert err.startswith(start), err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert "transcript:" not in out


def test_set_extra_with_a_dotted_key_is_one_flat_body_key(tmp_path: Path) -> None:
    # --set extra.x.y=1 is documented as extra.KEY: the key is "x.y", not {"x": {"y": 1}}.
    from kernel.cli.run import model_settings

    parser = cli.build_parser()
    args = parser.parse_args(["run", "hi", "--set", "extra.x.y=1", "--set", 'extra.z={"a":1}'])
    settings = model_settings(args)
    assert settings is not None and settings.extra == {"x.y": 1, "z": {"a": 1}}


def test_tools_empty_string_offers_no_tools(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # `--tools ""` (an empty shell variable) is an empty allow-list: the turn runs with
    # no tool schemas at all, as tools=[] does.
    code = cli.main(["--home", str(tmp_path / "home"), "run", "list the files", "--tools", ""])
    assert code == 0
    assert "→" not in capsys.readouterr().out  # no call was made


# -- tools per run ---------------------------------------------------------------------------


async def test_star_and_a_long_list_of_patterns_select_as_expected() -> None:
    model = ScriptedModel(["a", "b"])
    agent = Agent(model, [lookup, wipe], subagents=True)
    await agent.run_turn(session(), "hi", tools=["*"])
    await agent.run_turn(session(), "hi", tools=["lookup"] * 5000 + ["w?pe"])
    assert sorted(t.name for t in model.requests[0].tools) == ["delegate", "lookup", "wipe"]
    assert [t.name for t in model.requests[1].tools] == ["lookup", "wipe"]


async def test_tool_choice_naming_delegate_needs_subagents() -> None:
    s = session()
    with pytest.raises(UsageError, match="tool_choice 'delegate': no such tool"):
        await Agent(ScriptedModel(["x"]), [lookup]).run_turn(
            s, "hi", settings=ModelSettings(tool_choice="delegate")
        )
    assert await s.messages() == []
    model = ScriptedModel(["x"])
    await Agent(model, [lookup], subagents=True).run_turn(
        s, "hi", settings=ModelSettings(tool_choice="delegate")
    )
    assert model.requests[0].effective_settings().tool_choice == "delegate"


async def test_delegate_cannot_reach_a_tool_the_turn_did_not_select() -> None:
    model = ScriptedModel(
        [
            reply(calls=[("delegate", {"task": "clean up", "tools": ["wipe"]})]),
            reply(calls=[("wipe", {"path": "/"})]),
            "child done",
            "parent done",
        ]
    )
    agent = Agent(model, [lookup, wipe], subagents=True)
    await agent.run_turn(session(), "hi", tools=["lookup", "delegate"])
    offered = {t.name for request in model.requests for t in request.tools}
    assert "wipe" not in offered


async def test_a_subagent_asks_with_the_parents_settings() -> None:
    model = ScriptedModel(
        [reply(calls=[("delegate", {"task": "look it up"})]), "child done", "parent done"]
    )
    agent = Agent(
        model, [lookup], subagents=True, settings=ModelSettings(max_tokens=64, temperature=0.1)
    )
    await agent.run_turn(session(), "hi")
    child = model.requests[1].effective_settings()
    assert (child.max_tokens, child.temperature) == (64, 0.1)


async def test_a_fallback_chains_settings_stay_under_the_requests_max_tokens() -> None:
    inner = ScriptedModel(["ok"])
    chain = FallbackModel([inner], settings=[ModelSettings(max_tokens=2000, temperature=0.5)])
    await chain.complete(ModelRequest((Message("user", [Text("hi")]),), max_tokens=100))
    sent = inner.requests[0].effective_settings()
    assert (sent.max_tokens, sent.temperature) == (100, 0.5)


# -- honest outcomes ---------------------------------------------------------------------------


class Hang:
    """Streams some text (and, optionally, the start of a tool call), then hangs or fails."""

    name = "fake:hang"

    def __init__(self, *, fail: bool = False, with_call: bool = False) -> None:
        self.fail = fail
        self.with_call = with_call

    @contextlib.asynccontextmanager
    async def stream(self, request: ModelRequest) -> AsyncIterator[AsyncIterator[ModelEvent]]:
        async def events() -> AsyncIterator[ModelEvent]:
            yield TextDelta("partial words")
            if self.with_call:
                yield ToolCallDelta(0, "call_0", "lookup", '{"term": "x"')
            if self.fail:
                from kernel.models import ProviderError

                raise ProviderError("fake", "went away", status=None)
            await trio.sleep_forever()

        yield events()

    async def complete(self, request: ModelRequest) -> ModelResponse:
        raise NotImplementedError


class PartialStoreFails(Session):
    async def record_partial(self, text: str, *, model: str | None = None) -> None:
        raise StoreError("disk full")


async def test_a_failing_partial_record_does_not_swallow_the_cancellation(
    autojump_clock: trio.abc.Clock,
) -> None:
    s = PartialStoreFails(MemoryStore(), SessionKey("p", "s1"))
    events: list[AgentEvent] = []
    with trio.move_on_after(5) as scope:
        await Agent(Hang()).run_turn(s, "q", on_event=events.append)
    assert scope.cancelled_caught
    assert isinstance(events[-1], TurnFinished) and events[-1].reason == "cancelled"


async def test_a_failing_partial_record_after_a_model_failure_leaves_a_valid_transcript() -> None:
    s = PartialStoreFails(MemoryStore(), SessionKey("p", "s1"))
    with contextlib.suppress(StoreError):
        await Agent(Hang(fail=True)).run_turn(s, "q")
    assert [(m.role, m.text) for m in await s.messages()] == [("user", "q")]


async def test_a_cut_reply_with_a_half_streamed_call_records_only_its_text(
    autojump_clock: trio.abc.Clock,
) -> None:
    # The call never completed: nothing recorded may be a call without a result.
    for model in (Hang(with_call=True), Hang(with_call=True, fail=True)):
        s = session()
        with trio.move_on_after(5):
            await Agent(model, [lookup]).run_turn(s, "q")
        messages = await s.messages()
        assert [(m.role, m.text, m.tool_calls) for m in messages] == [
            ("user", "q", ()),
            ("assistant", "partial words", ()),
        ]


async def test_a_cancel_during_the_partial_record_still_records_it(
    autojump_clock: trio.abc.Clock,
) -> None:
    class SlowPartial(Session):
        async def record_partial(self, text: str, *, model: str | None = None) -> None:
            await trio.sleep(1)  # a second cancel lands here; the record is shielded
            await super().record_partial(text, model=model)

    s = SlowPartial(MemoryStore(), SessionKey("p", "s1"))
    async with trio.open_nursery() as nursery:

        async def turn() -> None:
            await Agent(Hang()).run_turn(s, "q")

        nursery.start_soon(turn)
        await trio.sleep(1)
        nursery.cancel_scope.cancel()
    assert [(m.role, m.text) for m in await s.messages()] == [
        ("user", "q"),
        ("assistant", "partial words"),
    ]


async def test_a_reply_cut_by_max_tokens_with_calls_leaves_every_call_answered() -> None:
    # A reply cut among its calls runs none of them (their arguments may be cut: issue
    # 22); only its text is recorded, so the transcript holds no call without a result.
    model = ScriptedModel(
        [
            reply(
                "Let me look",
                calls=[("lookup", {"term": "a"}), ("lookup", '{"term": "b')],
                stop_reason="max_tokens",
            ),
            "done",
        ]
    )
    s = session()
    finished = await Agent(model, [lookup]).run_turn(s, "q")
    assert finished.reason == "max_tokens"
    assert finished.error is not None and "inside its tool calls (lookup)" in finished.error
    messages = await s.messages()
    calls = [c.id for m in messages for c in m.tool_calls]
    answered = [o.call_id for m in messages for o in m.observations]
    assert calls == answered == []
    assert [m.role for m in messages] == ["user", "assistant"]
    assert messages[1].text == "Let me look"


# -- the front door ----------------------------------------------------------------------------


def fake_command(
    monkeypatch: pytest.MonkeyPatch, raise_: BaseException, *, debug: bool = False
) -> None:
    def boom(args: argparse.Namespace) -> int:
        raise raise_

    parser = argparse.ArgumentParser(prog="tak")
    parser.set_defaults(func=boom, command="x", debug=debug)
    monkeypatch.setattr(cli, "build_parser", lambda: parser)


def test_system_exit_from_a_command_is_not_swallowed(monkeypatch: pytest.MonkeyPatch) -> None:
    fake_command(monkeypatch, SystemExit(3))
    with pytest.raises(SystemExit) as caught:
        cli.main([])
    assert caught.value.code == 3


def test_keyboard_interrupt_inside_a_group_is_130(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    fake_command(
        monkeypatch, BaseExceptionGroup("g", [BaseExceptionGroup("h", [KeyboardInterrupt()])])
    )
    assert cli.main([]) == 130
    assert capsys.readouterr().err == "\ntak x: interrupted\n"


def test_a_broken_pipe_that_is_not_stdout_is_an_error(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # stdout is fine here (pytest's capture); the pipe that broke was another one.
    fake_command(monkeypatch, BrokenPipeError(errno.EPIPE, "Broken pipe"))
    code = cli.main([])
    assert code != 0
    assert "Broken pipe" in capsys.readouterr().err


def test_an_unexpected_error_is_one_line_naming_debug(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    fake_command(monkeypatch, RuntimeError("multi\nline"))
    assert cli.main([]) == 1
    err = capsys.readouterr().err
    assert err.startswith("tak x: internal error: RuntimeError") and "--debug" in err


@pytest.mark.parametrize(
    "home", ["/tmp/my home", "/tmp/it's here", '/tmp/"quoted" $HOME `x`', "-starts-with-dash"]
)
def test_the_show_it_hint_is_runnable_as_printed_with_any_home(home: str) -> None:
    from kernel.cli._common import home_option, tak_command

    hint = tak_command(*home_option(home), "sessions", "show", "abc", "--project", "my proj")
    words = shlex.split(hint)
    assert words[1:] == ["--home", home, "sessions", "show", "abc", "--project", "my proj"]


def test_a_tak_home_with_a_newline_is_usable_and_its_hint_round_trips(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    home = tmp_path / "odd\nhome"
    code = cli.main(["--home", str(home), "run", "hi"])
    assert code == 0
    out = capsys.readouterr().out
    hint = out.split("show it:    ", 1)[1].rstrip("\n")
    words = shlex.split(hint)
    assert words[words.index("--home") + 1] == str(home)


# -- WebSocket run: settings and tools of the wrong shape -------------------------------------

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


# -- ToolFailure kinds -------------------------------------------------------------------------


async def test_a_tool_failure_of_an_unknown_kind_is_an_exception_observation_saying_so() -> None:
    @tool
    async def find(name: str) -> str:
        """Find a thing."""
        from kernel.tools import ToolFailure

        raise ToolFailure("not_found", f"{name} is not here")  # type: ignore[arg-type]

    model = ScriptedModel([reply(calls=[("find", {"name": "x"})]), "done"])
    s = session()
    result = await Agent(model, [find]).run_turn(s, "q")
    assert result.reason == "final"
    (observation,) = [o for m in await s.messages() for o in m.observations]
    assert observation.error is not None and observation.error.kind == "exception"
    assert "'not_found' is not one of" in observation.content


# -- a forced tool choice, and the requests settings do not reach ------------------------------


class Obedient:
    """Calls ``lookup`` whenever the request forces a tool call; answers in text otherwise
    (as a model that honours ``tool_choice`` does)."""

    name = "fake:obedient"

    def __init__(self) -> None:
        self.requests: list[ModelRequest] = []

    @contextlib.asynccontextmanager
    async def stream(self, request: ModelRequest) -> AsyncIterator[AsyncIterator[ModelEvent]]:
        from kernel.models._assemble import events_of

        self.requests.append(request)
        forced = request.effective_settings().tool_choice not in (None, "auto", "none")
        answer = reply(calls=[("lookup", {"term": "x"})]) if forced else reply("x: found")

        async def events() -> AsyncIterator[ModelEvent]:
            for event in events_of(answer):
                yield event

        yield events()

    async def complete(self, request: ModelRequest) -> ModelResponse:
        raise NotImplementedError


@pytest.mark.parametrize("choice", ["required", "lookup"])
async def test_a_forced_tool_choice_lets_the_turn_end_with_an_answer(choice: str) -> None:
    model = Obedient()
    agent = Agent(model, [lookup], limits=RunLimits(max_steps=5))
    result = await agent.run_turn(session(), "q", settings=ModelSettings(tool_choice=choice))
    assert model.requests[0].effective_settings().tool_choice == choice  # the call is forced
    assert (result.reason, result.text) == ("final", "x: found")


async def test_the_compaction_request_carries_the_agents_settings() -> None:
    from kernel.models import Usage

    model = ScriptedModel(
        [
            reply("a", usage=Usage(input_tokens=5000)),
            reply("b", usage=Usage(input_tokens=6000)),
            "summary",
        ]
    )
    settings = ModelSettings(temperature=0.1, extra={"chat_template_kwargs": {"x": 1}})
    agent = Agent(model, compact_after_tokens=100, settings=settings)
    s = session()
    await agent.run_turn(s, "one")
    await agent.run_turn(s, "two")
    assert await agent.compact(s)
    sent = model.requests[-1].effective_settings()
    assert (sent.temperature, sent.extra) == (0.1, {"chat_template_kwargs": {"x": 1}})
