"""ReplayModel against what real runs record: a subagent's session, a reply cut short or by
the token limit, a turn that failed, a compaction request; and tools whose results differ
on replay, or come in another order (no divergence), or a call skipped (a divergence).

Beside tests/models/test_replay.py: here ``note`` returns a random number, so that no
result text is the recording's.
"""

from __future__ import annotations

import contextlib
import random
from collections.abc import AsyncIterator
from typing import Any

import pytest

from kernel import tool
from kernel.agent import COMPACTION_PROMPT, Agent, RunLimits
from kernel.errors import ModelAPIError
from kernel.messages import Message, Text, ToolCall
from kernel.models import (
    ModelEvent,
    ModelRequest,
    ProviderError,
    ReplayModel,
    ScriptedModel,
    TextDelta,
    Usage,
)
from kernel.session import Session
from kernel.store import MemoryStore, SessionKey

from .wire import tool_results, user

ran: list[str] = []


@tool
def note(text: str) -> str:
    """Write a note down."""
    ran.append(text)
    return f"noted {text} ({len(ran)}, {random.random()})"


def session(store: MemoryStore, name: str) -> Session:
    return Session(store, SessionKey("p", name))


async def test_bug_a_session_with_a_subagent_cannot_be_replayed() -> None:
    # docs/models.md: "a subagent's requests need a ReplayModel of their own";
    # but delegate builds Agent(parent.model, ...): there is no way to give one.
    store = MemoryStore()
    recorder = ScriptedModel(
        [
            ScriptedModel.reply(calls=[("delegate", {"task": "note x"})]),
            ScriptedModel.reply(calls=[("note", {"text": "x"})]),  # the child
            "child done",  # the child
            "parent done",
        ]
    )
    recorded = session(store, "recorded")
    first = await Agent(recorder, [note], subagents=True).run_turn(recorded, "go")
    assert first.text == "parent done"
    ran.clear()
    model = await ReplayModel.from_session(recorded)
    replayed = session(store, "replayed")
    result = await Agent(model, [note], subagents=True).run_turn(replayed, "go")
    assert result.text == "parent done"
    assert ran == ["x"]  # the subagent's tool ran again


async def test_bug_a_reply_cut_short_replays_as_a_finished_answer() -> None:
    class FailsMidStream:
        """Streams some text, then the connection drops (not retried)."""

        name = "fails:mid"

        async def complete(self, request: ModelRequest) -> Any:
            raise AssertionError("the agent streams")

        @contextlib.asynccontextmanager
        async def stream(self, request: ModelRequest) -> AsyncIterator[AsyncIterator[ModelEvent]]:
            async def events() -> AsyncIterator[ModelEvent]:
                yield TextDelta("Half an ans")
                raise ProviderError("fails", "connection lost", error_type="incomplete_stream")

            yield events()

    store = MemoryStore()
    recorded = session(store, "recorded")
    first = await Agent(FailsMidStream(), [note]).run_turn(recorded, "go")
    assert first.reason == "model_error"
    await Agent(ScriptedModel(["Fine."]), [note]).run_turn(recorded, "again")
    model = await ReplayModel.from_session(recorded)
    replayed = session(store, "replayed")
    result = await Agent(model, [note]).run_turn(replayed, "go")
    assert result.reason == "model_error"  # as recorded (a divergence error would do too)


async def test_bug_a_turn_stopped_by_its_token_limit_diverges_on_replay() -> None:
    store = MemoryStore()
    limits = RunLimits(max_tokens=1000)
    spent = Usage(input_tokens=900, output_tokens=200)
    recorder = ScriptedModel(
        [
            ScriptedModel.reply(calls=[("note", {"text": "a"})], usage=spent),
            ScriptedModel.reply(calls=[("note", {"text": "never"})]),
            "Done.",
        ]
    )
    recorded = session(store, "recorded")
    agent = Agent(recorder, [note], limits=limits)
    assert (await agent.run_turn(recorded, "go")).reason == "max_tokens"
    assert (await agent.run_turn(recorded, "go on")).text == "Done."
    model = await ReplayModel.from_session(recorded)
    replayed = session(store, "replayed")
    agent = Agent(model, [note], limits=limits)
    first = await agent.run_turn(replayed, "go")
    second = await agent.run_turn(replayed, "go on")
    assert (first.reason, second.reason, second.text) == ("max_tokens", "final", "Done.")


