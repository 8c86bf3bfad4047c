"""``tak mcp ls [--json]``: each ``[mcp.servers.NAME]`` of tak.toml, started and
listed as a kernel would (confined, and only once approved), with its state, its
approval, its confinement and its tools; one line per error.

Exit status 0 when every server answered, 1 when one did not (its errors say
why), 2 for a wrong tak.toml.

``tak mcp trust NAME`` / ``tak mcp untrust NAME``: approve a stdio server as it
is configured, or withdraw the approval (``plugins._mcp``).
"""

from __future__ import annotations

import argparse
import logging
import sys
from typing import TYPE_CHECKING

from ..terminal import escape_terminal
from ._common import ensure_home, home_option, tak_command
from ._exit import BAD_INPUT, FAILED, OK, one_line_errors
from ._terminal_json import terminal_json

if TYPE_CHECKING:
    from ..home import McpServerConfig


@one_line_errors("tak mcp ls")
def run(args: argparse.Namespace) -> int:
    import trio

    from plugins import McpServerInfo, open_mcp_servers

    from ..tools import ToolRegistry

    home = ensure_home(args.home)
    config = home.read_config()
    # Each server's errors are printed below, with the right hint: not the servers'
    # own warnings too (a trust hint for a program that is not there).
    logging.getLogger("tak.mcp").addHandler(logging.NullHandler())
    if not config.mcp.servers:
        if args.json:
            print("[]")
        else:
            print(f"no MCP servers: add [mcp.servers.NAME] to {home.config_file} (docs/mcp.md)")
        return OK

    async def main() -> list[McpServerInfo]:
        async with open_mcp_servers(
            config.mcp.servers,
            ToolRegistry(),
            log_dir=home.data / "mcp",
            workspace=home.workspace,
            home=home,
            allow_unsandboxed=config.sandbox.allow_unsandboxed,
        ) as servers:
            await servers.list_tools()
            return servers.info()

    infos = trio.run(main)
    if args.json:
        rows = [
            {
                "name": i.name,
                "transport": i.transport,
                "state": i.state,
                "approval": i.approval,
                "confinement": i.confinement,
                "tools": list(i.tools),
                "errors": list(i.errors),
            }
            for i in infos
        ]
        print(terminal_json(rows, indent=2))
    else:
        # A server's tool names and its errors (which quote what it wrote) are its own.
        for i in infos:
            count = f"{len(i.tools)} tool" + ("" if len(i.tools) == 1 else "s")
            print(f"{i.name}  {i.transport}  {i.state}  {count}")
            if i.transport == "stdio":
                print(f"  approval: {escape_terminal(i.approval)}")
                if i.confinement is not None:
                    print(f"  confinement: {escape_terminal(i.confinement)}")
            for name in i.tools:
                print(f"  {escape_terminal(name)}")
            missing = _missing_program(config.mcp.servers[i.name])
            if i.state == "not approved" and missing is not None:
                # approving it would fail: say what is wrong instead
                print(escape_terminal(f"  error: {missing} (its command in {home.config_file})"))
            elif i.state == "not approved":
                print(
                    f"  approve it: {tak_command(*home_option(args.home), 'mcp', 'trust', i.name)}"
                )
            else:
                for error in i.errors:
                    print(f"  error: {escape_terminal(error)}")
            if i.state not in ("running", "not approved") and i.transport == "stdio":
                print(f"  its stderr: {home.data / 'mcp' / (i.name + '.log')}")
    return OK if all(i.state == "running" for i in infos) else FAILED


def _missing_program(server: McpServerConfig) -> str | None:
    """Why the program of a stdio server cannot run (not found, not executable), or
    ``None``; ``tak mcp trust`` would refuse it for the same reason."""
    from plugins._mcp import server_environment
    from sandbox.exec import resolve_program

    from ..errors import SandboxError

    if server.command is None:
        return None
    path = server_environment(server).get("PATH")
    try:
        resolve_program(server.command, path=path, cwd=server.cwd)
    except SandboxError as exc:
        return str(exc)
    return None


@one_line_errors("tak mcp trust")
def trust(args: argparse.Namespace) -> int:
    from plugins._mcp import trust_mcp_server
    from plugins._trust import MCP_TRUST_FILE

    home = ensure_home(args.home)
    config = home.read_config()
    server = config.mcp.servers.get(args.name)
    if server is None:
        known = ", ".join(sorted(config.mcp.servers)) or "none"
        print(
            f"tak mcp trust: no server {args.name!r} in {home.config_file} (known: {known})",
            file=sys.stderr,
        )
        return BAD_INPUT
    approval = trust_mcp_server(home, args.name, server)
    # A server's command and arguments may name files of a cloned repository.
    print(f"trusted: {escape_terminal(args.name)}")
    print(f"  command:     {escape_terminal(' '.join([approval.command, *approval.args]))}")
    for path in approval.executables:
        print(f"  runs:        {escape_terminal(str(path))}")
    print(f"  sha256:      {approval.sha256}")
    print(f"  permissions: {escape_terminal(approval.permissions.describe())}")
    print(f"  recorded in: {escape_terminal(str(home.config / MCP_TRUST_FILE))}")
    return OK


@one_line_errors("tak mcp untrust")
def untrust(args: argparse.Namespace) -> int:
    from plugins._trust import MCP_TRUST_FILE, McpTrustStore

    from ..home import TakHome

    removed = McpTrustStore(TakHome.locate(args.home).config / MCP_TRUST_FILE).revoke(args.name)
    if removed is None:
        print(escape_terminal(f"tak mcp untrust: {args.name} was not trusted"), file=sys.stderr)
        return BAD_INPUT  # the name given holds no approval
    print(f"untrusted: {escape_terminal(args.name)}")
    return OK
