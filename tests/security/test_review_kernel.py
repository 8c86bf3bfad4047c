"""A second engineer's attempts against the kernel side of issue 10 (review pass).

Each test is one attempt. Those marked ``xfail(strict=True, reason="HOLE: ...")``
got through when they were written: the lead fixes the hole and removes the
mark. The others were refused and stay as part of the adversarial suite.

Attempts whose failure would leave a runaway thread (a call into the kernel's
``fs`` tools that keeps burning CPU after its deadline) run in a child process
that is killed at the bound, so the suite stays fast and leaves nothing behind.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import threading
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import trio
from kit import Arena
from test_trust import home_of, plant, trust

from kernel.errors import SandboxError
from kernel.executor import run_tool_calls
from kernel.home import TakHome
from kernel.messages import ToolCall
from kernel.plugin import Permissions, use_context
from kernel.tools import ToolFailure
from plugins import open_plugin_host
from plugins._host import PluginHost, _check_overlap
from plugins._trust import TRUST_FILE, TrustedPlugin, TrustStore
from sandbox import Workspace
from tests.server.wsclient import connect, open_test_kernel, running_server

ROOT = Path(__file__).resolve().parents[2]

#: A hang guard, not a measurement: an ``fs`` call that has not ended by itself after
#: this long never will (grep and glob stop on their own clock after ``GREP_SECONDS``,
#: edit_file counts lines once). The inputs below would take hours without the fixes.
HANG_GUARD_S = 120

_FS_CALL = """
import json, logging, sys
sys.path.insert(0, sys.argv[1])
from kernel.plugin import ToolContext, use_context
from plugins import fs
from sandbox import Workspace
workspace, name, arguments = sys.argv[2], sys.argv[3], json.loads(sys.argv[4])
[tool] = [t for t in fs.plugin.tools if t.name == name]
with Workspace(workspace, protected=(".tak",)) as ws:
    with use_context(ToolContext(ws, "p/s", logging.getLogger("review"), {})):
        try:
            print(json.dumps({"returned": str(tool.fn(**arguments))[-2000:]}))
        except Exception as exc:
            print(json.dumps({"raised": f"{type(exc).__name__}: {exc}"[:2000]}))
