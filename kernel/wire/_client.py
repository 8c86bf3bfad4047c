"""A Trio client of ``tak serve``: ``open_client(url)`` (docs/protocol.md, "The client").

::

    async with open_client("ws://127.0.0.1:8765/?token=...") as client:
        print(client.info.model)
        result = await client.call_tools("s1", [ToolCall("a", "add", {"a": 2, "b": 40})])
        async with client.request(Run(id=client.new_id(), session="s1", prompt="hi")) as run:
            async for event in run.events():
                if isinstance(event, ModelDeltaEvent):
                    print(event.text, end="")
            reply = await run.reply()

One task (owned by ``open_client``) reads every frame and routes it by ``re``
to the request it is about, so requests may run concurrently on one
connection and ``cancel`` can be sent while one runs. A frame is turned into
its record only when it is read: a caller that waits for a reply only does
not pay for the events it skips.
"""

from __future__ import annotations

import contextlib
import itertools
import math
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any, TypeVar

import trio
from trio_websocket import (
    ConnectionClosed,
    ConnectionRejected,
    HandshakeError,
    WebSocketConnection,
    open_websocket_url,
)

from .._version import __version__
from ..errors import ProtocolError
from ..messages import ToolCall
from ..settings import ModelSettings
from ._codec import encode, parse_server_frame, structure_server_frame
from ._frames import (
    DEFAULT_PROJECT,
    CallTools,
    Cancel,
    ErrorFrame,
    ErrorInfo,
    Event,
    Hello,
    History,
    Reply,
    Request,
    Run,
    ServerFrame,
    Sessions,
    Tools,
    settings_object,
)
from ._payloads import (
    CallToolsResult,
    CancelResult,
    EventData,
    HistoryResult,
    RunResult,
    ServerInfo,
    SessionsResult,
    ToolsResult,
)
from ._send import send_messages

#: Replies such as a long history are big; the server bounds what it sends, not us.
MAX_SERVER_FRAME = 256 << 20

_R = TypeVar("_R")


class HandshakeRefused(ProtocolError):
    """The server refused the WebSocket handshake with an HTTP status (401, 403, 503, ...)."""

    def __init__(self, status_code: int, body: bytes) -> None:
        self.status_code = status_code
        self.body = body.decode(errors="replace").strip()
        super().__init__(f"refused: HTTP {status_code} {self.body}")


class ConnectionLost(ProtocolError):
    """The connection ended before the request's reply came (``Client.closed`` says why)."""


class RequestFailed(ProtocolError):
    """A request's reply was ``error`` or ``cancelled``, or the server refused its frame.

    ``status`` is the reply's (``"refused"`` for an ``error`` frame); ``error``
    the server's code and message, ``None`` for a cancelled request.
    """

    def __init__(self, re: str, status: str, error: ErrorInfo | None) -> None:
        self.re = re
        self.status = status
        self.error = error
        why = f" ({error.code}): {error.message}" if error is not None else ""
        super().__init__(f"request {re!r}: {status}{why}")


class Exchange:
    """One request on the wire: its events as they come, then its reply."""

    def __init__(self, request: Request) -> None:
        self.request = request
        self._route, self._frames = trio.open_memory_channel[dict[str, Any]](math.inf)
        self._final: Reply | ErrorFrame | None = None
        # Once the caller waits for the reply only, events are dropped by the reader
        # instead of waking the caller for each one.
        self._skip_events = False

    async def events(self) -> AsyncIterator[EventData]:
        """The request's event payloads, until its reply (or the connection's end).

        Raises:
            ProtocolError: the server sent a frame that is not of this protocol.
        """
        async for value in self._frames:
            frame = structure_server_frame(value)
            if isinstance(frame, Event):
                yield frame.payload()
            else:
                self._final = frame
                return

    async def reply(self) -> Reply | ErrorFrame:
        """The request's ``reply``, or the ``error`` frame that refused it; events left
        unread are skipped.

        Raises:
            ConnectionLost: the connection ended first.
            ProtocolError: the server sent a frame that is not of this protocol.
        """
        if self._final is not None:
            return self._final
        self._skip_events = True
        async for value in self._frames:
            if value.get("type") != "event":
                frame = structure_server_frame(value)
                assert not isinstance(frame, Event)
                self._final = frame
                return frame
        raise ConnectionLost(f"the connection ended before the reply to {self.request.id!r}")


