"""``tak repl URL``: a line-oriented client of ``tak serve``.

A line is a prompt for an agent turn (``run``) on the current session; lines
starting with ``/`` are commands::

    /call TOOL {json}   run one tool call (call_tools)
    /tools              the server's tools
    /sessions           the sessions of the project
    /history            the current session's transcript
    /session ID         switch to session ID
    /cancel             cancel the running request
    /help, /quit

Output streams as events arrive. Ctrl-C cancels the running request and keeps
the REPL; Ctrl-D (end of input) or ``/quit`` leaves. Input is read by a thread
(``input()`` blocks) and handed to Trio through a memory channel, so the REPL
reads ``/cancel`` while a request runs, and works the same when stdin is a
pipe: lines then run one after another, and the REPL exits at the end of
input once the last request has replied. Lines are appended to
``$TAK_HOME/data/repl_history`` (loaded into readline on a terminal).

Exit status (``tak``'s rule, kernel/cli/_exit.py): 0; 1 when a request failed
or the connection was lost, or the server could not be reached or refused the
connection (one line says why); 2 for a URL that is not one ``tak serve``
prints. A mistyped command is reported and, at a terminal, does not change the
status.

Everything the server sends (model text, tool names and output, titles, error
messages) is shown through ``kernel.terminal.escape_terminal``: a field of one
line with its newlines escaped too, model text and tool output keeping theirs.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import threading
import uuid
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any
from urllib.parse import parse_qs, urlsplit

import trio

from ._version import __version__
from .errors import ProtocolError
from .messages import Observation, ToolCall
from .terminal import escape_terminal
from .wire import (
    DEFAULT_PROJECT,
    CallFinishedEvent,
    CallStartedEvent,
    CallTools,
    Cancel,
    Client,
    ConnectionLost,
    ErrorFrame,
    EventData,
    History,
    HistoryResult,
    ModelDeltaEvent,
    Reply,
    Request,
    RequestFailed,
    Run,
    ServerFrame,
    Sessions,
    SessionsResult,
    Tools,
    ToolsResult,
    TurnFinishedEvent,
    open_client,
)

PROMPT = "tak> "
HISTORY_LINES = 1000
HELP = """\
a line              run an agent turn with it as the prompt
/call TOOL {json}   run one tool call
/tools              list the server's tools
/sessions           list the project's sessions
/history            show the current session's transcript
/session ID         switch to session ID
/cancel             cancel the running request (Ctrl-C does the same)
/quit               leave (Ctrl-D too)"""


class Repl:
    """The REPL's state and commands; ``out`` gets results, ``err`` diagnostics."""

    def __init__(
        self,
        client: Client,
        *,
        out: IO[str],
        err: IO[str],
        session: str,
        project: str = DEFAULT_PROJECT,
        interactive: bool = False,
    ) -> None:
        self.client = client
        self.out = out
        self.err = err
        self.session = session
        self.project = project
        self.interactive = interactive
        self.failed = False
        self.running: str | None = None
        self._pending: deque[str] = deque()
        self._lines: trio.MemoryReceiveChannel[str] | None = None
        self._eof = False
        self._mid_line = False

    # --- the loop ----------------------------------------------------------------

    async def loop(self, lines: trio.MemoryReceiveChannel[str]) -> None:
        """Run lines until ``/quit``, end of input, or a lost connection."""
        self._lines = lines
        while self.client.closed is None:
            if not self._pending:
                if self._eof:
                    return
                if self.interactive:
                    self._write(PROMPT)
                    self.out.flush()
                try:
                    self._pending.append(await lines.receive())
                except trio.EndOfChannel:
                    self._eof = True
                    continue
                if self.interactive:
                    # The terminal echoed the user's Enter: the prompt's line is over.
                    self._mid_line = False
            if not await self.execute(self._pending.popleft()):
                return

    async def execute(self, line: str) -> bool:
        """Run one line; ``False`` means leave."""
        text = line.strip()
        if not text:
            return True
        if not text.startswith("/"):
            await self._run_request(
                Run(
                    id=self.client.new_id(), session=self.session, prompt=line, project=self.project
                )
            )
            return True
        command, _, rest = text.partition(" ")
        rest = rest.strip()
        if command in ("/quit", "/exit"):
            return False
        if command == "/help":
            self._line(HELP)
        elif command == "/cancel":
            self._diag("nothing is running")
        elif command == "/session":
            if not rest:
                self._line(f"session: {self.session} (project {self.project})")
            else:
                self.session = rest
                self._line(f"session: {self.session}")
        elif command == "/tools":
            await self._run_request(Tools(id=self.client.new_id()))
        elif command == "/sessions":
            await self._run_request(Sessions(id=self.client.new_id(), project=self.project))
        elif command == "/history":
            await self._run_request(
                History(id=self.client.new_id(), session=self.session, project=self.project)
            )
        elif command == "/call":
            call = self._parse_call(rest)
            if call is not None:
                await self._run_request(
                    CallTools(
                        id=self.client.new_id(),
                        session=self.session,
                        calls=(call,),
                        project=self.project,
                    )
                )
        else:
            self._mistyped(f"unknown command {command}; /help lists them")
        return True

    def _mistyped(self, text: str) -> None:
        """A line the REPL cannot run: at a terminal the person retypes it; in a script
        it is a failure the exit status keeps."""
        self._diag(text)
        if not self.interactive:
            self.failed = True

    def _parse_call(self, rest: str) -> ToolCall | None:
        name, _, raw = rest.partition(" ")
        if not name:
            self._mistyped("usage: /call TOOL {json arguments}")
            return None
        raw = raw.strip() or "{}"
        try:
            arguments = json.loads(raw)
        except ValueError:
            # Sent as it is: the executor reports bad arguments as an observation.
            arguments = raw
        if not isinstance(arguments, dict):
            arguments = raw
        return ToolCall(id=f"call_{uuid.uuid4().hex[:8]}", name=name, arguments=arguments)

    async def _run_request(self, request: Request) -> None:
        """Send ``request``, print its frames as they come; meanwhile, keep reading input."""
        self.running = request.id
        try:
            async with trio.open_nursery() as nursery:
                if self._lines is not None and not self._eof:
                    nursery.start_soon(self._read_while_running, self._lines)
                try:
                    async with self.client.request(request) as exchange:
                        async for event in exchange.events():
                            self._show_event(event)
                            self.out.flush()
                        self._show(request, await exchange.reply())
                except ConnectionLost:
                    pass  # run_repl says once that the connection is gone
                except ProtocolError as exc:
                    self._diag(f"the server broke the protocol: {exc}")
                    self.failed = True
                self._end_line()
                nursery.cancel_scope.cancel()
        finally:
            self.running = None

    async def _read_while_running(self, lines: trio.MemoryReceiveChannel[str]) -> None:
        while True:
            try:
                line = await lines.receive()
            except trio.EndOfChannel:
                self._eof = True
                return
            if line.strip() == "/cancel":
                await self.cancel_running()
            else:
                self._pending.append(line)

    async def cancel_running(self) -> None:
        """Ask the server to cancel the running request (its reply says ``cancelled``)."""
        if self.running is None or self.client.closed is not None:
            return
        with contextlib.suppress(ConnectionLost):
            await self.client.send(Cancel(id=self.client.new_id("cancel"), target=self.running))

    # --- output ------------------------------------------------------------------

    def _write(self, text: str) -> None:
        # The last guard: whatever reached here, no control but a newline is written.
        text = escape_terminal(text, keep_newlines=True)
        self.out.write(text)
        self._mid_line = bool(text) and not text.endswith("\n")

    def _end_line(self) -> None:
        if self._mid_line:
            self._write("\n")

    def _line(self, text: str) -> None:
        self._end_line()
        self._write(text + "\n")
        self.out.flush()

    def _diag(self, text: str) -> None:
        self._end_line()
        self.out.flush()
        print(escape_terminal(text), file=self.err, flush=True)

    def show_unrouted(self, frame: ServerFrame) -> None:
        if isinstance(frame, ErrorFrame):
            self._diag(f"error ({frame.error.code}): {frame.error.message}")
        # Anything else is the reply to a /cancel we sent and forgot: nothing to say.

    def _show(self, request: Request, frame: Reply | ErrorFrame) -> None:
        if isinstance(frame, ErrorFrame) or frame.status == "error":
            error = frame.error
            assert error is not None
            self._diag(f"error ({error.code}): {error.message}")
            self.failed = True
        elif frame.status == "cancelled":
            self._line("(cancelled)")
        else:
            self._show_result(request, frame)
        self.out.flush()

    def _show_event(self, event: EventData) -> None:
        if isinstance(event, ModelDeltaEvent):
            self._write(event.text)
        elif isinstance(event, CallStartedEvent):
            call = event.call
            shown = (
                call.arguments if isinstance(call.arguments, str) else json.dumps(call.arguments)
            )
            self._line(f"→ [{event.index}] {_one_line(call.name)} {_one_line(_clip(shown, 120))}")
        elif isinstance(event, CallFinishedEvent):
            self._line(_observation_line(event.observation))
        elif isinstance(event, TurnFinishedEvent):
            self._end_line()
            if event.reason != "final":
                error = f": {_one_line(event.error)}" if event.error else ""
                self._line(f"(turn ended: {event.reason}{error})")
        # An event of a kind this REPL does not know (a newer server): nothing to show.

    def _show_result(self, request: Request, reply: Reply) -> None:
        if isinstance(request, Tools):
            for spec in reply.result_as(ToolsResult).tools:
                description = str(spec.get("description") or "").strip().split("\n")
                name = _one_line(str(spec.get("name")))
                self._line(f"{name}  {_one_line(description[0])}")
        elif isinstance(request, Sessions):
            # Newest first, as `tak sessions ls` lists them.
            sessions = sorted(
                reply.result_as(SessionsResult).sessions,
                key=lambda summary: (-summary.mtime_ms, summary.session_id),
            )
            if not sessions:
                self._line(f"no sessions in project {self.project!r}")
            for summary in sessions:
                title = _one_line(summary.data.title or "")
                shown = _one_line(summary.session_id)
                self._line(f"{shown}  {summary.data.entry_count} entries  {title}")
        elif isinstance(request, History):
            entries = reply.result_as(HistoryResult).entries
            if not entries:
                self._line(f"session {self.session} is empty")
            for entry in entries:
                self._line(_entry_text(entry))


