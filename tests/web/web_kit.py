"""The web tests' parts: a real ``tak serve`` in a subprocess, and the screenshot helper.

A module of its own (``tests.web.web_kit``), not the folder's conftest: a test imports
from here.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import attrs

from tests.cli_kit import die_with_parent

if TYPE_CHECKING:
    from playwright.sync_api import Page

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
        preexec_fn=die_with_parent,  # dies with the test process, even SIGKILLed
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


def screenshot(page: Page, tmp_path: Path, name: str) -> Path:
    """Save the scenario's screenshot under the test's tmp dir (and say where)."""
    path = tmp_path / f"{name}.png"
    page.screenshot(path=str(path), full_page=True)
    print(f"screenshot: {path}")
    return path
