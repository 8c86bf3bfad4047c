from __future__ import annotations

import itertools
import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import trio.testing

from tests.entry_points_kit import hide_installed_entry_points
from tests.hang_guard import pytest_configure as hang_guard_configure
from tests.hang_guard import pytest_runtest_protocol as pytest_runtest_protocol
from tests.store import pg_server

#: On PYTHONPATH for every Python the tests start: its sitecustomize hides the
#: installed ``tak.plugins`` entry points there too (tests/entry_points_kit.py).
SITE_HOOKS = Path(__file__).parent / "site_hooks"
REAPER = Path(__file__).parent / "reaper.py"


def pytest_configure(config: pytest.Config) -> None:
    hang_guard_configure(config)
    # No test may touch the real ~/.tak: a test (or a `tak` subprocess) that does not
    # name a home gets this throwaway one.
    os.environ["TAK_HOME"] = tempfile.mkdtemp(prefix="tak-test-home-")
    # Nor see the plugins the user installed into this environment: a test that
    # installs one on purpose sets entry_points_kit.SHOW_INSTALLED_ENV.
    hide_installed_entry_points()
    path = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join([str(SITE_HOOKS), *([path] if path else [])])
    # What the run starts dies with it, however it ends (tests/reaper.py); xdist's
    # workers are the controller's descendants, so only the top process starts one.
    if not hasattr(config, "workerinput"):
        subprocess.Popen(
            [sys.executable, str(REAPER), str(os.getpid())],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            start_new_session=True,  # not in the run's process group: Ctrl-C is not its
        )


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--stress",
        action="store_true",
        default=False,
        help="run stress tests at full size (make stress); default is a bounded version",
    )
    parser.addoption(
        "--interop",
        action="store_true",
        default=False,
        help="run the tests against a real model server (make interop; builds it on first use)",
    )


#: What makes a test id differ between two collections: an object's address in its
#: repr, a tmp_path. pytest-xdist refuses to run when its workers' ids differ.
_UNSTABLE_IDS = re.compile(r" at 0x[0-9a-f]+|pytest-of-")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    unstable = [item.nodeid for item in items if _UNSTABLE_IDS.search(item.nodeid)]
    if unstable:
        raise pytest.UsageError(
            "test ids that differ from one collection to the next (give parametrize ids=): "
            + ", ".join(unstable[:5])
        )
    if config.getoption("--interop"):
        return
    skip = pytest.mark.skip(reason="a real model server: run `make interop`")
    for item in items:
        if "interop" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def stress(request: pytest.FixtureRequest) -> bool:
    """True under `make stress`: tests scale their rounds up."""
    return bool(request.config.getoption("--stress"))


@pytest.fixture
def thread_clock() -> trio.testing.MockClock:
    """Like ``autojump_clock``, but jumps only after 0.25 s of real idleness.

    ``autojump_clock`` jumps as soon as no task is runnable, which includes while a
    sync tool works in a thread: a 30 s deadline would expire before ``a + b`` returns.
    """
    return trio.testing.MockClock(autojump_threshold=0.25)


# -- a real PostgreSQL server (tests/store/pg_server.py), for any folder -------------------
#
# ``pg`` is the process's shared server (``pg_server.shared_server()``): one per test
# process (each xdist worker has its own), started by the first test that asks for it
# and stopped when the process exits (or dies). Each test gets a database of its own
# (``db_url``). ``pg_to_break`` is the process's other server, for the few tests that
# stop, freeze or restart it: it is running again after each.

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
