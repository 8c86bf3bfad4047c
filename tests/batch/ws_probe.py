"""A plugin run in a sandbox worker (not in process), for the per-task workspace tests."""

from __future__ import annotations

import os

from kernel.plugin import Plugin, context

plugin = Plugin(
    "wsprobe",
    version="1.0.0",
    description="Reads files in its worker: the task's own, and (it tries) another's.",
    permissions={"workspace": "write"},
)


@plugin.tool
def read_here(path: str) -> str:
    """Read a file of the workspace, through the confined workspace.

    Args:
        path: Relative to the workspace.
    """
    return context().workspace.read_text(path)


@plugin.tool
def read_raw(path: str) -> str:
    """Read any path with plain open() (Landlock decides), and say where the worker runs.

    Args:
        path: Absolute, or relative to the worker's working directory.
    """
    with open(path) as f:
        return f"{os.getcwd()}|{f.read()}"
