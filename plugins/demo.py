"""Toy tools for demos and tests: pure computation, nothing outside the process.

Not loaded by default (a real agent should not be offered toys): name it,
``tak --plugin demo ...`` or ``open_kernel(extra_plugins=["demo"])``. The
``scripted:demo`` model's ``/call add {"a": 1, "b": 2}`` lines pair well with it.
"""

from __future__ import annotations

import trio

from kernel.plugin import Plugin

__all__ = ["add", "divide", "echo", "plugin", "sleep"]

plugin = Plugin(
    "demo",
    version="1.0.0",
    description="Toy tools (sleep, add, divide, echo) for demos and tests.",
    in_process=True,  # no side effects at all
)


@plugin.tool
async def sleep(seconds: float) -> str:
    """Wait, then say how long.

    Args:
        seconds: How long to wait.
    """
    await trio.sleep(seconds)
    return f"slept {seconds:g} s"


@plugin.tool
def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: First addend.
        b: Second addend.
    """
    return a + b


@plugin.tool
def divide(a: float, b: float) -> float:
    """Divide a by b.

    Args:
        a: Dividend.
        b: Divisor.
    """
    return a / b


@plugin.tool
async def echo(text: str) -> str:
    """Return the text unchanged.

    Args:
        text: What to echo.
    """
    return text
