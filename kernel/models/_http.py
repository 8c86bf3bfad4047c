"""What the three HTTP adapters share: sending, errors, retries, and the stream's life.

A stream is opened inside the retry loop and read there until its first
event: a refused request, a dropped connection or an error event before
that point is retried like any other failure. From the first event on, the
caller owns what it has seen, so a failure is raised, never retried (a
retry would repeat text the caller already showed). Leaving the ``stream``
block, normally or by cancellation, closes the HTTP response at once.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import ipaddress
import json
from collections import deque
from collections.abc import (
    AsyncGenerator,
    AsyncIterator,
    Iterable,
    Iterator,
    Mapping,
    Sequence,
)
from typing import Any, ClassVar, Protocol

import httpx
import trio

from ..errors import UsageError
from ..settings import ModelSettings
from ..tools import ToolDefinition
from ._assemble import events_of
from ._base import ModelEvent, ModelRequest, ModelResponse, ProviderError, ResponseComplete
from ._budget import Grant, ModelBudget, estimate_tokens
from ._prices import Price
from ._retry import RETRYABLE_STATUSES, RetryPolicy, parse_retry_after, says_malformed_output
from ._sse import SSEDecoder, SSEEvent

# Closing a response must finish even when the caller was cancelled; this
# bounds how long a dead connection can hold the shielded close.
_CLOSE_TIMEOUT = 5.0
# After the final event a server ends the body at once; reading to its end
# lets httpx keep the connection for the next request.
_DRAIN_TIMEOUT = 1.0
_MAX_ERROR_TEXT = 2000
# An error event inside a stream (after the HTTP 200) that means what these
# statuses mean: the budget is told, as of a refused request.
_IN_BAND_STATUS: Mapping[str, int] = {
    "overloaded_error": 529,  # Anthropic
    "rate_limit_error": 429,  # Anthropic
    "rate_limit_exceeded": 429,  # OpenAI
    "RESOURCE_EXHAUSTED": 429,  # Gemini
    "UNAVAILABLE": 503,  # Gemini
}


@contextlib.asynccontextmanager
async def open_http_client() -> AsyncIterator[httpx.AsyncClient]:
    """One ``httpx.AsyncClient`` for every model of a program, with timeouts fit for them.

    The read timeout is generous (a model may think for minutes before its
    first byte); deadlines for a whole turn belong in the caller's cancel
    scopes.
    """
    timeout = httpx.Timeout(connect=15.0, read=300.0, write=60.0, pool=60.0)
    async with httpx.AsyncClient(timeout=timeout, follow_redirects=False) as client:
        yield client


class StreamDecoder(Protocol):
    """Turns one provider's server-sent events into ``ModelEvent``s."""

    done: bool

    def feed(self, event: SSEEvent) -> list[ModelEvent]:
        """Events for one SSE event. Raises ``ProviderError`` for an error event."""
        ...

    def response(self) -> ModelResponse: ...


def load_json(provider: str, text: str | bytes) -> Any:
    try:
        return json.loads(text)
    except ValueError as exc:
        shown = text if isinstance(text, str) else text.decode("utf-8", "replace")
        raise ProviderError(
            provider, f"not JSON: {shown[:200]!r}", error_type="bad_response"
        ) from exc


@contextlib.contextmanager
def response_shape(provider: str) -> Iterator[None]:
    """Turn a provider's answer of an unexpected shape into a ``ProviderError``."""
    try:
        yield
    except (KeyError, IndexError, TypeError, AttributeError, ValueError) as exc:
        raise ProviderError(
            provider,
            f"unexpected response: {type(exc).__name__}: {exc}",
            error_type="bad_response",
        ) from exc


def refuse_settings(provider: str, settings: ModelSettings, names: Sequence[str]) -> None:
    """Refuse, before sending, the set fields among ``names`` the provider cannot express.

    Raises:
        UsageError: one line naming the provider and the fields.
    """
    unset = [n for n in names if getattr(settings, n) is not None]
    if unset:
        raise UsageError(
            f"{provider}: {', '.join(unset)} cannot be expressed by this provider; "
            "leave it unset (or send the provider's own key in settings.extra)"
        )


