"""A plugin that names its tools in TOOLS: only those are served."""

from __future__ import annotations

from kernel.tools import tool


@tool
def served() -> str:
    """In TOOLS."""
    return "served"


@tool
def hidden() -> str:
    """Not in TOOLS."""
    return "hidden"


TOOLS = [served]
