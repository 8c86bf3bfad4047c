"""Plain HTTP on the WebSocket's port: the browser page (docs/web.md).

Each TCP connection's request head is read here first (``read_request_head``),
within the connection's handshake deadline. A WebSocket upgrade goes on to
trio-websocket with the bytes already read put back in front
(``ReplayStream``); any other request is answered here and the connection
closed: ``GET /?token=TOKEN`` gives the page, ``GET /NAME.js`` and
``GET /NAME.css`` its files (package data in ``kernel/web/``), anything else
404.

The same checks as the WebSocket handshake (``Gate.check_host_and_origin``,
``origin_form``): a loopback ``Host`` unless remote clients are allowed, the
server's own ``Origin`` or an allowed one when a browser sends one, an
origin-form target (``/path?query``). ``/`` also needs the
token, compared as the handshake does (``Gate.token_matches``); without it the
page is not served (401). The page's scripts and style sheet are the
package's public code, the same for every server, and are served without it:
a module script cannot carry the page's query string to what it imports, and
the token must not go into a cookie.

Every response, a refusal of a head h11 could not read too, has the same
security headers (``security_headers``): a Content Security Policy with no
inline script, and ``Referrer-Policy: no-referrer`` so that the URL with the
token is never sent elsewhere; the token is never logged (a request's target
is not either).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from http import HTTPStatus
from importlib import resources
from urllib.parse import parse_qs

import attrs
import h11
import trio

from ._handshake import Gate, Refused, origin_form, security_headers

logger = logging.getLogger("tak.server")

#: The largest request head read before it is refused (h11's own default).
MAX_HEAD_BYTES = 16 * 1024

_CONTENT_TYPES: Mapping[str, str] = {
    ".html": "text/html; charset=utf-8",
    ".js": "text/javascript; charset=utf-8",
    ".css": "text/css; charset=utf-8",
}
#: How long a refused request's peer may go on sending before the connection is closed.
_LINGER_S = 1.0


@attrs.frozen
class RequestHead:
    """A request's head as read off the socket, and the parser that read it."""

    request: h11.Request
    parser: h11.Connection
    #: Every byte received so far: the head and whatever followed it.
    received: bytes

    def header(self, name: bytes) -> bytes | None:
        """The first header called ``name`` (lower case)."""
        values = self.headers(name)
        return values[0] if values else None

    def headers(self, name: bytes) -> list[bytes]:
        """Every header called ``name`` (lower case), in order."""
        return [bytes(value) for key, value in self.request.headers if key == name]

    @property
    def is_websocket(self) -> bool:
        upgrade = self.header(b"upgrade")
        return upgrade is not None and b"websocket" in upgrade.lower()


async def read_request_head(stream: trio.abc.Stream, label: str) -> RequestHead | None:
    """The connection's request head; ``None`` when the peer left or sent no HTTP.

    A malformed or oversized head gets a 400 or 431 here before ``None``.
    """
    parser = h11.Connection(h11.SERVER, max_incomplete_event_size=MAX_HEAD_BYTES)
    received = bytearray()
    while True:
        try:
            event = parser.next_event()
        except h11.RemoteProtocolError as exc:
            status = exc.error_status_hint
            why = "head too large" if status == 431 else "not an HTTP request"
            await _refuse_bare(stream, label, status, why)
            return None
        if isinstance(event, h11.Request):
            return RequestHead(event, parser, bytes(received))
        if event is not h11.NEED_DATA:
            return None  # the peer closed the connection
        if len(received) >= MAX_HEAD_BYTES:
            await _refuse_bare(stream, label, 431, "head too large")
            return None
        try:
            data = bytes(await stream.receive_some(MAX_HEAD_BYTES))
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            return None
        received += data
        parser.receive_data(data)


async def _refuse_bare(stream: trio.abc.Stream, label: str, status: int, why: str) -> None:
    """Answer a request h11 could not read (so without it): the status, ``why``, closed."""
    logger.warning("%s refused (HTTP %d): %s", label, status, why)
    body = f"{why}\n".encode()
    headers = [
        (b"content-type", b"text/plain; charset=utf-8"),
        (b"content-length", str(len(body)).encode()),
        *security_headers(None),
        (b"connection", b"close"),
    ]
    head = f"HTTP/1.1 {status} {HTTPStatus(status).phrase}\r\n".encode() + b"".join(
        name + b": " + value + b"\r\n" for name, value in headers
    )
    head += b"\r\n"
    try:
        await stream.send_all(head + body)
        if isinstance(stream, trio.SocketStream):
            # Closing with unread bytes resets the connection, and the peer may lose the
            # answer: say we are done, then read what it still sends (within the deadline).
            await stream.send_eof()
            with trio.move_on_after(_LINGER_S):
                while await stream.receive_some(MAX_HEAD_BYTES):
                    pass
    except (trio.BrokenResourceError, trio.ClosedResourceError):
        pass


