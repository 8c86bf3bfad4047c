"""``tak mcp serve``: the kernel's tools served over MCP (``kernel.mcp``), on stdio or
on streamable HTTP (``--http HOST:PORT``).

The command parses, opens the kernel, serves, and prints: on stdio nothing (fd 1 is
the wire; EOF on stdin, SIGINT or SIGTERM end it, exit status 0); on HTTP one line
on stdout, the URL with its token (new each start, or read from or created in
``--token-file``), then logs on stderr. Calls are recorded in one session
(``--session ID``, else a new one per run).
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import signal
import sys
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

import trio

from ..terminal import escape_terminal
from ._common import ensure_home
from ._exit import FAILED, OK, one_line_errors, os_error_line, report, single_leaf
from ._terminal_log import log_to_terminal
from .serve import read_token

if TYPE_CHECKING:
    from mcp.server import Server

logger = logging.getLogger("tak.mcp")


@one_line_errors("tak mcp serve")
def run(args: argparse.Namespace) -> int:
    import functools

    from ..errors import KernelError, UsageError
    from ..mcp import claim_stdio, serve_http, serve_stdio
    from ..wire._handshake import refuse_remote_bind

    if args.http is None and (args.token_file is not None or args.allow_remote):
        raise UsageError("--token-file and --allow-remote go with --http HOST:PORT")
    token: str | None = None
    host, port = "", 0
    if args.http is not None:
        host, port = parse_host_port(args.http)
        # Refused before anything starts or logs.
        trio.run(functools.partial(refuse_remote_bind, host, allow_remote=args.allow_remote))
    ensure_home(args.home)
    if args.http is not None:
        try:
            token = read_token(args.token_file) if args.token_file else None
        except OSError as exc:
            line = f"tak mcp serve: --token-file: {os_error_line(exc)}"
            print(escape_terminal(line), file=sys.stderr)
            return FAILED
        if token is None:
            import secrets

            token = secrets.token_urlsafe(32)
    log_to_terminal()

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_cancel_on_signal, nursery.cancel_scope)
            if token is None:
                # Claimed before the kernel starts anything, so no child inherits the wire.
                with claim_stdio() as (wire_in, wire_out):
                    async with _open_server(args) as server:
                        await serve_stdio(server, wire_in, wire_out)
                        logger.info("stdin closed: stopping")
            else:
                async with _open_server(args) as server:
                    serve = functools.partial(serve_http, allow_remote=args.allow_remote)
                    url = await nursery.start(serve, server, host, port, token)
                    # The one line on stdout, first and flushed: scripts read it.
                    print(url, flush=True)
                    await trio.sleep_forever()
            nursery.cancel_scope.cancel()

    try:
        trio.run(main)
    except BaseException as exc:
        cause = single_leaf(exc)
        if isinstance(cause, KernelError):
            return report("tak mcp serve", cause)
        if isinstance(cause, OSError) and token is not None:
            line = f"tak mcp serve: cannot listen on {host}:{port}: {cause}"
            print(escape_terminal(line), file=sys.stderr)
            return FAILED
        raise
    return OK


def parse_host_port(text: str) -> tuple[str, int]:
    """``HOST:PORT`` (``[::1]:PORT`` for IPv6) as a pair.

    Raises:
        UsageError: not of that form.
    """
    from ..errors import UsageError

    host, sep, port_text = text.rpartition(":")
    host = host.removeprefix("[").removesuffix("]")
    if not sep or not host or not port_text.isdigit() or int(port_text) > 65535:
        raise UsageError(f"--http: expected HOST:PORT, e.g. 127.0.0.1:8766, got {text!r}")
    return host, int(port_text)


async def _cancel_on_signal(scope: trio.CancelScope) -> None:
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async for signum in signals:
            logger.info("%s: stopping", signal.Signals(signum).name)
            scope.cancel()
            return


@contextlib.asynccontextmanager
async def _open_server(args: argparse.Namespace) -> AsyncIterator[Server[Any]]:
    from ..kernel import open_kernel
    from ..mcp import mcp_server

    async with open_kernel(
        home=args.home, workspace=args.workspace, extra_plugins=args.plugin
    ) as k:
        session = k.session(args.session, project=args.project)
        logger.info("serving %d tools; calls are recorded in session %s", len(k.tools), session.key)
        yield mcp_server(k, session)


__all__ = ["parse_host_port", "run"]
