"""The worker's side of the mechanism: confine this process, then serve call frames.

The child program (``plugins._worker``, started by the pool as ``python -I -m
plugins._worker FD``) is what knows plugins; this module knows only processes,
confinement and frames. The program calls, in order:

1. ``start(fd)``: keep only stdio and the channel, read the configuration
   (``WorkerConfig``, the first frame), take the broker channel when the worker
   has network, confine itself (``sandbox._confine``, the steps in order), and
   install the broker (``sandbox._netbroker``) so that nothing after it resolves
   names or connects by itself;
2. whatever it loads (only now: the code runs confined), then sends a
   ``ReadyFrame`` or a ``FatalFrame``;
3. ``serve(channel, handle)``: each ``CallFrame`` runs ``handle`` in the call thread
   that read it (another one reads on), and the result frames go back in completion
   order, tagged with the call's id;
4. ``exit_group()`` once the kernel closed the channel: every program its calls
   started ends with it.

``Attempts`` and ``denial_message`` say which permission a refused operation
needed (Python audit events: sockets, programs, file writes); the sandbox itself
(seccomp, Landlock) is what refuses.
"""

from __future__ import annotations

import errno
import logging
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from kernel.errors import SandboxError

from . import _protocol
from ._confine import IPC_FD, close_stray_fds, confine
from ._protocol import (
    CallError,
    CallFrame,
    Confinement,
    FatalFrame,
    ResultFrame,
    WorkerConfig,
    WorkerFrameError,
)

__all__ = [
    "Attempts",
    "Channel",
    "LogFrames",
    "denial_message",
    "error_result",
    "exit_group",
    "file_size_note",
    "permission_error",
    "serve",
    "start",
]

#: The longest error message a result carries (an exception's text can be anything).
MAX_ERROR_TEXT = 64 * 1024


class Channel:
    """Blocking frames over the IPC socket; sends from many threads are serialized."""

    def __init__(self, sock: socket.socket) -> None:
        self.socket = sock
        self._send_lock = threading.Lock()

    def receive(self) -> dict[str, Any]:
        """The next message, decoded (not yet a record).

        Raises:
            EOFError: the kernel closed the channel.
            WorkerFrameError: the frame broke the protocol.
        """
        length = _protocol.body_length(self._exactly(_protocol.HEADER.size))
        return _protocol.decode(self._exactly(length))

    def _exactly(self, n: int) -> bytes:
        buf = bytearray()
        while len(buf) < n:
            chunk = self.socket.recv(min(n - len(buf), 1 << 20))
            if not chunk:
                raise EOFError
            buf += chunk
        return bytes(buf)

    def send_frame(self, frame: bytes) -> None:
        with self._send_lock:
            self.socket.sendall(frame)

    def send(self, record: Any) -> None:
        """Send a frame record the kernel accepts (``FROM_WORKER``).

        Raises:
            WorkerFrameError: too large or too complex for the kernel.
            OSError: the channel is gone.
        """
        self.send_frame(_protocol.encode_frame(record, _protocol.FROM_WORKER))


def start(fd: int, program: str) -> tuple[Channel, WorkerConfig, Confinement]:
    """Steps 1 to 8 of ``sandbox._confine``: the channel, the configuration, confinement.

    ``program`` names the caller in what it prints when it cannot start.

    Raises:
        SystemExit: 2 without a usable configuration (printed to stderr), 1 when
            confinement failed (told to the kernel in a ``FatalFrame``).
    """
    close_stray_fds(fd)
    ipc = socket.socket(fileno=IPC_FD)
    channel = Channel(ipc)
    broker = None
    try:
        config = WorkerConfig.from_json(channel.receive())
        if config.network:
            # Imported only here: the broker's records and addresses cost a worker
            # without network several milliseconds of start.
            from . import _netbroker

            # The kernel sends the broker channel right after the configuration.
            broker = _netbroker.receive_channel(ipc)
    except (EOFError, OSError, WorkerFrameError) as exc:
        print(f"{program}: no usable configuration: {exc!r}", file=sys.stderr)
        raise SystemExit(2) from None
    try:
        report = confine(config)
        # Started in "/" (sandbox.pool: nothing a tool writes is on the path while
        # the interpreter starts); relative paths of tools are inside the workspace.
        os.chdir(config.workspace)
    except (SandboxError, OSError) as exc:
        channel.send(FatalFrame(message=str(exc)))
        raise SystemExit(1) from None
    if broker is not None:
        from . import _netbroker

        _netbroker.install(broker)  # before any plugin code: it never resolves or connects
    return channel, config, report


