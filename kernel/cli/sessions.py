"""``tak sessions``: list, show, remove and repair stored sessions."""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from ..errors import CorruptTranscript, KernelError
from ..terminal import escape_terminal
from . import DEFAULT_PROJECT
from ._common import home_option, os_errors_as, tak_command
from ._exit import BAD_INPUT, FAILED, OK, error_line, exit_code, one_line_errors, single_leaf

if TYPE_CHECKING:
    from ..store import FileStore, PostgresStore, RepairReport, SessionKey

    #: The store ``tak.toml`` selects (``kernel.store.open_store``).
    AnyStore = FileStore | PostgresStore

# rm and repair take the session's lock; a server holds it only while it appends.
DEFAULT_WAIT_S = 10.0


def add_commands(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("sessions", help="list, show, remove and repair stored sessions")
    p.set_defaults(func=lambda args: _help(p))
    cmds = p.add_subparsers(dest="sessions_command", metavar="COMMAND")

    def project_option(q: argparse.ArgumentParser) -> None:
        q.add_argument(
            "--project", default=DEFAULT_PROJECT, help=f"project (default: {DEFAULT_PROJECT})"
        )

    q = cmds.add_parser("ls", help="list sessions, newest first")
    project_option(q)
    q.set_defaults(func=cmd_ls)

    q = cmds.add_parser("show", help="print a session's transcript")
    q.add_argument("id", help="session id")
    q.add_argument("--sub", metavar="SUBPATH", help="show a child transcript (a subagent)")
    project_option(q)
    q.set_defaults(func=cmd_show)

    def wait_option(q: argparse.ArgumentParser) -> None:
        q.add_argument(
            "--wait",
            type=float,
            default=DEFAULT_WAIT_S,
            metavar="SECONDS",
            help="how long to wait for another process writing the session "
            f"(default: {DEFAULT_WAIT_S:g})",
        )

    q = cmds.add_parser("rm", help="remove a session and its child transcripts")
    q.add_argument("id", help="session id")
    project_option(q)
    wait_option(q)
    q.set_defaults(func=cmd_rm)

    q = cmds.add_parser(
        "repair", help="set damaged transcripts aside under quarantine/, keeping the good lines"
    )
    q.add_argument("id", help="session id")
    project_option(q)
    wait_option(q)
    q.set_defaults(func=cmd_repair)


def _help(parser: argparse.ArgumentParser) -> int:
    parser.print_help()
    return BAD_INPUT


def _run(args: argparse.Namespace, body: Callable[[AnyStore], Awaitable[int]]) -> int:
    """Run ``body`` with the home's store (``[store] url`` or ``TAK_STORE_URL`` picks
    PostgreSQL, else the files under the home), turning kernel errors into exit codes."""
    import trio

    from ..home import TakHome
    from ..store import open_store

    async def main() -> int:
        home = TakHome.locate(args.home)
        with os_errors_as(f"TAK_HOME {home.root}"):
            config = await trio.to_thread.run_sync(home.read_config)
            async with open_store(home, config.store) as store:
                return await body(store)

    try:
        return trio.run(main)
    except BaseException as exc:
        error = single_leaf(exc)
        if not isinstance(error, KernelError):
            raise
        line = error_line("tak: error", error)
        if isinstance(error, CorruptTranscript):
            repair = _repair_command(args, getattr(args, "id", "ID"))
            line += f"; `{escape_terminal(repair)}` sets it aside"
        print(line, file=sys.stderr)
        return exit_code(error)


def _repair_command(args: argparse.Namespace, session_id: str) -> str:
    """``tak sessions repair ID`` for the home and project this command was given."""
    project = getattr(args, "project", DEFAULT_PROJECT)
    words = ["sessions", "repair", session_id]
    if project != DEFAULT_PROJECT:
        words += ["--project", project]
    return tak_command(*home_option(args.home), *words)


def _key(args: argparse.Namespace, subpath: str | None = None) -> SessionKey:
    from ..store import SessionKey

    return SessionKey(args.project, args.id, subpath)


def _local_time(mtime_ms: int) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(mtime_ms / 1000))


