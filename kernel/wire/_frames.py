"""The WebSocket protocol's frames as records, and the protocol's converter.

Every frame is one JSON object in one text frame, ``{"v": 1, "type": ..., ...}``
(docs/protocol.md has the whole protocol, with examples). Requests go from
the client to the server and carry an ``id``; the server answers each with
``event`` frames and exactly one ``reply``, or refuses a frame with one
``error``. The records here are ``@attrs.frozen`` classes in two tagged unions
on ``type`` (``Request`` and ``ServerFrame``); an event's payload and a reply's
result are the records of ``kernel.wire._payloads``. All of them go through
``wire_converter``, a copy of ``kernel.messages.converter`` with the protocol's
hooks (the two tagged unions, frames that leave out empty fields), so that a
bad request is reported with the path of what was wrong
(``$.calls[1].name: required field missing``) and the shared converter is left
as it is.

A new request: its record here, in ``Request`` and ``REQUEST_TYPES``; its
handler in ``kernel.wire._handlers``; its paragraph in docs/protocol.md. The
JSON text of frames (``encode``, ``decode_request``, ...) is
``kernel.wire._codec``'s.

This module does no I/O: the server and the client (``kernel.wire``) share it.
"""

from __future__ import annotations

from typing import Any, Final, Literal, TypeAlias, TypeVar, get_args

import attrs
from cattrs.strategies import configure_tagged_union

from ..errors import ProtocolError
from ..home import DEFAULT_PROJECT
from ..messages import ToolCall, describe_structure_error
from ..messages import converter as _shared_converter
from ..settings import ModelSettings, settings_from_mapping
from ._payloads import (
    EVENT_CLASSES,
    EventData,
    OtherEvent,
    Result,
    RunResult,
    TurnFinishedEvent,
)

#: The protocol's converter: the kernel's, plus the hooks below (the shared one is untouched).
wire_converter = _shared_converter.copy()

PROTOCOL_VERSION: Final = 1
#: Request ids are echoed in every frame about the request: keep them short.
MAX_ID_LENGTH: Final = 128

ErrorCode: TypeAlias = Literal[
    "bad_json",
    "bad_message",
    "unknown_type",
    "duplicate_id",
    "too_many_inflight",
    "too_large",
    "unauthorized",
    "too_many_connections",
    "invalid_request",
    "kernel_error",
    "internal",
]
ERROR_CODES: tuple[ErrorCode, ...] = get_args(ErrorCode)

_R = TypeVar("_R")

Status: TypeAlias = Literal["ok", "error", "cancelled"]
EventKind: TypeAlias = Literal["call_started", "call_finished", "model_delta", "turn_finished"]
EVENT_KINDS: tuple[EventKind, ...] = get_args(EventKind)


# --- requests (client → server) ---------------------------------------------------


@attrs.frozen(kw_only=True)
class Hello:
    """Authenticate (when the handshake carried no token) and learn about the server."""

    id: str
    token: str | None = None
    client: str | None = None
    v: int = PROTOCOL_VERSION


@attrs.frozen(kw_only=True)
class CallTools:
    """Run ``calls`` as one batch, as if a model had declared them, recorded in ``session``."""

    id: str
    session: str
    calls: tuple[ToolCall, ...]
    project: str = DEFAULT_PROJECT
    v: int = PROTOCOL_VERSION


@attrs.frozen(kw_only=True)
class Run:
    """One agent turn on ``session``.

    ``model`` (``provider:model``), when given, runs this turn on that model
    instead of the server's (same tools and limits); one the server cannot
    use (unknown provider, missing API key) is ``invalid_request``.
    ``settings`` is the JSON object of a ``ModelSettings`` for this turn
    (merged over the server's); the handler reads it with ``model_settings()``
    so that a bad field is named ``$.settings.<field>``. ``tools`` selects the
    tools offered (names or ``fnmatch`` patterns). Both are left out of the
    frame when not given, so older requests are unchanged on the wire.
    """

    id: str
    session: str
    prompt: str
    model: str | None = None
    settings: dict[str, Any] | None = None
    tools: tuple[str, ...] | None = None
    project: str = DEFAULT_PROJECT
    v: int = PROTOCOL_VERSION

    def model_settings(self) -> ModelSettings | None:
        """``settings`` as the record, ``None`` when the request has none.

        Raises:
            UsageError: an unknown or bad field
                (``$.settings.temperature: expected a number from 0 to 2, got 7``).
        """
        return None if self.settings is None else settings_from_mapping(self.settings, "$.settings")


