"""``tak batch``'s commands (the parser is ``kernel.cli.batch``'s, docs/batch.md)."""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

import attrs

from .plugins import home_option, one_line_errors, tak_command
from .run import model_settings, tool_patterns

if TYPE_CHECKING:
    from ..batch import BatchProgress, BatchTask, Ledger, TaskLimits, TaskResult
    from ..kernel import Kernel
    from ..settings import ModelSettings

#: How often progress is redrawn on a terminal, at most (seconds).
TTY_REDRAW_S = 0.1
#: The file in a run's directory holding what the command was given (for ``resume``).
COMMAND_FILE = "command.json"


# --- what a run was started with --------------------------------------------


@attrs.frozen(kw_only=True)
class RunCommand:
    """What ``tak batch run`` was given, kept in the run's ``command.json`` so that
    ``tak batch resume RUN`` opens the same kernel and runs the same way."""

    model: str
    fallbacks: tuple[str, ...] = ()
    system: str | None = None
    plugins: tuple[str, ...] = ()
    tools: tuple[str, ...] | None = None
    settings: dict[str, Any] | None = None  # ModelSettings, as tak.toml spells it
    limits: dict[str, Any] = attrs.field(factory=dict)  # TaskLimits' fields that are set
    concurrency: int = 10

    def model_settings(self) -> ModelSettings | None:
        from ..settings import settings_from_mapping

        return None if self.settings is None else settings_from_mapping(self.settings)

    def task_limits(self) -> TaskLimits:
        from ..batch import TaskLimits

        return TaskLimits(**self.limits)


def _command_of(args: argparse.Namespace) -> RunCommand:
    """The run's settings from the flags.

    Raises:
        UsageError: a bad value, naming its flag.
    """
    from ..batch import TaskLimits
    from ..errors import UsageError

    if args.concurrency < 1:
        raise UsageError(f"--concurrency: expected 1 or more, got {args.concurrency}")
    given = {
        name: getattr(args, name)
        for name in ("max_steps", "max_tokens", "max_cost", "wall_time")
        if getattr(args, name) is not None
    }
    for name, value in given.items():
        try:
            TaskLimits(**{name: value})
        except UsageError:
            flag = "--" + name.replace("_", "-")
            raise UsageError(f"{flag}: expected a positive number, got {value}") from None
    # run.model_settings reads every flag of `tak run`'s; batch offers a few (and
    # --max-tokens is a task's limit here: a reply's is --set max_tokens=N).
    flags = argparse.Namespace(
        **{
            "set": args.set,
            "temperature": args.temperature,
            "top_p": None,
            "max_tokens": None,
            "stop": None,
            "seed": args.seed,
            "tool_choice": None,
            "parallel_tool_calls": None,
            "reasoning_effort": args.reasoning_effort,
        }
    )
    settings = model_settings(flags)
    tools = tool_patterns(args)
    return RunCommand(
        model=args.model,
        fallbacks=tuple(args.fallback),
        system=args.system,
        plugins=tuple(args.plugin),
        tools=None if tools is None else tuple(tools),
        settings=None if settings is None else _settings_mapping(settings),
        limits=given,
        concurrency=args.concurrency,
    )


def _settings_mapping(settings: ModelSettings) -> dict[str, Any]:
    """``settings`` as ``tak.toml``'s ``[model.settings]`` spells them (the fields set)."""
    out: dict[str, Any] = {}
    for name, value in attrs.asdict(settings, recurse=False).items():
        if value is None:
            continue
        out[name] = list(value) if isinstance(value, tuple) else value
        if name == "extra":
            out[name] = dict(value)
    return out


def _write_command(run_dir: Path, command: RunCommand) -> None:
    path = run_dir / COMMAND_FILE
    temporary = path.with_suffix(".json.tmp")
    temporary.write_text(json.dumps(attrs.asdict(command), indent=2) + "\n")
    os.replace(temporary, path)


def _read_command(run_dir: Path) -> RunCommand:
    """What the run was started with.

    Raises:
        UsageError: the file is missing or damaged (one line naming it).
    """
    import cattrs

    from ..errors import UsageError

    path = run_dir / COMMAND_FILE
    try:
        data = json.loads(path.read_text())
        return cattrs.Converter(forbid_extra_keys=True).structure(data, RunCommand)
    except FileNotFoundError:
        raise UsageError(
            f"{run_dir}: not a run started by `tak batch` (no {COMMAND_FILE})"
        ) from None
    except (ValueError, cattrs.BaseValidationError) as exc:
        raise UsageError(f"{path}: damaged: {exc}") from None


