"""The one exit-code rule of ``tak``, and the one line an error is told in.

Every command ends with one of four codes::

    0    OK           it did what was asked
    1    FAILED       it was asked properly and could not do it: the store, the
                      sandbox, a model provider, a peer, the operating system,
                      a tool or a task that failed, a bug (an internal error)
    2    BAD_INPUT    what it was given is wrong: an argument, a flag, a file it
                      was told to read, tak.toml, a name that does not exist
    130  INTERRUPTED  Ctrl-C (SIGINT)

An exception is mapped by ``exit_code``: ``UsageError`` (and its subclasses:
``TurnRunning``, the trust errors, every tak.toml error) is bad input; every
other ``KernelError`` (``StoreError``, ``SandboxError``, ``ModelAPIError``,
``ProtocolError``...) and every ``OSError`` failed. A lost database or a lost
batch lease is therefore 1, never 2: the input was fine, running it was not.
A command that itself judges a path or value it was given to be wrong raises
``UsageError`` (or returns ``BAD_INPUT``); it does not invent a code.

``error_line`` says an error in one line, escaped for the terminal (an error
that quotes a hostile file or tool name must not carry its controls), and
``report`` prints it and returns the code: the commands and ``tak``'s own
handler (``kernel.cli.main``) use the same two.

This module imports only ``kernel.errors`` and ``kernel.terminal``: ``tak
--help`` stays cheap.
"""

from __future__ import annotations

import sys
from typing import TextIO

from ..errors import KernelError, UsageError
from ..terminal import escape_terminal

__all__ = [
    "BAD_INPUT",
    "FAILED",
    "INTERRUPTED",
    "OK",
    "error_line",
    "exit_code",
    "report",
    "single_leaf",
]

OK = 0
FAILED = 1
BAD_INPUT = 2
INTERRUPTED = 130


def single_leaf(exc: BaseException) -> BaseException:
    """The one exception inside (nested) groups of one, or ``exc`` itself."""
    while isinstance(exc, BaseExceptionGroup) and len(exc.exceptions) == 1:
        exc = exc.exceptions[0]
    return exc


def exit_code(exc: BaseException) -> int:
    """The exit code ``tak`` ends with when a command raised ``exc``.

    A group of several: interrupted if any part was Ctrl-C, bad input only if
    every part was, else failed.
    """
    exc = single_leaf(exc)
    if isinstance(exc, BaseExceptionGroup):
        codes = {exit_code(inner) for inner in exc.exceptions}
        if INTERRUPTED in codes:
            return INTERRUPTED
        return BAD_INPUT if codes == {BAD_INPUT} else FAILED
    if isinstance(exc, KeyboardInterrupt):
        return INTERRUPTED
    if isinstance(exc, SystemExit):
        if exc.code is None:
            return OK
        return exc.code if isinstance(exc.code, int) else FAILED
    if isinstance(exc, UsageError):
        return BAD_INPUT
    return FAILED


def error_line(prog: str, exc: BaseException) -> str:
    """``PROG: what went wrong``, one line, every terminal control escaped.

    ``prog`` is what the person typed, e.g. ``"tak batch"``.
    """
    exc = single_leaf(exc)
    if isinstance(exc, KeyboardInterrupt):
        reason = "interrupted"
    elif isinstance(exc, KernelError):
        reason = str(exc)
    elif isinstance(exc, OSError):
        where = f": {exc.filename}" if exc.filename else ""
        reason = f"{exc.strerror or exc}{where}"
    else:
        reason = f"internal error: {type(exc).__name__}: {exc} (run with --debug for the traceback)"
    return f"{prog}: {escape_terminal(reason)}"


def report(prog: str, exc: BaseException, *, file: TextIO | None = None) -> int:
    """Print ``error_line(prog, exc)`` to ``file`` (stderr) and return ``exit_code(exc)``."""
    print(error_line(prog, exc), file=sys.stderr if file is None else file)
    return exit_code(exc)
