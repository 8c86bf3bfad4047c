"""The built-in plugins that run in sandbox workers work there, confined (not only in process)."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from kernel.testing import plugin_harness


async def test_shell_runs_commands_in_a_worker(tmp_path: Path) -> None:
    (tmp_path / "hello.txt").write_text("hi there\n")
    async with plugin_harness("plugins.shell", tmp_path) as h:
        assert h.plugin.isolation != "unconfined"
        shell_string = await h.call("run_command", {"command": "cat hello.txt; echo done"})
        argv = await h.call("run_command", {"command": ["/bin/echo", "argv", "form"]})
        failing = await h.call("run_command", {"command": "exit 3"})
        escape = await h.call("run_command", {"command": "cat /etc/passwd"})
    assert shell_string.error is None, shell_string.content
    assert "hi there" in shell_string.content and "done" in shell_string.content
    assert "argv form" in argv.content
    assert failing.error is None and "exit code 3" in failing.content
    assert "root:" not in escape.content  # Landlock: nothing outside the workspace


async def test_python_runs_snippets_in_a_worker(tmp_path: Path) -> None:
    async with plugin_harness("plugins.python", tmp_path) as h:
        result = await h.call("run_python", {"code": "print('out')\n6 * 7"})
        boom = await h.call("run_python", {"code": "1 / 0"})
        outside = await h.call("run_python", {"code": "open('/etc/passwd').read()"})
    assert result.error is None, result.content
    assert "out" in result.content and "42" in result.content
    assert "ZeroDivisionError" in boom.content
    assert "root:" not in outside.content and "PermissionError" in outside.content


async def test_notes_in_a_worker(tmp_path: Path) -> None:
    async with plugin_harness("plugins.notes", tmp_path) as h:
        first = await h.call("remember", {"text": "trio nurseries scope tasks", "tags": ["trio"]})
        await h.call("remember", {"text": "landlock confines files"})
        found = await h.call("recall", {"query": "nurseries"})
    assert first.error is None, first.content
    assert "trio nurseries" in found.content and "landlock" not in found.content
    assert (tmp_path / ".notes" / "notes.sqlite3").is_file()


@pytest.fixture
def page_server() -> Iterator[str]:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = b"<html><body><h1>Hello</h1><p>from the page</p></body></html>"
            self.send_response(200)
            self.send_header("Content-Type", "text/html")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


async def test_web_fetches_an_allowed_local_page_in_a_worker(
    tmp_path: Path, page_server: str
) -> None:
    config = {"allow_hosts": [page_server]}
    async with plugin_harness("plugins.web", tmp_path, config=config) as h:
        page = await h.call("fetch_url", {"url": f"http://{page_server}/"})
        refused = await h.call("fetch_url", {"url": "http://example.org/"})
    assert page.error is None, page.content
    assert "# Hello" in page.content and "from the page" in page.content
    assert refused.error is not None and refused.error.kind == "denied"
