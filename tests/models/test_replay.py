"""ReplayModel: a recorded session run again, tools included, and where a run goes another way."""

from __future__ import annotations

import pytest

from kernel import tool
from kernel.agent import Agent
from kernel.errors import ModelAPIError, UsageError
from kernel.messages import Message, Text, ToolCall
from kernel.models import (
    ModelEvent,
    ModelRequest,
    ProviderError,
    ReplayModel,
    ScriptedModel,
    TextDelta,
    ToolCallDelta,
    Usage,
)
from kernel.session import MessageEntry, Session
from kernel.store import MemoryStore, SessionKey

from .wire import collect, final, tool_results, user

reply = ScriptedModel.reply
ran: list[str] = []


@tool
def note(text: str) -> str:
    """Write a note down."""
    ran.append(text)
    return f"noted {text} ({len(ran)})"


def session(store: MemoryStore, name: str) -> Session:
    return Session(store, SessionKey("p", name))


async def record(store: MemoryStore) -> Session:
    """A two-turn session: calls, results, answers."""
    model = ScriptedModel(
        [
            reply("Noting.", calls=[("note", {"text": "a"}), ("note", {"text": "b"})]),
            reply(calls=[("note", {"text": "c"})]),
            "Three notes.",
            "Bye.",
        ]
    )
    recorded = session(store, "recorded")
    agent = Agent(model, [note])
    await agent.run_turn(recorded, "note a, b, c")
    await agent.run_turn(recorded, "thanks")
    return recorded


async def test_a_session_runs_again_with_its_tools() -> None:
    store = MemoryStore()
    recorded = await record(store)
    ran.clear()
    model = await ReplayModel.from_session(recorded)
    assert (model.name, model.steps) == ("replay:p/recorded", 4)
    replayed = session(store, "replayed")
    agent = Agent(model, [note])
    first = await agent.run_turn(replayed, "note a, b, c")
    second = await agent.run_turn(replayed, "thanks")
    assert (first.reason, first.text, second.text) == ("final", "Three notes.", "Bye.")
    assert sorted(ran) == ["a", "b", "c"]  # the tools ran again (a and b in parallel)
    before, after = await recorded.messages(), await replayed.messages()
    assert [m for m in after if m.role == "assistant"] == [
        m for m in before if m.role == "assistant"
    ]
    assert [m.role for m in after] == [m.role for m in before]
    assert model.served == 4


async def test_streaming_gives_the_same_answers() -> None:
    call = ToolCall(id="call_x", name="note", arguments='{"text": "a"}', index=0)
    recording = [
        user("go"),
        Message("assistant", (Text("Let me note it."), call)),
        tool_results([call], ["noted"]),
        Message("assistant", (Text("Done."),)),
    ]
    model = ReplayModel(recording)
    events = await collect(model, ModelRequest(recording[:1]))
    assert events[:-1] == [
        TextDelta("Let me note it."),
        ToolCallDelta(0, "call_x", "note", '{"text": "a"}'),
    ]
    response = final(events)
    assert (response.message, response.stop_reason) == (recording[1], "tool_use")
    response = final(await collect(model, ModelRequest(recording[:3])))
    assert (response.message.text, response.stop_reason) == ("Done.", "end_turn")
    assert response.usage.total_tokens == 0


def recording_with_two_calls() -> tuple[list[Message], list[ToolCall]]:
    calls = [
        ToolCall(id="c1", name="note", arguments="{}", index=0),
        ToolCall(id="c2", name="note", arguments="{}", index=1),
    ]
    return [
        user("go"),
        Message("assistant", tuple(calls)),
        tool_results(calls, ["x", "y"]),
        Message("assistant", (Text("Done."),)),
    ], calls


async def diverged(model: ReplayModel, messages: list[Message]) -> str:
    with pytest.raises(ModelAPIError) as caught:
        await model.complete(ModelRequest(messages))
    assert isinstance(caught.value, ProviderError)
    assert caught.value.error_type == "replay_diverged"
    assert not caught.value.retryable
    text = str(caught.value)
    assert "\n" not in text
    return text


