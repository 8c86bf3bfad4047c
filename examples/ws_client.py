"""A client of `tak serve` in plain JSON: hello, a batch of tool calls, then an agent turn.

    tak serve --port 0                       # prints ws://127.0.0.1:PORT/?token=...
    python examples/ws_client.py 'ws://127.0.0.1:PORT/?token=...'

Every request gets `event` frames (which carry its id in `re`) and then exactly
one `reply`; see docs/protocol.md. This client sends one request at a time, so
every frame it reads is about that request.
"""

from __future__ import annotations

import json
import sys
from typing import Any

import trio
from trio_websocket import WebSocketConnection, open_websocket_url


async def request(ws: WebSocketConnection, frame: dict[str, Any]) -> dict[str, Any]:
    """Send a request, print its events as they come, return its reply."""
    await ws.send_message(json.dumps({"v": 1, **frame}))
    while True:
        message = json.loads(await ws.get_message())
        if message["type"] in ("reply", "error"):
            return dict(message)
        if message["kind"] == "model_delta":
            print(message["text"], end="", flush=True)
        elif message["kind"] == "call_started":
            call = message["call"]
            print(f"  started  [{message['index']}] {call['name']} {json.dumps(call['arguments'])}")
        elif message["kind"] == "call_finished":
            o = message["observation"]
            print(f"  finished [{o['index']}] {o['name']}: {o['content']}")
        elif message["kind"] == "turn_finished":
            print(f"\n  turn finished: {message['reason']} after {message['steps']} step(s)")


async def main(url: str) -> int:
    async with open_websocket_url(url) as ws:
        hello = await request(ws, {"type": "hello", "id": "1"})
        info = hello["result"]
        print(f"connected: {info['server']} {info['version']}, model {info['model']}")

        print("call_tools:")
        reply = await request(
            ws,
            {
                "type": "call_tools",
                "id": "2",
                "session": "ws-example",
                "calls": [
                    {"id": "a", "name": "add", "arguments": {"a": 2, "b": 40}},
                    {"id": "b", "name": "divide", "arguments": {"a": 1, "b": 0}},
                ],
            },
        )
        for o in reply["result"]["observations"]:
            print(f"  reply    [{o['index']}] {o['content']}")

        print("run:")
        reply = await request(
            ws,
            {
                "type": "run",
                "id": "3",
                "session": "ws-example",
                "prompt": '/call echo {"text": "hello over websocket"}',
            },
        )
        print(f"  reply: {reply['status']}, {reply['result']['reason']}")
    return 0


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    sys.exit(trio.run(main, sys.argv[1]))
