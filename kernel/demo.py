"""The scripted turn behind ``tak demo``, on the built-in tools.

No API key and no network: the "model" is a fixed list of five declared calls
that shows what ``run_tool_calls`` guarantees — a slow call declared first
(a shell command in a sandbox worker), a fast one (a file read), one that
fails, one with bad arguments, one that hits its deadline.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from .executor import CallFinished, CallLimits
from .messages import Message, Observation, Text, ToolCall

if TYPE_CHECKING:
    from .agent import AgentEvent
    from .kernel import Kernel
    from .session import Session

__all__ = ["DEMO_FILE", "DEMO_PLUGINS", "format_table", "run_demo_turn"]

#: The built-in plugins the demo uses, and the file it reads.
DEMO_PLUGINS = ("fs", "shell", "python")
DEMO_FILE = ("hello.txt", "Hello from the workspace.\n")

DEMO_CALLS: tuple[ToolCall, ...] = (
    ToolCall("call_slow", "run_command", '{"command": "sleep 0.6; echo slow done"}', 0),
    ToolCall("call_fast", "read_file", '{"path": "hello.txt"}', 1),
    ToolCall("call_fails", "read_file", '{"path": "missing.txt"}', 2),
    ToolCall("call_bad_args", "run_python", '{"code": 42}', 3),
    ToolCall("call_hangs", "run_command", '{"command": "sleep 30", "timeout": 1}', 4),
)
DEMO_LIMITS = CallLimits(timeout=10.0)
DEMO_PROMPT = "Run five tools at once: a slow one, a fast one, one that raises, one with bad arguments, one that hangs."


async def run_demo_turn(k: Kernel, session: Session) -> tuple[list[Observation], list[int], float]:
    """Run the scripted turn and persist it; return observations, completion order, wall time."""
    finished: list[int] = []

    def on_event(event: AgentEvent) -> None:
        if isinstance(event, CallFinished):
            finished.append(event.index)

    await session.record_title("demo: five parallel calls")
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