def _one_line(text: str) -> str:
    """A field the server sent, shown on one line: every control escaped, newlines too."""
    return escape_terminal(text)


def _clip(text: str, width: int) -> str:
    return text if len(text) <= width else text[: width - 3] + "..."


def _observation_line(o: Observation) -> str:
    error = o.error.kind if o.error is not None else None
    return _result_line(o.index, o.name, error, o.content, o.duration_s)


def _result_line(
    index: object, name: object, error_kind: object, content: str, duration_s: float
) -> str:
    name, error_kind = _one_line(str(name)), _one_line(str(error_kind)) if error_kind else None
    mark = f"✗ [{index}] {name} {error_kind}" if error_kind else f"✓ [{index}] {name}"
    return f"{mark} ({duration_s:.2f}s): {_indent_rest(content)}"


def _indent_rest(text: str) -> str:
    """Multi-line content (escaped) with every line after the first indented: no line
    of it can pass for one of the REPL's own."""
    return escape_terminal(text, keep_newlines=True).replace("\n", "\n    ")


def _entry_text(entry: dict[str, Any]) -> str:
    kind = entry.get("type")
    message = entry.get("message")
    kind = _one_line(str(kind))
    if not isinstance(message, dict):
        return f"[{kind}]" + (f" {_one_line(str(entry['title']))}" if kind == "title" else "")
    pieces = []
    for part in message.get("parts", []):
        if part.get("type") == "text":
            pieces.append(part.get("text", ""))
        elif part.get("type") == "tool_call":
            arguments = part.get("arguments")
            shown = arguments if isinstance(arguments, str) else json.dumps(arguments)
            pieces.append(f"→ {_one_line(str(part.get('name')))} {_one_line(_clip(shown, 120))}")
        elif part.get("type") == "observation":
            # Transcript entries are the store's dicts, not records: read them by key.
            error = part.get("error")
            pieces.append(
                _result_line(
                    part.get("index"),
                    part.get("name"),
                    error.get("kind") if error else None,
                    str(part.get("content", "")),
                    float(part.get("duration_s") or 0.0),
                )
            )
    return f"{kind}: " + _indent_rest("\n".join(pieces))


