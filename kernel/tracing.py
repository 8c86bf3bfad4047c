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
``trio.Cancelled``; else the exception's class name.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator, Mapping
from types import TracebackType
from typing import Any, Literal, TypeAlias

import trio

#: The semantic conventions the span and attribute names follow.
SCHEMA_URL = "https://opentelemetry.io/schemas/1.37.0"

SpanKind: TypeAlias = Literal["internal", "client"]

ERROR_TYPE = "error.type"

_NULL_BLOCK: contextlib.nullcontext[None] = contextlib.nullcontext()


class Span:
    """What the kernel does with a span: attributes, the error that ended it, its end.

    This class is the span when tracing is off: every method does nothing.
    """

    __slots__ = ()

    def set_attribute(self, key: str, value: Any) -> None:
        """Set ``key`` (a string, number, bool or a sequence of one of them)."""

    def set_error(self, kind: str, message: str = "") -> None:
        """Mark the span failed: status ERROR, ``error.type`` = ``kind``."""

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
        try:
            _state.api = _Api()
        except ImportError:
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
    exception's class name. It is ended when the block is left, whatever
    way. A no-op without OpenTelemetry.
    """
    tracer = _tracer()
    if tracer is None:
        return _NO_SPAN_BLOCK
    return _Block(_start(tracer, name, attributes, kind))


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


def _start(tracer: Any, name: str, attributes: Mapping[str, Any] | None, kind: SpanKind) -> _Span:
    api = _state.api
    assert api is not None  # _tracer() found it
    return _Span(
        api,
        tracer.start_span(
            name,
            kind=api.kinds[kind],
            attributes=attributes,
            record_exception=False,
            set_status_on_exception=False,
        ),
    )


class _Span(Span):
    __slots__ = ("_api", "_failed", "_span")

    def __init__(self, api: _Api, span: Any) -> None:
        self._api = api
        self._span = span
        self._failed = False

    def set_attribute(self, key: str, value: Any) -> None:
        self._span.set_attribute(key, value)

    def set_error(self, kind: str, message: str = "") -> None:
        self._failed = True
        self._span.set_attribute(ERROR_TYPE, kind)
        self._span.set_status(self._api.status(self._api.error, message or None))

    def end(self) -> None:
        self._span.end()

    @contextlib.contextmanager
    def current(self) -> Iterator[None]:
        token = self._api.attach(self._api.in_context(self._span))
        try:
            yield
        finally:
            self._api.detach(token)


class _Block:
    """``span``'s block: the span is current inside, failed by an exception, ended after."""

    __slots__ = ("_span", "_token")

    def __init__(self, span: _Span) -> None:
        self._span = span

    def __enter__(self) -> Span:
        span = self._span
        self._token = span._api.attach(span._api.in_context(span._span))
        return span

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        span = self._span
        try:
            if exc is not None and not span._failed:
                span.set_error(error_type(exc), str(exc))
        finally:
            span._api.detach(self._token)
            span.end()


def error_type(exc: BaseException) -> str:
    """``error.type`` for an exception: ``cancelled`` for ``trio.Cancelled``, else its class."""
    if isinstance(exc, trio.Cancelled):
        return "cancelled"
    return type(exc).__qualname__
