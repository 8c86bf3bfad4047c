"""The ``tak`` command.

Each command group lives in its own module with ``add_commands(subparsers)``;
a handler takes the parsed ``argparse.Namespace`` and returns the exit code, by
the one rule of ``kernel.cli._exit`` (0 ok, 1 failed, 2 bad input, 130
interrupted: docs/cli.md); what it raises is mapped by the same rule here.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from types import TracebackType
from typing import NoReturn

from ._exit import BAD_INPUT, INTERRUPTED, OK, report, single_leaf

#: ``kernel.home.DEFAULT_PROJECT``, spelled here: importing ``kernel.home`` (attrs,
#: tomllib) would cost ``tak --help`` a fifth of its time. tests/test_cli.py checks
#: that the two agree.
DEFAULT_PROJECT = "default"


class _Parser(argparse.ArgumentParser):
    """A parser whose usage errors are one line; ``--help`` shows the usage.

    (argparse's own prints the whole usage first, and a person looks for the
    error among it. Sub-commands' parsers are made of this class too.)
    """

    def error(self, message: str) -> NoReturn:
        # The message quotes the words given (``unrecognized arguments: ...``), and a
        # command pasted from a hint or a page may carry a hostile name: escaped.
        from ..terminal import escape_terminal

        hint = _plugin_hint(message)
        if hint is not None:
            self.exit(2, escape_terminal(f"{self.prog}: {message}: {hint}") + "\n")
        self.exit(2, escape_terminal(f"{self.prog}: {message} (see {self.prog} --help)") + "\n")


def _plugin_hint(message: str) -> str | None:
    """Where ``--plugin`` goes, when it came after the command (``tak batch T --plugin
    demo``): it is ``tak``'s own option, before the command."""
    if not message.startswith("unrecognized arguments:"):
        return None
    words = message.removeprefix("unrecognized arguments:").split()
    names = [
        words[i + 1] if word == "--plugin" else word.removeprefix("--plugin=")
        for i, word in enumerate(words)
        if (word == "--plugin" and i + 1 < len(words)) or word.startswith("--plugin=")
    ]
    if not names:
        return None
    before = " ".join(f"--plugin {name}" for name in names)
    return f"--plugin is an option of tak, before the command: tak {before} COMMAND ..."


#: Kept for the command modules that import it from here (use ``._exit.single_leaf``).
_single_leaf = single_leaf


def build_parser() -> argparse.ArgumentParser:
    from .._version import __version__

    parser = _Parser(prog="tak", description="trio-agent-kernel")
    parser.add_argument("--version", action="version", version=f"tak {__version__}")
    parser.add_argument("--home", help="TAK_HOME directory (default: $TAK_HOME or ~/.tak)")
    parser.add_argument(
        "--debug", action="store_true", help="on an error, show the whole traceback"
    )
    parser.add_argument(
        "--plugin",
        action="append",
        default=[],
        metavar="NAME",
        help="load this plugin too (a name, module or .py path; e.g. demo)",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    from . import batch, doctor, mcp, plugins, run, serve, sessions, tools

    for group in (tools, run, batch, sessions, doctor, plugins, serve, mcp):
        group.add_commands(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    func = getattr(args, "func", None)
    if func is None:
        parser.print_help()
        return BAD_INPUT
    from ._terminal_log import terminal_logging

    try:
        with terminal_logging():  # a log record on the terminal: escaped
            code: int = func(args)
    except BaseException as exc:
        # Errors come out of nurseries wrapped in groups; a person wants the one line.
        leaf = _single_leaf(exc)
        if isinstance(leaf, KeyboardInterrupt):
            print(f"\ntak {args.command}: interrupted", file=sys.stderr)
            return INTERRUPTED
        if isinstance(leaf, BrokenPipeError) and _stdout_closed():
            # `tak tools | head`: the reader has what it wanted. Further writes
            # (the interpreter's own flush at exit) go nowhere. (A broken pipe to
            # a worker or a server is an error like any other, below.)
            _quiet_stdout()
            return OK
        if args.debug and not isinstance(leaf, SystemExit):
            # The traceback asked for, printed by the interpreter as it leaves: its
            # messages may quote a plugin, a model or a workspace, so escaped.
            sys.excepthook = _escaped_traceback
        if args.debug or isinstance(leaf, SystemExit):
            raise
        return report(f"tak {args.command}", leaf)
    return code


def _escaped_traceback(
    kind: type[BaseException], value: BaseException, tb: TracebackType | None
) -> None:
    """``sys.excepthook`` for ``tak --debug``: the whole traceback, every line escaped
    for the terminal (newlines kept)."""
    import traceback

    from ..terminal import escape_terminal

    text = "".join(traceback.format_exception(kind, value, tb))
    sys.stderr.write(escape_terminal(text, keep_newlines=True))
    sys.stderr.flush()


def _stdout_closed() -> bool:
    """Whether stdout's reader has gone (a flush fails with a broken pipe, or the
    pipe reports an error: a write end whose read end is closed polls POLLERR)."""
    try:
        sys.stdout.flush()
    except BrokenPipeError:
        return True
    except (OSError, ValueError):
        return False
    try:
        import select

        poller = select.poll()
        poller.register(sys.stdout.fileno(), select.POLLOUT)
        return any(events & select.POLLERR for _, events in poller.poll(0))
    except (OSError, ValueError, AttributeError):
        return False


def _quiet_stdout() -> None:
    import os

    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError):
        pass


if __name__ == "__main__":
    sys.exit(main())


__all__ = ["DEFAULT_PROJECT", "build_parser", "main"]