class HTTPModel:
    """Base of the provider adapters. Subclasses say how requests and answers look."""

    provider: ClassVar[str]
    #: Where the provider's API lives unless ``base_url`` says otherwise.
    default_base_url: ClassVar[str]

    @staticmethod
    def tool_specs(definitions: Iterable[ToolDefinition]) -> list[dict[str, Any]]:
        """The ``tools`` of a request, made from the tools' definitions (what the
        adapter sends, and what ``tak tools --format PROVIDER`` prints)."""
        raise NotImplementedError

    def __init__(
        self,
        model: str,
        *,
        client: httpx.AsyncClient,
        api_key: str | None = None,
        base_url: str | None = None,
        retry: RetryPolicy | None = None,
        prices: Mapping[str, Price] | None = None,
        budget: ModelBudget | None = None,
    ) -> None:
        self.model = model
        self.api_key = api_key
        self.base_url = (base_url or self.default_base_url).rstrip("/")
        self.retry = retry if retry is not None else RetryPolicy()
        self.prices = prices
        #: Shared limits every attempt waits for (``None``: none).
        self.budget = budget
        self._client = client

    @property
    def name(self) -> str:
        return f"{self.provider}:{self.model}"

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.model!r}, base_url={self.base_url!r})"

    # --- what subclasses provide ----------------------------------------------------

    def build(self, request: ModelRequest, *, stream: bool) -> tuple[str, dict[str, str], Any]:
        """The URL, headers and JSON body of ``request``."""
        raise NotImplementedError

    def decoder(self, request: ModelRequest, id_prefix: str) -> StreamDecoder:
        raise NotImplementedError

    def parse(self, request: ModelRequest, body: Any, id_prefix: str) -> ModelResponse:
        """A whole (non-streamed) response."""
        raise NotImplementedError

    def error_details(self, body: Any) -> tuple[str | None, str | None, float | None]:
        """The provider's error type, message and retry hint from an error body."""
        return None, None, None

    # --- the public methods ---------------------------------------------------------

    async def complete(self, request: ModelRequest) -> ModelResponse:
        """The whole response, retried as the retry policy says.

        Raises:
            ProviderError: the provider refused, or retrying did not help.
        """
        url, headers, body = self.build(request, stream=False)
        content = json.dumps(body, ensure_ascii=False).encode()
        id_prefix = self._id_prefix(content)

        queued = _Queued()

        async def attempt() -> ModelResponse:
            with await self._grant(request, content, queued) as grant:
                response = await self._send(url, headers, content, stream=False, grant=grant)
                body = load_json(self.provider, response.content)
                with response_shape(self.provider):
                    parsed = self.parse(request, body, id_prefix)
                grant.settle(parsed.usage.total_tokens)
                return parsed

        return await self.retry.run(attempt, queued=queued.total)

    @contextlib.asynccontextmanager
    async def stream(self, request: ModelRequest) -> AsyncIterator[AsyncIterator[ModelEvent]]:
        """The response's events as they arrive; ``ResponseComplete`` last.

        Raises:
            ProviderError: on entering, when the provider refused and retrying
                did not help; while iterating, when the stream breaks or
                carries an error (never retried once an event was yielded).
        """
        url, headers, body = self.build(request, stream=True)
        content = json.dumps(body, ensure_ascii=False).encode()
        id_prefix = self._id_prefix(content)

        queued = _Queued()

        async def attempt() -> _OpenStream:
            grant = await self._grant(request, content, queued)
            try:
                response = await self._send(url, headers, content, stream=True, grant=grant)
                # The stream holds the grant (its connection) until it is closed.
                opened = _OpenStream(self, request, response, id_prefix, grant)
            except BaseException:
                grant.release()
                raise
            try:
                await opened.prefetch()
            except BaseException:
                await opened.aclose()
                raise
            return opened

        opened = await self.retry.run(attempt, queued=queued.total)
        try:
            yield opened.events()
        finally:
            await opened.aclose()

    # --- plumbing -------------------------------------------------------------------

    def _id_prefix(self, content: bytes) -> str:
        # Ids for calls the provider did not name: the same request gives the
        # same ids, and no two turns of a conversation share them (each turn's
        # request holds the one before).
        return f"{self.provider}-{hashlib.sha256(content).hexdigest()[:10]}"

    async def _grant(
        self, request: ModelRequest, content: bytes, queued: _Queued
    ) -> Grant | _NoGrant:
        """Leave from the budget to send one attempt (at once without a budget)."""
        if self.budget is None:
            return _NO_GRANT
        tokens = _estimate(request, content)
        started = trio.current_time()
        try:
            return await self.budget.acquire(self.provider, self.model, tokens)
        finally:
            queued.seconds += trio.current_time() - started

    async def _send(
        self,
        url: str,
        headers: dict[str, str],
        content: bytes,
        *,
        stream: bool,
        grant: Grant | _NoGrant,
    ) -> httpx.Response:
        request = self._client.build_request("POST", url, headers=headers, content=content)
        try:
            response = await self._client.send(request, stream=stream)
        except httpx.TransportError as exc:
            raise self.connection_error(exc) from exc
        if not response.is_success:
            try:
                await response.aread()
            except httpx.TransportError:
                pass  # the status says enough
            finally:
                await response.aclose()
            error = self._status_error(response)
            grant.refused(error.status, error.retry_after)
            raise error
        return response

    def connection_error(self, exc: httpx.TransportError) -> ProviderError:
        if _refused_on_loopback(exc):
            # Nothing listens there: a local server that is not running, which
            # waiting seconds between attempts will not start.
            return ProviderError(
                self.provider,
                f"nothing listens at {self.base_url} (connection refused); "
                "start the server or point the base URL elsewhere",
                error_type="connection_error",
            )
        detail = str(exc) or type(exc).__name__
        return ProviderError(
            self.provider,
            f"{type(exc).__name__}: {detail}",
            error_type="connection_error",
            retryable=True,
        )

    def _status_error(self, response: httpx.Response) -> ProviderError:
        error_type = message = None
        hint: float | None = None
        try:
            error_type, message, hint = self.error_details(json.loads(response.content))
        except (ValueError, TypeError, AttributeError, KeyError, httpx.ResponseNotRead):
            pass
        if message is None:
            try:
                text = response.text.strip()
            except httpx.ResponseNotRead:
                text = ""
            message = text[:_MAX_ERROR_TEXT] or response.reason_phrase or "no message"
        retryable = response.status_code in RETRYABLE_STATUSES
        # OpenAI and Anthropic say outright when a retry is (not) worth it.
        should_retry = response.headers.get("x-should-retry")
        if should_retry in ("true", "false"):
            retryable = should_retry == "true"
        if retryable and says_malformed_output(message, error_type):
            retryable = False
            message += " (the model's output could not be parsed: asking again gets the same)"
        retry_after = parse_retry_after(response.headers)
        return ProviderError(
            self.provider,
            message,
            status=response.status_code,
            error_type=error_type,
            retryable=retryable,
            retry_after=retry_after if retry_after is not None else hint,
        )


