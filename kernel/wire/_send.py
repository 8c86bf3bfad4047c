"""Text messages to a trio-websocket connection, several in one write.

``WebSocketConnection.send_message`` writes one message per ``send_all``
and takes its send lock with ``async with`` (one more pass through the
scheduler); the server's writer sends what is queued at once, and the client
sends its requests, through ``send_messages`` instead. The bytes on the wire
are the same: each text is still its own WebSocket message.
"""

from __future__ import annotations

import trio
from trio_websocket import ConnectionClosed, WebSocketConnection
from wsproto.events import TextMessage


async def send_messages(ws: WebSocketConnection, texts: list[str]) -> None:
    """``ws.send_message`` of each text in turn, written to the socket at once.

    Raises:
        ConnectionClosed: the connection is closed or closing (as ``send_message``).
    """
    # trio-websocket writes one message per send, under a lock it also takes to
    # answer pings; this is its own send path for several (private names, pinned
    # with the version in pyproject.toml).
    if ws._close_reason:
        raise ConnectionClosed(ws._close_reason)
    data = b"".join([ws._wsproto.send(TextMessage(data=text)) for text in texts])
    lock = ws._stream_lock
    try:
        # Free nearly always: taken without the extra trip through the scheduler
        # that ``async with`` costs (send_all below is the checkpoint).
        lock.acquire_nowait()
    except trio.WouldBlock:
        await lock.acquire()
    try:
        await ws._stream.send_all(data)
    except (trio.BrokenResourceError, trio.ClosedResourceError):
        await ws._abort_web_socket()
        assert ws._close_reason is not None
        raise ConnectionClosed(ws._close_reason) from None
    finally:
        lock.release()
