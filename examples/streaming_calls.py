"""Stream observations in declared order, watch calls finish, and cancel one by id.

Run: .venv/bin/python examples/streaming_calls.py
"""

from __future__ import annotations

import trio

from kernel import (
    BatchHandle,
    CallEvent,
    CallFinished,
    CallLimits,
    ToolCall,
    ordered_observations,
    tool,
)


@tool
async def search(query: str, seconds: float = 0.2) -> list[str]:
    """Pretend to search.

    Args:
        query: What to look for.
        seconds: How long the pretend search takes.
    """
    await trio.sleep(seconds)
    return [f"{query} result {i}" for i in range(2)]


@tool(exclusive=True)
def write_report(title: str) -> str:
    """Runs alone: every call declared before it has finished when it starts."""
    return f"wrote {title!r}"


async def main() -> None:
    calls = [
        ToolCall("a", "search", {"query": "trio", "seconds": 0.3}),
        ToolCall("b", "search", {"query": "nurseries", "seconds": 0.1}),
        ToolCall("c", "search", {"query": "forever", "seconds": 60}),
        ToolCall("d", "write_report", {"title": "findings"}),
    ]
    handle = BatchHandle()

    def on_event(event: CallEvent) -> None:
        if isinstance(event, CallFinished):
            print(f"  finished: #{event.index} {event.observation.name}")
            if event.observation.call_id == "a":
                handle.cancel("c")  # enough results: drop the slow search

    async with ordered_observations(
        calls,
        [search, write_report],
        limits=CallLimits(timeout=5),
        on_event=on_event,
        handle=handle,
    ) as stream:
        async for observation in stream:
            print(f"in order: #{observation.index} {observation.content}")


if __name__ == "__main__":
    trio.run(main)
