"""The agent loop with the scripted model: turns, limits, cancellation, subagents, compaction."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
import trio

from kernel import CallFinished, CallLimits, CallStarted, tool
from kernel.agent import (
    Agent,
    AgentEvent,
    ModelDelta,
    RunLimits,
    TurnFinished,
    history_from_entries,
    load_history,
)
from kernel.errors import UsageError
from kernel.messages import Message
from kernel.models import ModelRequest, ModelResponse, ProviderError, ScriptedModel, Usage
from kernel.plugin import ToolContext, context, use_context
from kernel.session import Session
from kernel.store import MemoryStore, SessionKey
from sandbox import Workspace

reply = ScriptedModel.reply


@tool
async def lookup(term: str) -> str:
    """Look a term up."""
    await trio.sleep(0.5)
    return f"{term}: found"


@tool
async def slow(seconds: float) -> str:
    """Take a while."""
    await trio.sleep(seconds)
    return "done"


@tool
def explode() -> str:
    """Fail."""
    raise RuntimeError("boom")


TOOLS = [lookup, slow, explode]


def new_session(store: MemoryStore | None = None, session_id: str = "s1") -> Session:
    return Session(store if store is not None else MemoryStore(), SessionKey("p", session_id))


def assert_valid_transcript(messages: list[Message]) -> None:
    """Every assistant message with calls is followed by one tool message answering them in order."""
    for i, message in enumerate(messages):
        if message.role == "assistant" and message.tool_calls:
            assert i + 1 < len(messages), "a call without its result"
            results = messages[i + 1]
            assert results.role == "tool"
            assert [o.call_id for o in results.observations] == [c.id for c in message.tool_calls]
            assert [o.index for o in results.observations] == list(range(len(message.tool_calls)))


async def test_final_answer_without_tools() -> None:
    session = new_session()
    agent = Agent(ScriptedModel(["Hello there."]), TOOLS)
    result = await agent.run_turn(session, "hi")
    assert (result.reason, result.text, result.steps) == ("final", "Hello there.", 1)
    messages = await session.messages()
    assert [m.role for m in messages] == ["user", "assistant"]
    assert messages[0].text == "hi" and messages[1].text == "Hello there."


async def test_parallel_calls_are_recorded_in_declared_order(
    thread_clock: trio.abc.Clock,
) -> None:
    model = ScriptedModel(
        [
            reply(
                "Checking.",
                calls=[
                    ("lookup", {"term": "a"}),
                    ("explode", {}),
                    ("slow", {"seconds": 0.1}),
                    ("nowhere", {}),
                ],
            ),
            "All done.",
        ]
    )
    session = new_session()
    result = await Agent(model, TOOLS).run_turn(session, "go")
    assert (result.reason, result.text, result.steps) == ("final", "All done.", 2)
    messages = await session.messages()
    assert [m.role for m in messages] == ["user", "assistant", "tool", "assistant"]
    assert_valid_transcript(messages)
    observations = messages[2].observations
    assert [o.content for o in observations] == [
        "a: found",
        "Error (exception): boom",
        "done",
        observations[3].content,
    ]
    assert observations[3].error is not None and observations[3].error.kind == "unknown_tool"
    # the second request carried the results, in declared order
    second = model.requests[1]
    assert [m.role for m in second.messages] == ["user", "assistant", "tool"]
    assert second.messages[2].observations == observations


async def test_max_steps_ends_the_turn_with_a_reason(autojump_clock: trio.abc.Clock) -> None:
    model = ScriptedModel(lambda request: reply(calls=[("lookup", {"term": "x"})]))
    session = new_session()
    result = await Agent(model, TOOLS, limits=RunLimits(max_steps=3)).run_turn(session, "loop")
    assert (result.reason, result.steps) == ("max_steps", 3)
    messages = await session.messages()
    assert [m.role for m in messages] == ["user", *["assistant", "tool"] * 3]
    assert_valid_transcript(messages)


async def test_max_tokens_and_max_cost(autojump_clock: trio.abc.Clock) -> None:
    def script(request: ModelRequest) -> ModelResponse:
        return reply(
            calls=[("lookup", {"term": "x"})],
            usage=Usage(input_tokens=80, output_tokens=20, cost_usd=0.01),
        )

    result = await Agent(ScriptedModel(script), TOOLS, limits=RunLimits(max_tokens=250)).run_turn(
        new_session(), "go"
    )
    assert (result.reason, result.steps, result.usage.total_tokens) == ("max_tokens", 3, 300)
    result = await Agent(ScriptedModel(script), TOOLS, limits=RunLimits(max_cost=0.025)).run_turn(
        new_session(), "go"
    )
    assert result.reason == "max_cost" and result.steps == 3
    assert result.cost_usd == pytest.approx(0.03)


async def test_usage_and_cost_reach_the_session_summary(autojump_clock: trio.abc.Clock) -> None:
    store = MemoryStore()
    model = ScriptedModel(
        [
            reply(calls=[("lookup", {"term": "x"})], usage=Usage(100, 10, cost_usd=0.5)),
            reply("ok", usage=Usage(200, 20, cost_usd=0.25)),
        ]
    )
    await Agent(model, TOOLS).run_turn(new_session(store), "go")
    [summary] = await store.list_session_summaries("p")
    assert (summary.data.input_tokens, summary.data.output_tokens) == (300, 30)
    assert summary.data.cost_usd == pytest.approx(0.75)


async def test_wall_time_cancels_the_calls_and_keeps_the_transcript_valid(
    autojump_clock: trio.abc.Clock,
) -> None:
    model = ScriptedModel(
        [reply(calls=[("slow", {"seconds": 100}), ("lookup", {"term": "y"})]), "unreached"]
    )
    session = new_session()
    agent = Agent(model, TOOLS, limits=RunLimits(wall_time=10), call_limits=CallLimits(timeout=60))
    result = await agent.run_turn(session, "go")
    assert result.reason == "wall_time"
    messages = await session.messages()
    assert_valid_transcript(messages)
    kinds = [o.error.kind if o.error else None for o in messages[2].observations]
    assert kinds == ["cancelled", None]


async def test_cancelled_turn_leaves_a_valid_transcript(autojump_clock: trio.abc.Clock) -> None:
    model = ScriptedModel(
        [
            reply(
                calls=[
                    ("slow", {"seconds": 100}),
                    ("lookup", {"term": "y"}),
                    ("slow", {"seconds": 1}),
                ]
            )
        ]
    )
    session = new_session()
    events: list[AgentEvent] = []
    with trio.move_on_after(5) as scope:
        await Agent(model, TOOLS).run_turn(session, "go", on_event=events.append)
    assert scope.cancelled_caught
    assert isinstance(events[-1], TurnFinished) and events[-1].reason == "cancelled"
    messages = await session.messages()
    assert [m.role for m in messages] == ["user", "assistant", "tool"]
    assert_valid_transcript(messages)
    kinds = [o.error.kind if o.error else None for o in messages[2].observations]
    assert kinds == ["cancelled", None, None]


async def test_model_error_ends_the_turn_and_keeps_what_happened() -> None:
    error = ProviderError("openai", status=400, error_type="invalid_request_error", message="bad")
    session = new_session()
    result = await Agent(ScriptedModel([error]), TOOLS).run_turn(session, "go")
    assert result.reason == "model_error"
    assert result.error is not None and "invalid_request_error" in result.error
    assert [m.role for m in await session.messages()] == ["user"]


async def test_events_stream_ends_with_turn_finished(autojump_clock: trio.abc.Clock) -> None:
    model = ScriptedModel([reply("Let me look.", calls=[("lookup", {"term": "z"})]), "Found it."])
    events: list[AgentEvent] = []
    async with Agent(model, TOOLS).run(new_session(), "go") as stream:
        async for event in stream:
            events.append(event)
    kinds = [type(e).__name__ for e in events]
    assert kinds[-1] == "TurnFinished"
    assert "".join(e.text for e in events if isinstance(e, ModelDelta) and e.step == 1) == (
        "Let me look."
    )
    assert kinds.index("CallStarted") < kinds.index("CallFinished")
    assert [e.index for e in events if isinstance(e, CallStarted | CallFinished)] == [0, 0]
    final = events[-1]
    assert isinstance(final, TurnFinished) and final.text == "Found it."


async def test_leaving_the_event_stream_early_cancels_the_turn(
    autojump_clock: trio.abc.Clock,
) -> None:
    model = ScriptedModel([reply(calls=[("slow", {"seconds": 100})]), "unreached"])
    session = new_session()
    async with Agent(model, TOOLS).run(session, "go") as stream:
        async for event in stream:
            if isinstance(event, CallStarted):
                break
    assert_valid_transcript(await session.messages())
    assert len(await session.messages()) == 3


async def test_subagent_runs_on_a_child_transcript(autojump_clock: trio.abc.Clock) -> None:
    def script(request: ModelRequest) -> ModelResponse | str:
        last = request.messages[-1]
        if last.role == "user" and last.text.startswith("Find"):
            # the child: use a tool, then answer
            return reply(calls=[("lookup", {"term": "child"})])
        if last.role == "tool" and last.observations[0].name == "lookup":
            return "child says: found"
        if last.role == "user":
            return reply(calls=[("delegate", {"task": "Find the thing", "tools": ["lookup"]})])
        return f"parent got: {last.observations[0].content}"

    store = MemoryStore()
    session = new_session(store)
    model = ScriptedModel(script)
    agent = Agent(model, TOOLS, subagents=True)
    result = await agent.run_turn(session, "please delegate")
    assert result.text == "parent got: child says: found"
    [child_path] = await store.list_subkeys(session.key)
    assert child_path.startswith("subagents/")
    child = Session(store, session.key.child(child_path))
    assert [m.role for m in await child.messages()] == ["user", "assistant", "tool", "assistant"]
    [summary] = await store.list_session_summaries("p")
    assert summary.data.type_counts == {"user": 1, "assistant": 2, "tool": 1}
    # the parent was offered delegate; the child only the tools it was given
    tool_names = [[t.name for t in r.tools] for r in model.requests]
    assert tool_names[0] == ["lookup", "slow", "explode", "delegate"]
    assert tool_names[1] == ["lookup"]


async def test_concurrent_turns_delegate_from_their_own_session_and_agent(
    autojump_clock: trio.abc.Clock,
) -> None:
    """``delegate`` is one tool for every agent and turn: it finds the turn it serves
    (its agent and session) in the task's context, so concurrent turns do not mix."""

    def script(name: str) -> Any:
        def answer(request: ModelRequest) -> ModelResponse | str:
            last = request.messages[-1]
            if last.role == "user" and last.text.startswith("child"):
                return f"{name}'s child did {last.text}"
            if last.role == "user":
                return reply(calls=[("delegate", {"task": f"child of {last.text}"})])
            return last.observations[0].content

        return answer

    store = MemoryStore()
    agents = [Agent(ScriptedModel(script(n)), TOOLS, subagents=True) for n in ("A", "B")]
    sessions = [new_session(store, f"s{i}") for i in range(4)]
    results: dict[int, TurnFinished] = {}

    async def turn(i: int) -> None:
        results[i] = await agents[i % 2].run_turn(sessions[i], f"task {i}")

    async with trio.open_nursery() as nursery:
        for i in range(4):
            nursery.start_soon(turn, i)
    for i, session in enumerate(sessions):
        name = "AB"[i % 2]
        assert results[i].text == f"{name}'s child did child of task {i}"
        [child_path] = await store.list_subkeys(session.key)
        child = Session(store, session.key.child(child_path))
        assert (await child.messages())[0].text == f"child of task {i}"
    offered = [[t for t in a._offered_tools() if t.name == "delegate"] for a in agents]
    assert offered[0] == offered[1] and offered[0][0] is offered[1][0]  # built once


