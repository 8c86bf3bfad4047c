"""The kernel over a WebSocket: ``serve_websocket(kernel, ...)`` (DESIGN §9, docs/protocol.md).

::

    async with open_kernel(model="scripted:demo", tools=tools) as k:
        async with trio.open_nursery() as nursery:
            url = await nursery.start(functools.partial(serve_websocket, k, port=0))
            # url == "ws://127.0.0.1:PORT/?token=..."; the page: page_url(url)

The accept loop and its budgets are ``kernel.wire._admission``; each TCP
connection's request head is read by ``kernel.wire._http``, which answers a
plain HTTP request itself (the browser page, docs/web.md); a WebSocket
handshake is checked by ``kernel.wire._handshake``; an
accepted WebSocket is run by ``kernel.wire._connection``, which answers each
request with its handler from ``kernel.wire._handlers``.

Before any of that, a connection must show the token: until it does, it holds
one of ``ServerLimits.max_unauthenticated`` places (the oldest is dropped to
make room) and has ``handshake_timeout`` seconds from TCP accept to show it;
only authenticated connections count against ``max_connections``.

A bug never takes the server down: an exception in a request gives an
``internal`` reply and closes that connection with 1011; one anywhere else in a
connection's code is logged and closes that connection with 1011.
"""

from __future__ import annotations

import itertools
import logging
import math
import resource
import secrets
from collections.abc import Sequence
from urllib.parse import quote

import trio
from trio_websocket import WebSocketConnection, wrap_server_stream

from ..errors import UsageError
from ..kernel import Kernel
from ._admission import (
    Admission,
    Slot,
    open_files_in_use,
    raise_open_files_limit,
    serve_listeners,
)
from ._connection import Connection
from ._handshake import Gate, host_url, is_loopback_address
from ._http import PageFiles, ReplayStream, answer_page_request, read_request_head
from ._limits import CLOSE_INTERNAL, ServerLimits

logger = logging.getLogger("tak.server")

_DEFAULT_LIMITS = ServerLimits()


