"""A second engineer's attacks on issue 23's changes: run settings and the read-only
run view (kernel.batch), the MCP server as a library (kernel.mcp), typed config
sections (open_store), the session as the one maker of the recorded form
(kernel.session, kernel.agent), one provider list, and the last hang guard.

The bugs it found are fixed, and their tests now hold: a huge ``--max-steps`` (an
OverflowError), a hand-edited limit called a foreign run, a FIFO in a run directory
(waited on for ever), invalid JSON-RPC lines never answered, a query token outside
latin-1 (a 500), the recorded text of an abandoned final record, and a child forked
under the hang guard.
"""

from __future__ import annotations

import errno
import faulthandler
import json
import os
import select
import signal
import socket
import threading
from pathlib import Path
from types import SimpleNamespace
from typing import Any
from urllib.parse import quote

import pytest
import trio

from kernel import tool
from kernel.agent import Agent
from kernel.batch import (
    RunSettings,
    TaskLimits,
    TasksFile,
    open_postgres_ledger,
    open_run_dir,
    read_run_dir,
)
from kernel.batch._directory import RESULTS
from kernel.errors import StoreError, UsageError
from kernel.home import Config, StoreConfig, TakHome
from kernel.messages import ToolCall
from kernel.models import ScriptedModel
from kernel.session import Session
from kernel.store import FileStore, MemoryStore, SessionKey, open_store
from tests.batch.ledger_conformance import result, task
from tests.cli_kit import tak
from tests.hang_guard import hang_limit_s

try:  # the PostgreSQL fixtures, until they move to tests/conftest.py (for every folder)
    from tests.store.conftest import db_url, pg  # noqa: F401
except ImportError:
    pass

reply = ScriptedModel.reply

# -- 1. RunSettings and the read-only run view -----------------------------------------


def _tasks_file(tmp_path: Path) -> Path:
    path = tmp_path / "evals.jsonl"
    path.write_text('{"id": "a", "prompt": "hello"}\n')
    return path


def test_a_max_steps_past_float_range_is_a_limit_not_an_internal_error(tmp_path: Path) -> None:
    """A whole number, however big, is a positive integer (JSON keeps it): taken as the
    limit it is (``math.isfinite`` of it overflowed: "internal error: OverflowError")."""
    tasks = _tasks_file(tmp_path)
    huge = 10**400
    home = tmp_path / "home"
    done = tak("batch", str(tasks), "--max-steps", str(huge), home=home, demo=True)
    assert done.returncode == 0 and "internal error" not in done.stderr, done.stderr
    manifest = json.loads((home / "batch" / "evals" / "manifest.json").read_text())
    assert manifest["settings"]["limits"] == {"max_steps": huge}


def test_every_limit_survives_resume_and_a_second_run_with_the_same_flags(tmp_path: Path) -> None:
    """--max-tokens and --max-cost too (the fix's own test covers steps and wall time)."""
    tasks = _tasks_file(tmp_path)
    home = tmp_path / "home"
    limits = ("--max-steps", "3", "--max-tokens", "5000", "--max-cost", "1", "--wall-time", "60")
    first = tak("batch", str(tasks), *limits, home=home, demo=True)
    assert first.returncode == 0, first.stderr
    manifest = json.loads((home / "batch" / "evals" / "manifest.json").read_text())
    assert manifest["settings"]["limits"] == {
        "max_steps": 3,
        "max_tokens": 5000,
        "max_cost": 1.0,
        "wall_time": 60.0,
    }
    resumed = tak("batch", "resume", "evals", home=home, demo=True)
    assert resumed.returncode == 0, resumed.stderr
    again = tak("batch", str(tasks), *limits, home=home, demo=True)
    assert again.returncode == 0, again.stderr
    other = tak("batch", str(tasks), "--max-cost", "2", home=home, demo=True)
    assert other.returncode == 2 and "started with other limits" in other.stderr, other.stderr


async def test_a_manifest_of_the_previous_format_still_reads(tmp_path: Path) -> None:
    """What 98f709d's RunCommand wrote (limits as a dict of the flags given)."""
    old = {
        "model": "scripted:demo",
        "fallbacks": [],
        "system": None,
        "plugins": [],
        "tools": None,
        "settings": None,
        "limits": {"max_steps": 2, "wall_time": 60.0},
        "concurrency": 10,
        "tasks_file": None,
    }
    async with open_run_dir(tmp_path / "r", settings=old) as ledger:
        kept = RunSettings.of_ledger(ledger)
    assert kept.limits == TaskLimits(max_steps=2, wall_time=60.0)
    assert isinstance(kept.limits.max_steps, int)
    assert kept.to_json()["limits"] == {"max_steps": 2, "wall_time": 60.0}


