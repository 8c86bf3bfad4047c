"""Test helpers for plugin authors: run tools as the kernel does, in a temporary workspace.

::

    from kernel.testing import plugin_harness
    from my_plugin import plugin

    async def test_greet(tmp_path):
        async with plugin_harness(plugin, tmp_path) as h:
            observation = await h.call("greet", {"name": "Ada"})
        assert observation.content == "Hello, Ada!"

Calls go through ``run_tool_calls`` (argument validation, deadlines, error
observations) and, unless the plugin runs in process, a real sandbox worker
confined to the workspace with the plugin's declared permissions: a tool that
tries more gets the ``denied`` observation it would get in production.
Works under pytest-trio (``trio_mode = true``, or ``@pytest.mark.trio``).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import AsyncIterator, Mapping, Sequence
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

from .errors import UsageError
from .executor import CallLimits, run_tool_calls
from .messages import Observation, ToolCall
from .plugin import Plugin, use_context
from .tools import ToolRegistry

if TYPE_CHECKING:
    from plugins import LoadedPlugin, PluginHost


class PluginHarness:
    """One plugin, loaded by a real plugin host; made by ``plugin_harness``.

    Attributes:
        workspace: the temporary workspace (a real directory: put fixtures in it).
        plugin: what the host loaded (name, version, permissions, isolation, tools).
        tools: the plugin's tools by name.
        session: the session key tools see in ``kernel.context().session``.
    """

    def __init__(self, host: PluginHost, session: str | None, limits: CallLimits) -> None:
        self.host = host
        self.workspace = Path(host.workspace.path)
        self.plugin: LoadedPlugin = host.plugins[0]
        self.tools: ToolRegistry = host.tools
        self.session = session
        self.limits = limits
        self._calls = 0

    async def call(
        self, tool: str, arguments: Mapping[str, Any] | str | None = None
    ) -> Observation:
        """Run one call and return its observation (errors are observations, not raised)."""
        observations = await self.call_many([(tool, arguments)])
        return observations[0]

    async def call_many(
        self, calls: Sequence[tuple[str, Mapping[str, Any] | str | None]]
    ) -> list[Observation]:
        """Run calls concurrently, as one model turn; observations in the order given."""
        batch = []
        for index, (tool, arguments) in enumerate(calls):
            self._calls += 1
            args: dict[str, Any] | str = (
                arguments if isinstance(arguments, str) else dict(arguments or {})
            )
            batch.append(ToolCall(f"test-{self._calls}", tool, args, index))
        with use_context(self.host.context(self.session)):
            return await run_tool_calls(batch, self.tools, limits=self.limits)


@contextlib.asynccontextmanager
async def plugin_harness(
    plugin: Plugin | ModuleType | str,
    workspace: str | os.PathLike[str],
    *,
    config: Mapping[str, Any] | None = None,
    session: str | None = "test/session",
    limits: CallLimits = CallLimits(),
    allow_unsandboxed: bool = False,
) -> AsyncIterator[PluginHarness]:
    """Load ``plugin`` alone, confined to ``workspace``, and yield a harness to call it.

    Args:
        plugin: a ``Plugin``, its module, or a module name or ``.py`` path.
        workspace: a directory (pytest's ``tmp_path`` is a good one).
        config: what ``kernel.context().config`` holds (``[plugins.<name>]``).
        session: the session key tools see.
        limits: the executor's limits (a default deadline for tools without one).
        allow_unsandboxed: run even where the sandbox is unavailable (marked).

    Raises:
        UsageError: the plugin did not load; the message says why.
    """
    from plugins import open_plugin_host

    name = plugin.name if isinstance(plugin, Plugin) else None
    settings = {"plugins": {name: dict(config)}} if config and name else {}
    async with open_plugin_host(
        workspace, plugins=[plugin], allow_unsandboxed=allow_unsandboxed, config=settings
    ) as host:
        if host.errors:
            raise UsageError(f"the plugin did not load: {host.errors[0].reason}")
        if config and name is None:
            # The name is known only now: give the plugin its config from here on.
            host.configure_plugin(host.plugins[0].name, config)
        yield PluginHarness(host, session, limits)


__all__ = ["PluginHarness", "plugin_harness"]