async def serve_websocket(
    kernel: Kernel,
    host: str = "127.0.0.1",
    port: int = 8765,
    *,
    token: str | None = None,
    allow_origins: Sequence[str] = (),
    allow_remote: bool = False,
    limits: ServerLimits = _DEFAULT_LIMITS,
    task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve ``kernel`` over WebSocket until cancelled.

    ``task_status.started(url)`` gives ``ws://HOST:PORT/?token=TOKEN`` with the
    port actually bound (``port=0`` picks a free one). The same port serves the
    browser page at ``http://HOST:PORT/?token=TOKEN`` (``page_url(url)``).

    Args:
        token: what clients must present (default: ``secrets.token_urlsafe(32)``,
            given back in the URL).
        allow_origins: browser origins allowed besides the server's own, e.g.
            ``"http://localhost:3000"``.
        allow_remote: allow binding a non-loopback address and ``Host`` headers
            that are not loopback names. The token is then all that guards the
            kernel, in clear text: put TLS in front.

    The process's soft open-file limit is raised to its hard limit (logged), and
    connections are kept below it (see ``kernel.wire._admission``).

    Raises:
        UsageError: ``host`` is not a loopback address and ``allow_remote`` is
            false, or the token is empty.
        OSError: the address cannot be bound.
    """
    if token is None:
        token = secrets.token_urlsafe(32)
    if not token:
        raise UsageError("the server token must not be empty")
    if not allow_remote and not await is_loopback_address(host):
        raise UsageError(
            f"refusing to bind {host!r}: not a loopback address (pass allow_remote / "
            "--allow-remote to serve other machines, and put TLS in front)"
        )
    listeners = await trio.open_tcp_listeners(port, host=host)
    if port == 0 and len(listeners) > 1:
        # "localhost" may bind ::1 and 127.0.0.1 on two different free ports: keep one.
        for extra in listeners[1:]:
            await extra.aclose()
        listeners = listeners[:1]
    bound_port = listeners[0].socket.getsockname()[1]
    gate = Gate(
        token=token,
        allow_origins=allow_origins,
        allow_remote=allow_remote,
        limits=limits,
        admission=await _open_admission(limits),
    )
    pages = await trio.to_thread.run_sync(PageFiles.load)
    if not pages.files:
        logger.warning("the page's files (kernel/web/) are not installed: no browser page")
    server = _Server(kernel, gate, pages)
    url_host = f"[{host}]" if ":" in host else host
    url = f"{host_url('ws', host, bound_port)}/?token={quote(token, safe='')}"
    async with trio.open_nursery() as nursery:
        await nursery.start(serve_listeners, listeners, gate.admission, server.handle)
        logger.info(
            "serving %s on ws://%s:%d/ and its page on http://%s:%d/ (model %s, %d tools)",
            "the kernel",
            url_host,
            bound_port,
            url_host,
            bound_port,
            kernel.model.name,
            len(kernel.tools),
        )
        if allow_remote:
            logger.warning(
                "remote clients allowed: anyone who can reach this port and has the token "
                "can run tools; the connection is not encrypted"
            )
        task_status.started(url)


def page_url(url: str) -> str:
    """The browser page's URL of the server whose WebSocket URL is ``url`` (same token)."""
    return "http://" + url.removeprefix("ws://")


async def _open_admission(limits: ServerLimits) -> Admission:
    """The connection budgets, under this process's open-file limit (raised first)."""
    before, soft = raise_open_files_limit()
    if soft != before:
        logger.info("raised the open-file limit (soft RLIMIT_NOFILE) from %d to %d", before, soft)
    in_use = await trio.to_thread.run_sync(open_files_in_use)
    budget: float = math.inf
    if soft != resource.RLIM_INFINITY:
        budget = max(1, soft - (in_use or 0) - limits.fd_reserve)
        wanted = limits.max_connections + limits.max_unauthenticated
        if budget < wanted:
            logger.warning(
                "the open-file limit (%d, %d in use) leaves room for %d connections, "
                "fewer than max_connections + max_unauthenticated = %d",
                soft,
                in_use or 0,
                budget,
                wanted,
            )
    return Admission(
        max_unauthenticated=limits.max_unauthenticated,
        max_connections=limits.max_connections,
        handshake_timeout=limits.handshake_timeout,
        open_files_budget=budget,
    )


class _Server:
    """Runs each TCP connection: a page request, or a handshake then a ``Connection``."""

    def __init__(self, kernel: Kernel, gate: Gate, pages: PageFiles) -> None:
        self.kernel = kernel
        self.gate = gate
        self.pages = pages
        self.limits = gate.limits
        self._numbers = itertools.count(1)

    async def handle(self, stream: trio.SocketStream, slot: Slot) -> None:
        """One TCP connection, run inside ``slot.scope`` (its deadline, or its drop).

        Never raises but ``Cancelled``, or the whole server would stop.
        """
        label = f"#{next(self._numbers)} {_peer(stream)}"
        ws: WebSocketConnection | None = None
        try:
            head = await read_request_head(stream, label)
            if head is None or not head.is_websocket:
                if head is not None:
                    await answer_page_request(stream, head, self.gate, self.pages, label)
                return  # the caller closes the stream
            async with trio.open_nursery() as nursery:  # trio-websocket's reader task
                request = await wrap_server_stream(
                    nursery,
                    ReplayStream(stream, head.received),
                    max_message_size=self.limits.frame_buffer_limit,
                    receive_buffer_size=1 << 16,
                )
                ws = await self.gate.accept(request, label, slot)
                if ws is not None:
                    logger.info("%s connected", label)
                    await Connection(self.kernel, self.gate, ws, label, slot).serve()
                    with trio.move_on_after(self.limits.close_grace):
                        await ws.aclose()
                nursery.cancel_scope.cancel()
        except Exception:
            logger.exception("%s: internal error; closing the connection", label)
            if ws is not None:
                await self._close_after_bug(ws)
        except BaseExceptionGroup as group:
            errors, rest = group.split(Exception)
            if errors is not None:
                logger.error("%s: internal error; closing the connection", label, exc_info=errors)
                if ws is not None:
                    await self._close_after_bug(ws)
            if rest is not None:
                raise rest from None

    async def _close_after_bug(self, ws: WebSocketConnection) -> None:
        with trio.move_on_after(self.limits.close_grace):
            await ws.aclose(CLOSE_INTERNAL, "internal error")
        await trio.aclose_forcefully(ws)


def _peer(stream: trio.SocketStream) -> str:
    try:
        address = stream.socket.getpeername()
    except OSError:
        return "(gone)"
    host, port = address[0], address[1]
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
