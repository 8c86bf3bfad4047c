"""``tak batch run``, ``resume`` and ``worker`` (the parser is ``kernel.cli.batch``'s;
docs/batch.md): the flags become a ``kernel.batch.RunSettings``, which the run's ledger
keeps, so ``resume`` and every ``worker`` run the same way; ``run_batch`` runs the
tasks under a ``ProgressView``; the summary is printed.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import signal
import stat
import sys
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import AbstractAsyncContextManager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import attrs

from ..errors import UsageError
from ..home import STORE_URL_ENV, TakHome
from ..terminal import escape_terminal
from ._batch_limits import check_concurrency
from ._batch_progress import TTY_REDRAW_S, ProgressView
from ._batch_show import request_timeout_s, runs_dir, summary_text
from ._batch_show import run_dir as find_run_dir
from ._common import ensure_home, home_option, tak_command
from ._exit import one_line_errors
from .run import model_settings, tool_patterns

if TYPE_CHECKING:
    from ..batch import BatchTask, Ledger, RunSettings
    from ..kernel import Kernel
    from ..store import SessionStore

#: What a start that stopped before writing its manifest may leave in a run's directory.
LEFT_BY_A_START = frozenset({"lock", "manifest.json.tmp"})
#: How ``RunSettings.differences`` are named to the user: as the flags that set them.
FLAGS = {"fallbacks": "--fallback", "plugins": "--plugin", "settings": "model settings",
         "limits": "limits"}  # fmt: skip

OpenLedger = Callable[[dict[str, Any] | None], AbstractAsyncContextManager["Ledger"]]


# --- what a run was started with --------------------------------------------


def _settings_of(args: argparse.Namespace) -> RunSettings:
    """The run's settings from ``tak batch run``'s flags.

    Raises:
        UsageError: a bad value, naming its flag.
    """
    from ..batch import RunSettings, TaskLimits

    check_concurrency(args.concurrency)
    given = {
        name: getattr(args, name)
        for name in ("max_steps", "max_tokens", "max_cost", "wall_time")
        if getattr(args, name) is not None
    }
    for name, value in given.items():
        try:
            TaskLimits(**{name: value})
            # a limit of inf is no limit, and JSON cannot keep it (an int, however
            # big, is finite: math.isfinite would overflow on one past a float's range)
            if isinstance(value, float) and not math.isfinite(value):
                raise UsageError(name)
        except UsageError:
            flag = "--" + name.replace("_", "-")
            raise UsageError(f"{flag}: expected a positive number, got {value}") from None
    # run.model_settings reads every model flag of `tak run`; batch offers a few (its
    # --max-tokens is a task's limit: a reply's is --set max_tokens=N).
    flags = argparse.Namespace(
        set=args.set,
        temperature=args.temperature,
        top_p=None,
        max_tokens=None,
        stop=None,
        seed=args.seed,
        tool_choice=None,
        parallel_tool_calls=None,
        reasoning_effort=args.reasoning_effort,
    )
    settings = model_settings(flags)
    tools = tool_patterns(args)
    return RunSettings(
        model=args.model,
        fallbacks=tuple(args.fallback),
        system=args.system,
        plugins=tuple(_plugin_specs(args.plugin)),
        tools=None if tools is None else tuple(tools),
        settings=RunSettings.settings_json(settings),
        limits=TaskLimits(**given),
        concurrency=args.concurrency,
    )


def _check_progress_every(value: float) -> None:
    # Lines come at most every TTY_REDRAW_S: less (0 too) would not be what it says.
    if not (math.isfinite(value) and value >= TTY_REDRAW_S):
        raise UsageError(
            f"--progress-every: expected at least {TTY_REDRAW_S:g} seconds, got {value:g}"
        )


def _plugin_specs(specs: Sequence[str]) -> list[str]:
    """``--plugin``s as a run keeps them: a path made absolute (``resume`` may be run
    from another directory), a name or module as given."""
    from plugins import source_for

    return [
        source.target if (source := source_for(spec)).kind == "path" else spec for spec in specs
    ]


def _check_tasks_file(path: Path) -> None:
    """Refuse what is not a regular file before reading it: a device or a pipe may
    never end (``/dev/zero``), and a run's tasks are read whole, to the end.

    Raises:
        UsageError: ``PATH: cannot read the task file: ...``.
    """
    try:
        mode = path.stat().st_mode
    except OSError as exc:
        raise UsageError(f"{path}: cannot read the task file: {exc.strerror}") from None
    if stat.S_ISDIR(mode):
        raise UsageError(f"{path}: cannot read the task file: Is a directory")
    if not stat.S_ISREG(mode):
        raise UsageError(
            f"{path}: cannot read the task file: not a regular file (a device or a pipe; "
            "write the tasks to a file)"
        )


# --- where runs live --------------------------------------------------------


def _default_run_id(args: argparse.Namespace) -> str:
    """``--run-id``, else ``--out``'s name, else the tasks file's stem (its characters
    outside ``A-Z a-z 0-9 . _ -`` made ``-``, cut to a run id's length).

    Raises:
        UsageError: ``--run-id`` is not a valid id, or no id can be made of the name
            (``--out 評価``), naming the name and ``--run-id``.
    """
    import re

    from ..batch import MAX_RUN_ID, check_run_id

    if args.run_id is not None:
        check_run_id(args.run_id, "--run-id")
        return str(args.run_id)
    if args.out is not None:
        name, where = args.out.absolute().name, f"--out {args.out}"
    else:
        name, where = args.tasks.stem, str(args.tasks)
    run_id = re.sub(r"[^A-Za-z0-9._-]", "-", name).lstrip("._-")[:MAX_RUN_ID]
    run_id = run_id.replace("..", "-")
    try:
        check_run_id(run_id, "run id")
    except UsageError:
        raise UsageError(
            f"{where}: no run id can be made of its name {name!r} (an id is 1-{MAX_RUN_ID} "
            "of A-Z a-z 0-9 . _ -); give one with --run-id"
        ) from None
    return run_id


def _check_run_dir(run_dir: Path) -> None:
    """Refuse a directory for a new run that holds something else: it is the user's.

    Raises:
        UsageError: ``run_dir`` is not a directory, or holds files and no run.
    """
    if run_dir.is_symlink() and not run_dir.exists():
        raise UsageError(
            f"{run_dir}: leads to {run_dir.readlink()}, which is gone; remove the link "
            "or give another --run-id"
        )
    if not run_dir.exists():
        return
    if not run_dir.is_dir():
        raise UsageError(f"{run_dir}: not a directory; give --out a new or empty directory")
    if (run_dir / "manifest.json").exists():
        return
    others = sorted(p.name for p in run_dir.iterdir() if p.name not in LEFT_BY_A_START)
    if others:
        shown = ", ".join(others[:3]) + (", ..." if len(others) > 3 else "")
        raise UsageError(
            f"{run_dir}: holds other files ({shown}) and no run (no manifest.json); "
            "give --out a new or empty directory"
        )


def _check_link(home: str | None, run_id: str, run_dir: Path) -> Path | None:
    """Where ``<home>/batch/<run_id>`` is to lead to ``run_dir``; ``None`` when it does.

    Raises:
        UsageError: the id names another run.
    """
    link = runs_dir(home) / run_id
    if link.absolute() == run_dir.absolute():
        return None
    if link.is_symlink() or link.exists():
        if link.resolve() == run_dir.resolve():
            return None
        raise UsageError(
            f"run id {run_id!r} is taken by {link.resolve()}; give another with --run-id"
        )
    return link


def _link_run(home: str | None, run_id: str, run_dir: Path) -> None:
    """Make ``<home>/batch/<run_id>`` lead to ``run_dir`` (a link when it is elsewhere).

    Raises:
        UsageError: the id names another run.
    """
    link = _check_link(home, run_id, run_dir)
    if link is not None:
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(run_dir.absolute(), target_is_directory=True)


def _store_url(args: argparse.Namespace) -> str:
    url = args.store or os.environ.get(STORE_URL_ENV)
    if not url:
        raise UsageError(f"--store URL is needed (or ${STORE_URL_ENV})")
    return str(url)


# --- tak batch run / resume / worker -----------------------------------------


@one_line_errors("tak batch")
def cmd_run(args: argparse.Namespace) -> int:
    from ..batch import TasksFile, load_tasks

    _check_progress_every(args.progress_every)
    given = _settings_of(args)
    _check_tasks_file(args.tasks)
    tasks = load_tasks(args.tasks)  # UsageError: "FILE:LINE: $.path: ..."
    if not tasks:
        raise UsageError(f"{args.tasks}: no tasks (a task is a JSON object a line: docs/batch.md)")
    given = attrs.evolve(given, tasks_file=TasksFile.of(args.tasks))
    ensure_home(args.home)
    run_id = _default_run_id(args)
    if args.store is not None:
        url = _store_url(args)

        def open_postgres(settings: dict[str, Any] | None) -> Any:
            from ..batch import open_postgres_ledger

            return open_postgres_ledger(
                url, run_id, settings=settings, request_timeout_s=request_timeout_s(args.home)
            )

        return _drive(args, open_postgres, tasks=tasks, given=given, run_dir=None, shared=url)
    run_dir = (args.out if args.out is not None else runs_dir(args.home) / run_id).absolute()
    data = TakHome.locate(args.home).data.resolve()
    if run_dir.resolve().is_relative_to(data):
        # its tasks' workspaces would be refused, one by one (sandbox._overlap)
        raise UsageError(
            f"--out {args.out}: lies inside the home's data ({data}), where no task's "
            "workspace may be; choose another directory"
        )
    _check_run_dir(run_dir)
    _check_link(args.home, run_id, run_dir)  # before anything is made

    @contextlib.asynccontextmanager
    async def open_directory(settings: dict[str, Any] | None) -> AsyncIterator[Ledger]:
        from ..batch import open_run_dir

        async with open_run_dir(run_dir, run_id=run_id, settings=settings) as ledger:
            # once the run is there: a start that failed keeps no id
            _link_run(args.home, run_id, run_dir)
            yield ledger

    return _drive(args, open_directory, tasks=tasks, given=given, run_dir=run_dir)


@one_line_errors("tak batch resume")
def cmd_resume(args: argparse.Namespace) -> int:
    check_concurrency(args.concurrency)
    _check_progress_every(args.progress_every)
    run_dir = find_run_dir(args.home, args.run)

    def open_directory(settings: dict[str, Any] | None) -> Any:
        from ..batch import open_run_dir

        return open_run_dir(run_dir, create=False)

    return _drive(args, open_directory, run_dir=run_dir, concurrency=args.concurrency)


@one_line_errors("tak batch worker")
def cmd_worker(args: argparse.Namespace) -> int:
    from ..batch import check_run_id

    check_concurrency(args.concurrency)
    _check_progress_every(args.progress_every)
    check_run_id(args.run, "--run")
    url = _store_url(args)
    ensure_home(args.home)

    def open_postgres(settings: dict[str, Any] | None) -> Any:
        from ..batch import open_postgres_ledger

        return open_postgres_ledger(
            url, args.run, create=False, request_timeout_s=request_timeout_s(args.home)
        )

    return _drive(args, open_postgres, run_dir=None, concurrency=args.concurrency, shared=url)


def _drive(
    args: argparse.Namespace,
    open_ledger: OpenLedger,
    *,
    tasks: Sequence[BatchTask] | None = None,
    given: RunSettings | None = None,
    run_dir: Path | None,
    concurrency: int | None = None,
    shared: str | None = None,
) -> int:
    """Open the run's ledger and a kernel as the run says, run the tasks showing
    progress, print the summary; the exit status.

    ``tasks`` and ``given`` come from ``tak batch run`` (the tasks are added, the
    command becomes the settings of a new run and must match an existing one's);
    ``None``: the ledger holds them (resume, a worker). ``shared``: the PostgreSQL
    URL of a run many hosts share, whose sessions live there too (a worker taking
    over a task whose lease lapsed continues its transcript).
    """
    import trio

    from ..batch import RunSettings

    async def main() -> int:
        async with contextlib.AsyncExitStack() as stack:
            sessions = None
            if shared is not None:
                from ..store import PostgresStore

                sessions = await stack.enter_async_context(
                    PostgresStore(
                        shared,
                        retry_lost_connections=True,
                        request_timeout_s=request_timeout_s(args.home),
                    )
                )
            if given is not None:
                # Checked before the run is made: a mistake is not kept as its settings.
                kernel = await stack.enter_async_context(_open_kernel(args, given, sessions))
                await kernel.check_run(
                    model=given.model, settings=given.model_settings(), tools=given.tools
                )
                ledger = await stack.enter_async_context(open_ledger(given.to_json()))
                command = RunSettings.of_ledger(ledger)
                _check_tasks_file_of(ledger.run_id, command, given)
                changed = [FLAGS.get(f, f"--{f}") for f in command.differences(given)]
                if changed:
                    raise UsageError(
                        f"run {ledger.run_id!r} was started with other {', '.join(changed)}; "
                        "run it as it was (tak batch resume) or give a new --run-id"
                    )
                command = given
            else:
                ledger = await stack.enter_async_context(open_ledger(None))
                command = RunSettings.of_ledger(ledger)
                kernel = await stack.enter_async_context(_open_kernel(args, command, sessions))
            if concurrency is not None:
                command = attrs.evolve(command, concurrency=concurrency)
            workspace_root = None
            if run_dir is None:  # PostgreSQL: each host keeps its tasks' workspaces
                workspace_root = runs_dir(args.home) / ledger.run_id / "workspaces"
            return await _run_with_progress(
                args, kernel, ledger, tasks, command, run_dir, workspace_root
            )
        raise AssertionError("unreachable")  # mypy: an exit stack may swallow an exception

    return trio.run(main)


def _check_tasks_file_of(run_id: str, command: RunSettings, given: RunSettings) -> None:
    """Refuse to add another file's tasks to a run (two ``tasks.jsonl`` of two
    projects are one run ``tasks`` by name alone).

    Raises:
        UsageError: the run was started with another tasks file.
    """
    first, now = command.tasks_file, given.tasks_file
    if first is None or now is None or first.is_the_file_of(now):
        return
    raise UsageError(
        f"run {run_id!r} has the tasks of {first.path}, not of {now.path}; give this "
        "file's run its own --run-id"
    )


def _open_kernel(
    args: argparse.Namespace, command: RunSettings, sessions: SessionStore | None
) -> AbstractAsyncContextManager[Kernel]:
    from ..kernel import open_kernel

    return open_kernel(
        home=args.home,
        model=command.model,
        fallbacks=command.fallbacks,
        store=sessions,
        # the run's plugins, and any `tak --plugin` of this command
        extra_plugins=[*command.plugins, *_new(_plugin_specs(args.plugin), command.plugins)],
        system=command.system,
    )


async def _run_with_progress(
    args: argparse.Namespace,
    kernel: Kernel,
    ledger: Ledger,
    tasks: Sequence[BatchTask] | None,
    command: RunSettings,
    run_dir: Path | None,
    workspace_root: Path | None,
) -> int:
    """``run_batch`` with a progress view, stopped cleanly by the first Ctrl-C or
    SIGTERM (``kill``, ``docker stop``, systemd): exit status 128 + the signal's number."""
    import trio

    from ..batch import run_batch

    view = ProgressView(sys.stderr, kernel, every=args.progress_every)
    stopped_by: signal.Signals | None = None
    async with trio.open_nursery() as nursery:
        run_scope = trio.CancelScope()

        async def stop_on_signal() -> None:
            nonlocal stopped_by
            with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
                async for number in signals:
                    if stopped_by is not None:  # a second: stop waiting for the records
                        _die_of(number)
                    stopped_by = signal.Signals(number)
                    name = "" if number == signal.SIGINT else f" ({stopped_by.name})"
                    view.note(
                        f"tak batch: stopping{name}; the running tasks are recorded cancelled"
                    )
                    run_scope.cancel()

        nursery.start_soon(stop_on_signal)
        nursery.start_soon(view.redraw)
        with run_scope:
            await run_batch(
                kernel,
                tasks,
                ledger=ledger,
                model=command.model,
                settings=command.model_settings(),
                tools=command.tools,
                max_concurrency=command.concurrency,
                limits=command.limits,
                workspace_root=workspace_root,
                on_progress=view.update,
            )
        nursery.cancel_scope.cancel()
    view.finish(show=stopped_by is None)  # stopped, its last line is out of date
    results = await ledger.results()
    counts = await ledger.counts()
    print(summary_text(ledger.run_id, results, counts.total, run_dir, ledger.session_project))
    sys.stdout.flush()
    if stopped_by is not None:
        resume = _resume_command(args, ledger.run_id, run_dir, command)
        how = "interrupted" if stopped_by == signal.SIGINT else "terminated"
        print(escape_terminal(f"tak batch: {how}; to finish the run: {resume}"), file=sys.stderr)
        return 128 + stopped_by
    return 0


def _die_of(number: int) -> None:
    """Stop now, as the signal ``number`` stops a process that does not handle it
    (a second Ctrl-C is ``KeyboardInterrupt``: ``tak`` exits 130)."""
    if number == signal.SIGINT:
        raise KeyboardInterrupt
    signal.signal(number, signal.SIG_DFL)
    os.kill(os.getpid(), number)
    raise KeyboardInterrupt  # not reached: the default action ends the process


def _new(names: Sequence[str], known: Sequence[str]) -> list[str]:
    return [name for name in names if name not in known]


def _resume_command(
    args: argparse.Namespace, run_id: str, run_dir: Path | None, command: RunSettings
) -> str:
    """The command that finishes the run, as a person can paste it here."""
    home = home_option(args.home)
    if run_dir is None:  # a PostgreSQL run: a worker takes the rest
        store = ("--store", args.store) if args.store else ()
        return tak_command(*home, "batch", "worker", "--run", run_id, *store)
    linked = runs_dir(args.home) / run_id
    by_id = linked.exists() and linked.resolve() == run_dir.resolve()
    return tak_command(*home, "batch", "resume", run_id if by_id else str(run_dir))
