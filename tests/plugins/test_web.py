"""The ``web`` built-in plugin against a real HTTP server on 127.0.0.1 (in a thread)."""

from __future__ import annotations

import http.server
import socket
import ssl
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
from builtin_kit import run_calls, tool_context

from kernel.tools import ToolFailure
from plugins import web

PAGE = b"""<!doctype html>
<html><head><title>The  Page</title><style>body { color: red }</style>
<script>alert("no")</script></head>
<body>
<h1>Welcome</h1>
<p>First   paragraph with a <a href="/next">link text</a>.</p>
<p>Second<br>line</p>
<ul><li>one</li><li>two</li></ul>
<pre>  keep
    this</pre>
<noscript>hidden</noscript>
<h2>End &amp; more</h2>
</body></html>
"""


class Handler(http.server.BaseHTTPRequestHandler):
    def log_message(self, format: str, *args: object) -> None:
        pass

    def send_body(
        self, status: int, body: bytes, content_type: str, *, length: bool = True
    ) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        if length:
            self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def redirect(self, location: str) -> None:
        self.send_response(302)
        self.send_header("Location", location)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def do_GET(self) -> None:
        port = self.server.server_address[1]
        routes: dict[str, Callable[[], None]] = {
            "/page": lambda: self.send_body(200, PAGE, "text/html; charset=utf-8"),
            "/plain": lambda: self.send_body(
                200, "plain text ✓\n".encode(), "text/plain; charset=utf-8"
            ),
            "/json": lambda: self.send_body(200, b'{"a": 1}', "application/json"),
            "/image": lambda: self.send_body(200, b"\x89PNG\r\n\x1a\n\x00\x00", "image/png"),
            "/redirect-ok": lambda: self.redirect("/plain"),
            "/redirect-away": lambda: self.redirect(f"http://localhost:{port}/plain"),
            "/redirect-file": lambda: self.redirect("file:///etc/passwd"),
            "/loop": lambda: self.redirect("/loop"),
            "/missing": lambda: self.send_body(404, b"<h1>No such page</h1>", "text/html"),
            "/error": lambda: self.send_body(500, b"database exploded", "text/plain"),
            "/big": lambda: self.send_body(200, b"x" * 300_000, "text/plain"),
            "/big-unannounced": lambda: self.send_body(
                200, b"y" * 300_000, "text/plain", length=False
            ),
            "/slow": self.slow,
            "/trickle": self.trickle,
        }
        routes.get(self.path, lambda: self.send_body(404, b"", "text/plain"))()

    def slow(self) -> None:
        time.sleep(1.5)
        self.send_body(200, b"late", "text/plain")

    def trickle(self) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "text/plain")
        self.end_headers()
        for _ in range(30):
            self.wfile.write(b"drip\n")
            self.wfile.flush()
            time.sleep(0.1)


@pytest.fixture(scope="module")
def server() -> Iterator[str]:
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    httpd.daemon_threads = True
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}"
    finally:
        httpd.shutdown()
        httpd.server_close()


@pytest.fixture
def ws(tmp_path: Path) -> Iterator[Path]:
    with tool_context(tmp_path, {"allow_hosts": ["127.0.0.1"]}):
        yield tmp_path


def test_html_becomes_readable_text(ws: Path, server: str) -> None:
    out = web.fetch_url.fn(f"{server}/page")
    assert out == (
        f"URL: {server}/page\n"
        "Status: 200 OK\n"
        "Content-Type: text/html; charset=utf-8\n"
        "\n"
        "Title: The Page\n\n"
        "# Welcome\n\n"
        "First paragraph with a link text.\n\n"
        "Second\n\nline\n\n"
        "- one\n\n- two\n\n"
        "  keep\n    this\n\n"
        "## End & more"
    )


def test_plain_json_and_binary(ws: Path, server: str) -> None:
    assert web.fetch_url.fn(f"{server}/plain").endswith(
        "Content-Type: text/plain; charset=utf-8\n\nplain text ✓\n"
    )
    assert web.fetch_url.fn(f"{server}/json").endswith('\n\n{"a": 1}')
    assert web.fetch_url.fn(f"{server}/image").endswith(
        "Content-Type: image/png\n\n[binary content: 10 bytes of image/png, not shown]"
    )


def test_redirects_are_followed_and_rechecked(ws: Path, server: str) -> None:
    out = web.fetch_url.fn(f"{server}/redirect-ok")
    assert out.startswith(f"URL: {server}/plain\nRedirected from: {server}/redirect-ok\n")
    with pytest.raises(ToolFailure) as info:
        web.fetch_url.fn(f"{server}/redirect-away")
    assert info.value.kind == "denied"
    port = server.rpartition(":")[2]
    assert info.value.message.startswith(
        f"fetching http://localhost:{port}/plain is not allowed: localhost:{port} is not in "
        "allow_hosts (127.0.0.1)"
    )
    with pytest.raises(ToolFailure, match="only http and https URLs can be fetched") as info:
        web.fetch_url.fn(f"{server}/redirect-file")
    assert info.value.kind == "denied"
    with pytest.raises(
        web.TooManyRedirects, match=f"more than 5 redirects, starting at {server}/loop"
    ):
        web.fetch_url.fn(f"{server}/loop")