"""


def fs_call(workspace: Path, tool: str, **arguments: object) -> dict[str, str]:
    """What one ``fs`` call returned (``{"returned": text}``) or raised (``{"raised":
    "Type: message"}``), run by itself to its end in a child process.

    In a child process, killed at the hang guard: an abandoned thread in this process
    would keep burning CPU for the rest of the suite.
    """
    try:
        done = subprocess.run(
            [
                sys.executable,
                "-c",
                _FS_CALL,
                str(ROOT),
                str(workspace),
                tool,
                json.dumps(arguments),
            ],
            capture_output=True,
            text=True,
            timeout=HANG_GUARD_S,
            check=True,
        )
    except subprocess.TimeoutExpired:
        pytest.fail(f"{tool} was still running after {HANG_GUARD_S} s: it never stops itself")
    outcome: dict[str, str] = json.loads(done.stdout.strip().splitlines()[-1])
    return outcome


def assert_stopped_by_its_clock(outcome: dict[str, str]) -> None:
    """The call ended by itself: the search stopped on its own clock and said so."""
    from plugins import fs

    returned = outcome.get("returned", "")
    assert f"[stopped after {fs.GREP_SECONDS:g} s: " in returned, outcome


# -- class 6: fs tools whose cost outlives the deadline ---------------------------------


def test_edit_file_with_an_old_text_occurring_everywhere_is_bounded(arena: Arena) -> None:
    # 400 000 occurrences took ~20 s before the fix, growing with their square: these
    # 4 Mi would take over half an hour, past the hang guard on any machine.
    many = 4 * 1024 * 1024
    (arena.workspace / "many.txt").write_text("a" * many)
    outcome = fs_call(arena.workspace, "edit_file", path="many.txt", old="a", new="b")
    assert outcome["raised"].startswith(f"ValueError: old text occurs {many} times in many.txt")
    assert (arena.workspace / "many.txt").read_text() == "a" * many
    arena.assert_nothing_seen()


def _ab_lines(path: Path, size: int) -> None:
    """Random ``a``/``b`` lines of 1000 characters: the DFA of ``[ab]*a[ab]{999}c`` explodes."""
    table = bytes(97 + (i & 1) for i in range(256))
    raw = bytearray(os.urandom(size).translate(table))
    raw[1000::1001] = b"\n" * len(raw[1000::1001])
    path.write_bytes(bytes(raw))


def test_grep_with_a_dfa_exploding_pattern_is_bounded(arena: Arena) -> None:
    _ab_lines(arena.workspace / "ab.txt", 8 * 1024 * 1024 - 1)
    outcome = fs_call(arena.workspace, "grep", pattern=r"[ab]*a[ab]{999}c", path=".")
    assert_stopped_by_its_clock(outcome)
    arena.assert_nothing_seen()


def test_grep_with_the_largest_program_it_runs_is_bounded(arena: Arena) -> None:
    """Refused: 33 of those patterns in one alternation (32 575 instructions, just under
    MAX_GREP_PROGRAM) cost ~40 us/byte; the window shrinks to 1 KiB and the clock stops it."""
    from plugins import fs

    pattern = "|".join(f"[ab]*a[ab]{{{999 - i}}}c" for i in range(33))
    assert fs.MAX_GREP_PROGRAM / 2 < fs._compile_grep(pattern).programsize <= fs.MAX_GREP_PROGRAM
    _ab_lines(arena.workspace / "ab.txt", 8 * 1024 * 1024 - 1)
    outcome = fs_call(arena.workspace, "grep", pattern=pattern, path=".")
    assert_stopped_by_its_clock(outcome)
    arena.assert_nothing_seen()


def test_edit_file_with_a_few_occurrences_answers_quickly(arena: Arena) -> None:
    """Not the hole above: the error for several occurrences on a big file names them."""
    (arena.workspace / "few.txt").write_text(("x" * 1000 + "\n") * 8000 + "needle\n" * 3)
    outcome = fs_call(arena.workspace, "edit_file", path="few.txt", old="needle", new="n")
    assert outcome == {
        "raised": "ValueError: old text occurs 3 times in few.txt, starting at lines 8001, "
        "8002, 8003; include more surrounding text so that it matches exactly once"
    }
    arena.assert_nothing_seen()


# -- class 6: the disk budget, measured after a worker's call ---------------------------


# A directory moved back and forth while the tree is walked: a program doing it can only
# be a worker's (or a program a worker left running), and the host walks with every
# worker frozen: tests/security/test_overlap.py::
# test_a_directory_a_worker_keeps_moving_cannot_hide_from_the_budget.


class _NoWorkers:
    """A pool with no worker running: freezing them all is nothing to do."""

    @contextlib.asynccontextmanager
    async def frozen(self) -> AsyncIterator[bool]:
        yield True

    async def unlinked_open_bytes(self, device: int) -> int:
        return 0


async def test_budget_check_fails_closed_when_the_workspace_cannot_be_measured(
    arena: Arena, monkeypatch: pytest.MonkeyPatch
) -> None:
    (arena.workspace / "big").write_bytes(os.urandom(1 << 20))

    def keeps_changing(self: Workspace) -> int:
        raise SandboxError("the workspace kept changing while its disk usage was measured")

    with Workspace(arena.workspace, max_bytes=1000) as ws:
        host = object.__new__(PluginHost)
        host.workspace = ws
        host.pool = _NoWorkers()  # type: ignore[assignment]
        monkeypatch.setattr(Workspace, "refresh_usage", keeps_changing)
        hook = host._budget_check(Permissions(workspace="write"))
        assert hook is not None
        with pytest.raises(ToolFailure):
            # What runs around a worker's call: the check itself, or a preparation
            # before the call that returns the check.
            after = await hook()
            if callable(after):
                await after()
    arena.assert_nothing_seen()


async def test_what_a_background_process_writes_between_calls_is_counted(arena: Arena) -> None:
    with Workspace(arena.workspace, max_bytes=1 << 20) as ws:
        host = object.__new__(PluginHost)
        host.workspace = ws
        host.pool = _NoWorkers()  # type: ignore[assignment]
        await trio.to_thread.run_sync(ws.usage)  # measured once, at the first write
        hook = host._budget_check(Permissions(workspace="write"))
        assert hook is not None
        # Between two calls, a background process fills 4 MiB (past the 1 MiB budget).
        (arena.workspace / "filler").write_bytes(os.urandom(4 << 20))
        os.sync()
        with pytest.raises(ToolFailure):
            after = await hook()  # the next call starts ...
            if callable(after):
                await after()  # ... writes nothing, and ends
    arena.assert_nothing_seen()


# -- class 3: what a workspace may not contain ---------------------------------------------


def test_workspace_holding_a_missing_sys_path_directory_is_refused(
    arena: Arena, monkeypatch: pytest.MonkeyPatch
) -> None:
    planned = arena.workspace / "lib"  # does not exist yet: a tool can make it
    monkeypatch.setattr(sys, "path", [*sys.path, str(planned)])
    with pytest.raises(SandboxError, match=r"sys\.path"):
        _check_overlap(arena.workspace, TakHome(arena.root / "home"))
    arena.assert_nothing_seen()


def test_workspace_holding_a_zip_on_sys_path_is_refused(
    arena: Arena, monkeypatch: pytest.MonkeyPatch
) -> None:
    import zipfile

    archive = arena.workspace / "deps.zip"
    with zipfile.ZipFile(archive, "w") as z:
        z.writestr("depmod.py", "VALUE = 1\n")
    monkeypatch.setattr(sys, "path", [*sys.path, str(archive)])
    with pytest.raises(SandboxError, match=r"sys\.path"):
        _check_overlap(arena.workspace, TakHome(arena.root / "home"))
    arena.assert_nothing_seen()


def test_workspace_holding_an_existing_sys_path_directory_is_refused(
    arena: Arena, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Refused: the same, with the directory already there."""
    (arena.workspace / "lib").mkdir()
    monkeypatch.setattr(sys, "path", [*sys.path, str(arena.workspace / "lib") + "/"])
    with pytest.raises(SandboxError, match=r"sys\.path"):
        _check_overlap(str(arena.workspace) + "/.", TakHome(arena.root / "home"))
    arena.assert_nothing_seen()