# --- running it ----------------------------------------------------------------------


def history_path(home: str | os.PathLike[str] | None = None) -> Path:
    from .home import TakHome

    return TakHome.locate(home).data / "repl_history"


def _load_readline_history(path: Path) -> None:
    """Give a terminal's line editor the saved lines (up-arrow), trimming the file."""
    try:
        import readline
    except ImportError:  # no readline on this platform: plain input() still works
        return
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return
    if len(lines) > HISTORY_LINES:
        lines = lines[-HISTORY_LINES:]
        with contextlib.suppress(OSError):
            path.write_text("\n".join(lines) + "\n")
    for line in lines:
        readline.add_history(line)


def _read_lines(
    stdin: IO[str],
    send: trio.MemorySendChannel[str],
    token: trio.lowlevel.TrioToken,
    history: Path | None,
) -> None:
    """In a daemon thread: read lines into ``send`` until end of input.

    On a terminal ``input()`` gives readline's line editing and history.
    """
    interactive = stdin is sys.stdin and stdin.isatty()
    try:
        while True:
            if interactive:
                try:
                    line = input()
                except EOFError:
                    break
            else:
                line = stdin.readline()
                if not line:
                    break
                line = line.removesuffix("\n")
            if history is not None and line.strip():
                with contextlib.suppress(OSError), history.open("a") as f:
                    f.write(line.replace("\n", " ") + "\n")
            trio.from_thread.run(send.send, line, trio_token=token)
        trio.from_thread.run_sync(send.close, trio_token=token)
    except (trio.RunFinishedError, trio.BrokenResourceError, trio.ClosedResourceError):
        pass  # the REPL ended first


