"""One accepted WebSocket: its reader, writer, keep-alive, and its requests (DESIGN §9).

Per connection, three tasks and one nursery per request:

- the **reader** reads frames as fast as they come (so pings are answered and
  ``cancel`` is seen while requests run), answers ``hello`` and ``cancel`` at
  once, and starts every other request in its own nursery, under its own
  cancel scope, with its handler from ``kernel.wire._handlers.HANDLERS``;
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

A connection whose handshake carried no token must send ``hello`` with it
before ``Slot.token_deadline``; until then every other frame is refused.
"""

from __future__ import annotations

import logging
import math

import trio
from trio_websocket import ConnectionClosed, WebSocketConnection

from .._version import __version__
from ..errors import KernelError, UsageError
from ..executor import CallCanceller, cancelling_calls
from ..kernel import Kernel
from ._admission import Slot
from ._codec import decode_request, encode_numbered
from ._frames import (
    PROTOCOL_VERSION,
    Cancel,
    ErrorCode,
    ErrorFrame,
    ErrorInfo,
    Event,
    FrameError,
    Hello,
    Reply,
    Request,
    ServerFrame,
)
from ._handlers import HANDLERS, Emit
from ._handshake import Gate
from ._limits import CLOSE_INTERNAL, CLOSE_NORMAL, CLOSE_POLICY, CLOSE_TRY_AGAIN
from ._payloads import CancelResult, EventData, ServerInfo
from ._send import send_messages

logger = logging.getLogger("tak.server")

#: Queued frames sent in one write, up to about this many bytes.
_BATCH_BYTES = 1 << 16


class Connection:
    """One accepted WebSocket: reader, writer, keep-alive, and its requests."""

    def __init__(
        self, kernel: Kernel, gate: Gate, ws: WebSocketConnection, label: str, slot: Slot
    ) -> None:
        self._gate = gate
        self._kernel = kernel
        self._limits = gate.limits
        self._ws = ws
        self._label = label
        self._slot = slot
        # Bounded in bytes by _push (a burst of small events is no sign of a slow client).
        self._outbox_send, self._outbox_recv = trio.open_memory_channel[str](math.inf)
        self._queued_bytes = 0
        self._sending_since: float | None = None
        self._seq = 0
        self._inflight: dict[str, trio.CancelScope] = {}
        # What cancels one call of each running request (cancel with a call id).
        self._calls: dict[str, CallCanceller] = {}
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
        text = encode_numbered(frame, self._seq)
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
                    batch = [text]
                    size = len(text)
                    # What was queued meanwhile goes out in the same write: one send for
                    # the batch, and one wake-up of the client's reader instead of several.
                    while size < _BATCH_BYTES:
                        try:
                            text = self._outbox_recv.receive_nowait()
                        except (trio.WouldBlock, trio.EndOfChannel):
                            break
                        batch.append(text)
                        size += len(text)
                    self._sending_since = trio.current_time()
                    await send_messages(self._ws, batch)
                    self._sending_since = None
                    self._queued_bytes -= size
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
            # Before hello too: a hello (or a cancel) reusing a running request's id
            # would give that request's client a second reply.
            self._error(
                "duplicate_id",
                f"request {request.id!r} is still running; ids must be unique among "
                "running requests",
                re=request.id,
            )
        elif not self._authenticated or isinstance(request, Hello):
            self._hello(request)
        elif isinstance(request, Cancel):
            self._push(Reply.ok(request.id, CancelResult(found=self._cancel(request))))
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
            self._calls[request.id] = CallCanceller()
            assert self._work is not None
            self._work.start_soon(
                self._serve_request, request, scope, name=f"{self._label} {request.id}"
            )

    def _cancel(self, request: Cancel) -> bool:
        """Cancel the request ``target``, or one call of it; whether it was found running."""
        if request.call is not None:
            calls = self._calls.get(request.target)
            return calls is not None and calls.cancel(request.call)
        scope = self._inflight.get(request.target)
        if scope is not None:
            scope.cancel()
        return scope is not None

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
        if token is not None and not self._gate.token_matches(token):
            self._refuse(request.id, "wrong token")
        elif not self._authenticated and token is None:
            self._refuse(request.id, "authenticate first: send hello with the token")
        elif (verdict := self._gate.admission.authenticate(self._slot)) == "dropped":
            # Dropped for room after this hello was read: the connection is being
            # cut (its scope is cancelled), so this refusal is said, rarely sent.
            logger.info("%s: hello after the connection was dropped for room", self._label)
            self._error(
                "too_many_connections",
                "this connection was dropped before its hello was read: too many "
                "connections were waiting to show the token; connect again",
                re=request.id,
            )
            self._close(CLOSE_TRY_AGAIN, "dropped: too many unauthenticated connections")
        elif verdict == "full":
            logger.warning("%s refused: too many connections", self._label)
            self._error(
                "too_many_connections",
                f"{self._limits.max_connections} clients are connected, the most this "
                "server takes; try again later",
                re=request.id,
            )
            self._close(CLOSE_TRY_AGAIN, "too many connections")
        else:
            info = ServerInfo(
                server="tak",
                version=__version__,
                protocol=PROTOCOL_VERSION,
                model=self._kernel.model.name,
            )
            self._push(Reply.ok(request.id, info))

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
        """Run ``request`` under ``scope``; reply once it has returned.

        The handler's tasks live in nurseries it opens and closes itself, so when it
        returns nothing about the request is left to follow the reply.
        """
        reply: Reply | None = None
        try:
            with scope, cancelling_calls(self._calls[request.id]):
                reply = await self._answer(request)
        finally:
            del self._inflight[request.id]
            del self._calls[request.id]
            self._last_activity = trio.current_time()
            if reply is None:
                reply = Reply(re=request.id, status="cancelled")
            self._push(reply)
            if reply.error is not None and reply.error.code == "internal":
                self._close(CLOSE_INTERNAL, "internal error")

    async def _answer(self, request: Request) -> Reply:
        re = request.id
        try:
            # KeyError: hello and cancel are answered by the reader, never here.
            handler = HANDLERS[type(request)]
            result = await handler(self._kernel, request, self._emitter(re))
        except UsageError as exc:
            return _error_reply(re, "invalid_request", str(exc))
        except KernelError as exc:
            return _error_reply(re, "kernel_error", f"{type(exc).__name__}: {exc}")
        except Exception:
            logger.exception("%s: request %r (%s) failed", self._label, re, type(request).__name__)
            return _error_reply(re, "internal", "internal error; the server closes this connection")
        return Reply.ok(re, result)

    def _emitter(self, re: str) -> Emit:
        def emit(payload: EventData) -> None:
            self._push(Event.of(re, payload))

        return emit


def _error_reply(re: str, code: ErrorCode, message: str) -> Reply:
    return Reply(re=re, status="error", error=ErrorInfo(code=code, message=message))