@one_line_errors("tak sessions ls")
def cmd_ls(args: argparse.Namespace) -> int:
    async def body(store: AnyStore) -> int:
        summaries = await store.list_session_summaries(args.project)
        if not summaries:
            print(f"no sessions in project {args.project!r}")
            return OK
        summaries.sort(key=lambda s: (-s.mtime_ms, s.session_id))
        width = max(len("ID"), *(len(s.session_id) for s in summaries))
        print(f"{'ID':<{width}}  {'MODIFIED':<19}  {'ENTRIES':>7}  TITLE")
        for s in summaries:
            title = f"DAMAGED: {s.problem}" if s.problem else (s.data.title or "")
            title = escape_terminal(title)  # a prompt's first words: the model's, anyone's
            print(
                f"{s.session_id:<{width}}  {_local_time(s.mtime_ms)}  "
                f"{s.data.entry_count:>7}  {title}"
            )
        damaged = [s.session_id for s in summaries if s.problem]
        if damaged:
            repair = _repair_command(args, damaged[0])
            print(
                f"tak sessions ls: damaged: {', '.join(damaged)}; `{repair}` sets one aside",
                file=sys.stderr,
            )
            return FAILED
        return OK

    return _run(args, body)


def _indent(text: str, prefix: str) -> str:
    """``text`` (hostile: a model's, a tool's) escaped line by line, each line indented,
    so that no line of it can pass for one of ours."""
    text = escape_terminal(text, keep_newlines=True)
    return "\n".join(prefix + line for line in text.split("\n"))


def format_entry(entry: dict[str, Any]) -> str:
    """One transcript entry as people read it: every text of it escaped for the terminal
    (a transcript holds what models, tools and workspaces wrote)."""
    from ..messages import Observation, Text, ToolCall
    from ..session import message_from_entry

    stamp = str(entry.get("timestamp", ""))
    head = f"[{stamp}] " if stamp else ""
    try:
        message = message_from_entry(entry)
    except KernelError:
        message = None
    if message is None:
        rest = {k: v for k, v in entry.items() if k not in ("type", "uuid", "timestamp")}
        return escape_terminal(f"{head}{entry.get('type')}: {json.dumps(rest, ensure_ascii=False)}")
    lines = [escape_terminal(f"{head}{message.role}:")]
    for part in message.parts:
        if isinstance(part, Text):
            lines.append(_indent(part.text, "  "))
        elif isinstance(part, ToolCall):
            arguments = (
                part.arguments
                if isinstance(part.arguments, str)
                else json.dumps(part.arguments, ensure_ascii=False)
            )
            lines.append(escape_terminal(f"  -> {part.name}({arguments})  [call {part.id}]"))
        elif isinstance(part, Observation):
            mark = " (error)" if part.is_error else ""
            lines.append(escape_terminal(f"  <- {part.name}{mark}  [call {part.call_id}]"))
            lines.append(_indent(part.content, "     "))
    return "\n".join(lines)


def _track_answers(
    entry: dict[str, Any],
    unanswered: dict[str, list[tuple[str, str]]],
    last_assistant: str | None,
) -> str | None:
    """Keep ``unanswered`` (assistant uuid -> its calls) current; the last assistant uuid.

    A ``tool`` entry answers the assistant entry it names (``answers``), or, in
    transcripts written before calls were recorded ahead of running, the one just
    before it.
    """
    uuid = str(entry.get("uuid"))
    if entry.get("type") == "tool":
        unanswered.pop(str(entry.get("answers", last_assistant)), None)
        return None
    message = entry.get("message")
    calls = message.get("parts", []) if isinstance(message, dict) else []
    pending = [
        (str(p.get("name")), str(p.get("id")))
        for p in calls
        if isinstance(p, dict) and p.get("type") == "tool_call"
    ]
    if entry.get("type") == "assistant" and pending:
        unanswered[uuid] = pending
        return uuid
    return last_assistant


