"""A throwaway PostgreSQL server for the tests and the bench.

``running_server()`` runs Debian's ``postgresql`` binaries from a temporary
directory: ``initdb`` (trust authentication, C locale), then ``postgres`` on
a free port of 127.0.0.1 with its unix socket in the same directory, and
removes everything on exit. ``initdb`` refuses to run as root, so as root the
server runs as a dedicated system user (``tak-pg-test``, created when
missing). ``unavailable_reason()`` says why a server cannot be started here,
for a skip message.

``shared_server(name)`` is one server per test process and name, started on
first use and stopped when the process exits: the store and batch tests use
``shared_server()``; the few that stop, freeze or restart their server share
``shared_server("faults")``, so their faults never cut another test's
connections. Under pytest-xdist each worker process has its own.

A server dies with the process that started it, however that process ends
(SIGKILL included): a supervisor (this file, run as ``python pg_server.py
supervise``, in a session of its own so that a signal to the test's process
group does not reach it) runs ``postgres`` as its own child, never
daemonized, with ``PR_SET_PDEATHSIG`` = SIGQUIT (PostgreSQL's immediate
shutdown), then reads its stdin, a pipe whose only writer is the test
process. The kernel closes that pipe when the test process dies; the
supervisor then wakes a frozen server (SIGCONT), stops it and removes its
directory. If the supervisor is killed first (tests/reaper.py SIGKILLs what
a dead run left), its server gets SIGQUIT from the kernel (only its directory
is left behind then). Tests stop and restart a server through its
supervisor (``stop``, ``start``, ``restart``), never with ``pg_ctl``, so the
server stays its child.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import glob
import json
import os
import pwd
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import attrs

USER = "tak-pg-test"


@attrs.frozen
class PgServer:
    """A running server: ``url`` names its ``postgres`` database."""

    port: int
    directory: Path

    def url(self, database: str = "postgres") -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/{database}"

    @property
    def data(self) -> Path:
        return self.directory / "data"

    def postmaster_pid(self) -> int | None:
        """The running postmaster's pid."""
        return _postmaster_pid(self.data)

    def signal(self, signum: int) -> None:
        """Send ``signum`` to the whole server: the postmaster and every process it
        started (each of which is in a session of its own, so no process group
        holds them all), the postmaster first (it starts no new one meanwhile)."""
        pid = self.postmaster_pid()
        if pid is not None:
            _signal_server(pid, signum)


def bin_dir() -> Path | None:
    """The directory of ``initdb``/``pg_ctl``: the newest Debian version, else ``$PATH``."""
    found = sorted(
        glob.glob("/usr/lib/postgresql/*/bin/initdb"),
        key=lambda p: (
            int(Path(p).parent.parent.name) if Path(p).parent.parent.name.isdigit() else 0
        ),
    )
    if found:
        return Path(found[-1]).parent
    initdb = shutil.which("initdb")
    return Path(initdb).parent if initdb else None


def unavailable_reason() -> str | None:
    """Why a server cannot be started here, or ``None`` when it can."""
    if bin_dir() is None:
        return "PostgreSQL binaries not found (apt-get install postgresql)"
    if os.geteuid() == 0 and shutil.which("runuser") is None:
        return "running as root without runuser: cannot start initdb as another user"
    with contextlib.suppress(ImportError):
        import psycopg  # noqa: F401

        return None
    return "psycopg is not installed (pip install 'trio-agent-kernel[postgres]')"


def _ensure_user() -> None:
    try:
        pwd.getpwnam(USER)
    except KeyError:
        subprocess.run(
            ["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", USER],
            check=True,
            capture_output=True,
        )


def _as_server_user(argv: list[str]) -> list[str]:
    # initdb and postgres refuse to run as root: as root, run them as USER.
    return ["runuser", "-u", USER, "--", *argv] if os.geteuid() == 0 else argv


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def server_options(port: int, directory: Path, *, fsync: bool = False) -> str:
    """``postgres`` options of a test server (``pg_ctl -o``), for a restart too."""
    settings = [
        f"-p {port}",
        "-c listen_addresses=127.0.0.1",
        f"-k {directory}",
        "-c max_connections=200",
        "-c shared_buffers=64MB",
    ]
    if not fsync:
        settings += ["-c fsync=off", "-c full_page_writes=off"]
    return " ".join(settings)


def _signal_server(postmaster: int, signum: int) -> None:
    pids = [postmaster]
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:  # gone meanwhile
                continue
            # "pid (comm) state ppid ...": comm may hold spaces and parentheses.
            if int(stat.rsplit(")", 1)[1].split()[1]) == postmaster:
                pids.append(int(entry))
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signum)


def _postmaster_pid(data: Path) -> int | None:
    try:
        first = (data / "postmaster.pid").read_text().split("\n", 1)[0]
    except (FileNotFoundError, PermissionError):
        return None
    return int(first) if first.strip().isdigit() else None


