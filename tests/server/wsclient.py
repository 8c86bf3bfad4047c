"""What the server tests share: a kernel, a server on 127.0.0.1:0, and two clients.

``open_test_client`` is the real client (``kernel.wire.open_client``), for
tests of well-formed requests. ``connect`` is a raw JSON client over
trio-websocket: tests of what the server does with frames no real client
sends (not JSON, unknown types, no ``hello``, reused ids, floods) need it.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import json
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

import trio
from trio_websocket import WebSocketConnection, open_websocket_url

from kernel import CallLimits, Kernel, Tool, open_kernel, tool, wire
from kernel.models import ScriptedModel
from kernel.models._scripted import demo_script
from kernel.wire import ServerLimits, open_client, serve_websocket
from plugins.demo import plugin as demo_plugin

TOKEN = "test-token-3f9a1c"
DEFAULT_LIMITS = ServerLimits()


@tool
def blob(size: int) -> str:
    """Return ``size`` bytes of text.

    Args:
        size: How many bytes.
    """
    return "x" * size


@contextlib.asynccontextmanager
async def open_test_kernel(
    home: Path, *, model: str | ScriptedModel | None = None, tools: Sequence[Tool] | None = None
) -> AsyncIterator[Kernel]:
    """The demo model (``/call TOOL {json}`` lines become calls) and the demo tools."""
    # Only these tools: no plugin workers (where open_kernel loads plugins).
    only_ours: dict[str, Any] = (
        {"plugins": []} if "plugins" in inspect.signature(open_kernel).parameters else {}
    )
    async with open_kernel(
        home=home,
        model=model or ScriptedModel(demo_script, name="scripted:demo"),
        tools=[*demo_plugin.tools, blob] if tools is None else tools,
        call_limits=CallLimits(max_output=None),
        **only_ours,
    ) as k:
        yield k


@contextlib.asynccontextmanager
async def running_server(
    kernel: Kernel, *, limits: ServerLimits = DEFAULT_LIMITS, token: str = TOKEN, **options: Any
) -> AsyncIterator[str]:
    """Serve ``kernel`` on a free loopback port; yield the URL (with the token)."""
    async with trio.open_nursery() as nursery:
        url: str = await nursery.start(
            functools.partial(
                serve_websocket, kernel, port=0, token=token, limits=limits, **options
            )
        )
        yield url
        nursery.cancel_scope.cancel()


def bare(url: str) -> str:
    """``url`` without its token."""
    return url.split("?", 1)[0]


class Client:
    """JSON frames over one trio-websocket connection."""

    def __init__(self, ws: WebSocketConnection) -> None:
        self.ws = ws

    async def send(self, frame: dict[str, Any] | str | bytes) -> None:
        await self.ws.send_message(frame if isinstance(frame, str | bytes) else json.dumps(frame))

    async def recv(self) -> dict[str, Any]:
        with trio.fail_after(10):
            message = await self.ws.get_message()
        assert isinstance(message, str)
        frame = json.loads(message)
        assert isinstance(frame, dict)
        return frame

    async def until_reply(self, re: str) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        """Frames about ``re`` until its reply or error (nothing else may come meanwhile)."""
        events = []
        while True:
            frame = await self.recv()
            assert frame.get("re") == re, frame
            if frame["type"] in ("reply", "error"):
                return events, frame
            events.append(frame)

    async def request(self, frame: dict[str, Any]) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        await self.send({"v": 1, **frame})
        return await self.until_reply(frame["id"])


@contextlib.asynccontextmanager
async def connect(
    url: str, *, headers: list[tuple[bytes, bytes]] | None = None, **options: Any
) -> AsyncIterator[Client]:
    async with open_websocket_url(
        url, extra_headers=headers, max_message_size=256 << 20, **options
    ) as ws:
        yield Client(ws)


@contextlib.asynccontextmanager
async def open_test_client(url: str, **options: Any) -> AsyncIterator[wire.Client]:
    """``kernel.wire.open_client``; the whole exchange fails the test after 10 s."""
    with trio.fail_after(10):
        async with open_client(url, **options) as client:
            yield client