def _refused_on_loopback(exc: httpx.TransportError) -> bool:
    """Whether ``exc`` is a connection refused (ECONNREFUSED) by a loopback address."""
    if not isinstance(exc, httpx.ConnectError):
        return False
    try:
        host = exc.request.url.host
    except RuntimeError:  # no request attached
        return False
    if host != "localhost":
        try:
            if not ipaddress.ip_address(host).is_loopback:
                return False
        except ValueError:
            return False
    return _refused(exc, depth=0)


def _refused(exc: BaseException, *, depth: int) -> bool:
    """ECONNREFUSED, found down the causes; a group (Trio tries each address) only
    when every attempt in it was refused."""
    if depth > 10:
        return False
    if isinstance(exc, OSError) and exc.errno == errno.ECONNREFUSED:
        return True
    if isinstance(exc, BaseExceptionGroup):
        return all(_refused(e, depth=depth + 1) for e in exc.exceptions)
    cause = exc.__cause__ or exc.__context__
    return cause is not None and _refused(cause, depth=depth + 1)


def _estimate(request: ModelRequest, content: bytes) -> int:
    """``estimate_tokens`` of a request: an attachment sent counts as an image, not its bytes."""
    attachments = 0
    media_bytes = 0
    for message in request.messages:
        if message.role != "tool":
            continue
        for observation in message.observations:
            for attachment in observation.attachments:
                # Sent (its base64 is in the body, verbatim), or left out by the adapter.
                if content.find(attachment.data[:64].encode()) >= 0:
                    attachments += 1
                    media_bytes += len(attachment.data)
    max_tokens = request.effective_settings().max_tokens
    return estimate_tokens(max_tokens, len(content) - media_bytes, attachments=attachments)


