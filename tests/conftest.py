from __future__ import annotations

import os
import tempfile

import pytest
import trio.testing


def pytest_configure(config: pytest.Config) -> None:
    # No test may touch the real ~/.tak: a test (or a `tak` subprocess) that does not
    # name a home gets this throwaway one.
    os.environ["TAK_HOME"] = tempfile.mkdtemp(prefix="tak-test-home-")


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


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
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
