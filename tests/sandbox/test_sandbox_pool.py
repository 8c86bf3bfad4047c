"""The worker pool: tools in confined processes, plugged into ``run_tool_calls`` unchanged."""

# One test starts a kernel process directly.
# ruff: noqa: ASYNC220

from __future__ import annotations

import glob
import importlib.util
import json
import logging
import os
import signal
import socket
import struct
import subprocess
import sys
from pathlib import Path

import attrs
import pytest
import trio
from sandbox_kit import PLUGINS, Canary, group_members, is_gone, open_sandbox, wait_until_gone

from kernel.errors import SandboxError
from kernel.executor import CallLimits, run_tool_calls
from kernel.messages import ToolCall
from kernel.tools import Tool
from plugins import remote_tools
from sandbox import Policy, _protocol, open_worker_pool, probe_isolation
from sandbox._logtext import LogBudget
from sandbox.pool import _Connection

pytestmark = pytest.mark.skipif(
    probe_isolation().level != "full", reason="needs Landlock ABI 6+ and seccomp"
)


def in_process_tools(plugin: str) -> list[Tool]:
    spec = importlib.util.spec_from_file_location(f"inproc_{plugin}", PLUGINS / f"{plugin}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return [v for v in vars(module).values() if isinstance(v, Tool)]


async def test_tools_behave_as_they_do_in_process(workspace: Path) -> None:
    calls = [
        ToolCall("a", "echo", {"text": "héllo"}),
        ToolCall("b", "add", {"a": 2}),
        ToolCall("c", "nap", {"seconds": 0.01}),
        ToolCall("d", "fail", {"message": "boom"}),
        ToolCall("e", "refuse", {"what": "that"}),
        ToolCall("f", "add", {"a": "two"}),
        ToolCall("g", "unserializable", {}),
        ToolCall("h", "nope", {}),
    ]
    local = await run_tool_calls(calls, in_process_tools("basic"))
    async with open_sandbox(workspace, "basic") as sb:
        tools = remote_tools(sb.worker)
        remote = await run_tool_calls(calls, tools)
    assert [t.name for t in tools] == [t.name for t in in_process_tools("basic")]
    local_by_name = {t.name: t for t in in_process_tools("basic")}
    for t in tools:
        assert t.fn is None and t.invoke is not None
        assert t.parameters == local_by_name[t.name].parameters
        assert t.description == local_by_name[t.name].description

    def comparable(o: object) -> object:
        return attrs.evolve(o, duration_s=0.0)  # type: ignore[misc]

    assert [comparable(o) for o in remote] == [comparable(o) for o in local]
    assert remote[2].content == "rested"
    assert remote[4].error is not None and remote[4].error.kind == "denied"


async def test_calls_run_concurrently_in_one_worker(workspace: Path) -> None:
    async with open_sandbox(workspace, "basic") as sb:
        # Four calls that each answer only when all four are in the worker at once.
        calls = [ToolCall(str(i), "meet", {"parties": 4}) for i in range(4)]
        observations = await run_tool_calls(calls, remote_tools(sb.worker))
    assert [o.content for o in observations] == ["met"] * 4


async def test_a_crash_fails_in_flight_calls_and_the_worker_restarts(workspace: Path) -> None:
    async with open_sandbox(workspace, "basic") as sb:
        first_pid = sb.worker.pid
        assert first_pid is not None
        crash, sibling = await run_tool_calls(
            [ToolCall("c", "crash", {"code": 3}), ToolCall("s", "block", {"seconds": 30})],
            remote_tools(sb.worker),
        )
        for o in (crash, sibling):
            assert o.error is not None and o.error.kind == "crashed"
            assert f"pid {first_pid}) exited with exit code 3" in o.content
        assert is_gone(first_pid)
        new_pid = int(await sb.text("pid"))
        assert new_pid != first_pid
        assert sb.worker.starts == 2


async def test_a_deadline_kills_the_process_group(workspace: Path) -> None:
    async with open_sandbox(workspace, "basic") as sb:
        pid = sb.worker.pid
        assert pid is not None
        slow, sibling = await run_tool_calls(
            [
                ToolCall("slow", "block", {"seconds": 60}),
                ToolCall("sibling", "nap", {"seconds": 60}),
            ],
            remote_tools(sb.worker),
            limits=CallLimits(timeout=0.5),
        )
        assert slow.error is not None and slow.error.kind == "timeout"
        assert sibling.error is not None
        assert sibling.error.kind in ("timeout", "crashed")
        await wait_until_gone(pid)
        assert int(await sb.text("pid")) != pid


async def test_a_deadline_in_one_call_fails_the_others_as_crashed(workspace: Path) -> None:
    async with open_sandbox(workspace, "basic") as sb:
        slow = ToolCall("slow", "block", {"seconds": 60})
        other = ToolCall("other", "block", {"seconds": 2})
        limits = CallLimits(timeout=30)

        async def short(call: ToolCall) -> None:
            with trio.move_on_after(0.3):
                await run_tool_calls([call], remote_tools(sb.worker), limits=limits)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(short, slow)
            [observation] = await run_tool_calls([other], remote_tools(sb.worker), limits=limits)
        assert observation.error is not None and observation.error.kind == "crashed"
        assert "a call to block was cancelled" in observation.content


async def test_cancelling_the_batch_kills_the_worker(workspace: Path) -> None:
    async with open_sandbox(workspace, "basic") as sb:
        pid = sb.worker.pid
        assert pid is not None
        with trio.move_on_after(0.3):
            await run_tool_calls([ToolCall("x", "nap", {"seconds": 60})], remote_tools(sb.worker))
        await wait_until_gone(pid)


async def test_output_goes_to_the_log(workspace: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="sandbox.worker")
    async with open_sandbox(workspace, "basic") as sb:
        assert await sb.text("shout", text="hello") == "hello"
        pid = sb.worker.pid
    records = {(r.levelno, r.getMessage()) for r in caplog.records if r.name == "sandbox.worker"}
    assert (logging.INFO, f"[basic pid {pid}] out: hello") in records
    assert (logging.WARNING, f"[basic pid {pid}] err: hello") in records


async def test_pool_exit_leaves_no_process_even_after_a_child_is_killed(
    workspace: Path,
) -> None:
    policy = Policy(subprocess=True)
    async with open_sandbox(workspace, policy=policy) as sb:
        pgid = sb.worker.pid
        assert pgid is not None
        pids = json.loads(await sb.text("spawn_grandchild"))
        os.kill(pids["child"], signal.SIGKILL)
        await wait_until_gone_pid(pids["child"])
        # The grandchild is an orphan now, but still in the worker's process group.
        assert not is_gone(pids["grandchild"])
        assert os.getpgid(pids["grandchild"]) == pgid
    for pid in (pgid, pids["grandchild"]):
        await wait_until_gone_pid(pid)
    assert group_members(pgid) == []


async def wait_until_gone_pid(pid: int) -> None:
    with trio.move_on_after(5):
        while not is_gone(pid):  # noqa: ASYNC110 (nothing to wait on but /proc)
            await trio.sleep(0.02)
    assert is_gone(pid)


async def test_a_killed_kernel_takes_its_workers_along(workspace: Path) -> None:
    kernel = subprocess.Popen(
        [
            sys.executable,
            str(Path(__file__).parent / "kernel_process.py"),
            str(workspace),
            str(PLUGINS / "basic.py"),
        ],
        stdout=subprocess.PIPE,
    )
    try:
        assert kernel.stdout is not None
        with trio.fail_after(20):
            line = await trio.to_thread.run_sync(kernel.stdout.readline, abandon_on_cancel=True)
        worker_pid, spare_pid = map(int, line.split())
        assert not is_gone(worker_pid)
        assert not is_gone(spare_pid)
        kernel.kill()
        # The worker by its parent-death signal, the spare when its channel closes.
        await wait_until_gone_pid(worker_pid)
        await wait_until_gone_pid(spare_pid)
    finally:
        kernel.kill()
        kernel.wait()


@pytest.mark.stress
async def test_workers_outlive_idle_threads(workspace: Path) -> None:
    # Trio's cached threads exit after 10 idle seconds; a worker forked from one
    # would get its parent-death signal then.
    async with open_sandbox(workspace, "basic") as sb:
        pid = sb.worker.pid
        await trio.sleep(11)
        assert int(await sb.text("pid")) == pid


async def test_a_read_only_workspace(workspace: Path) -> None:
    async with open_sandbox(workspace, "basic", policy=Policy(workspace="read")) as sb:
        assert await sb.text("write_here", name="x.txt", text="x") == "denied: Permission denied"
    assert not (workspace / "x.txt").exists()
    async with open_sandbox(workspace, "basic") as sb:
        assert await sb.text("write_here", name="x.txt", text="x") == "written"
    assert (workspace / "x.txt").read_text() == "x"


async def test_tools_listed_in_TOOLS(workspace: Path) -> None:
    async with open_sandbox(workspace, "listed") as sb:
        assert [t.name for t in remote_tools(sb.worker)] == ["served"]


@pytest.mark.parametrize(
    ("plugin", "message"),
    [
        ("broken", "this plugin cannot be imported"),
        ("empty", "defines no tools"),
        ("missing", "No such file"),
    ],
)
async def test_a_plugin_that_cannot_load_is_refused(
    workspace: Path, plugin: str, message: str
) -> None:
    async with open_worker_pool(workspace) as pool:
        with pytest.raises(SandboxError, match=message):
            await pool.start(str(PLUGINS / f"{plugin}.py"))


async def test_landlock_unavailable_is_refused(workspace: Path) -> None:
    no_landlock = attrs.evolve(probe_isolation(), landlock_abi=0)
    async with open_worker_pool(workspace, isolation=no_landlock) as pool:
        with pytest.raises(SandboxError) as info:
            await pool.start(str(PLUGINS / "basic.py"))
        assert pool.workers == []
    assert "needs isolation" in str(info.value)
    assert "Landlock is not available" in str(info.value)
    assert "allow_unsandboxed" in str(info.value)


async def test_seccomp_unavailable_is_refused(workspace: Path) -> None:
    no_seccomp = attrs.evolve(probe_isolation(), seccomp=False)
    async with open_worker_pool(workspace, isolation=no_seccomp) as pool:
        with pytest.raises(SandboxError, match="seccomp filters are not available"):
            await pool.start(str(PLUGINS / "basic.py"))


async def test_allow_unsandboxed_marks_every_observation(workspace: Path, canary: Canary) -> None:
    no_landlock = attrs.evolve(probe_isolation(), landlock_abi=0)
    async with open_sandbox(workspace, isolation=no_landlock, allow_unsandboxed=True) as sb:
        assert sb.worker.unconfined == ["Landlock is not available"]
        assert sb.worker.confinement.seccomp  # what could be applied still was
        ok = await sb.call("read_file", path=str(canary.path))
        failed = await sb.call("fail_here")
    assert ok.content.startswith("[ran unconfined: Landlock is not available]\n")
    # The note is honest: without Landlock the canary is readable.
    assert canary.secret in ok.content
    assert failed.is_error and "[ran unconfined: Landlock is not available]" in failed.content


@pytest.mark.parametrize(
    ("body", "announced"),
    [
        ('{"type": "result", "id": [1], "ok": true}', -1),  # unhashable id
        ('{"type": "result", "id": 1, "ok": false, "error": "x"}', -1),
        ('{"type": "ready", "tools": []}', -1),  # a second greeting
        ('{"type": "log", "level": "20", "message": "x"}', -1),  # a field of the wrong type
        ("not json", -1),
        ("", 2**31),  # a frame far over the limit
    ],
)
async def test_a_worker_that_breaks_the_protocol_is_killed(
    workspace: Path, body: str, announced: int
) -> None:
    async with open_sandbox(workspace) as sb:
        pid = sb.worker.pid
        observation = await sb.call("forge_frame", body=body, announced=announced)
        assert observation.error is not None and observation.error.kind == "crashed"
        assert "broke the protocol" in observation.content
        if '"20"' in body:
            assert "malformed log frame: $.level: " in observation.content
        assert pid is not None
        await wait_until_gone_pid(pid)
        assert "pid" in await sb.text("identity")  # the kernel is fine; a new worker serves


async def test_without_a_spare_process(workspace: Path) -> None:
    async with open_sandbox(workspace, "basic", spare=False) as sb:
        assert await sb.text("echo", text="x") == "x"
        assert sb.pool._spare is None


async def test_a_pool_that_starts_no_worker_starts_no_process(workspace: Path) -> None:
    async with open_worker_pool(workspace) as pool:
        await trio.sleep(0.5)  # a spare, were one started at open, would be coming by now
        assert pool._spare is None and not pool._spare_coming and not pool._processes


async def test_the_spare_process_is_used_and_does_not_outlive_the_pool(workspace: Path) -> None:
    async with open_worker_pool(workspace) as pool:
        pool.prime()  # as a turn that begins does
        with trio.fail_after(10):
            while pool._spare is None:  # noqa: ASYNC110 (the spare starts in the background)
                await trio.sleep(0.01)
        spare_pid = pool._spare.pid
        worker = await pool.start(str(PLUGINS / "basic.py"))
        assert worker.pid == spare_pid
        with trio.fail_after(10):
            while pool._spare is None:  # noqa: ASYNC110
                await trio.sleep(0.01)
        next_spare = pool._spare.pid
        assert next_spare != spare_pid
    await wait_until_gone_pid(spare_pid)
    await wait_until_gone_pid(next_spare)


async def test_a_plugin_whose_import_hangs_is_refused_not_waited_for(
    workspace: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import sandbox.pool

    monkeypatch.setattr(sandbox.pool, "START_TIMEOUT_S", 1.0)
    plugin_dir = tmp_path / "stuck_plugin"
    plugin_dir.mkdir()
    (plugin_dir / "stuck.py").write_text("import time\ntime.sleep(3600)\n")
    async with open_worker_pool(workspace) as pool:
        with trio.fail_after(20), pytest.raises(SandboxError, match="no greeting within 1 s"):
            await pool.start(str(plugin_dir / "stuck.py"))


# --- what a worker may send the kernel (sandbox._protocol.FROM_WORKER) ------------------

_BIG_RESULTS = '''
from kernel.plugin import context
from kernel.tools import tool


@tool
def big(kind: str) -> object:
    """Results past the limits of a frame to the kernel."""
    if kind == "bytes":
        return "x" * (9 * 1024 * 1024)
    if kind == "values":
        return [0] * 300_000
    if kind == "int":
        return 10**1500
    if kind == "digits_in_text":
        return "1" * 5000
    if kind == "error":
        raise ValueError("e" * (9 * 1024 * 1024))
    if kind == "log":
        context().logger.warning("\\x01\\U0001f600" * 20_000)
        return "logged"
    return [0] * 1000
'''


@pytest.mark.parametrize("kind", ["bytes", "values", "int"])
async def test_a_result_too_large_or_complex_is_output_too_large(
    workspace: Path, tmp_path: Path, kind: str
) -> None:
    plugin = tmp_path / "big_results.py"
    plugin.write_text(_BIG_RESULTS)
    async with open_worker_pool(workspace) as pool:
        worker = await pool.start(str(plugin))
        pid = worker.pid
        [too_big, fine] = await run_tool_calls(
            [ToolCall("a", "big", {"kind": kind}), ToolCall("b", "big", {"kind": "fine"})],
            remote_tools(worker),
        )
        assert too_big.error is not None and too_big.error.kind == "output_too_large", too_big
        assert "limit" in too_big.content
        assert not fine.is_error
        assert worker.pid == pid  # the worker was not killed: it said so itself


@pytest.mark.parametrize("kind", ["digits_in_text", "error", "log"])
async def test_honest_frames_near_the_limits_pass(
    workspace: Path, tmp_path: Path, kind: str
) -> None:
    plugin = tmp_path / "big_results.py"
    plugin.write_text(_BIG_RESULTS)
    async with open_worker_pool(workspace) as pool:
        worker = await pool.start(str(plugin))
        pid = worker.pid
        [observation] = await run_tool_calls(
            [ToolCall("a", "big", {"kind": kind})], remote_tools(worker)
        )
        assert observation.error is None or observation.error.kind == "exception", observation
        assert worker.pid == pid


def test_decode_turns_every_decoding_error_into_a_frame_error() -> None:
    limits = _protocol.FROM_WORKER
    bodies = [
        b'{"type":"x","v":' + b"1" * 5000 + b"}",  # Python's own digit limit: ValueError
        b'{"type":"x","v":' + b"1" * 1001 + b"}",
        b'{"type":"x","v":-' + b"1" * 1001 + b"}",
        b'{"type":"x","v":"\xff"}',
        b'{"type":"x","v":' + b"[" * 100_000 + b"]" * 100_000 + b"}",
        b'{"type":"x","v":[' + b"0," * 200_000 + b"0]}",
        b'{"type":"x","v":"' + b"x" * (8 * 1024 * 1024) + b'"}',
        b"[]",
        b"",
    ]
    for body in bodies:
        with pytest.raises(_protocol.WorkerFrameError):
            _protocol.decode(body, limits)
    assert _protocol.decode(b'{"type":"x","v":' + b"1" * 1000 + b"}", limits)["v"] > 0
    assert _protocol.decode(b'{"type":"x","v":"' + b"1" * 5000 + b'"}', limits)
    with pytest.raises(_protocol.WorkerFrameError):
        _protocol.encode({"type": "x", "v": [0] * 200_000}, limits)
    with pytest.raises(_protocol.WorkerFrameError):
        _protocol.body_length(struct.pack("!I", limits.max_bytes + 1), limits)
    frame = _protocol.encode_log(20, "\x01\U0001f600" * 20_000)
    assert len(frame) <= _protocol.HEADER.size + _protocol.MAX_LOG_FRAME


async def test_descriptors_are_refused_at_the_sender() -> None:
    ours, theirs = socket.socketpair()
    with ours, theirs:
        if not _protocol.refuse_descriptors(ours):
            pytest.skip("Linux before 6.16: no SO_PASSRIGHTS")
        with pytest.raises(PermissionError):
            socket.send_fds(theirs, [b"x"], [0])


async def test_without_so_passrights_descriptors_are_closed_off_the_trio_thread() -> None:
    # The fallback for Linux before 6.16: received with room for all, closed in a thread.
    ours, theirs = socket.socketpair()
    r, w = os.pipe()
    with theirs:
        sock = trio.socket.from_stdlib_socket(ours)
        theirs.send(b"ab")
        assert await _protocol.receive_some(sock, 2, refused=False) == b"ab"
        socket.send_fds(theirs, [b"x"], [w] * 200)
        os.close(w)
        with pytest.raises(_protocol.WorkerFrameError, match="200 file descriptor"):
            await _protocol.receive_some(sock, 1, refused=False)
        with trio.fail_after(5):
            while True:  # every copy of the write end closed: the read end sees EOF
                await trio.lowlevel.wait_readable(r)
                if os.read(r, 1) == b"":
                    break
        sock.close()
    os.close(r)


def test_log_budget_drops_past_the_burst_and_refills() -> None:
    now = [0.0]
    budget = LogBudget(
        burst_lines=10, lines_per_s=5, burst_bytes=100, bytes_per_s=50, clock=lambda: now[0]
    )
    assert [budget.admit(1) for _ in range(12)].count(True) == 10
    assert "2 lines dropped" in str(budget.summary())
    assert budget.admit(1) is False
    assert budget.summary() is None  # once per interval
    now[0] += 1.0
    assert [budget.admit(1) for _ in range(6)].count(True) == 5
    assert budget.admit(0) is False
    now[0] += 100
    assert budget.admit(101) is False  # the byte budget
    assert budget.admit(100) is True
    assert "4 lines dropped" in str(budget.summary())  # since the first summary
    assert budget.summary(final=True) is None  # nothing dropped since


async def test_an_unforeseen_failure_of_the_reader_costs_the_worker_only(
    workspace: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    dispatch = _Connection._dispatch

    def failing(self: _Connection, frame: _protocol.FromWorker) -> None:
        if isinstance(frame, _protocol.LogFrame) and frame.message == "trigger":
            raise RuntimeError("a bug in the kernel")
        dispatch(self, frame)

    monkeypatch.setattr(_Connection, "_dispatch", failing)
    async with open_sandbox(workspace) as sb:
        observation = await sb.call(
            "forge_frame", body='{"type": "log", "level": 20, "message": "trigger"}'
        )
        assert observation.error is not None and observation.error.kind == "crashed"
        assert "could not handle its output (RuntimeError" in observation.content
        assert "pid" in await sb.text("identity")  # the pool lives; a new worker serves


async def test_frozen_stops_every_worker_for_the_block(workspace: Path) -> None:
    if probe_isolation().cgroup_parents().version == 0:
        pytest.skip("no writable cgroup here")
    async with open_sandbox(workspace, "basic") as sb:
        assert (await sb.call("echo", text="warm")).content == "warm"
        answered = trio.Event()

        async def echo() -> None:
            await sb.call("echo", text="later")
            answered.set()

        async with trio.open_nursery() as nursery:
            async with sb.pool.frozen() as complete:
                assert complete
                nursery.start_soon(echo)
                with trio.move_on_after(0.3):
                    await answered.wait()
                assert not answered.is_set()  # the worker is stopped: no answer
            with trio.fail_after(5):
                await answered.wait()  # thawed: the call completes


async def test_a_warm_worker_runs_calls_on_the_threads_it_keeps(workspace: Path) -> None:
    # A thread per call cost a clone and a wait for it to be scheduled: the call
    # threads stay, one running a call while another reads the next frame.
    async with open_sandbox(workspace, "basic") as sb:
        idents = {await sb.text("thread") for _ in range(30)}
        assert len(idents) <= 2
        # A burst takes more threads (test_calls_run_concurrently_in_one_worker: in
        # parallel); between calls, few are kept.
        calls = [ToolCall(str(i), "block", {"seconds": 0.1}) for i in range(5)]
        observations = await run_tool_calls(calls, remote_tools(sb.worker))
        assert all(o.content == "done" for o in observations)
        await sb.text("pid")
        pid = sb.worker.pid
        assert pid is not None
        # The main thread, and the call threads kept between calls.
        assert len(os.listdir(f"/proc/{pid}/task")) <= 3


async def test_a_plugin_that_cannot_load_says_so_once_however_late_its_word_is_read(
    workspace: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A worker whose plugin fails to import sends why and exits. On a loaded machine
    the kernel may see the exit before it reads the frame: the reason reaches whoever
    started it, and no warning about the exit is logged beside it (the CLI would
    print it as a second line)."""
    real = _protocol.receive_some

    async def late(sock: trio.socket.SocketType, max_bytes: int, *, refused: bool) -> bytes:
        await trio.sleep(0.3)  # the process has exited by now
        return await real(sock, max_bytes, refused=refused)

    monkeypatch.setattr(_protocol, "receive_some", late)
    pool_log = logging.getLogger("sandbox.pool")
    monkeypatch.setattr(pool_log, "disabled", False)  # whatever configured logging before
    monkeypatch.setattr(pool_log, "propagate", True)
    caplog.set_level(logging.INFO, logger="sandbox.pool")
    async with open_worker_pool(workspace) as pool:
        with pytest.raises(SandboxError, match="this plugin cannot be imported"):
            await pool.start(str(PLUGINS / "broken.py"))
    # (The exit is logged as detail, or not at all when the pool killed it first.)
    warned = [r.getMessage() for r in caplog.records if r.name == "sandbox.pool"]
    assert not [
        r for r in caplog.records if r.name == "sandbox.pool" and r.levelno >= logging.WARNING
    ], warned


def _children() -> set[str]:
    found: set[str] = set()
    for path in glob.glob(f"/proc/{os.getpid()}/task/*/children"):
        try:
            with open(path) as f:
                found |= set(f.read().split())
        except FileNotFoundError:
            continue  # a thread (Trio's cached ones) ended since the listing
    return found


@pytest.mark.parametrize("delay", [None, 0.0, 0.001, 0.02])
async def test_a_spare_primed_as_the_pool_closes_does_not_outlive_it(
    tmp_path: Path, delay: float | None
) -> None:
    before = _children()
    async with open_worker_pool(tmp_path) as pool:
        pool.prime()
        if delay is not None:
            await trio.sleep(delay)  # the spare's start is under way, or done
    assert _children() - before == set()
    pool.prime()  # after close: nothing starts, nothing raises
    await trio.sleep(0.05)
    assert _children() - before == set() and not pool._spare_coming
