"""``tak mcp``: the MCP servers the kernel uses (``ls``), and the kernel's tools
served over MCP (``serve``). docs/mcp.md.

The ``mcp`` package is an extra (``pip install -e '.[mcp]'``), imported only by
the handlers, never by ``tak --help``.
"""

from __future__ import annotations

import argparse


def add_commands(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("mcp", help="MCP: the servers the kernel uses; the kernel as a server")
    commands = p.add_subparsers(dest="mcp_command", metavar="COMMAND", required=True)
    ls = commands.add_parser("ls", help="each configured MCP server: its state and its tools")
    ls.add_argument("--json", action="store_true", help="print the list as JSON")
    ls.set_defaults(func=cmd_ls)
    serve = commands.add_parser(
        "serve", help="serve the kernel's tools over MCP (stdio; --http HOST:PORT for HTTP)"
    )
    serve.add_argument("--http", metavar="HOST:PORT", help="streamable HTTP instead of stdio")
    serve.add_argument("--token-file", metavar="PATH", help="read (or create) the HTTP token")
    serve.add_argument("--workspace", help="the directory the tools work in")
    serve.add_argument("--session", help="the session each call is recorded in")
    serve.set_defaults(func=cmd_serve)


def cmd_ls(args: argparse.Namespace) -> int:
    from ._mcp_ls import run

    return run(args)


def cmd_serve(args: argparse.Namespace) -> int:
    from ._mcp_serve import run

    return run(args)