def error_result(call_id: int, kind: str, type_: str, message: str) -> ResultFrame:
    """A failed result, its message cut to ``MAX_ERROR_TEXT`` characters."""
    if len(message) > MAX_ERROR_TEXT:
        message = f"{message[:MAX_ERROR_TEXT]} [... cut at {MAX_ERROR_TEXT} characters]"
    return ResultFrame(
        id=call_id, ok=False, error=CallError(kind=kind, type=type_[:200], message=message)
    )


def _result_bytes(call: CallFrame, result: ResultFrame) -> bytes:
    """The frame of ``result``, or of the error that replaces one the kernel would refuse."""
    try:
        return _protocol.encode_frame(result, _protocol.FROM_WORKER)
    except WorkerFrameError as exc:
        replaced = error_result(
            call.id, "output_too_large", "OutputTooLarge", f"{call.tool}: {exc}"
        )
    except (TypeError, ValueError, RecursionError) as exc:
        what = type(result.value).__name__
        replaced = error_result(
            call.id,
            "exception",
            type(exc).__name__,
            f"{call.tool} returned a {what} that cannot be serialized to JSON: {exc}",
        )
    return _protocol.encode_frame(replaced, _protocol.FROM_WORKER)


#: How often, and how long apart, a call thread is tried when the worker is out of tasks.
_THREAD_TRIES = 20
_THREAD_RETRY_S = 0.005
#: Threads kept between calls (beyond the main thread): one reading the next frame,
#: one ready to take over from it. Fewer would start a thread per call again; every
#: one kept is a task the plugin's process limit counts.
_IDLE_THREADS = 2


class _CallThreads:
    """Leader/follower call threads: the one that reads a call runs it.

    Starting a thread per call cost a clone and, with the machine busy, a wait for
    the new thread to be scheduled before the call even began. Here the thread that
    reads a frame hands the reading over (a lock another idle thread waits on) and
    runs the call itself: the call runs in the thread its frame woke, and calls
    still run in parallel (a new thread is started only when none is left to read).
    A thread that fails outside ``handle`` (which must not raise) ends the worker,
    as the channel's end does: its calls fail as crashed rather than never answer.
    """

    def __init__(self, channel: Channel, handle: Callable[[CallFrame], ResultFrame]) -> None:
        self._channel = channel
        self._handle = handle
        self._reading = threading.Lock()  # held by the thread that reads the next frame
        self._count_lock = threading.Lock()
        self._free = 0  # threads not running a call: the reader and those waiting to read
        self.closed = threading.Event()

    def start(self) -> RuntimeError | None:
        """Start the first call thread; the error when there is no task for it."""
        return self._add_thread()

    def _add_thread(self) -> RuntimeError | None:
        """One more free thread; the error when the worker is out of tasks or memory.

        At its process limit the worker waits a few milliseconds for a thread that is
        ending to be gone before it says it is exhausted.
        """
        with self._count_lock:
            self._free += 1
        for attempt in range(_THREAD_TRIES):
            try:
                threading.Thread(target=self._run, name="call", daemon=True).start()
                return None
            except RuntimeError as exc:
                if attempt == _THREAD_TRIES - 1:
                    with self._count_lock:
                        self._free -= 1
                    return exc
                time.sleep(_THREAD_RETRY_S)
        return None

    def _run(self) -> None:
        ended = True  # the channel closed, or this thread failed: the worker ends
        try:
            while True:
                with self._reading:
                    call = self._next_call()
                if call is None:
                    return
                frame = _result_bytes(call, self._handle(call))
                # Counted free before the result goes: the kernel's next call may be
                # read before this thread is back, and must not start a thread for it.
                with self._count_lock:
                    stays = self._free < _IDLE_THREADS
                    if stays:
                        self._free += 1
                try:
                    self._channel.send_frame(frame)
                except OSError:
                    pass  # the kernel is gone; the reader will notice
                if not stays:
                    ended = False
                    return  # enough threads wait already: this task goes back
        finally:
            if ended:
                self.closed.set()

    def _next_call(self) -> CallFrame | None:
        """Read frames until a call this thread runs (``None``: the channel closed).

        Before returning a call it makes sure another thread reads the next frame;
        what it cannot run (a malformed call, no task left for a thread) it answers.
        """
        while True:
            try:
                message = self._channel.receive()
            except (EOFError, OSError, WorkerFrameError):
                return None
            if message["type"] != "call":
                continue
            try:
                call: CallFrame = _protocol.structure_frame(message, CallFrame)
            except WorkerFrameError as exc:
                call_id = message.get("id")
                if type(call_id) is not int:
                    continue  # nothing to answer: the kernel never sends this
                reply = error_result(call_id, "bad_arguments", "WorkerFrameError", str(exc))
            else:
                with self._count_lock:
                    self._free -= 1
                    alone = self._free == 0
                error = self._add_thread() if alone else None
                if error is None:
                    return call
                with self._count_lock:
                    self._free += 1  # it keeps reading: it runs no call
                reply = error_result(
                    call.id, "exception", "RuntimeError", f"the worker is exhausted: {error}"
                )
            try:
                self._channel.send(reply)
            except OSError:
                return None