@pytest.mark.parametrize(
    "limits",
    [{"max_steps": 2.0}, {"max_steps": -1}, {"max_cost": "1"}, {"wall_time": 0}],
    ids=["float-steps", "negative", "string", "zero"],
)
def test_a_hand_edited_bad_limit_is_named_not_called_a_foreign_run(
    limits: dict[str, Any],
) -> None:
    settings = {"model": "scripted:demo", "limits": limits}
    with pytest.raises(UsageError) as refused:
        RunSettings.of_ledger(SimpleNamespace(settings=settings, run_id="r"))  # type: ignore[arg-type]
    message = str(refused.value)
    assert "not started by" not in message and next(iter(limits)) in message, message


def test_odd_but_valid_limits_in_a_manifest_read_back() -> None:
    """null is no limit; an int for a float limit is taken; a huge step count is a count."""
    settings = {
        "model": "scripted:demo",
        "limits": {"max_steps": None, "max_cost": 1, "max_tokens": 10**30},
    }
    kept = RunSettings.of_ledger(SimpleNamespace(settings=settings, run_id="r"))  # type: ignore[arg-type]
    assert kept.limits == TaskLimits(max_cost=1.0, max_tokens=10**30)
    assert kept.to_json()["limits"] == {"max_cost": 1, "max_tokens": 10**30}


async def test_limits_round_trip_through_a_postgresql_run(tmp_path: Path, db_url: str) -> None:
    given = RunSettings(
        model="scripted:demo",
        limits=TaskLimits(max_steps=2, max_tokens=1000, max_cost=0.5, wall_time=60.0),
        tasks_file=TasksFile.of(_tasks_file(tmp_path)),
    )
    with trio.fail_after(60):  # a hang guard
        async with open_postgres_ledger(db_url, "pgr", settings=given.to_json()) as ledger:
            pass
        async with open_postgres_ledger(db_url, "pgr", create=False) as ledger:
            kept = RunSettings.of_ledger(ledger)
    assert kept == given and given.differences(kept) == []
    assert isinstance(kept.limits.max_steps, int) and isinstance(kept.limits.max_tokens, int)


def test_a_postgresql_worker_runs_with_the_limits_of_the_run(tmp_path: Path, db_url: str) -> None:
    tasks = _tasks_file(tmp_path)
    home = tmp_path / "home"
    limits = ("--max-steps", "2", "--max-tokens", "900", "--max-cost", "0.5", "--wall-time", "30")
    command = ("batch", str(tasks), "--store", db_url, "--run-id", "lim", *limits)
    first = tak(*command, home=home, demo=True)
    assert first.returncode == 0, first.stderr
    worker = tak("batch", "worker", "--run", "lim", "--store", db_url, home=home, demo=True)
    assert worker.returncode == 0, worker.stderr
    again = tak(*command, home=home, demo=True)
    assert again.returncode == 0, again.stderr


async def test_a_view_read_while_results_are_appended_only_grows(tmp_path: Path) -> None:
    """A reader in another thread, while the holder finishes tasks: never an error,
    never a result without its task, the counts never go back."""
    run = tmp_path / "r"
    seen: list[tuple[int, int]] = []
    problems: list[BaseException] = []
    stop = threading.Event()

    def read_forever() -> None:
        while not stop.is_set():
            try:
                view = read_run_dir(run)
            except BaseException as exc:  # recorded, asserted below
                problems.append(exc)
                return
            seen.append((view.total, view.finished))

    n = 40
    with trio.fail_after(60):  # a hang guard
        async with open_run_dir(run, settings={"model": "scripted:x"}) as ledger:
            await ledger.add_tasks([task(i) for i in range(n)])
            await ledger.claim("w", n)
            reader = threading.Thread(target=read_forever)
            reader.start()
            try:
                for i in range(n):
                    await ledger.finish("w", result(f"t{i:03d}", text="x" * 5000))
                    await trio.lowlevel.checkpoint()
            finally:
                stop.set()
                await trio.to_thread.run_sync(reader.join)
    assert problems == []
    assert all(total == n for total, _ in seen)
    finished = [f for _, f in seen]
    assert finished == sorted(finished)
    assert read_run_dir(run).finished == n


