"""The ``web`` built-in plugin: fetch a URL from an allow-listed host, as readable text.

Configuration (``[plugins.web]`` in ``tak.toml``, seen as ``context().config``)::

    [plugins.web]
    allow_hosts = ["docs.python.org", "*.example.org", "127.0.0.1:8000"]

An entry is an exact host name or address, or ``*.suffix`` for any subdomain of
``suffix`` (not ``suffix`` itself); ``host:port`` limits it to one port. With no
entries nothing may be fetched. Every redirect target is checked against the
list again. The list is of host *names*: where a name resolves to is not
checked, so list only hosts you trust.

Permissions: the plugin declares ``network: ["*:80", "*:443"]``. Ports named
in ``allow_hosts`` cannot be known when this module is imported; the plugin
host adds them to the worker's network permissions from the configuration.

Errors. Each failure is an observation whose message says which (``FetchError`` is
drawn in the project's tree too, ``kernel.errors``)::

    ToolFailure "denied"  (HostNotAllowed)   host not in allow_hosts, or a non-http(s) URL
    ToolFailure "timeout" (FetchTimeout)     the request's deadline passed
    FetchError                               any other failure to fetch:
     ├── DNSError                            the host name does not resolve
     ├── TLSError                            TLS handshake or certificate failure
     ├── ConnectionFailed                    refused, reset, unreachable
     ├── HTTPStatusError                     a 4xx or 5xx response (its start is shown)
     ├── TooManyRedirects
     └── ResponseTooLarge                    more than ``max_bytes``
"""

from __future__ import annotations

import html.parser
import re
import socket
import ssl
import time
from collections.abc import Mapping, Sequence
from typing import Any

import httpx

from kernel.errors import KernelError
from kernel.plugin import Plugin, context
from kernel.tools import ToolFailure

__all__ = [
    "MAX_REDIRECTS",
    "ConnectionFailed",
    "DNSError",
    "FetchError",
    "HTTPStatusError",
    "ResponseTooLarge",
    "TLSError",
    "TooManyRedirects",
    "fetch",
    "fetch_url",
    "host_allowed",
    "plugin",
]

plugin = Plugin(
    "web",
    version="0.1.0",
    description="Fetch web pages from allow-listed hosts as readable text.",
    permissions={"network": ["*:80", "*:443"]},
)

DEFAULT_MAX_BYTES = 2_000_000
#: The largest ``max_bytes`` a call may ask for.
MAX_BYTES_LIMIT = 20_000_000
MAX_REDIRECTS = 5
MAX_TIMEOUT = 120.0
#: Characters of an error response's body shown in the error.
_ERROR_BODY_CHARS = 500


class FetchError(KernelError):
    """A URL could not be fetched; the subclass says why."""


class DNSError(FetchError):
    """The host name does not resolve."""


class TLSError(FetchError):
    """The TLS handshake failed (certificate, protocol)."""


class ConnectionFailed(FetchError):
    """The connection was refused, reset or could not be made."""


class HTTPStatusError(FetchError):
    """The server answered with a 4xx or 5xx status."""


class TooManyRedirects(FetchError):
    """More redirects than ``MAX_REDIRECTS``."""


class ResponseTooLarge(FetchError):
    """The body is larger than the call's ``max_bytes``."""


# --- the allow-list ----------------------------------------------------------------


def _split_entry(entry: str) -> tuple[str, int | None]:
    """``host``, ``host:port``, ``[v6]`` or ``[v6]:port`` as (host, port or None)."""
    entry = entry.strip().lower()
    if entry.startswith("["):
        host, _, rest = entry[1:].partition("]")
        port = rest[1:] if rest.startswith(":") else ""
    elif entry.count(":") == 1:
        host, _, port = entry.partition(":")
    else:
        host, port = entry, ""
    if port and not port.isdigit():
        raise ValueError(f"allow_hosts entry {entry!r}: the port must be a number")
    return host.rstrip("."), int(port) if port else None