def settings_object(settings: ModelSettings) -> dict[str, Any]:
    """The JSON object of ``settings`` as a ``run`` request carries it: set fields only."""
    return {
        name: list(value) if name == "stop" else dict(value) if name == "extra" else value
        for name, value in settings.set_fields().items()
    }


@attrs.frozen(kw_only=True)
class Cancel:
    """Cancel the in-flight request whose id is ``target``; with ``call``, only that call of it.

    A cancelled call gets a ``cancelled`` observation and its batch goes on; the
    request replies as it would have. ``call`` is left out of the frame when not
    given, so a plain ``cancel`` is unchanged on the wire.
    """

    id: str
    target: str
    call: str | None = None
    v: int = PROTOCOL_VERSION


@attrs.frozen(kw_only=True)
class Sessions:
    """The summaries of a project's sessions."""

    id: str
    project: str = DEFAULT_PROJECT
    v: int = PROTOCOL_VERSION


@attrs.frozen(kw_only=True)
class History:
    """A session's transcript entries, all of them or those after the entry ``after``."""

    id: str
    session: str
    after: str | None = None
    project: str = DEFAULT_PROJECT
    v: int = PROTOCOL_VERSION


@attrs.frozen(kw_only=True)
class Tools:
    """The tools the server offers, with their JSON Schemas."""

    id: str
    v: int = PROTOCOL_VERSION


Request: TypeAlias = Hello | CallTools | Run | Cancel | Sessions | History | Tools
REQUEST_TYPES: dict[type, str] = {
    Hello: "hello",
    CallTools: "call_tools",
    Run: "run",
    Cancel: "cancel",
    Sessions: "sessions",
    History: "history",
    Tools: "tools",
}
REQUEST_CLASSES: dict[str, type] = {tag: cls for cls, tag in REQUEST_TYPES.items()}


# --- server frames (server → client) -----------------------------------------------


@attrs.frozen(kw_only=True)
class ErrorInfo:
    """What went wrong: a code from ``ERROR_CODES``, a message for people, maybe details."""

    # A str, not ErrorCode: a client must still read frames from a newer server.
    code: str
    message: str
    details: dict[str, Any] | None = None


@attrs.frozen(kw_only=True)
class Reply:
    """The one answer to a request, sent after every event of that request."""

    re: str
    status: Status
    result: dict[str, Any] | None = None
    error: ErrorInfo | None = None
    seq: int = 0
    v: int = PROTOCOL_VERSION

    @classmethod
    def ok(cls, re: str, result: Result) -> Reply:
        """The ``ok`` reply to request ``re`` with ``result``."""
        return cls(re=re, status="ok", result=wire_converter.unstructure(result))

    def result_as(self, cls: type[_R]) -> _R:
        """``result`` as the record ``cls`` (the request's result type).

        Raises:
            ProtocolError: no result, or not a ``cls``.
        """
        if self.result is None:
            raise ProtocolError(f"the {self.status} reply to {self.re!r} has no result")
        try:
            return wire_converter.structure(self.result, cls)
        except Exception as exc:
            raise ProtocolError(
                f"bad result for {self.re!r}: {describe_structure_error(exc)}"
            ) from None


@attrs.frozen(kw_only=True)
class Event:
    """Progress of a request. On the wire ``data``'s keys sit beside ``re``, ``seq``, ``kind``."""

    re: str
    kind: str
    data: dict[str, Any] = attrs.field(factory=dict)
    seq: int = 0
    v: int = PROTOCOL_VERSION

    @classmethod
    def of(cls, re: str, payload: EventData) -> Event:
        """The event frame about request ``re`` that carries ``payload``."""
        if isinstance(payload, OtherEvent):
            return cls(re=re, kind=payload.kind, data=payload.data)
        return cls(re=re, kind=payload.kind, data=wire_converter.unstructure(payload))

    def payload(self) -> EventData:
        """The payload as its record; an ``OtherEvent`` for a kind this client does not know.

        Raises:
            ProtocolError: a known kind whose fields are not what this protocol says.
        """
        cls = EVENT_CLASSES.get(self.kind)
        if cls is None:
            return OtherEvent(kind=self.kind, data=self.data)
        try:
            payload: EventData = wire_converter.structure(self.data, cls)
        except Exception as exc:
            raise ProtocolError(f"bad {self.kind} event: {describe_structure_error(exc)}") from None
        return payload


@attrs.frozen(kw_only=True)
class ErrorFrame:
    """A frame the server refused; ``re`` is its id when one could be read."""

    error: ErrorInfo
    re: str | None = None
    seq: int = 0
    v: int = PROTOCOL_VERSION


