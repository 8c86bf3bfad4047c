"""The plugin authoring API: ``Plugin``, its permissions, and ``context()`` inside a tool.

::

    from kernel import Plugin, context

    plugin = Plugin("weather", version="0.1.0", permissions={"network": ["api.example.org:443"]})

    @plugin.tool(timeout=10)
    async def forecast(city: str, days: int = 3) -> str:
        \"\"\"Forecast for a city.

        Args:
            city: City name.
            days: How many days, 1 to 7.
        \"\"\"
        context().logger.info("forecast for %s", city)
        ...

Every sandbox worker imports this module, so it stays as light as ``kernel.tools``:
no trio, no httpx; of the sandbox only its permission validators (``sandbox._policy``).
The host maps ``Permissions`` onto the sandbox's ``Policy`` (``plugins.policy_for``).
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import re
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any, overload

import attrs

from sandbox import WorkspaceAccess, check_network, check_workspace_access

from .errors import UsageError
from .tools import TOOL_NAME_PATTERN, Tool, tool

if TYPE_CHECKING:
    from sandbox import Workspace

__all__ = ["Permissions", "Plugin", "ToolContext", "context", "use_context"]

_PLUGIN_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_-]{0,63}")
_PERMISSION_KEYS = ("workspace", "network", "subprocess")


# One set of validators for permissions and the sandbox's Policy (sandbox._policy).
def _check_workspace(instance: object, attribute: attrs.Attribute[Any], value: Any) -> None:
    check_workspace_access(value, "permissions.workspace")


def _check_network(instance: object, attribute: attrs.Attribute[Any], value: Any) -> None:
    check_network(value, "permissions.network")


def _network_tuple(value: Any) -> tuple[str, ...]:
    if isinstance(value, str):
        raise UsageError(f"permissions.network: expected a list of 'host:port', got {value!r}")
    return tuple(value)


def _check_bool(instance: object, attribute: attrs.Attribute[Any], value: Any) -> None:
    if not isinstance(value, bool):
        raise UsageError(f"permissions.{attribute.name}: expected true or false, got {value!r}")


@attrs.frozen(kw_only=True)
class Permissions:
    """What a plugin may do beyond computing: the sandbox enforces exactly this.

    Attributes:
        workspace: ``"read"`` (default) or ``"write"`` inside the workspace.
        network: ``"host:port"`` entries the plugin may connect to; none by default.
        subprocess: whether it may start programs.
    """

    workspace: WorkspaceAccess = attrs.field(default="read", validator=_check_workspace)
    network: tuple[str, ...] = attrs.field(
        default=(), converter=_network_tuple, validator=_check_network
    )
    subprocess: bool = attrs.field(default=False, validator=_check_bool)

    @classmethod
    def from_mapping(cls, value: Mapping[str, Any] | Permissions | None) -> Permissions:
        """Permissions from ``{"workspace": ..., "network": [...], "subprocess": ...}``.

        Raises:
            UsageError: an unknown key or a bad value, named by its path.
        """
        if value is None:
            return cls()
        if isinstance(value, Permissions):
            return value
        unknown = sorted(set(value) - set(_PERMISSION_KEYS))
        if unknown:
            raise UsageError(
                f"permissions: unknown key(s) {', '.join(unknown)}; "
                f"known: {', '.join(_PERMISSION_KEYS)}"
            )
        return cls(**dict(value))

    def describe(self) -> str:
        """``workspace: write, network: a:443, subprocess`` — for listings and errors."""
        parts = [f"workspace: {self.workspace}"]
        parts.append(f"network: {', '.join(self.network)}" if self.network else "no network")
        parts.append("subprocess" if self.subprocess else "no subprocess")
        return ", ".join(parts)


class Plugin:
    """A named, versioned set of tools with the permissions they need.

    A plugin module exposes one ``plugin = Plugin(...)``; its ``@plugin.tool``
    functions are its tools. ``in_process=True`` is for built-ins whose every
    side effect goes through the confined ``Workspace`` (see docs/plugins.md):
    they run in the kernel's process; every other plugin runs in sandbox workers.

    Raises:
        UsageError: a bad name or permissions; a second tool with one name.
    """

    def __init__(
        self,
        name: str,
        *,
        version: str = "0.0.0",
        description: str = "",
        permissions: Mapping[str, Any] | Permissions | None = None,
        in_process: bool = False,
    ) -> None:
        if not isinstance(name, str) or not _PLUGIN_NAME.fullmatch(name):
            raise UsageError(
                f"plugin name {name!r}: a name starts with a letter or '_' and has at most "
                "64 letters, digits, '_' or '-'"
            )
        self.name = name
        self.version = version
        self.description = description
        self.permissions = Permissions.from_mapping(permissions)
        self.in_process = in_process
        self._tools: dict[str, Tool] = {}

    def __repr__(self) -> str:
        return f"Plugin({self.name!r}, version={self.version!r}, tools={list(self._tools)})"

    @property
    def tools(self) -> list[Tool]:
        """The plugin's tools, in declaration order."""
        return list(self._tools.values())

    def add(self, new: Tool) -> Tool:
        """Add a tool made elsewhere (``@tool``).

        Raises:
            UsageError: the plugin already has a tool with that name.
        """
        if new.name in self._tools:
            raise UsageError(f"plugin {self.name}: two tools are named {new.name!r}")
        self._tools[new.name] = new
        return new

    @overload
    def tool(self, fn: Callable[..., Any], /) -> Tool: ...

    @overload
    def tool(
        self,
        /,
        *,
        name: str | None = None,
        timeout: float | None = None,
        exclusive: bool = False,
        max_output: int | None = None,
    ) -> Callable[[Callable[..., Any]], Tool]: ...

    def tool(
        self,
        fn: Callable[..., Any] | None = None,
        /,
        *,
        name: str | None = None,
        timeout: float | None = None,
        exclusive: bool = False,
        max_output: int | None = None,
    ) -> Tool | Callable[[Callable[..., Any]], Tool]:
        """``@plugin.tool`` or ``@plugin.tool(timeout=..., ...)``: like ``@tool``, and registered."""

        def register(function: Callable[..., Any]) -> Tool:
            made = tool(name=name, timeout=timeout, exclusive=exclusive, max_output=max_output)(
                function
            )
            return self.add(made)

        return register(fn) if fn is not None else register

    def qualified(self, tool_name: str) -> str:
        """``weather.forecast``: the namespaced name used when two plugins collide."""
        qualified = f"{self.name}.{tool_name}"
        if not TOOL_NAME_PATTERN.fullmatch(qualified):
            raise UsageError(f"plugin {self.name}: {qualified!r} is not a valid tool name")
        return qualified


@attrs.frozen
class ToolContext:
    """What a tool may know about the call it serves.

    Attributes:
        workspace: the confined workspace (``sandbox.Workspace``): every path a tool
            opens goes through it; plugins never see the host's paths.
        session: the session's key (``project/session`` or with a subpath), if any.
        logger: where the tool should log.
        config: the plugin's own section of ``tak.toml`` (``[plugins.<name>]``).
    """

    workspace: Workspace
    session: str | None
    logger: logging.Logger
    config: Mapping[str, Any] = attrs.field(factory=dict)


_current: contextvars.ContextVar[ToolContext] = contextvars.ContextVar("tak_tool_context")


def context() -> ToolContext:
    """The context of the tool call being served.

    Raises:
        UsageError: called outside a tool call.
    """
    try:
        return _current.get()
    except LookupError:
        raise UsageError(
            "kernel.context() is only available while the kernel runs a tool call"
        ) from None


@contextlib.contextmanager
def use_context(ctx: ToolContext) -> Iterator[ToolContext]:
    """Make ``ctx`` what ``context()`` returns inside the block (and tasks started in it)."""
    token = _current.set(ctx)
    try:
        yield ctx
    finally:
        _current.reset(token)
