"""``Agent.resume_turn``: a turn a crash or a cancel cut short goes on from its transcript.

Each transcript is made by really running a turn (scripted model, real tools)
and stopping it at one moment: a crash while its calls ran (the store's
entries at that moment, as a SIGKILL leaves them), a cancel mid-call, a cancel
after the observations were recorded, a cancel mid-stream, and a turn that
finished.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest
import trio

from kernel import tool
from kernel.agent import INTERRUPTED, Agent, AgentEvent, RunLimits, TurnFinished
from kernel.errors import UsageError
from kernel.history import HistoryCache
from kernel.messages import Message, Observation
from kernel.models import ModelRequest, ModelResponse, ScriptedModel
from kernel.session import Session, message_entry, message_from_entry
from kernel.store import MemoryStore, SessionKey

reply = ScriptedModel.reply
KEY = SessionKey("p", "task-1")


class Runs:
    """How many times each tool ran, and when the hanging ones have all started."""

    def __init__(self) -> None:
        self.count: dict[str, int] = {}
        self.hanging = 0
        self.all_hanging = trio.Event()
        self.expect_hanging = 1

    def ran(self, name: str) -> None:
        self.count[name] = self.count.get(name, 0) + 1


RUNS = Runs()


@tool
async def hang() -> str:
    """Run until cancelled (a side effect happens first)."""
    RUNS.ran("hang")
    RUNS.hanging += 1
    if RUNS.hanging >= RUNS.expect_hanging:
        RUNS.all_hanging.set()
    await trio.sleep_forever()
    raise AssertionError("unreachable")


@tool
async def note(text: str) -> str:
    """Write a note (a side effect)."""
    RUNS.ran("note")
    return f"noted {text}"


TOOLS = [hang, note]


@pytest.fixture(autouse=True)
def fresh_runs() -> None:
    global RUNS
    RUNS = Runs()


def new_session(store: MemoryStore | None = None) -> Session:
    return Session(store if store is not None else MemoryStore(), KEY)


async def stop_when(
    session: Session, model: ScriptedModel, ready: Callable[[], Awaitable[None]]
) -> list[dict[str, Any]]:
    """Run a turn, cancel it once ``ready`` returns; the entries as they were at that moment."""
    snapshot: list[dict[str, Any]] = []
    async with trio.open_nursery() as nursery:

        async def turn() -> None:
            await Agent(model, TOOLS).run_turn(session, "go")

        nursery.start_soon(turn)
        await ready()
        snapshot.extend(await session.entries())
        nursery.cancel_scope.cancel()
    return snapshot


async def crashed_copy(entries: list[dict[str, Any]]) -> Session:
    """A session holding ``entries`` and nothing else: what a process killed then leaves."""
    store = MemoryStore()
    await store.append(KEY, entries)
    return new_session(store)


def last_request(model: ScriptedModel) -> ModelRequest:
    return model.requests[-1]


async def test_calls_running_at_a_crash_are_answered_as_interrupted_never_run_again(
    autojump_clock: trio.abc.Clock,
) -> None:
    RUNS.expect_hanging = 2
    first = ScriptedModel([reply(calls=[("hang", {}), ("hang", {})])])
    entries = await stop_when(new_session(), first, RUNS.all_hanging.wait)
    assert [e["type"] for e in entries] == ["user", "assistant"]  # calls recorded, no results
    session = await crashed_copy(entries)

    model = ScriptedModel(["recovered"])
    events: list[AgentEvent] = []
    result = await Agent(model, TOOLS).resume_turn(session, on_event=events.append)

    assert (result.reason, result.text, result.steps) == ("final", "recovered", 1)
    assert events[-1] == result
    assert RUNS.count == {"hang": 2}  # not run again
    sent = last_request(model).messages
    assert [m.role for m in sent] == ["user", "assistant", "tool"]
    errors = [o.error for o in sent[-1].observations]
    assert errors == [INTERRUPTED, INTERRUPTED]
    assert INTERRUPTED.kind == "crashed"
    assert INTERRUPTED.message == "interrupted: the run stopped before the call finished"
    # Recorded, linked to the calls' entry: the transcript now reads the same everywhere.
    after = await session.entries()
    assert [e["type"] for e in after] == ["user", "assistant", "tool", "assistant"]
    assert after[2]["answers"] == after[1]["uuid"]
    assert [m.role for m in await session.messages()] == ["user", "assistant", "tool", "assistant"]


async def test_a_turn_cancelled_mid_call_goes_on_with_its_cancelled_observations(
    autojump_clock: trio.abc.Clock,
) -> None:
    session = new_session()
    first = ScriptedModel([reply(calls=[("note", {"text": "a"}), ("hang", {})])])
    await stop_when(session, first, RUNS.all_hanging.wait)
    assert [e["type"] for e in await session.entries()] == ["user", "assistant", "tool"]

    model = ScriptedModel(["carried on"])
    result = await Agent(model, TOOLS).resume_turn(session)

    assert (result.reason, result.text) == ("final", "carried on")
    assert RUNS.count == {"note": 1, "hang": 1}
    kinds = [
        o.error.kind if o.error else None for o in last_request(model).messages[-1].observations
    ]
    assert kinds == [None, "cancelled"]
    # No second result for those calls.
    assert [e["type"] for e in await session.entries()] == [
        "user",
        "assistant",
        "tool",
        "assistant",
    ]


async def test_a_turn_cancelled_after_its_observations_asks_the_model_again(
    autojump_clock: trio.abc.Clock,
) -> None:
    asked_again = trio.Event()

    async def never_answers(request: ModelRequest) -> ModelResponse:
        asked_again.set()
        await trio.sleep_forever()
        raise AssertionError("unreachable")

    session = new_session()
    first = ScriptedModel([reply(calls=[("note", {"text": "a"})]), never_answers])
    await stop_when(session, first, asked_again.wait)
    assert [e["type"] for e in await session.entries()] == ["user", "assistant", "tool"]

    model = ScriptedModel([reply(calls=[("note", {"text": "b"})]), "both noted"])
    result = await Agent(model, TOOLS).resume_turn(session)

    assert (result.reason, result.text, result.steps) == ("final", "both noted", 2)
    assert RUNS.count == {"note": 2}  # "a" once, then the resumed turn's own "b"
    assert last_request(model).messages[2].observations[0].content == "noted a"


async def test_a_reply_cut_mid_stream_is_asked_for_again(autojump_clock: trio.abc.Clock) -> None:
    streaming = trio.Event()

    def long_reply(request: ModelRequest) -> ModelResponse:
        streaming.set()
        return reply("one two three four five six")

    async def after_some_words() -> None:
        await streaming.wait()
        await trio.sleep(2.5)

    session = new_session()
    first = ScriptedModel([long_reply], chunk_delay=1.0)
    await stop_when(session, first, after_some_words)
    entries = await session.entries()
    assert [e["type"] for e in entries] == ["user", "assistant"] and entries[-1]["partial"]

    model = ScriptedModel(["the whole answer"])
    result = await Agent(model, TOOLS).resume_turn(session)

    assert (result.reason, result.text, result.steps) == ("final", "the whole answer", 1)
    # Asked again from the prompt: the cut reply, sent last, would be a prefill
    # (which Anthropic refuses when it ends in whitespace, and continues otherwise).
    assert [m.role for m in last_request(model).messages] == ["user"]
    # It stays in the transcript: the user saw it.
    after = await session.entries()
    assert [e["type"] for e in after] == ["user", "assistant", "assistant"]
    assert after[1]["partial"] and "partial" not in after[2]


async def test_a_finished_turn_returns_its_answer_without_asking_the_model() -> None:
    session = new_session()
    await Agent(ScriptedModel([reply(calls=[("note", {"text": "a"})]), "done"]), TOOLS).run_turn(
        session, "go"
    )
    before = await session.entries()
    await session.record_title("a title")  # not a message: skipped

    model = ScriptedModel([])  # any request would fail
    events: list[AgentEvent] = []
    result = await Agent(model, TOOLS).resume_turn(session, on_event=events.append)

    assert result == TurnFinished("final", "done", 0, result.usage)
    assert (result.usage.total_tokens, result.cost_usd) == (0, None)
    assert events == [result]
    assert model.requests == []
    assert len(await session.entries()) == len(before) + 1  # only the title


async def test_resuming_twice_finishes_once(autojump_clock: trio.abc.Clock) -> None:
    first = ScriptedModel([reply(calls=[("hang", {})])])
    session = await crashed_copy(await stop_when(new_session(), first, RUNS.all_hanging.wait))
    await Agent(ScriptedModel(["recovered"]), TOOLS).resume_turn(session)
    again = ScriptedModel([])
    result = await Agent(again, TOOLS).resume_turn(session)
    assert (result.reason, result.text, result.steps) == ("final", "recovered", 0)
    assert again.requests == []


async def test_the_resumed_turn_has_the_usual_limits(autojump_clock: trio.abc.Clock) -> None:
    first = ScriptedModel([reply(calls=[("hang", {})])])
    entries = await stop_when(new_session(), first, RUNS.all_hanging.wait)

    session = await crashed_copy(entries)
    loops = ScriptedModel(lambda request: reply(calls=[("note", {"text": "again"})]))
    result = await Agent(loops, TOOLS, limits=RunLimits(max_steps=2)).resume_turn(session)
    assert (result.reason, result.steps) == ("max_steps", 2)
    assert RUNS.count == {"hang": 1, "note": 2}

    session = await crashed_copy(entries)

    async def slow(request: ModelRequest) -> str:
        await trio.sleep(100)
        return "late"

    timed = Agent(ScriptedModel([slow]), TOOLS, limits=RunLimits(wall_time=10))
    result = await timed.resume_turn(session)
    assert result.reason == "wall_time"
    # The interrupted calls were recorded before the model was asked.
    assert [m.role for m in await session.messages()] == ["user", "assistant", "tool"]


async def test_a_cancelled_resume_ends_with_a_cancelled_event(
    autojump_clock: trio.abc.Clock,
) -> None:
    first = ScriptedModel([reply(calls=[("hang", {})])])
    session = await crashed_copy(await stop_when(new_session(), first, RUNS.all_hanging.wait))
    RUNS.all_hanging = trio.Event()
    model = ScriptedModel([reply(calls=[("hang", {})])])
    events: list[AgentEvent] = []
    with trio.move_on_after(5):
        await Agent(model, TOOLS).resume_turn(session, on_event=events.append)
    last = events[-1]
    assert isinstance(last, TurnFinished) and last.reason == "cancelled"
    messages: list[Message] = await session.messages()
    assert [m.role for m in messages] == ["user", "assistant", "tool", "assistant", "tool"]
    assert messages[2].observations[0].error == INTERRUPTED
    error = messages[4].observations[0].error
    assert error is not None and error.kind == "cancelled"


async def test_nothing_to_resume_is_a_usage_error() -> None:
    session = new_session()
    with pytest.raises(UsageError, match="holds no message, nothing to resume"):
        await Agent(ScriptedModel([]), TOOLS).resume_turn(session)
    await session.record_title("only a title")
    with pytest.raises(UsageError, match="nothing to resume"):
        await Agent(ScriptedModel([]), TOOLS).resume_turn(session)
    assert [e["type"] for e in await session.entries()] == ["title"]


async def test_bad_settings_are_refused_before_anything_is_recorded(
    autojump_clock: trio.abc.Clock,
) -> None:
    first = ScriptedModel([reply(calls=[("hang", {})])])
    session = await crashed_copy(await stop_when(new_session(), first, RUNS.all_hanging.wait))
    with pytest.raises(UsageError):
        await Agent(ScriptedModel([]), TOOLS).resume_turn(session, tools=["nope.*"])
    assert [e["type"] for e in await session.entries()] == ["user", "assistant"]


async def test_two_turns_on_one_session_run_one_after_the_other(
    autojump_clock: trio.abc.Clock,
) -> None:
    # Two Session objects for one key, sharing a cache, as a Kernel's k.session() makes them.
    store = MemoryStore()
    cache = HistoryCache()
    first, second = Session(store, KEY, cache=cache), Session(store, KEY, cache=cache)
    released = trio.Event()

    @tool
    async def wait_a_while() -> str:
        """Wait until released."""
        RUNS.all_hanging.set()
        await released.wait()
        return "waited"

    models = [
        ScriptedModel([reply(calls=[("wait_a_while", {})]), "first done"]),
        ScriptedModel(["second done"]),
    ]
    results: list[TurnFinished] = []

    async def turn(model: ScriptedModel, session: Session, prompt: str) -> None:
        results.append(await Agent(model, [wait_a_while]).run_turn(session, prompt))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(turn, models[0], first, "one")
        await RUNS.all_hanging.wait()
        nursery.start_soon(turn, models[1], second, "two")
        await trio.sleep(5)
        assert len(models[1].requests) == 0  # waits for the turn before it
        released.set()

    assert [r.text for r in results] == ["first done", "second done"]
    messages = await first.messages()
    assert [(m.role, m.text) for m in messages if m.role != "tool"] == [
        ("user", "one"),
        ("assistant", ""),
        ("assistant", "first done"),
        ("user", "two"),
        ("assistant", "second done"),
    ]
    # The second turn saw the whole first one.
    assert [m.role for m in models[1].requests[0].messages] == [
        "user",
        "assistant",
        "tool",
        "assistant",
        "user",
    ]


async def test_a_resume_refuses_while_a_turn_of_the_session_runs(
    autojump_clock: trio.abc.Clock,
) -> None:
    session = new_session()
    async with trio.open_nursery() as nursery:
        running = Agent(ScriptedModel([reply(calls=[("hang", {})])]), TOOLS)
        nursery.start_soon(running.run_turn, session, "go")
        await RUNS.all_hanging.wait()
        with pytest.raises(UsageError, match="a turn of this session is running in this process"):
            await Agent(ScriptedModel([]), TOOLS).resume_turn(session)
        nursery.cancel_scope.cancel()
    assert RUNS.count == {"hang": 1}


class AnswersAfterTheFirstRead(MemoryStore):
    """A store in which another process records the calls' real results right after
    the resume first read the transcript."""

    def __init__(self, results: dict[str, Any]) -> None:
        super().__init__()
        self.results: dict[str, Any] | None = results

    def iter_entries(self, key: SessionKey, *, start: int = 0) -> AsyncIterator[dict[str, Any]]:
        return self._then_answer(super().iter_entries(key, start=start))

    async def _then_answer(
        self, entries: AsyncIterator[dict[str, Any]]
    ) -> AsyncIterator[dict[str, Any]]:
        async for entry in entries:
            yield entry
        if self.results is not None:
            results, self.results = self.results, None
            await self.append(KEY, [results])


async def test_results_recorded_elsewhere_right_before_a_resume_writes_are_not_answered_twice(
    autojump_clock: trio.abc.Clock,
) -> None:
    entries = await stop_when(
        new_session(),
        ScriptedModel([reply(calls=[("note", {"text": "a"}), ("hang", {})])]),
        RUNS.all_hanging.wait,
    )
    assistant = message_from_entry(entries[1])
    assert assistant is not None
    real = Message(
        "tool",
        [
            Observation.success(assistant.tool_calls[0], 0, "noted a"),
            Observation.success(assistant.tool_calls[1], 1, "hung, then done"),
        ],
    )
    results = message_entry(real, timestamp=entries[1]["timestamp"], answers=entries[1]["uuid"])
    store = AnswersAfterTheFirstRead(results)
    await MemoryStore.append(store, KEY, entries)
    model = ScriptedModel([])
    with pytest.raises(UsageError, match="answered meanwhile by another writer"):
        await Agent(model, TOOLS).resume_turn(Session(store, KEY))
    after = await store.load(KEY) or []
    assert [e["type"] for e in after] == ["user", "assistant", "tool"]  # no second answer
    assert after[2]["uuid"] == results["uuid"]
    assert model.requests == []