ServerFrame: TypeAlias = Reply | Event | ErrorFrame
SERVER_TAGS: dict[type, str] = {Reply: "reply", Event: "event", ErrorFrame: "error"}
EVENT_HEADER = ("v", "type", "re", "seq", "kind")


class FrameError(ProtocolError):
    """A client frame the server refuses: becomes an ``error`` frame with ``code``."""

    def __init__(
        self,
        code: ErrorCode,
        message: str,
        *,
        re: str | None = None,
        details: dict[str, Any] | None = None,
    ) -> None:
        super().__init__(f"{code}: {message}")
        self.code: ErrorCode = code
        self.message = message
        self.re = re
        self.details = details

    def info(self) -> ErrorInfo:
        return ErrorInfo(code=self.code, message=self.message, details=self.details)


def _unstructure_event(event: Event) -> dict[str, Any]:
    body: dict[str, Any] = {"v": event.v, "re": event.re, "seq": event.seq, "kind": event.kind}
    # Header keys win over data keys, so a payload can never forge them.
    body.update((k, v) for k, v in event.data.items() if k not in EVENT_HEADER)
    return body


def _structure_event(value: Any, _: Any) -> Event:
    if not isinstance(value, dict):
        raise TypeError(f"expected an object, got {type(value).__name__}")
    fields = {k: value[k] for k in ("v", "re", "seq", "kind") if k in value}
    data = {k: v for k, v in value.items() if k not in EVENT_HEADER}
    return Event(
        re=wire_converter.structure(fields["re"], str),
        kind=wire_converter.structure(fields["kind"], str),
        seq=wire_converter.structure(fields.get("seq", 0), int),
        v=wire_converter.structure(fields.get("v", PROTOCOL_VERSION), int),
        data=data,
    )


def _structure_names(value: Any, _: Any) -> tuple[str, ...] | None:
    # cattrs would take a string (or an object's keys) as a sequence of names: refuse both.
    if value is None:
        return None
    if not isinstance(value, list):
        raise TypeError(f"expected an array of strings, got {type(value).__name__}")
    return wire_converter.structure(value, tuple[str, ...])


def _configure() -> None:
    from cattrs.gen import make_dict_unstructure_fn, override

    # Leave out what is not there ("error": null on an ok reply says nothing),
    # but always say which protocol version and which frame number this is.
    always = override(omit_if_default=False)
    # ErrorInfo first: the hooks generated below look up the hooks of their fields.
    wire_converter.register_unstructure_hook(
        ErrorInfo, make_dict_unstructure_fn(ErrorInfo, wire_converter, _cattrs_omit_if_default=True)
    )
    for request_class in REQUEST_TYPES:
        wire_converter.register_unstructure_hook(
            request_class,
            make_dict_unstructure_fn(
                request_class, wire_converter, _cattrs_omit_if_default=True, v=always
            ),
        )
    for frame_class in (Reply, ErrorFrame):
        wire_converter.register_unstructure_hook(
            frame_class,
            make_dict_unstructure_fn(
                frame_class, wire_converter, _cattrs_omit_if_default=True, v=always, seq=always
            ),
        )
    # "error" only when there is one, as the protocol has always sent it.
    for result_class in (TurnFinishedEvent, RunResult):
        wire_converter.register_unstructure_hook(
            result_class,
            make_dict_unstructure_fn(
                result_class, wire_converter, error=override(omit_if_default=True)
            ),
        )
    wire_converter.register_structure_hook(tuple[str, ...] | None, _structure_names)
    wire_converter.register_unstructure_hook(Event, _unstructure_event)
    wire_converter.register_structure_hook(Event, _structure_event)
    configure_tagged_union(
        Request, wire_converter, tag_name="type", tag_generator=REQUEST_TYPES.__getitem__
    )
    configure_tagged_union(
        ServerFrame, wire_converter, tag_name="type", tag_generator=SERVER_TAGS.__getitem__
    )


_configure()


__all__ = [
    "DEFAULT_PROJECT",
    "ERROR_CODES",
    "EVENT_KINDS",
    "MAX_ID_LENGTH",
    "PROTOCOL_VERSION",
    "REQUEST_TYPES",
    "CallTools",
    "Cancel",
    "ErrorCode",
    "ErrorFrame",
    "ErrorInfo",
    "Event",
    "EventKind",
    "FrameError",
    "Hello",
    "History",
    "Reply",
    "Request",
    "Run",
    "ServerFrame",
    "Sessions",
    "Status",
    "Tools",
    "settings_object",
    "wire_converter",
]
