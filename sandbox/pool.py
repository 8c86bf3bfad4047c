"""The Trio side of plugin workers: start them, call their tools, kill them.

::

    async with open_worker_pool(workspace) as pool:
        worker = await pool.start("my_plugin", policy=Policy(workspace="read"))
        worker.specs                     # the tools its greeting named (ToolSpec)
        value = await worker.invoke("read", {"path": "a.txt"}, session="p/s")

Each ``Worker`` is one confined process per plugin, started in its own
session (so its process group is its own) and spoken to over a socket pair
with length-prefixed JSON frames (``sandbox._protocol``); calls are
multiplexed by id. The process runs the program ``open_worker_pool(entry=...)``
names (the plugin worker, ``plugins._worker``, by default); the plugin host
turns each ``ToolSpec`` into a ``Tool`` whose ``invoke`` is ``Worker.invoke``
(``plugins.remote_tools``), so the executor runs them like any other tool:

- a worker that dies fails its in-flight calls with ``crashed`` and is
  started again for the next call;
- a call that is cancelled (its deadline, a cancelled batch) kills the
  worker's whole process group, and the ``Cancelled`` goes on up;
- the worker's stdout and stderr go to the ``sandbox.worker`` logger, and
  its log frames to ``tak.plugin.<name>``;
- each call frame carries the session key the caller passes to ``invoke``,
  and the plugin's config (``Worker.config``);
- when the pool closes, every worker and everything it started is killed;
- a workspace watched with ``watch_budget`` is held to its disk budget while any
  worker that may write it lives (``sandbox._diskwatch``): a walk that finds it
  over kills those workers, and calls that would write there are refused
  (``denied``) until files are removed.

Workers are forked from one thread that lives as long as the pool:
``PR_SET_PDEATHSIG`` fires when the *thread* that forked a process ends, and
Trio's cached threads (which ``trio.lowlevel.open_process`` forks from) end
after ten idle seconds, which would kill every worker ten seconds after it
started.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, TypeVar

import attrs
import outcome
import trio

from kernel.errors import KernelError, SandboxError

from . import _cgroup, _netbroker, _protocol
from ._diskwatch import INTERVAL_S, DiskWatch
from ._logtext import LogBudget, escape_log_text
from ._policy import Policy
from ._probe import IsolationSupport, probe_isolation
from ._protocol import (
    CallFrame,
    Confinement,
    FatalFrame,
    FromWorker,
    LogFrame,
    ReadyFrame,
    ToolSpec,
    WorkerConfig,
    WorkerFrameError,
)
from ._workspace import Workspace

__all__ = [
    "START_TIMEOUT_S",
    "Spawner",
    "Worker",
    "WorkerCallError",
    "WorkerPool",
    "open_worker_pool",
]

#: The program a worker process runs (``python -I -m ENTRY FD``) unless the pool is
#: told another: the plugin worker, a floor up. Named, never imported, here.
DEFAULT_ENTRY = "plugins._worker"

#: How long a worker may take from start to its greeting (imports included).
START_TIMEOUT_S = 30.0

logger = logging.getLogger("sandbox.pool")
#: How long ``frozen`` waits for a worker it could not stop to be gone.
_FREEZE_KILL_S = 5.0
worker_logger = logging.getLogger("sandbox.worker")

T = TypeVar("T")

_MAX_LOG_LINE = 8192
#: Frames or lines handled between two checkpoints of the Trio loop.
_CHECKPOINT_EVERY = 256
#: How long a dead worker's output may take to drain into the log.
_DRAIN_S = 1.0


#: Signals a worker gets from its own limits (when it stops ignoring them).
_SIGNAL_CAUSES: dict[int, str] = {
    signal.SIGXFSZ: "a file grew past the worker's file size limit (RLIMIT_FSIZE)",
    signal.SIGXCPU: "the worker used up its CPU time limit (RLIMIT_CPU)",
}


def describe_exit(returncode: int) -> str:
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = "unknown"
        why = _SIGNAL_CAUSES.get(-returncode)
        return f"signal {-returncode} ({name})" + (f": {why}" if why else "")
    return f"exit code {returncode}"


_DEFAULT_POLICY = Policy()


class WorkerCallError(SandboxError):
    """A call to a worker failed: ``kind`` as the worker (or the pool) names it.

    The pool's own kinds: ``crashed`` (the worker died, was killed, or could not
    start) and ``bad_arguments`` (arguments too large to send). Whatever the
    worker sends is passed on as it is; the plugin host maps it onto the
    observation's error kinds.
    """

    def __init__(self, kind: str, message: str, *, type: str = "WorkerCallError") -> None:
        super().__init__(message)
        self.kind = kind
        self.message = message
        self.type = type


class Spawner:
    """One long-lived thread that runs blocking jobs (fork/exec, cgroup files) in order."""

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue[
            tuple[Callable[[], Any], trio.lowlevel.TrioToken, Callable[[Any], None]] | None
        ] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="tak-sandbox-spawner", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            fn, token, deliver = job
            result = outcome.capture(fn)
            try:
                token.run_sync_soon(deliver, result)
            except trio.RunFinishedError:
                pass

    async def run(self, fn: Callable[[], T]) -> T:
        """Run ``fn`` in the spawner thread; not cancellable (the jobs are short)."""
        done = trio.Event()
        box: list[outcome.Outcome[T]] = []

        def deliver(result: outcome.Outcome[T]) -> None:
            box.append(result)
            done.set()

        self._jobs.put((fn, trio.lowlevel.current_trio_token(), deliver))
        with trio.CancelScope(shield=True):
            await done.wait()
        return box[0].unwrap()

    def close(self) -> None:
        self._jobs.put(None)


@attrs.define
class _Pending:
    tool: str
    done: trio.Event = attrs.Factory(trio.Event)
    value: Any = None
    failure: WorkerCallError | None = None

    def resolve(self, value: Any = None, failure: WorkerCallError | None = None) -> None:
        if not self.done.is_set():
            self.value, self.failure = value, failure
            self.done.set()


class _Connection:
    """One worker process: started unconfigured (a spare), then bound to a ``Worker``."""

    def __init__(
        self,
        pool: WorkerPool,
        popen: subprocess.Popen[bytes],
        stream: trio.SocketStream,
        out: trio.lowlevel.FdStream,
        err: trio.lowlevel.FdStream,
        *,
        descriptors_refused: bool,
        raw: socket.socket,
    ) -> None:
        self.pool = pool
        self.worker: Worker | None = None
        self.name = "spare"
        self.popen = popen
        self.pid = popen.pid
        self.stream = stream
        # The stdlib socket the stream wraps (the same object, non-blocking): ``_send``
        # tries it first. Closed with the stream.
        self._raw = raw
        self.out = out
        self.err = err
        self.cgroups: list[str] = []
        self.pending: dict[int, _Pending] = {}
        self.next_id = 0
        self.send_lock = trio.StrictFIFOLock()
        self.hello: ReadyFrame | FatalFrame | None = None
        self.hello_event = trio.Event()
        self.kill_reason: str | None = None
        self.death: str | None = None  # set once the process is reaped
        self.finished = trio.Event()
        self.descriptors_refused = descriptors_refused
        self.log_budget = LogBudget()
        self._pidfd = os.pidfd_open(self.pid)

    async def configure(self, worker: Worker, config: WorkerConfig) -> None:
        """Make this process ``worker``'s: send its configuration, wait for its greeting."""
        # The name comes from a file name, which a workspace chooses: log-safe it once.
        self.worker, self.cgroups = worker, config.cgroups
        self.name = escape_log_text(worker.name, limit=200)
        self.pool._writers_moved()  # before it runs plugin code: the watchdog wakes
        try:
            await self.stream.send_all(_protocol.encode(config.to_json()))
            if config.network:  # its names and connections go through the kernel
                approval = _netbroker.Approval.of(self.name, worker.policy.network)
                await _netbroker.start(
                    self.pool._nursery,
                    self.stream,
                    approval,
                    finished=self.finished,
                    kill=self.kill,
                )
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
            pass  # it died; the greeting never comes and the supervisor says why
        with trio.move_on_after(START_TIMEOUT_S):
            await self.hello_event.wait()
            return
        # A plugin whose import blocks must not hang whoever starts it (the kernel
        # at start-up); once killed, the supervisor reports the death and wakes us.
        self.kill(f"no greeting within {START_TIMEOUT_S:g} s (does importing the plugin block?)")
        await self.hello_event.wait()

    @property
    def alive(self) -> bool:
        return self.death is None and self.kill_reason is None

    def kill(self, reason: str) -> None:
        """SIGKILL the worker's process group, saying why (the first reason is kept)."""
        if self.kill_reason is None and self.death is None:
            self.kill_reason = reason
            logger.info("killing %s: %s", self._label(), reason)
        self._killpg()

    def _killpg(self) -> None:
        # Only while the leader is unreaped: its pid then still names the group,
        # so the signal cannot reach an unrelated process that reused the number.
        if self.death is None:
            try:
                os.killpg(self.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    async def call(
        self,
        tool: str,
        arguments: dict[str, Any],
        session: str | None,
        config: dict[str, Any],
    ) -> Any:
        if not self.alive:
            raise WorkerCallError("crashed", self._death_message())
        self.next_id += 1
        call_id = self.next_id
        pending = _Pending(tool)
        self.pending[call_id] = pending
        try:
            try:
                frame = _protocol.encode_frame(
                    CallFrame(
                        id=call_id, tool=tool, arguments=arguments, session=session, config=config
                    )
                )
            except WorkerFrameError as exc:
                raise WorkerCallError("bad_arguments", f"arguments too large: {exc}") from None
            try:
                await self._send(frame)
            except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
                pass  # the worker is dying; the supervisor fails this call
            await pending.done.wait()
        except trio.Cancelled:
            if not pending.done.is_set():
                self.kill(
                    f"a call to {tool} was cancelled before it finished (its deadline or "
                    "its batch), so the worker was killed"
                )
            raise
        finally:
            del self.pending[call_id]
        if pending.failure is not None:
            raise pending.failure
        return pending.value

    async def _send(self, frame: bytes) -> None:
        """Send one whole frame, in order with the other calls' frames.

        When no other frame is being sent, the frame goes straight into the socket
        (a call frame fits its buffer): no trip through Trio's run loop before the
        call waits for its result, which is a checkpoint anyway. What does not fit
        goes on through the stream, the lock held.

        Raises:
            trio.BrokenResourceError, trio.ClosedResourceError, OSError: the
                channel is gone.
        """
        if self.send_lock.locked():
            async with self.send_lock:
                await self.stream.send_all(frame)
            return
        self.send_lock.acquire_nowait()
        try:
            try:
                sent = self._raw.send(frame)
            except BlockingIOError:
                sent = 0
            if sent < len(frame):
                await self.stream.send_all(memoryview(frame)[sent:])
        finally:
            self.send_lock.release()

    def _label(self) -> str:
        return f"worker for plugin {self.name} (pid {self.pid})"

    def _death_message(self) -> str:
        what = self._label()
        if self.kill_reason is not None:
            return f"{what}: {self.kill_reason}"
        return f"{what} exited with {self.death}"

    async def supervise(self) -> None:
        """Pump replies and output until the process exits; then fail what was in flight."""
        try:
            async with trio.open_nursery() as nursery:
                drained = [trio.Event(), trio.Event(), trio.Event()]
                pump = self._pump_output
                nursery.start_soon(self._worker_only, pump, self.out, logging.INFO, drained[0])
                nursery.start_soon(self._worker_only, pump, self.err, logging.WARNING, drained[1])
                nursery.start_soon(self._worker_only, self._read_replies, drained[2])
                await trio.lowlevel.wait_readable(self._pidfd)
                self._killpg()  # whatever it started goes with it
                returncode = self.popen.wait()
                self.death = describe_exit(returncode)
                if returncode == -signal.SIGKILL and self.kill_reason is None and self.cgroups:
                    await self._blame_oom()
                with trio.move_on_after(_DRAIN_S):
                    for event in drained:
                        await event.wait()
                if self.kill_reason is None:
                    # A worker that said why it stops (a plugin that cannot load) exits
                    # as it said; whoever started it reports the reason, so the exit
                    # itself is detail -- however late its frame was read.
                    fatal = isinstance(self.hello, FatalFrame)
                    level = logging.INFO if fatal else logging.WARNING
                    logger.log(level, "%s exited with %s", self._label(), self.death)
                nursery.cancel_scope.cancel()
            summary = self.log_budget.summary(final=True)
            if summary is not None:
                worker_logger.warning("%s %s", self._prefix(), summary)
        finally:
            with trio.CancelScope(shield=True):
                self._fail_pending()
                if not self.hello_event.is_set():
                    self.hello_event.set()
                os.close(self._pidfd)
                await self.stream.aclose()
                await self.out.aclose()
                await self.err.aclose()
                if self.cgroups:
                    # Kill what is left in them (a member outside the process group
                    # too), then remove them.
                    cgroups = self.cgroups
                    try:
                        await trio.to_thread.run_sync(_cgroup.destroy, cgroups)
                    except OSError as exc:
                        logger.warning("could not remove cgroups %s: %s", cgroups, exc)
                self.finished.set()

    async def _blame_oom(self) -> None:
        """Say so when the SIGKILL came from the memory cgroup's OOM killer."""
        limit = await trio.to_thread.run_sync(_cgroup.oom_kill_limit, self.cgroups)
        if limit is not None:
            self.kill_reason = f"killed: out of memory (memory cgroup limit {limit} bytes)"
            logger.warning("%s was %s", self._label(), self.kill_reason)

    def _fail_pending(self) -> None:
        message = self._death_message()
        for pending in self.pending.values():
            pending.resolve(failure=WorkerCallError("crashed", message, type="WorkerCrashed"))

    async def _worker_only(self, fn: Callable[..., Awaitable[None]], *args: Any) -> None:
        """Run one of the supervisor's tasks: whatever it raises costs this worker only.

        A frame or a line nobody foresaw (or a bug here) must not reach the pool's
        nursery, which would take every other worker down with it.
        """
        try:
            await fn(*args)
        except Exception as exc:
            logger.exception("the kernel's side of %s failed", self._label())
            self.kill(f"the kernel could not handle its output ({type(exc).__name__}: {exc})")

    async def _receive(self, max_bytes: int) -> bytes:
        sock = self.stream.socket
        return await _protocol.receive_some(sock, max_bytes, refused=self.descriptors_refused)

    async def _read_replies(self, drained: trio.Event) -> None:
        try:
            await self._read_frames()
        finally:
            drained.set()

    async def _read_frames(self) -> None:
        limits = _protocol.FROM_WORKER
        buffer = bytearray()
        try:
            frames = 0
            while True:
                while len(buffer) < _protocol.HEADER.size:
                    chunk = await self._receive(1 << 16)
                    if not chunk:
                        return
                    buffer += chunk
                length = _protocol.body_length(bytes(buffer[: _protocol.HEADER.size]), limits)
                if length > _protocol.MAX_LOG_FRAME and self.hello is not None and not self.pending:
                    # Past its greeting, only a result may be large, and only while a call
                    # waits for one: refuse before paying for the decode.
                    raise WorkerFrameError(f"a {length}-byte frame while no call is waiting")
                end = _protocol.HEADER.size + length
                while len(buffer) < end:
                    chunk = await self._receive(max(1 << 16, end - len(buffer)))
                    if not chunk:
                        return
                    buffer += chunk
                message = _protocol.decode(bytes(buffer[_protocol.HEADER.size : end]), limits)
                del buffer[:end]
                if message["type"] == "log" and length > _protocol.MAX_LOG_FRAME:
                    raise WorkerFrameError(
                        f"a log frame of {length} bytes (the limit is {_protocol.MAX_LOG_FRAME})"
                    )
                try:
                    self._dispatch(_protocol.structure_frame(message, FromWorker))
                except (TypeError, ValueError, KeyError, AttributeError) as exc:
                    raise WorkerFrameError(repr(exc)) from None
                frames += 1
                if frames % _CHECKPOINT_EVERY == 0:  # a chunk may hold a thousand frames
                    await trio.lowlevel.checkpoint()
        except WorkerFrameError as exc:
            self.kill(f"broke the protocol ({exc})")
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):  # it is gone
            pass
        finally:
            # The channel closed: the worker is ending; make sure of it.
            self._killpg()

    def _dispatch(self, frame: FromWorker) -> None:
        """Act on one frame. The worker runs untrusted code: its record was checked
        field by field (``structure_frame``); here, whether it may come now.

        Raises:
            WorkerFrameError: the frame is not one the protocol allows here.
        """
        if isinstance(frame, ReadyFrame | FatalFrame):
            if self.hello is not None:
                raise WorkerFrameError(f"unexpected {_frame_type(frame)!r} frame")
            self.hello = frame
            self.hello_event.set()
            return
        if isinstance(frame, LogFrame):
            self._plugin_log(frame)
            return
        pending = self.pending.get(frame.id)
        if pending is None or pending.done.is_set():
            # No honest worker sends it: a cancelled call kills its worker, so a result
            # for no call waiting (or a second one) is forged, to make the kernel decode
            # frames nobody asked for.
            raise WorkerFrameError(f"a result for no call waiting for one (id {frame.id})")
        if frame.error is None:
            pending.resolve(value=frame.value)
            return
        error = frame.error
        pending.resolve(failure=WorkerCallError(error.kind, error.message, type=error.type))

    async def _pump_output(
        self, stream: trio.lowlevel.FdStream, level: int, drained: trio.Event
    ) -> None:
        pending = b""
        try:
            # Read on while lines are dropped: a worker never blocks on a full pipe.
            while chunk := await stream.receive_some(1 << 16):
                pending += chunk
                *lines, pending = pending.split(b"\n")
                if len(pending) > _MAX_LOG_LINE:
                    lines.append(pending)
                    pending = b""
                for i, line in enumerate(lines):
                    if not self._admit_line(len(line)):
                        self.log_budget.drop(len(lines) - i - 1)  # they came with it
                        break
                    self._log(level, self._prefix(), line)
                    if i % _CHECKPOINT_EVERY == _CHECKPOINT_EVERY - 1:
                        await trio.lowlevel.checkpoint()
            if pending and self._admit_line(len(pending)):
                self._log(level, self._prefix(), pending)
        except (trio.ClosedResourceError, trio.BrokenResourceError):
            pass
        finally:
            drained.set()

    def _prefix(self) -> str:
        # Read per line: a spare process is renamed when it is given its plugin.
        return f"[{self.name} pid {self.pid}]"

    def _admit_line(self, size: int) -> bool:
        """Whether the worker's budget lets one more line of ``size`` bytes into the log."""
        summary = self.log_budget.summary()
        if summary is not None:
            worker_logger.warning("%s %s", self._prefix(), summary)
        return self.log_budget.admit(min(size, _MAX_LOG_LINE))

    def _plugin_log(self, frame: LogFrame) -> None:
        # The logger is named by the kernel (the worker's name), never by the frame.
        level = min(max(frame.level, logging.DEBUG), logging.CRITICAL)
        if self._admit_line(len(frame.message)):
            logging.getLogger(f"tak.plugin.{self.name}").log(
                level, "%s", escape_log_text(frame.message)
            )

    @staticmethod
    def _log(level: int, prefix: str, line: bytes) -> None:
        text = line[:_MAX_LOG_LINE].decode("utf-8", errors="replace").rstrip("\r")
        worker_logger.log(level, "%s %s", prefix, escape_log_text(text))


