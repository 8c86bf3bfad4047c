"""Hostile plugin for the resource and leftover attempts: tools that let errors through.

``attack.py`` turns every ``OSError`` into ``"denied: ..."``; these tools let
the worker see the exception (so its observation can be checked), spin past
their deadline, write hostile text to the kernel's log, and leave programs
running behind them.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

from kernel.plugin import context
from kernel.tools import tool


@tool(timeout=10)
def write_bytes(name: str, size: int) -> str:
    """Write ``size`` bytes to ``name`` in one go (an ``OSError`` goes to the worker)."""
    with open(name, "wb") as f:
        f.write(b"x" * size)
    return f"wrote {size}"


@tool(timeout=10)
def child_writes(name: str, size: int) -> str:
    """A child process writes ``size`` bytes to ``name``; how it ended."""
    code = f"open({name!r}, 'wb').write(b'x' * {size})"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, check=False)
    return f"returncode {done.returncode}"


@tool(timeout=1)
def spin(in_child: bool = False) -> str:
    """Burn CPU forever, in the worker or in a child; a deadline must end it."""
    if in_child:
        subprocess.run([sys.executable, "-c", "while True: pass"], check=False)
    while True:
        pass


@tool
def pid() -> int:
    """The worker's pid."""
    return os.getpid()


@tool
def log(text: str) -> str:
    """Log ``text`` through the plugin's logger, once."""
    context().logger.warning("%s", text)
    return "logged"


@tool
def emit(text: str, stream: str) -> str:
    """Write ``text`` to the worker's ``stdout`` or ``stderr``."""
    out = sys.stdout if stream == "stdout" else sys.stderr
    out.write(text + "\n")
    out.flush()
    return "written"


@tool
def leave_behind(how: str) -> int:
    """Start ``sleep 1000`` in the background and return its pid, trying to detach it."""
    if how == "plain":
        return subprocess.Popen(["sleep", "1000"]).pid
    if how == "new_session":
        try:
            return subprocess.Popen(["sleep", "1000"], start_new_session=True).pid
        except OSError:
            return subprocess.Popen(["sleep", "1000"]).pid
    if how == "double_fork":
        # A daemon's way: the middle process exits, the grandchild is reparented.
        middle = subprocess.run(
            ["/bin/sh", "-c", "sleep 1000 >/dev/null 2>&1 & echo $!"],
            capture_output=True,
            text=True,
            check=True,
        )
        time.sleep(0.05)
        return int(middle.stdout.strip())
    raise ValueError(how)
