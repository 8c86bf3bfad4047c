"""A real ``tak serve`` in a subprocess, and Debian's Chromium driven by Playwright's sync API.

Playwright's sync API runs its own event loop and cannot run inside Trio, so
these tests are plain ``def`` tests: the server is a separate process (the way
a person runs it), the browser another. Without Playwright or
``/usr/bin/chromium`` they skip with the reason; nothing is downloaded.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

import attrs
import pytest

if TYPE_CHECKING:
    from playwright.sync_api import Browser, Page

CHROMIUM = Path("/usr/bin/chromium")
#: Set to a path, the parallel-calls test saves its screenshot there (docs/web-screenshot.png).
SCREENSHOT_ENV = "TAK_WEB_SCREENSHOT"
#: Set (to anything), a missing Playwright or Chromium fails the browser tests instead of
#: skipping them: for CI, which must run them.
REQUIRE_ENV = "TAK_WEB_REQUIRED"


@attrs.frozen
class Server:
    """A running ``tak serve``: its two printed URLs and its process."""

    ws_url: str
    page_url: str
    process: subprocess.Popen[str]
    home: Path

    @property
    def token(self) -> str:
        return self.page_url.partition("?token=")[2]

    @property
    def origin(self) -> str:
        return self.page_url.partition("/?")[0]

    @property
    def port(self) -> int:
        return int(self.origin.rpartition(":")[2])

    def stop(self) -> None:
        self.process.send_signal(signal.SIGTERM)
        self.process.wait(timeout=30)
        assert self.process.stdout is not None
        self.process.stdout.close()


def start_server(home: Path, *args: str) -> Server:
    """``tak --plugin demo serve --port 0 ARGS`` with its home in ``home``, once it has printed."""
    home.mkdir(parents=True, exist_ok=True)
    log = (home / "serve.log").open("a")
    process = subprocess.Popen(
        [sys.executable, "-m", "kernel.cli", "--plugin", "demo", "serve", "--port", "0", *args],
        stdout=subprocess.PIPE,
        stderr=log,
        text=True,
        env={**os.environ, "TAK_HOME": str(home)},
    )
    log.close()
    assert process.stdout is not None
    ws_url = process.stdout.readline().strip()
    page_url = process.stdout.readline().strip()
    if not page_url.startswith("http://"):
        process.kill()
        process.wait()
        raise AssertionError(
            f"tak serve printed {ws_url!r}, {page_url!r}; log:\n{(home / 'serve.log').read_text()}"
        )
    return Server(ws_url, page_url, process, home)


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


def screenshot(page: Page, tmp_path: Path, name: str) -> Path:
    """Save the scenario's screenshot under the test's tmp dir (and say where)."""
    path = tmp_path / f"{name}.png"
    page.screenshot(path=str(path), full_page=True)
    print(f"screenshot: {path}")
    return path