def serve(channel: Channel, handle: Callable[[CallFrame], ResultFrame]) -> None:
    """Answer calls until the kernel closes the channel.

    ``handle`` runs in a call thread (``_CallThreads``: calls run in parallel, each
    in the thread that read it) and must not raise: it turns every failure into an
    error result (``error_result``). The main thread only waits for the end.
    """
    threads = _CallThreads(channel, handle)
    if threads.start() is not None:
        return  # not even one thread: nothing can be served
    threads.closed.wait()


def exit_group() -> None:
    """End this worker and every program its calls started (its process group)."""
    sys.stderr.flush()
    os.kill(0, signal.SIGKILL)


class LogFrames(logging.Handler):
    """Sends log records to the kernel as log frames (it names the logger)."""

    def __init__(self, channel: Channel) -> None:
        super().__init__(logging.DEBUG)
        self._channel = channel

    def emit(self, record: logging.LogRecord) -> None:
        try:
            text = self.format(record)
            self._channel.send_frame(_protocol.encode_log(record.levelno, text))
        except Exception:
            self.handleError(record)


# --- denials -----------------------------------------------------------------------

_NETWORK_EVENTS = frozenset(
    {"socket.__new__", "socket.connect", "socket.bind", "socket.sendto", "socket.sendmsg"}
)
_SUBPROCESS_EVENTS = frozenset(
    {
        "subprocess.Popen",
        "os.exec",
        "os.posix_spawn",
        "os.spawn",
        "os.fork",
        "os.forkpty",
        "os.system",
        "pty.spawn",
    }
)
_WRITE_EVENTS = frozenset(
    {
        "os.remove",
        "os.rename",
        "os.mkdir",
        "os.rmdir",
        "os.truncate",
        "os.symlink",
        "os.link",
        "shutil.rmtree",
        "shutil.move",
    }
)
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
_DENIED_ERRNOS = frozenset({errno.EPERM, errno.EACCES})


