"""``tak batch``: one agent over a file of tasks, concurrent and resumable (docs/batch.md).

::

    tak batch run TASKS.jsonl [options]    # or, for short: tak batch TASKS.jsonl [options]
    tak batch resume RUN                   # the unfinished tasks of RUN (its settings kept)
    tak batch ls                           # the runs under the home
    tak batch show RUN [--json]            # a run's summary, its failed tasks
    tak batch worker --run RUN --store URL # one of many hosts sharing a run in PostgreSQL

A run lives in a directory: ``--out DIR`` (new, empty, or a run's), else
``<home>/batch/<run-id>`` (a run elsewhere is linked there under its id, so
``ls``, ``show`` and ``resume`` find it by id). Its id is ``--run-id``, else
``DIR``'s name, else the tasks file's stem: running the same command again
continues the same run, and finished tasks are not run again. Another tasks
file's tasks are not added to a run (give that file's run its own ``--run-id``).

Exit status (``tak``'s one rule, ``kernel.cli._exit``): 0 when the command ran to
its end (every task it could claim has a result; a task that failed is a result,
see ``tak batch show``); 2 when what it was given is wrong (a bad tasks file,
flag or run); 1 when it could not run it (an OS error, the database failed or
stalled, a ``StoreError``); 130 when stopped with Ctrl-C, 143 with SIGTERM
(running tasks are recorded ``cancelled`` and the printed ``tak batch resume``
command finishes them).
"""

from __future__ import annotations

import argparse
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from ._batch_limits import MAX_CONCURRENCY

#: How often a progress line is printed when stderr is not a terminal (seconds).
LINE_EVERY_S = 5.0
#: ``kernel.home.STORE_URL_ENV`` (importing kernel.home would slow ``tak --help``).
STORE_URL_ENV = "TAK_STORE_URL"


