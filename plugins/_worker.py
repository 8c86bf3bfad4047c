"""A plugin worker: ``python -I -m plugins._worker FD``; the pool starts it.

``FD`` is this process's end of the pool's socket pair. The worker confines
itself (``sandbox.worker.start``: the steps of ``sandbox._confine``, in order),
only then appends the plugin's directories (``WorkerConfig.path``) to
``sys.path`` and imports the plugin (``plugins._loading``), greets the kernel
with its tools and what the plugin says about itself, and answers calls
(``sandbox.worker.serve``): each in its own thread, an ``async`` tool in its own
``trio.run`` there.

Each call runs inside ``kernel.context()``: the workspace (a confined,
lazily opened ``Workspace``), the session key and the plugin's config, both sent
by the kernel in the call frame, and a logger whose records travel to the
kernel's log as log frames. A tool that fails with ``EPERM``/``EACCES`` gets a
``denied`` result naming the permission its plugin lacks
(``sandbox.worker.denial_message``).

It exits when the kernel closes the channel, and takes its process group (any
programs its tools started) with it.
"""

from __future__ import annotations

import functools
import logging
import os
import sys
import traceback
from collections.abc import Sequence
from typing import Any

from kernel.messages import converter
from kernel.plugin import ToolContext, use_context
from kernel.tools import ArgumentError, Tool, ToolFailure, describe_exception
from sandbox import CallFrame, FatalFrame, ReadyFrame, ResultFrame, WorkerConfig, Workspace
from sandbox import worker as mechanism

from ._loading import PluginInfo, load_plugin, split_target, tool_spec, unpin

_USAGE = "usage: python -I -m plugins._worker FD"


class _Calls:
    """What every call shares: the tools, the context's parts; ``run`` serves one call."""

    def __init__(
        self,
        channel: mechanism.Channel,
        config: WorkerConfig,
        tools: dict[str, Tool],
        plugin_name: str,
        attempts: mechanism.Attempts,
    ) -> None:
        self.config = config
        self.tools = tools
        self.attempts = attempts
        self.logger = logging.getLogger(f"tak.plugin.{plugin_name}")
        self.logger.setLevel(logging.DEBUG)
        self.logger.propagate = False
        self.logger.addHandler(mechanism.LogFrames(channel))
        # Opened on first use: a worker whose tools never touch it holds no
        # descriptor beyond stdio and its channel (the sandbox tests check that).
        self.workspace = Workspace(config.workspace, lazy=True)

    def run(self, call: CallFrame) -> ResultFrame:
        """The result of one call; every failure becomes an error result."""
        tool = self.tools.get(call.tool)
        if tool is None:
            return mechanism.error_result(
                call.id, "unknown_tool", "UnknownTool", f"no tool named {call.tool!r}"
            )
        self.attempts.clear()
        context = ToolContext(
            workspace=self.workspace, session=call.session, logger=self.logger, config=call.config
        )
        try:
            kwargs = tool.validate(call.arguments)
            assert tool.fn is not None
            with use_context(context):
                result = _run_async(tool.fn, kwargs) if tool.is_async else tool.fn(**kwargs)
        except ToolFailure as exc:
            return mechanism.error_result(call.id, exc.kind, exc.type, exc.message)
        except ArgumentError as exc:
            return mechanism.error_result(call.id, "bad_arguments", "ArgumentError", str(exc))
        except BaseException as exc:  # a tool's SystemExit ends its call, not the worker
            denied = mechanism.permission_error(exc)
            if denied is not None:
                text = mechanism.denial_message(self.config, self.attempts.last(), denied)
                return mechanism.error_result(call.id, "denied", type(denied).__name__, text)
            text = describe_exception(exc) + mechanism.file_size_note(self.config, exc)
            return mechanism.error_result(call.id, "exception", type(exc).__name__, text)
        return _value_result(call.id, tool, result)


def _value_result(call_id: int, tool: Tool, result: Any) -> ResultFrame:
    try:
        if isinstance(result, bytes):
            value: Any = result.decode("utf-8", errors="replace")
        elif isinstance(result, str):
            value = result
        else:
            value = converter.unstructure(result)
    except (TypeError, ValueError, RecursionError) as exc:
        return mechanism.error_result(
            call_id,
            "exception",
            type(exc).__name__,
            f"{tool.name} returned a {type(result).__name__} that cannot be "
            f"serialized to JSON: {exc}",
        )
    return ResultFrame(id=call_id, ok=True, value=value)


def _run_async(fn: Any, kwargs: dict[str, Any]) -> Any:
    import trio  # only plugins with async tools pay for it

    return trio.run(functools.partial(fn, **kwargs))


def _extend_path(config: WorkerConfig) -> None:
    # Appended, not prepended: an installed module of the same name still wins,
    # and nothing in the directory can shadow the standard library.
    for entry in config.path:
        if entry and entry not in sys.path:
            sys.path.append(entry)


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 1 or not args[0].isdigit():
        print(_USAGE, file=sys.stderr)
        return 2
    try:
        channel, config, report = mechanism.start(int(args[0]), "plugins._worker")
    except SystemExit as exc:
        return int(exc.code or 0)
    _extend_path(config)
    try:
        plugin, tools = load_plugin(config.plugin)
    except BaseException as exc:
        traceback.print_exc()
        channel.send(
            FatalFrame(
                message=f"cannot load plugin {unpin(config.plugin)[0]}: {type(exc).__name__}: "
                f"{describe_exception(exc)}"
            )
        )
        return 1
    attempts = mechanism.Attempts()
    attempts.install()  # after the import: the plugin's own imports are not audited
    label = plugin.name if plugin is not None else split_target(unpin(config.plugin)[0])[0]
    info = PluginInfo.of(plugin) if plugin is not None else None
    channel.send(
        ReadyFrame(
            pid=os.getpid(),
            tools=[tool_spec(t) for t in tools],
            confinement=report,
            plugin=converter.unstructure(info) if info is not None else None,
        )
    )
    calls = _Calls(channel, config, {t.name: t for t in tools}, label, attempts)
    mechanism.serve(channel, calls.run)
    # The kernel closed the channel: end every program the tools started, and this one.
    mechanism.exit_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