# --- where runs live --------------------------------------------------------


def runs_dir(home: str | None) -> Path:
    """``<home>/data/batch``: a directory (or a link to one) per run."""
    from ..home import TakHome

    return TakHome.locate(home).data / "batch"


def _run_dir(home: str | None, run: str) -> Path:
    """The directory of ``run``: a path to a run's directory, or a run id under the home.

    Raises:
        UsageError: there is no such run.
    """
    from ..errors import UsageError

    given = Path(run)
    if os.sep in run or run in (".", ".."):
        if not (given / COMMAND_FILE).is_file() and not (given / "manifest.json").is_file():
            raise UsageError(f"{run}: not a batch run's directory")
        return given.absolute()
    path = runs_dir(home) / run
    if not path.is_dir():
        if (given / COMMAND_FILE).is_file():  # a run directory in the current one
            return given.absolute()
        raise UsageError(f"no run {run!r} under {runs_dir(home)} (see tak batch ls)")
    return path


def _default_run_id(args: argparse.Namespace) -> str:
    """``--run-id``, else ``--out``'s name, else the tasks file's stem."""
    import re

    from ..batch import check_task_id

    if args.run_id is not None:
        check_task_id(args.run_id, "--run-id")
        return str(args.run_id)
    name = args.out.absolute().name if args.out is not None else args.tasks.stem
    run_id = re.sub(r"[^A-Za-z0-9._-]", "-", name).lstrip("._-")[:128] or "run"
    check_task_id(run_id, "run id")
    return run_id


def _link_run(home: str | None, run_id: str, run_dir: Path) -> None:
    """Make ``<home>/data/batch/<run_id>`` name ``run_dir`` (a link when it is elsewhere).

    Raises:
        UsageError: the id names another run.
    """
    from ..errors import UsageError

    link = runs_dir(home) / run_id
    if link.absolute() == run_dir.absolute():
        return
    link.parent.mkdir(parents=True, exist_ok=True)
    if link.is_symlink() or link.exists():
        if link.resolve() == run_dir.resolve():
            return
        raise UsageError(
            f"run id {run_id!r} is taken by {link.resolve()}; give another with --run-id"
        )
    link.symlink_to(run_dir.absolute(), target_is_directory=True)


# --- tak batch run / resume / worker -----------------------------------------


@one_line_errors("tak batch")
def cmd_run(args: argparse.Namespace) -> int:
    from ..batch import load_tasks
    from .plugins import ensure_home

    command = _command_of(args)
    tasks = load_tasks(args.tasks)  # UsageError: "FILE:LINE: ..."
    ensure_home(args.home)
    run_id = _default_run_id(args)
    if args.store is not None:
        return _drive(args, command, run_id, tasks, store=args.store)
    run_dir = (args.out if args.out is not None else runs_dir(args.home) / run_id).absolute()
    _link_run(args.home, run_id, run_dir)
    return _drive(args, command, run_id, tasks, run_dir=run_dir)


@one_line_errors("tak batch resume")
def cmd_resume(args: argparse.Namespace) -> int:
    run_dir = _run_dir(args.home, args.run)
    command = _read_command(run_dir)
    if args.concurrency is not None:
        if args.concurrency < 1:
            from ..errors import UsageError

            raise UsageError(f"--concurrency: expected 1 or more, got {args.concurrency}")
        command = attrs.evolve(command, concurrency=args.concurrency)
    return _drive(args, command, None, None, run_dir=run_dir.resolve())


@one_line_errors("tak batch worker")
def cmd_worker(args: argparse.Namespace) -> int:
    from ..batch import check_task_id

    check_task_id(args.run, "--run")
    return _drive(args, _command_of(args), args.run, None, store=args.store)


