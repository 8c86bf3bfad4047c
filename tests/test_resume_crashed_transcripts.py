"""``Agent.resume_turn`` on what a crash, a race or another writer leaves: two resumes at
once, a resume while the turn still runs, a torn results line, results for some calls
only, a compaction after the crashed calls, a crash inside a subagent, a reply cut by
the token limit, a turn that ended on a model error, a batch task stopped before its
prompt; and the resumed request is one OpenAI and Anthropic accept.

Crashed transcripts are what the store held while a real turn's calls ran
(``crash_while_calls_run`` of tests/crashed_turn_kit.py), copied into a fresh store:
what a SIGKILL leaves. tests/test_resume_turn.py has the turns stopped at each moment.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

from kernel import open_kernel
from kernel.agent import INTERRUPTED, Agent, TurnFinished
from kernel.batch import BatchTask
from kernel.batch._directory import open_run_dir
from kernel.batch._run import run_batch
from kernel.history import SUMMARY_PREFIX
from kernel.messages import Message, Observation, Text
from kernel.models import ProviderError, ScriptedModel
from kernel.models._anthropic import AnthropicModel
from kernel.models._openai import OpenAIModel
from kernel.session import Session, message_entry, message_from_entry
from kernel.store import FileStore, MemoryStore, SessionKey
from kernel.store._disk import transcript_path
from tests.crashed_turn_kit import KEY, RUNS, TOOLS, answering, crash_while_calls_run, memory_copy

reply = ScriptedModel.reply


@pytest.fixture(autouse=True)
def fresh_runs() -> None:
    RUNS.reset()


class ReadGate:
    """Holds each append until every store has read the transcript to its end (or a
    while has passed): the moment two resumes race, each having read the transcript
    before either wrote. Counted when a read finishes, per store: a read merely begun
    (a thread slow under load) does not open the gate."""

    def __init__(self, readers: int) -> None:
        self.readers = readers
        self.done: set[int] = set()
        self.both_read = trio.Event()

    def finished(self, store: object) -> None:
        self.done.add(id(store))
        if len(self.done) >= self.readers:
            self.both_read.set()


class GatedFileStore(FileStore):
    def __init__(self, root: Path, gate: ReadGate) -> None:
        super().__init__(root)
        self.gate = gate

    async def iter_entries(  # type: ignore[override]
        self, key: SessionKey, *, start: int = 0
    ) -> AsyncIterator[dict[str, Any]]:
        async for entry in super().iter_entries(key, start=start):
            yield entry
        self.gate.finished(self)

    async def append(self, key: SessionKey, entries: Sequence[Mapping[str, Any]]) -> None:
        with trio.move_on_after(30):  # a fix that serialises resumes never lets both read
            await self.gate.both_read.wait()
        await super().append(key, entries)


@pytest.fixture
def patient_clock() -> trio.testing.MockClock:
    """``thread_clock`` that waits 5 s of real idleness before it jumps: the gate's
    30 s must not pass while a loaded machine's thread still reads the transcript."""
    return trio.testing.MockClock(autojump_threshold=5)


@pytest.mark.parametrize("processes", [1, 2])
async def test_two_resumes_at_once_answer_the_interrupted_calls_once(
    tmp_path: Path, processes: int, patient_clock: trio.abc.Clock
) -> None:
    entries = await crash_while_calls_run(ScriptedModel([reply(calls=[("hang", {})])]))
    async with FileStore(tmp_path) as seed:
        await seed.append(KEY, entries)
    gate = ReadGate(readers=processes)
    stores = [GatedFileStore(tmp_path, gate) for _ in range(processes)]  # one per process
    first = Session(stores[0], KEY)
    sessions = [first, first] if processes == 1 else [Session(s, KEY) for s in stores]
    models = [ScriptedModel(["one"]), ScriptedModel(["two"])]
    outcomes: list[TurnFinished | Exception] = []

    async def resume(model: ScriptedModel, session: Session) -> None:
        try:
            outcomes.append(await Agent(model, TOOLS).resume_turn(session))
        except Exception as exc:  # refusing the second resume would be a fix too
            outcomes.append(exc)

    async with trio.open_nursery() as nursery:
        for model, session in zip(models, sessions, strict=True):
            nursery.start_soon(resume, model, session)
    after = await first.entries()
    for store in stores:
        await store.aclose()

    assert RUNS.count == {"hang": 1}  # held: never run again
    assert len(answering(after, entries[1]["uuid"])) == 1
    assert sum(len(m.requests) for m in models) == 1
    assert [e["type"] for e in after] == ["user", "assistant", "tool", "assistant"]


