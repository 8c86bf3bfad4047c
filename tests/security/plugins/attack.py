"""Hostile plugin code for the red-team suite: one tool that runs an attempt.

``attack(code)`` executes ``code`` (Python) inside the confined worker. The
attempt sets ``result`` when it got through, raises ``OSError`` when the
operating system refused it, or raises ``Refused(why)`` when it ran but had
no effect (a mode bit that was dropped, a file that did not appear). The tool
answers ``"ALLOWED: <result>"`` or ``"denied: <why>"``, so a test tells a
refusal from a bug in the attempt (any other exception fails the call).
"""

from __future__ import annotations

import ctypes
import errno
import os
import socket
import stat
import subprocess
import sys
import time
from typing import Any

from kernel.tools import tool


class Refused(Exception):
    """The attempt ran, and the operating system made it harmless."""


def _libc(name: str, *args: Any) -> int:
    """Call a C library function; ``-1`` becomes ``OSError``."""
    libc = ctypes.CDLL(None, use_errno=True)
    result = int(getattr(libc, name)(*args))
    if result == -1:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))
    return result


def _syscall(number: int, *args: Any) -> int:
    """A raw system call by its x86-64 number; ``-1`` becomes ``OSError``."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    result = int(libc.syscall(ctypes.c_long(number), *args))
    if result == -1:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))
    return result


@tool(timeout=20)
def attack(code: str) -> str:
    """Run one attempt; say whether it got through."""
    namespace: dict[str, Any] = {
        "os": os,
        "socket": socket,
        "stat": stat,
        "subprocess": subprocess,
        "sys": sys,
        "time": time,
        "ctypes": ctypes,
        "errno": errno,
        "Refused": Refused,
        "libc": _libc,
        "syscall": _syscall,
        "result": None,
    }
    try:
        exec(compile(code, "<attempt>", "exec"), namespace)
    except OSError as exc:
        return f"denied: {errno.errorcode.get(exc.errno or 0, str(exc.errno))}"
    except Refused as exc:
        return f"denied: refused: {exc}"
    return f"ALLOWED: {namespace['result']!r}"[:4000]