async def test_bug_a_reply_cut_by_the_token_limit_replays_as_final() -> None:
    store = MemoryStore()
    recorder = ScriptedModel([ScriptedModel.reply("It was the best of", stop_reason="max_tokens")])
    recorded = session(store, "recorded")
    assert (await Agent(recorder, [note]).run_turn(recorded, "go")).reason == "max_tokens"
    model = await ReplayModel.from_session(recorded)
    result = await Agent(model, [note]).run_turn(session(store, "replayed"), "go")
    assert (result.reason, result.text) == ("max_tokens", "It was the best of")


async def test_held_tools_giving_other_results_on_replay_do_not_diverge() -> None:
    # note() returns a random number: every result text differs from the recording's.
    store = MemoryStore()
    recorder = ScriptedModel(
        [
            ScriptedModel.reply(calls=[("note", {"text": "a"}), ("note", {"text": "b"})]),
            ScriptedModel.reply(calls=[("note", {"text": "c"}), ("missing", {})]),
            "Done.",
        ]
    )
    recorded = session(store, "recorded")
    await Agent(recorder, [note]).run_turn(recorded, "go")
    ran.clear()
    model = await ReplayModel.from_session(recorded)
    replayed = session(store, "replayed")
    result = await Agent(model, [note]).run_turn(replayed, "go")
    assert (result.reason, result.text) == ("final", "Done.")
    assert sorted(ran) == ["a", "b", "c"]
    then, now = await recorded.messages(), await replayed.messages()
    assert [m.role for m in then] == [m.role for m in now]
    tool_then = [m for m in then if m.role == "tool"]
    tool_now = [m for m in now if m.role == "tool"]
    assert tool_then != tool_now  # the observations differ; the replay went on regardless


async def test_held_results_in_another_order_do_not_diverge() -> None:
    calls = [ToolCall(id=f"c{i}", name="note", arguments="{}", index=i) for i in range(3)]
    recording = [
        user("go"),
        Message("assistant", tuple(calls)),
        tool_results(calls, ["x", "y", "z"]),
        Message("assistant", (Text("Done."),)),
    ]
    model = ReplayModel(recording)
    await model.complete(ModelRequest(recording[:1]))
    shuffled = tool_results(list(reversed(calls)), ["z", "y", "x"])
    response = await model.complete(ModelRequest([*recording[:2], shuffled]))
    assert response.message.text == "Done."


async def test_held_a_run_that_skips_a_call_diverges_even_with_the_same_count() -> None:
    # The false negative to fear: as many results as recorded, but one call
    # answered twice and another not at all.
    calls = [ToolCall(id=f"c{i}", name="note", arguments="{}", index=i) for i in range(2)]
    recording = [
        user("go"),
        Message("assistant", tuple(calls)),
        tool_results(calls, ["x", "y"]),
        Message("assistant", (Text("Done."),)),
    ]
    model = ReplayModel(recording)
    await model.complete(ModelRequest(recording[:1]))
    twice = tool_results([calls[0], calls[0]], ["x", "x"])
    with pytest.raises(ModelAPIError, match="missing c1"):
        await model.complete(ModelRequest([*recording[:2], twice]))


async def test_held_a_turn_that_failed_in_the_recording_fails_again_on_replay() -> None:
    # A model error with nothing streamed leaves no answer in the recording:
    # the replay refuses that turn (model_error, as recorded) and goes on.
    store = MemoryStore()
    outage = ProviderError("x", "down", status=500)
    recorder = ScriptedModel(
        [ScriptedModel.reply(calls=[("note", {"text": "a"})]), outage, "Later."]
    )
    recorded = session(store, "recorded")
    agent = Agent(recorder, [note])
    assert (await agent.run_turn(recorded, "go")).reason == "model_error"
    assert (await agent.run_turn(recorded, "retry")).text == "Later."
    model = await ReplayModel.from_session(recorded)
    replayed = session(store, "replayed")
    agent = Agent(model, [note])
    first = await agent.run_turn(replayed, "go")
    second = await agent.run_turn(replayed, "retry")
    assert (first.reason, second.reason, second.text) == ("model_error", "final", "Later.")


async def test_held_a_compaction_request_is_refused_not_answered() -> None:
    recording = [user("go"), Message("assistant", (Text("ok"),)), user("next")]
    model = ReplayModel([*recording, Message("assistant", (Text("bye"),))])
    await model.complete(ModelRequest(recording[:1]))
    with pytest.raises(ModelAPIError, match="replay_diverged"):
        await model.complete(ModelRequest([*recording, user(COMPACTION_PROMPT)]))
    assert model.served == 1