async def test_subagent_with_unknown_tools_is_an_error_observation(
    autojump_clock: trio.abc.Clock,
) -> None:
    model = ScriptedModel(
        [reply(calls=[("delegate", {"task": "t", "tools": ["nope"]})]), "giving up"]
    )
    session = new_session()
    await Agent(model, TOOLS, subagents=True).run_turn(session, "go")
    observation = (await session.messages())[2].observations[0]
    assert observation.error is not None and "unknown tools ['nope']" in observation.content


async def test_compaction_summarizes_old_turns_and_history_starts_from_it() -> None:
    answers = iter(["first answer", "second answer", "SUMMARY: user asked twice", "third answer"])
    model = ScriptedModel(lambda request: next(answers))
    session = new_session()
    agent = Agent(model, TOOLS, compact_after_tokens=1)
    await agent.run_turn(session, "first question")
    await agent.run_turn(session, "second question")
    assert await agent.compact(session) is True
    history = await load_history(session)
    assert [m.role for m in history] == ["user", "user", "assistant"]
    assert history[0].text.endswith("SUMMARY: user asked twice")
    assert history[1].text == "second question"
    await agent.run_turn(session, "third question")
    last_request = model.requests[-1]
    assert last_request.messages[0].text.endswith("SUMMARY: user asked twice")
    assert [m.text for m in last_request.messages[1:]] == [
        "second question",
        "second answer",
        "third question",
    ]
    # the transcript itself keeps everything
    assert len(await session.messages()) == 6


