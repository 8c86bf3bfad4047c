from __future__ import annotations

import pytest


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--stress",
        action="store_true",
        default=False,
        help="run stress tests at full size (make stress); default is a bounded version",
    )


@pytest.fixture
def stress(request: pytest.FixtureRequest) -> bool:
    """True under `make stress`: tests scale their rounds up."""
    return bool(request.config.getoption("--stress"))