def test_a_fifo_in_a_run_directory_is_refused_not_waited_on(tmp_path: Path) -> None:
    run = tmp_path / "r"
    trio.run(_make_run, run)
    (run / RESULTS).unlink()
    os.mkfifo(run / RESULTS)
    outcome: list[BaseException | None] = []

    def read() -> None:
        try:
            read_run_dir(run)
            outcome.append(None)
        except BaseException as exc:  # asserted below
            outcome.append(exc)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    opened_by_reader = False
    # Deterministic: a non-blocking open for writing succeeds only once a reader has
    # the FIFO open (ENXIO before); closing it gives that reader EOF, so nothing hangs.
    for _ in range(100_000):
        if not reader.is_alive():
            break
        try:
            fd = os.open(run / RESULTS, os.O_WRONLY | os.O_NONBLOCK)
        except OSError as exc:
            assert exc.errno == errno.ENXIO
            reader.join(0.001)
            continue
        opened_by_reader = True
        os.close(fd)
        break
    reader.join(30)  # a hang guard
    assert not opened_by_reader, "read_run_dir opened the FIFO and waited for a writer"
    assert outcome and isinstance(outcome[0], UsageError | OSError)


async def _make_run(run: Path) -> None:
    async with open_run_dir(run, settings={"model": "scripted:x"}) as ledger:
        await ledger.add_tasks([task(1)])


def test_a_result_whose_task_line_is_torn_is_named_in_one_line(tmp_path: Path) -> None:
    """A hand-made damage (no writer leaves it): the reader says which line, and
    leaves the files as they were."""
    run = tmp_path / "r"
    trio.run(_make_run, run)
    with open(run / "tasks.jsonl", "ab") as f:
        f.write(b'{"id": "t002", "pro')
    with open(run / RESULTS, "ab") as f:
        f.write(b'{"id": "t002", "reason": "final"}\n')
    before = (run / "tasks.jsonl").read_bytes()
    with pytest.raises(UsageError, match=r"results.jsonl:1: a result for task 't002'"):
        read_run_dir(run)
    assert (run / "tasks.jsonl").read_bytes() == before


# -- 2. kernel.mcp ----------------------------------------------------------------------


class _Wire:
    """One end of a socket pair that ``serve_stdio`` serves on the other."""

    def __init__(self, sock: socket.socket) -> None:
        self.stream = trio.SocketStream(trio.socket.from_stdlib_socket(sock))
        self.buffer = b""

    async def send(self, line: bytes) -> None:
        await self.stream.send_all(line + b"\n")

    async def receive(self) -> dict[str, Any]:
        while b"\n" not in self.buffer:
            data = await self.stream.receive_some(65536)
            assert data, "the server closed the wire"
            self.buffer += data
        line, _, self.buffer = self.buffer.partition(b"\n")
        answer: dict[str, Any] = json.loads(line)
        return answer

    async def until(self, wanted: int) -> list[dict[str, Any]]:
        """Every answer up to and including the one for id ``wanted``."""
        answers = [await self.receive()]
        while answers[-1].get("id") != wanted:
            answers.append(await self.receive())
        return answers


@tool
def surrogate() -> str:
    """Return text with a lone surrogate."""
    return "x\udc80y"


async def _serving(tmp_path: Path, body: Any) -> None:
    from kernel import open_kernel
    from kernel.mcp import mcp_server, serve_stdio

    ours, theirs = socket.socketpair()
    with ours, theirs:
        wire = _Wire(ours)
        with trio.fail_after(60):  # a hang guard
            async with (
                open_kernel(home=tmp_path, tools=[surrogate], plugins=[]) as k,
                trio.open_nursery() as nursery,
            ):
                server = mcp_server(k, k.session())
                nursery.start_soon(serve_stdio, server, theirs.fileno(), theirs.fileno())
                params = {"protocolVersion": "2025-06-18", "capabilities": {},
                          "clientInfo": {"name": "t", "version": "1"}}  # fmt: skip
                hello = {"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": params}
                await wire.send(json.dumps(hello).encode())
                assert "result" in await wire.receive()
                await wire.send(b'{"jsonrpc": "2.0", "method": "notifications/initialized"}')
                await body(wire)
                nursery.cancel_scope.cancel()


async def test_mcp_stdio_answers_an_invalid_request_with_its_id(tmp_path: Path) -> None:
    async def body(wire: _Wire) -> None:
        await wire.send(b'{"jsonrpc": "2.0", "id": 7, "method": 5}')
        await wire.send(b'{"jsonrpc": "2.0", "id": 8, "method": "tools/list"}')
        answers = await wire.until(8)  # id 8 is answered: the server lives on
        assert any(a.get("id") == 7 and "error" in a for a in answers), answers

    await _serving(tmp_path, body)