def _drive(
    args: argparse.Namespace,
    command: RunCommand,
    run_id: str | None,
    tasks: Sequence[BatchTask] | None,
    *,
    run_dir: Path | None = None,
    store: str | None = None,
) -> int:
    """Open the kernel and the run's ledger, run the tasks with progress; the summary.

    ``tasks`` are added to the ledger first (``None``: it holds them: resume, a worker).
    """
    import contextlib

    import trio

    from ..kernel import open_kernel

    async def main() -> int:
        async with contextlib.AsyncExitStack() as stack:
            if run_dir is not None:
                from ..batch import open_run_dir

                ledger: Ledger = await stack.enter_async_context(
                    open_run_dir(run_dir, run_id=run_id, create=tasks is not None)
                )
                # after the lock: two commands never write it at once
                await trio.to_thread.run_sync(_write_command, run_dir, command)
                workspace_root = None
            else:
                assert store is not None and run_id is not None
                from ..batch import open_postgres_ledger

                ledger = await stack.enter_async_context(open_postgres_ledger(store, run_id))
                workspace_root = runs_dir(args.home) / run_id / "workspaces"
            kernel = await stack.enter_async_context(
                open_kernel(
                    home=args.home,
                    model=command.model,
                    fallbacks=command.fallbacks,
                    extra_plugins=command.plugins,
                    system=command.system,
                )
            )
            return await _run_with_progress(
                args, kernel, ledger, tasks, command, run_dir, workspace_root
            )
        raise AssertionError("unreachable")  # pragma: no cover (mypy: the stack may swallow)

    return trio.run(main)


async def _run_with_progress(
    args: argparse.Namespace,
    kernel: Kernel,
    ledger: Ledger,
    tasks: Sequence[BatchTask] | None,
    command: RunCommand,
    run_dir: Path | None,
    workspace_root: Path | None,
) -> int:
    import signal

    import trio

    from ..batch import run_batch

    view = ProgressView(sys.stderr, kernel, every=args.progress_every)
    interrupted = False
    async with trio.open_nursery() as nursery:
        run_scope = trio.CancelScope()

        async def stop_on_sigint() -> None:
            nonlocal interrupted
            with trio.open_signal_receiver(signal.SIGINT) as signals:
                async for _ in signals:
                    if not interrupted:
                        interrupted = True
                        view.note("stopping: recording the running tasks as cancelled")
                        run_scope.cancel()

        nursery.start_soon(stop_on_sigint)
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
    view.finish()
    results = await ledger.results()
    counts = await ledger.counts()
    print(_summary_text(ledger.run_id, results, counts.total, run_dir))
    sys.stdout.flush()
    if interrupted:
        resume = _resume_command(args, ledger.run_id, run_dir, command)
        print(f"tak batch: interrupted; to finish the run: {resume}", file=sys.stderr)
        return 130
    return 0


def _resume_command(
    args: argparse.Namespace, run_id: str, run_dir: Path | None, command: RunCommand
) -> str:
    """The command that finishes the run, as a person can paste it here."""
    if run_dir is None:  # a PostgreSQL run: another worker on the same run
        words = ["batch", "worker", "--run", run_id, "--store", str(args.store)]
        words += ["--model", command.model, "--concurrency", str(command.concurrency)]
        return tak_command(*home_option(args.home), *_plugin_options(command), *words)
    linked = runs_dir(args.home) / run_id
    target = run_id if linked.resolve() == run_dir.resolve() else str(run_dir)
    return tak_command(*home_option(args.home), "batch", "resume", target)


def _plugin_options(command: RunCommand) -> list[str]:
    return [word for name in command.plugins for word in ("--plugin", name)]


# --- progress ----------------------------------------------------------------


