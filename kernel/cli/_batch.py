"""``tak batch``'s commands (the parser is ``kernel.cli.batch``'s; docs/batch.md).

What ``tak batch run`` was given (model, tools, limits, settings, plugins,
concurrency: a ``RunCommand``) is the run's settings, kept by its ledger (the
directory's ``manifest.json``, or the PostgreSQL run's row): ``resume`` and
``worker`` run the same way from them.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import math
import os
import signal
import stat
import sys
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import AbstractAsyncContextManager
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

import attrs
import cattrs

from ..errors import UsageError
from ..home import STORE_URL_ENV, TakHome
from ..terminal import escape_terminal
from ._batch_limits import check_concurrency
from ._common import ensure_home, home_option, tak_command
from ._exit import one_line_errors, os_error_line
from ._terminal_json import terminal_json
from .run import model_settings, tool_patterns

if TYPE_CHECKING:
    from ..batch import BatchProgress, BatchTask, Ledger, TaskLimits, TaskResult
    from ..kernel import Kernel
    from ..settings import ModelSettings
    from ..store import SessionStore

#: How often progress is redrawn on a terminal, at most (seconds).
TTY_REDRAW_S = 0.1
#: What a start that stopped before writing its manifest may leave in a run's directory.
LEFT_BY_A_START = frozenset({"lock", "manifest.json.tmp"})

OpenLedger = Callable[[dict[str, Any] | None], AbstractAsyncContextManager["Ledger"]]


# --- what a run was started with --------------------------------------------


@attrs.frozen(kw_only=True)
class TasksFile:
    """The tasks file a run was started with: another file's tasks are not added to it."""

    path: str  # resolved
    sha256: str  # of its bytes then

    @classmethod
    def of(cls, path: Path) -> TasksFile:
        """Blocking I/O (the file is read once more, to hash it)."""
        with open(path, "rb") as f:
            digest = hashlib.file_digest(f, "sha256").hexdigest()
        return cls(path=str(path.resolve()), sha256=digest)

    def is_the_file_of(self, other: TasksFile) -> bool:
        """The same file (its tasks may have grown since), or a copy of the run's first."""
        return self.path == other.path or self.sha256 == other.sha256


@attrs.frozen(kw_only=True)
class RunCommand:
    """What ``tak batch run`` was given: the run's settings in its ledger, so that
    ``resume`` and every ``worker`` open the same kernel and run the same way.

    ``concurrency`` is the first command's; ``resume`` and ``worker`` may give their own.
    ``tasks_file`` is ``None`` for a run made before it was kept.
    """

    model: str
    fallbacks: tuple[str, ...] = ()
    system: str | None = None
    plugins: tuple[str, ...] = ()
    tools: tuple[str, ...] | None = None
    settings: dict[str, Any] | None = None  # ModelSettings, as [model.settings] spells them
    limits: dict[str, float] = attrs.field(factory=dict)  # the TaskLimits fields given
    concurrency: int = 10
    tasks_file: TasksFile | None = None

    def model_settings(self) -> ModelSettings | None:
        from ..settings import settings_from_mapping

        return None if self.settings is None else settings_from_mapping(self.settings)

    def task_limits(self) -> TaskLimits:
        from ..batch import TaskLimits

        return TaskLimits(**self.limits)  # type: ignore[arg-type]

    def to_settings(self) -> dict[str, Any]:
        data: dict[str, Any] = json.loads(json.dumps(_converter.unstructure(self), allow_nan=False))
        return data

    @classmethod
    def from_settings(cls, run_id: str, settings: object) -> RunCommand:
        """The command a run was started with, from its ledger's settings.

        Raises:
            UsageError: the run was not started by ``tak batch`` (by ``run_batch``
                in a program, say): its settings say nothing of a model.
        """
        try:
            command: RunCommand = _converter.structure(settings, cls)
        except (cattrs.BaseValidationError, TypeError, ValueError, KeyError):
            raise UsageError(
                f"run {run_id!r} was not started by `tak batch run` (its settings name no "
                "model and tools); resume it from the program that started it"
            ) from None
        return command

    def differences(self, other: RunCommand) -> list[str]:
        """The fields (concurrency and the tasks file aside) where ``other`` differs, as flags."""
        own = ("concurrency", "tasks_file")
        names = [f.name for f in attrs.fields(RunCommand) if f.name not in own]
        flags = {"fallbacks": "--fallback", "plugins": "--plugin", "settings": "model settings",
                 "limits": "limits"}  # fmt: skip
        return [
            flags.get(name, f"--{name}")
            for name in names
            if getattr(self, name) != getattr(other, name)
        ]


