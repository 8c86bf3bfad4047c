"""The kernel over a WebSocket: ``serve_websocket(kernel, ...)`` (DESIGN §9, docs/protocol.md).

::

    async with open_kernel(model="scripted:demo", tools=tools) as k:
        async with trio.open_nursery() as nursery:
            url = await nursery.start(functools.partial(serve_websocket, k, port=0))
            # url == "ws://127.0.0.1:PORT/?token=..."

Per connection, three tasks and one nursery per request:

- the **reader** reads frames as fast as they come (so pings are answered and
  ``cancel`` is seen while requests run) and starts each request in its own
  nursery, under its own cancel scope;
- a request's events and its one ``reply`` (sent when the request's nursery
  has closed, so nothing about it follows the reply) go into an **outbox**
  bounded in bytes; event callbacks are synchronous, so a client that does
  not read is disconnected (1008) rather than waited for: when the outbox
  passes ``outbox_bytes``, or when one frame takes over ``send_timeout``;
- the **writer** is the only task that sends messages: it empties the outbox,
  then sends the close frame; if the peer does not read even that within
  ``ServerLimits.close_grace``, the TCP connection is cut;
- a **keep-alive** task pings, and closes a connection that stops answering,
  stays idle, or whose writer is stuck.

Before any of that, a connection must show the token: until it does, it holds
one of ``ServerLimits.max_unauthenticated`` places (the oldest is dropped to
make room) and has ``handshake_timeout`` seconds from TCP accept to show it;
only authenticated connections count against ``max_connections``
(``kernel._admission`` has the budgets and the accept loop).

A bug never takes the server down: an exception in a request gives an
``internal`` reply and closes that connection with 1011; one anywhere else in a
connection's code is logged and closes that connection with 1011.
"""

from __future__ import annotations

import hmac
import ipaddress
import itertools
import logging
import math
import resource
import secrets
from collections.abc import Sequence
from typing import Any
from urllib.parse import parse_qs, quote, urlsplit

import attrs
import trio
from trio_websocket import (
    ConnectionClosed,
    WebSocketConnection,
    WebSocketRequest,
    wrap_server_stream,
)

from . import __version__
from ._admission import (
    Admission,
    Slot,
    open_files_in_use,
    raise_open_files_limit,
    serve_listeners,
)
from .agent import AgentEvent, AgentEventCallback, ModelDelta, TurnFinished
from .errors import KernelError, UsageError
from .executor import CallFinished, CallStarted
from .kernel import Kernel
from .messages import converter
from .protocol import (
    PROTOCOL_VERSION,
    CallTools,
    Cancel,
    ErrorCode,
    ErrorFrame,
    ErrorInfo,
    Event,
    FrameError,
    Hello,
    History,
    Reply,
    Request,
    Run,
    ServerFrame,
    Sessions,
    Tools,
    decode_request,
    encode,
)
from .tools import Tool

logger = logging.getLogger("tak.server")

# WebSocket close codes (RFC 6455 §7.4.1)
CLOSE_NORMAL = 1000
CLOSE_POLICY = 1008  # unauthorized, or a client too slow to read what it asked for
CLOSE_TOO_BIG = 1009  # sent by trio-websocket for a frame past ServerLimits.hard_frame_limit
CLOSE_INTERNAL = 1011  # a bug on our side, or a peer that stopped answering pings
CLOSE_TRY_AGAIN = 1013  # authenticated by hello, but max_connections clients are connected


def _positive(instance: object, attribute: attrs.Attribute[Any], value: Any) -> None:
    if value is not None and not value > 0:
        raise UsageError(f"ServerLimits.{attribute.name} must be positive, got {value!r}")


