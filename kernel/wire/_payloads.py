"""What the frames carry: each event kind's payload and each request's result, as records.

An ``event`` frame's payload sits beside its header on the wire
(``{"type": "event", "re": ..., "seq": ..., "kind": "model_delta", "step": 1,
"text": "Hi"}``); a ``reply``'s ``result`` is one object. The server builds
these records and the clients read them back (``Event.payload()``,
``kernel.wire.open_client``), so a field is found missing by the type checker,
not by a ``KeyError`` in a client. ``kernel.wire._frames`` holds the converter
that turns them into JSON and back; this module does no I/O and has no hooks.

A new event kind: a record here with its ``kind``, added to ``EventData`` and
``EVENT_CLASSES``; a new request's result: a record here, returned by its
handler (``kernel.wire._handlers``).
"""

from __future__ import annotations

from typing import Any, ClassVar, TypeAlias

import attrs

from ..messages import Observation, ToolCall
from ..models import Usage
from ..store import SessionSummary

# --- events (``event`` frames: progress of a request) ------------------------------


@attrs.frozen(kw_only=True)
class ModelDeltaEvent:
    """Text the model produced, as it streams (``step`` counts model calls in the turn)."""

    kind: ClassVar[str] = "model_delta"
    step: int
    text: str


@attrs.frozen(kw_only=True)
class CallStartedEvent:
    """A tool call of the batch started; ``index`` is its place in the batch."""

    kind: ClassVar[str] = "call_started"
    index: int
    call: ToolCall


@attrs.frozen(kw_only=True)
class CallFinishedEvent:
    """A tool call finished (in completion order), with its observation."""

    kind: ClassVar[str] = "call_finished"
    index: int
    observation: Observation


@attrs.frozen(kw_only=True)
class TurnFinishedEvent:
    """How a ``run`` turn ended: its last event. ``error`` is left out when there is none."""

    kind: ClassVar[str] = "turn_finished"
    reason: str
    text: str
    steps: int
    usage: Usage
    error: str | None = None


@attrs.frozen(kw_only=True)
class OtherEvent:
    """An event of a kind this client does not know (from a newer server): kept as sent."""

    kind: str
    data: dict[str, Any] = attrs.field(factory=dict)


EventData: TypeAlias = (
    ModelDeltaEvent | CallStartedEvent | CallFinishedEvent | TurnFinishedEvent | OtherEvent
)
#: The known event kinds, by ``kind``.
EVENT_CLASSES: dict[
    str, type[ModelDeltaEvent | CallStartedEvent | CallFinishedEvent | TurnFinishedEvent]
] = {
    cls.kind: cls
    for cls in (ModelDeltaEvent, CallStartedEvent, CallFinishedEvent, TurnFinishedEvent)
}


# --- results (a ``reply``'s ``result``, by request type) -----------------------------


@attrs.frozen(kw_only=True)
class ServerInfo:
    """``hello``'s result: who answered."""

    server: str
    version: str
    protocol: int
    model: str


@attrs.frozen(kw_only=True)
class CallToolsResult:
    """``call_tools``' result: one observation per call, in declared order."""

    observations: tuple[Observation, ...]


@attrs.frozen(kw_only=True)
class RunResult:
    """``run``'s result: the turn's end (as ``turn_finished``) and its session."""

    session: str
    reason: str
    text: str
    steps: int
    usage: Usage
    error: str | None = None


@attrs.frozen(kw_only=True)
class CancelResult:
    """``cancel``'s result: whether the target was running."""

    found: bool


@attrs.frozen(kw_only=True)
class SessionsResult:
    """``sessions``' result: a summary of each of the project's sessions."""

    sessions: tuple[SessionSummary, ...]


@attrs.frozen(kw_only=True)
class HistoryResult:
    """``history``'s result: transcript entries as the store keeps them."""

    entries: tuple[dict[str, Any], ...]


@attrs.frozen(kw_only=True)
class ToolsResult:
    """``tools``' result: each tool's name, description, JSON Schema and limits."""

    tools: tuple[dict[str, Any], ...]


Result: TypeAlias = (
    ServerInfo
    | CallToolsResult
    | RunResult
    | CancelResult
    | SessionsResult
    | HistoryResult
    | ToolsResult
)
