"""The ``shell`` built-in plugin: run a program in the workspace with a deadline and output caps.

``run_command(["ls", "-l"])`` runs the program directly, with no shell;
``run_command("ls -l | wc -l")`` runs ``/bin/sh -c "ls -l | wc -l"``. The
command string is the only thing a shell interprets: nothing else the model
sends is ever put into a shell command line.

Processes and deadlines. The command starts in a process group of its own
(``process_group=0``) when the system allows it, and the whole group is
SIGKILLed at its deadline, and also when the command exits (background
programs it left behind would otherwise hold its output pipes open and
outlive the call). A sandbox worker's seccomp filter refuses ``setpgid`` so
that every descendant stays in the worker's group: there the command's own
process is killed at the deadline, output is read for a short grace period
after it exits, and whatever it left in the background is ended with the
worker's process group (when the host kills or recycles the worker).

``run_process`` is the one piece of process handling the built-ins share
(``plugins.python`` uses it too).
"""

from __future__ import annotations

import collections
import errno
import os
import selectors
import signal
import subprocess
import time
from collections.abc import Mapping, Sequence

import attrs

from kernel.plugin import Plugin, context
from kernel.tools import ToolFailure

__all__ = [
    "MAX_STREAM_BYTES",
    "ProcessResult",
    "describe_exit",
    "format_streams",
    "plugin",
    "run_command",
    "run_process",
    "workspace_directory",
]

plugin = Plugin(
    "shell",
    version="0.1.0",
    description="Run programs in the workspace.",
    permissions={"workspace": "write", "subprocess": True},
)

#: Bytes of stdout and of stderr kept by ``run_command`` (the head and the tail of each).
MAX_STREAM_BYTES = 32_000
#: Longest deadline a call may ask for, in seconds.
MAX_TIMEOUT = 600.0
#: After the command's own process exits, how long output is still read: enough for
#: its killed group to close the pipes; leftovers that escaped it are not waited for.
_EXIT_GRACE = 0.5
#: Environment variables passed to commands; nothing else (no API keys) gets through.
_PASSED_ENVIRONMENT = ("PATH", "HOME", "TMPDIR", "LANG", "LC_ALL", "LC_CTYPE", "TZ", "TERM")


