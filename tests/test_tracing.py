"""OpenTelemetry spans of turns, model requests and tool calls (``kernel.tracing``).

Spans go to the SDK's in-memory exporter through a provider given to
``kernel.tracing.use_tracer_provider`` (the global one can be set once per
process: that path runs in a subprocess).
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
import trio
from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from kernel import CallLimits, open_kernel, tool, tracing
from kernel.agent import Agent
from kernel.batch import BatchTask
from kernel.batch._directory import open_run_dir
from kernel.batch._run import run_batch
from kernel.models import ModelRequest, ModelResponse, ProviderError, ScriptedModel, Usage
from kernel.session import Session
from kernel.store import MemoryStore, SessionKey
from tests.tracing_kit import collected_spans

reply = ScriptedModel.reply


@tool
async def lookup(term: str) -> str:
    """Look a term up (opens a span of its own)."""
    with tracing.span("lookup.inner", {"term": term}):
        await trio.sleep(0.5)
    return f"{term}: found"


@tool
async def explode() -> str:
    """Fail."""
    await trio.sleep(0.1)
    raise RuntimeError("boom")


@tool
async def hang() -> str:
    """Never finish."""
    await trio.sleep_forever()
    raise AssertionError("unreachable")


TOOLS = [lookup, explode, hang]


@pytest.fixture
def spans() -> Iterator[InMemorySpanExporter]:
    with collected_spans() as exporter:
        yield exporter


def session(session_id: str = "s1") -> Session:
    return Session(MemoryStore(), SessionKey("p", session_id))


def named(finished: Sequence[ReadableSpan], name: str) -> list[ReadableSpan]:
    return [s for s in finished if s.name == name]


def one(finished: Sequence[ReadableSpan], name: str) -> ReadableSpan:
    [found] = named(finished, name)
    return found


def parent_of(span: ReadableSpan, finished: Sequence[ReadableSpan]) -> ReadableSpan | None:
    if span.parent is None:
        return None
    [parent] = [s for s in finished if s.context.span_id == span.parent.span_id]
    return parent


def error_type(span: ReadableSpan) -> object:
    assert span.attributes is not None
    return span.attributes.get("error.type")


async def test_a_turn_with_three_parallel_calls_one_failing(
    spans: InMemorySpanExporter, autojump_clock: trio.abc.Clock
) -> None:
    model = ScriptedModel(
        [
            reply(
                calls=[("lookup", {"term": "a"}), ("explode", {}), ("lookup", {"term": "b"})],
                usage=Usage(100, 10),
            ),
            reply("done", usage=Usage(150, 5)),
        ]
    )
    s = session()
    result = await Agent(model, TOOLS, name="researcher").run_turn(s, "go")
    assert result.reason == "final"
    finished = spans.get_finished_spans()

    turn = one(finished, "invoke_agent researcher")
    chats = named(finished, "chat test")
    lookups = named(finished, "execute_tool lookup")
    failed = one(finished, "execute_tool explode")
    assert (len(chats), len(lookups)) == (2, 2)
    assert len(finished) == 1 + 2 + 3 + 2  # and the two spans the lookups opened

    assert turn.parent is None and turn.kind == SpanKind.INTERNAL
    assert dict(turn.attributes or {}) == {
        "gen_ai.operation.name": "invoke_agent",
        "gen_ai.provider.name": "scripted",
        "gen_ai.request.model": "test",
        "gen_ai.agent.name": "researcher",
        "gen_ai.conversation.id": "p/s1",
        "gen_ai.usage.input_tokens": 250,
        "gen_ai.usage.output_tokens": 15,
        "tak.turn.reason": "final",
        "tak.turn.steps": 2,
    }
    assert turn.status.status_code == StatusCode.UNSET

    for child in [*chats, *lookups, failed]:
        assert parent_of(child, finished) is turn
        assert child.context.trace_id == turn.context.trace_id
    first, second = sorted(chats, key=lambda c: c.start_time or 0)
    assert first.kind == SpanKind.CLIENT
    assert first.attributes is not None
    assert first.attributes["gen_ai.operation.name"] == "chat"
    assert first.attributes["gen_ai.request.model"] == "test"
    assert first.attributes["gen_ai.response.model"] == "scripted"
    assert first.attributes["gen_ai.conversation.id"] == "p/s1"
    assert first.attributes["gen_ai.response.finish_reasons"] == ("tool_use",)
    assert first.attributes["gen_ai.usage.input_tokens"] == 100
    assert first.attributes["gen_ai.usage.output_tokens"] == 10
    assert second.attributes is not None
    assert second.attributes["gen_ai.usage.input_tokens"] == 150
    assert second.attributes["gen_ai.response.finish_reasons"] == ("end_turn",)
    # The calls run after the first request and before the second.
    assert all(
        (first.end_time or 0) <= (c.start_time or 0)
        and (c.end_time or 0) <= (second.start_time or 0)
        for c in [*lookups, failed]
    )

    calls = (await s.messages())[1].tool_calls
    by_id = {c.attributes["gen_ai.tool.call.id"]: c for c in [*lookups, failed] if c.attributes}
    assert set(by_id) == {c.id for c in calls}
    for call in calls:
        traced = by_id[call.id]
        assert traced.kind == SpanKind.INTERNAL
        assert traced.attributes is not None
        assert traced.attributes["gen_ai.operation.name"] == "execute_tool"
        assert traced.attributes["gen_ai.tool.name"] == call.name
        assert traced.attributes["gen_ai.tool.type"] == "function"
    assert error_type(failed) == "exception"
    assert (
        failed.attributes is not None and failed.attributes["tak.tool.error_type"] == "RuntimeError"
    )
    assert failed.status.status_code == StatusCode.ERROR
    # The class, not the message: a message can quote the call's arguments.
    assert failed.status.description == "RuntimeError"
    for ok in lookups:
        assert error_type(ok) is None and ok.status.status_code == StatusCode.UNSET
    # A span opened inside a tool is a child of that call's span, though the calls run
    # in parallel tasks.
    for inner in named(finished, "lookup.inner"):
        parent = parent_of(inner, finished)
        assert parent is not None and parent.name == "execute_tool lookup"
        assert parent.attributes is not None and inner.attributes is not None
        term = inner.attributes["term"]
        assert parent.attributes["gen_ai.tool.call.id"] == calls[0 if term == "a" else 2].id


async def test_turn_spans_nest_under_the_span_around_them(
    spans: InMemorySpanExporter, autojump_clock: trio.abc.Clock
) -> None:
    async def task(task_id: str) -> None:
        model = ScriptedModel([reply(calls=[("lookup", {"term": task_id})]), "done"])
        with tracing.span("batch_task", {"tak.batch.task_id": task_id}):
            await Agent(model, TOOLS).run_turn(session(task_id), "go")

    # Two tasks at once: each one's spans under its own batch_task span.
    async with trio.open_nursery() as nursery:
        nursery.start_soon(task, "t1")
        nursery.start_soon(task, "t2")
    finished = spans.get_finished_spans()

    outers = named(finished, "batch_task")
    assert len(outers) == 2 and all(o.parent is None for o in outers)
    for outer in outers:
        assert outer.attributes is not None
        task_id = str(outer.attributes["tak.batch.task_id"])
        [turn] = [s for s in named(finished, "invoke_agent tak") if parent_of(s, finished) is outer]
        assert turn.attributes is not None
        assert turn.attributes["gen_ai.conversation.id"] == f"p/{task_id}"
        children = [s for s in finished if parent_of(s, finished) is turn]
        assert sorted(c.name for c in children) == ["chat test", "chat test", "execute_tool lookup"]
        assert {c.context.trace_id for c in children} == {outer.context.trace_id}


async def test_a_batch_tasks_turn_nests_under_its_span(
    spans: InMemorySpanExporter, tmp_path: Path
) -> None:
    def script(request: ModelRequest) -> ModelResponse | str:
        if request.messages[-1].role == "user":
            return reply(calls=[("lookup", {"term": "x"}), ("explode", {})])
        return "done"

    work = [BatchTask(id=f"t{i}", prompt=f"task {i}") for i in range(3)]
    async with (
        open_kernel(home=tmp_path / "home", model="scripted:echo", tools=TOOLS, plugins=[]) as k,
        open_run_dir(tmp_path / "run-1") as ledger,
    ):
        k.agent.model = ScriptedModel(script, keep_requests=0)
        await run_batch(k, work, ledger=ledger, max_concurrency=3)
    finished = spans.get_finished_spans()

    tasks = named(finished, "batch_task")
    assert len(tasks) == 3
    for task in tasks:
        [turn] = [s for s in finished if parent_of(s, finished) is task]
        assert turn.name == "invoke_agent tak"
        children = sorted(s.name for s in finished if parent_of(s, finished) is turn)
        assert children == [
            "chat test",
            "chat test",
            "execute_tool explode",
            "execute_tool lookup",
        ]


async def test_a_cancelled_turn_ends_its_spans(
    spans: InMemorySpanExporter, autojump_clock: trio.abc.Clock
) -> None:
    model = ScriptedModel([reply(calls=[("hang", {}), ("lookup", {"term": "x"})])])
    with trio.move_on_after(5) as scope:
        await Agent(model, TOOLS).run_turn(session(), "go")
    assert scope.cancelled_caught
    finished = spans.get_finished_spans()

    # Every span was ended (only ended spans are exported).
    assert sorted(s.name for s in finished) == [
        "chat test",
        "execute_tool hang",
        "execute_tool lookup",
        "invoke_agent tak",
        "lookup.inner",
    ]
    turn = one(finished, "invoke_agent tak")
    assert error_type(turn) == "cancelled" and turn.status.status_code == StatusCode.ERROR
    assert turn.attributes is not None and turn.attributes["tak.turn.reason"] == "cancelled"
    hung = one(finished, "execute_tool hang")
    assert error_type(hung) == "cancelled" and parent_of(hung, finished) is turn
    assert error_type(one(finished, "execute_tool lookup")) is None
    assert error_type(one(finished, "chat test")) is None
    # Nothing is left current in this task.
    assert not trace.get_current_span().get_span_context().is_valid


async def test_a_timed_out_call_and_a_refused_call_have_their_kinds(
    spans: InMemorySpanExporter, autojump_clock: trio.abc.Clock
) -> None:
    model = ScriptedModel([reply(calls=[("hang", {}), ("nope", {})]), "done"])
    agent = Agent(model, TOOLS, call_limits=CallLimits(timeout=3))
    await agent.run_turn(session(), "go")
    finished = spans.get_finished_spans()
    assert error_type(one(finished, "execute_tool hang")) == "timeout"
    refused = one(finished, "execute_tool nope")
    assert error_type(refused) == "unknown_tool"
    assert parent_of(refused, finished) is one(finished, "invoke_agent tak")


async def test_a_model_error_fails_the_request_and_the_turn(
    spans: InMemorySpanExporter,
) -> None:
    error = ProviderError("openai", status=400, error_type="invalid_request_error", message="bad")
    result = await Agent(ScriptedModel([error]), TOOLS).run_turn(session(), "go")
    assert result.reason == "model_error"
    finished = spans.get_finished_spans()
    chat = one(finished, "chat test")
    assert error_type(chat) == "invalid_request_error"
    assert chat.status.status_code == StatusCode.ERROR
    turn = one(finished, "invoke_agent tak")
    assert error_type(turn) == "model_error" and "invalid_request_error" in (
        turn.status.description or ""
    )


async def test_a_subagent_turn_nests_under_the_delegate_call(
    spans: InMemorySpanExporter, autojump_clock: trio.abc.Clock
) -> None:
    model = ScriptedModel(
        [reply(calls=[("delegate", {"task": "look x up"})]), "x: found", "the subagent said so"]
    )
    await Agent(model, TOOLS, subagents=True).run_turn(session(), "go")
    finished = spans.get_finished_spans()
    delegate = one(finished, "execute_tool delegate")
    outer, inner = sorted(named(finished, "invoke_agent tak"), key=lambda s: s.start_time or 0)
    assert parent_of(delegate, finished) is outer
    assert parent_of(inner, finished) is delegate
    assert inner.attributes is not None
    assert str(inner.attributes["gen_ai.conversation.id"]).startswith("p/s1:subagents/")


async def test_a_resumed_turn_is_traced_too(spans: InMemorySpanExporter) -> None:
    s = session()
    await Agent(ScriptedModel(["done"]), TOOLS).run_turn(s, "go")
    spans.clear()
    await Agent(ScriptedModel([]), TOOLS).resume_turn(s)
    [turn] = spans.get_finished_spans()
    assert turn.name == "invoke_agent tak"
    assert turn.attributes is not None and turn.attributes["tak.turn.steps"] == 0


async def test_without_a_provider_spans_do_nothing(spans: InMemorySpanExporter) -> None:
    tracing.use_tracer_provider(None)
    if not isinstance(trace.get_tracer_provider(), trace.ProxyTracerProvider):
        pytest.skip("a global tracer provider was set in this process")
    assert not tracing.enabled()
    with tracing.span("outer") as s:
        s.set_attribute("a", 1)
        s.set_error("exception", "never seen")
    await Agent(ScriptedModel(["done"]), TOOLS).run_turn(session(), "go")
    assert spans.get_finished_spans() == ()


def run_python(code: str) -> str:
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_import_kernel_and_an_untraced_turn_import_no_opentelemetry() -> None:
    out = run_python(
        """
        import sys
        import trio
        import kernel
        from kernel.agent import Agent
        from kernel.models import ScriptedModel
        from kernel.session import Session
        from kernel.store import MemoryStore, SessionKey

        assert not [m for m in sys.modules if m.startswith("opentelemetry")], "on import"
        session = Session(MemoryStore(), SessionKey("p", "s"))
        trio.run(Agent(ScriptedModel(["done"])).run_turn, session, "go")
        print(sorted(m for m in sys.modules if m.startswith("opentelemetry")))
        """
    )
    assert out.strip() == "[]"


def test_the_global_tracer_provider_is_used_once_it_is_set() -> None:
    out = run_python(
        """
        import trio
        from opentelemetry import trace
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import SimpleSpanProcessor
        from opentelemetry.sdk.trace.export.in_memory_span_exporter import (
            InMemorySpanExporter,
        )
        from kernel import tracing
        from kernel.agent import Agent
        from kernel.models import ScriptedModel
        from kernel.session import Session
        from kernel.store import MemoryStore, SessionKey

        def turn():
            session = Session(MemoryStore(), SessionKey("p", "s"))
            trio.run(Agent(ScriptedModel(["done"])).run_turn, session, "go")

        print(tracing.enabled())  # the API's proxy provider: off
        turn()
        exporter = InMemorySpanExporter()
        provider = TracerProvider()
        provider.add_span_processor(SimpleSpanProcessor(exporter))
        trace.set_tracer_provider(provider)
        print(tracing.enabled())
        turn()
        print(sorted(s.name for s in exporter.get_finished_spans()))
        """
    )
    assert out.splitlines() == ["False", "True", "['chat test', 'invoke_agent tak']"]


class RaisingProcessor(SimpleSpanProcessor):
    """Exports like the SDK's, but raises at every start and end (a buggy processor)."""

    def on_start(self, span: Any, parent_context: Any = None) -> None:
        raise RuntimeError("on_start bug")

    def on_end(self, span: ReadableSpan) -> None:
        super().on_end(span)
        raise RuntimeError("on_end bug")