# -- the supervisor (its own process) -----------------------------------------

_PR_SET_PDEATHSIG = 1


def _die_with_parent(signum: int) -> Callable[[], None]:
    libc = ctypes.CDLL(None, use_errno=True)  # loaded here, not in the forked child

    def arm() -> None:
        # preexec_fn runs after the child's uid changed: a change of uid clears it.
        libc.prctl(_PR_SET_PDEATHSIG, signum, 0, 0, 0)

    return arm


class _Postmaster:
    """The supervisor's server: ``postgres`` as its own child, never daemonized, so
    that it dies with the supervisor (``PR_SET_PDEATHSIG``: SIGQUIT, PostgreSQL's
    immediate shutdown), whoever kills the supervisor."""

    def __init__(self, directory: Path, fsync: bool) -> None:
        self.directory = directory
        self.data = directory / "data"
        self.fsync = fsync
        self.port = 0
        self.process: subprocess.Popen[bytes] | None = None

    def init(self) -> None:
        bins = bin_dir()
        if bins is None:
            raise RuntimeError("PostgreSQL binaries not found")
        if os.geteuid() == 0:
            _ensure_user()
            user = pwd.getpwnam(USER)
            os.chown(self.directory, user.pw_uid, user.pw_gid)
        initdb = [str(bins / "initdb"), "-D", str(self.data), "-U", "postgres", "-A", "trust"]
        initdb += ["-E", "UTF8", "--locale=C", "--no-sync"]
        made = subprocess.run(_as_server_user(initdb), capture_output=True, text=True)
        if made.returncode != 0:
            raise RuntimeError(f"initdb failed: {made.stderr[-2000:]}")

    def start(self) -> None:
        """Start the server (on a new free port the first time, its own after).

        Raises:
            RuntimeError: it did not become ready (with its log).
        """
        bins = bin_dir()
        assert bins is not None
        for attempt in range(5):
            port = self.port or _free_port()
            log = open(self.directory / "server.log", "ab")
            options = shlex.split(server_options(port, self.directory, fsync=self.fsync))
            as_user: dict[str, Any] = {}
            if os.geteuid() == 0:
                user = pwd.getpwnam(USER)
                as_user = {"user": user.pw_uid, "group": user.pw_gid, "extra_groups": []}
            self.process = subprocess.Popen(
                [str(bins / "postgres"), "-D", str(self.data), *options],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                preexec_fn=_die_with_parent(signal.SIGQUIT),
                **as_user,
            )
            log.close()
            if self._ready():
                self.port = port
                return
            self.stop(signal.SIGQUIT)
            if attempt == 4 or self.port:  # the port may have been taken: retry, then give up
                text = (self.directory / "server.log").read_text(errors="replace")
                raise RuntimeError(f"postgres did not start: {text[-2000:]}")
        raise AssertionError("unreachable")

    def _ready(self) -> bool:
        deadline = time.monotonic() + 30
        assert self.process is not None
        while time.monotonic() < deadline and self.process.poll() is None:
            with contextlib.suppress(OSError):
                lines = (self.data / "postmaster.pid").read_text().splitlines()
                if len(lines) > 7 and lines[0].strip() == str(self.process.pid):
                    if lines[7].strip() == "ready":
                        return True
            time.sleep(0.02)
        return False

    def stop(self, signum: int) -> None:
        """Stop it: SIGINT is PostgreSQL's fast shutdown, SIGQUIT its immediate one."""
        process = self.process
        if process is None or process.poll() is not None:
            return
        _signal_server(process.pid, signal.SIGCONT)  # a frozen server cannot act on it
        process.send_signal(signum)
        try:
            process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            _signal_server(process.pid, signal.SIGKILL)
            process.wait()

    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None


def _supervise(fsync: bool) -> None:
    """Start a server, say where (one JSON line), then obey stdin until it ends.

    stdin is the test process's pipe: its end (the process exiting or killed) is
    the signal to stop. Lines ``stop fast``, ``stop immediate`` and ``start``
    stop and start the server (a test's restart), each answered ``ok`` or
    ``error: ...``. A SIGTERM stops the server too; SIGINT is not ours.
    """
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    directory = Path(tempfile.mkdtemp(prefix="tak-pg-"))
    server = _Postmaster(directory, fsync)
    try:
        try:
            server.init()
            server.start()
        except Exception as exc:
            print(json.dumps({"error": str(exc)}), flush=True)
            return
        print(json.dumps({"port": server.port, "directory": str(directory)}), flush=True)
        for line in sys.stdin:
            command = line.split()
            try:
                if command == ["stop", "fast"]:
                    server.stop(signal.SIGINT)
                elif command == ["stop", "immediate"]:
                    server.stop(signal.SIGQUIT)
                elif command == ["start"]:
                    if not server.running():
                        server.start()
                else:
                    raise RuntimeError(f"unknown command {line.strip()!r}")
                print("ok", flush=True)
            except Exception as exc:
                print(f"error: {exc}", flush=True)
    finally:
        server.stop(signal.SIGQUIT)
        shutil.rmtree(directory, ignore_errors=True)


