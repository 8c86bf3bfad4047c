"""A plain plugin: the tools a worker serves in the pool tests."""

from __future__ import annotations

import os
import threading
import time

import trio

from kernel.tools import tool


@tool
def echo(text: str) -> str:
    """Return the text."""
    return text


@tool
def add(a: int, b: int = 1) -> dict[str, int]:
    """Add two numbers."""
    return {"sum": a + b}


@tool
async def nap(seconds: float) -> str:
    """Sleep in Trio, then answer."""
    await trio.sleep(seconds)
    return "rested"


@tool
def block(seconds: float) -> str:
    """Sleep in a thread."""
    time.sleep(seconds)
    return "done"


_meetings: dict[int, threading.Barrier] = {}
_meetings_lock = threading.Lock()


@tool
def meet(parties: int) -> str:
    """Wait, in a thread, until ``parties`` calls of it are waiting at once: it answers
    only if they run concurrently (a minute later, one alone gives up)."""
    with _meetings_lock:
        barrier = _meetings.setdefault(parties, threading.Barrier(parties, timeout=60))
    try:
        barrier.wait()
    except threading.BrokenBarrierError:
        return "alone"
    return "met"


@tool
def pid() -> int:
    """The worker's process id."""
    return os.getpid()


@tool
def thread() -> int:
    """The identity of the worker thread that runs this call."""
    import threading

    return threading.get_ident()


@tool
def crash(code: int = 0) -> str:
    """End the worker at once (as a segfault would)."""
    os._exit(code)


@tool
def fail(message: str) -> str:
    """Raise an error."""
    raise ValueError(message)


@tool
def shout(text: str) -> str:
    """Print to stdout and stderr, then answer."""
    import sys

    print(f"out: {text}", flush=True)
    print(f"err: {text}", file=sys.stderr, flush=True)
    return text


@tool
def refuse(what: str) -> str:
    """Refuse with a chosen error kind."""
    from kernel.tools import ToolFailure

    raise ToolFailure("denied", f"{what} is not allowed")


@tool
def unserializable() -> object:
    """Return something JSON cannot carry."""
    return {1, 2}


@tool
def write_here(name: str, text: str) -> str:
    """Write a file in the workspace (the worker's cwd)."""
    try:
        with open(name, "w") as f:
            f.write(text)
    except OSError as exc:
        return f"denied: {exc.strerror}"
    return "written"
