"""The hello_plugin plugin for tak: made with ``tak plugins new``, then extended.

``greet`` is the scaffold's tool; ``word_count`` was added after it: it reads a
file through the confined workspace of ``kernel.context()``, which the
default permission (read the workspace) allows.
"""

from __future__ import annotations

from typing import Literal

from kernel import Plugin, ToolFailure, context

# Permissions: what the sandbox lets the tools do. The default is reading the
# workspace; add {"workspace": "write"}, {"network": ["host:443"]} or
# {"subprocess": True} when a tool needs it.
plugin = Plugin("hello_plugin", version="0.2.0", description="Greets people, counts words.")


@plugin.tool
def greet(name: str, times: int = 1) -> str:
    """Greet someone.

    Args:
        name: Who to greet.
        times: How many times, 1 to 10.
    """
    context().logger.info("greeting %s", name)
    return " ".join([f"Hello, {name}!"] * max(1, min(times, 10)))


@plugin.tool(timeout=10)
def word_count(path: str, unit: Literal["words", "lines"] = "words") -> dict[str, int | str]:
    """Count the words (or lines) of a text file in the workspace.

    Args:
        path: The file, relative to the workspace.
        unit: What to count.
    """
    try:
        text = context().workspace.read_text(path)
    except FileNotFoundError:
        raise ToolFailure("exception", f"{path}: no such file in the workspace") from None
    count = len(text.split()) if unit == "words" else len(text.splitlines())
    return {"path": path, unit: count}