async def test_a_request_past_the_recording_is_refused() -> None:
    recording, _ = recording_with_two_calls()
    model = ReplayModel(recording, name="replay:t")
    await model.complete(ModelRequest(recording[:1]))
    await model.complete(ModelRequest(recording[:3]))
    text = await diverged(model, [*recording, user("more")])
    assert text == (
        "replay: replay_diverged: replay:t step 3 of 2: the recording has 2 answers; "
        "there is no answer 3"
    )


async def test_a_different_number_of_results_is_a_divergence() -> None:
    recording, calls = recording_with_two_calls()
    model = ReplayModel(recording, name="replay:t")
    await model.complete(ModelRequest(recording[:1]))
    text = await diverged(model, [*recording[:2], tool_results(calls[:1], ["x"])])
    assert "replay:t step 2 of 2: the recording answered the results of 2 calls" in text
    assert "the request brings 1" in text


async def test_results_of_other_calls_are_a_divergence() -> None:
    recording, calls = recording_with_two_calls()
    model = ReplayModel(recording)
    await model.complete(ModelRequest(recording[:1]))
    other = ToolCall(id="c9", name="note", arguments="{}", index=1)
    text = await diverged(model, [*recording[:2], tool_results([calls[0], other], ["x", "y"])])
    assert "other calls than the recording's (missing c2)" in text


async def test_a_turn_that_ends_elsewhere_is_a_divergence() -> None:
    recording, _ = recording_with_two_calls()
    model = ReplayModel(recording)
    await model.complete(ModelRequest(recording[:1]))
    # The run asks again after a new prompt where the recording had results.
    text = await diverged(model, [*recording[:2], user("something else")])
    assert "step 2 of 2: the recording answered the results of 2 calls" in text
    assert "the request ends with a user message 'something else'" in text


async def test_another_prompt_is_a_divergence() -> None:
    recording, _ = recording_with_two_calls()
    text = await diverged(ReplayModel(recording), [user("Summarize the conversation so far.")])
    assert "step 1 of 2: the recording answered a user message 'go'" in text
    assert "the request ends with a user message 'Summarize the conversation so far.'" in text


async def test_different_results_are_not_a_divergence() -> None:
    recording, calls = recording_with_two_calls()
    model = ReplayModel(recording)
    await model.complete(ModelRequest(recording[:1]))
    response = await model.complete(
        ModelRequest([*recording[:2], tool_results(calls, ["other", "outcomes"])])
    )
    assert response.message.text == "Done."


async def test_a_replay_that_diverges_ends_the_turn_as_a_model_error() -> None:
    store = MemoryStore()
    recorded = await record(store)
    model = await ReplayModel.from_session(recorded)
    agent = Agent(model, [note])
    replayed = session(store, "replayed")
    await agent.run_turn(replayed, "note a, b, c")
    # The recording's second turn was one request; this run asks a third time in a row.
    await agent.run_turn(replayed, "thanks")
    result = await agent.run_turn(replayed, "and again")
    assert result.reason == "model_error"
    assert result.error is not None and "step 5 of 4" in result.error


def test_a_recording_without_answers_is_refused() -> None:
    with pytest.raises(UsageError, match="no assistant message"):
        ReplayModel([user("hi")])


# --- what the transcript says besides the messages: usage, partial replies, subagents ----------


async def test_the_recorded_usage_is_replayed() -> None:
    store = MemoryStore()
    spent = Usage(input_tokens=700, output_tokens=40, cache_read_tokens=300, cost_usd=0.25)
    recorded = session(store, "recorded")
    await Agent(ScriptedModel([reply("Hello.", usage=spent)]), [note]).run_turn(recorded, "hi")
    model = await ReplayModel.from_session(recorded)
    response = await model.complete(ModelRequest([user("hi")]))
    assert response.usage == spent
    # Built from messages alone, nothing is known of it.
    plain = ReplayModel(await recorded.messages())
    assert (await plain.complete(ModelRequest([user("hi")]))).usage == Usage()


