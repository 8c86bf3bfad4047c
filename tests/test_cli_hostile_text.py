"""Hostile text never reaches the terminal raw: every ``tak`` command, walked.

One home holds hostile data of every kind the CLI shows: a workspace plugin
(approved) whose description, docstring and output carry ``ESC [ 8 m`` (hidden
text), ``ESC ] 0 ;`` (a window title), ``\\r`` (an overwritten line), ``\\x9b``
(a one-byte CSI), U+202E (a bidi override) and a ``\\n`` that forges a line; a
plugin file whose *name* carries them; an MCP server (approved) whose tool
description and output carry them, and one whose program's name does; a model
(an OpenAI-compatible server on 127.0.0.1: only the provider is faked) whose
text, tool-call names and arguments and error replies carry them; the session
and the batch run those made; a batch task's seed directory with a link whose
name carries them (a warning names it: a log record). Each command of the parser
is run on that home in this process (``kernel.cli.main``, its descriptors
captured, so a child's writes count; a log record nobody handles reaches stderr
as in a ``tak`` process), and its stdout and stderr must hold none of
``kernel.terminal.ESCAPES`` but the newline, nor a forged line, except where
multi-line content is shown (a tool's output, a model's text), whose newlines
are kept. ``tak serve`` runs as a process for ``tak repl`` to talk to, and a
client that names itself and closes with controls: its log must hold none either.

The walk is built from the parser: a command added to ``tak`` without a case
here fails ``test_every_command_is_walked``.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import logging
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import attrs
import pytest
import trio

from kernel.cli import build_parser, main
from kernel.cli._exit import exit_code
from kernel.terminal import ESCAPES, escape_terminal
from tests.cli_kit import child_environ, die_with_parent, tak_argv
from tests.mcp.mcp_kit import light_server_args

#: Every trick at once; FORGED starts the line the ``\n`` would forge.
FORGED = "FORGED-LINE"
HOSTILE = (
    "\x1b[8mhidden\x1b[0m \x1b]0;retitled\x07 \rover \x9b2J \u202eevil \u2028sep\x7f"
    f"\n{FORGED} trusted: yes"
)
#: What shows that hostile text reached the output, escaped (as JSON in --json, as
#: Python's repr where an error quotes a name).
SHOWN = ("\\e[8m", "\\u001b[8m", "\\x1b[8m")
#: A name with controls, for the places a name is quoted (an error, a listing).
BAD_NAME = "ev\x1b[8mil\u202e"

#: The characters that must not be written raw: every one a terminal acts on but \n.
RAW = {chr(code) for code in ESCAPES} - {"\n"}

PLUGIN_SOURCE = f'''
from kernel import Plugin

H = {HOSTILE!r}
plugin = Plugin("hostile", version="1.0", description=H)


@plugin.tool
def shout(text: str) -> str:
    """Shout {HOSTILE.replace(chr(10), "").encode("unicode_escape").decode()} loudly."""
    return H + text
'''

#: The MCP server's one tool and what it prints at start: hostile text (a plain
#: stdio server, tests/mcp/light_server.py: the subject is the kernel's side).
MCP_TOOLS = [{"name": "say", "description": "Say " + HOSTILE, "reply": HOSTILE}]


# --- a model that speaks hostile text ------------------------------------------------


def _chunk(delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
    return {
        "id": "chatcmpl-hostile",
        "object": "chat.completion.chunk",
        "created": 1_760_000_000,
        "model": "hostile",
        "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
    }


def _call(index: int, call_id: str, name: str, arguments: dict[str, Any]) -> dict[str, Any]:
    function = {"name": name, "arguments": json.dumps(arguments)}
    return {"index": index, "id": call_id, "type": "function", "function": function}


def _reply(body: dict[str, Any]) -> tuple[int, list[dict[str, Any]] | dict[str, Any]]:
    """First request of a turn: hostile text and two calls (one to a tool named with
    controls); after the tool results: a hostile answer. Model ``fail``: a hostile
    HTTP 400."""
    if body.get("model") == "fail":
        return 400, {"error": {"message": HOSTILE, "type": "invalid_request_error"}}
    if body["messages"][-1].get("role") == "tool":
        return 200, [_chunk({"role": "assistant", "content": HOSTILE}), _chunk({}, "stop")]
    calls = [
        _call(0, "call_shout", "shout", {"text": HOSTILE}),
        _call(1, "call_bad" + BAD_NAME, "sh" + BAD_NAME, {"x": HOSTILE}),
    ]
    return 200, [
        _chunk({"role": "assistant", "content": HOSTILE}),
        _chunk({"tool_calls": calls}),
        _chunk({}, "tool_calls"),
    ]


@contextlib.contextmanager
def hostile_model() -> Iterator[str]:
    """An OpenAI-compatible server on 127.0.0.1; its base URL."""

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            status, reply = _reply(body)
            self.send_response(status)
            if isinstance(reply, dict):
                data = json.dumps(reply).encode()
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)
                return
            self.send_header("Content-Type", "text/event-stream")
            self.end_headers()
            for c in reply:
                self.wfile.write(f"data: {json.dumps(c)}\n\n".encode())
            self.wfile.write(b"data: [DONE]\n\n")

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/v1"
    finally:
        server.shutdown()
        server.server_close()


# --- the home ---------------------------------------------------------------------------


@attrs.frozen
class World:
    root: Path
    home: Path
    workspace: Path
    repl_url: str
    serve_log: Path


@attrs.frozen
class Ran:
    argv: list[str]
    code: int
    stdout: str
    stderr: str


def tak(world: World, *argv: str, stdin: str = "") -> int:
    """``tak --home HOME ARGV...`` in this process (``kernel.cli.main``); its status.
    Its output is what a terminal would get: what the command prints and whatever a
    child process it starts writes to the same descriptors (``capfd`` holds both).

    A log record that no handler takes reaches stderr through ``logging.lastResort``,
    as in a ``tak`` process: pytest's own capturing handlers are taken off the root
    logger meanwhile.
    """
    root = logging.getLogger()
    handlers = root.handlers[:]
    for handler in handlers:
        root.removeHandler(handler)
    before = sys.stdin
    sys.stdin = io.StringIO(stdin)
    try:
        code = main(["--home", str(world.home), *argv])
    except SystemExit as exc:  # argparse's own usage errors
        code = exit_code(exc)
    finally:
        sys.stdin = before
        for handler in handlers:
            root.addHandler(handler)
    return code


def _setup(world: World, *argv: str) -> None:
    """A step that makes the home (its output is not what is checked)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = tak(world, *argv)
    assert code == 0, f"tak {' '.join(argv)}: {code}\n{out.getvalue()}{err.getvalue()}"


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    """The hostile home, made once for the module (one test uses it: a test process of
    pytest-xdist makes it once), with ``tak serve`` running on it."""
    root = tmp_path_factory.mktemp("hostile")
    home, workspace = root / "home", root / "workspace"
    plugins = workspace / ".tak" / "plugins"
    plugins.mkdir(parents=True)
    (plugins / "hostile.py").write_text(PLUGIN_SOURCE)
    (plugins / f"{BAD_NAME}.py").write_text("x = 1\n")  # a file name that is an attack
    (home / "config").mkdir(parents=True)
    (home / "config" / "tak.toml").write_text(
        "[mcp.servers.m]\n"
        f"command = {json.dumps(sys.executable)}\n"
        f"args = {json.dumps(light_server_args(root, MCP_TOOLS, stderr=HOSTILE))}\n"
        'start = "eager"\n'
        "[mcp.servers.gone]\n"
        f"command = {json.dumps('/nonexistent/' + BAD_NAME)}\n"
    )
    # A task seeded from a directory (a cloned repository) whose link's name is an attack
    # and leads out of it: the warning that names it is a log record.
    seed = root / "seed"
    seed.mkdir()
    (seed / f"link{BAD_NAME}").symlink_to("/etc/passwd")
    (root / "tasks.jsonl").write_text(
        "".join(
            json.dumps({"id": f"t{i}", "prompt": HOSTILE, "workspace": str(seed)}) + "\n"
            for i in range(2)
        )
    )
    # A run's directory copied from elsewhere: its manifest is anyone's.
    (root / "copied-run").mkdir()
    (root / "copied-run" / "manifest.json").write_text(
        json.dumps({"run_id": "r" + BAD_NAME, "created": 1.0, "nonce": HOSTILE})
    )
    (root / "copied-run" / "tasks.jsonl").write_text("")
    with hostile_model() as base_url, pytest.MonkeyPatch.context() as env:
        for key in [k for k in os.environ if k.endswith("_API_KEY")]:
            env.delenv(key)
        env.delenv("TAK_HOME", raising=False)
        env.delenv("TAK_STORE_URL", raising=False)
        env.setenv("OPENAI_BASE_URL", base_url)
        env.setenv("OPENAI_API_KEY", "sk-test")
        world = World(root, home, workspace, repl_url="", serve_log=root / "serve.log")
        _setup(world, "plugins", "trust", "hostile", "--workspace", str(workspace))
        _setup(world, "mcp", "trust", "m")
        # A title, as a kernel writes one (the session's ls line); the walk's tak run
        # adds the model's text, its calls and their results to the same session.
        trio.run(_append_title, home)
        with _served(world) as url:
            yield attrs.evolve(world, repl_url=url)