@attrs.frozen(kw_only=True)
class ServerLimits:
    """What one server and each of its connections may use.

    Attributes:
        max_frame_bytes: a client frame longer than this (UTF-8 bytes) gets a
            ``too_large`` error and is not read as a request; the connection stays.
        hard_frame_limit: a frame longer than this many characters is not even
            buffered: trio-websocket closes the connection with 1009 (default:
            twice ``max_frame_bytes``).
        max_inflight: requests one connection may have running (``cancel`` and
            ``hello`` are answered at once and do not count).
        max_connections: authenticated connections; the next one gets HTTP 503
            (token in the handshake) or ``too_many_connections`` and 1013 (token
            in ``hello``). Connections that have not shown the token do not count.
        max_unauthenticated: connections that have not shown the token yet (in
            the handshake or in ``hello``); a new one drops the oldest.
        fd_reserve: file descriptors left for everything but sockets (transcripts,
            workers): connections stop being accepted before the open-file limit
            is this close.
        outbox_bytes: bytes of frames a connection may have queued and not yet
            sent: past it the connection is closed with 1008, so a client that
            does not read costs bounded memory (a frame larger than this still
            goes out when nothing else is queued).
        send_timeout: seconds one frame may take to go out; a client that does not
            read for that long is closed with 1008.
        handshake_timeout: seconds from TCP accept until the token has been shown,
            in the HTTP handshake or in ``hello``; then the connection is closed.
        ping_interval: seconds between pings (``None``: no pings).
        ping_timeout: seconds a ping may wait for its pong before the connection is closed.
        idle_timeout: seconds without a frame from the client and with no request
            running before the connection is closed (``None``: never).
        close_grace: seconds a closing connection has to take its last frames and
            the close frame before the TCP connection is cut.
    """

    max_frame_bytes: int = attrs.field(default=1 << 20, validator=_positive)
    hard_frame_limit: int | None = attrs.field(default=None, validator=_positive)
    max_inflight: int = attrs.field(default=16, validator=_positive)
    max_connections: int = attrs.field(default=64, validator=_positive)
    max_unauthenticated: int = attrs.field(default=16, validator=_positive)
    fd_reserve: int = attrs.field(default=64, validator=_positive)
    outbox_bytes: int = attrs.field(default=64 << 20, validator=_positive)
    send_timeout: float = attrs.field(default=20.0, validator=_positive)
    handshake_timeout: float = attrs.field(default=5.0, validator=_positive)
    ping_interval: float | None = attrs.field(default=20.0, validator=_positive)
    ping_timeout: float = attrs.field(default=20.0, validator=_positive)
    idle_timeout: float | None = attrs.field(default=3600.0, validator=_positive)
    close_grace: float = attrs.field(default=5.0, validator=_positive)

    def __attrs_post_init__(self) -> None:
        if self.hard_frame_limit is not None and self.hard_frame_limit < self.max_frame_bytes:
            raise UsageError("ServerLimits.hard_frame_limit must be at least max_frame_bytes")

    @property
    def frame_buffer_limit(self) -> int:
        """The ``max_message_size`` given to trio-websocket (characters)."""
        return self.hard_frame_limit or 2 * self.max_frame_bytes


