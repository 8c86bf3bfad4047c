"""Tracing never breaks a turn, leaks what it carries, or leaves a span open: a model
cancelled as a group or mid-stream, a tool raising a ``BaseException``, the tracer
provider swapped mid-turn, a span processor with a bug, attribute values of any type, a
resume beside a turn; no prompt, reply, argument or result in a span; and without
OpenTelemetry installed, it is looked for once.

The turns run the tools of tests/crashed_turn_kit.py; tests/test_tracing.py has the
spans of ordinary turns.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator, Sequence
from typing import Literal

import pytest
import trio
from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan, SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode

from kernel import tool, tracing
from kernel.agent import Agent, AgentEvent, TurnFinished
from kernel.models import ModelRequest, ModelResponse, ScriptedModel
from kernel.session import Session
from kernel.store import MemoryStore, SessionKey
from tests.crashed_turn_kit import KEY, RUNS, TOOLS, crash_while_calls_run, memory_copy
from tests.tracing_kit import collected_spans

reply = ScriptedModel.reply


@pytest.fixture(autouse=True)
def fresh_runs() -> None:
    RUNS.reset()


@pytest.fixture
def spans() -> Iterator[InMemorySpanExporter]:
    with collected_spans() as exporter:
        yield exporter


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
