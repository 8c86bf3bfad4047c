"""``ToolRegistry``: tools by name; and ``ToolDefinition``, what a model adapter is told."""

from __future__ import annotations

import fnmatch
from collections.abc import Iterable, Iterator
from typing import Any

import attrs

from ..errors import UsageError
from ._tool import Tool


@attrs.frozen
class ToolDefinition:
    """A tool as a model sees it, in no provider's format.

    Each model adapter turns these into its provider's wire format (see
    docs/models.md); ``parameters`` is the kernel's JSON Schema, shared with
    the tool: an adapter copies what it changes.
    """

    name: str
    description: str
    parameters: dict[str, Any]


class ToolRegistry:
    """Tools by name, in registration order.

    Names are kept as given. ``TOOL_NAME_PATTERN`` allows ``.`` for
    namespacing, which OpenAI and Anthropic reject: their adapters map it.

    Raises:
        UsageError: a second tool with a name already registered.
    """

    def __init__(self, tools: Iterable[Tool] = ()) -> None:
        self._tools: dict[str, Tool] = {}
        for t in tools:
            self.add(t)

    def add(self, tool: Tool) -> None:
        """Register a tool.

        Raises:
            UsageError: a tool with this name is already registered.
        """
        if tool.name in self._tools:
            raise UsageError(f"a tool named {tool.name!r} is already registered")
        self._tools[tool.name] = tool

    def get(self, name: str) -> Tool | None:
        return self._tools.get(name)

    def names(self) -> list[str]:
        return list(self._tools)

    def definitions(self) -> list[ToolDefinition]:
        """What a model adapter needs of each tool, in registration order."""
        return [ToolDefinition(t.name, t.description, t.parameters) for t in self]

    def __iter__(self) -> Iterator[Tool]:
        return iter(self._tools.values())

    def __len__(self) -> int:
        return len(self._tools)

    def __contains__(self, name: object) -> bool:
        return name in self._tools


def select_tools(registry: ToolRegistry, patterns: Iterable[str] | None) -> ToolRegistry:
    """The tools of ``registry`` whose name matches one of ``patterns`` (exact
    names, or ``fnmatch`` patterns such as ``fs.*``); all of them when ``None``.

    Raises:
        UsageError: a pattern that matches no tool (the names it could have
            matched are listed), or one that is not a non-empty string.
    """
    if patterns is None:
        return registry
    wanted = list(patterns)
    names = registry.names()
    chosen: set[str] = set()
    for pattern in wanted:
        if not isinstance(pattern, str) or not pattern:
            raise UsageError(f"tools: expected tool names or patterns, got {pattern!r}")
        matched = (
            fnmatch.filter(names, pattern)
            if _is_pattern(pattern)
            else ([pattern] if pattern in names else [])
        )
        if not matched:
            raise UsageError(
                f"tools: no tool matches {pattern!r} (tools: {', '.join(sorted(names))})"
            )
        chosen.update(matched)
    return ToolRegistry(t for t in registry if t.name in chosen)


def _is_pattern(text: str) -> bool:
    return any(c in text for c in "*?[")