# -- the test process's side ---------------------------------------------------


@attrs.define
class _Supervisor:
    process: subprocess.Popen[str]
    lock: threading.Lock = attrs.Factory(threading.Lock)

    def ask(self, command: str) -> None:
        assert self.process.stdin is not None and self.process.stdout is not None
        with self.lock:
            self.process.stdin.write(command + "\n")
            self.process.stdin.flush()
            answer = self.process.stdout.readline().strip()
        if answer != "ok":
            raise RuntimeError(f"the server's supervisor: {command}: {answer or 'gone'}")


_supervisors: dict[Path, _Supervisor] = {}


def stop(server: PgServer, mode: str = "fast") -> None:
    """Stop ``server`` (``fast``: sessions ended, ``immediate``: as if it crashed)."""
    _supervisors[server.directory].ask(f"stop {mode}")


def start(server: PgServer) -> None:
    """Start ``server`` again (after ``stop``), on its port."""
    _supervisors[server.directory].ask("start")


def restart(server: PgServer, *, down_s: float = 0.0) -> None:
    """Stop ``server`` (fast shutdown: every session is ended), ``down_s`` seconds down,
    then start it again."""
    stop(server, "fast")
    time.sleep(down_s)
    start(server)


@contextlib.contextmanager
def running_server(*, fsync: bool = False) -> Iterator[PgServer]:
    """Start a server in a temporary directory; stop it and remove the directory on
    exit, or when this process dies (see the module docstring).

    ``fsync=False`` (the tests) trades crash safety of the server itself for
    speed; a killed client process is unaffected either way.

    Raises:
        RuntimeError: the server could not be started (with its log).
    """
    process = subprocess.Popen(
        [sys.executable, "-I", os.path.abspath(__file__), "supervise", json.dumps(fsync)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,  # a signal to our process group must not stop it early
    )
    assert process.stdin is not None and process.stdout is not None
    directory: Path | None = None
    try:
        line = process.stdout.readline()
        said = json.loads(line) if line.strip() else {"error": "the supervisor said nothing"}
        if "error" in said:
            raise RuntimeError(said["error"])
        directory = Path(said["directory"])
        _supervisors[directory] = _Supervisor(process)
        yield PgServer(port=int(said["port"]), directory=directory)
    finally:
        if directory is not None:
            _supervisors.pop(directory, None)
        process.stdin.close()  # the supervisor stops the server
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        process.stdout.close()


_shared: dict[str, PgServer] = {}
_shared_lock = threading.Lock()
_exits = contextlib.ExitStack()
atexit.register(_exits.close)


def shared_server(name: str = "main") -> PgServer:
    """This process's server called ``name``, started on first use, stopped at exit.

    Raises:
        RuntimeError: the server could not be started (with its log).
    """
    with _shared_lock:
        server = _shared.get(name)
        if server is None:
            server = _shared[name] = _exits.enter_context(running_server())
        return server


def revive(server: PgServer) -> None:
    """Leave ``server`` running, whatever a test did to it (froze it, stopped it)."""
    server.signal(signal.SIGCONT)
    start(server)


class Freezer:
    """Freezes a whole server (``SIGSTOP`` of all its processes), as a host that stops
    answering looks to a client (TCP still accepts and acknowledges, nothing
    replies), and thaws it; a timer thaws it after ``thaw_after_s`` whatever the
    test does, so code that would wait forever returns then, for the test to fail
    on what it got."""

    def __init__(self, server: PgServer, *, thaw_after_s: float = 60.0) -> None:
        self.server = server
        self.thaw_after_s = thaw_after_s
        self.timer: threading.Timer | None = None
        self.frozen = False

    def freeze(self) -> None:
        self.server.signal(signal.SIGSTOP)
        self.frozen = True
        self.timer = threading.Timer(self.thaw_after_s, self.thaw)
        self.timer.daemon = True
        self.timer.start()

    def thaw(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
        self.frozen = False
        self.server.signal(signal.SIGCONT)


def create_database(server: PgServer, name: str) -> str:
    """Create database ``name`` on ``server`` and return its URL."""
    import psycopg

    with psycopg.connect(server.url(), autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}" TEMPLATE template0')
    return server.url(name)


def wait_until(what: str, check: object, timeout: float = 60.0) -> None:
    """Poll ``check()`` until it is true; AssertionError naming ``what`` after ``timeout``."""
    assert callable(check)
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"gave up waiting for {what}")
        time.sleep(0.05)


if __name__ == "__main__" and sys.argv[1:2] == ["supervise"]:
    _supervise(json.loads(sys.argv[2]))
