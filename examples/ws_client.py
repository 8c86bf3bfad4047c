"""A client of `tak serve` with `kernel.wire.open_client`: hello, a batch of tool calls, a turn.

    .venv/bin/tak --plugin demo serve --port 0   # prints ws://127.0.0.1:PORT/?token=...
    .venv/bin/python examples/ws_client.py 'ws://127.0.0.1:PORT/?token=...'

It uses the demo plugin's tools (`add`, `divide`, `echo`: `--plugin demo`) and
the default scripted model (`scripted:demo`, which runs `/call TOOL ARGS`); a
server without them is told apart in one line.

Every request gets `event` frames (which carry its id in `re`) and then exactly
one `reply`; see docs/protocol.md, which also shows the JSON for clients in
other languages. `open_client` says `hello`, routes each frame to its request,
and gives events and results as records.
"""

from __future__ import annotations

import json
import sys

import trio

from kernel import ToolCall
from kernel.wire import (
    CallFinishedEvent,
    CallStartedEvent,
    EventData,
    ModelDeltaEvent,
    TurnFinishedEvent,
    open_client,
)


def show(event: EventData) -> None:
    """Print an event as it comes."""
    if isinstance(event, ModelDeltaEvent):
        print(event.text, end="", flush=True)
    elif isinstance(event, CallStartedEvent):
        call = event.call
        print(f"  started  [{event.index}] {call.name} {json.dumps(call.arguments)}")
    elif isinstance(event, CallFinishedEvent):
        o = event.observation
        print(f"  finished [{o.index}] {o.name}: {o.content}")
    elif isinstance(event, TurnFinishedEvent):
        print(f"\n  turn finished: {event.reason} after {event.steps} step(s)")


async def main(url: str) -> int:
    async with open_client(url) as client:
        info = client.info
        print(f"connected: {info.server} {info.version}, model {info.model}")
        names = {spec["name"] for spec in (await client.tools()).tools}
        missing = sorted({"add", "divide", "echo"} - names)
        if missing:
            print(
                f"the server has no {', '.join(missing)}: start it with `tak --plugin demo serve`",
                file=sys.stderr,
            )
            return 2

        print("call_tools:")
        result = await client.call_tools(
            "ws-example",
            [
                ToolCall("a", "add", {"a": 2, "b": 40}),
                ToolCall("b", "divide", {"a": 1, "b": 0}),
            ],
            on_event=show,
        )
        for o in result.observations:
            print(f"  reply    [{o.index}] {o.content}")

        print("run:")
        turn = await client.run(
            "ws-example", '/call echo {"text": "hello over websocket"}', on_event=show
        )
        print(f"  reply: ok, {turn.reason}")
    return 0


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    sys.exit(trio.run(main, sys.argv[1]))
