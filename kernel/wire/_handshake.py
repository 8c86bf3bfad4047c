"""The HTTP handshake: which requests become WebSocket connections (DESIGN §9, §11).

``Gate.accept`` checks, before any frame: the ``Host`` header (a loopback
name, against DNS rebinding, unless remote clients are allowed), the
``Origin`` (the server's own or one allowed; one header at most), the request
target (origin-form, ``/path?query``: ``origin_form``), and a token offered in
the query or as ``Authorization: Bearer``. A handshake with the right token takes an
authenticated place (``kernel.wire._admission``); one without is accepted and
must send ``hello`` with the token before the deadline (``_connection``).
"""

from __future__ import annotations

import hmac
import ipaddress
import logging
import re
from collections.abc import Sequence
from urllib.parse import parse_qs

import attrs
import trio
from trio_websocket import WebSocketConnection, WebSocketRequest

from ._admission import Admission, Slot
from ._limits import ServerLimits

logger = logging.getLogger("tak.server")

#: trio-websocket's private attribute holding wsproto's request event (see ``request_host``).
REQUEST_EVENT_ATTRIBUTE = "_event"

#: ``host[:port]`` as taken from a ``Host`` header or an ``Origin``: a bracketed IPv6
#: literal, or a name or IPv4 address of plain characters. No userinfo
#: (``evil.example@127.0.0.1``: a URL's, never a Host's), no path, no space.
_HOST_PORT = re.compile(r"(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9._~-]+)(?::([0-9]+))?")
#: An origin-form request target (RFC 9112 §3.2.1): ``/path?query``, a path of RFC
#: 3986's pchar (with a bare ``%`` let through); the query is taken as it comes (h11 has
#: refused controls and spaces; browsers leave ``[``, ``]`` and more unencoded there). A
#: fragment, which browsers never send, is dropped.
_ORIGIN_FORM = re.compile(
    r"(?P<path>(?:/[A-Za-z0-9\-._~!$&'()*+,;=:@%]*)+)(?:\?(?P<query>[^#]*))?(?:#.*)?", re.DOTALL
)


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


def is_loopback_name(hostname: str) -> bool:
    """Whether a ``Host`` header's name is this machine's (against DNS rebinding)."""
    if hostname == "localhost" or hostname.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(hostname).is_loopback
    except ValueError:
        return False


async def refuse_remote_bind(host: str, *, allow_remote: bool) -> None:
    """Refuse a ``host`` that would expose a server to other machines, unless allowed.

    Called before anything starts (``tak serve``, ``tak mcp serve --http``), so the
    refusal is the command's only output: no log line of a kernel that was opened
    for nothing.

    Raises:
        UsageError: ``host`` is not a loopback address and ``allow_remote`` is false.
    """
    from kernel.errors import UsageError

    try:
        loopback = allow_remote or await is_loopback_address(host)
    except UnicodeError:  # no host name at all (the IDNA codec refuses it)
        loopback = False
    if not loopback:
        raise UsageError(
            f"refusing to bind {host!r}: not a loopback address (--allow-remote to serve "
            "other machines, and put TLS in front)"
        )


def _host_and_port(netloc: str, default_port: int) -> tuple[str, int] | None:
    """``("host", port)`` of ``host[:port]``, lower-cased; ``None`` when it is not one."""
    if not netloc.startswith("[") and netloc.count(":") > 1:
        # An IPv6 address without brackets, as trio-websocket's client writes "::1:8765".
        address, _, port_text = netloc.rpartition(":")
        try:
            host = str(ipaddress.IPv6Address(address))
        except ValueError:
            return None
        port = _port(port_text)
        return (host, port) if port is not None else None
    match = _HOST_PORT.fullmatch(netloc)
    if match is None:
        return None
    name, port_text = match.groups()
    if name.startswith("["):
        try:
            name = str(ipaddress.IPv6Address(name[1:-1]))
        except ValueError:
            return None
    if port_text is None:
        return name.lower(), default_port
    port = _port(port_text)
    return (name.lower(), port) if port is not None else None


def _port(text: str) -> int | None:
    """A TCP port written in decimal ASCII digits, or ``None``."""
    if not (text.isascii() and text.isdigit()) or int(text) > 65535:
        return None
    return int(text)


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


@attrs.frozen
class Target:
    """An origin-form request target: its path and its query (without the ``?``)."""

    path: str
    query: str