def _unconfined_note(reasons: list[str]) -> str:
    return "[ran unconfined: " + "; ".join(reasons) + "]"


def _frame_type(frame: FromWorker) -> str:
    return type(frame).__name__.removesuffix("Frame").lower()


class Worker:
    """One plugin's worker process (restarted when it dies); its tools run in it.

    Attributes:
        specs: the tools its first greeting named; empty until it has started.
        confinement: what the worker last reported it applied to itself.
        plugin_info: what the worker's greeting said about its plugin (the plugin
            host reads it: name, version, description, permissions, in_process),
            or ``None``; ``None`` too until the worker has started.
        config: sent with every call; ``kernel.context().config`` in the worker.
        path: directories the worker appends to ``sys.path`` before it imports.
        workspace: the directory it is confined to: the pool's, unless it was
            made for another (``WorkerPool.worker(workspace=...)``).
    """

    def __init__(
        self,
        pool: WorkerPool,
        plugin: str,
        policy: Policy,
        name: str,
        *,
        path: tuple[str, ...] = (),
        config: dict[str, Any] | None = None,
        workspace: Path | None = None,
    ) -> None:
        self.pool = pool
        self.workspace = workspace if workspace is not None else pool.workspace
        self.plugin = plugin
        self.policy = policy
        self.name = name
        self.path = path
        self.config: dict[str, Any] = dict(config or {})
        self.plugin_info: dict[str, Any] | None = None
        self.specs: list[ToolSpec] = []
        self.confinement = Confinement()
        self.unconfined: list[str] = []
        self.starts = 0
        self._conn: _Connection | None = None
        self._start_lock = trio.Lock()
        self._closed = False

    @property
    def pid(self) -> int | None:
        """The current process id, or ``None`` while no process runs."""
        conn = self._conn
        return conn.pid if conn is not None and conn.alive else None

    async def invoke(
        self, tool: str, arguments: dict[str, Any], *, session: str | None = None
    ) -> Any:
        """Run ``tool`` in the worker (starting it first if it is not running).

        ``session`` is the caller's session key, which the tool sees in its context.

        Raises:
            WorkerCallError: the tool failed (its kind), or the worker crashed, could
                not be restarted, or was killed (``crashed``).
        """
        if self.pool._watches:
            await self.pool._admit(self)
        conn = self._conn
        if conn is None or not conn.alive or self._closed or self._start_lock.locked():
            # Not running, or a start under way: wait for it in turn (``_running``).
            # A warm call skips the lock, which would cost it a trip through the
            # run loop for nothing.
            try:
                conn = await self._running()
            except SandboxError as exc:
                raise WorkerCallError("crashed", f"worker for plugin {self.name}: {exc}") from None
        try:
            value = await conn.call(tool, arguments, session, self.config)
        except WorkerCallError as exc:
            if not self.unconfined:
                raise
            note = _unconfined_note(self.unconfined)
            raise WorkerCallError(exc.kind, f"{note} {exc.message}", type=exc.type) from None
        if self.unconfined:
            text = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)
            return f"{_unconfined_note(self.unconfined)}\n{text}"
        return value

    async def _running(self) -> _Connection:
        async with self._start_lock:
            if self._closed:
                raise SandboxError("the worker was closed")
            if self._conn is not None and self._conn.alive:
                return self._conn
            if self._conn is not None:
                with trio.CancelScope(shield=True):
                    await self._conn.finished.wait()
            self._conn = await self._start()
            return self._conn

    async def _start(self) -> _Connection:
        pool = self.pool
        # A cgroup set for every worker: memory for its whole process tree; pids
        # (cheap: one more mkdir) for all, though only subprocess plugins can fork.
        limits = self.policy.limits
        cgroups = await trio.to_thread.run_sync(
            functools.partial(
                _cgroup.create,
                pool._cgroup_parents,
                memory_bytes=limits.memory_bytes,
                max_pids=limits.processes,
            )
        )
        try:
            conn = await pool._take_process(self.workspace)
        except BaseException:
            with trio.CancelScope(shield=True):
                await trio.to_thread.run_sync(_cgroup.destroy, cgroups)
            raise
        self.starts += 1
        try:
            await conn.configure(self, pool._worker_config(self, cgroups))
            self._accept(conn)
            logger.info(
                "%s started, confinement: %s",
                conn._label(),
                escape_log_text(str(self.confinement)),  # the worker's own report
            )
        except BaseException:
            conn.kill("its start was abandoned")
            raise
        return conn

    def _accept(self, conn: _Connection) -> None:
        hello = conn.hello
        if hello is None:
            raise SandboxError(f"{conn._death_message()} before it was ready")
        if isinstance(hello, FatalFrame):
            conn.kill("refused to start")
            raise SandboxError(f"worker for plugin {self.name}: {hello.message}")
        unconfined = list(hello.confinement.unconfined)
        if unconfined and self.policy.isolate and not self.pool.allow_unsandboxed:
            conn.kill("it is not confined")
            raise SandboxError(
                f"worker for plugin {self.name} is not confined: {'; '.join(unconfined)}"
            )
        self.confinement = hello.confinement
        self.unconfined = unconfined
        self.plugin_info = hello.plugin
        if not self.specs:
            self.specs = list(hello.tools)

    async def aclose(self) -> None:
        """Kill the worker and its process group and wait until it is reaped."""
        self._closed = True
        with trio.CancelScope(shield=True):
            async with self._start_lock:
                conn = self._conn
            if conn is not None:
                conn.kill("the worker pool closed")
                await conn.finished.wait()


