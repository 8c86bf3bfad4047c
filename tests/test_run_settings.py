"""Model settings and tool selection, per agent, per turn, per kernel and in
tak.toml (issue 14, items 1-3): what reaches the model's request, and what
is refused before anything is recorded; and honest outcomes (a reply cut by
the token limit, text streamed before a failure or a cancel)."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import trio
import trio.lowlevel

from kernel import open_kernel, tool
from kernel.agent import Agent, AgentEvent, RunLimits, TurnFinished
from kernel.errors import StoreError, UsageError
from kernel.models import (
    ModelEvent,
    ModelRequest,
    ModelResponse,
    ProviderError,
    ScriptedModel,
    TextDelta,
    ToolCallDelta,
)
from kernel.models._assemble import events_of
from kernel.session import Session
from kernel.settings import ModelSettings
from kernel.store import MemoryStore, SessionKey

reply = ScriptedModel.reply


@tool
async def lookup(term: str) -> str:
    """Look a term up."""
    return f"{term}: found"


@tool
async def fetch(url: str) -> str:
    """Fetch a page."""
    return "page"


def session() -> Session:
    return Session(MemoryStore(), SessionKey("p", "s1"))


async def test_a_turns_settings_are_merged_over_the_agents() -> None:
    model = ScriptedModel(["one", "two"])
    agent = Agent(model, [lookup], settings=ModelSettings(temperature=0.2, max_tokens=100))
    s = session()
    await agent.run_turn(s, "hi")
    await agent.run_turn(s, "again", settings=ModelSettings(max_tokens=7, seed=3))
    first, second = model.requests
    assert first.settings == ModelSettings(temperature=0.2, max_tokens=100)
    assert second.settings == ModelSettings(temperature=0.2, max_tokens=7, seed=3)


async def test_only_the_selected_tools_are_offered() -> None:
    model = ScriptedModel([reply(calls=[("lookup", {"term": "x"})]), "done"])
    agent = Agent(model, [lookup, fetch], subagents=True)
    result = await agent.run_turn(session(), "hi", tools=["look*"])
    assert result.reason == "final"
    assert [t.name for t in model.requests[0].tools] == ["lookup"]  # no fetch, no delegate


@pytest.mark.parametrize(
    ("tools", "settings", "message"),
    [
        (["nothing*"], None, "tools: no tool matches 'nothing\\*'"),
        (["lookup"], ModelSettings(tool_choice="fetch"), "tool_choice 'fetch': no such tool"),
        ([], ModelSettings(tool_choice="required"), "tool_choice 'required': the request has no"),
    ],
)
async def test_a_selection_or_choice_that_cannot_be_met_records_nothing(
    tools: list[str], settings: ModelSettings | None, message: str
) -> None:
    model = ScriptedModel(["never"])
    s = session()
    with pytest.raises(UsageError, match=message):
        await Agent(model, [lookup, fetch]).run_turn(s, "hi", tools=tools, settings=settings)
    assert await s.messages() == [] and model.requests == []


async def test_a_reply_cut_by_the_token_limit_ends_as_max_tokens_with_its_text() -> None:
    model = ScriptedModel([reply("Once upon a ti", stop_reason="max_tokens")])
    s = session()
    result = await Agent(model, [lookup]).run_turn(s, "tell a story")
    assert (result.reason, result.text) == ("max_tokens", "Once upon a ti")
    assert [m.text for m in await s.messages()] == ["tell a story", "Once upon a ti"]


async def test_the_kernel_merges_tak_toml_then_open_kernel_then_the_turn(tmp_path: Path) -> None:
    home = tmp_path / "home"
    (home / "config").mkdir(parents=True)
    (home / "config" / "tak.toml").write_text(
        "[model.settings]\ntemperature = 0.1\nmax_tokens = 50\nstop = ['END']\n"
    )
    model = ScriptedModel(["ok", "ok"])
    async with open_kernel(
        home=home, model=model, tools=[lookup], plugins=[], settings=ModelSettings(max_tokens=9)
    ) as k:
        s = k.session("s")
        await k.run_turn(s, "hi", settings=ModelSettings(seed=1), tools=["lookup"])
        async with k.run(s, "again", tools=["lookup"]) as events:
            async for _ in events:
                pass
    assert model.requests[0].settings == ModelSettings(
        temperature=0.1, max_tokens=9, stop=("END",), seed=1
    )
    assert model.requests[1].settings == ModelSettings(temperature=0.1, max_tokens=9, stop=("END",))
    assert [t.name for t in model.requests[1].tools] == ["lookup"]


async def test_a_bad_model_setting_in_tak_toml_is_one_line_naming_it(tmp_path: Path) -> None:
    home = tmp_path / "home"
    (home / "config").mkdir(parents=True)
    (home / "config" / "tak.toml").write_text("[model.settings]\ntemperature = 9\n")
    with pytest.raises(UsageError, match=r"tak\.toml: \$\.model\.settings: temperature: expected"):
        async with open_kernel(home=home, plugins=[]):
            pass


async def test_a_bad_run_settings_raises_before_the_event_stream_opens() -> None:
    async with open_kernel(home=None, model=ScriptedModel(["x"]), plugins=[]) as k:
        with pytest.raises(UsageError, match="no tool matches"):
            async with k.run(k.session("s"), "hi", tools=["missing"]):
                await trio.lowlevel.checkpoint()


class CutShort:
    """A model that streams some text, then fails (or hangs); then answers plainly."""

    name = "fake:cut"

    def __init__(self, *, hang: bool) -> None:
        self.hang = hang
        self.requests: list[ModelRequest] = []

    @contextlib.asynccontextmanager
    async def stream(self, request: ModelRequest) -> AsyncIterator[AsyncIterator[ModelEvent]]:
        self.requests.append(request)
        first = len(self.requests) == 1

        async def events() -> AsyncIterator[ModelEvent]:
            if not first:
                for event in events_of(ScriptedModel.reply("Fine.")):
                    yield event
                return
            yield TextDelta("The answer ")
            yield TextDelta("is")
            if self.hang:
                await trio.sleep_forever()
            raise ProviderError("fake", "overloaded", status=529, retryable=True)

        yield events()

    async def complete(self, request: ModelRequest) -> ModelResponse:
        raise NotImplementedError


async def test_text_streamed_before_a_model_failure_is_recorded_as_partial() -> None:
    model = CutShort(hang=False)
    s = session()
    agent = Agent(model, [lookup])
    result = await agent.run_turn(s, "question")
    assert result.reason == "model_error"
    entries = await s.store.load(s.key)
    assert entries is not None
    assert [(e["type"], e.get("partial")) for e in entries] == [
        ("user", None),
        ("assistant", True),
    ]
    assert entries[1]["message"]["parts"] == [{"type": "text", "text": "The answer is"}]
    # The next turn sends it, as the assistant's words.
    await agent.run_turn(s, "go on")
    sent = model.requests[-1].messages
    assert [(m.role, m.text) for m in sent] == [
        ("user", "question"),
        ("assistant", "The answer is"),
        ("user", "go on"),
    ]


async def test_text_streamed_before_a_cancel_is_recorded_as_partial(
    autojump_clock: trio.abc.Clock,
) -> None:
    model = CutShort(hang=True)
    s = session()
    with trio.move_on_after(5):
        await Agent(model, [lookup]).run_turn(s, "question")
    assert [(m.role, m.text) for m in await s.messages()] == [
        ("user", "question"),
        ("assistant", "The answer is"),
    ]


async def test_a_plugin_pattern_selects_that_plugins_tools(tmp_path: Path) -> None:
    model = ScriptedModel(["ok", "ok"])
    async with open_kernel(home=tmp_path / "home", model=model, plugins=["fs", "demo"]) as k:
        fs_tools = sorted(next(p for p in k.plugins.plugins if p.name == "fs").tools)
        await k.run_turn(k.session("s"), "hi", tools=["fs.*"])
        assert sorted(t.name for t in model.requests[0].tools) == fs_tools
        await k.run_turn(k.session("s"), "hi", tools=["fs.*", "add"])
        assert sorted(t.name for t in model.requests[1].tools) == sorted([*fs_tools, "add"])
        with pytest.raises(UsageError, match=r"no tool matches 'nope\.\*'"):
            await k.run_turn(k.session("s"), "hi", tools=["nope.*"])


async def test_the_kernels_default_selection_from_tak_toml_or_open_kernel(tmp_path: Path) -> None:
    home = tmp_path / "home"
    (home / "config").mkdir(parents=True)
    (home / "config" / "tak.toml").write_text("[model]\ntools = ['fs.*']\n")
    model = ScriptedModel(["ok", "ok", "ok"])
    async with open_kernel(home=home, model=model, plugins=["fs", "demo"]) as k:
        fs_tools = sorted(next(p for p in k.plugins.plugins if p.name == "fs").tools)
        await k.run_turn(k.session("s"), "hi")  # the default: tak.toml's
        await k.run_turn(k.session("s"), "hi", tools=["add"])  # a run's own replaces it
    assert sorted(t.name for t in model.requests[0].tools) == fs_tools
    assert [t.name for t in model.requests[1].tools] == ["add"]
    model = ScriptedModel(["ok"])
    async with open_kernel(
        home=home, model=model, plugins=["fs", "demo"], allowed_tools=["echo"]
    ) as k:
        await k.run_turn(k.session("s"), "hi")  # open_kernel's wins over tak.toml's
    assert [t.name for t in model.requests[0].tools] == ["echo"]


@tool
async def wipe(path: str) -> str:
    """Delete everything below a path."""
    return f"wiped {path}"


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
