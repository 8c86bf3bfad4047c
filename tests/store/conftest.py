"""A real PostgreSQL server for the store tests: one per test process (pg_server.py).

``pg`` is the process's shared server (``pg_server.shared_server()``), however
many modules import the fixture: every module that imports it gets a fixture
of its own, and all of them return the same server, stopped when the process
exits (or dies). Each test gets a database of its own (``db_url``).

``pg_to_break`` is the process's other server, for the few tests that stop,
freeze or restart it: it is running again after each.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Iterator

import pytest

from . import pg_server

# The pid in the names: databases of two processes never collide (xdist workers
# have servers of their own anyway).
_databases = itertools.count()


@pytest.fixture(scope="session")
def pg() -> pg_server.PgServer:
    reason = pg_server.unavailable_reason()
    if reason is not None:
        pytest.skip(reason)
    return pg_server.shared_server()


@pytest.fixture
def db_url(pg: pg_server.PgServer) -> str:
    """A new, empty database for each test."""
    return pg_server.create_database(pg, f"t{os.getpid()}_{next(_databases)}")


@pytest.fixture
def pg_to_break() -> Iterator[pg_server.PgServer]:
    """A server of its own (shared by the tests that break theirs), running again after."""
    reason = pg_server.unavailable_reason()
    if reason is not None:
        pytest.skip(reason)
    server = pg_server.shared_server("faults")
    pg_server.revive(server)
    try:
        yield server
    finally:
        pg_server.revive(server)