class WorkerPool:
    """Workers for plugins, all confined to one workspace. Made by ``open_worker_pool``."""

    def __init__(
        self,
        nursery: trio.Nursery,
        workspace: Path,
        *,
        allow_unsandboxed: bool,
        isolation: IsolationSupport,
        python: str,
        spare: bool,
        entry: str = DEFAULT_ENTRY,
    ) -> None:
        self._nursery = nursery
        self.workspace = workspace
        self.allow_unsandboxed = allow_unsandboxed
        self.isolation = isolation
        self.python = python
        self.entry = entry
        self.workers: list[Worker] = []
        self.spare = spare
        self._spare: _Connection | None = None
        self._spare_coming = False
        self._processes: set[_Connection] = set()
        self._closing = False
        self._spawner = Spawner()
        self._cgroup_parents = isolation.cgroup_parents()
        self._watches: dict[Path, DiskWatch] = {}
        self._writers_event = trio.Event()
        # One frozen block at a time: a second one's thaw must not end the first's.
        self._freeze_lock = trio.Lock()

    async def start(
        self,
        plugin: str,
        *,
        policy: Policy = _DEFAULT_POLICY,
        name: str | None = None,
        path: tuple[str, ...] = (),
        config: dict[str, Any] | None = None,
    ) -> Worker:
        """Start a worker for ``plugin`` (a module name, or a path to a ``.py`` file or a
        package directory, optionally with ``:attribute``) and return it once its
        tools are known.

        Raises:
            SandboxError: the plugin needs isolation this machine cannot give and
                unsandboxed plugins are not allowed; or the worker refused to start
                (the message says why), or the plugin failed to load.
        """
        worker = self.worker(plugin, policy=policy, name=name, path=path, config=config)
        await worker._running()
        return worker

    def worker(
        self,
        plugin: str,
        *,
        policy: Policy = _DEFAULT_POLICY,
        name: str | None = None,
        path: tuple[str, ...] = (),
        config: dict[str, Any] | None = None,
        workspace: Path | None = None,
    ) -> Worker:
        """A worker for ``plugin`` that starts on its first call (see ``start``).

        Its ``specs`` stay empty until it has started: callers that know the tools
        already (a plugin host) call ``worker.invoke`` with their names. With
        ``workspace`` (a directory prepared as the pool's is, with ``.tak/tmp``)
        it is confined there instead of the pool's workspace: one job's worker
        (a batch task's), closed with ``close_worker`` when the job ends.

        Raises:
            SandboxError: the plugin needs isolation this machine cannot give and
                unsandboxed plugins are not allowed.
        """
        target = plugin.rpartition(":")[0] if ":" in plugin else plugin
        label = name or os.path.splitext(os.path.basename(target.rstrip("/")))[0]
        missing = self.isolation.missing(policy)
        if missing and policy.isolate and not self.allow_unsandboxed:
            raise SandboxError(
                f"plugin {label} needs isolation, which is unavailable here: "
                + "; ".join(missing)
                + ". It was not started; set allow_unsandboxed to run it unconfined."
            )
        worker = Worker(self, plugin, policy, label, path=path, config=config, workspace=workspace)
        self.workers.append(worker)
        return worker

    async def close_worker(self, worker: Worker) -> None:
        """Kill ``worker`` (see ``Worker.aclose``) and forget it; finishes even when cancelled."""
        await worker.aclose()
        with contextlib.suppress(ValueError):
            self.workers.remove(worker)

    def closing(self) -> bool:
        return self._closing

    async def _spawn(self) -> _Connection:
        """A new worker process, waiting for its configuration (whose ``workspace``
        becomes its cwd once it is confined)."""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        refused = _protocol.refuse_descriptors(ours)  # see sandbox._protocol
        out_r, out_w = os.pipe2(os.O_CLOEXEC)
        err_r, err_w = os.pipe2(os.O_CLOEXEC)
        command = [self.python, "-I", "-m", self.entry, str(theirs.fileno())]
        # The worker replaces its environment with the one in its configuration
        # before it runs plugin code; it starts with nothing of the kernel's either.
        env = {"LANG": "C.UTF-8", "MALLOC_ARENA_MAX": "2", "PATH": "/usr/bin:/bin"}

        def spawn() -> subprocess.Popen[bytes]:
            return subprocess.Popen(
                command,
                stdin=subprocess.DEVNULL,
                stdout=out_w,
                stderr=err_w,
                pass_fds=(theirs.fileno(),),
                # Not the workspace: the interpreter imports from relative entries of
                # sys.path (an editable install's path hook name) against its cwd at
                # start, before it is confined, and a tool can write one there
                # (``sitecustomize.py`` in it would run unconfined). The worker enters
                # its workspace once confined (sandbox.worker.start).
                cwd="/",
                env=env,
                start_new_session=True,
            )

        try:
            popen = await self._spawner.run(spawn)
        except BaseException:
            for fd in (out_r, err_r):
                os.close(fd)
            ours.close()
            raise
        finally:
            theirs.close()
            os.close(out_w)
            os.close(err_w)
        conn = _Connection(
            self,
            popen,
            trio.SocketStream(trio.socket.from_stdlib_socket(ours)),
            trio.lowlevel.FdStream(out_r),
            trio.lowlevel.FdStream(err_r),
            descriptors_refused=refused,
            raw=ours,
        )
        self._processes.add(conn)
        self._nursery.start_soon(self._supervise, conn)
        return conn

    async def _supervise(self, conn: _Connection) -> None:
        try:
            await conn.supervise()
        finally:
            self._processes.discard(conn)
            self._writers_moved()

    async def _take_process(self, workspace: Path) -> _Connection:
        """The spare process if one is ready (and start the next), else a new one.

        The spare is the pool's workspace's: a worker of another workspace gets a
        process of its own.
        """
        if workspace != self.workspace:
            return await self._spawn()
        spare, self._spare = self._spare, None
        if self.spare:
            self._nursery.start_soon(self._make_spare)
        if spare is not None and spare.alive:
            return spare
        return await self._spawn()

    def prime(self) -> None:
        """Start the spare process now, if the pool keeps one and it is not there yet.

        The spare comes with the first worker start anyway; whoever knows that workers
        are about to be needed (a turn that begins: its calls come once the model
        answers) primes the pool so that even the first start skips the interpreter's
        start-up. A pool nobody primes and no worker uses never starts a process.
        """
        # Every turn primes: no task when the spare is there or coming already.
        if self.spare and not (self.closing() or self._spare_coming or self._spare is not None):
            self._nursery.start_soon(self._make_spare)

    async def _make_spare(self) -> None:
        if self._spare_coming or self._spare is not None or self.closing():
            return
        self._spare_coming = True
        try:
            conn = await self._spawn()
        except OSError as exc:
            logger.warning("could not start a spare worker process: %s", exc)
            return
        finally:
            self._spare_coming = False
        if self.closing():  # it closed while this process started
            conn.kill("not needed")
        else:
            self._spare = conn

    def _environment(self, worker: Worker) -> dict[str, str]:
        """Built from scratch: nothing from the kernel's environment reaches a plugin."""
        policy = worker.policy
        ws = str(worker.workspace)
        # Without subprocess nothing can be executed; a PATH without compilers also
        # keeps ctypes.util.find_library (which trio calls) from trying to run one.
        path = "/usr/local/bin:/usr/bin:/bin" if policy.subprocess else f"{ws}/.tak/bin"
        env = {
            "PATH": path,
            "HOME": ws,
            "TMPDIR": f"{ws}/.tak/tmp",
            "LANG": "C.UTF-8",
            "LC_ALL": "C.UTF-8",
            "MALLOC_ARENA_MAX": "2",
        }
        return env

    def _worker_config(self, worker: Worker, cgroups: list[str]) -> WorkerConfig:
        policy = worker.policy
        limits = attrs.asdict(policy.limits)
        return WorkerConfig(
            plugin=worker.plugin,
            workspace=str(worker.workspace),
            workspace_access=policy.workspace,
            tcp_ports=list(policy.tcp_ports),
            network=bool(policy.network),
            subprocess=policy.subprocess,
            limits=limits,
            landlock=self.isolation.landlock_abi >= 1,
            seccomp=self.isolation.seccomp,
            require=policy.isolate and not self.allow_unsandboxed,
            cgroups=cgroups,
            kernel_pid=os.getpid(),
            env=self._environment(worker),
            # The plugin's own directories, when it is not installed where Python looks.
            path=list(worker.path),
            extra_read=list(worker.path),
        )

    @asynccontextmanager
    async def frozen(self, *, wait_s: float = _cgroup.FREEZE_S) -> AsyncIterator[bool]:
        """Every worker process stopped (its cgroup set frozen) for the block.

        What runs inside sees the workspace as no worker changes it: the disk budget's
        walk of the tree, which a background program moving a directory back and forth
        could otherwise make miss what that directory holds. Calls in flight simply
        wait. A worker that does not stop within ``wait_s`` (tasks in uninterruptible
        sleep: a long ``write``) is killed, and its whole cgroup set with it, before
        the block runs: the block
        never runs beside a worker that was meant to be stopped. Yields ``False`` when
        this machine has no freezer for some worker (no writable cgroup): then nothing
        could be stopped, and the block runs anyway.

        Raises:
            SandboxError: a worker could neither be stopped nor killed in time; the
                block did not run.
        """
        async with self._freeze_lock:
            async with self._frozen(wait_s) as complete:
                yield complete

    @asynccontextmanager
    async def _frozen(self, wait_s: float) -> AsyncIterator[bool]:
        frozen: list[list[str]] = []
        complete = True
        try:
            for conn in list(self._processes):
                if not conn.cgroups:
                    complete = complete and conn.worker is None  # an unconfigured spare
                    continue
                try:
                    stopped = await trio.to_thread.run_sync(_cgroup.freeze, conn.cgroups, wait_s)
                except OSError as exc:
                    conn.kill(f"could not be stopped to measure the workspace ({exc})")
                    with trio.move_on_after(_FREEZE_KILL_S):
                        await conn.finished.wait()  # its cgroups destroyed: nobody left
                    if not conn.finished.is_set():
                        raise SandboxError(
                            f"{conn._label()} could neither be stopped nor killed in time"
                        ) from exc
                    continue
                if stopped:
                    frozen.append(conn.cgroups)
                else:
                    complete = False
            yield complete
        finally:
            with trio.CancelScope(shield=True):
                for paths in frozen:
                    await trio.to_thread.run_sync(_cgroup.thaw, paths)

    # -- the disk watchdog (sandbox._diskwatch) --------------------------------

    @asynccontextmanager
    async def watch_budget(
        self, workspace: Workspace, *, interval_s: float = INTERVAL_S
    ) -> AsyncIterator[DiskWatch]:
        """Hold ``workspace`` to its budget while workers that may write it live.

        The watchdog is a task of this pool's nursery, stopped when the block ends
        (before the pool closes). ``workspace`` is the budget's ``Workspace`` (its
        ``max_bytes``, ``max_files`` and kept figures); the workers it watches are
        those confined to its path with ``workspace="write"``.

        Raises:
            SandboxError: that directory is already watched.
        """
        if workspace.path in self._watches:
            raise SandboxError(f"the disk budget of {workspace.path} is already watched")
        watch = DiskWatch(workspace, self, interval_s=interval_s)
        self._watches[workspace.path] = watch
        try:
            await self._nursery.start(watch.run)
            yield watch
        finally:
            del self._watches[workspace.path]
            await watch.stop()

    def writers(self, workspace: Path) -> int:
        """Processes of workers that may write ``workspace``, alive or not yet reaped."""
        return sum(
            1
            for conn in self._processes
            if conn.worker is not None
            and conn.worker.workspace == workspace
            and conn.worker.policy.workspace == "write"
        )

    async def writers_changed(self) -> None:
        """Return once a process was given a worker, or one ended."""
        await self._writers_event.wait()

    def _writers_moved(self) -> None:
        self._writers_event.set()
        self._writers_event = trio.Event()

    async def kill_writers(self, workspace: Path, reason: str) -> None:
        """Kill every worker that may write ``workspace`` and all in its cgroups.

        Meant for inside ``frozen()``: each member of a frozen set is sent SIGKILL once
        (none can fork meanwhile) and dies as it thaws, without running again.
        """
        for conn in list(self._processes):
            worker = conn.worker
            if worker is None or worker.workspace != workspace:
                continue
            if worker.policy.workspace != "write":
                continue
            if conn.cgroups:
                await trio.to_thread.run_sync(_cgroup.signal_members, conn.cgroups)
            conn.kill(reason)

    async def _admit(self, worker: Worker) -> None:
        """Raises: WorkerCallError: ``denied``, its workspace is over its budget."""
        watch = self._watches.get(worker.workspace)
        if watch is None or worker.policy.workspace != "write":
            return
        try:
            over = await watch.admit()
        except KernelError as exc:
            over = f"its usage could not be measured: {exc}"
        if over is not None:
            raise WorkerCallError(
                "denied",
                f"workspace over its budget: {over}; no plugin that writes it runs until "
                "files are removed",
                type="DiskBudgetExceeded",
            )

    async def unlinked_open_bytes(self, device: int) -> int:
        """Disk on ``device`` held by files the workers keep open after unlinking them.

        A walk of the workspace cannot see such a file (``_cgroup.unlinked_open_bytes``);
        the disk budget adds this to what the walk found. Read it inside ``frozen()``.
        """
        return await self._unlinked_open_bytes(device, None)

    async def unlinked_open_bytes_in(self, workspace: Path, device: int) -> int:
        """``unlinked_open_bytes``, of the workers confined to ``workspace`` only.

        What the workers of another workspace on the same file system hold is theirs:
        charged to this one, it would kill this workspace's writers and refuse its calls
        for files they cannot even see.
        """
        return await self._unlinked_open_bytes(device, workspace)

    async def _unlinked_open_bytes(self, device: int, workspace: Path | None) -> int:
        total = 0
        for conn in list(self._processes):
            if not conn.cgroups:
                continue
            if workspace is not None and (
                conn.worker is None or conn.worker.workspace != workspace
            ):
                continue
            total += await trio.to_thread.run_sync(
                _cgroup.unlinked_open_bytes, conn.cgroups, device
            )
        return total

    async def aclose(self) -> None:
        """Kill every worker and everything it started; finishes even when cancelled."""
        self._closing = True
        with trio.CancelScope(shield=True):
            for worker in list(self.workers):
                await worker.aclose()
            for conn in list(self._processes):  # spares, and starts that failed
                conn.kill("the worker pool closed")
                await conn.finished.wait()
            self._spawner.close()


