"""The HTTP handshake: which requests become WebSocket connections (DESIGN §9, §11).

``Gate.accept`` checks, before any frame: the ``Host`` header (a loopback
name, against DNS rebinding, unless remote clients are allowed), the
``Origin`` (the server's own or one allowed), and a token offered in the query
or as ``Authorization: Bearer``. A handshake with the right token takes an
authenticated place (``kernel.wire._admission``); one without is accepted and
must send ``hello`` with the token before the deadline (``_connection``).
"""

from __future__ import annotations

import hmac
import ipaddress
import logging
from collections.abc import Sequence
from urllib.parse import parse_qs, urlsplit

import attrs
import trio
from trio_websocket import WebSocketConnection, WebSocketRequest

from ._admission import Admission, Slot
from ._limits import ServerLimits

logger = logging.getLogger("tak.server")

#: trio-websocket's private attribute holding wsproto's request event (see ``request_host``).
REQUEST_EVENT_ATTRIBUTE = "_event"


async def is_loopback_address(host: str) -> bool:
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


def request_host(request: WebSocketRequest) -> str | None:
    """The handshake's ``Host`` header.

    wsproto takes ``Host`` out of the headers trio-websocket shows
    (``request.headers``) and keeps it on the request event only, which
    trio-websocket holds in a private attribute; without it we cannot tell
    DNS rebinding from a local client, so the caller refuses (HTTP 400). That
    is why pyproject.toml pins trio-websocket to the versions tested, and why
    tests/server/test_handshake.py fails loudly when the attribute is gone.
    """
    event = getattr(request, REQUEST_EVENT_ATTRIBUTE, None)
    host = getattr(event, "host", None)
    return host if isinstance(host, str) else None


def host_url(scheme: str, host: str, port: int) -> str:
    """``scheme://host:port``, with an IPv6 address in brackets."""
    return f"{scheme}://[{host}]:{port}" if ":" in host else f"{scheme}://{host}:{port}"


@attrs.frozen
class Refused:
    """Why a request is refused before it is served: the HTTP status, and a line for the log."""

    status: int
    why: str


class Gate:
    """The server's token, its allowed origins, and the handshake checks that use them."""

    def __init__(
        self,
        *,
        token: str,
        allow_origins: Sequence[str],
        allow_remote: bool,
        limits: ServerLimits,
        admission: Admission,
    ) -> None:
        self.limits = limits
        self.admission = admission
        self._token = token.encode()
        self._allow_origins = {o.rstrip("/").lower() for o in allow_origins}
        self._allow_remote = allow_remote

    def token_matches(self, candidate: str) -> bool:
        return hmac.compare_digest(candidate.encode("utf-8", "surrogatepass"), self._token)

    async def accept(
        self, request: WebSocketRequest, label: str, slot: Slot
    ) -> WebSocketConnection | None:
        """Accept the handshake, or refuse it with an HTTP status before any frame.

        A handshake with the right token authenticates ``slot``; one without
        gets until the token deadline to send ``hello``, plus ``close_grace`` to
        take the refusal.
        """
        headers: dict[bytes, bytes] = {name.lower(): value for name, value in request.headers}
        origin = headers.get(b"origin")
        checked = self.check_host_and_origin(
            request_host(request), origin.decode("latin-1") if origin is not None else None
        )
        if isinstance(checked, Refused):
            await self._reject(request, label, checked.status, checked.why)
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

    def check_host_and_origin(
        self, host: str | None, origin: str | None
    ) -> tuple[str, int] | Refused:
        """The ``(host, port)`` a client dialled, or why its request is refused.

        Checks the ``Host`` header (a loopback name unless remote clients are
        allowed: against DNS rebinding) and, when a browser sent one, the
        ``Origin`` (the server's own, or one allowed). Both the WebSocket
        handshake and the page (``kernel.wire._http``) go through here.
        """
        host_port = _host_and_port(host, 80) if host is not None else None
        if host_port is None:
            return Refused(400, "missing or malformed Host header")
        if not self._allow_remote and not _is_loopback_name(host_port[0]):
            # DNS rebinding: a page on evil.example resolving to 127.0.0.1 sends Host: evil.example
            return Refused(403, "Host is not a loopback name")
        if origin is not None and not self._origin_allowed(origin, host_port):
            return Refused(403, "Origin not allowed")
        return host_port

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