async def test_resume_while_the_turn_still_runs_keeps_the_calls_real_result() -> None:
    session = Session(MemoryStore(), KEY)
    outcomes: list[TurnFinished | Exception] = []
    async with trio.open_nursery() as nursery:
        original = Agent(ScriptedModel([reply(calls=[("slow", {})]), "original done"]), TOOLS)
        nursery.start_soon(original.run_turn, session, "go")
        await RUNS.hanging.wait()
        try:
            outcomes.append(await Agent(ScriptedModel(["resumed"]), TOOLS).resume_turn(session))
        except Exception as exc:  # refusing (the turn runs) would be a fix
            outcomes.append(exc)
        RUNS.release.set()

    entries = await session.entries()
    assert len(answering(entries, entries[1]["uuid"])) == 1
    observation = (await session.messages())[2].observations[0]
    assert (observation.content, observation.error) == ("the real result", None)


async def test_resume_of_a_reply_cut_by_the_token_limit_says_max_tokens() -> None:
    session = Session(MemoryStore(), KEY)
    cut = reply("half an ans", stop_reason="max_tokens")
    first = await Agent(ScriptedModel([cut]), TOOLS).run_turn(session, "go")
    assert first.reason == "max_tokens"
    model = ScriptedModel([])
    again = await Agent(model, TOOLS).resume_turn(session)
    assert model.requests == []  # held: not asked again
    assert (again.reason, again.text) == ("max_tokens", "half an ans")


async def test_a_resumed_cut_reply_is_a_request_anthropic_accepts() -> None:
    session = Session(MemoryStore(), KEY)
    await session.append(Message("user", [Text("go")]))
    # What Agent._ask records when the turn is cancelled after the first paragraph streamed.
    await session.record_partial("Let me look at the notes.\n\n", model="anthropic:claude")
    model = ScriptedModel(["the whole answer"])
    assert (await Agent(model, TOOLS).resume_turn(session)).reason == "final"

    async with httpx.AsyncClient() as client:
        _, _, body = AnthropicModel("claude-x", client=client).build(
            model.requests[-1], stream=True
        )
    last = body["messages"][-1]
    final_text = "".join(b.get("text", "") for b in last["content"])
    assert last["role"] == "user" or final_text == final_text.rstrip()


