"""Log records on the terminal, escaped: the one way ``tak`` writes a record to stderr.

A record quotes what it is about: a seed file's name (``task t1: seed link NAME
left out``), an MCP server's reason for ending, a worker's stderr, a client's
request. Written as it is, that text would put its controls on the terminal, and
a ``\\n`` in it would forge a log line of its own. ``EscapingFormatter`` passes the
message, the traceback and the stack through ``kernel.terminal.escape_terminal``
(a traceback keeps its newlines, every line after its first indented: no line of
it starts where a log line does).

Two paths write records to the terminal, and both use it:

- every command: a record that no handler takes goes to ``logging.lastResort``
  (WARNING and up, the message alone). ``terminal_logging`` replaces it while
  a command runs, so the records a command never meant to show are shown
  exactly as before, escaped;
- ``tak serve`` and ``tak mcp serve``: ``log_to_terminal`` puts one handler on
  the root logger, from INFO up, with time, level and logger name.

Both handlers write to whatever ``sys.stderr`` is when the record comes (as
``logging.lastResort`` does), so a test that captures stderr sees them.
"""

from __future__ import annotations

import contextlib
import logging
import sys
from collections.abc import Iterator
from typing import Any, TextIO

from ..terminal import escape_terminal

__all__ = ["EscapingFormatter", "log_to_terminal", "terminal_logging"]


class EscapingFormatter(logging.Formatter):
    """A ``logging.Formatter`` whose every line is escaped for the terminal."""

    def formatMessage(self, record: logging.LogRecord) -> str:
        return escape_terminal(super().formatMessage(record))

    def formatException(self, ei: Any) -> str:
        return _indented(super().formatException(ei))

    def formatStack(self, stack_info: str) -> str:
        return _indented(super().formatStack(stack_info))


def _indented(text: str) -> str:
    """Many lines of the kernel's own (a traceback), escaped, every line after the first
    indented: the last lines quote an exception's message, whose newlines must not
    start a line that passes for a log line of its own."""
    return escape_terminal(text, keep_newlines=True).replace("\n", "\n  ")


class _StderrHandler(logging.StreamHandler[TextIO]):
    """A handler writing to the current ``sys.stderr`` (as ``logging.lastResort`` does)."""

    def __init__(self, level: int, fmt: str) -> None:
        logging.Handler.__init__(self, level)
        self.setFormatter(EscapingFormatter(fmt))

    @property
    def stream(self) -> TextIO:  # type: ignore[override]  # (read-only: stderr at the time)
        return sys.stderr


@contextlib.contextmanager
def terminal_logging() -> Iterator[None]:
    """While a command runs: a record no handler takes is written escaped (WARNING and
    up, its message alone, as ``logging.lastResort`` writes it). After it, what
    ``log_to_terminal`` set is undone (``kernel.cli.main`` may run in a test's process)."""
    root = logging.getLogger()
    before, level = logging.lastResort, root.level
    logging.lastResort = _StderrHandler(logging.WARNING, "%(message)s")
    try:
        yield
    finally:
        logging.lastResort = before
        _remove_ours(root)
        root.setLevel(level)


def log_to_terminal() -> None:
    """The servers' log lines on stderr, from INFO up, each escaped for the terminal
    (once the command's input is checked: a refusal is one line, nothing logged first).

    One handler on the root logger, however often this is called.
    """
    root = logging.getLogger()
    _remove_ours(root)
    root.addHandler(_StderrHandler(logging.INFO, "%(asctime)s %(levelname)s %(name)s: %(message)s"))
    if root.level > logging.INFO:
        root.setLevel(logging.INFO)


def _remove_ours(root: logging.Logger) -> None:
    for handler in [h for h in root.handlers if isinstance(h, _StderrHandler)]:
        root.removeHandler(handler)
