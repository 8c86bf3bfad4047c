"""Review of ``Agent.resume_turn`` and the OpenTelemetry spans: attacks that broke them
(each was ``xfail(strict=True)`` until fixed) and guarantees that held.

Crashed transcripts are what the store held while a real turn's calls ran
(``crash_while_calls_run``), copied into a fresh store: what a SIGKILL leaves.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import textwrap
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

import httpx
import pytest
import trio
from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan, SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode

from kernel import open_kernel, tool, tracing
from kernel.agent import INTERRUPTED, Agent, AgentEvent, TurnFinished
from kernel.batch import BatchTask
from kernel.batch._directory import open_run_dir
from kernel.batch._run import run_batch
from kernel.history import SUMMARY_PREFIX
from kernel.messages import Message, Observation, Text
from kernel.models import ModelRequest, ModelResponse, ProviderError, ScriptedModel
from kernel.models._anthropic import AnthropicModel
from kernel.models._openai import OpenAIModel
from kernel.session import Session, message_entry, message_from_entry
from kernel.store import FileStore, MemoryStore, SessionKey
from kernel.store._disk import transcript_path

reply = ScriptedModel.reply
KEY = SessionKey("p", "task-1")


class Runs:
    """How many times each tool ran; set when a hanging call has started."""

    def __init__(self) -> None:
        self.count: dict[str, int] = {}
        self.hanging = trio.Event()
        self.release = trio.Event()

    def ran(self, name: str) -> None:
        self.count[name] = self.count.get(name, 0) + 1


RUNS = Runs()


@pytest.fixture(autouse=True)
def fresh_runs() -> None:
    global RUNS
    RUNS = Runs()


@tool
async def hang() -> str:
    """Run until cancelled (a side effect happens first)."""
    RUNS.ran("hang")
    RUNS.hanging.set()
    await trio.sleep_forever()
    raise AssertionError("unreachable")


@tool
async def slow() -> str:
    """Run until released, then return a real result."""
    RUNS.ran("slow")
    RUNS.hanging.set()
    await RUNS.release.wait()
    return "the real result"


@tool
async def note(text: str) -> str:
    """Write a note (a side effect)."""
    RUNS.ran("note")
    return f"noted {text}"


@tool
async def read_file(path: str) -> str:
    """Read a file (fails as ``open`` does, naming the path)."""
    raise FileNotFoundError(2, "No such file or directory", path)


TOOLS = [hang, slow, note, read_file]


async def crash_while_calls_run(model: ScriptedModel, *, agent: Agent | None = None) -> list[Any]:
    """Run a turn until a ``hang`` call runs; the entries the store held at that moment."""
    session = Session(MemoryStore(), KEY)
    runner = agent if agent is not None else Agent(model, TOOLS)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(runner.run_turn, session, "go")
        await RUNS.hanging.wait()
        entries = await session.entries()
        nursery.cancel_scope.cancel()
    return entries


async def memory_copy(entries: Sequence[Any]) -> Session:
    store = MemoryStore()
    await store.append(KEY, entries)
    return Session(store, KEY)


def answering(entries: Sequence[dict[str, Any]], uuid: str) -> list[dict[str, Any]]:
    return [e for e in entries if e.get("type") == "tool" and e.get("answers") == uuid]


# --- resume: attacks that broke it -------------------------------------------------


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


# --- resume: what held ---------------------------------------------------------------


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


# --- tracing -------------------------------------------------------------------------


@pytest.fixture
def spans() -> Iterator[InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracing.use_tracer_provider(provider)
    try:
        yield exporter
    finally:
        tracing.use_tracer_provider(None)
        provider.shutdown()


def named(finished: Sequence[ReadableSpan], name: str) -> list[ReadableSpan]:
    return [s for s in finished if s.name == name]


def span_text(span: ReadableSpan) -> str:
    """Every string a span carries: name, attribute values, status description."""
    values = [str(v) for v in (span.attributes or {}).values()]
    return "\n".join([span.name, *values, span.status.description or ""])


async def model_with_a_nursery(request: ModelRequest) -> ModelResponse:
    """A model implementation that runs a helper task while it waits (a keepalive, a
    hedged second request): cancelled, its nursery raises a group of ``Cancelled``."""
    async with trio.open_nursery() as nursery:
        nursery.start_soon(trio.sleep_forever)
        await trio.sleep_forever()
    raise AssertionError("unreachable")


async def test_a_model_cancelled_as_a_group_marks_its_spans_cancelled(
    spans: InMemorySpanExporter, autojump_clock: trio.abc.Clock
) -> None:
    with trio.move_on_after(5):
        await Agent(ScriptedModel([model_with_a_nursery]), TOOLS).run_turn(
            Session(MemoryStore(), KEY), "go"
        )
    finished = spans.get_finished_spans()
    kinds = {s.name: (s.attributes or {}).get("error.type") for s in finished}
    assert kinds == {"chat test": "cancelled", "invoke_agent tak": "cancelled"}


async def test_a_turn_cancelled_as_a_group_still_ends_with_a_cancelled_event(
    autojump_clock: trio.abc.Clock,
) -> None:
    events: list[AgentEvent] = []
    with trio.move_on_after(5):
        await Agent(ScriptedModel([model_with_a_nursery]), TOOLS).run_turn(
            Session(MemoryStore(), KEY), "go", on_event=events.append
        )
    assert events and isinstance(events[-1], TurnFinished)
    assert events[-1].reason == "cancelled"


@tool
async def pick(mode: Literal["fast", "thorough"]) -> str:
    """Pick a mode."""
    return mode


async def test_a_failing_calls_arguments_stay_out_of_its_span(
    spans: InMemorySpanExporter,
) -> None:
    path = "/home/alice/medical/diagnosis-2026.pdf"
    mode = "my-password-hunter2"
    calls = [("read_file", {"path": path}), ("pick", {"mode": mode})]
    model = ScriptedModel([reply(calls=calls), "done"])
    await Agent(model, [*TOOLS, pick]).run_turn(Session(MemoryStore(), KEY), "go")
    finished = spans.get_finished_spans()
    kinds = {s.name: (s.attributes or {}).get("error.type") for s in finished}
    assert kinds["execute_tool read_file"] == "exception"  # held
    assert kinds["execute_tool pick"] == "bad_arguments"  # held
    leaked = [s.name for s in finished for value in (path, mode) if value in span_text(s)]
    assert leaked == []


async def test_a_tool_name_the_model_made_up_is_bounded_in_its_span(
    spans: InMemorySpanExporter,
) -> None:
    made_up = "x" * 100_000
    model = ScriptedModel([reply(calls=[(made_up, {})]), "done"])
    await Agent(model, TOOLS).run_turn(Session(MemoryStore(), KEY), "go")
    [call] = [s for s in spans.get_finished_spans() if s.name.startswith("execute_tool")]
    assert (call.attributes or {}).get("error.type") == "unknown_tool"  # held
    assert len(span_text(call)) < 10_000


def run_python(code: str, env: dict[str, str] | None = None) -> str:
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env={**os.environ, **(env or {})},
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_opentelemetry_missing_with_the_provider_variable_set_is_looked_for_once() -> None:
    out = run_python(
        """
        import sys

        attempts = []

        class NotInstalled:
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] == "opentelemetry":
                    attempts.append(name)
                    raise ModuleNotFoundError(f"No module named {name!r}", name=name)
                return None

        sys.meta_path.insert(0, NotInstalled())
        import trio
        from kernel import tool
        from kernel.agent import Agent
        from kernel.models import ScriptedModel
        from kernel.session import Session, message_entry, message_from_entry
        from kernel.store import MemoryStore, SessionKey

        @tool
        async def note(text: str) -> str:
            "Note."
            return "ok"

        session = Session(MemoryStore(), SessionKey("p", "s"))
        for _ in range(3):
            model = ScriptedModel([ScriptedModel.reply(calls=[("note", {"text": "a"})]), "done"])
            trio.run(Agent(model, [note]).run_turn, session, "go")
        print(len(attempts))
        """,
        env={"OTEL_PYTHON_TRACER_PROVIDER": "sdk_tracer_provider"},
    )
    assert int(out) <= 1


class Stop(BaseException):
    """Not an ``Exception``: a tool raising it is not the call's failure to report."""