class Client:
    """Requests over one connection to ``tak serve``; made by ``open_client``.

    Attributes:
        info: what the server said in its reply to ``hello``.
        closed: why the connection ended (``"1000 idle for 60 s"``), ``None`` while open.
        on_unrouted: called with frames about no request this client waits for
            (the reply to a ``cancel`` sent with ``send``, an ``error`` without ``re``).
    """

    def __init__(self, ws: WebSocketConnection) -> None:
        self.info = ServerInfo(server="", version="", protocol=0, model="")
        self.closed: str | None = None
        self.on_unrouted: Callable[[ServerFrame], None] | None = None
        self._ws = ws
        self._routes: dict[str, Exchange] = {}
        self._ids = itertools.count(1)
        self._gone = trio.Event()

    def new_id(self, prefix: str = "r") -> str:
        """A request id not used before on this client."""
        return f"{prefix}{next(self._ids)}"

    async def wait_closed(self) -> None:
        """Return once the connection has ended (``closed`` says why)."""
        await self._gone.wait()

    async def send(self, request: Request) -> None:
        """Send ``request`` without waiting for anything about it.

        Raises:
            ConnectionLost: the connection is closed.
        """
        try:
            await send_messages(self._ws, [encode(request)])
        except ConnectionClosed as exc:
            self._lost(_reason(exc))
            raise ConnectionLost(f"connection closed: {self.closed}") from None

    @contextlib.asynccontextmanager
    async def request(self, request: Request) -> AsyncIterator[Exchange]:
        """Send ``request``; the ``Exchange`` gives its events, then its reply.

        Raises:
            ConnectionLost: the connection is closed.
        """
        exchange = self._routes[request.id] = Exchange(request)
        try:
            if self.closed is not None:
                exchange._route.close()
            else:
                await self.send(request)
            yield exchange
        finally:
            del self._routes[request.id]

    async def call(
        self, request: Request, result: type[_R], on_event: Callable[[EventData], None] | None
    ) -> _R:
        """Send ``request``, hand its events to ``on_event``; its result as a ``result``.

        Raises:
            RequestFailed: the reply was not ``ok``, or the frame was refused.
            ConnectionLost: the connection ended before the reply.
        """
        async with self.request(request) as exchange:
            if on_event is not None:
                async for event in exchange.events():
                    on_event(event)
            final = await exchange.reply()
        if isinstance(final, ErrorFrame):
            raise RequestFailed(request.id, "refused", final.error)
        if final.status != "ok":
            raise RequestFailed(request.id, final.status, final.error)
        return final.result_as(result)

    # --- one method per request type ---------------------------------------------------

    async def call_tools(
        self,
        session: str,
        calls: Sequence[ToolCall],
        *,
        project: str = DEFAULT_PROJECT,
        on_event: Callable[[EventData], None] | None = None,
    ) -> CallToolsResult:
        """Run ``calls`` as one batch in ``session`` (``call_tools``).

        Raises:
            RequestFailed: the server refused or failed the request.
            ConnectionLost: the connection ended before the reply.
        """
        request = CallTools(id=self.new_id(), session=session, calls=tuple(calls), project=project)
        return await self.call(request, CallToolsResult, on_event)

    async def run(
        self,
        session: str,
        prompt: str,
        *,
        model: str | None = None,
        settings: ModelSettings | None = None,
        tools: Sequence[str] | None = None,
        project: str = DEFAULT_PROJECT,
        on_event: Callable[[EventData], None] | None = None,
    ) -> RunResult:
        """One agent turn on ``session`` (``run``); ``settings`` are merged over the
        server's for this turn, ``tools`` (names or patterns) selects the tools offered.

        Raises:
            RequestFailed: the server refused, failed or cancelled the request.
            ConnectionLost: the connection ended before the reply.
        """
        request = Run(
            id=self.new_id(),
            session=session,
            prompt=prompt,
            model=model,
            settings=None if settings is None else settings_object(settings),
            tools=None if tools is None else tuple(tools),
            project=project,
        )
        return await self.call(request, RunResult, on_event)

    async def cancel(self, target: str, *, call: str | None = None) -> bool:
        """Cancel the running request ``target``, or only its call ``call``; whether it was
        running.

        Raises:
            RequestFailed: the server refused the request.
            ConnectionLost: the connection ended before the reply.
        """
        result = await self.call(
            Cancel(id=self.new_id("cancel"), target=target, call=call), CancelResult, None
        )
        return result.found

    async def sessions(self, *, project: str = DEFAULT_PROJECT) -> SessionsResult:
        """The summaries of ``project``'s sessions (``sessions``).

        Raises:
            RequestFailed: the server refused or failed the request.
            ConnectionLost: the connection ended before the reply.
        """
        return await self.call(Sessions(id=self.new_id(), project=project), SessionsResult, None)

    async def history(
        self, session: str, *, after: str | None = None, project: str = DEFAULT_PROJECT
    ) -> HistoryResult:
        """``session``'s transcript entries, those after entry ``after`` if given.

        Raises:
            RequestFailed: the server refused or failed the request.
            ConnectionLost: the connection ended before the reply.
        """
        request = History(id=self.new_id(), session=session, after=after, project=project)
        return await self.call(request, HistoryResult, None)

    async def tools(self) -> ToolsResult:
        """The server's tools (``tools``).

        Raises:
            RequestFailed: the server refused or failed the request.
            ConnectionLost: the connection ended before the reply.
        """
        return await self.call(Tools(id=self.new_id()), ToolsResult, None)

    # --- the reader ----------------------------------------------------------------------

    async def _hello(self, token: str | None, name: str) -> ServerInfo:
        """Say ``hello`` before the reader starts (nothing else is in flight yet).

        Raises:
            RequestFailed: the server refused it.
            ConnectionLost: the server closed the connection first.
            ProtocolError: the server broke the protocol.
        """
        hello = Hello(id=self.new_id("hello"), token=token, client=name)
        await self.send(hello)
        try:
            while True:
                value = parse_server_frame(await self._ws.get_message())
                if value.get("re") == hello.id and value.get("type") != "event":
                    break
        except ConnectionClosed as exc:
            self._lost(_reason(exc))
            raise ConnectionLost(f"connection closed: {self.closed}") from None
        final = structure_server_frame(value)
        assert not isinstance(final, Event)
        if isinstance(final, ErrorFrame):
            raise RequestFailed(hello.id, "refused", final.error)
        if final.status != "ok":
            raise RequestFailed(hello.id, final.status, final.error)
        return final.result_as(ServerInfo)

    async def _read_frames(self) -> None:
        """Route frames until the connection closes, then end every open request."""
        try:
            while True:
                value = parse_server_frame(await self._ws.get_message())
                re = value.get("re")
                exchange = self._routes.get(re) if isinstance(re, str) else None
                if exchange is not None:
                    if not (exchange._skip_events and value.get("type") == "event"):
                        exchange._route.send_nowait(value)
                elif self.on_unrouted is not None:
                    self.on_unrouted(structure_server_frame(value))
        except ConnectionClosed as exc:
            self._lost(_reason(exc))
        except ProtocolError as exc:
            self._lost(f"the server broke the protocol: {exc}")
        finally:
            self._lost("closed")

    def _lost(self, why: str) -> None:
        if self.closed is None:
            self.closed = why
        for exchange in self._routes.values():
            exchange._route.close()
        self._gone.set()


