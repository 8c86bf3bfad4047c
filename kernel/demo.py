"""The demo tools and the scripted turn behind ``tak demo``.

No API key and no network: the "model" is a fixed list of five declared calls
that shows what ``run_tool_calls`` guarantees — a slow call declared first,
a fast one, one that raises, one with bad arguments, one that times out.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import trio

from .executor import CallFinished, CallLimits
from .messages import Message, Observation, Text, ToolCall
from .tools import ToolRegistry, tool

if TYPE_CHECKING:
    from .agent import AgentEvent
    from .kernel import Kernel
    from .session import Session


@tool
async def sleep(seconds: float) -> str:
    """Wait, then say how long.

    Args:
        seconds: How long to wait.
    """
    await trio.sleep(seconds)
    return f"slept {seconds:g} s"


@tool
def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: First addend.
        b: Second addend.
    """
    return a + b


@tool
def divide(a: float, b: float) -> float:
    """Divide a by b.

    Args:
        a: Dividend.
        b: Divisor.
    """
    return a / b


@tool
async def echo(text: str) -> str:
    """Return the text unchanged.

    Args:
        text: What to echo.
    """
    return text


DEMO_TOOLS = (sleep, add, divide, echo)


def demo_registry() -> ToolRegistry:
    """The tools ``tak tools`` and ``tak call`` offer until plugins are loaded."""
    return ToolRegistry(DEMO_TOOLS)


DEMO_CALLS: tuple[ToolCall, ...] = (
    ToolCall("call_slow", "sleep", '{"seconds": 0.6}', 0),
    ToolCall("call_fast", "add", '{"a": 2, "b": 3}', 1),
    ToolCall("call_raises", "divide", '{"a": 1, "b": 0}', 2),
    ToolCall("call_bad_args", "add", '{"a": "two", "b": 3}', 3),
    ToolCall("call_hangs", "sleep", '{"seconds": 30}', 4),
)
DEMO_LIMITS = CallLimits(timeout=1.0)
DEMO_PROMPT = "Run five tools at once: a slow one, a fast one, one that raises, one with bad arguments, one that hangs."


async def run_demo_turn(k: Kernel, session: Session) -> tuple[list[Observation], list[int], float]:
    """Run the scripted turn and persist it; return observations, completion order, wall time."""
    finished: list[int] = []

    def on_event(event: AgentEvent) -> None:
        if isinstance(event, CallFinished):
            finished.append(event.index)

    await session.set_title("demo: five parallel calls")
    await session.append(Message("user", [Text(DEMO_PROMPT)]))
    started = time.perf_counter()
    observations = await k.call_tools(session, DEMO_CALLS, limits=DEMO_LIMITS, on_event=on_event)
    return observations, finished, time.perf_counter() - started


def format_table(observations: list[Observation]) -> str:
    """Observations as a fixed-width table, in the order given."""
    rows = [("#", "call id", "tool", "result", "duration", "content")]
    for o in observations:
        status = o.error.kind if o.error is not None else "ok"
        content = o.content.replace("\n", " ")
        if len(content) > 60:
            content = content[:57] + "..."
        rows.append((str(o.index), o.call_id, o.name, status, f"{o.duration_s:.3f} s", content))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
    lines = []
    for r in rows:
        lines.append(
            "  ".join(c.ljust(w) for c, w in zip(r[:-1], widths, strict=True)) + "  " + r[-1]
        )
    lines.insert(1, "-" * max(len(line) for line in lines))
    return "\n".join(lines)