class CappedBuffer:
    """Keeps the first and last bytes of a stream up to ``limit`` in all, and counts the rest."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.head = bytearray()
        self.tail: collections.deque[bytes] = collections.deque()
        self.tail_size = 0
        self.total = 0

    def add(self, data: bytes) -> None:
        self.total += len(data)
        room = self.limit // 3 - len(self.head)  # a third for the head, the rest for the tail
        if room > 0:
            self.head += data[:room]
            data = data[room:]
        if not data:
            return
        self.tail.append(data)
        self.tail_size += len(data)
        keep = self.limit - len(self.head)
        while self.tail_size - len(self.tail[0]) >= keep:
            self.tail_size -= len(self.tail.popleft())

    def text(self, name: str = "output") -> str:
        """The kept bytes as text, with a visible marker where bytes were dropped."""
        tail = b"".join(self.tail)
        kept_tail = self.limit - len(self.head)
        dropped = self.total - len(self.head) - min(len(tail), kept_tail)
        head_text = self.head.decode("utf-8", errors="replace")
        if dropped <= 0:
            return head_text + tail.decode("utf-8", errors="replace")
        tail_text = tail[-kept_tail:].decode("utf-8", errors="replace")
        marker = (
            f"\n[... {dropped} bytes of {name} truncated; {self.total} bytes in all, "
            f"showing the first {len(self.head)} and the last {min(len(tail), kept_tail)} ...]\n"
        )
        return head_text + marker + tail_text


@attrs.frozen
class ProcessResult:
    """How a process ended and what it wrote.

    Attributes:
        returncode: the exit status; ``-N`` when killed by signal ``N``.
        timed_out: the deadline passed and the process was killed.
        outputs: one ``CappedBuffer`` per captured stream, in the order asked for.
        duration: seconds from start to end.
        left_running: output pipes were still held open by programs the process left
            in the background, which could not be killed (no process group of its own).
    """

    returncode: int
    timed_out: bool
    outputs: tuple[CappedBuffer, ...]
    duration: float
    left_running: bool = False


def describe_exit(returncode: int) -> str:
    """``exit code 3`` or ``killed by signal 9 (SIGKILL)``."""
    if returncode >= 0:
        return f"exit code {returncode}"
    try:
        name = signal.Signals(-returncode).name
    except ValueError:
        name = "unknown signal"
    return f"killed by signal {-returncode} ({name})"


def command_environment() -> dict[str, str]:
    """The environment a command sees: a few neutral variables, never the kernel's secrets.

    In a sandbox worker the environment was already built from scratch; in the
    kernel's process this keeps API keys away from the programs a model starts.
    """
    env = {name: os.environ[name] for name in _PASSED_ENVIRONMENT if name in os.environ}
    env.setdefault("PATH", "/usr/local/bin:/usr/bin:/bin")
    env.setdefault("LANG", "C.UTF-8")
    return env


def workspace_directory() -> str:
    """The workspace's directory on the host, as the cwd for a program.

    The path comes from the context's ``Workspace``; confinement is the
    sandbox's job (Landlock in a worker), not this path's. Checking that it is
    still the directory the workspace fd holds catches a workspace moved or
    replaced since it was opened.
    """
    ws = context().workspace
    directory = str(ws.path)
    held = os.fstat(ws.fileno())
    try:
        current = os.stat(directory)
    except OSError as exc:
        raise RuntimeError(f"the workspace directory is gone: {exc.strerror}") from None
    if (current.st_dev, current.st_ino) != (held.st_dev, held.st_ino):
        raise RuntimeError("the workspace directory was replaced since the workspace was opened")
    return directory


def _popen(
    argv: Sequence[str],
    cwd: str,
    env: Mapping[str, str],
    pass_fds: Sequence[int],
    process_group: int | None,
) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        list(argv),
        cwd=cwd,
        env=dict(env),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        pass_fds=tuple(pass_fds),
        close_fds=True,
        process_group=process_group,
    )


def _start(
    argv: Sequence[str], cwd: str, env: Mapping[str, str], pass_fds: Sequence[int]
) -> tuple[subprocess.Popen[bytes], bool]:
    """Start the process, in a group of its own when allowed: (process, has own group)."""
    try:
        return _popen(argv, cwd, env, pass_fds, process_group=0), True
    except PermissionError as exc:
        # seccomp in a sandbox worker refuses setpgid with EPERM before exec; CPython
        # reports such an error with no filename, or with cwd's when cwd was given. A
        # program that may not be executed is refused with its own name: not retried.
        if exc.errno != errno.EPERM or exc.filename not in (None, cwd):
            raise
    return _popen(argv, cwd, env, pass_fds, process_group=None), False


def _exited(pid: int) -> bool:
    """Whether the child has exited, without reaping it (its pid, and group, stay reserved)."""
    try:
        info = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    except ChildProcessError:
        return True
    return info is not None


def _kill(process: subprocess.Popen[bytes], own_group: bool) -> None:
    try:
        if own_group:
            # The group id is the child's pid, reserved until the child is reaped.
            os.killpg(process.pid, signal.SIGKILL)
        else:
            process.send_signal(signal.SIGKILL)
    except ProcessLookupError:
        pass
    except PermissionError as exc:  # pragma: no cover - a group member we may not signal
        if exc.errno != errno.EPERM:
            raise


def run_process(
    argv: Sequence[str],
    *,
    cwd: str,
    timeout: float,
    max_bytes: int = MAX_STREAM_BYTES,
    extra_output: int | None = None,
    env: Mapping[str, str] | None = None,
) -> ProcessResult:
    """Run ``argv`` to completion or its deadline, capturing stdout and stderr (capped).

    Blocks its thread (sync tools run in worker threads, never on the Trio thread).

    Args:
        argv: the program and its arguments; no shell is involved.
        cwd: the directory it runs in.
        timeout: seconds until the process (group) is SIGKILLed.
        max_bytes: bytes kept of each stream (head and tail, with a marker between).
        extra_output: when given, the bytes kept of a third output: a pipe whose write
            end the child inherits; each ``"{fd}"`` in ``argv`` becomes its fd number.
            Its content is ``outputs[2]``.
        env: the environment; default ``command_environment()``.

    Raises:
        FileNotFoundError, PermissionError: the program cannot be started.
    """
    extra_read: int | None = None
    extra_write: int | None = None
    if extra_output is not None:
        extra_read, extra_write = os.pipe()
        argv = [arg.replace("{fd}", str(extra_write)) for arg in argv]
    started = time.monotonic()
    deadline = started + timeout
    try:
        process, own_group = _start(
            argv,
            cwd,
            command_environment() if env is None else env,
            [] if extra_write is None else [extra_write],
        )
    except BaseException:
        for fd in (extra_read, extra_write):
            if fd is not None:
                os.close(fd)
        raise
    if extra_write is not None:
        os.close(extra_write)  # the child holds the only write end now
    assert process.stdout is not None and process.stderr is not None
    buffers = [CappedBuffer(max_bytes), CappedBuffer(max_bytes)]
    fds = {process.stdout.fileno(): buffers[0], process.stderr.fileno(): buffers[1]}
    if extra_read is not None:
        buffers.append(CappedBuffer(extra_output or max_bytes))
        fds[extra_read] = buffers[2]
    timed_out = False
    left_running = False
    exited_at: float | None = None
    try:
        with selectors.DefaultSelector() as selector:
            for fd in fds:
                os.set_blocking(fd, False)
                selector.register(fd, selectors.EVENT_READ)
            while selector.get_map():
                now = time.monotonic()
                if exited_at is None and _exited(process.pid):
                    exited_at = now
                    if own_group:
                        # Leftovers in the background die with the command: they would
                        # hold its pipes and outlive the call.
                        _kill(process, own_group)
                if exited_at is None and now >= deadline:
                    timed_out = True
                    _kill(process, own_group)
                    exited_at = now
                if exited_at is not None and now >= exited_at + _EXIT_GRACE:
                    left_running = True
                    break
                wait = 0.05 if exited_at is not None else min(max(deadline - now, 0), 0.1)
                for key, _ in selector.select(wait):
                    fd = key.fd
                    try:
                        data = os.read(fd, 65536)
                    except BlockingIOError:
                        continue
                    if data:
                        fds[fd].add(data)
                    else:
                        selector.unregister(fd)
        if exited_at is None:
            # Every pipe closed while the child runs on (it closed them itself).
            remaining = deadline - time.monotonic()
            try:
                process.wait(timeout=max(remaining, 0))
            except subprocess.TimeoutExpired:
                timed_out = True
        if own_group or timed_out:
            _kill(process, own_group)
        returncode = process.wait()
    finally:
        if process.returncode is None:
            _kill(process, own_group)
            process.wait()
        process.stdout.close()
        process.stderr.close()
        if extra_read is not None:
            os.close(extra_read)
    return ProcessResult(
        returncode=returncode,
        timed_out=timed_out,
        outputs=tuple(buffers),
        duration=time.monotonic() - started,
        left_running=left_running,
    )


def format_streams(result: ProcessResult) -> str:
    """``stdout:`` and ``stderr:`` sections; empty streams are left out."""
    parts = []
    for name, buffer in zip(("stdout", "stderr"), result.outputs[:2], strict=False):
        if buffer.total:
            body = buffer.text(name)
            parts.append(f"{name}:\n{body}" + ("" if body.endswith("\n") else "\n"))
    if result.left_running:
        parts.append(
            "[programs the command left in the background still hold its output; stopped reading]\n"
        )
    return "".join(parts) or "(no output)\n"


def _argv(command: str | list[str]) -> list[str]:
    if isinstance(command, str):
        if not command.strip():
            raise ValueError("command is empty")
        return ["/bin/sh", "-c", command]
    if not command or not command[0]:
        raise ValueError("command is an empty list; give the program and its arguments")
    return list(command)


@plugin.tool(timeout=MAX_TIMEOUT + 30)
def run_command(command: str | list[str], timeout: float = 30) -> str:
    """Run a command in the workspace directory and return its exit code and output.

    A string runs with ``/bin/sh -c`` (pipes, redirections and globs work); a
    list runs the program directly with those arguments and no shell. The
    command's whole process group is killed at the deadline and when it exits,
    so background programs do not outlive the call. stdout and stderr keep
    their first and last bytes (32 000 each) with a marker for what was cut.
    A non-zero exit code is a normal result.

    Args:
        command: A shell command line, or a program and its arguments as a list.
        timeout: Seconds before the command is killed (at most 600).
    """
    if not 0 < timeout <= MAX_TIMEOUT:
        raise ValueError(f"timeout must be more than 0 and at most {MAX_TIMEOUT:g} s")
    argv = _argv(command)
    try:
        result = run_process(argv, cwd=workspace_directory(), timeout=timeout)
    except FileNotFoundError:
        raise FileNotFoundError(f"program not found: {argv[0]!r}") from None
    except PermissionError as exc:
        reason = os.strerror(exc.errno) if exc.errno else str(exc)
        raise PermissionError(f"cannot run {argv[0]!r}: {reason.lower()}") from None
    if result.timed_out:
        raise ToolFailure(
            "timeout",
            f"command did not finish within {timeout:g} s and was killed\n"
            + format_streams(result),
            type="CommandTimeout",
        )
    return f"{describe_exit(result.returncode)}\n{format_streams(result)}"
