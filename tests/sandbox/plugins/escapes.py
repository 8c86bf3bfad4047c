"""Hostile plugin code: each tool tries one way out of the sandbox.

Every tool returns ``"ALLOWED: ..."`` when the attempt worked and
``"denied: <errno name>"`` when the operating system refused it, so a test
can tell a refusal from a bug in the attempt.
"""

from __future__ import annotations

import ctypes
import errno
import os
import socket
import stat
import subprocess
import sys
import time
from collections.abc import Callable

from kernel.tools import tool


def _outcome(fn: Callable[[], object]) -> str:
    try:
        result = fn()
    except OSError as exc:
        name = errno.errorcode.get(exc.errno or 0, str(exc.errno))
        return f"denied: {name}"
    return f"ALLOWED: {result!r}"[:2000]


def _libc_call(name: str, *args: object) -> object:
    libc = ctypes.CDLL(None, use_errno=True)
    result = getattr(libc, name)(*args)
    if result == -1:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))
    return result


def _read(path: str) -> str:
    def read() -> str:
        with open(path, "rb") as f:
            return f.read(4096).decode("utf-8", "replace")

    return _outcome(read)


@tool
def read_file(path: str) -> str:
    """Read a file by any path."""
    return _read(path)


@tool
def write_file(path: str, text: str = "pwned") -> str:
    """Overwrite (or create) a file by any path."""

    def write() -> int:
        with open(path, "w") as f:
            return f.write(text)

    return _outcome(write)


@tool
def append_file(path: str, text: str = "pwned") -> str:
    """Append to a file by any path."""

    def append() -> int:
        with open(path, "a") as f:
            return f.write(text)

    return _outcome(append)


@tool
def list_dir(path: str) -> str:
    """List a directory by any path."""
    return _outcome(lambda: sorted(os.listdir(path)))


@tool
def symlink_then_read(target: str, link: str) -> str:
    """Plant a symbolic link inside the workspace, then read through it."""
    made = _outcome(lambda: os.symlink(target, link))
    return f"symlink {made}; read {_read(link)}"


@tool
def hard_link(source: str, link: str) -> str:
    """Hard-link an outside file into the workspace."""
    return _outcome(lambda: os.link(source, link))


@tool
def rename(source: str, destination: str) -> str:
    """Rename a file."""
    return _outcome(lambda: os.rename(source, destination))


@tool
def make_device(path: str) -> str:
    """Create a character device node like /dev/null."""
    return _outcome(lambda: os.mknod(path, stat.S_IFCHR | 0o666, os.makedev(1, 3)))


@tool
def make_fifo(path: str) -> str:
    """Create a FIFO."""
    return _outcome(lambda: os.mkfifo(path))


@tool
def change_metadata(path: str) -> str:
    """chmod, chown and utime a file by any path."""
    return "; ".join(
        [
            "chmod " + _outcome(lambda: os.chmod(path, 0o777)),
            "chown " + _outcome(lambda: os.chown(path, 65534, 65534)),
            "utime " + _outcome(lambda: os.utime(path, (0, 0))),
        ]
    )


@tool
def execute(argv: list[str]) -> str:
    """Run a program and wait for it."""
    return _outcome(lambda: subprocess.run(argv, capture_output=True, timeout=10).returncode)


@tool
def exec_replace(path: str) -> str:
    """Replace the worker with a program (execv)."""
    return _outcome(lambda: os.execv(path, [path]))


@tool
def tcp_connect(host: str, port: int) -> str:
    """Open a TCP connection."""

    def connect() -> str:
        with socket.create_connection((host, port), timeout=5) as s:
            return f"connected from {s.getsockname()}"

    return _outcome(connect)


@tool
def udp_send(host: str, port: int) -> str:
    """Send a UDP datagram."""

    def send() -> int:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            return s.sendto(b"escaped", (host, port))

    return _outcome(send)


@tool
def unix_connect(address: str, abstract: bool = False) -> str:
    """Connect to a Unix stream socket by path, or by abstract name."""

    def connect() -> str:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.connect("\0" + address if abstract else address)
            s.sendall(b"escaped")
            return "connected"

    return _outcome(connect)


@tool
def unix_datagram(address: str) -> str:
    """Send a Unix datagram to a path."""

    def send() -> int:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
            return s.sendto(b"escaped", address)

    return _outcome(send)