async def test_a_partial_reply_streams_its_text_then_fails() -> None:
    store = MemoryStore()
    recorded = session(store, "recorded")
    recording = [user("go"), Message("assistant", (Text("Half an ans"),)), user("again")]
    await recorded.record(MessageEntry.of(recording[0], timestamp="t"))
    await recorded.record_partial("Half an ans")  # the model failed mid-stream
    await recorded.record(MessageEntry.of(recording[2], timestamp="t"))
    await recorded.record_turn(Message("assistant", (Text("Fine."),)))
    model = await ReplayModel.from_session(recorded)
    seen: list[ModelEvent] = []
    with pytest.raises(ProviderError, match="cut short") as caught:
        async with model.stream(ModelRequest(recording[:1])) as events:
            async for event in events:
                seen.append(event)
    assert seen == [TextDelta("Half an ans")]
    assert caught.value.error_type == "replay_partial"
    response = await model.complete(ModelRequest(recording))
    assert response.message.text == "Fine."


def delegating_recorder() -> ScriptedModel:
    """A parent that delegates two tasks in one step (run at once), then answers."""
    return ScriptedModel(
        [
            reply(calls=[("delegate", {"task": "note x"}), ("delegate", {"task": "note y"})]),
            # The two children, in whichever order they ask: each answers its own task.
            lambda request: reply(calls=[("note", {"text": request.messages[0].text[-1]})]),
            lambda request: reply(calls=[("note", {"text": request.messages[0].text[-1]})]),
            lambda request: reply(f"child {request.messages[0].text[-1]} done"),
            lambda request: reply(f"child {request.messages[0].text[-1]} done"),
            "parent done",
        ]
    )


async def test_subagents_running_at_once_replay_from_their_own_transcripts() -> None:
    store = MemoryStore()
    recorded = session(store, "recorded")
    first = await Agent(delegating_recorder(), [note], subagents=True).run_turn(recorded, "go")
    assert first.text == "parent done"
    ran.clear()
    model = await ReplayModel.from_session(recorded)
    assert model.steps == 6
    replayed = session(store, "replayed")
    result = await Agent(model, [note], subagents=True).run_turn(replayed, "go")
    assert (result.reason, result.text) == ("final", "parent done")
    assert sorted(ran) == ["x", "y"]
    assert model.served == 6
    children = await store.list_subkeys(replayed.key)
    assert len(children) == 2


async def test_without_its_children_the_subagents_of_a_replay_diverge() -> None:
    store = MemoryStore()
    recorded = session(store, "recorded")
    await Agent(delegating_recorder(), [note], subagents=True).run_turn(recorded, "go")
    ran.clear()
    model = await ReplayModel.from_session(recorded, children=False)
    again = session(store, "again")
    result = await Agent(model, [note], subagents=True).run_turn(again, "go")
    # The children's requests reach the parent's recording and are refused;
    # the parent goes on (results are not compared), its subagents did not run.
    assert result.text == "parent done"
    assert ran == []
    results = [m for m in await again.messages() if m.role == "tool"]
    assert all("replay_diverged" in o.content for o in results[0].observations)


async def test_children_given_as_messages_answer_their_own_requests() -> None:
    child = [user("note x"), Message("assistant", (Text("child done"),))]
    call = ToolCall(id="d1", name="delegate", arguments='{"task": "note x"}', index=0)
    parent = [
        user("go"),
        Message("assistant", (call,)),
        tool_results([call], ["child done"]),
        Message("assistant", (Text("parent done"),)),
    ]
    model = ReplayModel(parent, children=[child])
    assert (await model.complete(ModelRequest(parent[:1]))).message == parent[1]
    assert (await model.complete(ModelRequest(child[:1]))).message.text == "child done"
    assert (await model.complete(ModelRequest(parent[:3]))).message.text == "parent done"
    text = await diverged(model, [user("note z")])  # no conversation began so: the main one's
    assert "step 3 of 2" in text
