"""``ToolRegistry``: tools by name; and ``ToolDefinition``, what a model adapter is told."""

from __future__ import annotations

import fnmatch
import re
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


#: The tools of the embedder (``open_kernel(tools=...)``): they own no namespace.
KERNEL_TOOLS = "the kernel's own tools"


class ToolRegistry:
    """Tools by name, in registration order, and the namespace each source owns.

    Names are kept as given. ``TOOL_NAME_PATTERN`` allows ``.`` for
    namespacing, which OpenAI and Anthropic reject: their adapters map it.

    A source (a plugin, an MCP server) ``claim``s its namespace ``NAME`` and may
    then register names ``NAME.x`` (and bare names, which no namespace holds);
    a name inside another source's namespace is refused, so no source can
    capture the calls meant for another. The embedder's own tools (no
    ``owner``) may take any free name, a namespace's too, which then stays
    theirs: a source claiming it later is refused.

    A name is owned as the model sees it too. OpenAI and Anthropic adapters send
    ``.`` as ``__`` (``wire_form``), so ``m3__echo`` *is* ``m3.echo`` there: its
    namespace is ``m3`` (``namespace_of``), and two names of one wire form are one
    name. Namespaces differing only in case (``M3``, ``m3``) are one namespace: a
    person reading an approval cannot tell them apart.

    Raises:
        UsageError: a second tool with a name already registered.
    """

    def __init__(self, tools: Iterable[Tool] = ()) -> None:
        self._tools: dict[str, Tool] = {}
        self._owner_of: dict[str, str] = {}  # tool name -> the label of its source
        self._namespaces: dict[str, str] = {}  # casefolded namespace -> its owner's label
        self._wire: dict[str, str] = {}  # wire_form(name) -> name
        for t in tools:
            self.add(t)

    def claim(self, namespace: str, owner: str) -> None:
        """Make ``namespace`` the namespace of the source ``owner`` (its label, as
        ``tak`` names it: ``plugin weather (entry point weather)``, ``MCP server m3``).

        Raises:
            UsageError: not a valid namespace, or another source holds it or a
                name in it (one line naming both sources).
        """
        if not isinstance(namespace, str) or not NAMESPACE_PATTERN.fullmatch(namespace):
            raise UsageError(f"{owner}: {namespace!r} is not a valid namespace ({NAMESPACE_RULE})")
        key = namespace.casefold()
        held = self._namespaces.get(key)
        if held is None:
            held = next((o for n, o in self._owner_of.items() if _folded_namespace(n) == key), None)
        if held is not None and held != owner:
            raise UsageError(
                f"two tool sources claim the namespace {namespace!r}: {held} and {owner}; "
                "rename or remove one"
            )
        self._namespaces[key] = owner

    def owner(self, namespace: str) -> str | None:
        """The label of the source whose namespace this is (in any case), if any."""
        return self._namespaces.get(namespace.casefold())

    def taken(self, name: str) -> str | None:
        """The registered name that ``name`` is, as given or on the wire (``wire_form``)."""
        return self._wire.get(wire_form(name))

    def check_name(self, name: str, owner: str | None = None) -> None:
        """Refuse ``name`` as ``add`` would, registering nothing.

        Raises:
            UsageError: the name is taken, or lies in a namespace ``owner`` does not hold.
        """
        if name in self._tools:
            raise UsageError(f"a tool named {name!r} is already registered")
        other = self.taken(name)
        if other is not None:
            raise UsageError(
                f"tool name {name!r} is {other!r} on the wire ({wire_form(name)!r}), which "
                "is already registered"
            )
        namespace = namespace_of(name)
        if namespace is None:
            return
        held = self._namespaces.get(namespace.casefold())
        label = owner if owner is not None else KERNEL_TOOLS
        if owner is not None and held != owner:
            whose = f"belongs to {held}" if held is not None else "is not its own"
            raise UsageError(
                f"{owner}: tool name {name!r} lies in the namespace {namespace!r}, which "
                f"{whose}; a source registers bare names or names in its own namespace"
            )
        if owner is None and held is not None and held != label:
            raise UsageError(
                f"tool name {name!r} lies in the namespace {namespace!r}, which belongs to {held}"
            )

    def add(self, tool: Tool, *, owner: str | None = None) -> None:
        """Register a tool; ``owner`` is the label of the source whose namespace
        (``claim``) a dotted name must lie in (``None``: the embedder's own tool).

        Raises:
            UsageError: a tool with this name is already registered, or its name
                lies in another source's namespace.
        """
        self.check_name(tool.name, owner)
        self._tools[tool.name] = tool
        self._wire[wire_form(tool.name)] = tool.name
        self._owner_of[tool.name] = owner if owner is not None else KERNEL_TOOLS

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


#: A namespace: a source's name, without ``.`` (``weather`` in ``weather.forecast``).
#: No ``__`` in it and no ``_`` at its end: on the wire (``wire_form``) its end
#: would be ambiguous (``m3_.b`` and ``m3._b`` are both ``m3___b``).
NAMESPACE_PATTERN = re.compile(r"(?=.{1,64}$)_?[A-Za-z][A-Za-z0-9-]*(?:_[A-Za-z0-9-]+)*")
#: ``NAMESPACE_PATTERN`` in words, for the errors that refuse a name.
NAMESPACE_RULE = (
    "at most 64 letters, digits, '-' and '_', starting with a letter or '_' and a letter, "
    "with no '__' and no '_' at the end"
)


def wire_form(name: str) -> str:
    """``name`` as the OpenAI and Anthropic adapters send it: ``.`` as ``__``
    (``kernel.models._wire``); two names of one wire form are one name."""
    return name.replace(".", "__")


def namespace_of(name: str) -> str | None:
    """``weather`` for ``weather.forecast`` and for ``weather__forecast`` (its wire
    form); ``None`` for a bare name."""
    head, sep, _ = wire_form(name).partition("__")
    return head if sep and head else None


def _folded_namespace(name: str) -> str | None:
    namespace = namespace_of(name)
    return namespace.casefold() if namespace is not None else None


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