_converter = cattrs.Converter(forbid_extra_keys=True)


def _command_of(args: argparse.Namespace) -> RunCommand:
    """The run's settings from ``tak batch run``'s flags.

    Raises:
        UsageError: a bad value, naming its flag.
    """
    from ..batch import TaskLimits

    check_concurrency(args.concurrency)
    given = {
        name: getattr(args, name)
        for name in ("max_steps", "max_tokens", "max_cost", "wall_time")
        if getattr(args, name) is not None
    }
    for name, value in given.items():
        try:
            TaskLimits(**{name: value})
            if not math.isfinite(value):  # a limit of inf is no limit; JSON cannot keep it
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
    return RunCommand(
        model=args.model,
        fallbacks=tuple(args.fallback),
        system=args.system,
        plugins=tuple(_plugin_specs(args.plugin)),
        tools=None if tools is None else tuple(tools),
        settings=None if settings is None else _settings_mapping(settings),
        limits=given,
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


def _settings_mapping(settings: ModelSettings) -> dict[str, Any]:
    """``settings`` as ``[model.settings]`` spells them: the fields that are set."""
    out: dict[str, Any] = {}
    for name, value in attrs.asdict(settings, recurse=False).items():
        if value is None:
            continue
        if isinstance(value, tuple):
            value = list(value)
        elif name == "extra":
            value = dict(value)
        out[name] = value
    return out


# --- where runs live --------------------------------------------------------


def runs_dir(home: str | None) -> Path:
    """``<home>/batch``: a directory (or a link to one) per run.

    Not under ``<home>/data``: a run's directory holds its tasks' workspaces, and
    a workspace may not lie inside the kernel's data (``sandbox._overlap``).
    """
    return TakHome.locate(home).root / "batch"


def _run_dir(home: str | None, run: str) -> Path:
    """The directory of ``run``: a run id under the home, or a path to a run's directory.

    Raises:
        UsageError: there is no such run.
    """
    from ..batch import check_run_id

    under_home = runs_dir(home) / run
    if os.sep not in run and run not in (".", "..") and (under_home / "manifest.json").is_file():
        return under_home
    given = Path(run)
    if (given / "manifest.json").is_file():
        return given.absolute()
    if os.sep in run:
        raise UsageError(f"{run}: not a batch run's directory (no manifest.json)")
    check_run_id(run, "RUN")
    raise UsageError(f"no run {run!r} under {runs_dir(home)} (see tak batch ls)")


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


def _settings_of(ledger: Ledger) -> object:
    """The run's settings: ``PostgresLedger.settings``, a directory's manifest."""
    settings = getattr(ledger, "settings", None)
    if settings is None:
        settings = getattr(getattr(ledger, "manifest", None), "settings", None)
    return settings


# --- tak batch run / resume / worker -----------------------------------------


@one_line_errors("tak batch")
def cmd_run(args: argparse.Namespace) -> int:
    from ..batch import load_tasks

    _check_progress_every(args.progress_every)
    given = _command_of(args)
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
                url, run_id, settings=settings, request_timeout_s=_request_timeout_s(args.home)
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
    run_dir = _run_dir(args.home, args.run)

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
            url, args.run, create=False, request_timeout_s=_request_timeout_s(args.home)
        )

    return _drive(args, open_postgres, run_dir=None, concurrency=args.concurrency, shared=url)


