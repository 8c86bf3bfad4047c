"""The exceptions a tool's arguments or its run raise, and how a failure reads."""

from __future__ import annotations

from ..errors import KernelError, UsageError
from ..messages import ERROR_KINDS, ErrorKind


class ArgumentError(UsageError):
    """Arguments failed the tool's schema.

    ``str(exc)`` names each failing path and why, joined by ``; ``:
    ``$.items[2].name: expected int, got str``.
    """


class ToolFailure(KernelError):
    """Raised by a tool (or whatever runs it) to choose the observation's error kind.

    ``raise ToolFailure("denied", "network access to example.org:443 was not declared")``

    ``kind`` is one of ``kernel.ERROR_KINDS`` (every client knows them); any
    other is refused here, so a tool that tries ``ToolFailure("not_found", ...)``
    gets an ``exception`` observation saying so, not a silent rewrite. For a
    finer reason, keep the kind and use ``type`` (``type="NotFound"``).

    Raises:
        UsageError: ``kind`` is not one of ``ERROR_KINDS``.
    """

    def __init__(self, kind: ErrorKind, message: str, *, type: str | None = None) -> None:
        if kind not in ERROR_KINDS:
            raise UsageError(
                f"ToolFailure kind {kind!r} is not one of {', '.join(ERROR_KINDS)}; "
                "keep one of those and name the reason with type=..."
            )
        super().__init__(message)
        self.kind: ErrorKind = kind
        self.message = message
        self.type = type or "ToolFailure"


def describe_exception(exc: BaseException) -> str:
    """How a tool's exception reads in its observation: its message, or for an
    exception group one ``Type: message`` per sub-exception, on one line."""
    if isinstance(exc, BaseExceptionGroup):
        leaves = [f"{type(e).__name__}: {describe_exception(e)}" for e in exc.exceptions]
        return f"{exc.message} ({len(exc.exceptions)} sub-exceptions): " + "; ".join(leaves)
    return str(exc) or type(exc).__name__