class Attempts:
    """The last sensitive operation each thread attempted, from Python audit events.

    Only consulted after a call failed with EPERM/EACCES, to say which permission
    it lacked; the sandbox itself (seccomp, Landlock) is what refuses. Install it
    after the served code is imported: its own imports are not audited.
    """

    def __init__(self) -> None:
        self._local = threading.local()
        self.latest: tuple[str, str] | None = None

    def install(self) -> None:
        sys.addaudithook(self._hook)

    def clear(self) -> None:
        self._local.last = None

    def last(self) -> tuple[str, str] | None:
        mine: tuple[str, str] | None = getattr(self._local, "last", None)
        # An async tool's blocking work may run in one of trio's threads.
        return mine if mine is not None else self.latest

    def _hook(self, event: str, args: tuple[Any, ...]) -> None:
        attempt: tuple[str, str] | None = None
        if event in _NETWORK_EVENTS:
            target = args[1] if len(args) > 1 and event != "socket.__new__" else None
            attempt = ("network", f"{event.partition('.')[2]} {target!r}" if target else event)
        elif event in _SUBPROCESS_EVENTS:
            program = args[0] if args else ""
            if isinstance(program, (list, tuple)):
                program = program[0] if program else ""
            attempt = ("subprocess", f"running {os.fsdecode(program) if program else 'a program'}")
        elif event in _WRITE_EVENTS:
            path = args[0] if args else ""
            attempt = ("write", _path_text(path))
        elif event == "open" and len(args) >= 3:
            path, mode, flags = args[0], args[1], args[2]
            if isinstance(path, int):
                return
            writes = (isinstance(mode, str) and any(c in mode for c in "wax+")) or (
                mode is None and isinstance(flags, int) and flags & _WRITE_FLAGS
            )
            attempt = ("write" if writes else "read", _path_text(path))
        if attempt is not None:
            self._local.last = attempt
            self.latest = attempt


def _path_text(path: Any) -> str:
    try:
        return os.fsdecode(path)
    except TypeError:
        return repr(path)


def permission_error(exc: BaseException) -> OSError | None:
    """The EPERM/EACCES behind ``exc``: itself, its cause or context, or a group leaf."""
    seen: set[int] = set()
    todo = [exc]
    while todo:
        current = todo.pop()
        if id(current) in seen:
            continue
        seen.add(id(current))
        if isinstance(current, OSError) and current.errno in _DENIED_ERRNOS:
            return current
        if isinstance(current, BaseExceptionGroup):
            todo.extend(current.exceptions)
        for linked in (current.__cause__, current.__context__):
            if linked is not None:
                todo.append(linked)
    return None


def _inside(workspace: str, path: str) -> bool:
    # Relative paths are inside: the worker's cwd is the workspace.
    full = os.path.normpath(os.path.join(workspace, path))
    return full == workspace or full.startswith(workspace.rstrip(os.sep) + os.sep)


def denial_message(config: WorkerConfig, attempt: tuple[str, str] | None, error: OSError) -> str:
    """Why the sandbox refused, naming the permission the plugin would need."""
    reason = error.strerror or str(error)
    declared = "declare it in Plugin(permissions=...)"
    if attempt is None:
        return f"the sandbox refused an operation ({reason}); the plugin may lack a permission"
    category, what = attempt
    if category == "network":
        if not config.network:
            return f"{what}: needs permission network ({declared}, e.g. ['host:443'])"
        ports = ", ".join(str(p) for p in config.tcp_ports)
        return (
            f"{what}: refused ({reason}); the plugin may connect only to the declared "
            f"network ports ({ports}): add the host:port to its network permission"
        )
    if category == "subprocess":
        if not config.subprocess:
            return f"{what}: needs permission subprocess ({declared}, subprocess=True)"
        return (
            f"{what}: refused ({reason}); programs may run only from the system's bin directories"
        )
    if not _inside(config.workspace, what):
        return (
            f"{'writing' if category == 'write' else 'reading'} {what}: refused ({reason}); "
            "it is outside the workspace, which no permission grants"
        )
    if category == "write" and config.workspace_access != "write":
        return f"writing {what}: needs permission workspace: write ({declared})"
    return f"{what}: refused by the sandbox ({reason})"


def file_size_note(config: WorkerConfig, exc: BaseException) -> str:
    """What to add to an ``EFBIG`` error: the worker's file size limit (else nothing).

    RLIMIT_FSIZE: Python ignores SIGXFSZ, so the write fails and the worker lives.
    """
    if isinstance(exc, OSError) and exc.errno == errno.EFBIG:
        size = config.limits.get("file_size_bytes")
        return f" (the worker's file size limit is {size} bytes)"
    return ""