async def _append_title(home: Path) -> None:
    from kernel.home import TakHome
    from kernel.store import SessionKey, open_store

    async with open_store(TakHome(home), {}) as store:
        title = {"type": "title", "uuid": "title-1", "timestamp": "2026-12-02T00:00:00Z"}
        await store.append(SessionKey("default", "hostile"), [{**title, "title": HOSTILE}])


@contextlib.contextmanager
def _served(world: World) -> Iterator[str]:
    """``tak serve`` on the hostile home as a process (``tak repl`` talks to it), its
    stderr (its log) in ``serve_log``; its URL."""
    with world.serve_log.open("w") as log:
        server = subprocess.Popen(
            tak_argv("serve", "--port", "0", "--workspace", str(world.workspace), home=world.home),
            stdout=subprocess.PIPE,
            stderr=log,
            text=True,
            env=child_environ(),
            preexec_fn=die_with_parent,
        )
        try:
            assert server.stdout is not None
            url = server.stdout.readline().strip()
            assert url.startswith("ws://"), url
            yield url
        finally:
            server.terminate()
            try:
                server.wait(timeout=60)
            except subprocess.TimeoutExpired:
                server.kill()
                server.wait()
            server.stdout.close() if server.stdout else None


#: A client's own words, short enough for a close frame's reason (123 bytes).
CLIENT_TEXT = f"\x1b[8mhid\x1b]0;t\x07\r\x9b\u202e\n{FORGED} x"