def test_error_statuses_say_which(ws: Path, server: str) -> None:
    with pytest.raises(
        web.HTTPStatusError, match=f"^HTTP 404 Not Found from {server}/missing: # No such page$"
    ):
        web.fetch_url.fn(f"{server}/missing")
    with pytest.raises(
        web.HTTPStatusError,
        match=f"^HTTP 500 Internal Server Error from {server}/error: database exploded$",
    ):
        web.fetch_url.fn(f"{server}/error")


def test_size_cap(ws: Path, server: str) -> None:
    with pytest.raises(
        web.ResponseTooLarge, match="the body is 300000 bytes, more than max_bytes=100000"
    ):
        web.fetch_url.fn(f"{server}/big", max_bytes=100_000)
    with pytest.raises(
        web.ResponseTooLarge, match="more than max_bytes=100000 bytes; stopped reading"
    ):
        web.fetch_url.fn(f"{server}/big-unannounced", max_bytes=100_000)
    assert web.fetch_url.fn(f"{server}/big").endswith("x" * 1000)


def test_deadlines(ws: Path, server: str) -> None:
    # /slow answers after 1.5 s and /trickle drips for longer: a deadline that did not
    # hold would give their bodies, not these failures.
    with pytest.raises(
        ToolFailure, match=f"fetching {server}/slow did not finish within 0.4 s"
    ) as info:
        web.fetch_url.fn(f"{server}/slow", timeout=0.4)
    assert info.value.kind == "timeout"
    with pytest.raises(ToolFailure, match=r"did not finish within 0.4 s") as info:
        web.fetch_url.fn(f"{server}/trickle", timeout=0.4)
    assert info.value.kind == "timeout"


def test_connection_refused(ws: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(web.ConnectionFailed, match=f"^connection to 127.0.0.1:{port} refused$"):
        web.fetch_url.fn(f"http://127.0.0.1:{port}/")


def test_allow_list(tmp_path: Path, server: str) -> None:
    with tool_context(tmp_path, {}), pytest.raises(ToolFailure) as info:
        web.fetch_url.fn(f"{server}/plain")
    assert info.value.kind == "denied"
    assert "no host is allowed yet. Add the host to allow_hosts in the [plugins.web] section" in (
        info.value.message
    )
    assert 'allow_hosts = ["127.0.0.1"]' in info.value.message
    with (
        tool_context(tmp_path, {"allow_hosts": ["127.0.0.1"]}),
        pytest.raises(ToolFailure, match="only http and https"),
    ):
        web.fetch_url.fn("ftp://127.0.0.1/x")
    assert web.host_allowed(["*.example.org"], "docs.example.org", 443)
    assert web.host_allowed(["*.example.org"], "a.b.EXAMPLE.org.", 443)
    assert not web.host_allowed(["*.example.org"], "example.org", 443)
    assert not web.host_allowed(["*.example.org"], "badexample.org", 443)
    assert web.host_allowed(["example.org:8080"], "example.org", 8080)
    assert not web.host_allowed(["example.org:8080"], "example.org", 443)
    assert web.host_allowed(["[::1]:8080"], "::1", 8080)


def _failing(cause: BaseException) -> httpx.MockTransport:
    def handler(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError(str(cause), request=request) from cause

    return httpx.MockTransport(handler)


def test_dns_and_tls_errors_say_which() -> None:
    gai = socket.gaierror(socket.EAI_NONAME, "Name or service not known")
    with pytest.raises(web.DNSError, match=r"^nowhere.example: the host name does not resolve"):
        web.fetch(
            "https://nowhere.example/", allow_hosts=["nowhere.example"], transport=_failing(gai)
        )
    tls = ssl.SSLCertVerificationError(1, "certificate verify failed: self-signed certificate")
    with pytest.raises(web.TLSError, match=r"^TLS error talking to self.example: .*self-signed"):
        web.fetch("https://self.example/", allow_hosts=["self.example"], transport=_failing(tls))


async def test_web_through_the_executor(ws: Path, server: str) -> None:
    page, missing, away, slow = await run_calls(
        web.plugin,
        [
            ("fetch_url", {"url": f"{server}/plain"}),
            ("fetch_url", {"url": f"{server}/missing"}),
            ("fetch_url", {"url": "http://example.org/"}),
            ("fetch_url", {"url": f"{server}/slow", "timeout": 0.3}),
        ],
    )
    assert not page.is_error and page.content.endswith("plain text ✓\n")
    assert missing.error is not None and missing.error.kind == "exception"
    assert missing.error.type == "HTTPStatusError"
    assert (
        missing.content
        == f"Error (exception): HTTP 404 Not Found from {server}/missing: # No such page"
    )
    assert away.error is not None and away.error.kind == "denied"
    assert away.error.type == "HostNotAllowed"
    assert slow.error is not None and slow.error.kind == "timeout"


def test_web_permissions() -> None:
    assert web.plugin.permissions.network == ("*:80", "*:443")
    assert not web.plugin.permissions.subprocess
