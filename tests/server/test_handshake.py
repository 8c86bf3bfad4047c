"""The handshake reads trio-websocket's private request event: fail loudly if it goes."""

from __future__ import annotations

from importlib.metadata import version

import pytest
import trio
import trio_websocket

from kernel.wire._handshake import REQUEST_EVENT_ATTRIBUTE, request_host


async def test_trio_websocket_still_keeps_the_request_event_with_the_host_header() -> None:
    """``request_host`` needs ``WebSocketRequest._event.host`` (wsproto hides ``Host``)."""
    seen: list[trio_websocket.WebSocketRequest] = []

    async def handler(request: trio_websocket.WebSocketRequest) -> None:
        seen.append(request)
        await request.reject(404)

    async with trio.open_nursery() as nursery:
        server = await nursery.start(trio_websocket.serve_websocket, handler, "127.0.0.1", 0, None)
        port = server.port
        with trio.fail_after(10), pytest.raises(trio_websocket.ConnectionRejected):
            async with trio_websocket.open_websocket("127.0.0.1", port, "/", use_ssl=False):
                pass
        nursery.cancel_scope.cancel()

    (request,) = seen
    if not hasattr(request, REQUEST_EVENT_ATTRIBUTE) or request_host(request) is None:
        pytest.fail(
            f"trio-websocket {version('trio-websocket')} no longer keeps wsproto's request "
            f"event (with the Host header) in WebSocketRequest.{REQUEST_EVENT_ATTRIBUTE}: "
            "kernel/wire/_handshake.py's request_host cannot read Host, so tak serve would "
            "refuse every handshake with HTTP 400. Read Host the new way there, and move "
            "the trio-websocket pin in pyproject.toml."
        )
    assert request_host(request) == f"127.0.0.1:{port}"