@tool
async def stop_everything(how: str) -> str:
    """Raise a BaseException after a while."""
    await trio.sleep(1)
    raise KeyboardInterrupt if how == "KeyboardInterrupt" else Stop("stop")


@pytest.mark.parametrize("how", ["KeyboardInterrupt", "Stop"])
async def test_a_tool_raising_a_base_exception_ends_every_span(
    spans: InMemorySpanExporter, autojump_clock: trio.abc.Clock, how: str
) -> None:
    model = ScriptedModel([reply(calls=[("stop_everything", {"how": how}), ("hang", {})])])
    agent = Agent(model, [*TOOLS, stop_everything])
    with pytest.raises(BaseException) as raised:
        await agent.run_turn(Session(MemoryStore(), KEY), "go")
    if how == "KeyboardInterrupt":
        assert raised.type is KeyboardInterrupt  # never wrapped, never swallowed
    else:
        assert isinstance(raised.value, BaseExceptionGroup) and raised.group_contains(Stop)
    finished = spans.get_finished_spans()
    assert sorted(s.name for s in finished) == [
        "chat test",
        "execute_tool hang",
        "execute_tool stop_everything",
        "invoke_agent tak",
    ]
    for span in finished:
        if span.name != "chat test":
            assert span.status.status_code == StatusCode.ERROR
    assert not trace.get_current_span().get_span_context().is_valid