async def test_compaction_waits_for_the_budget() -> None:
    model = ScriptedModel(lambda request: reply("a", usage=Usage(input_tokens=10)))
    session = new_session()
    agent = Agent(model, TOOLS, compact_after_tokens=1000)
    await agent.run_turn(session, "q1")
    await agent.run_turn(session, "q2")
    assert await agent.compact(session) is False
    assert all(e["type"] != "compaction" for e in await session.entries())


def test_history_without_compaction_is_every_message() -> None:
    entries: list[dict[str, Any]] = [
        {"type": "title", "uuid": "t", "title": "x"},
        {
            "type": "user",
            "uuid": "u",
            "message": {"role": "user", "parts": [{"type": "text", "text": "hi"}]},
        },
    ]
    assert [m.text for m in history_from_entries(entries)] == ["hi"]


def test_run_limits_reject_nonsense() -> None:
    with pytest.raises(UsageError, match="max_steps"):
        RunLimits(max_steps=0)


async def test_subagent_tools_see_the_child_session(tmp_path: Path) -> None:
    @tool
    async def whoami() -> str:
        """The session this call serves."""
        return str(context().session)

    def script(request: ModelRequest) -> ModelResponse | str:
        last = request.messages[-1]
        if last.role == "user" and last.text == "child task":
            return reply(calls=[("whoami", {})])
        if last.role == "user":
            return reply(calls=[("whoami", {}), ("delegate", {"task": "child task"})])
        if last.observations[0].name == "whoami" and len(last.observations) == 1:
            return f"child: {last.observations[0].content}"
        return "done"

    store = MemoryStore()
    session = new_session(store)
    ctx = ToolContext(Workspace(tmp_path), str(session.key), logging.getLogger("t"))
    with use_context(ctx):
        await Agent(ScriptedModel(script), [whoami], subagents=True).run_turn(session, "go")
    observations = (await session.messages())[2].observations
    [child_path] = await store.list_subkeys(session.key)
    assert observations[0].content == "p/s1"
    assert observations[1].content == f"child: p/s1:{child_path}"


