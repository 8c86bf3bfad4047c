"""``tak tools``, ``tak call`` and ``tak demo``.

``tak tools`` and ``tak call`` see what ``tak run`` offers a model: the demo
tools and every plugin's tools (built-ins and discovered plugins), loaded by a
plugin host on the workspace, and the tools of the MCP servers of ``[mcp.servers]``
as ``NAME.tool`` (``tak tools`` lists an eager server's; ``tak call NAME.tool``
starts the lazy server it names).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .._providers import HTTP_PROVIDERS
from ..errors import KernelError
from ..terminal import escape_terminal
from ._exit import BAD_INPUT, FAILED, OK, one_line_errors
from ._terminal_json import terminal_json

if TYPE_CHECKING:
    from plugins import McpServerInfo

    from ..tools import ToolRegistry

PROVIDER_FORMATS = HTTP_PROVIDERS


def add_commands(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("tools", help="list the registered tools and their schemas")
    p.add_argument(
        "--format",
        choices=["summary", *PROVIDER_FORMATS],
        default="summary",
        help="summary (default) or a provider's tool-spec JSON",
    )
    p.add_argument("--workspace", type=Path, help="workspace (default: <home>/workspace)")
    p.set_defaults(func=cmd_tools)

    p = sub.add_parser("call", help="run one tool call and print its observation")
    p.add_argument("tool", help="tool name")
    p.add_argument("arguments", nargs="?", default="{}", help="arguments as a JSON object")
    p.add_argument("--workspace", type=Path, help="workspace directory for file tools")
    p.add_argument("--timeout", type=float, default=120.0, help="deadline in seconds")
    p.add_argument("--json", action="store_true", help="print the observation as JSON")
    p.set_defaults(func=cmd_call)

    p = sub.add_parser("demo", help="run the scripted parallel-call demo")
    p.set_defaults(func=cmd_demo)


@one_line_errors("tak tools")
def cmd_tools(args: argparse.Namespace) -> int:
    import trio

    from ._common import open_cli_tools, workspace_or_exit

    workspace = workspace_or_exit("tak tools", args)
    if workspace is None:
        return BAD_INPUT

    async def main() -> ToolRegistry:
        async with open_cli_tools(args.home, workspace, args.plugin) as (host, mcp):
            for info in mcp.info() if mcp is not None else []:
                if info.state != "running":
                    print(escape_terminal(f"tak tools: {_not_listed(info)}"), file=sys.stderr)
            return host.tools

    registry = trio.run(main)
    if args.format in PROVIDER_FORMATS:
        print(terminal_json(provider_tools(registry, args.format), indent=2))
        return OK
    # A tool's name, description and schema are its plugin's or its MCP server's.
    for t in registry:
        flags = [f"timeout={t.timeout:g}s"] if t.timeout is not None else []
        flags += ["exclusive"] if t.exclusive else []
        extra = f"  [{', '.join(flags)}]" if flags else ""
        first = t.description.split("\n", 1)[0] if t.description else ""
        print(f"{escape_terminal(t.name)}{extra}\n  {escape_terminal(first)}")
        print("  " + terminal_json(t.parameters))
    return OK


def provider_tools(registry: ToolRegistry, provider: str) -> list[dict[str, Any]]:
    """The ``tools`` of a request to ``provider``, made by that adapter's own function:
    what ``tak tools --format <provider>`` prints is what the adapter sends.

    Raises:
        UsageError: tool names that collide, or grow too long, on that provider's wire.
    """
    from ..models._resolve import ADAPTERS

    return ADAPTERS[provider].tool_specs(registry.definitions())


@one_line_errors("tak call")
def cmd_call(args: argparse.Namespace) -> int:
    import trio

    from ..executor import CallLimits, run_tool_calls
    from ..messages import Observation, ToolCall, converter
    from ..plugin import use_context
    from ._common import open_cli_tools, os_errors_as, workspace_or_exit

    workspace = workspace_or_exit("tak call", args)
    if workspace is None:
        return BAD_INPUT
    if not args.timeout > 0:
        print(f"tak call: --timeout must be positive, got {args.timeout:g}", file=sys.stderr)
        return BAD_INPUT
    call = ToolCall("cli-1", args.tool, args.arguments, 0)

    async def main() -> Observation:
        with os_errors_as(f"workspace {workspace}"):
            async with open_cli_tools(args.home, workspace, args.plugin) as (host, mcp):
                if mcp is not None:
                    # A lazy MCP server starts when the call names one of its tools.
                    await mcp.list_tools_for([call.name])
                    server = call.name.partition(".")[0]
                    for info in mcp.info():
                        if info.name == server and info.state != "running":
                            raise KernelError(_not_listed(info))
                with use_context(host.context()):
                    observations = await run_tool_calls(
                        [call], host.tools, limits=CallLimits(timeout=args.timeout)
                    )
        return observations[0]

    observation = trio.run(main)
    # What the tool returned (or its error, which may quote the call): hostile.
    if args.json:
        print(terminal_json(converter.unstructure(observation)))
    else:
        print(escape_terminal(observation.content, keep_newlines=True))
    return FAILED if observation.is_error else OK


def _not_listed(info: McpServerInfo) -> str:
    """Why the tools of an MCP server are not among those listed, in one line."""
    if info.state == "not started":
        return (
            f"MCP server {info.name!r} is lazy: its tools are listed when a call names one "
            f"(`tak mcp ls` starts it)"
        )
    why = f": {info.errors[0]}" if info.errors else ""
    return f"MCP server {info.name!r} is {info.state}{why} (see `tak mcp ls`)"


@one_line_errors("tak demo")
def cmd_demo(args: argparse.Namespace) -> int:
    from datetime import UTC, datetime

    import trio

    from ..demo import DEMO_FILE, DEMO_PLUGINS, format_table, run_demo_turn
    from ..kernel import open_kernel
    from ._common import ensure_home, home_option, os_errors_as, tak_command

    home = ensure_home(args.home)
    workspace = home.workspace / "demo"
    with os_errors_as(f"TAK_HOME {home.root} is not usable"):
        workspace.mkdir(exist_ok=True)
        (workspace / DEMO_FILE[0]).write_text(DEMO_FILE[1])

    async def main() -> int:
        async with open_kernel(home=home, workspace=workspace, plugins=DEMO_PLUGINS) as k:
            session = k.session(datetime.now(UTC).strftime("demo-%Y%m%d-%H%M%S-%f"))
            observations, finished, wall = await run_demo_turn(k, session)
            transcript = (
                k.home.sessions / session.key.project / session.key.session_id / "transcript.jsonl"
            )
        print("One turn, five calls declared by the model, run concurrently:\n")
        print(escape_terminal(format_table(observations), keep_newlines=True))
        total = sum(o.duration_s for o in observations)
        print(f"\ncompletion order: {finished}   (results above are in declared order)")
        print(f"wall time {wall:.3f} s   vs   sum of call durations {total:.3f} s")
        print(f"\ntranscript: {transcript}")
        show = tak_command(*home_option(args.home), "sessions", "show", session.key.session_id)
        print(f"show it:    {show}")
        return 0

    with os_errors_as(f"TAK_HOME {home.root}"):
        return trio.run(main)


__all__ = [
    "PROVIDER_FORMATS",
    "add_commands",
    "cmd_call",
    "cmd_demo",
    "cmd_tools",
    "provider_tools",
]
