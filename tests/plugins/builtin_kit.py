"""Shared helpers for the built-in plugin tests: a tool context on a tmp workspace, calls."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from kernel.executor import CallLimits, run_tool_calls
from kernel.messages import Observation, ToolCall
from kernel.plugin import Plugin, ToolContext, use_context
from sandbox import Workspace


@contextlib.contextmanager
def tool_context(root: Path, config: Mapping[str, Any] | None = None) -> Iterator[ToolContext]:
    """``context()`` inside the block is a context on a workspace at ``root``."""
    with Workspace(root) as ws:
        ctx = ToolContext(ws, "p/s", logging.getLogger("tests.plugins"), dict(config or {}))
        with use_context(ctx):
            yield ctx


async def run_calls(
    plugin: Plugin,
    calls: list[tuple[str, dict[str, Any]]],
    *,
    limits: CallLimits = CallLimits(),
) -> list[Observation]:
    """Run ``(tool name, arguments)`` calls through the real executor, in process.

    The caller sets the context (``tool_context``): the executor's threads and
    tasks inherit it.
    """
    tool_calls = [
        ToolCall(id=f"call_{i}", name=name, arguments=arguments)
        for i, (name, arguments) in enumerate(calls)
    ]
    return await run_tool_calls(tool_calls, plugin.tools, limits=limits)
