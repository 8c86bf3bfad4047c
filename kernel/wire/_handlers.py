"""What the server does for each request that runs: one handler per request type.

A handler gets the kernel, the request and ``emit`` (which sends an event
about the request) and returns the request's result record; the connection
(``kernel.wire._connection``) runs it in the request's own nursery, turns the
result into the ``ok`` reply, and an exception into an error reply
(``UsageError``: ``invalid_request``; ``KernelError``: ``kernel_error``;
anything else: ``internal``). ``hello`` and ``cancel`` are not here: they
are about the connection itself and answered at once by its reader.

A new request: its record (``kernel.wire._frames``), its result record
(``kernel.wire._payloads``), a handler here in ``HANDLERS``, and its paragraph
in docs/protocol.md.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from ..agent import AgentEvent, ModelDelta, TurnFinished
from ..errors import UsageError
from ..executor import CallFinished, CallStarted
from ..kernel import Kernel
from ..tools import Tool
from ._frames import CallTools, History, Request, Run, Sessions, Tools
from ._payloads import (
    CallFinishedEvent,
    CallStartedEvent,
    CallToolsResult,
    EventData,
    HistoryResult,
    ModelDeltaEvent,
    Result,
    RunResult,
    SessionsResult,
    ToolsResult,
    TurnFinishedEvent,
)

Emit = Callable[[EventData], None]
Handler = Callable[[Kernel, Any, Emit], Awaitable[Result]]


async def call_tools(kernel: Kernel, request: CallTools, emit: Emit) -> CallToolsResult:
    session = kernel.session(request.session, project=request.project)
    observations = await kernel.call_tools(
        session, list(request.calls), on_event=lambda e: emit(event_data(e))
    )
    return CallToolsResult(observations=tuple(observations))


async def run(kernel: Kernel, request: Run, emit: Emit) -> RunResult:
    settings = request.model_settings()
    try:
        kernel.agent_for(request.model)
    except UsageError as exc:
        raise UsageError(f"$.model: {exc}") from None
    session = kernel.session(request.session, project=request.project)
    # A tools pattern that matches nothing, or a tool_choice the chosen tools cannot
    # meet, is the kernel's UsageError, raised before the prompt is recorded.
    finished = await kernel.run_turn(
        session,
        request.prompt,
        on_event=lambda e: emit(event_data(e)),
        model=request.model,
        settings=settings,
        tools=request.tools,
    )
    return RunResult(
        session=session.key.session_id,
        reason=finished.reason,
        text=finished.text,
        steps=finished.steps,
        usage=finished.usage,
        error=finished.error,
    )


async def sessions(kernel: Kernel, request: Sessions, emit: Emit) -> SessionsResult:
    summaries = await kernel.store.list_session_summaries(request.project)
    return SessionsResult(sessions=tuple(summaries))


async def history(kernel: Kernel, request: History, emit: Emit) -> HistoryResult:
    entries = await kernel.session(request.session, project=request.project).entries()
    if request.after is not None:
        after = next((i for i, e in enumerate(entries) if e.get("uuid") == request.after), None)
        if after is None:
            raise UsageError(f"$.after: session {request.session!r} has no entry {request.after!r}")
        entries = entries[after + 1 :]
    return HistoryResult(entries=tuple(entries))


async def tools(kernel: Kernel, request: Tools, emit: Emit) -> ToolsResult:
    return ToolsResult(tools=tuple(tool_spec(t) for t in kernel.tools))


#: The handler of each request type that runs in its own nursery.
HANDLERS: Mapping[type[Request], Handler] = {
    CallTools: call_tools,
    Run: run,
    Sessions: sessions,
    History: history,
    Tools: tools,
}


def event_data(event: AgentEvent) -> EventData:
    """The wire payload of an agent or executor event."""
    if isinstance(event, ModelDelta):
        return ModelDeltaEvent(step=event.step, text=event.text)
    if isinstance(event, CallStarted):
        return CallStartedEvent(index=event.index, call=event.call)
    if isinstance(event, CallFinished):
        return CallFinishedEvent(index=event.index, observation=event.observation)
    return _turn_finished(event)


def _turn_finished(finished: TurnFinished) -> TurnFinishedEvent:
    return TurnFinishedEvent(
        reason=finished.reason,
        text=finished.text,
        steps=finished.steps,
        usage=finished.usage,
        error=finished.error,
    )


def tool_spec(t: Tool) -> dict[str, Any]:
    """A tool as the ``tools`` reply lists it; limits only when set."""
    spec: dict[str, Any] = {
        "name": t.name,
        "description": t.description,
        "parameters": t.parameters,
    }
    if t.timeout is not None:
        spec["timeout"] = t.timeout
    if t.exclusive:
        spec["exclusive"] = True
    if t.max_output is not None:
        spec["max_output"] = t.max_output
    return spec