def origin_form(target: str) -> Target | Refused:
    """The path and query of ``/path?query``; any other form of target is refused (400).

    Only origin-form is served: an absolute-form target (``http://host/...``)
    names a host that the ``Host`` checks would not see (RFC 9112 §3.2.2), and
    browsers send it only to proxies.
    """
    match = _ORIGIN_FORM.fullmatch(target)
    if match is None:
        return Refused(400, "malformed request target: only /path?query is served")
    return Target(match["path"], match["query"] or "")


def security_headers(host_port: tuple[str, int] | None) -> list[tuple[bytes, bytes]]:
    """The headers on every HTTP answer of the server (docs/web.md, Security).

    ``host_port`` is the ``Host`` checked (``Gate.check_host_and_origin``),
    named in the policy's ``connect-src``; ``None`` when it was not.
    """
    connect = "'self'"
    if host_port is not None:
        # 'self' covers ws: to the same host in recent browsers; older ones need it named.
        connect += f" {host_url('ws', *host_port)}"
    policy = (
        "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
        f"connect-src {connect}; object-src 'none'; base-uri 'none'; form-action 'none'; "
        "frame-ancestors 'none'"
    )
    return [
        (b"content-security-policy", policy.encode()),
        (b"x-content-type-options", b"nosniff"),
        (b"referrer-policy", b"no-referrer"),
        (b"x-frame-options", b"DENY"),
        (b"cache-control", b"no-store"),
    ]


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
        origins = [value.decode("latin-1") for name, value in request.headers if name == b"origin"]
        checked = self.check_host_and_origin(request_host(request), origins)
        if isinstance(checked, Refused):
            await self._reject(request, label, checked, None)
            return None
        target = origin_form(request.path)
        if isinstance(target, Refused):
            await self._reject(request, label, target, checked)
            return None
        offered = parse_qs(target.query).get("token", [])
        authorization = headers.get(b"authorization", b"").decode("latin-1")
        scheme, _, credentials = authorization.partition(" ")
        if scheme.lower() == "bearer":
            offered.append(credentials.strip())
        if not all(self.token_matches(t) for t in offered):
            await self._reject(request, label, Refused(401, "wrong token"), checked)
            return None
        if not offered:
            slot.scope.deadline = slot.token_deadline + self.limits.close_grace
        elif (verdict := self.admission.authenticate(slot)) == "dropped":
            # Dropped for room after its request was read: its scope is cancelled.
            logger.info("%s: handshake after the connection was dropped for room", label)
            return None
        elif verdict == "full":
            await self._reject(request, label, Refused(503, "too many connections"), checked)
            return None
        return await request.accept()

    def check_host_and_origin(
        self, host: str | None, origins: Sequence[str]
    ) -> tuple[str, int] | Refused:
        """The ``(host, port)`` a client dialled, or why its request is refused.

        Checks the ``Host`` header (a loopback name unless remote clients are
        allowed: against DNS rebinding) and, when a browser sent one, the
        ``Origin`` (the server's own, or one allowed); ``origins`` are the
        values of every ``Origin`` header, and two are refused, whatever they
        say (one reader would take the first, another the last). Both the
        WebSocket handshake and the page (``kernel.wire._http``) go through here.
        """
        host_port = _host_and_port(host, 80) if host is not None else None
        if host_port is None:
            return Refused(400, "missing or malformed Host header")
        if not self._allow_remote and not is_loopback_name(host_port[0]):
            # DNS rebinding: a page on evil.example resolving to 127.0.0.1 sends Host: evil.example
            return Refused(403, "Host is not a loopback name")
        if len(origins) > 1:
            return Refused(400, "more than one Origin header")
        if origins and not self._origin_allowed(origins[0], host_port):
            return Refused(403, "Origin not allowed")
        return host_port

    def _origin_allowed(self, origin: str, host_port: tuple[str, int]) -> bool:
        if origin.rstrip("/").lower() in self._allow_origins:
            return True
        # The server's own origin: the page was served from the host:port the client dialled.
        scheme, separator, netloc = origin.partition("://")
        default = {"http": 80, "https": 443}.get(scheme.lower())
        if not separator or default is None:
            return False
        return _host_and_port(netloc, default) == host_port

    async def _reject(
        self,
        request: WebSocketRequest,
        label: str,
        refused: Refused,
        host_port: tuple[str, int] | None,
    ) -> None:
        logger.warning("%s refused (HTTP %d): %s", label, refused.status, refused.why)
        await request.reject(
            refused.status,
            extra_headers=security_headers(host_port),
            body=f"{refused.why}\n".encode(),
        )