def _drive(
    args: argparse.Namespace,
    open_ledger: OpenLedger,
    *,
    tasks: Sequence[BatchTask] | None = None,
    given: RunCommand | None = None,
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
    import contextlib

    import trio

    async def main() -> int:
        async with contextlib.AsyncExitStack() as stack:
            sessions = None
            if shared is not None:
                from ..store import PostgresStore

                sessions = await stack.enter_async_context(
                    PostgresStore(
                        shared,
                        retry_lost_connections=True,
                        request_timeout_s=_request_timeout_s(args.home),
                    )
                )
            if given is not None:
                # Checked before the run is made: a mistake is not kept as its settings.
                kernel = await stack.enter_async_context(_open_kernel(args, given, sessions))
                await kernel.check_run(
                    model=given.model, settings=given.model_settings(), tools=given.tools
                )
                ledger = await stack.enter_async_context(open_ledger(given.to_settings()))
                command = RunCommand.from_settings(ledger.run_id, _settings_of(ledger))
                _check_tasks_file_of(ledger.run_id, command, given)
                changed = command.differences(given)
                if changed:
                    raise UsageError(
                        f"run {ledger.run_id!r} was started with other {', '.join(changed)}; "
                        "run it as it was (tak batch resume) or give a new --run-id"
                    )
                command = given
            else:
                ledger = await stack.enter_async_context(open_ledger(None))
                command = RunCommand.from_settings(ledger.run_id, _settings_of(ledger))
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


def _check_tasks_file_of(run_id: str, command: RunCommand, given: RunCommand) -> None:
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
    args: argparse.Namespace, command: RunCommand, sessions: SessionStore | None
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
    command: RunCommand,
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
                limits=command.task_limits(),
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
    args: argparse.Namespace, run_id: str, run_dir: Path | None, command: RunCommand
) -> str:
    """The command that finishes the run, as a person can paste it here."""
    home = home_option(args.home)
    if run_dir is None:  # a PostgreSQL run: a worker takes the rest
        store = ("--store", args.store) if args.store else ()
        return tak_command(*home, "batch", "worker", "--run", run_id, *store)
    linked = runs_dir(args.home) / run_id
    by_id = linked.exists() and linked.resolve() == run_dir.resolve()
    return tak_command(*home, "batch", "resume", run_id if by_id else str(run_dir))


# --- progress ----------------------------------------------------------------


class ProgressView:
    """A run's progress on ``out``: on a terminal one line redrawn (at most every
    ``TTY_REDRAW_S``); else a plain line every ``every`` seconds when something
    changed, and one at the end."""

    def __init__(self, out: IO[str], kernel: Kernel, *, every: float) -> None:
        self.out = out
        self.tty = out.isatty()
        self.kernel = kernel
        self.every = TTY_REDRAW_S if self.tty else max(every, TTY_REDRAW_S)
        self.latest: BatchProgress | None = None
        self.first: tuple[float, int] | None = None  # (time, done) at the first update
        self.shown: object = None  # what the last plain line showed
        self.drawn = False

    def update(self, progress: BatchProgress) -> None:
        """``run_batch``'s ``on_progress``: kept for the next redraw (never blocks)."""
        import trio

        if self.first is None:
            self.first = (trio.current_time(), progress.done)
        self.latest = progress

    async def redraw(self) -> None:
        import trio

        while True:
            await trio.sleep(self.every)
            self._show()

    def note(self, text: str) -> None:
        """A line of its own (the progress line is drawn again below it)."""
        self._clear()
        self.out.write(f"{escape_terminal(text)}\n")
        self.out.flush()

    def finish(self, *, show: bool = True) -> None:
        """The last line (``show``), and the terminal's cursor left below it."""
        if show:
            self._show(last=True)
        if self.drawn:
            self.out.write("\n")
            self.drawn = False
        self.out.flush()

    def _clear(self) -> None:
        if self.drawn:
            self.out.write("\r\x1b[2K")
            self.drawn = False

    def _show(self, *, last: bool = False) -> None:
        line = self.line()
        if line is None:
            return
        # Not a terminal: a line when the run moved (the ETA alone moves with the clock).
        moved = (self.latest, self._budget())
        if not self.tty and not last and moved == self.shown:
            return
        self.shown = moved
        if self.tty:
            self._clear()
            self.out.write(line[: _columns(self.out) - 1])
            self.drawn = True
        else:
            self.out.write(line + "\n")
        self.out.flush()

    def line(self) -> str | None:
        """The progress in one line (``None`` before the first update)."""
        import trio

        p = self.latest
        if p is None:
            return None
        parts = [
            f"{p.done}/{p.total} done",
            f"{p.running} running",
            f"{p.failed} failed",
            f"{p.input_tokens:,} in / {p.output_tokens:,} out tokens",
        ]
        if p.cost_usd is not None:
            parts.append(f"${p.cost_usd:.4f}")
        eta = self._eta(p, trio.current_time())
        if eta is not None:
            parts.append(f"ETA {eta}")
        line = f"{p.run_id}: " + ", ".join(parts)
        load = self._budget()
        return escape_terminal(f"{line} | {load}" if load else line)

    def _eta(self, p: BatchProgress, now: float) -> str | None:
        """From the pace since this command started (earlier runs' tasks aside)."""
        if self.first is None or p.done >= p.total:
            return None
        since, done_then = self.first
        done = p.done - done_then
        if done <= 0 or now <= since:
            return None
        return _duration((p.total - p.done) * (now - since) / done)

    def _budget(self) -> str:
        """The shared model budget's load per provider: in flight (of its limit), waiting."""
        budget = getattr(self.kernel, "budget", None)  # once the kernel has one
        snapshot = getattr(budget, "snapshot", None)
        if snapshot is None:
            return ""
        shown = []
        for load in snapshot():
            if load.model is not None:  # a provider's models are in its row
                continue
            in_flight = f"{load.in_flight}/{load.limit}" if load.limit else f"{load.in_flight}"
            text = f"{load.provider} {in_flight} in flight, {load.waiting} waiting"
            if load.paused_for > 0:
                text += f", paused {math.ceil(load.paused_for)}s"
            shown.append(text)
        return "; ".join(shown)