def _token_from(url: str) -> str | None:
    tokens = parse_qs(urlsplit(url).query).get("token")
    return tokens[0] if tokens else os.environ.get("TAK_TOKEN")


async def run_repl(
    url: str,
    *,
    out: IO[str],
    err: IO[str],
    lines: trio.MemoryReceiveChannel[str],
    session: str | None = None,
    project: str = DEFAULT_PROJECT,
    interactive: bool = False,
    handle_sigint: bool = False,
    on_connected: Callable[[], None] | None = None,
) -> int:
    """Connect to ``url`` and run ``lines``; return the exit status.

    The token comes from the URL's query or ``$TAK_TOKEN`` (sent in ``hello``).
    With ``handle_sigint``, Ctrl-C cancels the running request instead of
    stopping the program. ``on_connected`` runs once the server said hello
    (``main`` starts reading input then: a thread blocked reading stdin must not
    outlive a REPL that could not connect).

    A URL that is not ``ws://`` or ``wss://`` is one line on ``err`` and status 2;
    a server that cannot be reached, one line and status 1.
    """
    problem = url_problem(url)
    if problem is not None:
        print(escape_terminal(f"tak repl: {problem}"), file=err, flush=True)
        return 2  # bad input (kernel/cli/_exit.py: BAD_INPUT; kernel.cli is a floor above)
    try:
        async with open_client(
            url,
            token=_token_from(url),
            name=f"tak-repl/{__version__}",
        ) as client:
            repl = Repl(
                client,
                out=out,
                err=err,
                session=session or uuid.uuid4().hex[:16],
                project=project,
                interactive=interactive,
            )
            client.on_unrouted = repl.show_unrouted
            if on_connected is not None:
                on_connected()
            info = client.info
            repl._diag(
                f"connected to {info.server} {info.version} (model {info.model}); "
                f"session {repl.session}; /help for commands"
            )
            async with trio.open_nursery() as nursery:

                async def stop_when_closed() -> None:
                    await client.wait_closed()
                    # The server is gone: stop waiting for input too.
                    nursery.cancel_scope.cancel()

                nursery.start_soon(stop_when_closed)
                if handle_sigint:
                    nursery.start_soon(_cancel_on_sigint, repl)
                await repl.loop(lines)
                nursery.cancel_scope.cancel()
            if client.closed is not None:
                repl._diag(f"connection closed: {client.closed}")
                return 1
            return 1 if repl.failed else 0
    except RequestFailed as exc:
        # hello refused: a wrong token in the URL or $TAK_TOKEN, or a full server
        print(escape_terminal(f"tak repl: {_refusal(url, exc)}"), file=err, flush=True)
        return 1
    except (OSError, ProtocolError) as exc:
        line = f"tak repl: cannot talk to {_without_token(url)}: {_why(exc)}"
        print(escape_terminal(line), file=err, flush=True)
        return 1