class ProgressView:
    """A run's progress on ``out``: on a terminal one line redrawn (at most every
    ``TTY_REDRAW_S``), else a plain line every ``every`` seconds when something
    changed, and one at the end."""

    def __init__(self, out: IO[str], kernel: Kernel, *, every: float) -> None:
        self.out = out
        self.tty = out.isatty()
        self.kernel = kernel
        self.every = TTY_REDRAW_S if self.tty else max(every, TTY_REDRAW_S)
        self.latest: BatchProgress | None = None
        self.first: tuple[float, int] | None = None  # (time, done) at the first update
        self.shown: str | None = None
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
        self._clear()
        self.out.write(f"{text}\n")
        self.out.flush()

    def finish(self) -> None:
        self._show(always=True)
        if self.tty and self.drawn:
            self.out.write("\n")
            self.drawn = False
        self.out.flush()

    def _clear(self) -> None:
        if self.tty and self.drawn:
            self.out.write("\r\x1b[2K")
            self.drawn = False

    def _show(self, *, always: bool = False) -> None:
        line = self.line()
        if line is None or (line == self.shown and not always and not self.tty):
            return
        self.shown = line
        if self.tty:
            self._clear()
            self.out.write(line[: _columns() - 1])
            self.drawn = True
        else:
            self.out.write(line + "\n")
        self.out.flush()

    def line(self) -> str | None:
        """The progress as one line (``None`` before the first update)."""
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
        return f"{line} | {load}" if load else line

    def _eta(self, p: BatchProgress, now: float) -> str | None:
        if self.first is None or p.done >= p.total:
            return None
        since, done_then = self.first
        done = p.done - done_then
        if done <= 0 or now <= since:
            return None
        return _duration((p.total - p.done) * (now - since) / done)

    def _budget(self) -> str:
        """The shared model budget's load: in flight (of the limit) and waiting, per provider."""
        budget = getattr(self.kernel, "budget", None)
        snapshot = getattr(budget, "snapshot", None)
        if snapshot is None:
            return ""
        shown = []
        for load in snapshot():
            name = getattr(load, "provider", "?")
            model = getattr(load, "model", None)
            if model:
                name = f"{name}/{model}"
            limit = getattr(load, "limit", None)
            in_flight = f"{load.in_flight}/{limit}" if limit else f"{load.in_flight}"
            shown.append(f"{name} {in_flight} in flight, {load.waiting} waiting")
        return "; ".join(shown)


def _columns() -> int:
    import shutil

    return shutil.get_terminal_size((100, 24)).columns


def _duration(seconds: float) -> str:
    seconds = max(0, math.ceil(seconds))
    if seconds < 60:
        return f"{seconds}s"
    minutes, seconds = divmod(seconds, 60)
    if minutes < 60:
        return f"{minutes}m{seconds:02d}s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m"


# --- tak batch ls / show -----------------------------------------------------


@attrs.frozen(kw_only=True)
class RunView:
    """What a run's files say, read without its lock (a run may be going on)."""

    run_id: str
    path: Path
    created: float | None  # Unix time
    model: str | None
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


def read_run(run_id: str, path: Path) -> RunView:
    """A run's manifest, tasks and results, as they are on disk now (blocking I/O).

    A last line being written (no newline yet) is left out.

    Raises:
        UsageError: a file is damaged (one line naming it and the line).
    """
    from ..batch import converter
    from ..errors import UsageError

    created: float | None = None
    model: str | None = None
    try:
        manifest = json.loads((path / "manifest.json").read_text())
    except (OSError, ValueError):
        manifest = {}
    if isinstance(manifest, dict):
        created = _unix_time(manifest.get("created"))
        run_id = str(manifest.get("run_id", run_id))
        model = manifest.get("model") if isinstance(manifest.get("model"), str) else None
    if model is None:
        with _suppress_usage():
            model = _read_command(path).model
    total = sum(1 for _ in _complete_lines(path / "tasks.jsonl"))
    latest: dict[str, TaskResult] = {}
    for number, line in enumerate(_complete_lines(path / "results.jsonl"), 1):
        try:
            from ..batch import TaskResult

            result = converter.structure(json.loads(line), TaskResult)
        except Exception as exc:
            raise UsageError(f"{path / 'results.jsonl'}:{number}: {exc}") from None
        if result.finished or result.id not in latest or not latest[result.id].finished:
            latest[result.id] = result
    if created is None:
        with _suppress_os():
            created = (path / COMMAND_FILE).stat().st_mtime
    return RunView(
        run_id=run_id,
        path=path,
        created=created,
        model=model,
        total=total,
        results=tuple(latest.values()),
    )


def _complete_lines(path: Path) -> list[str]:
    try:
        text = path.read_text()
    except FileNotFoundError:
        return []
    lines = text.split("\n")
    return [line for line in lines[:-1] if line.strip()]  # the last is "" or unfinished


def _unix_time(value: object) -> float | None:
    if isinstance(value, int | float) and not isinstance(value, bool):
        return float(value)
    if isinstance(value, str):
        from datetime import datetime

        try:
            return datetime.fromisoformat(value).timestamp()
        except ValueError:
            return None
    return None


def _suppress_usage() -> Any:
    import contextlib

    from ..errors import UsageError

    return contextlib.suppress(UsageError)


def _suppress_os() -> Any:
    import contextlib

    return contextlib.suppress(OSError)