def _columns(out: IO[str]) -> int:
    """The terminal's width (``out``'s own: stdout may be a file meanwhile)."""
    try:
        columns = os.get_terminal_size(out.fileno()).columns
    except (OSError, ValueError, AttributeError):
        columns = 0
    return columns if columns > 0 else 100


def _duration(seconds: float) -> str:
    whole = max(0, math.ceil(seconds))
    if whole < 60:
        return f"{whole}s"
    minutes, whole = divmod(whole, 60)
    if minutes < 60:
        return f"{minutes}m{whole:02d}s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m"


# --- tak batch ls / show -----------------------------------------------------


@attrs.frozen(kw_only=True)
class RunView:
    """A run as its ledger holds it now (a directory's read without its lock: the
    run may be going on)."""

    run_id: str
    where: str  # its directory, or the PostgreSQL store
    created: float | None  # Unix time
    model: str | None
    session_project: str  # where its tasks' sessions are (tak sessions ls --project)
    total: int
    results: tuple[TaskResult, ...]  # each task's latest

    @property
    def finished(self) -> int:
        return sum(r.finished for r in self.results)

    @property
    def failed(self) -> int:
        return sum(r.finished and r.reason != "final" for r in self.results)

    @property
    def cost_usd(self) -> float | None:
        costs = [r.cost_usd for r in self.results if r.cost_usd is not None]
        return sum(costs) if costs else None


def read_run(path: Path) -> RunView:
    """A run directory's manifest, tasks and results as they are on disk (blocking I/O).

    A last line still being written (no newline yet) is left out. A file is read as
    its ledger reads it: strict JSON (no NaN), every result for a task of the run.

    Raises:
        UsageError: a file is damaged (one line naming it, and the line).
        OSError: a file cannot be read.
    """
    from ..batch import session_project

    manifest_path = path / "manifest.json"
    try:
        manifest = json.loads(manifest_path.read_bytes(), parse_constant=_refuse_constant)
        run_id = str(manifest["run_id"])
        created = float(manifest["created"])
        if not math.isfinite(created):
            raise ValueError(f"created: {created}")
        nonce = manifest.get("nonce")
        if not (nonce is None or isinstance(nonce, str)):
            raise ValueError(f"nonce: {nonce!r}")
        settings = manifest.get("settings") or {}
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise UsageError(f"{manifest_path}: damaged ({exc})") from None
    model = settings.get("model") if isinstance(settings, dict) else None
    # The results before the tasks: a task's line is written before it can have a
    # result, so every result read has its task in the tasks read after, mid-run too.
    results_path, tasks_path = path / "results.jsonl", path / "tasks.jsonl"
    result_lines = _complete_lines(results_path)
    order: dict[str, int] = {}
    for number, line in _complete_lines(tasks_path):
        value = _json_line(line, f"{tasks_path}:{number}")
        if not (isinstance(value, dict) and isinstance(value.get("id"), str)):
            raise UsageError(f"{tasks_path}:{number}: damaged (not a task: no id)")
        order.setdefault(value["id"], number)
    latest: dict[str, TaskResult] = {}
    for number, line in result_lines:
        where = f"{results_path}:{number}"
        result = _result(_json_line(line, where), where)
        if result.id not in order:  # the ledger's rule: resume refuses the same
            raise UsageError(
                f"{where}: a result for task {result.id!r}, which is not in {tasks_path}"
            )
        # the ledger's rule: a finished result is the last word on its task
        if result.id not in latest or not latest[result.id].finished:
            latest[result.id] = result
    return RunView(
        run_id=run_id,
        where=os.path.realpath(path),  # the run's own directory (--out), not its link
        created=created,
        model=model if isinstance(model, str) else None,
        session_project=session_project(run_id, nonce),
        total=len(order),
        results=tuple(sorted(latest.values(), key=lambda r: order[r.id])),
    )


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def _json_line(line: bytes, where: str) -> Any:
    try:
        return json.loads(line, parse_constant=_refuse_constant)
    except ValueError as exc:  # UnicodeDecodeError too
        raise UsageError(f"{where}: not valid JSON ({exc})") from None