def _refusal(url: str, exc: RequestFailed) -> str:
    """Why the server refused ``hello``, as a person reads it: what to do next."""
    error = exc.error
    where = _without_token(url)
    if error is not None and error.code == "unauthorized":
        if _token_from(url) is None:
            return (
                f"{where} wants a token: give the whole ws://...?token=... line "
                "tak serve printed (or set $TAK_TOKEN)"
            )
        return (
            f"{where} refused the token (the URL's, or $TAK_TOKEN's): give the line "
            "this server's tak serve printed"
        )
    if error is not None:
        return f"{where} refused the connection ({error.code}): {error.message}"
    return f"{where} refused the connection: {exc.status}"


def url_problem(url: str) -> str | None:
    """Why ``url`` is not one ``tak serve`` prints (``ws://HOST:PORT/?token=...``), or ``None``."""
    parts = urlsplit(url)
    if parts.scheme not in ("ws", "wss"):
        shown = _without_token(url) if parts.scheme else url
        return f"expected a ws:// URL (the line tak serve printed), got {shown!r}"
    try:
        port = parts.port
    except ValueError as exc:  # a port that is not a number, or out of range
        return f"{_without_token(url)}: {exc}"
    if not parts.hostname:
        return f"{_without_token(url)}: no host"
    if port == 0:
        return f"{_without_token(url)}: port 0 cannot be connected to"
    return None


def _why(exc: BaseException) -> str:
    """Why a connection failed, never empty: the system's reason when there is one
    ("Connection refused", from the attempts trio grouped under its own message),
    else the first message in the chain (the wire's wrapper may say nothing)."""
    seen: set[int] = set()
    todo: list[BaseException] = [exc]
    messages: list[str] = []
    while todo:
        current = todo.pop(0)
        if id(current) in seen:
            continue
        seen.add(id(current))
        if isinstance(current, OSError) and current.strerror:
            return current.strerror
        text = str(current).strip()
        if text and not text.endswith(":") and not isinstance(current, BaseExceptionGroup):
            messages.append(text)
        if isinstance(current, BaseExceptionGroup):
            todo.extend(current.exceptions)
        for linked in (current.__cause__, current.__context__):
            if linked is not None:
                todo.append(linked)
    return messages[0] if messages else type(exc).__name__


def _without_token(url: str) -> str:
    parts = urlsplit(url)
    return parts._replace(query="").geturl()


async def _cancel_on_sigint(repl: Repl) -> None:
    with trio.open_signal_receiver(signal.SIGINT) as signals:
        async for _ in signals:
            if repl.running is not None:
                repl._diag("^C: cancelling")
                await repl.cancel_running()
            else:
                repl._diag("^C (Ctrl-D or /quit to leave)")


def main(
    url: str,
    *,
    session: str | None = None,
    project: str = DEFAULT_PROJECT,
    home: str | None = None,
    stdin: IO[str] | None = None,
    out: IO[str] | None = None,
    err: IO[str] | None = None,
) -> int:
    """``tak repl``: run the REPL on this process's terminal or pipes."""
    stdin = stdin if stdin is not None else sys.stdin
    out = out if out is not None else sys.stdout
    err = err if err is not None else sys.stderr
    interactive = stdin.isatty()
    history: Path | None = history_path(home)
    try:
        history_path(home).parent.mkdir(parents=True, exist_ok=True)
    except OSError:
        history = None  # a read-only home: run without saving lines
    if interactive and history is not None:
        _load_readline_history(history)

    async def repl_main() -> int:
        send, receive = trio.open_memory_channel[str](16)
        thread = threading.Thread(
            target=_read_lines,
            args=(stdin, send, trio.lowlevel.current_trio_token(), history),
            name="tak-repl-stdin",
            daemon=True,  # blocked in input() at exit: must not keep the process alive
        )
        return await run_repl(
            url,
            out=out,
            err=err,
            lines=receive,
            session=session,
            project=project,
            interactive=interactive,
            handle_sigint=threading.current_thread() is threading.main_thread(),
            on_connected=thread.start,
        )

    return trio.run(repl_main)


__all__ = ["Repl", "history_path", "main", "run_repl", "url_problem"]
