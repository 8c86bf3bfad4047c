"""A real ``tak serve`` in a subprocess, and Debian's Chromium driven by Playwright's sync API.

Playwright's sync API runs its own event loop and cannot run inside Trio, so
these tests are plain ``def`` tests: the server is a separate process (the way
a person runs it), the browser another. Without Playwright or
``/usr/bin/chromium`` they skip with the reason; nothing is downloaded.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

import pytest

from .web_kit import CHROMIUM, REQUIRE_ENV, Server, start_server

if TYPE_CHECKING:
    from playwright.sync_api import Browser, Page


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """One server for a module's tests (each uses its own sessions)."""
    running = start_server(tmp_path_factory.mktemp("tak-home"))
    yield running
    running.stop()


def _cannot_run(why: str) -> NoReturn:
    """Skip, with the reason; fail instead where the browser tests must run (CI)."""
    if os.environ.get(REQUIRE_ENV):
        pytest.fail(f"{REQUIRE_ENV} is set, but {why}")
    pytest.skip(why)


@pytest.fixture(scope="session")
def browser() -> Iterator[Browser]:
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        _cannot_run("playwright is not installed (pip install -e '.[test]')")
    if not CHROMIUM.exists() or shutil.which(str(CHROMIUM)) is None:
        _cannot_run(f"no Chromium at {CHROMIUM} (apt-get install chromium)")
    with sync_playwright() as playwright:
        launched = playwright.chromium.launch(
            executable_path=str(CHROMIUM), args=["--no-sandbox"], headless=True
        )
        yield launched
        launched.close()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Any:
    report = yield
    if report.when == "call":
        item.stash[_OUTCOME] = report
    return report


_OUTCOME = pytest.StashKey[pytest.TestReport]()


@pytest.fixture
def page(browser: Browser, request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Page]:
    """A fresh page (1200 by 800); on failure a screenshot is saved and its path printed."""
    context = browser.new_context(viewport={"width": 1200, "height": 800})
    opened = context.new_page()
    errors: list[str] = []
    opened.on("pageerror", lambda error: errors.append(str(error)))
    # A violation of the page's Content Security Policy is a console error, not a page error.
    opened.on(
        "console",
        lambda message: (
            errors.append(message.text)
            if message.type == "error" and "Content Security Policy" in message.text
            else None
        ),
    )
    yield opened
    outcome = request.node.stash.get(_OUTCOME, None)
    if outcome is not None and outcome.failed:
        path = tmp_path / "failure.png"
        opened.screenshot(path=str(path), full_page=True)
        print(f"screenshot of the failure: {path}")
        outcome.sections.append(("screenshot", str(path)))
    context.close()
    assert not errors, f"script errors or CSP violations on the page: {errors}"
