"""What one server and each of its connections may use (``ServerLimits``), and close codes."""

from __future__ import annotations

import attrs

from .._checks import positive
from ..errors import UsageError

# WebSocket close codes (RFC 6455 §7.4.1)
CLOSE_NORMAL = 1000
CLOSE_POLICY = 1008  # unauthorized, or a client too slow to read what it asked for
CLOSE_TOO_BIG = 1009  # sent by trio-websocket for a frame past ServerLimits.hard_frame_limit
CLOSE_INTERNAL = 1011  # a bug on our side, or a peer that stopped answering pings
CLOSE_TRY_AGAIN = 1013  # authenticated by hello, but max_connections clients are connected


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

    max_frame_bytes: int = attrs.field(default=1 << 20, validator=positive(integer=True))
    hard_frame_limit: int | None = attrs.field(
        default=None, validator=positive(integer=True, optional=True)
    )
    max_inflight: int = attrs.field(default=16, validator=positive(integer=True))
    max_connections: int = attrs.field(default=64, validator=positive(integer=True))
    max_unauthenticated: int = attrs.field(default=16, validator=positive(integer=True))
    fd_reserve: int = attrs.field(default=64, validator=positive(integer=True))
    outbox_bytes: int = attrs.field(default=64 << 20, validator=positive(integer=True))
    send_timeout: float = attrs.field(default=20.0, validator=positive())
    handshake_timeout: float = attrs.field(default=5.0, validator=positive())
    ping_interval: float | None = attrs.field(default=20.0, validator=positive(optional=True))
    ping_timeout: float = attrs.field(default=20.0, validator=positive())
    idle_timeout: float | None = attrs.field(default=3600.0, validator=positive(optional=True))
    close_grace: float = attrs.field(default=5.0, validator=positive())

    def __attrs_post_init__(self) -> None:
        if self.hard_frame_limit is not None and self.hard_frame_limit < self.max_frame_bytes:
            raise UsageError("ServerLimits.hard_frame_limit must be at least max_frame_bytes")

    @property
    def frame_buffer_limit(self) -> int:
        """The ``max_message_size`` given to trio-websocket (characters)."""
        return self.hard_frame_limit or 2 * self.max_frame_bytes
