"""Retries with jittered exponential backoff, honouring ``Retry-After``."""

from __future__ import annotations

import email.utils
import itertools
import math
import random
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, TypeVar

import attrs
import trio

from .._checks import positive
from ..errors import UsageError
from ._base import ProviderError

T = TypeVar("T")

RETRYABLE_STATUSES = frozenset({408, 409, 429, 500, 502, 503, 504, 529})
"""Statuses worth trying again: timeouts, conflicts, rate limits, server errors and
Anthropic's "overloaded" (and only before the first event of a stream)."""

#: Words of an error (any status) that say the model's own output could not be
#: parsed, as generated or as sent back in the history: asking again sends the
#: same history and, at temperature 0, gets the same output. Never retried.
MALFORMED_OUTPUT_SIGNS = (
    # llama.cpp's llama-server, HTTP 500: a call's arguments in the history (cut
    # by max_tokens, say) are not JSON.
    "failed to parse tool call",
    # llama-server's PEG parser, HTTP 500: "The model produced output that does not
    # match the expected peg-native format" (the reply fits no tool-call format).
    "the model produced output that does not match",
    # Ollama, HTTP 500: "error parsing tool call: raw='...', err=..."
    "error parsing tool call",
    # OpenAI, HTTP 500 model_error.
    "the model produced invalid content",
)


def says_malformed_output(message: str | None, error_type: str | None = None) -> bool:
    """Whether an error says the model's output could not be parsed (see ``MALFORMED_OUTPUT_SIGNS``)."""
    if error_type == "model_error":  # OpenAI's word for it
        return True
    lowered = (message or "").lower()
    return any(sign in lowered for sign in MALFORMED_OUTPUT_SIGNS)


def _non_negative(instance: object, attribute: attrs.Attribute[Any], value: float) -> None:
    if not value >= 0:
        raise UsageError(f"RetryPolicy.{attribute.name} must be >= 0, got {value!r}")


def _fraction(instance: object, attribute: attrs.Attribute[Any], value: float) -> None:
    if not 0 <= value <= 1:
        raise UsageError(f"RetryPolicy.{attribute.name} must be between 0 and 1, got {value!r}")


@attrs.frozen(kw_only=True)
class RetryPolicy:
    """When to try a failed request again.

    Retried: HTTP 408, 429, 500, 502, 503, 504, 529, connection errors, and a
    stream that fails before its first event reaches the caller. Never
    retried: an error saying the model's output could not be parsed
    (``says_malformed_output``), and a connection refused on a loopback
    address (nothing listens there: a local server that is not running). The wait
    before retry ``n`` (1, 2, ...) is ``Retry-After`` when the provider sent
    one, else ``base_delay * 2**(n-1)``; either way at most ``max_delay``.
    ``jitter`` is the fraction of a backoff wait drawn at random, so clients
    that failed together do not come back together (a ``Retry-After`` is
    kept as given). Retrying stops after ``max_attempts`` attempts, or when
    the next wait would end more than ``max_total`` seconds after the first
    attempt began; the last error is raised, with ``attempts`` set.

    ``RetryPolicy(max_attempts=1)`` never retries.
    """

    max_attempts: int = attrs.field(default=5, validator=positive(integer=True))
    base_delay: float = attrs.field(default=0.5, validator=_non_negative)
    max_delay: float = attrs.field(default=20.0, validator=_non_negative)
    max_total: float = attrs.field(default=60.0, validator=_non_negative)
    jitter: float = attrs.field(default=0.25, validator=_fraction)

    def delay(self, retry: int, retry_after: float | None = None) -> float:
        """Seconds to wait before retry number ``retry`` (1 for the first)."""
        if retry_after is not None and not math.isnan(retry_after):
            return min(max(retry_after, 0.0), self.max_delay)
        # The exponent capped: a policy of thousands of attempts must not overflow.
        backoff = min(self.max_delay, self.base_delay * 2.0 ** min(retry - 1, 64))
        return backoff * (1 - self.jitter * random.random())

    async def run(
        self, attempt: Callable[[], Awaitable[T]], *, queued: Callable[[], float] | None = None
    ) -> T:
        """Await ``attempt()`` until it succeeds or retrying is over.

        ``queued()`` is how many seconds the attempts so far spent waiting
        their turn (for a ``ModelBudget``): that time is left out of
        ``max_total``, so a request that queued behind others still gets its
        retries.

        Raises:
            ProviderError: the last failure, with ``attempts`` set.
        """
        started = trio.current_time()
        for number in itertools.count(1):
            try:
                return await attempt()
            except ProviderError as exc:
                exc.attempts = number
                if not exc.retryable or number >= self.max_attempts:
                    raise
                wait = self.delay(number, exc.retry_after)
                elapsed = trio.current_time() - started - (queued() if queued else 0.0)
                if elapsed + wait > self.max_total:
                    raise
            await trio.sleep(wait)
        raise AssertionError("unreachable")  # pragma: no cover


def parse_retry_after(headers: Mapping[str, str], *, now: float | None = None) -> float | None:
    """Seconds the server asked us to wait, from ``retry-after-ms`` or ``Retry-After``.

    ``Retry-After`` is seconds or an HTTP date; ``now`` (epoch seconds, the
    wall clock by default) is what a date is measured from. Anything else is
    ignored (``nan`` too); a date past or a negative number is 0 (come back now).
    """
    lowered = {k.lower(): v for k, v in headers.items()}
    milliseconds = lowered.get("retry-after-ms")
    if milliseconds is not None:
        seconds = _number(milliseconds)
        if seconds is not None:
            return seconds / 1000
    value = lowered.get("retry-after")
    if value is None:
        return None
    seconds = _number(value)
    if seconds is not None:
        return seconds
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    if when.tzinfo is None:
        return None
    return max(when.timestamp() - (time.time() if now is None else now), 0.0)


def _number(text: str) -> float | None:
    """``text`` as a number of seconds >= 0 (``inf`` kept, to be capped), or ``None``."""
    try:
        value = float(text)
    except ValueError:
        return None
    return None if math.isnan(value) else max(value, 0.0)