def _result(value: Any, where: str) -> TaskResult:
    """A ``results.jsonl`` record, or an error naming the line and the field."""
    from ..batch import TaskResult, converter
    from ..messages import describe_structure_error

    if not isinstance(value, dict):
        raise UsageError(f"{where}: $: expected a JSON object, got {type(value).__name__}")
    try:
        result: TaskResult = converter.structure(value, TaskResult)
    except UsageError as exc:  # the record's own validator (its id)
        raise UsageError(f"{where}: {exc}") from None
    except (cattrs.BaseValidationError, TypeError, ValueError) as exc:
        raise UsageError(f"{where}: {describe_structure_error(exc, '$')}") from None
    return result


def _complete_lines(path: Path) -> list[tuple[int, bytes]]:
    """The file's lines that end in a newline and are not blank, with their numbers."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return []
    lines = data.split(b"\n")[:-1]  # the last: b"" or torn
    return [(number, line) for number, line in enumerate(lines, 1) if line.strip()]


@one_line_errors("tak batch ls")
def cmd_ls(args: argparse.Namespace) -> int:
    """The runs under the home; one that cannot be read is named on stderr, the rest
    listed (status 0: the listing is what was asked for). A home that is a file, or
    a wrong tak.toml, is refused as every command refuses them (status 2)."""
    TakHome.locate(args.home).read_config()
    root = runs_dir(args.home)
    entries = sorted(root.iterdir()) if root.is_dir() else []
    runs: list[RunView] = []
    unreadable: list[str] = []
    for entry in entries:
        if not (entry / "manifest.json").is_file():
            continue
        try:
            runs.append(read_run(entry))
        except UsageError as exc:
            unreadable.append(f"tak batch ls: {entry.name}: left out: {exc}")
        except OSError as exc:
            unreadable.append(f"tak batch ls: {entry.name}: left out: {os_error_line(exc)}")
    gone = [e for e in entries if e.is_symlink() and not e.exists()]
    runs.sort(key=lambda r: (-(r.created or 0), r.run_id))
    if args.json:
        print(terminal_json([totals_json(r) for r in runs], indent=2))
    elif not runs and not unreadable:
        print(f"no batch runs under {root}")
    elif not runs:
        pass  # the runs there are named on stderr, each with why it was left out
    else:
        width = max(len("ID"), *(len(r.run_id) for r in runs))
        print(
            f"{'ID':<{width}}  {'CREATED':<19}  {'TASKS':>6}  {'FINISHED':>8}  {'FAILED':>6}  "
            f"{'COST':>9}  MODEL"
        )
        for r in runs:
            created = _local_time(r.created) if r.created is not None else "?"
            cost = f"${r.cost_usd:.4f}" if r.cost_usd is not None else "-"
            # run_id and model are a manifest's, which anyone can have written
            print(
                escape_terminal(
                    f"{r.run_id:<{width}}  {created:<19}  {r.total:>6}  {r.finished:>8}  "
                    f"{r.failed:>6}  {cost:>9}  {r.model or '?'}"
                )
            )
    sys.stdout.flush()
    for line in unreadable:
        print(escape_terminal(line), file=sys.stderr)
    for link in gone:
        print(escape_terminal(f"tak batch ls: {link.name}: its directory is gone "
                              f"({link.readlink()})"), file=sys.stderr)  # fmt: skip
    return 0


def totals_json(view: RunView) -> dict[str, Any]:
    """A run's totals: one run of ``tak batch ls --json``, and ``show --json`` without
    its tasks."""
    scores = [r.score for r in view.results if r.score is not None]
    return {
        "run_id": view.run_id,
        "where": view.where,
        "created": view.created,
        "model": view.model,
        "session_project": view.session_project,
        "total": view.total,
        "finished": view.finished,
        "failed": view.failed,
        "unfinished": view.total - view.finished,
        "reasons": dict(sorted(Counter(r.reason for r in view.results).items())),
        "input_tokens": sum(r.input_tokens for r in view.results),
        "output_tokens": sum(r.output_tokens for r in view.results),
        "cost_usd": view.cost_usd,
        "score_mean": sum(scores) / len(scores) if scores else None,
    }


def _local_time(unix: float) -> str:
    try:
        return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(unix))
    except (OverflowError, OSError, ValueError):  # a hand-edited time past any calendar
        return "?"


@one_line_errors("tak batch show")
def cmd_show(args: argparse.Namespace) -> int:
    if args.store is not None:
        view = _read_postgres_run(args.store, args.run, args.home)
    else:
        view = read_run(_run_dir(args.home, args.run))
    if args.json:
        print(terminal_json(show_json(view), indent=2))
    else:
        print(summary_text(view.run_id, view.results, view.total, view.where, view.session_project))
    return 0


def _request_timeout_s(home: Path | None) -> float:
    """``[store] request_timeout_s`` of the home's tak.toml: it bounds the run's
    PostgreSQL calls (ledger and sessions) as it bounds the sessions' store."""
    return TakHome.locate(home).read_config().store.request_timeout_s