async def test_a_torn_results_line_is_cut_and_the_calls_are_answered_once(
    tmp_path: Path,
) -> None:
    entries = await crash_while_calls_run(
        ScriptedModel([reply(calls=[("note", {"text": "a"}), ("hang", {})])])
    )
    assert [e["type"] for e in entries] == ["user", "assistant"]
    async with FileStore(tmp_path) as seed:
        await seed.append(KEY, entries)
    # The results entry, half written when the process died.
    torn = json.dumps({"type": "tool", "answers": entries[1]["uuid"], "message": {"role": "t"}})
    path = transcript_path(str(tmp_path), KEY)
    assert await trio.Path(path).is_file()
    async with await trio.open_file(path, "a", encoding="utf-8") as f:
        await f.write(torn[: len(torn) // 2])

    model = ScriptedModel(["recovered"])
    async with FileStore(tmp_path) as store:
        result = await Agent(model, TOOLS).resume_turn(Session(store, KEY))
    assert (result.reason, result.text) == ("final", "recovered")
    assert RUNS.count == {"note": 1, "hang": 1}
    async with FileStore(tmp_path) as reread:
        after = await Session(reread, KEY).entries()
    assert [e["type"] for e in after] == ["user", "assistant", "tool", "assistant"]
    assert [o.error for o in model.requests[-1].messages[-1].observations] == [
        INTERRUPTED,
        INTERRUPTED,
    ]


async def test_results_recorded_for_some_calls_only_are_kept_and_the_rest_answered() -> None:
    entries = await crash_while_calls_run(
        ScriptedModel([reply(calls=[("note", {"text": "a"}), ("hang", {})])])
    )
    session = await memory_copy(entries)
    assistant = message_from_entry(entries[1])
    assert assistant is not None
    # Another writer's results entry that answers the first call only.
    first_only = Message("tool", [Observation.success(assistant.tool_calls[0], 0, "noted a")])
    partial_results = message_entry(
        first_only, timestamp=entries[1]["timestamp"], answers=entries[1]["uuid"]
    )
    await session.append_entries([partial_results])
    model = ScriptedModel(["recovered"])
    await Agent(model, TOOLS).resume_turn(session)
    observations = model.requests[-1].messages[-1].observations
    assert [o.call_id for o in observations] == ["call_0", "call_1"]
    assert observations[0].content == "noted a" and observations[1].error is not None
    assert observations[1].error.kind == "crashed"
    assert RUNS.count == {"note": 1, "hang": 1}


async def test_a_transcript_ending_in_a_compaction_resumes_from_its_summary() -> None:
    session = Session(MemoryStore(), KEY)
    await Agent(ScriptedModel(["first answer"]), TOOLS).run_turn(session, "first")
    await Agent(ScriptedModel(["second answer"]), TOOLS).run_turn(session, "second")
    through = (await session.entries())[-1]["uuid"]
    crash = Agent(ScriptedModel([reply(calls=[("hang", {})])]), TOOLS)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(crash.run_turn, session, "third")
        await RUNS.hanging.wait()
        entries = await session.entries()
        nursery.cancel_scope.cancel()
    crashed = await memory_copy(entries)
    # The compaction the kernel ran after the second turn lands after the crashed calls.
    await crashed.record_compaction("two questions answered", through=through, usage={}, model="m")

    model = ScriptedModel(["recovered"])
    result = await Agent(model, TOOLS).resume_turn(crashed)
    assert (result.reason, result.steps) == ("final", 1)
    sent = model.requests[-1].messages
    assert [m.role for m in sent] == ["user", "user", "assistant", "tool"]
    assert sent[0].text == SUMMARY_PREFIX + "two questions answered"
    assert sent[1].text == "third"
    assert sent[3].observations[0].error == INTERRUPTED
    assert RUNS.count == {"hang": 1}


async def test_text_and_calls_resume_as_requests_openai_and_anthropic_accept() -> None:
    calls = [("note", {"text": "a"}), ("hang", {}), ("note", {"text": "b"})]
    entries = await crash_while_calls_run(ScriptedModel([reply("I will take notes.", calls=calls)]))
    session = await memory_copy(entries)
    model = ScriptedModel(["recovered"])
    await Agent(model, TOOLS).resume_turn(session)
    request = model.requests[-1]
    async with httpx.AsyncClient() as client:
        _, _, openai = OpenAIModel("gpt-x", client=client).build(request, stream=True)
        _, _, anthropic = AnthropicModel("claude-x", client=client).build(request, stream=True)

    # OpenAI: the assistant's tool_calls, then one tool message per id, in order.
    roles = [m["role"] for m in openai["messages"]]
    assert roles == ["user", "assistant", "tool", "tool", "tool"]
    assistant = openai["messages"][1]
    assert assistant["content"] == "I will take notes."
    ids = [c["id"] for c in assistant["tool_calls"]]
    assert (
        [m["tool_call_id"] for m in openai["messages"][2:]]
        == ids
        == [
            "call_0",
            "call_1",
            "call_2",
        ]
    )
    # Anthropic: tool_use blocks, then tool_result blocks for each, in order, first.
    assert [m["role"] for m in anthropic["messages"]] == ["user", "assistant", "user"]
    uses = [b["id"] for b in anthropic["messages"][1]["content"] if b["type"] == "tool_use"]
    results = anthropic["messages"][2]["content"]
    assert [b["tool_use_id"] for b in results] == uses == ids
    assert [b.get("is_error", False) for b in results] == [True, True, True]
    assert RUNS.count == {"note": 2, "hang": 1}  # none run again


async def test_a_crash_inside_a_subagent_resumes_the_parent_without_delegating_again() -> None:
    first = ScriptedModel(
        [reply(calls=[("delegate", {"task": "take a note"})]), reply(calls=[("hang", {})])]
    )
    entries = await crash_while_calls_run(first, agent=Agent(first, TOOLS, subagents=True))
    assert [e["type"] for e in entries] == ["user", "assistant"]
    session = await memory_copy(entries)
    model = ScriptedModel(["recovered"])
    result = await Agent(model, TOOLS, subagents=True).resume_turn(session)
    assert (result.reason, result.steps) == ("final", 1)
    assert len(model.requests) == 1  # no subagent turn
    observation = model.requests[-1].messages[-1].observations[0]
    assert (observation.call_id, observation.error) == ("call_0", INTERRUPTED)
    assert RUNS.count == {"hang": 1}


async def test_a_turn_that_ended_on_a_model_error_is_asked_again() -> None:
    session = Session(MemoryStore(), KEY)
    error = ProviderError("openai", status=500, error_type="server_error", message="down")
    failed = await Agent(ScriptedModel([error]), TOOLS).run_turn(session, "go")
    assert failed.reason == "model_error"
    model = ScriptedModel(["answered"])
    result = await Agent(model, TOOLS).resume_turn(session)
    assert (result.reason, result.text) == ("final", "answered")
    assert [m.role for m in model.requests[-1].messages] == ["user"]
    assert [e["type"] for e in await session.entries()] == ["user", "assistant"]


async def test_a_batch_task_stopped_before_its_prompt_is_asked_it_on_resume(
    tmp_path: Path,
) -> None:
    hello = Message("assistant", [Text("hello, what shall I do?")])
    task = BatchTask(
        id="t1",
        messages=(Message("user", [Text("hi")]), hello, Message("user", [Text("do X")])),
    )
    model = ScriptedModel(["X done"])
    async with (
        open_kernel(home=tmp_path / "home", model="scripted:echo", tools=TOOLS, plugins=[]) as k,
        open_run_dir(tmp_path / "run-1") as ledger,
    ):
        k.agent.model = model
        # What the first run left when it was killed (or cancelled, which releases the
        # task) between appending the task's earlier messages and its prompt.
        seeded = k.session(task.id, project=ledger.session_project)
        await seeded.append(Message("user", [Text("hi")]), hello)
        await run_batch(k, [task], ledger=ledger, max_concurrency=1)
        [result] = await ledger.results()
    assert [m.messages[-1].text for m in model.requests] == ["do X"]
    assert (result.reason, result.text) == ("final", "X done")