def host_allowed(allow_hosts: Sequence[str], host: str, port: int) -> bool:
    """Whether ``host:port`` matches an entry (exact host, or ``*.suffix`` for subdomains)."""
    host = host.lower().rstrip(".")
    for entry in allow_hosts:
        pattern, allowed_port = _split_entry(entry)
        if allowed_port is not None and allowed_port != port:
            continue
        if pattern.startswith("*."):
            if host.endswith(pattern[1:]) and len(host) > len(pattern) - 1:
                return True
        elif host == pattern:
            return True
    return False


def _allow_list(config: Mapping[str, Any]) -> list[str]:
    value = config.get("allow_hosts", [])
    if isinstance(value, str) or not all(isinstance(v, str) for v in value):
        raise ValueError(f"[plugins.web] allow_hosts must be a list of host names, got {value!r}")
    return list(value)


def _check_url(url: httpx.URL, allow_hosts: Sequence[str]) -> None:
    if url.scheme not in ("http", "https"):
        raise ToolFailure(
            "denied", f"{url}: only http and https URLs can be fetched", type="HostNotAllowed"
        )
    if not url.host:
        raise ToolFailure("denied", f"{url}: the URL has no host", type="HostNotAllowed")
    port = url.port or (443 if url.scheme == "https" else 80)
    if host_allowed(allow_hosts, url.host, port):
        return
    if not allow_hosts:
        message = (
            f"fetching {url} is not allowed: no host is allowed yet. Add the host to "
            'allow_hosts in the [plugins.web] section of tak.toml, e.g. allow_hosts = ["'
            f'{url.host}"]'
        )
    else:
        message = (
            f"fetching {url} is not allowed: {url.host}:{port} is not in allow_hosts "
            f"({', '.join(allow_hosts)}); add it to [plugins.web] allow_hosts in tak.toml"
        )
    raise ToolFailure("denied", message, type="HostNotAllowed")


# --- HTML to text ------------------------------------------------------------------

_SKIPPED = frozenset({"script", "style", "noscript", "template", "svg", "head", "iframe"})
_BLOCKS = frozenset(
    {
        "p", "div", "section", "article", "main", "header", "footer", "nav", "aside",
        "blockquote", "ul", "ol", "dl", "dt", "dd", "table", "tr", "form", "fieldset",
        "figure", "figcaption", "hr", "address", "details", "summary",
    }
)  # fmt: skip
_HEADINGS = {f"h{n}": n for n in range(1, 7)}
_VOID = frozenset({"br", "hr", "img", "input", "meta", "link", "area", "base", "col", "wbr"})