def _read_postgres_run(url: str, run_id: str, home: Path | None) -> RunView:
    import trio

    from ..batch import check_run_id, open_postgres_ledger

    check_run_id(run_id, "RUN")

    async def main() -> RunView:
        async with open_postgres_ledger(
            url, run_id, create=False, request_timeout_s=_request_timeout_s(home)
        ) as ledger:
            results = await ledger.results()
            counts = await ledger.counts()
            model = ledger.settings.get("model")
            return RunView(
                run_id=run_id,
                where=repr(ledger),
                created=ledger.created,
                model=model if isinstance(model, str) else None,
                session_project=ledger.session_project,
                total=counts.total,
                results=tuple(results),
            )

    return trio.run(main)


def show_json(view: RunView) -> dict[str, Any]:
    """``tak batch show --json``: the run's totals (``totals_json``), the tasks that did
    not end ``final``, and every task's latest result (``results.jsonl``'s records)."""
    from ..batch import converter

    return {
        **totals_json(view),
        "not_final": [
            {"id": r.id, "reason": r.reason, "error": r.error}
            for r in view.results
            if r.reason != "final"
        ],
        "results": [converter.unstructure(r) for r in view.results],
    }


def summary_text(
    run_id: str,
    results: Sequence[TaskResult],
    total: int,
    where: Path | str | None,
    session_project: str,
) -> str:
    """``BatchSummary.table``, how many tasks finished, where the run and its tasks'
    sessions are, and each task that did not end ``final`` with its one-line error:
    escaped for the terminal (a task's error quotes a model or a tool; a run's id, its
    nonce in the sessions' project and its directory are a manifest's)."""
    from ..batch import BatchSummary

    finished = sum(r.finished for r in results)
    table = BatchSummary(run_id=run_id, results=tuple(results)).table().rstrip("\n")
    table = escape_terminal(table, keep_newlines=True)
    run_id = escape_terminal(run_id)
    where = None if where is None else escape_terminal(str(where))
    # The table counts the results; the run has ``total`` tasks, unfinished ones too.
    _, _, rest = table.partition("\n")
    lines = [f"run {run_id}: {total} tasks\n{rest}", ""]
    lines.append(f"  finished    {finished} of {total} tasks")
    if where is not None:
        lines.append(f"  run         {where}")
    lines.append(f"  sessions    project {escape_terminal(session_project)}")
    failed = [r for r in results if r.reason != "final"]
    if failed:
        lines += ["", f"  not final ({len(failed)}):"]
        width = max(len(r.id) for r in failed)
        for r in failed:
            error = escape_terminal(" ".join((r.error or "").split()))
            if len(error) > 160:
                error = error[:157] + "..."
            lines.append(f"    {r.id:<{width}}  {r.reason:<11}  {error}".rstrip())
    return "\n".join(lines)
