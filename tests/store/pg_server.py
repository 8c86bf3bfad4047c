"""A throwaway PostgreSQL server for the tests and the bench.

``running_server()`` runs Debian's ``postgresql`` binaries from a temporary
directory: ``initdb`` (trust authentication, C locale), then ``postgres`` on
a free port of 127.0.0.1 with its unix socket in the same directory, and
removes everything on exit. ``initdb`` refuses to run as root, so as root the
server runs as a dedicated system user (``tak-pg-test``, created when
missing). ``unavailable_reason()`` says why a server cannot be started here,
for a skip message.
"""

from __future__ import annotations

import contextlib
import glob
import os
import pwd
import shutil
import socket
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import attrs

USER = "tak-pg-test"


@attrs.frozen
class PgServer:
    """A running server: ``url`` names its ``postgres`` database."""

    port: int
    directory: Path

    def url(self, database: str = "postgres") -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/{database}"


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


@contextlib.contextmanager
def running_server(*, fsync: bool = False) -> Iterator[PgServer]:
    """Start a server in a temporary directory; stop it and remove the directory on exit.

    ``fsync=False`` (the tests) trades crash safety of the server itself for
    speed; a killed client process is unaffected either way.

    Raises:
        RuntimeError: the server could not be started (with its log).
    """
    bins = bin_dir()
    if bins is None:
        raise RuntimeError("PostgreSQL binaries not found")
    if os.geteuid() == 0:
        _ensure_user()
    directory = Path(tempfile.mkdtemp(prefix="tak-pg-"))
    data, log = directory / "data", directory / "server.log"
    if os.geteuid() == 0:
        user = pwd.getpwnam(USER)
        os.chown(directory, user.pw_uid, user.pw_gid)
    try:
        subprocess.run(
            _as_server_user(
                [
                    str(bins / "initdb"),
                    "-D",
                    str(data),
                    "-U",
                    "postgres",
                    "-A",
                    "trust",
                    "-E",
                    "UTF8",
                    "--locale=C",
                    "--no-sync",
                ]
            ),
            check=True,
            capture_output=True,
        )
        settings = [
            "-c listen_addresses=127.0.0.1",
            f"-k {directory}",
            "-c max_connections=200",
            "-c shared_buffers=64MB",
        ]
        if not fsync:
            settings += ["-c fsync=off", "-c full_page_writes=off"]
        for attempt in range(5):
            port = _free_port()
            started = subprocess.run(
                _as_server_user(
                    [
                        str(bins / "pg_ctl"),
                        "-D",
                        str(data),
                        "-l",
                        str(log),
                        "-w",
                        "-t",
                        "30",
                        "-o",
                        " ".join([f"-p {port}", *settings]),
                        "start",
                    ]
                ),
                capture_output=True,
                text=True,
            )
            if started.returncode == 0:
                break
            if attempt == 4:  # the port may have been taken meanwhile: retry, then give up
                text = log.read_text() if log.exists() else ""
                raise RuntimeError(f"pg_ctl start failed: {started.stderr}{text[-2000:]}")
        try:
            yield PgServer(port=port, directory=directory)
        finally:
            subprocess.run(
                _as_server_user(
                    [str(bins / "pg_ctl"), "-D", str(data), "-m", "immediate", "-w", "stop"]
                ),
                capture_output=True,
            )
    except subprocess.CalledProcessError as exc:
        raise RuntimeError(f"{exc.cmd[0]} failed: {exc.stderr!r}") from None
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def create_database(server: PgServer, name: str) -> str:
    """Create database ``name`` on ``server`` and return its URL."""
    import psycopg

    with psycopg.connect(server.url(), autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}" TEMPLATE template0')
    return server.url(name)