@one_line_errors("tak sessions show")
def cmd_show(args: argparse.Namespace) -> int:
    from ..session import KERNEL_STOPPED

    async def body(store: AnyStore) -> int:
        key = _key(args, args.sub)
        count = 0
        # Calls recorded before they ran whose results never landed (the kernel stopped).
        unanswered: dict[str, list[tuple[str, str]]] = {}
        last_assistant: str | None = None
        async for entry in store.iter_entries(key):
            print(format_entry(entry))
            count += 1
            last_assistant = _track_answers(entry, unanswered, last_assistant)
        for calls in unanswered.values():
            for name, call_id in calls:
                print(escape_terminal(f"  <- {name} (error)  [call {call_id}]"))
                print(f"     Error (crashed): {KERNEL_STOPPED.message}")
        if count == 0:
            print(f"tak: error: no session {key}", file=sys.stderr)
            return BAD_INPUT  # the id given names no session
        if key.subpath is None:
            subs = await store.list_subkeys(key)
            if subs:
                print(f"\nchild transcripts (show with --sub): {', '.join(subs)}")
        return OK

    return _run(args, body)


async def _busy(store: AnyStore, key: SessionKey, wait_s: float) -> int:
    """Refuse, naming who holds ``key``'s session lock."""
    from ..store import FileStore

    pids = await store.lock_holders(key) if isinstance(store, FileStore) else []
    who = f"pid {', '.join(map(str, pids))}" if pids else "another process"
    print(
        f"tak: error: session {key} is in use by {who} (waited {wait_s:g} s); "
        "try again, or stop that process",
        file=sys.stderr,
    )
    return FAILED


@one_line_errors("tak sessions rm")
def cmd_rm(args: argparse.Namespace) -> int:
    import trio

    async def body(store: AnyStore) -> int:
        key = _key(args)
        deleted = None
        with trio.move_on_after(args.wait):
            deleted = await store.delete(key)
        if deleted is None:
            return await _busy(store, key, args.wait)
        if not deleted:
            print(f"tak: error: no session {key}", file=sys.stderr)
            return BAD_INPUT  # the id given names no session
        print(f"removed {key}")
        return OK

    return _run(args, body)


def _repaired(report: RepairReport) -> str:
    """What ``repair`` did to one transcript, in one line."""
    if report.quarantined is not None:
        return (
            f"damaged from line {report.first_bad_line}; kept {report.kept} entries, "
            f"quarantined the damaged file as {report.quarantined}"
        )
    if report.torn_bytes:
        return (
            f"cut a torn last line ({report.torn_bytes} bytes, an append that never "
            f"finished); kept {report.kept} entries"
        )
    return f"ok ({report.kept} entries), nothing to repair"


@one_line_errors("tak sessions repair")
def cmd_repair(args: argparse.Namespace) -> int:
    import trio

    async def body(store: AnyStore) -> int:
        from ..store import FileStore

        if not isinstance(store, FileStore):
            print(
                "tak: error: repair applies to the file store; PostgreSQL keeps its own integrity",
                file=sys.stderr,
            )
            return BAD_INPUT
        key = _key(args)
        keys = [key] + [key.child(s) for s in await store.list_subkeys(key)]
        found = False
        for k in keys:
            waited = True
            with trio.move_on_after(args.wait):
                report = await store.repair(k)
                waited = False
            if waited:
                return await _busy(store, k, args.wait)
            if report is None:
                continue
            found = True
            print(f"{k}: {_repaired(report)}")
        if not found:
            print(f"tak: error: no session {key}", file=sys.stderr)
            return BAD_INPUT  # the id given names no session
        return OK

    return _run(args, body)


__all__ = [
    "DEFAULT_WAIT_S",
    "add_commands",
    "cmd_ls",
    "cmd_repair",
    "cmd_rm",
    "cmd_show",
    "format_entry",
]