async def test_a_turn_cancelled_mid_stream_ends_its_spans(
    spans: InMemorySpanExporter, autojump_clock: trio.abc.Clock
) -> None:
    streaming = trio.Event()

    def long_reply(request: ModelRequest) -> ModelResponse:
        streaming.set()
        return reply("one two three four five six")

    session = Session(MemoryStore(), KEY)
    model = ScriptedModel([long_reply], chunk_delay=1.0)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(Agent(model, TOOLS).run_turn, session, "go")
        await streaming.wait()
        await trio.sleep(2.5)
        nursery.cancel_scope.cancel()
    finished = spans.get_finished_spans()
    kinds = {s.name: (s.attributes or {}).get("error.type") for s in finished}
    assert kinds == {"chat test": "cancelled", "invoke_agent tak": "cancelled"}
    assert not trace.get_current_span().get_span_context().is_valid
    assert (await session.entries())[-1].get("partial") is True


async def test_swapping_the_provider_mid_turn_ends_every_span(
    spans: InMemorySpanExporter,
) -> None:
    later = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(later))

    @tool
    async def swap() -> str:
        """Swap the tracer provider."""
        tracing.use_tracer_provider(provider)
        return "swapped"

    try:
        model = ScriptedModel([reply(calls=[("swap", {})]), "done"])
        assert (await Agent(model, [swap]).run_turn(Session(MemoryStore(), KEY), "go")).reason == (
            "final"
        )
    finally:
        provider.shutdown()
    before = spans.get_finished_spans()
    after = later.get_finished_spans()
    assert sorted(s.name for s in before) == ["chat test", "execute_tool swap", "invoke_agent tak"]
    [turn] = named(before, "invoke_agent tak")
    # The request after the swap goes to the new provider, still a child of the turn.
    assert [(s.name, s.parent and s.parent.span_id) for s in after] == [
        ("chat test", turn.context.span_id)
    ]


async def test_attributes_of_any_type_never_raise(spans: InMemorySpanExporter) -> None:
    with tracing.span("mine", {"a.dict": {"k": 1}, "an.object": object(), "none": None}) as s:
        s.set_attribute("a.list", [1, "a"])
        s.set_attribute("another.object", object())
        s.set_error("bad", "message")
    [span] = spans.get_finished_spans()
    assert (span.attributes or {}).get("error.type") == "bad"


async def test_no_prompt_reply_argument_or_result_is_in_a_span(
    spans: InMemorySpanExporter,
) -> None:
    model = ScriptedModel(
        [reply("thinking-aloud-text", calls=[("note", {"text": "argument-value"})]), "reply-text"]
    )
    await Agent(model, TOOLS).run_turn(Session(MemoryStore(), KEY), "prompt-text")
    finished = spans.get_finished_spans()
    assert len(finished) == 4
    for content in ["prompt-text", "thinking-aloud", "argument-value", "noted", "reply-text"]:
        assert [s.name for s in finished if content in span_text(s)] == []


async def test_a_resume_and_a_turn_at_once_keep_their_spans_apart(
    spans: InMemorySpanExporter,
) -> None:
    crashed = await memory_copy(
        await crash_while_calls_run(ScriptedModel([reply(calls=[("hang", {})])]))
    )
    spans.clear()
    fresh = Session(MemoryStore(), SessionKey("p", "other"))
    async with trio.open_nursery() as nursery:
        resumed = ScriptedModel([reply(calls=[("note", {"text": "r"})]), "r done"])
        nursery.start_soon(Agent(resumed, TOOLS).resume_turn, crashed)
        ran = ScriptedModel([reply(calls=[("note", {"text": "n"})]), "n done"])
        nursery.start_soon(Agent(ran, TOOLS).run_turn, fresh, "go")
    finished = spans.get_finished_spans()
    turns = named(finished, "invoke_agent tak")
    assert len(turns) == 2 and all(t.parent is None for t in turns)
    for turn in turns:
        children = [s for s in finished if s.parent and s.parent.span_id == turn.context.span_id]
        assert sorted(c.name for c in children) == ["chat test", "chat test", "execute_tool note"]
        conversation = (turn.attributes or {})["gen_ai.conversation.id"]
        assert all(
            (c.attributes or {}).get("gen_ai.conversation.id", conversation) == conversation
            for c in children
        )
    # The interrupted call of the resumed turn was answered, not run: no span of its own.
    assert named(finished, "execute_tool hang") == []


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


class FailingProcessor(SpanProcessor):
    """A span processor with a bug (the SDK calls ``on_end`` without a guard)."""

    def on_end(self, span: ReadableSpan) -> None:
        if span.name.startswith("execute_tool"):
            raise RuntimeError("a bug in a span processor")


async def test_a_failing_span_processor_does_not_lose_the_calls_results() -> None:
    provider = TracerProvider()
    provider.add_span_processor(FailingProcessor())
    tracing.use_tracer_provider(provider)
    session = Session(MemoryStore(), KEY)
    try:
        model = ScriptedModel([reply(calls=[("note", {"text": "a"})]), "done"])
        with contextlib.suppress(RuntimeError):
            await Agent(model, TOOLS).run_turn(session, "go")
    finally:
        tracing.use_tracer_provider(None)
        provider.shutdown()
    assert RUNS.count == {"note": 1}
    messages = await session.messages()
    assert [m.role for m in messages][:3] == ["user", "assistant", "tool"]
    assert messages[2].observations[0].content == "noted a"
