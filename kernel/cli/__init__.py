"""The ``tak`` command.

Each command group lives in its own module with ``add_commands(subparsers)``;
a handler takes the parsed ``argparse.Namespace`` and returns the exit code.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence


def build_parser() -> argparse.ArgumentParser:
    from .. import __version__

    parser = argparse.ArgumentParser(prog="tak", description="trio-agent-kernel")
    parser.add_argument("--version", action="version", version=f"tak {__version__}")
    parser.add_argument("--home", help="TAK_HOME directory (default: $TAK_HOME or ~/.tak)")
    parser.add_argument(
        "--plugin",
        action="append",
        default=[],
        metavar="NAME",
        help="load this plugin too (a name, module or .py path; e.g. demo)",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    from . import doctor, plugins, run, serve, sessions, tools

    for group in (tools, run, sessions, doctor, plugins, serve):
        group.add_commands(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    func = getattr(args, "func", None)
    if func is None:
        parser.print_help()
        return 2
    code: int = func(args)
    return code


if __name__ == "__main__":
    sys.exit(main())