async def _hostile_client(url: str) -> None:
    """A client of ``tak serve`` that names itself with controls and closes with them
    (``tak serve`` logs a connection's close and its reason)."""
    from trio_websocket import open_websocket_url

    async with open_websocket_url(url) as ws:
        await ws.send_message(
            json.dumps({"v": 1, "type": "hello", "id": "h", "client": CLIENT_TEXT})
        )
        await ws.get_message()
        await ws.aclose(code=4000, reason=CLIENT_TEXT)


# --- the walk ----------------------------------------------------------------------------


@attrs.frozen
class Case:
    argv: tuple[str, ...]
    #: multi-line content is shown (a tool's output, a model's text): its newlines are kept
    multiline: bool = False
    #: the hostile text must be in the output (escaped): the case shows it
    shows: bool = True
    stdin: str = ""


W = "{workspace}"  # replaced by the world's workspace
ROOT = "{root}"  # by its root directory
URL = "{url}"  # by tak serve's URL

# One case a command where one shows the most, walked in this order: tak run and tak
# batch run make the session and the run that the commands after them show. Each runs
# in this process (only tak serve is a process of its own: tak repl talks to it).
CASES: dict[str, list[Case]] = {
    # the model's text, its calls (one to a tool named with controls), their results
    "run": [
        Case(
            (
                "run",
                HOSTILE,
                "--model",
                "openai:gpt-4.1-mini",
                "--session",
                "hostile",
                "--workspace",
                W,
            ),
            multiline=True,
        )
    ],
    # the provider's hostile error; the seed's hostile link name (a log record)
    "batch run": [Case(("batch", "run", f"{ROOT}/tasks.jsonl", "--model", "openai:fail"))],
    "tools": [Case(("tools", "--workspace", W))],  # the plugin's and the server's descriptions
    "call": [
        Case(("call", "--workspace", W, "shout", json.dumps({"text": "!"})), multiline=True),
        Case(("call", "--workspace", W, "m.say", "--json")),
    ],
    "demo": [Case(("demo",), shows=False)],  # shows only its own tools' text
    "batch resume": [Case(("batch", "resume", "tasks"))],
    "batch ls": [Case(("batch", "ls", "--json"), shows=False)],  # numbers and the model string
    "batch show": [
        Case(("batch", "show", "tasks")),
        Case(("batch", "show", "tasks", "--json")),
        Case(("batch", "show", f"{ROOT}/copied-run")),  # its id, its sessions' project
    ],
    "batch worker": [Case(("batch", "worker", "--run", "tasks", "--store", "x" + BAD_NAME))],
    "sessions ls": [Case(("sessions", "ls"))],  # the session's title
    "sessions show": [Case(("sessions", "show", "hostile"), multiline=True)],
    "sessions rm": [Case(("sessions", "rm", BAD_NAME))],
    "sessions repair": [Case(("sessions", "repair", BAD_NAME))],
    "doctor": [Case(("doctor",), shows=False)],
    "plugins ls": [Case(("plugins", "ls", "--workspace", W))],
    "plugins trust": [Case(("plugins", "trust", BAD_NAME, "--workspace", W))],
    "plugins untrust": [Case(("plugins", "untrust", BAD_NAME, "--workspace", W))],
    "plugins new": [Case(("plugins", "new", BAD_NAME, "--dir", f"{ROOT}/new"))],
    "plugins check": [Case(("plugins", "check", f"{W}/.tak/plugins/hostile.py"))],
    # a hostile word where none is expected: argparse quotes what it was given
    "serve": [Case(("serve", "--host", BAD_NAME)), Case(("serve", "--port", "1", BAD_NAME))],
    "repl": [
        Case(
            ("repl", URL, "--session", "hostile"),
            multiline=True,
            stdin='/tools\n/call shout {"text": "!"}\n/history\n/sessions\n',
        ),
    ],
    "mcp ls": [Case(("mcp", "ls"))],  # the failed server's program name
    "mcp trust": [Case(("mcp", "trust", BAD_NAME))],
    "mcp untrust": [Case(("mcp", "untrust", BAD_NAME))],
    "mcp serve": [Case(("mcp", "serve", "--http", BAD_NAME))],
}