class _Commands(argparse._SubParsersAction):  # type: ignore[type-arg]
    """``tak batch``'s commands, where a first word that names none is ``run``'s
    tasks file: ``tak batch tasks.jsonl`` is ``tak batch run tasks.jsonl``.

    (A tasks file named like a command is given as ``tak batch run ls``.)
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.choices = _CommandOrFile(self._name_parser_map)  # type: ignore[assignment]

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        if values and values[0] not in self._name_parser_map:
            values = ["run", *values]
        super().__call__(parser, namespace, values, option_string)


class _CommandOrFile(Mapping[str, argparse.ArgumentParser]):
    """The commands, as argparse checks a first word against them before the action
    sees it: any word passes here (the action makes a file ``run``'s)."""

    def __init__(self, commands: dict[str, argparse.ArgumentParser]) -> None:
        self.commands = commands

    def __contains__(self, key: object) -> bool:
        return True

    def __getitem__(self, key: str) -> argparse.ArgumentParser:
        return self.commands[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self.commands)

    def __len__(self) -> int:
        return len(self.commands)


def add_commands(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    group = sub.add_parser(
        "batch",
        help="run an agent over a file of tasks (concurrent, resumable)",
        usage="%(prog)s TASKS.jsonl [options]  (short for: %(prog)s run TASKS.jsonl ...)\n"
        "       %(prog)s {run,resume,ls,show,worker} ...",
        description="Run an agent over a file of tasks: one session and one workspace per "
        "task, concurrent, resumable (docs/batch.md). `tak batch TASKS.jsonl ...` is "
        "short for `tak batch run TASKS.jsonl ...`.",
        epilog="exit status: 0 the command ran to its end (failed tasks are results: see "
        "`tak batch show`), 2 bad input, 1 it could not run (an OS error, the store), "
        "130 stopped by Ctrl-C, 143 by SIGTERM (resume with the command it prints)",
    )
    commands = group.add_subparsers(
        dest="batch_command",
        metavar="COMMAND",
        required=True,
        action=_Commands,
        prog=group.prog,  # not from the usage above: "tak batch show", not the two lines
    )

    p = commands.add_parser(
        "run",
        help="run the tasks of a JSONL file (re-running continues the same run)",
        description="Run every task of TASKS (one JSON object a line: docs/batch.md). The "
        "same command again continues the run: finished tasks are not run again.",
    )
    p.add_argument("tasks", type=Path, metavar="TASKS", help="the tasks file (.jsonl)")
    p.add_argument(
        "--out",
        type=Path,
        metavar="DIR",
        help="the run's directory: new, empty or a run's (default: <home>/batch/<run-id>)",
    )
    p.add_argument(
        "--run-id",
        metavar="ID",
        help="the run's id (default: DIR's name, else the tasks file's stem)",
    )
    _kernel_options(p)
    _store_option(p, "claim the tasks from this PostgreSQL run (adds them first) with "
                  "other `tak batch worker`s")  # fmt: skip
    p.set_defaults(func=_handler("cmd_run"))

    p = commands.add_parser(
        "resume",
        help="finish a run's unfinished tasks, with the settings it was started with",
    )
    p.add_argument("run", metavar="RUN", help="a run id (tak batch ls) or a run's directory")
    p.add_argument(
        "--concurrency", type=int, metavar="N", help="tasks at once (default: the run's)"
    )
    _progress_option(p)
    p.set_defaults(func=_handler("cmd_resume"))

    p = commands.add_parser("ls", help="the runs under the home, newest first")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=_handler("cmd_ls", "_batch_show"))

    p = commands.add_parser("show", help="a run's summary table and its failed tasks")
    p.add_argument("run", metavar="RUN", help="a run id (tak batch ls) or a run's directory")
    p.add_argument("--json", action="store_true", help="print JSON")
    _store_option(p, "read the run from this PostgreSQL store")
    p.set_defaults(func=_handler("cmd_show", "_batch_show"))

    p = commands.add_parser(
        "worker",
        help="claim and run tasks of a PostgreSQL run (as many as you like, on any hosts)",
        description="Claim tasks of RUN from PostgreSQL and run them, as the run was started "
        "(`tak batch run TASKS --store URL`: its model, tools, limits), until none is left.",
    )
    p.add_argument("--run", required=True, metavar="RUN", help="the run's id")
    _store_option(p, f"the PostgreSQL store holding the run (default: ${STORE_URL_ENV})")
    p.add_argument(
        "--concurrency", type=int, metavar="N", help="tasks at once (default: the run's)"
    )
    _progress_option(p)
    p.set_defaults(func=_handler("cmd_worker"))


def _store_option(p: argparse.ArgumentParser, text: str) -> None:
    p.add_argument("--store", metavar="URL", help=f"postgresql://...: {text}")


def _progress_option(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--progress-every",
        type=float,
        default=LINE_EVERY_S,
        metavar="SECONDS",
        help="when stderr is not a terminal: a progress line this often, at least 0.1 "
        f"(default {LINE_EVERY_S:g})",
    )


def _kernel_options(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model", default="scripted:demo", help="provider:model (default scripted:demo)"
    )
    p.add_argument(
        "--fallback", action="append", default=[], help="model to try when the first fails"
    )
    p.add_argument("--system", help="system prompt")
    p.add_argument(
        "--concurrency",
        type=int,
        default=10,
        metavar="N",
        help=f"tasks at once, 1 to {MAX_CONCURRENCY:,} (default 10)",
    )
    p.add_argument(
        "--tools",
        action="append",
        metavar="NAME[,NAME...]",
        help="offer only these tools (names or patterns such as 'read_*'; repeatable)",
    )
    limits = p.add_argument_group(
        "limits per task", 'a task\'s own limits (its "limits" field) win over these'
    )
    limits.add_argument("--max-steps", type=int, metavar="N", help="model requests")
    limits.add_argument("--max-tokens", type=int, metavar="N", help="tokens, in and out")
    limits.add_argument("--max-cost", type=float, metavar="USD", help="US dollars")
    limits.add_argument("--wall-time", type=float, metavar="SECONDS", help="seconds, all told")
    model = p.add_argument_group(
        "model settings", "what each model request asks for (docs/models.md, Settings)"
    )
    model.add_argument("--temperature", metavar="F", help="sampling temperature, 0 to 2")
    model.add_argument("--seed", metavar="N", help="sampling seed")
    model.add_argument("--reasoning-effort", metavar="E", help="minimal, low, medium or high")
    model.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="any setting (VALUE as JSON, else a string), e.g. max_tokens=512 for the "
        "tokens of one reply; extra.KEY for a provider's own request-body key (repeatable)",
    )
    _progress_option(p)


def _handler(name: str, module: str = "_batch") -> Any:
    """The handler ``name`` of ``kernel.cli.<module>``, imported when the command runs
    (it needs attrs and the kernel: ``tak --help`` must not pay for them)."""

    def handler(args: argparse.Namespace) -> int:
        import importlib

        code: int = getattr(importlib.import_module(f"{__package__}.{module}"), name)(args)
        return code

    return handler


__all__ = ["LINE_EVERY_S", "STORE_URL_ENV", "add_commands"]
