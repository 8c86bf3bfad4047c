"""The agent loop: model → tool calls → observations in declared order → model, until done.

``Agent.run_turn(session, prompt)`` runs one turn and returns how it ended;
``Agent.run(session, prompt)`` is the same turn as a stream of events::

    async with agent.run(session, "summarize the notes") as events:
        async for event in events:
            ...

A turn ends with a final answer or at a limit (steps, tokens, cost, wall
time), and always leaves a valid transcript: the assistant message is
appended before any of its calls runs (a call whose record cannot be written
never runs), and its tool results after them, also when the turn is cancelled
while its calls run (the unfinished ones are recorded as ``cancelled``). If
the kernel dies in between, reading the transcript back answers the calls
with ``crashed`` observations (``kernel.history.messages_from_entries``).

A turn does not read the transcript again: the session's
``kernel.history.HistoryCache`` holds the conversation from the latest
compaction on, extended with what the turn appends.

Turns on one session run one at a time: each holds the session's turn lock
(``Session.hold_turn``), shared by the sessions of one cache (one
``Kernel``). A second ``run_turn`` waits for the first; ``resume_turn``
refuses while a turn runs.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import math
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Mapping, Sequence
from typing import Any, Literal, TypeAlias

import attrs
import trio

from ._checks import check_positive, positive
from .errors import ModelAPIError, StoreError, UsageError
from .executor import (
    CallEvent,
    CallFinished,
    CallLimits,
    CallStarted,
    only_cancelled,
    run_tool_calls,
)
from .history import history_from_entries as history_from_entries
from .history import is_message_entry, message_from_entry
from .messages import Message, Observation, Text, ToolError, recordable
from .models import Model, ModelRequest, ModelResponse, ResponseComplete, TextDelta, Usage
from .plugin import context, use_context
from .session import MessageEntry, Session
from .session import usage_entry_fields as usage_entry_fields
from .settings import ModelSettings, check_tool_choice, merge
from .tools import Tool, ToolFailure, ToolRegistry, select_tools, tool
from .tracing import Span as TraceSpan
from .tracing import enabled as tracing_enabled
from .tracing import span as trace_span

__all__ = [
    "COMPACTION_PROMPT",
    "INTERRUPTED",
    "Agent",
    "AgentEvent",
    "AgentEventCallback",
    "ModelDelta",
    "RunLimits",
    "TurnEnd",
    "TurnFinished",
    "history_from_entries",
    "load_history",
    "run_calls_recorded",
]

TurnEnd: TypeAlias = Literal[
    "final", "max_steps", "max_tokens", "max_cost", "wall_time", "model_error", "cancelled"
]

#: The result a resumed turn records for a call that was running when the run stopped.
INTERRUPTED = ToolError(
    "crashed", "Interrupted", "interrupted: the run stopped before the call finished"
)


#: How long a shielded write of the turn may take once the turn was cancelled
#: (before that, only the store's own bound applies: ``_persist_whole``).
_PERSIST_GRACE_S = 10.0

COMPACTION_PROMPT = (
    "Summarize the conversation so far for your own later use: the user's goals, "
    "decisions made, facts learned from tools (with the exact values that matter), "
    "open questions and next steps. Be complete but brief; do not call tools."
)


def _cut_calls(message: Message, max_tokens: int | None) -> str:
    """What a turn cut by the token limit among its tool calls says."""
    names = ", ".join(dict.fromkeys(call.name for call in message.tool_calls))
    limit = f" (max_tokens {max_tokens})" if max_tokens is not None else ""
    return (
        f"the reply was cut by the token limit{limit} inside its tool calls ({names}): "
        "none ran; raise max_tokens"
    )


@attrs.frozen(kw_only=True)
class RunLimits:
    """When a turn stops even without a final answer.

    Attributes:
        max_steps: model requests in one turn.
        max_tokens: tokens (prompt + output, summed over the turn's requests).
        max_cost: US dollars spent by the turn (needs a known price).
        wall_time: seconds for the whole turn.
    """

    max_steps: int = attrs.field(default=25, validator=positive(integer=True))
    max_tokens: int | None = attrs.field(
        default=None, validator=positive(integer=True, optional=True)
    )
    max_cost: float | None = attrs.field(default=None, validator=positive(optional=True))
    wall_time: float | None = attrs.field(default=None, validator=positive(optional=True))


@attrs.frozen
class ModelDelta:
    """Text the model produced, as it streams."""

    step: int
    text: str


@attrs.frozen
class TurnFinished:
    """How a turn ended: the last event of every turn.

    ``reason`` is ``"final"`` for a final answer; otherwise the limit that was
    hit, ``"model_error"`` (``error`` says what the provider answered) or
    ``"cancelled"``. ``text`` is the last text the model produced.
    """

    reason: TurnEnd
    text: str
    steps: int
    usage: Usage
    error: str | None = None

    @property
    def cost_usd(self) -> float | None:
        return self.usage.cost_usd


AgentEvent: TypeAlias = ModelDelta | CallStarted | CallFinished | TurnFinished
AgentEventCallback: TypeAlias = Callable[[AgentEvent], None]


async def load_history(session: Session) -> list[Message]:
    """``history_from_entries`` of the session's transcript (read through its cache)."""
    return await session.history()


async def run_calls_recorded(
    session: Session,
    assistant: Message,
    tools: Sequence[Tool] | ToolRegistry,
    *,
    limits: CallLimits,
    on_event: Callable[[CallEvent], None] | None = None,
    usage: Mapping[str, int] | None = None,
    model: str | None = None,
    cost_usd: float | None = None,
) -> list[Observation]:
    """Record ``assistant``, run its tool calls, then record their results.

    Nothing runs unless the assistant message was recorded first (as
    ``kernel.messages.recordable`` makes it; the calls that run are the ones
    recorded). The results land even when the caller is cancelled: while the
    calls run (every unfinished one is then ``cancelled``) or after they
    finished; the cancellation is delivered once the record is written.

    Raises:
        StoreError: the assistant message could not be recorded; no call ran.
    """
    _, observations = await _run_recorded(
        session,
        assistant,
        tools,
        limits=limits,
        on_event=on_event,
        usage=usage,
        model=model,
        cost_usd=cost_usd,
    )
    return observations


async def _run_recorded(
    session: Session,
    assistant: Message,
    tools: Sequence[Tool] | ToolRegistry,
    *,
    limits: CallLimits,
    on_event: Callable[[CallEvent], None] | None,
    usage: Mapping[str, int] | None,
    model: str | None,
    cost_usd: float | None,
    on_recorded: Callable[[Message], None] | None = None,
) -> tuple[Message, list[Observation]]:
    """``run_calls_recorded``; also the assistant message as recorded (the session
    makes it recordable: what ran, and what the model sees next), which
    ``on_recorded`` is also given before any call runs."""
    entry = await _record_before_running(
        session, assistant, usage=usage, model=model, cost_usd=cost_usd
    )
    assistant, answers = entry.message, entry.uuid
    if on_recorded is not None:
        on_recorded(assistant)
    calls = assistant.tool_calls
    done: dict[int, Observation] = {}

    def on_call_event(event: CallEvent) -> None:
        if isinstance(event, CallFinished):
            done[event.index] = event.observation
        if on_event is not None:
            on_event(event)

    async def record(observations: Sequence[Observation]) -> None:
        await session.record_results(assistant, observations, answers=answers)

    try:
        observations = await run_tool_calls(calls, tools, limits=limits, on_event=on_call_event)
    except BaseException:
        if len(done) == len(calls):
            await _persist_whole(record([done[i] for i in range(len(calls))]))
        raise
    await _persist_whole(record(observations))
    return assistant, observations


class Agent:
    """A model, its tools and a system prompt; runs turns against sessions.

    Args:
        model: what answers (``kernel.models``).
        tools: the tools the model may call.
        system: the system prompt.
        limits: when a turn stops without a final answer.
        call_limits: deadline, concurrency and output limits for each batch of calls.
        subagents: offer the built-in ``delegate`` tool, which runs a child agent
            on a child transcript (``subagents/<id>``); children cannot delegate.
        compact_after_tokens: ``compact`` summarizes old messages once the
            conversation's prompt passes this many tokens.
        settings: what every request of this agent asks of the model
            (``kernel.settings``); a turn's own settings are merged over them.
        name: the agent's name in traces (``invoke_agent {name}``, ``kernel.tracing``).
    """

    def __init__(
        self,
        model: Model,
        tools: Sequence[Tool] | ToolRegistry = (),
        *,
        system: str | None = None,
        limits: RunLimits = RunLimits(),
        call_limits: CallLimits = CallLimits(),
        subagents: bool = False,
        compact_after_tokens: int | None = None,
        settings: ModelSettings | None = None,
        name: str = "tak",
    ) -> None:
        self.model = model
        self.name = name
        self.settings = settings
        self.tools = tools if isinstance(tools, ToolRegistry) else ToolRegistry(tools)
        self.system = system
        self.limits = limits
        self.call_limits = call_limits
        self.subagents = subagents
        self.compact_after_tokens = compact_after_tokens

    def with_model(self, model: Model) -> Agent:
        """The same agent (tools, prompt, limits) answering with ``model``."""
        return Agent(
            model,
            self.tools,
            system=self.system,
            limits=self.limits,
            call_limits=self.call_limits,
            subagents=self.subagents,
            compact_after_tokens=self.compact_after_tokens,
            settings=self.settings,
            name=self.name,
        )

    @contextlib.asynccontextmanager
    async def run(
        self,
        session: Session,
        prompt: str,
        *,
        settings: ModelSettings | None = None,
        tools: Sequence[str] | None = None,
    ) -> AsyncIterator[trio.MemoryReceiveChannel[AgentEvent]]:
        """Run one turn in a nursery owned by this block; receive its events.

        The last event is ``TurnFinished``. Leaving the block early cancels the
        turn (its transcript stays valid).
        """
        self._prepare(settings, tools)  # bad settings raise here, before the block
        send, receive = trio.open_memory_channel[AgentEvent](math.inf)

        def forward(event: AgentEvent) -> None:
            with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
                send.send_nowait(event)

        async def turn() -> None:
            async with send:
                await self.run_turn(
                    session, prompt, on_event=forward, settings=settings, tools=tools
                )

        async with trio.open_nursery() as nursery:
            nursery.start_soon(turn)
            async with receive:
                yield receive
            nursery.cancel_scope.cancel()

    async def run_turn(
        self,
        session: Session,
        prompt: str,
        *,
        on_event: AgentEventCallback | None = None,
        settings: ModelSettings | None = None,
        tools: Sequence[str] | None = None,
    ) -> TurnFinished:
        """Run one turn: append the prompt, loop model → calls until done, return how it ended.

        ``settings`` are merged over the agent's for this turn; ``tools`` (names
        or ``fnmatch`` patterns such as ``fs.*``) selects the tools offered, and
        only their schemas are sent. A reply cut by the token limit ends the
        turn with reason ``max_tokens``, its text kept and recorded (marked
        ``stop_reason: "max_tokens"``, so that ``resume_turn`` says so too).
        While another turn of the session runs in this process, this one
        waits for it (``Session.hold_turn``).

        Raises:
            UsageError: a pattern in ``tools`` matches no tool, or
                ``settings.tool_choice`` names a tool not offered (nothing is
                recorded then).
            trio.Cancelled: the turn was cancelled from outside; the transcript
                was completed first and ``on_event`` got ``TurnFinished("cancelled")``.
        """

        async def start() -> list[Message]:
            history = await load_history(session)
            # The prompt is sent to the provider as the transcript records it.
            history += await session.append(Message("user", [Text(prompt)]))
            return history

        return await self._turn(session, start, on_event, settings, tools, wait=True)

    async def resume_turn(
        self,
        session: Session,
        *,
        on_event: AgentEventCallback | None = None,
        settings: ModelSettings | None = None,
        tools: Sequence[str] | None = None,
    ) -> TurnFinished:
        """Continue the turn a crash or a cancel left without a final answer.

        When the transcript already ends with the model's last word, that is
        returned at once (``steps=0``, no model request): a final answer as
        ``"final"``, a reply the token limit cut as ``"max_tokens"`` (older
        transcripts, which did not record it, as ``"final"``). Otherwise: if
        the last message is an assistant message whose calls have no recorded
        results (the kernel stopped while they ran), each call gets a
        ``crashed`` observation, "interrupted: the run stopped before the call
        finished", recorded first; the calls are never run again (they may
        have had effects). A reply cut mid-stream (``partial``) stays in the
        transcript but is not sent: the model is asked again from the message
        before it (sent last, it would be a prefill, which providers refuse
        or continue). Then the loop goes on as in ``run_turn``, asking the
        model, under the agent's limits counted afresh (``max_steps``
        requests from here, and so on).

        One turn at a time: within a process (sessions sharing a cache, as a
        ``Kernel``'s do), a resume refuses while a turn or another resume of
        the session runs. Across processes, two resumes that both find
        interrupted calls write one results entry between them (the store
        keeps one entry per uuid) and the one whose entry was kept goes on:
        the other refuses. What is not covered across processes: a resume
        racing the turn it resumes while that turn still runs elsewhere (the
        first results recorded count; the turn, if it is alive, goes on
        too), and two resumes of a transcript that needs no results recorded
        (both ask the model). Resume where the turn ran, or once it is known
        to be gone.

        Raises:
            UsageError: the transcript holds no message (nothing to resume);
                a turn of the session runs (in this process), or another
                resume answered the interrupted calls first (in another);
                ``settings``/``tools`` are refused as by ``run_turn``.
            trio.Cancelled: as for ``run_turn``.
        """

        async def start() -> list[Message] | TurnFinished:
            entries = await session.entries_since_cut()
            found = _last_message(entries)
            if found is None:
                raise UsageError(
                    f"session {session.key}: the transcript holds no message, nothing to resume"
                )
            last, message = found
            if message.role == "assistant" and not last.get("partial"):
                if not message.tool_calls:
                    cut = last.get("stop_reason") == "max_tokens"
                    return TurnFinished("max_tokens" if cut else "final", message.text, 0, Usage())
                await _answer_interrupted(session, last, message)
            history = await load_history(session)
            # A reply cut mid-stream, sent last, would be a prefill: ask again before it.
            for _ in range(_trailing_partials(entries)):
                if not history or history[-1].role != "assistant":
                    break
                history.pop()
            return history

        return await self._turn(session, start, on_event, settings, tools, wait=False)

    async def _turn(
        self,
        session: Session,
        start: Callable[[], Awaitable[list[Message] | TurnFinished]],
        on_event: AgentEventCallback | None,
        settings: ModelSettings | None,
        tools: Sequence[str] | None,
        *,
        wait: bool,
    ) -> TurnFinished:
        """A turn from the conversation ``start`` returns (or how it already ended).

        The one body of ``run_turn`` and ``resume_turn``: the session's turn
        lock (``wait`` for it, or refuse), limits, cancellation, the
        ``TurnFinished`` event.
        """
        turn_settings, registry = self._prepare(settings, tools)
        emit = on_event if on_event is not None else _ignore
        state = _TurnState()
        deadline = (
            trio.current_time() + self.limits.wall_time
            if self.limits.wall_time is not None
            else math.inf
        )
        finished: TurnFinished | None = None
        token = _current_turn.set(_Turn(self, session, registry, turn_settings))
        with trace_span(f"invoke_agent {self.name}", self._turn_attributes(session)) as traced:
            try:
                async with session.hold_turn(wait=wait):
                    with trio.move_on_at(deadline):
                        history = await start()
                        if isinstance(history, TurnFinished):
                            finished = history
                        else:
                            finished = await self._loop(
                                session, history, state, emit, turn_settings, registry
                            )
            except BaseException as exc:
                # A group of nothing but Cancelled (a model's own nursery, cancelled
                # from outside) is a cancellation too.
                if not only_cancelled(exc):
                    raise
                cancelled = state.finish("cancelled")
                _describe_turn(traced, cancelled)
                emit(cancelled)
                if isinstance(exc, BaseExceptionGroup):
                    # The scope cancelled is around us: this raises its Cancelled, bare.
                    await trio.lowlevel.checkpoint()
                raise
            finally:
                _current_turn.reset(token)
            if finished is None:
                finished = state.finish("wall_time")
            _describe_turn(traced, finished, state.error_type)
        emit(finished)
        return finished

    def _turn_attributes(self, session: Session) -> dict[str, Any] | None:
        if not tracing_enabled():
            return None
        provider, model = _provider_and_model(self.model.name)
        return {
            "gen_ai.operation.name": "invoke_agent",
            "gen_ai.provider.name": provider,
            "gen_ai.request.model": model,
            "gen_ai.agent.name": self.name,
            "gen_ai.conversation.id": session.key.name,
        }

    async def _loop(
        self,
        session: Session,
        history: list[Message],
        state: _TurnState,
        emit: AgentEventCallback,
        settings: ModelSettings | None,
        registry: ToolRegistry,
    ) -> TurnFinished:
        while True:
            if state.steps >= self.limits.max_steps:
                return state.finish("max_steps")
            state.steps += 1
            request = ModelRequest(
                messages=tuple(history), system=self.system, tools=registry, settings=settings
            )
            try:
                response = await self._ask(session, request, state.steps, emit)
            except ModelAPIError as exc:
                state.error_type = _model_error_type(exc)
                return state.finish("model_error", error=str(exc))
            state.usage = state.usage + response.usage
            # What is recorded (the session makes it recordable) is what runs and
            # what the model sees next time.
            message = response.message
            cut = response.stop_reason == "max_tokens"
            if not message.tool_calls or cut:
                # Cut by the token limit: not an answer the model finished (and
                # recorded so, for a resume to tell). Cut among its calls, their
                # arguments may be cut too: none runs, and only the text is kept
                # (a call recorded without its result is what providers refuse).
                error = None
                if message.tool_calls:
                    error = _cut_calls(message, request.effective_settings().max_tokens)
                    message = Message("assistant", [Text(message.text)] if message.text else [])
                recorded = await self._record(session, response, message, cut=cut)
                if recorded is not None:  # else abandoned: not in the transcript either
                    history.append(recorded)
                # The text the user gets is the recorded form's; a write abandoned (the
                # turn cancelled past its grace) gives it as it would have been recorded.
                shown = recorded if recorded is not None else recordable(message)
                state.text = shown.text or state.text
                return state.finish("max_tokens" if cut else "final", error=error)

            def recorded_calls(message: Message) -> None:
                # Before the calls run: a turn cancelled among them still says it.
                state.text = message.text or state.text

            message, observations = await self._run_calls(
                session, response, message, registry, emit, recorded_calls
            )
            history.append(message)
            history.append(Message("tool", observations))
            if settings is not None and settings.tool_choice not in (None, "auto", "none"):
                # A forced choice ("required", a name) is met once: held on every
                # step, a model that obeys it could never answer (max_steps).
                settings = attrs.evolve(settings, tool_choice="auto")
            if self.limits.max_tokens is not None and (
                state.usage.total_tokens >= self.limits.max_tokens
            ):
                return state.finish("max_tokens")
            cost = state.usage.cost_usd
            if (
                self.limits.max_cost is not None
                and cost is not None
                and cost >= self.limits.max_cost
            ):
                return state.finish("max_cost")

    async def _ask(
        self, session: Session, request: ModelRequest, step: int, emit: AgentEventCallback
    ) -> ModelResponse:
        """The model's response, its text streamed to ``emit`` as it comes.

        Cut short (cancelled, or the model failing mid-stream), the text
        already streamed is recorded as a partial assistant message first:
        the transcript keeps what the user saw.
        """
        streamed: list[str] = []
        name, attributes = (
            _request_span(self.model.name, session, request.settings)
            if tracing_enabled()
            else ("chat", None)
        )
        with trace_span(name, attributes, kind="client") as traced:
            try:
                async with self.model.stream(request) as events:
                    async for event in events:
                        if isinstance(event, TextDelta):
                            streamed.append(event.text)
                            emit(ModelDelta(step, event.text))
                        elif isinstance(event, ResponseComplete):
                            _describe_response(traced, event.response)
                            return event.response
                raise ModelAPIError(f"{self.model.name}: the stream ended without a response")
            except BaseException as exc:
                if isinstance(exc, ModelAPIError):
                    # Its type only: a provider's message can quote the request.
                    kind = _model_error_type(exc)
                    traced.set_error(kind, kind)
                if streamed:
                    try:
                        await _persist_whole(
                            session.record_partial("".join(streamed), model=self.model.name)
                        )
                    except Exception as failed:  # the original (a cancel, say) goes on
                        exc.add_note(f"the partial reply could not be recorded: {failed!r}")
                raise

    async def _run_calls(
        self,
        session: Session,
        response: ModelResponse,
        message: Message,
        registry: ToolRegistry,
        emit: AgentEventCallback,
        on_recorded: Callable[[Message], None],
    ) -> tuple[Message, list[Observation]]:
        return await _run_recorded(
            session,
            message,
            registry,
            limits=self.call_limits,
            on_event=emit,
            usage=usage_entry_fields(response.usage),
            model=response.model or self.model.name,
            cost_usd=response.usage.cost_usd,
            on_recorded=on_recorded,
        )

    async def _record(
        self,
        session: Session,
        response: ModelResponse,
        message: Message,
        *,
        cut: bool,
    ) -> Message | None:
        """``session.record_turn`` under ``_persist_whole``: the message as recorded,
        ``None`` when the write was abandoned (the turn cancelled past its grace)."""
        recorded: Message | None = None

        async def record() -> None:
            nonlocal recorded
            recorded = await session.record_turn(
                message,
                usage=usage_entry_fields(response.usage),
                model=response.model or self.model.name,
                cost_usd=response.usage.cost_usd,
                stop_reason="max_tokens" if cut else None,
            )

        await _persist_whole(record())
        return recorded

    def _prepare(
        self, settings: ModelSettings | None, tools: Sequence[str] | None
    ) -> tuple[ModelSettings | None, ToolRegistry]:
        """A turn's settings and tools, checked before anything is recorded.

        Raises:
            UsageError: see ``run_turn``.
        """
        registry = select_tools(self._offered_tools(), tools)
        merged = merge(self.settings, settings) if settings is not None else self.settings
        if merged is not None:
            check_tool_choice(merged, registry.names())
        return merged, registry

    def _offered_tools(self) -> ToolRegistry:
        if not self.subagents:
            return self.tools
        # A new registry each turn (cheap: the tools are shared), so tools added to
        # ``self.tools`` after construction are offered as they always were.
        return ToolRegistry([*self.tools, _delegate_tool()])

    async def compact(self, session: Session, *, keep_last_turns: int = 1) -> bool:
        """Summarize old messages when the conversation passed ``compact_after_tokens``.

        Everything before the last ``keep_last_turns`` user prompts is summarized by
        the model into one ``compaction`` entry; ``load_history`` then starts from it.
        Returns whether it compacted. Runs after a turn (the ``Kernel`` starts it in
        its own nursery); a turn that runs meanwhile is not disturbed, since the
        summary only covers entries that existed when it started.
        """
        check_positive(keep_last_turns, "keep_last_turns", integer=True)
        if self.compact_after_tokens is None:
            return False
        candidate = await session.compaction_candidate(
            keep_last_turns=keep_last_turns, min_prompt_tokens=self.compact_after_tokens
        )
        if candidate is None:
            return False
        request = ModelRequest(
            messages=(*candidate.messages, Message("user", [Text(COMPACTION_PROMPT)])),
            system=self.system,
            settings=_without_tool_choice(self.settings),
        )
        response = await self.model.complete(request)
        if not response.message.text:
            return False
        await session.record_compaction(
            response.message.text,
            through=candidate.through,
            usage=usage_entry_fields(response.usage),
            model=response.model or self.model.name,
            cost_usd=response.usage.cost_usd,
        )
        return True


#: Providers whose name in the GenAI conventions is not the kernel's.
_CONVENTION_PROVIDERS = {"gemini": "gcp.gemini"}


def _provider_and_model(name: str) -> tuple[str, str]:
    """``provider:model`` as the GenAI conventions name the two."""
    provider, colon, model = name.partition(":")
    if not colon:
        return "_OTHER", name
    return _CONVENTION_PROVIDERS.get(provider, provider), model


def _request_span(
    model_name: str, session: Session, settings: ModelSettings | None
) -> tuple[str, dict[str, Any]]:
    """The name and attributes of a model request's span."""
    provider, model = _provider_and_model(model_name)
    attributes: dict[str, Any] = {
        "gen_ai.operation.name": "chat",
        "gen_ai.provider.name": provider,
        "gen_ai.request.model": model,
        "gen_ai.conversation.id": session.key.name,
    }
    if settings is not None:
        for field, key in _TRACED_SETTINGS:
            value = getattr(settings, field)
            if value is not None:
                attributes[key] = value
    return f"chat {model}", attributes


_TRACED_SETTINGS = (
    ("temperature", "gen_ai.request.temperature"),
    ("top_p", "gen_ai.request.top_p"),
    ("max_tokens", "gen_ai.request.max_tokens"),
    ("seed", "gen_ai.request.seed"),
)


def _describe_response(traced: TraceSpan, response: ModelResponse) -> None:
    if response.model:
        traced.set_attribute("gen_ai.response.model", _provider_and_model(response.model)[1])
    traced.set_attribute("gen_ai.response.finish_reasons", (response.stop_reason,))
    _describe_usage(traced, response.usage)


def _describe_usage(traced: TraceSpan, usage: Usage) -> None:
    traced.set_attribute("gen_ai.usage.input_tokens", usage.total_input_tokens)
    traced.set_attribute("gen_ai.usage.output_tokens", usage.output_tokens)
    if usage.cost_usd is not None:
        traced.set_attribute("tak.usage.cost_usd", usage.cost_usd)


def _describe_turn(traced: TraceSpan, finished: TurnFinished, error_type: str = "") -> None:
    """How the turn ended, on its span; one without a final answer failed, with its
    reason (and for a model error, the provider's type of error, never its message)."""
    traced.set_attribute("tak.turn.reason", finished.reason)
    traced.set_attribute("tak.turn.steps", finished.steps)
    _describe_usage(traced, finished.usage)
    if finished.reason != "final":
        traced.set_error(finished.reason, error_type)


def _model_error_type(exc: ModelAPIError) -> str:
    """``error.type`` of a failed request: the provider's own name for it when known."""
    return getattr(exc, "error_type", None) or type(exc).__qualname__


def _without_tool_choice(settings: ModelSettings | None) -> ModelSettings | None:
    """``settings`` less what is about calling this turn's tools (a subagent's
    task and a compaction are requests of their own)."""
    if settings is None:
        return None
    return attrs.evolve(settings, tool_choice=None, parallel_tool_calls=None)


def _ignore(event: AgentEvent) -> None:
    pass


async def _persist_whole(write: Awaitable[None]) -> bool:
    """Finish ``write`` even if the caller is being cancelled; whether it finished.

    The write has no deadline of its own while the caller runs: the store bounds
    its calls (a PostgreSQL restart is ridden out within ``[store]
    request_timeout_s``, 30 s by default), and a turn that gave up on a slow write
    after a fixed 10 s dropped a record the store was about to take. Once the
    caller is cancelled, the write gets ``_PERSIST_GRACE_S`` more, then is
    abandoned (``False``). A cancellation that arrives meanwhile is delivered at
    the caller's next checkpoint (Trio's cancellation is level-triggered: the
    watcher below takes it only to start the grace period).

    Raises:
        Exception: what ``write`` raised.
    """
    persist = trio.CancelScope(shield=True)
    problem: Exception | None = None

    async def grace_once_cancelled() -> None:
        try:
            await trio.sleep_forever()
        except trio.Cancelled:
            persist.deadline = min(persist.deadline, trio.current_time() + _PERSIST_GRACE_S)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(grace_once_cancelled)
        with persist:
            try:
                await write
            except Exception as exc:
                problem = exc
        nursery.cancel_scope.cancel()
    if problem is not None:
        raise problem
    return not persist.cancelled_caught


async def _record_before_running(
    session: Session,
    assistant: Message,
    *,
    usage: Mapping[str, int] | None,
    model: str | None,
    cost_usd: float | None,
) -> MessageEntry:
    """``session.record_assistant``, shielded like ``_persist_whole``; the entry.

    Raises:
        StoreError: the record was not written (so no call may run).
    """
    problem: Exception | None = None
    entry: MessageEntry | None = None

    async def record() -> None:
        nonlocal entry
        entry = await session.record_assistant(
            assistant, usage=usage, model=model, cost_usd=cost_usd
        )

    try:
        await _persist_whole(record())
    except Exception as exc:
        problem = exc
    if entry is None:
        reason = problem or (
            f"the turn was cancelled and the store did not finish within {_PERSIST_GRACE_S:g} s"
        )
        raise StoreError(
            f"session {session.key}: could not record the model's "
            f"{len(assistant.tool_calls)} tool call(s), so none ran: {reason}"
        ) from problem
    return entry


async def _answer_interrupted(session: Session, entry: Mapping[str, Any], message: Message) -> None:
    """Record ``INTERRUPTED`` for the calls of ``message`` (recorded as ``entry``).

    Raises:
        UsageError: the entry has no uuid, or another resume (in another
            process) answered the calls first.
    """
    answers = entry.get("uuid")
    if not isinstance(answers, str):
        raise UsageError(
            f"session {session.key}: the last assistant entry has no uuid, "
            "so its calls cannot be answered"
        )
    interrupted = [
        Observation.failure(call, index, INTERRUPTED)
        for index, call in enumerate(message.tool_calls)
    ]
    ours: bool | None = None

    async def record() -> None:
        nonlocal ours
        ours = await session.record_interrupted(message, interrupted, answers=answers)

    await _persist_whole(record())
    if ours is None:
        raise StoreError(
            f"session {session.key}: the results of the interrupted calls were not "
            f"recorded within {_PERSIST_GRACE_S:g} s of the cancellation"
        )
    if not ours:
        raise UsageError(
            f"session {session.key}: the calls of entry {answers} were answered meanwhile "
            "by another writer (a resume, or the turn itself, in another process); "
            "this resume stops"
        )


def _trailing_partials(entries: Sequence[Mapping[str, Any]]) -> int:
    """How many messages at the end of ``entries`` are replies cut mid-stream."""
    count = 0
    for entry in reversed(entries):
        if not is_message_entry(entry):
            continue  # a title, a compaction
        if entry.get("type") != "assistant" or not entry.get("partial"):
            break
        count += 1
    return count


def _last_message(
    entries: Sequence[Mapping[str, Any]],
) -> tuple[Mapping[str, Any], Message] | None:
    """The last entry of ``entries`` that holds a message (titles, compactions
    skipped), with its message."""
    for entry in reversed(entries):
        message = message_from_entry(entry)
        if message is not None:
            return entry, message
    return None


@attrs.frozen
class _Turn:
    """The turn being run: what ``delegate`` delegates from. A subagent gets at
    most the tools this turn offered, and this turn's settings (less the
    ones about calling tools: its task is its own)."""

    agent: Agent
    session: Session
    tools: ToolRegistry
    settings: ModelSettings | None


# The tasks that run a turn's calls inherit it (Trio copies the context into each task).
_current_turn: contextvars.ContextVar[_Turn] = contextvars.ContextVar("tak_agent_turn")


@functools.cache
def _delegate_tool() -> Tool:
    """The ``delegate`` tool: one per process, built on first use.

    It reads the agent and session it serves from ``_current_turn``. Building
    it per agent or per turn cost ~60% of a one-call turn (``@tool`` generates
    an attrs class and its cattrs structuring code) and grew the shared
    converter's hook cache by one class each time: a leak.
    """

    @tool(name="delegate")
    async def delegate(task: str, tools: list[str] | None = None) -> str:
        """Hand a self-contained task to a subagent and get its final answer.

        The subagent starts with no memory of this conversation: say everything it needs.

        Args:
            task: The task, with all the context the subagent needs.
            tools: Names of the tools the subagent may use (default: all of yours).
        """
        turn = _current_turn.get(None)
        if turn is None:  # only an agent's turn offers this tool
            raise ToolFailure("exception", "delegate runs only inside an agent's turn")
        parent, session = turn.agent, turn.session
        # What this turn offered (its own tools= selection), never more.
        offered = ToolRegistry(t for t in turn.tools if t.name != "delegate")
        available = offered
        if tools is not None:
            unknown = [name for name in tools if name not in offered]
            if unknown:
                raise ToolFailure(
                    "exception",
                    f"unknown tools {unknown}; available: {', '.join(offered.names())}",
                    type="UnknownTool",
                )
            available = ToolRegistry([t for t in offered if t.name in tools])
        child = Agent(
            parent.model,
            available,
            system=parent.system,
            limits=parent.limits,
            call_limits=parent.call_limits,
            settings=_without_tool_choice(turn.settings),
        )
        child_session = session.child(uuid.uuid4().hex[:12])
        with _tool_context_for(child_session):
            result = await child.run_turn(child_session, task)
        if result.reason != "final":
            detail = f": {result.error}" if result.error else ""
            raise ToolFailure(
                "exception",
                f"the subagent stopped ({result.reason}{detail}) after {result.steps} "
                f"steps; its last words: {result.text!r}",
                type="SubagentStopped",
            )
        return result.text

    return delegate


@contextlib.contextmanager
def _tool_context_for(session: Session) -> Iterator[None]:
    """Tools the subagent calls see its own transcript's key, not its parent's."""
    try:
        current = context()
    except UsageError:  # not run by a Kernel: no tool context to adjust
        yield
        return
    with use_context(attrs.evolve(current, session=str(session.key))):
        yield


@attrs.define
class _TurnState:
    steps: int = 0
    usage: Usage = attrs.field(factory=Usage)
    text: str = ""
    error_type: str = ""  # a model error's type, for the turn's span

    def finish(self, reason: TurnEnd, *, error: str | None = None) -> TurnFinished:
        return TurnFinished(reason, self.text, self.steps, self.usage, error)