class ReplayStream(trio.abc.Stream):
    """``stream``, whose first bytes received are ``first`` (a head already read)."""

    def __init__(self, stream: trio.abc.Stream, first: bytes) -> None:
        self._stream = stream
        self._first = first

    async def receive_some(self, max_bytes: int | None = None) -> bytes | bytearray:
        if self._first:
            size = len(self._first) if max_bytes is None else max_bytes
            chunk, self._first = self._first[:size], self._first[size:]
            await trio.lowlevel.checkpoint()
            return chunk
        return await self._stream.receive_some(max_bytes)

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        await self._stream.send_all(data)

    async def wait_send_all_might_not_block(self) -> None:
        await self._stream.wait_send_all_might_not_block()

    async def aclose(self) -> None:
        await self._stream.aclose()


@attrs.frozen
class PageFiles:
    """The page's files by URL path (``/`` is ``index.html``), read once at start."""

    files: Mapping[str, tuple[str, bytes]]

    @classmethod
    def load(cls) -> PageFiles:
        """Read ``kernel/web/`` (blocking: call it in a thread); empty when not installed."""
        files: dict[str, tuple[str, bytes]] = {}
        folder = resources.files("kernel").joinpath("web")
        if folder.is_dir():
            for item in folder.iterdir():
                suffix = "." + item.name.rpartition(".")[2]
                if item.is_file() and suffix in _CONTENT_TYPES:
                    path = "/" if item.name == "index.html" else f"/{item.name}"
                    files[path] = (_CONTENT_TYPES[suffix], item.read_bytes())
        return cls(files)


async def answer_page_request(
    stream: trio.abc.Stream, head: RequestHead, gate: Gate, pages: PageFiles, label: str
) -> None:
    """Answer one plain HTTP request (not an upgrade), then the caller closes the connection."""
    checked = _check_host_and_origin(head, gate)
    status, content_type, body = _respond(head, checked, gate, pages)
    if status >= 400:
        log = logger.warning if status != 404 else logger.info
        log("%s refused (HTTP %d): %s", label, status, body.decode().strip())
    headers = [
        (b"content-type", content_type.encode()),
        (b"content-length", str(len(body)).encode()),
        *security_headers(None if isinstance(checked, Refused) else checked),
        (b"connection", b"close"),
    ]
    parser = head.parser
    data = parser.send(
        h11.Response(status_code=status, headers=headers, reason=HTTPStatus(status).phrase.encode())
    )
    if head.request.method != b"HEAD":
        data = (data or b"") + (parser.send(h11.Data(data=body)) or b"")
    data = (data or b"") + (parser.send(h11.EndOfMessage()) or b"")
    try:
        await stream.send_all(data)
    except (trio.BrokenResourceError, trio.ClosedResourceError):
        pass


def _respond(
    head: RequestHead, checked: tuple[str, int] | Refused, gate: Gate, pages: PageFiles
) -> tuple[int, str, bytes]:
    """``(status, content type, body)`` for a request."""
    text = "text/plain; charset=utf-8"
    if isinstance(checked, Refused):
        return checked.status, text, f"{checked.why}\n".encode()
    if head.request.method not in (b"GET", b"HEAD"):
        return 405, text, b"only GET\n"
    target = origin_form(head.request.target.decode("latin-1"))
    if isinstance(target, Refused):
        return target.status, text, f"{target.why}\n".encode()
    found = pages.files.get(target.path)
    if found is None:
        if not pages.files:
            return 404, text, b"the page's files are not installed (kernel/web/)\n"
        return 404, text, b"not found\n"
    if target.path == "/":
        offered = parse_qs(target.query).get("token", [])
        if not offered:
            why = b"missing token: open the http:// URL tak serve printed\n"
            return 401, text, why
        if not all(gate.token_matches(t) for t in offered):
            return 401, text, b"wrong token\n"
    content_type, body = found
    return 200, content_type, body


def _check_host_and_origin(head: RequestHead, gate: Gate) -> tuple[str, int] | Refused:
    host = head.header(b"host")
    return gate.check_host_and_origin(
        host.decode("latin-1") if host is not None else None,
        [origin.decode("latin-1") for origin in head.headers(b"origin")],
    )