def _reason(exc: ConnectionClosed) -> str:
    reason = exc.reason
    return f"{reason.code} {reason.reason or reason.name}" if reason is not None else "closed"


@contextlib.asynccontextmanager
async def open_client(
    url: str,
    *,
    token: str | None = None,
    name: str = f"tak-client/{__version__}",
    max_frame_bytes: int = MAX_SERVER_FRAME,
) -> AsyncIterator[Client]:
    """Connect to ``tak serve`` at ``url`` and say ``hello``; close on exit.

    The token is the one in the URL (``?token=``, checked in the handshake) or
    ``token`` (sent in ``hello``).

    Raises:
        HandshakeRefused: the server refused the handshake (wrong token, Host, Origin, full).
        RequestFailed: the server refused ``hello`` (``unauthorized``, ``too_many_connections``).
        ProtocolError: the handshake failed otherwise, or the server broke the protocol.
        OSError: the server cannot be reached.
    """
    try:
        async with open_websocket_url(url, max_message_size=max_frame_bytes) as ws:
            client = Client(ws)
            client.info = await client._hello(token, name)
            try:
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(client._read_frames)
                    yield client
                    nursery.cancel_scope.cancel()
            except BaseExceptionGroup as group:
                # The reader raises nothing: a group holds the caller's own exception,
                # which the caller should see as it raised it.
                if len(group.exceptions) == 1:
                    raise group.exceptions[0] from None
                raise
    except ConnectionRejected as exc:
        raise HandshakeRefused(exc.status_code, exc.body or b"") from None
    except HandshakeError as exc:
        raise ProtocolError(f"the WebSocket handshake failed: {exc}") from None
