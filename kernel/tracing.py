"""OpenTelemetry spans for turns, model requests and tool calls (``tak[otel]``).

Stub: the names and shapes are fixed; the spans are filled in by the
tracing work of issue 16 (GenAI semantic conventions). Without
``opentelemetry-api`` installed every span is a no-op and costs nothing; the
API is imported lazily, never by ``import kernel``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import Any


class Span:
    """What the kernel does with a span: attributes, and the error that ended it."""

    def set_attribute(self, key: str, value: Any) -> None:
        pass

    def set_error(self, kind: str, message: str = "") -> None:
        pass


_NO_SPAN = Span()


@contextlib.contextmanager
def span(name: str, attributes: Mapping[str, Any] | None = None) -> Iterator[Span]:
    """A span named ``name`` under the current one (a no-op without OpenTelemetry)."""
    yield _NO_SPAN
