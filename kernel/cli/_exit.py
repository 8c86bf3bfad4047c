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
``report`` prints it and returns the code. ``one_line_errors`` wraps a command's
handler with them; ``tak``'s own handler (``kernel.cli.main``) uses them for
whatever a handler let through.

This module imports only ``kernel.errors`` and ``kernel.terminal``: ``tak
--help`` stays cheap.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
from collections.abc import Callable
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
    "one_line_errors",
    "os_error_line",
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
        reason = os_error_line(exc)
    else:
        reason = f"internal error: {type(exc).__name__}: {exc} (run with --debug for the traceback)"
    return f"{prog}: {escape_terminal(reason)}"


def report(prog: str, exc: BaseException, *, file: TextIO | None = None) -> int:
    """Print ``error_line(prog, exc)`` to ``file`` (stderr) and return ``exit_code(exc)``."""
    print(error_line(prog, exc), file=sys.stderr if file is None else file)
    return exit_code(exc)


def os_error_line(exc: OSError) -> str:
    """An OS error in one line: the path (or paths) and the system's reason (not escaped:
    ``error_line`` escapes the whole line)."""
    reason = exc.strerror or str(exc) or type(exc).__name__
    if exc.filename is None:
        return reason
    path = os.fsdecode(exc.filename)
    if exc.filename2 is not None:
        path += f" -> {os.fsdecode(exc.filename2)}"
    return f"{path}: {reason}"


Handler = Callable[[argparse.Namespace], int]


def one_line_errors(prog: str) -> Callable[[Handler], Handler]:
    """Make a handler fail in one line on stderr that names the command (``prog``,
    e.g. ``"tak sessions show"``), never a traceback (unless ``tak --debug``), with
    the code of ``exit_code``.

    A ``KernelError`` or an ``OSError`` (even inside a Trio nursery's group) is
    reported here; Ctrl-C, a broken pipe and anything else go on to ``tak``'s own
    handler. The output is flushed here, so a reader that closed the pipe (``tak
    tools | head -1``) is seen while that handler can still end the command quietly.
    """

    def decorate(func: Handler) -> Handler:
        @functools.wraps(func)
        def handler(args: argparse.Namespace) -> int:
            try:
                code = func(args)
                sys.stdout.flush()
                return code
            except BaseException as exc:
                leaf = single_leaf(exc)
                if getattr(args, "debug", False) or isinstance(leaf, BrokenPipeError):
                    raise
                if isinstance(leaf, (KernelError, OSError)):
                    return report(prog, leaf)
                raise

        return handler

    return decorate
