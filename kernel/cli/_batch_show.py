"""``tak batch ls`` and ``tak batch show``: runs as their ledgers hold them
(``kernel.batch.RunView``), printed; and where a home keeps its runs."""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..errors import UsageError
from ..home import TakHome
from ..terminal import escape_terminal
from ._exit import one_line_errors, os_error_line
from ._terminal_json import terminal_json

if TYPE_CHECKING:
    from ..batch import RunView, TaskResult


def runs_dir(home: str | None) -> Path:
    """``<home>/batch``: a directory (or a link to one) per run.

    Not under ``<home>/data``: a run's directory holds its tasks' workspaces, and
    a workspace may not lie inside the kernel's data (``sandbox._overlap``).
    """
    return TakHome.locate(home).root / "batch"


def run_dir(home: str | None, run: str) -> Path:
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


def request_timeout_s(home: str | None) -> float:
    """``[store] request_timeout_s`` of the home's tak.toml: it bounds the run's
    PostgreSQL calls (ledger and sessions) as it bounds the sessions' store."""
    return TakHome.locate(home).read_config().store.request_timeout_s


@one_line_errors("tak batch ls")
def cmd_ls(args: argparse.Namespace) -> int:
    """The runs under the home; one that cannot be read is named on stderr, the rest
    listed (status 0: the listing is what was asked for). A home that is a file, or
    a wrong tak.toml, is refused as every command refuses them (status 2)."""
    from ..batch import read_run_dir

    TakHome.locate(args.home).read_config()
    root = runs_dir(args.home)
    entries = sorted(root.iterdir()) if root.is_dir() else []
    runs: list[RunView] = []
    unreadable: list[str] = []
    for entry in entries:
        if not (entry / "manifest.json").is_file():
            continue
        try:
            runs.append(read_run_dir(entry))
        except UsageError as exc:
            unreadable.append(f"tak batch ls: {entry.name}: left out: {exc}")
        except OSError as exc:
            unreadable.append(f"tak batch ls: {entry.name}: left out: {os_error_line(exc)}")
    gone = [e for e in entries if e.is_symlink() and not e.exists()]
    runs.sort(key=lambda r: (-(r.created or 0), r.run_id))
    if args.json:
        print(terminal_json([r.totals() for r in runs], indent=2))
    elif not runs and not unreadable:
        print(f"no batch runs under {root}")
    elif runs:  # else the runs there are named on stderr, each with why it was left out
        print(ls_table(runs))
    sys.stdout.flush()
    for line in unreadable:
        print(escape_terminal(line), file=sys.stderr)
    for link in gone:
        print(escape_terminal(f"tak batch ls: {link.name}: its directory is gone "
                              f"({link.readlink()})"), file=sys.stderr)  # fmt: skip
    return 0


def ls_table(runs: Sequence[RunView]) -> str:
    """One line a run, escaped (a run's id and model are a manifest's, which anyone
    can have written)."""
    width = max(len("ID"), *(len(r.run_id) for r in runs))
    lines = [
        f"{'ID':<{width}}  {'CREATED':<19}  {'TASKS':>6}  {'FINISHED':>8}  {'FAILED':>6}  "
        f"{'COST':>9}  MODEL"
    ]
    for r in runs:
        created = _local_time(r.created) if r.created is not None else "?"
        cost = f"${r.cost_usd:.4f}" if r.cost_usd is not None else "-"
        lines.append(
            escape_terminal(
                f"{r.run_id:<{width}}  {created:<19}  {r.total:>6}  {r.finished:>8}  "
                f"{r.failed:>6}  {cost:>9}  {r.model or '?'}"
            )
        )
    return "\n".join(lines)


def _local_time(unix: float) -> str:
    try:
        return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(unix))
    except (OverflowError, OSError, ValueError):  # a hand-edited time past any calendar
        return "?"


@one_line_errors("tak batch show")
def cmd_show(args: argparse.Namespace) -> int:
    import trio

    from ..batch import read_postgres_run, read_run_dir

    if args.store is not None:
        timeout = request_timeout_s(args.home)
        view = trio.run(lambda: read_postgres_run(args.store, args.run, request_timeout_s=timeout))
    else:
        view = read_run_dir(run_dir(args.home, args.run))
    if args.json:
        print(terminal_json(show_json(view), indent=2))
    else:
        print(summary_text(view.run_id, view.results, view.total, view.where, view.session_project))
    return 0


def show_json(view: RunView) -> dict[str, Any]:
    """``tak batch show --json``: the run's totals (``RunView.totals``), the tasks that
    did not end ``final``, and every task's latest result (``results.jsonl``'s records)."""
    from ..batch import converter

    return {
        **view.totals(),
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


__all__ = ["cmd_ls", "cmd_show", "request_timeout_s", "run_dir", "runs_dir", "summary_text"]
