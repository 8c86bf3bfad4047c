"""The tests' PostgreSQL servers (tests/store/pg_server.py): one per test process,
and none outlives the process that started it, however it ends."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.store import pg_server

ROOT = Path(__file__).resolve().parents[2]

# A stand-in for a test process: it starts a server the way the fixtures do, says
# where, and waits to be killed.
STARTS_A_SERVER = """
import json, sys, threading
from tests.store import pg_server
server = pg_server.shared_server()
supervisor = pg_server._supervisors[server.directory].process.pid
print(json.dumps({"port": server.port, "directory": str(server.directory),
                  "supervisor": supervisor}), flush=True)
threading.Event().wait()
"""


def _answers(port: int) -> bool:
    import psycopg

    try:
        with psycopg.connect(
            f"postgresql://postgres@127.0.0.1:{port}/postgres", connect_timeout=2
        ) as conn:
            conn.execute("SELECT 1")
    except psycopg.OperationalError:
        return False
    return True


@pytest.mark.parametrize(
    "how, supervisor_too",
    [(signal.SIGKILL, False), (signal.SIGTERM, False), (signal.SIGKILL, True)],
    ids=["killed", "terminated", "killed-with-its-supervisor"],
)
def test_a_server_dies_with_the_process_that_started_it(
    pg: pg_server.PgServer, how: signal.Signals, supervisor_too: bool
) -> None:
    """A test process SIGKILLed (a CI timeout) or terminated: its server stops, and its
    directory is removed, with nothing left to do by anyone. Its supervisor
    SIGKILLed at the same moment (what tests/reaper.py does to what a dead run
    left): the server stops all the same."""
    child = subprocess.Popen(
        [sys.executable, "-c", STARTS_A_SERVER],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        assert child.stdout is not None
        said = json.loads(child.stdout.readline())
        port, directory = int(said["port"]), Path(said["directory"])
        assert _answers(port)
        if supervisor_too:
            os.kill(said["supervisor"], signal.SIGKILL)
        os.kill(child.pid, how)
        child.wait()
        pg_server.wait_until("the server to stop", lambda: not _answers(port))
        if not supervisor_too:
            pg_server.wait_until("its directory to go", lambda: not directory.exists())
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()


def test_one_server_serves_the_whole_process(pg: pg_server.PgServer) -> None:
    """Every module that imports the ``pg`` fixture gets this process's one server."""
    assert pg is pg_server.shared_server()
    assert pg_server.shared_server("faults") is pg_server.shared_server("faults")
    assert pg_server.shared_server("faults") != pg