async def test_duplicate_call_ids_from_a_model_are_recorded_not_fatal(
    autojump_clock: trio.abc.Clock,
) -> None:
    from kernel.messages import Text as TextPart
    from kernel.messages import ToolCall

    duplicated = ModelResponse(
        message=Message(
            "assistant",
            [
                TextPart("twice"),
                ToolCall("same", "lookup", '{"term": "a"}', 0),
                ToolCall("same", "lookup", '{"term": "b"}', 1),
            ],
        ),
        stop_reason="tool_use",
    )
    session = new_session()
    result = await Agent(ScriptedModel([duplicated, "recovered"]), TOOLS).run_turn(session, "go")
    assert result.reason == "final"
    messages = await session.messages()
    assert [o.error.kind if o.error else None for o in messages[2].observations] == [
        "invalid_call",
        "invalid_call",
    ]


async def test_calls_that_ran_are_recorded_even_if_the_turn_ends_while_recording(
    autojump_clock: trio.abc.Clock,
) -> None:
    class SlowStore(MemoryStore):
        async def append(self, key: SessionKey, entries: Any) -> None:
            if any(e.get("type") == "tool" for e in entries):
                await trio.sleep(5)  # the wall time ends during this write
            await super().append(key, entries)

    store = SlowStore()
    session = new_session(store)
    model = ScriptedModel([reply(calls=[("lookup", {"term": "x"})]), "unreached"])
    agent = Agent(model, TOOLS, limits=RunLimits(wall_time=2))
    result = await agent.run_turn(session, "go")
    assert result.reason == "wall_time"
    messages = await session.messages()
    assert [m.role for m in messages] == ["user", "assistant", "tool"]
    assert messages[2].observations[0].content == "x: found"


async def test_compaction_keeps_at_least_one_turn() -> None:
    agent = Agent(ScriptedModel(["a"]), TOOLS, compact_after_tokens=1)
    with pytest.raises(UsageError, match="keep_last_turns"):
        await agent.compact(new_session(), keep_last_turns=0)


async def test_each_message_is_made_recordable_once_by_the_session(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The session owns the recorded form: the agent runs the calls and keeps the
    history the session gives back, never a second form of its own (a prompt and a
    reply with a lone surrogate are what the transcript and the next request hold)."""
    import kernel.agent
    import kernel.session
    from kernel.messages import recordable

    made: list[str] = []

    def counted(message: Message) -> Message:
        made.append(message.role)
        return recordable(message)

    monkeypatch.setattr(kernel.session, "recordable", counted)
    monkeypatch.setattr(kernel.agent, "recordable", counted, raising=False)
    model = ScriptedModel([reply("half \ud800", calls=[("lookup", {"term": "a"})]), "done \ud800"])
    session = new_session()
    result = await Agent(model, TOOLS).run_turn(session, "hi \ud800")
    # ascii(): a lone surrogate in a failure's message would stop pytest-xdist's run
    assert made == ["user", "assistant", "tool", "assistant"]  # once each
    assert ascii(result.text) == ascii("done \ufffd")
    sent = model.requests[-1].messages
    assert ascii([m.text for m in sent[:2]]) == ascii(["hi \ufffd", "half \ufffd"])
    assert ascii(sent) == ascii(tuple((await session.messages())[:3]))