def _sweep_stale_cgroups(support: IsolationSupport) -> None:
    """Kill what workers of a dead kernel left behind (a SIGKILLed kernel cleans nothing)."""
    try:
        removed = _cgroup.sweep(support.cgroup_parents())
    except OSError as exc:
        logger.warning("could not remove a stale worker cgroup: %s", exc)
        return
    for path in removed:
        logger.info("removed the stale worker cgroup %s and killed what was left in it", path)


def _prepare_workspace(workspace: str | os.PathLike[str]) -> Path:
    with Workspace(workspace) as ws:
        ws.mkdir(".tak/tmp", parents=True, exist_ok=True)
        return ws.path


@asynccontextmanager
async def open_worker_pool(
    workspace: str | os.PathLike[str],
    *,
    allow_unsandboxed: bool = False,
    isolation: IsolationSupport | None = None,
    python: str = sys.executable,
    spare: bool = True,
    entry: str = DEFAULT_ENTRY,
) -> AsyncIterator[WorkerPool]:
    """A pool of plugin workers confined to ``workspace``.

    Each worker process runs ``python -I -m <entry> FD``: a program that confines
    itself and serves frames with ``sandbox.worker`` (``plugins._worker`` by default).

    ``isolation`` replaces the probe of this machine (tests use it to play a
    machine without Landlock). With ``spare`` (the default) one worker process
    is kept started and unconfigured from the first worker start (or
    ``prime()``) on, so that starting or restarting a worker skips the
    interpreter's start-up; it has run no plugin code and is confined when it
    is given a plugin. A pool that starts no worker starts no process (a
    command that only lists tools or sessions pays no interpreter). With ``allow_unsandboxed``, plugins that need
    isolation run even where it is missing, and every observation from them
    starts with ``[ran unconfined: <why>]``.

    Raises:
        SandboxError: the workspace cannot be opened.
    """
    path = await trio.to_thread.run_sync(_prepare_workspace, workspace)
    support = isolation if isolation is not None else await trio.to_thread.run_sync(probe_isolation)
    await trio.to_thread.run_sync(_sweep_stale_cgroups, support)
    try:
        async with trio.open_nursery() as nursery:
            pool = WorkerPool(
                nursery,
                path,
                allow_unsandboxed=allow_unsandboxed,
                isolation=support,
                python=python,
                spare=spare,
                entry=entry,
            )
            try:
                yield pool
            finally:
                await pool.aclose()
    except BaseExceptionGroup as group:
        # The pool's own tasks do not raise; a lone error is the caller's, and the
        # caller should see it as raised, not wrapped in the pool's nursery group.
        if len(group.exceptions) == 1:
            raise group.exceptions[0] from None
        raise
