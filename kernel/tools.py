"""Tools: ``@tool`` turns a typed function into a ``Tool``; ``ToolRegistry`` holds them.

INTERFACE STUB — the implementation is being written; the names and
signatures below are the contract the executor is built on.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable, Iterator
from typing import Any

import attrs

from .messages import ErrorKind


class ArgumentError(Exception):
    """Arguments failed the tool's schema. ``str(exc)`` names the path: ``$.items[2].name: expected int``."""


class ToolFailure(Exception):
    """Raised by a tool (or whatever runs it) to choose the observation's error kind.

    ``raise ToolFailure("denied", "network access to example.org:443 was not declared")``
    """

    def __init__(self, kind: ErrorKind, message: str, *, type: str | None = None) -> None:
        super().__init__(message)
        self.kind: ErrorKind = kind
        self.message = message
        self.type = type or "ToolFailure"


@attrs.frozen
class Tool:
    name: str
    description: str
    parameters: dict[str, Any]
    fn: Callable[..., Any] | None
    is_async: bool
    timeout: float | None = None
    exclusive: bool = False
    max_output: int | None = None
    invoke: Callable[[dict[str, Any]], Awaitable[Any]] | None = None

    def validate(self, arguments: dict[str, Any]) -> dict[str, Any]:
        raise NotImplementedError


def tool(*args: Any, **kwargs: Any) -> Any:
    raise NotImplementedError


class ToolRegistry:
    def __init__(self, tools: Iterable[Tool] = ()) -> None:
        self._tools: dict[str, Tool] = {}

    def get(self, name: str) -> Tool | None:
        return self._tools.get(name)

    def names(self) -> list[str]:
        return list(self._tools)

    def __iter__(self) -> Iterator[Tool]:
        return iter(self._tools.values())