class _Queued:
    """The seconds one request's attempts waited for the budget: not retrying, so
    not counted against ``RetryPolicy.max_total``."""

    __slots__ = ("seconds",)

    def __init__(self) -> None:
        self.seconds = 0.0

    def total(self) -> float:
        return self.seconds


class _NoGrant:
    """The grant of a model without a budget: nothing to wait for or count."""

    def __enter__(self) -> _NoGrant:
        return self

    def __exit__(self, *exc_info: object) -> None:
        pass

    def settle(self, tokens: int) -> None:
        pass

    def refused(self, status: int | None, retry_after: float | None) -> None:
        pass

    def release(self) -> None:
        pass


_NO_GRANT = _NoGrant()


class _OpenStream:
    """One streamed HTTP response being decoded."""

    def __init__(
        self,
        model: HTTPModel,
        request: ModelRequest,
        response: httpx.Response,
        id_prefix: str,
        grant: Grant | _NoGrant,
    ) -> None:
        self._model = model
        self._grant = grant
        self._provider = model.provider
        self._request = request
        self._response = response
        self._decoder = model.decoder(request, id_prefix)
        self._id_prefix = id_prefix
        self._sse = SSEDecoder()
        self._lines: AsyncIterator[str] = response.aiter_lines()
        self._pending: deque[ModelEvent] = deque()
        self._complete: ModelResponse | None = None
        self._generator: AsyncGenerator[ModelEvent, None] | None = None
        self._closed = False
        self._drained = False

    async def prefetch(self) -> None:
        """Read until the first event (or the end), still inside the retry loop."""
        content_type = self._response.headers.get("content-type", "")
        if content_type.startswith("application/json"):
            # Some OpenAI-compatible servers ignore "stream": true.
            body = load_json(self._provider, await self._read_all())
            with response_shape(self._provider):
                response = self._model.parse(self._request, body, self._id_prefix)
            self._pending.extend(events_of(response)[:-1])
            self._complete = response
            self._grant.settle(response.usage.total_tokens)
            self._drained = True
            return
        await self._read_more()

    async def _read_all(self) -> bytes:
        try:
            return await self._response.aread()
        except httpx.TransportError as exc:
            raise self._model.connection_error(exc) from exc

    async def _read_more(self) -> None:
        """Decode lines until there are events to hand out or the response is complete."""
        try:
            while not self._pending and self._complete is None:
                line = await anext(self._lines, None)
                if line is None:
                    raise ProviderError(
                        self._provider,
                        "the stream ended early, before the response was complete",
                        error_type="incomplete_stream",
                        retryable=True,
                    )
                event = self._sse.feed(line)
                if event is None:
                    continue
                try:
                    with response_shape(self._provider):
                        self._pending.extend(self._decoder.feed(event))
                except ProviderError as exc:
                    status = _IN_BAND_STATUS.get(exc.error_type or "")
                    if exc.status is None and status is not None:
                        self._grant.refused(status, exc.retry_after)  # overloaded, in band
                    raise
                with response_shape(self._provider):
                    if self._decoder.done:
                        self._complete = self._decoder.response()
                        self._grant.settle(self._complete.usage.total_tokens)
        except httpx.TransportError as exc:
            raise ProviderError(
                self._provider,
                f"the stream ended early: {type(exc).__name__}: {exc or 'connection lost'}",
                error_type="incomplete_stream",
                retryable=True,
            ) from exc

    def events(self) -> AsyncGenerator[ModelEvent, None]:
        self._generator = self._events()
        return self._generator

    async def _events(self) -> AsyncGenerator[ModelEvent, None]:
        while True:
            while self._pending:
                # Events already read are still a cancel point each, as Trio expects.
                await trio.lowlevel.checkpoint()
                yield self._pending.popleft()
            if self._complete is not None:
                break
            await self._read_more()
        await self._drain()
        yield ResponseComplete(self._complete)

    async def _drain(self) -> None:
        if self._drained:
            return
        self._drained = True
        with trio.move_on_after(_DRAIN_TIMEOUT), contextlib.suppress(httpx.TransportError):
            while await anext(self._lines, None) is not None:
                pass

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            with trio.CancelScope(shield=True, deadline=trio.current_time() + _CLOSE_TIMEOUT):
                if self._generator is not None:
                    await self._generator.aclose()
                lines = self._lines
                if isinstance(lines, AsyncGenerator):
                    await lines.aclose()
                await self._response.aclose()
        finally:
            self._grant.release()
