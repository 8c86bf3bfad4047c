"""``tak serve`` (the kernel over WebSocket, ``kernel.wire``) and ``tak repl URL`` (its client)."""

from __future__ import annotations

import argparse
import functools
import os
import signal
import sys
from pathlib import Path

from ..terminal import escape_terminal
from . import DEFAULT_PROJECT
from ._exit import BAD_INPUT, FAILED, OK, one_line_errors, os_error_line, report, single_leaf

DEFAULT_PORT = 8765


def add_commands(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "serve",
        help="serve the kernel over WebSocket, and a page for the browser",
        description="Serve the kernel over WebSocket, and a page for the browser on the same "
        "port. Prints two lines, ws://HOST:PORT/?token=TOKEN then the page's "
        "http://HOST:PORT/?token=TOKEN, then logs to stderr. See docs/protocol.md and "
        "docs/web.md.",
    )
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    p.add_argument(
        "--port", type=int, default=DEFAULT_PORT, help=f"port (default {DEFAULT_PORT}; 0: any)"
    )
    p.add_argument("--workspace", help="workspace directory for tools")
    p.add_argument(
        "--model", default="scripted:demo", help="provider:model (default scripted:demo)"
    )
    p.add_argument(
        "--token-file",
        type=Path,
        help="read the token from this file; a missing file is created with a new token "
        "(mode 0600). Default: a new token each start",
    )
    p.add_argument(
        "--allow-origin",
        action="append",
        default=[],
        metavar="ORIGIN",
        help="browser origin allowed to connect, e.g. http://localhost:3000 (repeatable)",
    )
    p.add_argument(
        "--allow-remote",
        action="store_true",
        help="allow a non-loopback --host and Host header (no TLS: put a proxy in front)",
    )
    p.set_defaults(func=cmd_serve)

    p = sub.add_parser(
        "repl",
        help="an interactive client of tak serve",
        description="Lines are prompts for agent turns; /help lists the commands. "
        "Ctrl-C cancels the running request; works with piped input.",
    )
    p.add_argument("url", help="the ws://HOST:PORT/?token=TOKEN line tak serve printed")
    p.add_argument("--session", help="session id (default: a new session)")
    p.add_argument("--project", default=DEFAULT_PROJECT, help="project the sessions belong to")
    p.set_defaults(func=cmd_repl)


def read_token(path: Path) -> str:
    """The token in ``path``; a missing file gets a new one, readable only by its owner.

    Raises:
        UsageError: the file is empty.
    """
    import secrets

    from ..errors import UsageError

    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        token = path.read_text().strip()
        if not token:
            raise UsageError(f"token file {str(path)!r} is empty") from None
        return token
    token = secrets.token_urlsafe(32)
    with os.fdopen(fd, "w") as f:
        f.write(token + "\n")
    return token


@one_line_errors("tak serve")
def cmd_serve(args: argparse.Namespace) -> int:
    import logging

    import trio

    from ..errors import KernelError
    from ..kernel import open_kernel
    from ..wire import serve_websocket
    from ..wire._handshake import refuse_remote_bind
    from ..wire._server import page_url
    from ._common import ensure_home

    if not 0 <= args.port <= 65535:
        print(f"tak serve: --port: expected 0 to 65535 (0: any), got {args.port}", file=sys.stderr)
        return BAD_INPUT
    trio.run(functools.partial(refuse_remote_bind, args.host, allow_remote=args.allow_remote))
    # Before serving: a home or token file the OS refuses is not a port problem.
    ensure_home(args.home)
    try:
        token = read_token(args.token_file) if args.token_file else None
    except OSError as exc:
        print(f"tak serve: --token-file: {escape_terminal(os_error_line(exc))}", file=sys.stderr)
        return FAILED
    from ._terminal_log import log_to_terminal

    log_to_terminal()

    async def main() -> None:
        async with open_kernel(
            home=args.home,
            workspace=args.workspace,
            model=args.model,
            extra_plugins=args.plugin,
        ) as k:
            async with trio.open_nursery() as nursery:
                url = await nursery.start(
                    lambda task_status: serve_websocket(
                        k,
                        args.host,
                        args.port,
                        token=token,
                        allow_origins=args.allow_origin,
                        allow_remote=args.allow_remote,
                        task_status=task_status,
                    )
                )
                # The WebSocket URL first and flushed: scripts read that line to connect.
                print(url, flush=True)
                print(page_url(url), flush=True)
                await _until_stopped()
                logging.getLogger("tak.server").info("stopping")
                nursery.cancel_scope.cancel()

    try:
        trio.run(main)
    except BaseException as exc:
        cause = single_leaf(exc)
        if isinstance(cause, KernelError):
            return report("tak serve", cause)
        if isinstance(cause, OSError):
            line = f"tak serve: cannot listen on {args.host}:{args.port}: {cause}"
            print(escape_terminal(line), file=sys.stderr)
            return FAILED
        raise
    return OK


async def _until_stopped() -> None:
    """Return on SIGINT or SIGTERM, so the server stops cleanly either way."""
    import trio

    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async for _ in signals:
            return


@one_line_errors("tak repl")
def cmd_repl(args: argparse.Namespace) -> int:
    from ..repl import main

    return main(args.url, session=args.session, project=args.project, home=args.home)


__all__ = [
    "DEFAULT_PORT",
    "add_commands",
    "cmd_repl",
    "cmd_serve",
    "read_token",
]
