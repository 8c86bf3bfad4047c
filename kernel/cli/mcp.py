"""``tak mcp``: the MCP servers the kernel uses (``ls``, ``trust``, ``untrust``), and
the kernel's tools served over MCP (``serve``). docs/mcp.md.

The ``mcp`` package is an extra (``pip install -e '.[mcp]'``), imported only by
the handlers, never by ``tak --help``.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from . import DEFAULT_PROJECT


def add_commands(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("mcp", help="MCP: the servers the kernel uses; the kernel as a server")
    commands = p.add_subparsers(dest="mcp_command", metavar="COMMAND", required=True)
    ls = commands.add_parser("ls", help="each configured MCP server: its state and its tools")
    ls.add_argument("--json", action="store_true", help="print the list as JSON")
    ls.set_defaults(func=cmd_ls)
    trust = commands.add_parser(
        "trust",
        help="approve a stdio MCP server of tak.toml to run (confined) as it is configured",
        description="Record the server's program (its SHA-256, and that of the files its "
        "arguments name), arguments, env and permissions in "
        "$TAK_HOME/config/trusted-mcp-servers.json. A stdio server runs only once "
        "approved; any change to those voids the approval. See docs/mcp.md.",
    )
    trust.add_argument("name", help="the server's name in tak.toml ([mcp.servers.NAME])")
    trust.set_defaults(func=cmd_trust)
    untrust = commands.add_parser("untrust", help="withdraw the approval of an MCP server")
    untrust.add_argument("name", help="the server's name")
    untrust.set_defaults(func=cmd_untrust)
    serve = commands.add_parser(
        "serve",
        help="serve the kernel's tools over MCP (stdio; --http HOST:PORT for HTTP)",
        description="Serve the kernel's tools to any MCP client, each call recorded in a "
        "session. On stdio by default (stdout carries only MCP frames; logs go to stderr); "
        "with --http, streamable HTTP at http://HOST:PORT/mcp behind a bearer token, and "
        "one line on stdout: the URL. See docs/mcp.md.",
    )
    serve.add_argument(
        "--http",
        metavar="HOST:PORT",
        help="serve streamable HTTP at http://HOST:PORT/mcp instead of stdio (PORT 0: any)",
    )
    serve.add_argument(
        "--token-file",
        type=Path,
        metavar="PATH",
        help="with --http: read the bearer token from this file; a missing file is created "
        "with a new token (mode 0600). Default: a new token each start",
    )
    serve.add_argument(
        "--allow-remote",
        action="store_true",
        help="with --http: allow a non-loopback HOST and Host header (no TLS: put a proxy "
        "in front)",
    )
    serve.add_argument("--workspace", help="the directory the tools work in")
    serve.add_argument(
        "--session", help="the session every call is recorded in (default: a new one per run)"
    )
    serve.add_argument(
        "--project",
        default=DEFAULT_PROJECT,
        help=f"the project that session belongs to (default: {DEFAULT_PROJECT})",
    )
    serve.set_defaults(func=cmd_serve)


def cmd_ls(args: argparse.Namespace) -> int:
    from ._mcp_ls import run

    return run(args)


def cmd_trust(args: argparse.Namespace) -> int:
    from ._mcp_ls import trust

    return trust(args)


def cmd_untrust(args: argparse.Namespace) -> int:
    from ._mcp_ls import untrust

    return untrust(args)


def cmd_serve(args: argparse.Namespace) -> int:
    from ._mcp_serve import run

    return run(args)


__all__ = ["add_commands", "cmd_ls", "cmd_serve", "cmd_trust", "cmd_untrust"]