async def serve_websocket(
    kernel: Kernel,
    host: str = "127.0.0.1",
    port: int = 8765,
    *,
    token: str | None = None,
    allow_origins: Sequence[str] = (),
    allow_remote: bool = False,
    limits: ServerLimits = ServerLimits(),
    task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve ``kernel`` over WebSocket until cancelled.

    ``task_status.started(url)`` gives ``ws://HOST:PORT/?token=TOKEN`` with the
    port actually bound (``port=0`` picks a free one).

    Args:
        token: what clients must present (default: ``secrets.token_urlsafe(32)``,
            given back in the URL).
        allow_origins: browser origins allowed besides the server's own, e.g.
            ``"http://localhost:3000"``.
        allow_remote: allow binding a non-loopback address and ``Host`` headers
            that are not loopback names. The token is then all that guards the
            kernel, in clear text: put TLS in front.

    The process's soft open-file limit is raised to its hard limit (logged), and
    connections are kept below it (see ``kernel._admission``).

    Raises:
        UsageError: ``host`` is not a loopback address and ``allow_remote`` is
            false, or the token is empty.
        OSError: the address cannot be bound.
    """
    if token is None:
        token = secrets.token_urlsafe(32)
    if not token:
        raise UsageError("the server token must not be empty")
    if not allow_remote and not await _is_loopback_address(host):
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
    server = _Server(
        kernel,
        token=token,
        allow_origins=allow_origins,
        allow_remote=allow_remote,
        limits=limits,
        port=bound_port,
        admission=await _open_admission(limits),
    )
    url_host = f"[{host}]" if ":" in host else host
    url = f"ws://{url_host}:{bound_port}/?token={quote(token, safe='')}"
    async with trio.open_nursery() as nursery:
        await nursery.start(serve_listeners, listeners, server.admission, server.handle)
        logger.info(
            "serving %s on ws://%s:%d/ (model %s, %d tools)",
            "the kernel",
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


async def _is_loopback_address(host: str) -> bool:
    """Whether binding ``host`` exposes the server only to this machine."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        pass
    try:
        infos = await trio.socket.getaddrinfo(host, None)
    except OSError:
        return False
    return bool(infos) and all(
        ipaddress.ip_address(str(info[4][0]).split("%")[0]).is_loopback for info in infos
    )


def _is_loopback_name(hostname: str) -> bool:
    if hostname == "localhost" or hostname.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(hostname).is_loopback
    except ValueError:
        return False


def _host_and_port(netloc: str, default_port: int) -> tuple[str, int] | None:
    """``("host", port)`` of ``host[:port]``, lower-cased; ``None`` when it is not one."""
    if not netloc.startswith("[") and netloc.count(":") > 1:
        # An IPv6 address without brackets, as trio-websocket's client writes "::1:8765".
        address, _, port_text = netloc.rpartition(":")
        try:
            return str(ipaddress.IPv6Address(address)), int(port_text)
        except ValueError:
            return None
    try:
        parts = urlsplit(f"//{netloc}")
        port = parts.port
    except ValueError:
        return None
    if not parts.hostname:
        return None
    return parts.hostname.lower(), port if port is not None else default_port


def _request_host(request: WebSocketRequest) -> str | None:
    """The handshake's ``Host`` header.

    wsproto takes ``Host`` out of the headers trio-websocket shows
    (``request.headers``) and keeps it on the request event only; without it
    we cannot tell DNS rebinding from a local client, so the caller refuses.
    """
    event = getattr(request, "_event", None)
    host = getattr(event, "host", None)
    return host if isinstance(host, str) else None


class _Server:
    """Checks handshakes and runs a ``_Connection`` for each accepted one."""

    def __init__(
        self,
        kernel: Kernel,
        *,
        token: str,
        allow_origins: Sequence[str],
        allow_remote: bool,
        limits: ServerLimits,
        port: int,
        admission: Admission,
    ) -> None:
        self.kernel = kernel
        self.limits = limits
        self.admission = admission
        self._token = token.encode()
        self._allow_origins = {o.rstrip("/").lower() for o in allow_origins}
        self._allow_remote = allow_remote
        self._port = port
        self._numbers = itertools.count(1)

    def token_matches(self, candidate: str) -> bool:
        return hmac.compare_digest(candidate.encode("utf-8", "surrogatepass"), self._token)

    async def handle(self, stream: trio.SocketStream, slot: Slot) -> None:
        """One TCP connection, run inside ``slot.scope`` (its deadline, or its drop).

        Never raises but ``Cancelled``, or the whole server would stop.
        """
        label = f"#{next(self._numbers)} {_peer(stream)}"
        ws: WebSocketConnection | None = None
        try:
            async with trio.open_nursery() as nursery:  # trio-websocket's reader task
                request = await wrap_server_stream(
                    nursery,
                    stream,
                    max_message_size=self.limits.frame_buffer_limit,
                    receive_buffer_size=1 << 16,
                )
                ws = await self._accept(request, label, slot)
                if ws is not None:
                    logger.info("%s connected", label)
                    await _Connection(self, ws, label, slot).serve()
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

    async def _accept(
        self, request: WebSocketRequest, label: str, slot: Slot
    ) -> WebSocketConnection | None:
        """Accept the handshake, or refuse it with an HTTP status before any frame.

        A handshake with the right token authenticates ``slot``; one without
        gets until the token deadline to send ``hello``, plus ``close_grace`` to
        take the refusal.
        """
        host = _request_host(request)
        host_port = _host_and_port(host, 80) if host is not None else None
        if host_port is None:
            await self._reject(request, label, 400, "missing or malformed Host header")
            return None
        if not self._allow_remote and not _is_loopback_name(host_port[0]):
            # DNS rebinding: a page on evil.example resolving to 127.0.0.1 sends Host: evil.example
            await self._reject(request, label, 403, "Host is not a loopback name")
            return None
        headers: dict[bytes, bytes] = {name.lower(): value for name, value in request.headers}
        origin = headers.get(b"origin")
        if origin is not None and not self._origin_allowed(origin.decode("latin-1"), host_port):
            await self._reject(request, label, 403, "Origin not allowed")
            return None
        offered = parse_qs(urlsplit(request.path).query).get("token", [])
        authorization = headers.get(b"authorization", b"").decode("latin-1")
        scheme, _, credentials = authorization.partition(" ")
        if scheme.lower() == "bearer":
            offered.append(credentials.strip())
        if not all(self.token_matches(t) for t in offered):
            await self._reject(request, label, 401, "wrong token")
            return None
        if not offered:
            slot.scope.deadline = slot.token_deadline + self.limits.close_grace
        elif not self.admission.authenticate(slot):
            await self._reject(request, label, 503, "too many connections")
            return None
        return await request.accept()

    def _origin_allowed(self, origin: str, host_port: tuple[str, int]) -> bool:
        if origin.rstrip("/").lower() in self._allow_origins:
            return True
        # The server's own origin: the page was served from the host:port the client dialled.
        parts = urlsplit(origin)
        default = {"http": 80, "https": 443}.get(parts.scheme.lower())
        if default is None:
            return False
        return _host_and_port(parts.netloc, default) == host_port

    async def _reject(self, request: WebSocketRequest, label: str, status: int, why: str) -> None:
        logger.warning("%s refused (HTTP %d): %s", label, status, why)
        await request.reject(status, body=f"{why}\n".encode())


def _peer(stream: trio.SocketStream) -> str:
    try:
        address = stream.socket.getpeername()
    except OSError:
        return "(gone)"
    host, port = address[0], address[1]
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


class _Connection:
    """One accepted WebSocket: reader, writer, keep-alive, and its requests."""

    def __init__(self, server: _Server, ws: WebSocketConnection, label: str, slot: Slot) -> None:
        self._server = server
        self._kernel = server.kernel
        self._limits = server.limits
        self._ws = ws
        self._label = label
        self._slot = slot
        # Bounded in bytes by _push (a burst of small events is no sign of a slow client).
        self._outbox_send, self._outbox_recv = trio.open_memory_channel[str](math.inf)
        self._queued_bytes = 0
        self._sending_since: float | None = None
        self._seq = 0
        self._inflight: dict[str, trio.CancelScope] = {}
        self._work: trio.Nursery | None = None
        self._writer_scope = trio.CancelScope()
        self._close_code: int | None = None
        self._close_reason = ""
        self._discard = False
        self._last_activity = trio.current_time()

    @property
    def _authenticated(self) -> bool:
        return self._slot.authenticated

    async def serve(self) -> None:
        async with trio.open_nursery() as outer:
            outer.start_soon(self._write_frames, name=f"{self._label} writer")
            try:
                async with trio.open_nursery() as work:
                    self._work = work
                    work.start_soon(self._read_frames, name=f"{self._label} reader")
                    work.start_soon(self._keep_alive, name=f"{self._label} keep-alive")
                    if not self._authenticated:
                        work.start_soon(self._require_hello)
            except Exception:
                logger.exception("%s: internal error; closing the connection", self._label)
                self._close(CLOSE_INTERNAL, "internal error")
            finally:
                # The writer sends what is queued (unless discarding), then the close frame.
                self._outbox_send.close()
        logger.info(
            "%s closed (%s %s)", self._label, self._close_code or CLOSE_NORMAL, self._close_reason
        )

    def _close(self, code: int, reason: str, *, discard: bool = False) -> None:
        """Start closing: stop reading and cancel requests; the writer finishes the job."""
        if self._close_code is not None:
            return
        self._close_code, self._close_reason = code, reason
        self._discard = discard
        self._writer_scope.deadline = min(
            self._writer_scope.deadline, trio.current_time() + self._limits.close_grace
        )
        if self._work is not None:
            self._work.cancel_scope.cancel()

    # --- writing ---------------------------------------------------------------

    def _push(self, frame: ServerFrame) -> None:
        """Queue a frame without blocking: event callbacks are synchronous."""
        if self._discard:
            return
        self._seq += 1
        text = encode(attrs.evolve(frame, seq=self._seq))
        # Frames are ASCII (encode escapes the rest): characters are bytes.
        if self._queued_bytes and self._queued_bytes + len(text) > self._limits.outbox_bytes:
            logger.warning(
                "%s is not reading (%d bytes queued): disconnecting",
                self._label,
                self._queued_bytes,
            )
            self._close(CLOSE_POLICY, "client too slow: outbox full", discard=True)
            return
        try:
            self._outbox_send.send_nowait(text)
        except (trio.ClosedResourceError, trio.BrokenResourceError):
            return  # closing: what would follow the close frame is dropped
        self._queued_bytes += len(text)

    async def _write_frames(self) -> None:
        with self._writer_scope:
            try:
                async for text in self._outbox_recv:
                    if self._discard:
                        break
                    self._sending_since = trio.current_time()
                    await self._ws.send_message(text)
                    self._sending_since = None
                    self._queued_bytes -= len(text)
                await self._ws.aclose(self._close_code or CLOSE_NORMAL, self._close_reason)
            except ConnectionClosed:
                self._close(CLOSE_NORMAL, "closed by the client")
            finally:
                self._outbox_recv.close()  # later frames are dropped, not kept
        if self._writer_scope.cancelled_caught:
            # The peer took neither its frames nor the close frame in time: the
            # stream may hold half a frame, so nothing more can be sent on it.
            logger.warning("%s: close grace ran out; cutting the connection", self._label)
            await trio.aclose_forcefully(self._ws)

    # --- reading ---------------------------------------------------------------

    async def _read_frames(self) -> None:
        while True:
            try:
                message = await self._ws.get_message()
            except ConnectionClosed as exc:
                reason = exc.reason
                code = reason.code if reason is not None else CLOSE_NORMAL
                why = (reason.reason or reason.name) if reason is not None else "closed"
                self._close(code, f"closed: {why}")
                return
            self._last_activity = trio.current_time()
            self._on_frame(message)

    def _on_frame(self, message: str | bytes) -> None:
        try:
            request = self._check_frame(message)
        except FrameError as exc:
            if not self._authenticated:
                self._refuse(exc.re, "authenticate first: send hello with the token")
            else:
                self._push(ErrorFrame(error=exc.info(), re=exc.re))
            return
        if self._authenticated and request.id in self._inflight:
            # Checked before hello too: a reused id would give the running request
            # a second reply.
            self._error(
                "duplicate_id",
                f"request {request.id!r} is still running; ids must be unique among "
                "running requests",
                re=request.id,
            )
        elif not self._authenticated or isinstance(request, Hello):
            self._hello(request)
        elif request.id in self._inflight:
            self._error(
                "duplicate_id",
                f"request {request.id!r} is still running; ids must be unique among "
                "running requests",
                re=request.id,
            )
        elif isinstance(request, Cancel):
            scope = self._inflight.get(request.target)
            if scope is not None:
                scope.cancel()
            self._push(Reply(re=request.id, status="ok", result={"found": scope is not None}))
        elif len(self._inflight) >= self._limits.max_inflight:
            self._error(
                "too_many_inflight",
                f"{len(self._inflight)} requests are running, the most this connection "
                "may have; wait for a reply",
                re=request.id,
            )
        else:
            # Registered before the task starts, so the next frame sees it (duplicates, cancel).
            scope = self._inflight[request.id] = trio.CancelScope()
            assert self._work is not None
            self._work.start_soon(
                self._serve_request, request, scope, name=f"{self._label} {request.id}"
            )

    def _check_frame(self, message: str | bytes) -> Request:
        if isinstance(message, bytes):
            raise FrameError("bad_json", "binary frame: send each request as a JSON text frame")
        limit = self._limits.max_frame_bytes
        # A character is 1 to 4 bytes in UTF-8: encode only when the length is in doubt.
        if len(message) > limit or (
            len(message) * 4 > limit and len(message.encode("utf-8", "surrogatepass")) > limit
        ):
            raise FrameError("too_large", f"frame over {limit} bytes; not read")
        return decode_request(message)

    def _hello(self, request: Request) -> None:
        """Answer ``hello``; before authentication, every other frame is refused."""
        token = request.token if isinstance(request, Hello) else None
        if token is not None and not self._server.token_matches(token):
            self._refuse(request.id, "wrong token")
        elif not self._authenticated and token is None:
            self._refuse(request.id, "authenticate first: send hello with the token")
        elif not self._server.admission.authenticate(self._slot):
            logger.warning("%s refused: too many connections", self._label)
            self._error(
                "too_many_connections",
                f"{self._limits.max_connections} clients are connected, the most this "
                "server takes; try again later",
                re=request.id,
            )
            self._close(CLOSE_TRY_AGAIN, "too many connections")
        else:
            self._push(
                Reply(
                    re=request.id,
                    status="ok",
                    result={
                        "server": "tak",
                        "version": __version__,
                        "protocol": PROTOCOL_VERSION,
                        "model": self._kernel.model.name,
                    },
                )
            )

    def _refuse(self, re: str | None, why: str) -> None:
        logger.warning("%s unauthorized: %s", self._label, why)
        self._error("unauthorized", why, re=re)
        self._close(CLOSE_POLICY, "unauthorized")

    def _error(self, code: ErrorCode, message: str, *, re: str | None = None) -> None:
        self._push(ErrorFrame(error=ErrorInfo(code=code, message=message), re=re))

    async def _require_hello(self) -> None:
        await trio.sleep_until(self._slot.token_deadline)
        if not self._authenticated:
            self._refuse(
                None,
                f"no hello with the token within {self._limits.handshake_timeout:g} s "
                "of connecting",
            )

    async def _keep_alive(self) -> None:
        async with trio.open_nursery() as nursery:
            if self._limits.ping_interval is not None:
                nursery.start_soon(self._ping, self._limits.ping_interval)
            if self._limits.idle_timeout is not None:
                nursery.start_soon(self._close_when_idle, self._limits.idle_timeout)
            nursery.start_soon(self._watch_writer, self._limits.send_timeout)

    async def _watch_writer(self, send_timeout: float) -> None:
        """Close a connection whose writer is stuck: the client is not reading."""
        while True:
            since = self._sending_since
            if since is not None and trio.current_time() - since >= send_timeout:
                logger.warning(
                    "%s is not reading (one frame took over %g s): disconnecting",
                    self._label,
                    send_timeout,
                )
                self._close(CLOSE_POLICY, "client too slow: not reading", discard=True)
                return
            # Idle, look again soon; sending, look when this frame would be late.
            await trio.sleep_until(
                trio.current_time() + send_timeout / 4 if since is None else since + send_timeout
            )

    async def _ping(self, interval: float) -> None:
        while True:
            await trio.sleep(interval)
            with trio.move_on_after(self._limits.ping_timeout):
                try:
                    await self._ws.ping()
                except ConnectionClosed:
                    return
                continue
            self._close(CLOSE_INTERNAL, "keepalive ping timeout", discard=True)
            return

    async def _close_when_idle(self, idle_s: float) -> None:
        while True:
            await trio.sleep_until(self._last_activity + idle_s)
            if self._inflight:  # a long request is not idleness
                self._last_activity = trio.current_time()
            elif trio.current_time() >= self._last_activity + idle_s:
                self._close(CLOSE_NORMAL, f"idle for {idle_s:g} s")
                return

    # --- requests --------------------------------------------------------------

    async def _serve_request(self, request: Request, scope: trio.CancelScope) -> None:
        """Run ``request`` in its own nursery; reply once that nursery has closed."""
        outcome: list[Reply] = []
        try:
            with scope:
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(self._answer, request, outcome)
        finally:
            del self._inflight[request.id]
            self._last_activity = trio.current_time()
            reply = outcome[0] if outcome else Reply(re=request.id, status="cancelled")
            self._push(reply)
            if reply.error is not None and reply.error.code == "internal":
                self._close(CLOSE_INTERNAL, "internal error")

    async def _answer(self, request: Request, outcome: list[Reply]) -> None:
        re = request.id
        try:
            result = await self._dispatch(request)
        except UsageError as exc:
            outcome.append(_error_reply(re, "invalid_request", str(exc)))
        except KernelError as exc:
            outcome.append(_error_reply(re, "kernel_error", f"{type(exc).__name__}: {exc}"))
        except Exception:
            logger.exception("%s: request %r (%s) failed", self._label, re, type(request).__name__)
            outcome.append(
                _error_reply(re, "internal", "internal error; the server closes this connection")
            )
        else:
            outcome.append(Reply(re=re, status="ok", result=result))

    async def _dispatch(self, request: Request) -> dict[str, Any]:
        kernel = self._kernel
        if isinstance(request, CallTools):
            session = kernel.session(request.session, project=request.project)
            observations = await kernel.call_tools(
                session, list(request.calls), on_event=self._emitter(request.id)
            )
            return {"observations": [converter.unstructure(o) for o in observations]}
        if isinstance(request, Run):
            try:
                kernel.agent_for(request.model)
            except UsageError as exc:
                raise UsageError(f"$.model: {exc}") from None
            session = kernel.session(request.session, project=request.project)
            finished = await kernel.run_turn(
                session, request.prompt, on_event=self._emitter(request.id), model=request.model
            )
            return {"session": session.key.session_id, **_turn_fields(finished)}
        if isinstance(request, Sessions):
            summaries = await kernel.store.list_session_summaries(request.project)
            return {"sessions": [converter.unstructure(s) for s in summaries]}
        if isinstance(request, History):
            entries = await kernel.session(request.session, project=request.project).entries()
            if request.after is not None:
                after = next(
                    (i for i, e in enumerate(entries) if e.get("uuid") == request.after), None
                )
                if after is None:
                    raise UsageError(
                        f"$.after: session {request.session!r} has no entry {request.after!r}"
                    )
                entries = entries[after + 1 :]
            return {"entries": entries}
        if isinstance(request, Tools):
            return {"tools": [_tool_spec(t) for t in kernel.tools]}
        raise AssertionError(f"{type(request).__name__} is answered by the reader")

    def _emitter(self, re: str) -> AgentEventCallback:
        def emit(event: AgentEvent) -> None:
            kind, data = _event_fields(event)
            self._push(Event(re=re, kind=kind, data=data))

        return emit


def _error_reply(re: str, code: ErrorCode, message: str) -> Reply:
    return Reply(re=re, status="error", error=ErrorInfo(code=code, message=message))


def _turn_fields(finished: TurnFinished) -> dict[str, Any]:
    fields: dict[str, Any] = {
        "reason": finished.reason,
        "text": finished.text,
        "steps": finished.steps,
        "usage": converter.unstructure(finished.usage),
    }
    if finished.error is not None:
        fields["error"] = finished.error
    return fields


def _event_fields(event: AgentEvent) -> tuple[str, dict[str, Any]]:
    if isinstance(event, ModelDelta):
        return "model_delta", {"step": event.step, "text": event.text}
    if isinstance(event, CallStarted):
        return "call_started", {"index": event.index, "call": converter.unstructure(event.call)}
    if isinstance(event, CallFinished):
        return "call_finished", {
            "index": event.index,
            "observation": converter.unstructure(event.observation),
        }
    return "turn_finished", _turn_fields(event)


def _tool_spec(t: Tool) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "name": t.name,
        "description": t.description,
        "parameters": t.parameters,
    }
    if t.timeout is not None:
        spec["timeout"] = t.timeout
    if t.exclusive:
        spec["exclusive"] = True
    if t.max_output is not None:
        spec["max_output"] = t.max_output
    return spec


__all__ = ["ServerLimits", "serve_websocket"]