async def test_a_processor_failing_at_every_span_fails_nothing_and_is_logged_once(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(tracing._state, "warned", False)  # another test may have warned
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(RaisingProcessor(exporter))
    tracing.use_tracer_provider(provider)
    s = session()
    try:
        model = ScriptedModel([reply(calls=[("lookup", {"term": "a"}), ("explode", {})]), "done"])
        result = await Agent(model, TOOLS).run_turn(s, "go")
        with tracing.span("mine"):
            pass
    finally:
        tracing.use_tracer_provider(None)
        provider.shutdown()
    assert (result.reason, result.text) == ("final", "done")
    observations = (await s.messages())[2].observations
    assert observations[0].content == "a: found" and observations[1].error is not None
    warnings = [r for r in caplog.records if r.name == "kernel.tracing"]
    assert len(warnings) == 1 and "on_start bug" in caplog.text


async def test_names_and_strings_given_to_a_span_are_cut(spans: InMemorySpanExporter) -> None:
    long = "y" * 5_000
    with tracing.span(f"mine {long}", {"a": long, "b": ("short", long), "n": 3}) as s:
        s.set_attribute("c", long)
        s.set_error(long, long)
    [span] = spans.get_finished_spans()
    attributes = dict(span.attributes or {})
    texts = [span.name, attributes["a"], *attributes["b"], attributes["c"]]
    texts += [attributes["error.type"], span.status.description or ""]
    assert all(len(t) <= tracing.MAX_TEXT for t in texts)
    assert span.name.startswith("mine yyy") and attributes["b"][0] == "short"
    assert attributes["n"] == 3


async def test_a_span_starts_when_its_block_is_entered(spans: InMemorySpanExporter) -> None:
    block = tracing.span("later")
    with tracing.span("outer"):
        with block:
            pass
    finished = spans.get_finished_spans()
    assert parent_of(one(finished, "later"), finished) is one(finished, "outer")