@one_line_errors("tak batch ls")
def cmd_ls(args: argparse.Namespace) -> int:
    root = runs_dir(args.home)
    entries = sorted(root.iterdir()) if root.is_dir() else []
    runs: list[RunView] = []
    missing: list[str] = []
    for entry in entries:
        if not entry.is_dir():
            missing.append(f"{entry.name} -> {os.readlink(entry)}" if entry.is_symlink() else "")
            continue
        runs.append(read_run(entry.name, entry))
    missing = [m for m in missing if m]
    if not runs and not missing:
        print(f"no batch runs under {root}")
        return 0
    runs.sort(key=lambda r: (-(r.created or 0), r.run_id))
    width = max(len("ID"), *(len(r.run_id) for r in runs)) if runs else len("ID")
    print(
        f"{'ID':<{width}}  {'CREATED':<19}  {'TASKS':>6}  {'FINISHED':>8}  {'FAILED':>6}  "
        f"{'COST':>9}  MODEL"
    )
    for r in runs:
        created = _local_time(r.created) if r.created is not None else "?"
        cost = f"${r.cost_usd:.4f}" if r.cost_usd is not None else "-"
        print(
            f"{r.run_id:<{width}}  {created:<19}  {r.total:>6}  {r.finished:>8}  "
            f"{r.failed:>6}  {cost:>9}  {r.model or '?'}"
        )
    for m in missing:
        print(f"tak batch ls: the directory is gone: {m}", file=sys.stderr)
    return 0


def _local_time(unix: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(unix))


@one_line_errors("tak batch show")
def cmd_show(args: argparse.Namespace) -> int:
    if args.store is not None:
        view = _read_postgres_run(args.store, args.run)
    else:
        path = _run_dir(args.home, args.run)
        view = read_run(path.name, path)
    if args.json:
        print(json.dumps(show_json(view), indent=2, ensure_ascii=False))
    else:
        print(_summary_text(view.run_id, view.results, view.total, view.path))
    return 0


def _read_postgres_run(url: str, run_id: str) -> RunView:
    import trio

    from ..batch import check_task_id, open_postgres_ledger

    check_task_id(run_id, "RUN")

    async def main() -> RunView:
        async with open_postgres_ledger(url, run_id) as ledger:
            results = await ledger.results()
            counts = await ledger.counts()
        return RunView(
            run_id=run_id,
            path=Path(url),
            created=None,
            model=None,
            total=counts.total,
            results=tuple(results),
        )

    return trio.run(main)


def show_json(view: RunView) -> dict[str, Any]:
    """``tak batch show --json``: the run's totals, its counts by reason, its failed tasks
    and every task's latest result (``results.jsonl``'s records)."""
    from ..batch import converter

    scores = [r.score for r in view.results if r.score is not None]
    return {
        "run_id": view.run_id,
        "path": str(view.path),
        "created": view.created,
        "model": view.model,
        "total": view.total,
        "finished": view.finished,
        "failed": view.failed,
        "unfinished": view.total - view.finished,
        "reasons": dict(sorted(Counter(r.reason for r in view.results).items())),
        "input_tokens": sum(r.input_tokens for r in view.results),
        "output_tokens": sum(r.output_tokens for r in view.results),
        "cost_usd": view.cost_usd,
        "score_mean": sum(scores) / len(scores) if scores else None,
        "failed_tasks": [
            {"id": r.id, "reason": r.reason, "error": r.error}
            for r in view.results
            if r.reason != "final"
        ],
        "results": [converter.unstructure(r) for r in view.results],
    }


def _summary_text(run_id: str, results: Sequence[TaskResult], total: int, path: Path | None) -> str:
    """The summary table (``BatchSummary.table``), then what did not end ``final``."""
    from ..batch import BatchSummary

    finished = sum(r.finished for r in results)
    lines = [f"run {run_id}: {finished}/{total} tasks finished"]
    if path is not None:
        lines[0] += f" ({path})"
    lines.append(BatchSummary(run_id=run_id, results=tuple(results)).table().rstrip("\n"))
    failed = [r for r in results if r.reason != "final"]
    if failed:
        lines.append(f"not final ({len(failed)}):")
        width = max(len(r.id) for r in failed)
        for r in failed:
            error = (r.error or "").replace("\n", " ")
            if len(error) > 160:
                error = error[:157] + "..."
            lines.append(f"  {r.id:<{width}}  {r.reason:<11}  {error}".rstrip())
    return "\n".join(lines)
