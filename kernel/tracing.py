"""OpenTelemetry spans for turns, model requests and tool calls (``tak[otel]``).

The kernel opens its spans here, and so may an embedder (a batch task's span,
say), the same way::

    with span("batch_task", {"tak.batch.task_id": task.id}) as s:
        ...                        # spans opened in here are its children
        s.set_attribute("tak.batch.score", 1.0)

Spans are real when both hold:

1. ``opentelemetry-api`` is installed (``pip install 'trio-agent-kernel[otel]'``);
2. a tracer provider is configured: the one given to ``use_tracer_provider``
   (tests, or an embedder that keeps its own), else the global one
   (``opentelemetry.trace.set_tracer_provider``, or ``OTEL_PYTHON_TRACER_PROVIDER``).
   The proxy the API hands out before a provider is set does not count. The
   kernel never picks an exporter: that is the application's choice.

Otherwise every span is one shared object that does nothing, and the API is
never imported: a process in which nothing imported ``opentelemetry.trace``
cannot have set a global provider (setting one imports it), so the check is
a dictionary lookup in ``sys.modules``. ``import kernel`` never imports
OpenTelemetry.

Under Trio the current span lives in a ``contextvars`` context, as
OpenTelemetry keeps it: a task started in a nursery gets a copy of its
parent's context when it is started, so spans opened in the tasks that run
a turn's tool calls are children of the turn's span, however many run at
once. A span is ended when its block is left, cancelled or not.

The names follow the OpenTelemetry GenAI semantic conventions, v1.37.0
(status: Development; schema ``SCHEMA_URL``), written out where they are set
rather than imported (the conventions package marks them moved)::

    invoke_agent {agent}   INTERNAL  one turn (kernel.agent)
    chat {model}           CLIENT    one model request (kernel.agent)
    execute_tool {tool}    INTERNAL  one tool call (kernel.executor)

with ``gen_ai.operation.name``, ``gen_ai.provider.name``,
``gen_ai.request.model``, ``gen_ai.response.model``,
``gen_ai.usage.input_tokens``/``output_tokens``, ``gen_ai.agent.name``,
``gen_ai.conversation.id`` (the session key), ``gen_ai.tool.name``,
``gen_ai.tool.call.id``, ``gen_ai.tool.type``; what the conventions have no
name for is under ``tak.``. A span that failed has status ERROR and
``error.type``: for a call, its ``ToolError`` kind (``exception``,
``timeout``, ``cancelled``, ...); for a turn that ended without a final
answer, its reason (``max_steps``, ``model_error``, ``cancelled``, ...); for
a model request, the provider's error type; ``cancelled`` for a block left by
``trio.Cancelled`` (or a group of nothing else); else the exception's class
name. No message content reaches a span: not a prompt, a reply, a call's
arguments or its result, nor an error message (those can quote any of them);
a status description is a kind or a class name. Text from the model (a tool
name it made up, a call id) and any string given to a span is cut to
``MAX_TEXT`` characters.

Tracing never fails what it traces: a span that cannot be started or ended
(a span processor raising, say) is dropped, and the first such failure is
logged (logger ``kernel.tracing``).
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from collections.abc import Iterator, Mapping
from types import TracebackType
from typing import Any, Literal, TypeAlias

import trio

__all__ = [
    "MAX_TEXT",
    "SCHEMA_URL",
    "Span",
    "SpanKind",
    "enabled",
    "span",
    "start_span",
    "use_tracer_provider",
]

#: The semantic conventions the span and attribute names follow.
SCHEMA_URL = "https://opentelemetry.io/schemas/1.37.0"

SpanKind: TypeAlias = Literal["internal", "client"]

ERROR_TYPE = "error.type"

#: The longest span name, string attribute value or status description kept (characters).
MAX_TEXT = 256

_log = logging.getLogger("kernel.tracing")

_NULL_BLOCK: contextlib.nullcontext[None] = contextlib.nullcontext()


class Span:
    """What the kernel does with a span: attributes, the error that ended it, its end.

    This class is the span when tracing is off: every method does nothing.
    """

    __slots__ = ()

    def set_attribute(self, key: str, value: Any) -> None:
        """Set ``key`` (a string, number, bool or a sequence of one of them)."""

    def set_error(self, kind: str, description: str = "") -> None:
        """Mark the span failed: status ERROR, ``error.type`` = ``kind``.

        ``description`` is the status description; it must hold no content
        (no argument, no message that can quote one).
        """

    def end(self) -> None:
        """End a span from ``start_span`` (``span`` ends its own)."""

    def current(self) -> contextlib.AbstractContextManager[None]:
        """Make this span the current one for a block, without ending it."""
        return _NULL_BLOCK


_NO_SPAN = Span()
_NO_SPAN_BLOCK: contextlib.nullcontext[Span] = contextlib.nullcontext(_NO_SPAN)


class _Api:
    """The parts of ``opentelemetry`` used here, imported on first use."""

    def __init__(self) -> None:
        from opentelemetry import context, trace

        self.trace = trace
        self.attach = context.attach
        self.detach = context.detach
        self.in_context = trace.set_span_in_context
        self.error = trace.StatusCode.ERROR
        self.status = trace.Status
        self.kinds = {"internal": trace.SpanKind.INTERNAL, "client": trace.SpanKind.CLIENT}
        self.off = (trace.ProxyTracerProvider, trace.NoOpTracerProvider)


class _State:
    api: _Api | None = None
    missing = False  # importing opentelemetry failed: never tried again
    warned = False  # a span failed, and it was logged
    explicit: Any = None  # the provider given to use_tracer_provider
    provider: Any = None  # the provider ``tracer`` came from
    tracer: Any = None
    env_provider: bool | None = None  # OTEL_PYTHON_TRACER_PROVIDER is set


_state = _State()


def use_tracer_provider(provider: Any) -> None:
    """Trace through ``provider`` (an ``opentelemetry.trace.TracerProvider``).

    ``None`` goes back to the global provider. The global one can be set only
    once per process; this is the way for tests and for embedders that keep
    their own provider.
    """
    _state.explicit = provider
    _state.provider = _state.tracer = None


def _tracer() -> Any:
    """The tracer to use now, or ``None`` when tracing is off (see the module docstring)."""
    provider = _state.explicit
    if provider is None:
        if "opentelemetry.trace" not in sys.modules:
            if _state.env_provider is None:
                _state.env_provider = "OTEL_PYTHON_TRACER_PROVIDER" in os.environ
            if not _state.env_provider:
                return None
        api = _api()
        if api is None:
            return None
        provider = api.trace.get_tracer_provider()
        if isinstance(provider, api.off):
            return None
    if provider is not _state.provider:
        if _api() is None:
            return None
        _state.tracer = provider.get_tracer("tak", _version(), schema_url=SCHEMA_URL)
        _state.provider = provider
    return _state.tracer


def _api() -> _Api | None:
    if _state.api is None:
        if _state.missing:
            return None
        try:
            _state.api = _Api()
        except ImportError:
            # Remembered: with OTEL_PYTHON_TRACER_PROVIDER set, every span asks.
            _state.missing = True
            return None
    return _state.api


def _version() -> str | None:
    from importlib import metadata

    try:
        return metadata.version("trio-agent-kernel")
    except metadata.PackageNotFoundError:
        return None


def enabled() -> bool:
    """Whether spans are real now (so that their attributes are worth computing)."""
    return _tracer() is not None


def span(
    name: str, attributes: Mapping[str, Any] | None = None, *, kind: SpanKind = "internal"
) -> contextlib.AbstractContextManager[Span]:
    """A span named ``name``, child of the current one and current in the block.

    Left by an exception, the span gets the error (unless ``set_error`` was
    called already): ``cancelled`` for ``trio.Cancelled``, else the
    exception's class name. It starts when the block is entered (a child of
    the span current then) and is ended when the block is left, whatever
    way. A no-op without OpenTelemetry.
    """
    tracer = _tracer()
    if tracer is None:
        return _NO_SPAN_BLOCK
    return _Block(tracer, name, attributes, kind)


def start_span(
    name: str, attributes: Mapping[str, Any] | None = None, *, kind: SpanKind = "internal"
) -> Span:
    """A span named ``name``, child of the current one; the caller ends it (``Span.end``).

    For a span whose end comes later than its block: a tool call's span is
    ended when its result is known, which for a call that timed out is after
    its task was cancelled.
    """
    tracer = _tracer()
    if tracer is None:
        return _NO_SPAN
    return _start(tracer, name, attributes, kind)


def _start(tracer: Any, name: str, attributes: Mapping[str, Any] | None, kind: SpanKind) -> Span:
    """A real span, or the null one when it cannot be started (``_failed``)."""
    api = _state.api
    assert api is not None  # _tracer() found it
    try:
        started = tracer.start_span(
            _bounded(name),
            kind=api.kinds[kind],
            attributes=_bounded_attributes(attributes),
            record_exception=False,
            set_status_on_exception=False,
        )
    except Exception as exc:  # a span processor's on_start, say
        _failed("start", name, exc)
        return _NO_SPAN
    return _Span(api, started)


def _failed(what: str, name: str, exc: Exception) -> None:
    """A span operation failed: it is dropped, never the traced work; logged once."""
    if not _state.warned:
        _state.warned = True
        _log.warning(
            "tracing: could not %s span %r (%s); such failures are dropped, and not logged again",
            what,
            _bounded(name, 80),
            type(exc).__qualname__,
            exc_info=exc,
        )


def _bounded(text: str, limit: int = MAX_TEXT) -> str:
    """``text`` cut to ``limit`` characters (the last one an ellipsis) when longer."""
    if len(text) <= limit:
        return text
    return text[: limit - 1] + "\u2026"


def _bounded_value(value: Any) -> Any:
    if isinstance(value, str):
        return _bounded(value)
    if isinstance(value, list | tuple) and any(isinstance(v, str) for v in value):
        return [_bounded(v) if isinstance(v, str) else v for v in value]
    return value


def _bounded_attributes(attributes: Mapping[str, Any] | None) -> Mapping[str, Any] | None:
    if attributes is None or not any(
        isinstance(v, str | list | tuple) for v in attributes.values()
    ):
        return attributes
    return {key: _bounded_value(value) for key, value in attributes.items()}


class _Span(Span):
    __slots__ = ("_api", "_failed", "_span")

    def __init__(self, api: _Api, span: Any) -> None:
        self._api = api
        self._span = span
        self._failed = False

    def set_attribute(self, key: str, value: Any) -> None:
        try:
            self._span.set_attribute(key, _bounded_value(value))
        except Exception as exc:
            _failed("set an attribute of", key, exc)

    def set_error(self, kind: str, description: str = "") -> None:
        self._failed = True
        try:
            self._span.set_attribute(ERROR_TYPE, _bounded(kind))
            self._span.set_status(
                self._api.status(self._api.error, _bounded(description) if description else None)
            )
        except Exception as exc:
            _failed("fail", kind, exc)

    def end(self) -> None:
        try:
            self._span.end()
        except Exception as exc:  # a span processor's on_end, say: the work is done
            _failed("end", getattr(self._span, "name", "?"), exc)

    @contextlib.contextmanager
    def current(self) -> Iterator[None]:
        token = self._api.attach(self._api.in_context(self._span))
        try:
            yield
        finally:
            self._api.detach(token)


class _Block:
    """``span``'s block: the span is current inside, failed by an exception, ended after."""

    __slots__ = ("_attributes", "_kind", "_name", "_span", "_token", "_tracer")

    def __init__(
        self, tracer: Any, name: str, attributes: Mapping[str, Any] | None, kind: SpanKind
    ) -> None:
        self._tracer = tracer
        self._name = name
        self._attributes = attributes
        self._kind = kind
        self._span: _Span | None = None

    def __enter__(self) -> Span:
        span = _start(self._tracer, self._name, self._attributes, self._kind)
        if not isinstance(span, _Span):  # could not be started: the block runs untraced
            return span
        self._span = span
        self._token = span._api.attach(span._api.in_context(span._span))
        return span

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        span, self._span = self._span, None
        if span is None:
            return
        try:
            if exc is not None and not span._failed:
                # Not str(exc): an exception's message can quote anything.
                span.set_error(error_type(exc))
        finally:
            span._api.detach(self._token)
            span.end()


def error_type(exc: BaseException) -> str:
    """``error.type`` for an exception: ``cancelled`` for ``trio.Cancelled`` or a group
    of nothing else (a nursery cancelled from outside), else its class."""
    if isinstance(exc, trio.Cancelled) or (
        isinstance(exc, BaseExceptionGroup) and _only_cancelled(exc)
    ):
        return "cancelled"
    return type(exc).__qualname__


def _only_cancelled(group: BaseExceptionGroup[BaseException]) -> bool:
    # Floor 0: kernel.executor's twin cannot be imported here.
    return all(
        _only_cancelled(e) if isinstance(e, BaseExceptionGroup) else isinstance(e, trio.Cancelled)
        for e in group.exceptions
    )