@tool
def signal_process(pid: int, signal_number: int) -> str:
    """Send a signal to a process."""
    return _outcome(lambda: os.kill(pid, signal_number))


@tool
def ptrace_attach(pid: int) -> str:
    """PTRACE_ATTACH to a process."""
    return _outcome(lambda: _libc_call("ptrace", 16, pid, None, None))


@tool
def read_memory(pid: int) -> str:
    """process_vm_readv from another process."""

    class IoVec(ctypes.Structure):
        _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]

    buf = ctypes.create_string_buffer(16)
    local = IoVec(ctypes.cast(buf, ctypes.c_void_p), 16)
    remote = IoVec(0x400000, 16)
    return _outcome(
        lambda: _libc_call(
            "process_vm_readv", pid, ctypes.byref(local), 1, ctypes.byref(remote), 1, 0
        )
    )


@tool
def unshare_namespaces() -> str:
    """unshare(CLONE_NEWUSER | CLONE_NEWNS)."""
    return _outcome(lambda: _libc_call("unshare", 0x10000000 | 0x00020000))


@tool
def limit_other_process(pid: int) -> str:
    """prlimit another process's open files to nothing."""
    import resource

    return _outcome(lambda: resource.prlimit(pid, resource.RLIMIT_NOFILE, (0, 0)))


@tool
def new_session() -> str:
    """Leave the worker's process group (setsid)."""
    return _outcome(os.setsid)


@tool
def fork_once() -> str:
    """fork(); the child exits at once."""

    def fork() -> int:
        child = os.fork()
        if child == 0:
            os._exit(0)
        os.waitpid(child, 0)
        return child

    return _outcome(fork)


@tool
def fork_bomb(give_up_after: int = 50, most: int = 500) -> str:
    """Fork until refused ``give_up_after`` times (at most ``most`` children, which sleep)."""
    made = 0
    refused = 0
    while refused < give_up_after and made < most:
        try:
            pid = os.fork()
        except OSError:
            refused += 1
            time.sleep(0.001)
            continue
        if pid == 0:
            time.sleep(600)
            os._exit(0)
        made += 1
    return f"contained: {made} forks succeeded before {refused} refusals"


@tool
def memory_bomb(chunk_mb: int = 256, most_mb: int = 65536) -> str:
    """Allocate until something gives (or ``most_mb`` MiB, which no limit here allows)."""
    hoard = []
    try:
        while len(hoard) * chunk_mb < most_mb:
            hoard.append(bytearray(chunk_mb * 1024 * 1024))
    except MemoryError:
        total = len(hoard) * chunk_mb
        hoard.clear()
        return f"contained: MemoryError after {total} MiB"
    hoard.clear()
    return f"not contained: {most_mb} MiB allocated"


@tool
def environment() -> dict[str, str]:
    """The worker's environment."""
    return dict(os.environ)


@tool
def open_fds() -> list[int]:
    """Which file descriptors are open (probed with fstat: /proc is out of reach)."""
    found = []
    for fd in range(1024):
        try:
            os.fstat(fd)
        except OSError:
            continue
        found.append(fd)
    return found


@tool
def identity() -> dict[str, object]:
    """Who the worker is."""
    return {
        "pid": os.getpid(),
        "pgid": os.getpgid(0),
        "uid": os.getuid(),
        "cwd": os.getcwd(),
        "executable": sys.executable,
    }


@tool
def spawn_grandchild() -> dict[str, int]:
    """Start a child that starts a grandchild; both sleep. Returns their pids."""
    code = (
        "import subprocess, sys, time\n"
        "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'])\n"
        "print(p.pid, flush=True)\n"
        "time.sleep(600)\n"
    )
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE)
    assert child.stdout is not None
    grandchild = int(child.stdout.readline())
    return {"child": child.pid, "grandchild": grandchild}


@tool
def fail_here() -> str:
    """Raise an error inside the worker."""
    raise RuntimeError("failed inside the worker")


@tool
def forge_frame(body: str, announced: int = -1) -> str:
    """Write a raw frame to the kernel channel (fd 3), announcing ``announced`` bytes."""
    import struct

    raw = body.encode()
    os.write(3, struct.pack("!I", len(raw) if announced < 0 else announced) + raw)
    time.sleep(5)  # the kernel should kill this worker first
    return "not killed"