class _TextExtractor(html.parser.HTMLParser):
    """Readable text from HTML: headings marked, paragraphs apart, link text kept."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.blocks: list[str] = []
        self.current: list[str] = []
        self.skipping = 0
        self.pre = 0
        self.title: list[str] = []
        self.in_title = False
        self.prefix = ""

    def flush(self) -> None:
        raw = "".join(self.current)
        text = raw.strip("\n") if self.pre else re.sub(r"\s+", " ", raw).strip()
        if text:
            self.blocks.append(self.prefix + text)
        self.current = []
        self.prefix = ""

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag == "title":
            self.in_title = True
        if tag in _SKIPPED:
            if tag not in _VOID:
                self.skipping += 1
            return
        if self.skipping:
            return
        if tag in _BLOCKS or tag in _HEADINGS or tag in ("li", "pre"):
            self.flush()
        if tag in _HEADINGS:
            self.prefix = "#" * _HEADINGS[tag] + " "
        elif tag == "li":
            self.prefix = "- "
        elif tag == "pre":
            self.pre += 1
        elif tag == "br":
            self.current.append("\n" if self.pre else " ")
            if not self.pre:
                self.flush()
        elif tag in ("td", "th"):
            self.current.append(" ")

    def handle_endtag(self, tag: str) -> None:
        if tag == "title":
            self.in_title = False
        if tag in _SKIPPED:
            self.skipping = max(self.skipping - 1, 0)
            return
        if self.skipping:
            return
        if tag == "pre":
            self.flush()
            self.pre = max(self.pre - 1, 0)
        elif tag in _BLOCKS or tag in _HEADINGS or tag == "li":
            self.flush()

    def handle_data(self, data: str) -> None:
        if self.in_title:
            self.title.append(data)
        if not self.skipping:
            self.current.append(data)

    def text(self) -> str:
        self.flush()
        return "\n\n".join(self.blocks)


def html_to_text(markup: str) -> str:
    """Readable text of an HTML document (stdlib ``html.parser``; scripts and styles dropped)."""
    parser = _TextExtractor()
    parser.feed(markup)
    parser.close()
    body = parser.text()
    title = re.sub(r"\s+", " ", "".join(parser.title)).strip()
    return f"Title: {title}\n\n{body}" if title else body


# --- fetching ----------------------------------------------------------------------

_TEXT_TYPES = ("application/json", "application/xml", "application/javascript")


def _is_html(content_type: str) -> bool:
    return content_type in ("text/html", "application/xhtml+xml")


def _is_text(content_type: str) -> bool:
    return (
        content_type.startswith("text/")
        or content_type in _TEXT_TYPES
        or content_type.endswith(("+json", "+xml"))
    )


def _root_cause(exc: BaseException) -> BaseException:
    """The innermost exception (httpx wraps the socket or ssl error)."""
    seen: set[int] = set()
    while id(exc) not in seen:
        seen.add(id(exc))
        inner = exc.__cause__ or exc.__context__
        if inner is None:
            break
        exc = inner
    return exc


def _classify(exc: httpx.TransportError, url: httpx.URL) -> FetchError:
    cause = _root_cause(exc)
    host = url.host
    if isinstance(cause, socket.gaierror):
        return DNSError(f"{host}: the host name does not resolve ({cause.strerror or cause})")
    if isinstance(cause, ssl.SSLError):
        return TLSError(f"TLS error talking to {host}: {cause}")
    if isinstance(cause, ConnectionRefusedError):
        port = url.port or (443 if url.scheme == "https" else 80)
        return ConnectionFailed(f"connection to {host}:{port} refused")
    return ConnectionFailed(f"could not fetch {url}: {type(cause).__name__}: {cause}")


def _deadline_exceeded(url: httpx.URL, timeout: float) -> ToolFailure:
    return ToolFailure(
        "timeout", f"fetching {url} did not finish within {timeout:g} s", type="FetchTimeout"
    )


def _read_body(response: httpx.Response, max_bytes: int, deadline: float, timeout: float) -> bytes:
    declared = response.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > max_bytes:
        raise ResponseTooLarge(
            f"{response.url}: the body is {int(declared)} bytes, more than max_bytes="
            f"{max_bytes} (a call may ask for up to {MAX_BYTES_LIMIT})"
        )
    chunks: list[bytes] = []
    size = 0
    for chunk in response.iter_bytes():
        size += len(chunk)
        if size > max_bytes:
            raise ResponseTooLarge(
                f"{response.url}: the body is more than max_bytes={max_bytes} bytes; stopped "
                f"reading (a call may ask for up to {MAX_BYTES_LIMIT})"
            )
        chunks.append(chunk)
        # httpx's timeouts are per operation; a server trickling bytes still ends here.
        if time.monotonic() > deadline:
            raise _deadline_exceeded(response.url, timeout)
    return b"".join(chunks)


def _render(response: httpx.Response, body: bytes, redirects: list[str]) -> str:
    content_type = response.headers.get("content-type", "")
    media_type = content_type.partition(";")[0].strip().lower()
    lines = [f"URL: {response.url}"]
    if redirects:
        lines.append(f"Redirected from: {' -> '.join(redirects)}")
    lines.append(f"Status: {response.status_code} {response.reason_phrase}".rstrip())
    lines.append(f"Content-Type: {content_type or '(none)'}")
    if media_type and not _is_text(media_type) and not _is_html(media_type):
        lines.append(f"\n[binary content: {len(body)} bytes of {media_type}, not shown]")
        return "\n".join(lines)
    text = body.decode(response.charset_encoding or "utf-8", errors="replace")
    if _is_html(media_type) or (not media_type and "<html" in text[:1000].lower()):
        text = html_to_text(text)
    return "\n".join(lines) + "\n\n" + text


def _status_error(response: httpx.Response, body: bytes) -> HTTPStatusError:
    text = body.decode(response.charset_encoding or "utf-8", errors="replace")
    media_type = response.headers.get("content-type", "").partition(";")[0].strip().lower()
    if _is_html(media_type):
        text = html_to_text(text)
    text = re.sub(r"\s+", " ", text).strip()
    if len(text) > _ERROR_BODY_CHARS:
        text = text[:_ERROR_BODY_CHARS] + "…"
    shown = f": {text}" if text else ""
    return HTTPStatusError(
        f"HTTP {response.status_code} {response.reason_phrase} from {response.url}{shown}"
    )


def fetch(
    url: str,
    *,
    allow_hosts: Sequence[str],
    max_bytes: int = DEFAULT_MAX_BYTES,
    timeout: float = 30.0,
    transport: httpx.BaseTransport | None = None,
) -> str:
    """What ``fetch_url`` returns; ``transport`` is the seam for tests and embedders.

    Raises:
        ToolFailure: ``denied`` for a host not allowed, ``timeout`` past the deadline.
        FetchError: any other failure, the subclass says which.
    """
    deadline = time.monotonic() + timeout
    current = httpx.URL(url)
    redirects: list[str] = []
    # trust_env=False: no proxies or .netrc from the environment decide where requests go.
    with httpx.Client(
        follow_redirects=False, trust_env=False, transport=transport, timeout=timeout
    ) as client:
        while True:
            _check_url(current, allow_hosts)
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise _deadline_exceeded(current, timeout)
            request = client.build_request(
                "GET",
                current,
                # identity: max_bytes then bounds what is decoded too (no gzip bombs).
                headers={"User-Agent": "tak-web/0.1", "Accept-Encoding": "identity"},
                timeout=httpx.Timeout(remaining),
            )
            try:
                response = client.send(request, stream=True)
                try:
                    if response.is_redirect and response.next_request is not None:
                        redirects.append(str(current))
                        if len(redirects) > MAX_REDIRECTS:
                            raise TooManyRedirects(
                                f"more than {MAX_REDIRECTS} redirects, starting at {redirects[0]}"
                            )
                        current = response.next_request.url
                        continue
                    body = _read_body(response, max_bytes, deadline, timeout)
                finally:
                    response.close()
            except httpx.TimeoutException:
                raise _deadline_exceeded(current, timeout) from None
            except httpx.UnsupportedProtocol as exc:
                # Raised while building a redirect to a scheme other than http(s).
                raise ToolFailure(
                    "denied",
                    f"{current} redirects to a URL that is not http or https: {exc}",
                    type="HostNotAllowed",
                ) from None
            except httpx.TransportError as exc:
                raise _classify(exc, current) from exc
            if response.status_code >= 400:
                raise _status_error(response, body)
            return _render(response, body, redirects)


@plugin.tool(timeout=MAX_TIMEOUT + 10)
def fetch_url(url: str, max_bytes: int = DEFAULT_MAX_BYTES, timeout: float = 30.0) -> str:
    """Fetch an http(s) URL and return its content as text (HTML is converted to plain text).

    Only hosts listed in the ``[plugins.web] allow_hosts`` setting can be fetched;
    redirects (at most 5) are checked against the same list. The answer starts
    with the final URL, status and content type.

    Args:
        url: The http or https URL to fetch.
        max_bytes: Largest body accepted, in bytes (at most 20 000 000).
        timeout: Seconds for the whole fetch, redirects included (at most 120).
    """
    if not 0 < max_bytes <= MAX_BYTES_LIMIT:
        raise ValueError(f"max_bytes must be more than 0 and at most {MAX_BYTES_LIMIT}")
    if not 0 < timeout <= MAX_TIMEOUT:
        raise ValueError(f"timeout must be more than 0 and at most {MAX_TIMEOUT:g} s")
    try:
        parsed = httpx.URL(url)
    except httpx.InvalidURL as exc:
        raise ValueError(f"invalid URL {url!r}: {exc}") from None
    allow_hosts = _allow_list(context().config)
    return fetch(str(parsed), allow_hosts=allow_hosts, max_bytes=max_bytes, timeout=timeout)