async def test_mcp_stdio_answers_a_line_that_is_not_json(tmp_path: Path) -> None:
    async def body(wire: _Wire) -> None:
        await wire.send(b"{not json")
        await wire.send(b'{"jsonrpc": "2.0", "id": 8, "method": "tools/list"}')
        answers = await wire.until(8)
        assert any(a.get("id") is None and "error" in a for a in answers), answers

    await _serving(tmp_path, body)


async def test_mcp_stdio_survives_bad_frames_and_sends_a_surrogate_as_json(tmp_path: Path) -> None:
    """After bad frames the next request is answered; a tool's lone surrogate reaches
    the client as U+FFFD (the writer's model_dump_json does not die of it)."""

    async def body(wire: _Wire) -> None:
        await wire.send(b'{"jsonrpc": "2.0", "id": 7, "method": 5}')
        await wire.send(b"[]")
        await wire.send(b"\xff\xfe")
        call = {"jsonrpc": "2.0", "id": 9, "method": "tools/call",
                "params": {"name": "surrogate", "arguments": {}}}  # fmt: skip
        await wire.send(json.dumps(call).encode())
        [*_, answer] = await wire.until(9)
        assert answer["result"]["content"][0]["text"] == "x\ufffdy", answer
        await wire.send(b'{"jsonrpc": "2.0", "id": 10, "method": "tools/list"}')
        assert "result" in (await wire.until(10))[-1]

    await _serving(tmp_path, body)


async def _ok(scope: Any, receive: Any, send: Any) -> None:
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b"ok"})


async def _status(token: str, headers: list[tuple[bytes, bytes]], query: bytes = b"") -> int:
    from kernel.mcp import guarded_app

    app = guarded_app(_ok, token, allow_remote=False)
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b""}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    scope = {"type": "http", "path": "/mcp", "headers": headers, "query_string": query}
    await app(scope, receive, send)
    status: int = sent[0]["status"]
    return status


LOCAL = (b"host", b"localhost:8765")


async def test_a_query_token_outside_latin1_is_refused_not_raised() -> None:
    assert await _status("secret", [LOCAL], b"token=%CF%80") == 401


async def test_the_printed_url_works_with_a_non_ascii_token() -> None:
    token = "clé"
    assert await _status(token, [LOCAL], b"token=" + quote(token, safe="").encode()) == 200


async def test_the_http_guard_checks_host_then_token_and_the_header_wins() -> None:
    assert await _status("secret", [LOCAL], b"token=secret") == 200
    assert await _status("secret", [(b"host", b"[::1]:1")], b"token=secret") == 200
    assert await _status("secret", [(b"host", b"evil.example")], b"token=secret") == 403
    assert await _status("secret", [(b"host", b"localhost.evil.example")], b"token=secret") == 403
    assert await _status("secret", [], b"token=secret") == 403  # no Host at all
    wrong = (b"authorization", b"Bearer nope")
    assert await _status("secret", [LOCAL, wrong], b"token=secret") == 401
    assert await _status("secret", [LOCAL, (b"authorization", b"Bearer secret")]) == 200
    assert await _status("secret", [LOCAL], b"token=secre") == 401
    assert await _status("secret", [LOCAL], b"token=") == 401
    assert await _status("a+b", [LOCAL], b"token=" + quote("a+b", safe="").encode()) == 200


# -- 3. typed config sections ------------------------------------------------------------