def leaf_commands(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()) -> Iterator[str]:
    """Every command a person can run (``batch show``, ``tools``...), from the parser."""
    groups = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    if not groups:
        yield " ".join(path)
    for group in groups:
        for name, sub in group._name_parser_map.items():
            yield from leaf_commands(sub, (*path, name))


def test_every_command_is_walked() -> None:
    commands = set(leaf_commands(build_parser()))
    assert commands - set(CASES) == set(), "add a case for each new command to CASES"
    assert set(CASES) - commands == set()


def raw_controls(text: str) -> list[str]:
    return sorted({ch for ch in text if ch in RAW})


def test_raw_controls_sees_each_trick() -> None:
    # The checker itself: each character of HOSTILE that a terminal acts on is found.
    assert raw_controls(HOSTILE) == sorted(
        {"\x1b", "\x07", "\r", "\x9b", "\u202e", "\u2028", "\x7f"}
    )


def problems(ran: Ran, case: Case) -> list[str]:
    """What is wrong with what ``case`` wrote: raw controls, a forged line, nothing hostile
    shown where the case shows it."""
    where = f"tak {' '.join(ran.argv)!r} (status {ran.code})"
    found = []
    for name, text in (("stdout", ran.stdout), ("stderr", ran.stderr)):
        if raw_controls(text):
            found.append(f"{where}: raw controls {raw_controls(text)} on {name}:\n{text}")
        forged = [line for line in text.splitlines() if line.startswith(FORGED)]
        if forged and not case.multiline:
            found.append(f"{where}: a forged line on {name}:\n{text}")
    if case.shows and not any(s in ran.stdout + ran.stderr for s in SHOWN):
        found.append(f"{where}: shows nothing hostile:\n{ran.stdout}{ran.stderr}")
    return found


def test_no_raw_control_reaches_the_terminal(
    world: World, capfd: pytest.CaptureFixture[str]
) -> None:
    """Every case of every command, in one test (the home is made once), each failure
    named; then tak serve's log, after tak repl and a hostile client talked to it."""
    found: list[str] = []
    for cases in CASES.values():
        for case in cases:
            argv = [
                word.replace(W, str(world.workspace))
                .replace(ROOT, str(world.root))
                .replace(URL, world.repl_url)
                for word in case.argv
            ]
            capfd.readouterr()
            code = tak(world, *argv, stdin=case.stdin)
            out, err = capfd.readouterr()
            found += problems(Ran(argv, code, out, err), case)
    trio.run(_hostile_client, world.repl_url)
    shown = escape_terminal(CLIENT_TEXT)
    for _ in range(600):  # a hang guard: the close is logged once the server has seen it
        log = world.serve_log.read_text()
        if shown in log:
            break
        time.sleep(0.1)
    else:
        found.append(f"tak serve's log never showed the client's close:\n{log}")
    if raw_controls(log) or any(line.startswith(FORGED) for line in log.splitlines()):
        found.append(f"tak serve's log: raw controls or a forged line:\n{log}")
    assert found == [], "\n\n".join(found)