# -- class 2: the trust file -----------------------------------------------------------------


def _approval(key: str) -> TrustedPlugin:
    return TrustedPlugin(key, key.rpartition(":")[2], "0" * 64, Permissions())


def test_a_revocation_is_not_undone_by_a_concurrent_approval(
    arena: Arena, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = arena.root / "home" / "config" / TRUST_FILE
    TrustStore(path).approve(_approval("entry_point:a"))
    loaded = threading.Event()
    go_on = threading.Event()
    original = TrustStore.load

    def slow_load(self: TrustStore) -> dict[str, TrustedPlugin]:
        found = original(self)
        if threading.current_thread().name == "trust-b":
            loaded.set()
            go_on.wait(5)
        return found

    monkeypatch.setattr(TrustStore, "load", slow_load)
    approve = threading.Thread(
        target=TrustStore(path).approve, args=(_approval("entry_point:b"),), name="trust-b"
    )
    approve.start()
    assert loaded.wait(5)
    revoke = threading.Thread(target=TrustStore(path).revoke, args=("entry_point:a",))
    revoke.start()
    revoke.join(0.5)  # with a lock, it waits for the approval; without, it is done
    go_on.set()
    approve.join(5)
    revoke.join(5)
    final = original(TrustStore(path))
    assert "entry_point:b" in final
    assert "entry_point:a" not in final, "the user's untrust was silently undone"
    arena.assert_nothing_seen()


_SIBLING_MAIN = '''
from kernel import Plugin
try:
    import _sibling
    STATE = "sibling ran: " + _sibling.VALUE
except ImportError:
    STATE = "no sibling"
plugin = Plugin("sib", version="1.0", description="Imports a module beside it.")

@plugin.tool
def state() -> str:
    """Whether the sibling module was imported."""
    return STATE
'''


@pytest.mark.usefixtures("confined")
async def test_approved_plugin_cannot_import_an_unhashed_sibling(arena: Arena) -> None:
    """Refused: the hash covers one file, and the worker imports a copy of it from a
    directory of the kernel's, so ``import _sibling`` finds neither the sibling in
    ``.tak/plugins`` nor one a tool wrote at the workspace root."""
    home = home_of(arena)
    plant(arena, "_sibling", 'VALUE = "from .tak/plugins"\n')
    plant(arena, "sib", _SIBLING_MAIN)
    await trust(arena, home, "sib")
    (arena.workspace / "_sibling.py").write_text('VALUE = "written by a tool"\n')
    async with open_plugin_host(arena.workspace, home=home) as host:
        assert "sib" in [p.name for p in host.plugins], host.errors
        with use_context(host.context()):
            [obs] = await run_tool_calls([ToolCall("1", "state", {})], host.tools)
    assert obs.content == "no sibling", obs.content
    arena.assert_nothing_seen([obs.content])


# -- class 7: a connection flood from another process ----------------------------------------

_FLOOD = """
import socket, sys, threading, time
port, seconds = int(sys.argv[1]), float(sys.argv[2])
stop = time.monotonic() + seconds
def run():
    held = []
    while time.monotonic() < stop:
        try:
            held.append(socket.create_connection(("127.0.0.1", port)))
        except OSError:
            time.sleep(0.001)
            continue
        if len(held) > 100:
            held.pop(0).close()
    for s in held:
        s.close()
threads = [threading.Thread(target=run) for _ in range(4)]
for t in threads:
    t.start()
for t in threads:
    t.join()
"""


@pytest.fixture
async def served(tmp_path: Path) -> AsyncIterator[str]:
    async with open_test_kernel(tmp_path / "home") as k:
        async with running_server(k) as url:
            yield url


async def test_a_continuous_connection_flood_does_not_lock_out_the_client(
    served: str, arena: Arena
) -> None:
    """Refused: four threads of another process open connections as fast as they can
    for as long as the client needs (the server drops the oldest unauthenticated one
    each time); the real client still gets in, every time. The flood outlasts the
    hang guard, so a client locked out fails; a slow machine only makes it slower."""
    port = int(served.split(":")[2].split("/")[0])
    flood = await trio.lowlevel.open_process([sys.executable, "-c", _FLOOD, str(port), "3600"])
    try:
        await trio.sleep(0.5)
        for n in range(5):
            with trio.fail_after(120):  # a hang guard, not a measurement
                async with connect(served) as client:
                    _, reply = await client.request({"type": "tools", "id": f"t{n}"})
            assert reply["status"] == "ok"
    finally:
        with trio.CancelScope(shield=True):
            flood.kill()
            await flood.wait()
    arena.assert_nothing_seen()


# -- class 8: arguments that only become unrecordable once converted ------------------------


@pytest.mark.parametrize(
    "arguments",
    [
        '{"number": 1' + "0" * 400 + "}",  # an exact integer JSON allows, too big for a float
        '{"number": 1e999}',  # hidden inside arguments given as a JSON string
        {"number": 2 * 10**308},
        '{"number": 1.7976931348623159e308}',  # rounds up to infinity
    ],
    ids=["int-400-digits", "string-1e999", "int-past-float", "rounds-to-inf"],
)
async def test_a_number_that_overflows_a_float_parameter_does_not_run(
    tmp_path: Path, arena: Arena, arguments: object
) -> None:
    from test_frames import marker_tools

    markers = tmp_path / "markers"
    markers.mkdir()
    async with open_test_kernel(tmp_path / "home", tools=marker_tools(markers)) as k:
        session = k.session("victim")
        [obs] = await k.call_tools(session, [ToolCall("k", "mark", arguments)])  # type: ignore[arg-type]
    assert obs.is_error and "bad_arguments" in obs.content, obs.content
    assert list(markers.iterdir()) == []
    arena.assert_nothing_seen([obs.content])
