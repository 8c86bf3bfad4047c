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
from kernel.agent import Agent
from kernel.errors import UsageError
from kernel.models import (
    ModelEvent,
    ModelRequest,
    ModelResponse,
    ProviderError,
    ScriptedModel,
    TextDelta,
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
