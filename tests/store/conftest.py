"""A real PostgreSQL server for the store tests, started once per run (pg_server.py)."""

from __future__ import annotations

import itertools
from collections.abc import Iterator

import pytest

from . import pg_server

_databases = itertools.count()


@pytest.fixture(scope="session")
def pg() -> Iterator[pg_server.PgServer]:
    reason = pg_server.unavailable_reason()
    if reason is not None:
        pytest.skip(reason)
    with pg_server.running_server() as server:
        yield server


@pytest.fixture
def db_url(pg: pg_server.PgServer) -> str:
    """A new, empty database for each test."""
    return pg_server.create_database(pg, f"t{next(_databases)}")