def test_open_store_takes_the_environment_url_over_any_section(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    home = TakHome.locate(tmp_path)
    monkeypatch.setenv("TAK_STORE_URL", "")  # empty: unset
    assert isinstance(open_store(home, StoreConfig()), FileStore)
    monkeypatch.setenv("TAK_STORE_URL", "postgresql://u:hunter2@db.example/tak")
    shown = repr(open_store(home, StoreConfig(url="postgresql://other/x")))
    assert "db.example" in shown and "hunter2" not in shown
    monkeypatch.setenv("TAK_STORE_URL", "sqlite:///x:hunter2")
    with pytest.raises(UsageError, match=r"\$TAK_STORE_URL: expected a postgresql://") as bad:
        open_store(home, StoreConfig())
    assert "hunter2" not in str(bad.value)
    monkeypatch.setenv("TAK_STORE_URL", " ")
    with pytest.raises(UsageError, match=r"\$TAK_STORE_URL"):
        open_store(home, {"store": {}})


def test_a_mapping_with_a_section_tak_toml_lacks_is_refused_now(tmp_path: Path) -> None:
    """The old mapping form only had its [store] read; now every section is checked
    (a caller that passed its own extra keys gets a one-line refusal)."""
    home = TakHome.locate(tmp_path)
    with pytest.raises(UsageError, match=r"\$: unknown setting 'mine'"):
        open_store(home, {"store": {}, "mine": {"x": 1}})
    assert isinstance(open_store(home, Config.from_toml({"store": {}}).store), FileStore)


# -- 4. the session makes the recorded form ----------------------------------------------


@tool
def shout(s: str) -> str:
    """Echo it back with a lone surrogate."""
    return s + "\udc80"


async def test_lone_surrogates_everywhere_what_is_sent_is_what_is_recorded() -> None:
    model = ScriptedModel(
        [
            reply("half \ud800", calls=[ToolCall("id\ud800", "shout", {"s": "x\ud800"})]),
            reply("done \udfff"),
        ]
    )
    session = Session(MemoryStore(), SessionKey("p", "s"))
    finished = await Agent(model, [shout]).run_turn(session, "hi \udc00")
    assert ascii(finished.text) == ascii("done \ufffd")  # ascii(): see the next test
    sent = model.requests[-1].messages
    recorded = await session.messages()
    assert sent == tuple(recorded[: len(sent)])
    json.dumps([m.text for m in recorded], ensure_ascii=False).encode()  # no surrogate left
    [observation] = recorded[2].parts
    content: str = observation.content  # type: ignore[union-attr]
    assert not [c for c in content if 0xD800 <= ord(c) <= 0xDFFF], ascii(content)


class _Store(MemoryStore):
    """Writes ``allowed`` appends, then fails (or hangs) on every other."""

    def __init__(self, allowed: int, *, hang: bool) -> None:
        super().__init__()
        self.allowed, self.hang = allowed, hang

    async def _write(self, *args: Any, **kwargs: Any) -> None:
        if self.allowed <= 0:
            if self.hang:
                await trio.sleep_forever()
            raise StoreError("the disk is on fire")
        self.allowed -= 1
        await super()._write(*args, **kwargs)


async def test_a_failed_final_record_is_raised_and_leaves_the_prompt_only() -> None:
    session = Session(_Store(1, hang=False), SessionKey("p", "s"))
    agent = Agent(ScriptedModel([reply("final \ud800")]), [shout])
    with pytest.raises(StoreError, match="on fire"):
        await agent.run_turn(session, "hi")
    assert [m.role for m in await session.messages()] == ["user"]


async def test_an_abandoned_final_record_still_gives_recordable_text(autojump_clock: Any) -> None:
    session = Session(_Store(1, hang=True), SessionKey("p", "s"))
    agent = Agent(ScriptedModel([reply("final \ud800")]), [shout])
    with trio.move_on_after(5):
        finished = await agent.run_turn(session, "hi")
    assert [m.role for m in await session.messages()] == ["user"]  # abandoned
    # ascii(): a lone surrogate in a failure's report crashes an xdist worker (execnet
    # cannot send it), which stops the whole run with INTERNALERROR.
    assert ascii(finished.text) == ascii("final \ufffd")


# -- 5. one provider list ----------------------------------------------------------------


def test_each_provider_has_its_adapter_and_tool_specs_agree_on_class_and_instance() -> None:
    from kernel._providers import HTTP_PROVIDERS
    from kernel.cli.tools import provider_tools
    from kernel.models._resolve import ADAPTERS
    from kernel.tools import ToolRegistry

    assert tuple(ADAPTERS) == HTTP_PROVIDERS
    registry = ToolRegistry([shout])
    for name, adapter in ADAPTERS.items():
        specs = adapter.tool_specs(registry.definitions())
        assert specs == provider_tools(registry, name)
        assert adapter.__dict__["tool_specs"].__class__ is staticmethod, name
        assert json.dumps(specs)  # what tak tools --format prints


# -- 6. the last hang guard --------------------------------------------------------------


def test_a_child_forked_under_the_hang_guard_can_finish(request: pytest.FixtureRequest) -> None:
    if hang_limit_s(request.config) <= 0:
        pytest.skip("TAK_TEST_HANG_S=0: no guard armed")
    ready, done = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never back into pytest
        try:
            os.close(ready)
            faulthandler.cancel_dump_traceback_later()  # Py_Finalize does this too
            os.write(done, b"x")
        finally:
            os._exit(0)
    os.close(done)
    try:
        finished, _, _ = select.select([ready], [], [], 3)  # a hang guard
    finally:
        if not finished:
            os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        os.close(ready)
    assert finished, "the forked child hung cancelling the inherited hang guard"
