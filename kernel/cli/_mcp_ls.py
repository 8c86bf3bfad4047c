"""``tak mcp ls [--json]``: each ``[mcp.servers.NAME]`` of tak.toml, started and
listed as a kernel would, with its state and its tools; one line per error.

Exit status 0 when every server answered, 1 when one did not (its errors say
why), 2 for a wrong tak.toml.
"""

from __future__ import annotations

import argparse
import json

from .plugins import ensure_home, one_line_errors


@one_line_errors("tak mcp ls")
def run(args: argparse.Namespace) -> int:
    import trio

    from plugins import McpServerInfo, open_mcp_servers

    from ..tools import ToolRegistry

    home = ensure_home(args.home)
    config = home.read_config()
    if not config.mcp.servers:
        if args.json:
            print("[]")
        else:
            print(f"no MCP servers: add [mcp.servers.NAME] to {home.config_file} (docs/mcp.md)")
        return 0

    async def main() -> list[McpServerInfo]:
        async with open_mcp_servers(
            config.mcp.servers, ToolRegistry(), log_dir=home.data / "mcp"
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
                "tools": list(i.tools),
                "errors": list(i.errors),
            }
            for i in infos
        ]
        print(json.dumps(rows, indent=2))
    else:
        for i in infos:
            count = f"{len(i.tools)} tool" + ("" if len(i.tools) == 1 else "s")
            print(f"{i.name}  {i.transport}  {i.state}  {count}")
            for name in i.tools:
                print(f"  {name}")
            for error in i.errors:
                print(f"  error: {error}")
            if i.state != "running" and i.transport == "stdio":
                print(f"  its stderr: {home.data / 'mcp' / (i.name + '.log')}")
    return 0 if all(i.state == "running" for i in infos) else 1
