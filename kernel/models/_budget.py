"""A model budget shared by every session: connections, requests and tokens per provider and model.

``ModelBudget`` is the ``max_connections`` of an eval harness, plus requests
and tokens per minute, plus ``Retry-After`` shared by every request to a
provider. Every HTTP attempt of an adapter built with ``budget=`` (see
``resolve_model``) first waits for a ``Grant``::

    with await budget.acquire("openai", "gpt-4.1-mini", tokens=estimate) as grant:
        ...                      # send, read the answer
        grant.settle(usage.total_tokens)

Its guarantees:

1. **Limits.** At most ``max_connections`` requests hold a grant at once, at
   most ``requests_per_minute`` grants start in any 60 seconds, and the tokens
   of the grants started in any 60 seconds add up to at most
   ``tokens_per_minute``; each for the provider (``providers["openai"]``) and
   for each model (``models["openai:gpt-4.1-mini"]``), ``default`` standing
   for a provider not listed. A request whose estimate alone is over the
   tokens per minute goes when the window is empty, or once it has waited a
   minute, whichever comes first; it holds nobody back meanwhile (the
   requests behind it go as they fit).
2. **Tokens are reserved, then settled.** A grant reserves its estimate (the
   request's ``max_tokens``, a quarter of its bytes besides its attachments,
   and ``ATTACHMENT_TOKENS`` per attachment: ``estimate_tokens``) when it
   starts, and ``settle`` replaces the estimate by what the provider
   reported: an overestimate frees room at once, an underestimate holds later
   requests back. A grant left unsettled keeps its estimate; a refused one
   (``refused``) counts no tokens, only the request.
3. **Retry-After is everyone's.** A 429, 503 or 529 that says when to come
   back pauses every request to that provider until then (at most
   ``max_pause`` seconds). A 429 or 529 that does not say (or says 0, or
   something that is not a number) pauses the provider ``backoff`` seconds,
   doubled for each such refusal in a row, up to ``max_pause``. The requests
   already in flight when the provider began refusing are one refusal, not
   one each; a success, or a minute past the pause without a refusal, ends
   the row. Grants already given are not taken back.
4. **First come, first served.** Waiters of a provider are served in order;
   one held back by a provider-wide limit (a pause, the provider's
   connections, requests or tokens) holds back everyone behind it, so a big
   request is never starved by small ones slipping past (one over the
   minute's tokens aside: see 1). One held back only by its own model's
   limit lets later waiters for other models go (within a model, the order
   is still kept).
5. **Cancellation leaves nothing behind.** A waiter cancelled before its grant
   reserves nothing; one cancelled as its grant arrives gives it back
   (connection, request and tokens), as if it had never asked.

Everything runs on the caller's tasks: there is no background task. The
first waiter of a provider sleeps until the next time something frees up (a
pause ends, a minute-window entry expires) and looks again; a released grant
wakes the waiters at once. Looking goes over each model's first waiter, not
over every waiter: thousands queued behind a held model cost nothing.

``snapshot()`` shows the load: a ``ProviderLoad`` row per provider and per
model seen.

A budget keeps time on the Trio clock, which each ``trio.run`` starts
afresh: a budget used by a later run (a module-level budget in a test suite)
starts that run empty, as new; used by two runs at once (threads) it refuses
with a ``UsageError``.
"""

from __future__ import annotations

import collections
import heapq
import math
from collections.abc import Mapping
from types import TracebackType
from typing import Any

import attrs
import trio

from .._checks import positive
from ..errors import UsageError

WINDOW = 60.0
"""Seconds of the requests- and tokens-per-minute windows."""
PAUSE_STATUSES = frozenset({429, 503, 529})
"""Statuses whose ``Retry-After`` pauses the whole provider."""
BACKOFF_STATUSES = frozenset({429, 529})
"""Statuses that pause the provider even without ``Retry-After`` (rate limited, overloaded)."""
ATTACHMENT_TOKENS = 1600
"""The tokens an image (or another attachment) is reckoned at: providers bill an image
by its pixels, about 1,000 to 1,800 tokens for a screenshot, not by its bytes."""
_INF = math.inf
_MAX_DOUBLINGS = 64  # 2.0 ** 64 seconds: past any max_pause, far from an OverflowError


def _seconds(where: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value < _INF:
        raise UsageError(f"{where}: expected seconds >= 0, got {value!r}")
    return float(value)


@attrs.frozen(kw_only=True)
class BudgetLimits:
    """The limits of one provider or one model; ``None`` is no limit.

    Raises:
        UsageError: a limit that is not an integer >= 1.
    """

    max_connections: int | None = attrs.field(
        default=None, validator=positive(integer=True, optional=True)
    )
    requests_per_minute: int | None = attrs.field(
        default=None, validator=positive(integer=True, optional=True)
    )
    tokens_per_minute: int | None = attrs.field(
        default=None, validator=positive(integer=True, optional=True)
    )


NO_LIMITS = BudgetLimits()


@attrs.frozen
class ProviderLoad:
    """One row of ``ModelBudget.snapshot()``: a provider (``model`` is ``None``) or one model.

    ``in_flight`` grants are held now and ``waiting`` requests wait for one;
    ``limit`` is ``max_connections``. ``requests_used`` and ``tokens_used``
    count the last 60 seconds (tokens as settled, estimates until then).
    ``paused_for`` is the seconds left of a provider's pause (0 for a model row).
    """

    provider: str
    model: str | None
    in_flight: int
    waiting: int
    limit: int | None
    requests_used: int
    requests_per_minute: int | None
    tokens_used: int
    tokens_per_minute: int | None
    paused_for: float = 0.0


def estimate_tokens(max_tokens: int | None, body_bytes: int, *, attachments: int = 0) -> int:
    """What a request may use, before it is sent: its ``max_tokens`` (the most it can
    answer), its body's bytes over four (about a token each; tools count by their
    JSON, which errs high) and ``ATTACHMENT_TOKENS`` for each of its
    ``attachments`` (images: their bytes are not in ``body_bytes``)."""
    return (max_tokens or 0) + max(body_bytes, 0) // 4 + attachments * ATTACHMENT_TOKENS


class _Slot:
    """One entry of a minute window; its amount changes when a grant settles."""

    __slots__ = ("amount", "at")

    def __init__(self, at: float, amount: int) -> None:
        self.at = at
        self.amount = amount


class _Window:
    """What was started in the last 60 seconds, against a per-minute limit."""

    __slots__ = ("limit", "slots", "used")

    def __init__(self, limit: int | None) -> None:
        self.limit = limit
        self.slots: collections.deque[_Slot] = collections.deque()
        self.used = 0

    def expire(self, now: float) -> None:
        slots = self.slots
        while slots and slots[0].at + WINDOW <= now:
            self.used -= slots.popleft().amount

    def fits(self, amount: int) -> bool:
        if self.limit is None:
            return True
        # An amount over the whole limit can never fit: it goes alone, into an empty window.
        return self.used + amount <= self.limit or self.used == 0

    def next_expiry(self) -> float:
        """When the oldest entry leaves the window: room for more (never, without a limit)."""
        if self.limit is None or not self.slots:
            return _INF
        return self.slots[0].at + WINDOW

    def add(self, now: float, amount: int) -> _Slot:
        # Kept without a limit too, for snapshot().
        slot = _Slot(now, amount)
        self.slots.append(slot)
        self.used += amount
        return slot

    def change(self, slot: _Slot, amount: int) -> None:
        if self.slots and slot.at >= self.slots[0].at:  # still in the window
            self.used += amount - slot.amount
        slot.amount = amount


class _Gate:
    """The limits of a provider or of one model, and what is used of them."""

    __slots__ = ("in_flight", "limits", "requests", "tokens")

    def __init__(self, limits: BudgetLimits) -> None:
        self.limits = limits
        self.in_flight = 0
        self.requests = _Window(limits.requests_per_minute)
        self.tokens = _Window(limits.tokens_per_minute)

    def expire(self, now: float) -> None:
        self.requests.expire(now)
        self.tokens.expire(now)

    def fits(self, tokens: int) -> bool:
        limit = self.limits.max_connections
        return (
            (limit is None or self.in_flight < limit)
            and self.requests.fits(1)
            and self.tokens.fits(tokens)
        )

    def next_change(self) -> float:
        """When a minute window next frees something (a release wakes waiters itself)."""
        return min(self.requests.next_expiry(), self.tokens.next_expiry())

    def oversize(self, tokens: int) -> bool:
        """Whether ``tokens`` alone are over the tokens per minute (it waits for an empty window)."""
        limit = self.limits.tokens_per_minute
        return limit is not None and tokens > limit


class _Waiter:
    __slots__ = ("admitted", "event", "model", "scope", "seq", "since", "tokens")

    def __init__(self, seq: int, model: str, tokens: int, since: float) -> None:
        self.seq = seq  # the order of arrival, over the provider's models
        self.model = model
        self.tokens = tokens
        self.since = since
        self.event = trio.Event()
        self.scope: trio.CancelScope | None = None
        self.admitted: Grant | None = None


class _Provider:
    """A provider's gate, its models' gates, its pause and its queue of waiters."""

    def __init__(self, name: str, limits: BudgetLimits) -> None:
        self.name = name
        self.gate = _Gate(limits)
        self.models: dict[str, _Gate] = {}
        # Each model's waiters, in order; the provider's order is their seq.
        self.queues: dict[str, collections.deque[_Waiter]] = {}
        self.arrivals = 0
        self.paused_until = -_INF
        self.refusals = 0  # in a row, without Retry-After
        self.refused_at = -_INF  # when the row last grew
        self.row_ends = -_INF  # a minute after its pause: no refusal since, a new row
        self.wake_at = _INF

    def first(self) -> _Waiter | None:
        """The waiter that came first (it keeps the wake-up timer)."""
        heads = [queue[0] for queue in self.queues.values() if queue]
        return min(heads, key=lambda waiter: waiter.seq) if heads else None

    def waiting(self) -> int:
        return sum(len(queue) for queue in self.queues.values())


class Grant:
    """Leave to send one request: held until ``release`` (or the end of its ``with``).

    ``settle(tokens)`` puts the tokens the provider reported in place of the
    estimate; ``refused(status, retry_after)`` tells the budget the provider
    turned the request down (pausing the provider as the module says).
    """

    __slots__ = ("_budget", "_model", "_provider", "_released", "_request_slots", "_token_slots")

    def __init__(
        self,
        budget: ModelBudget,
        provider: _Provider,
        model: _Gate,
        request_slots: tuple[_Slot, _Slot],
        token_slots: tuple[_Slot, _Slot],
    ) -> None:
        self._budget = budget
        self._provider = provider
        self._model = model
        self._request_slots = request_slots
        self._token_slots = token_slots
        self._released = False

    def __enter__(self) -> Grant:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.release()

    def settle(self, tokens: int) -> None:
        """Count ``tokens`` (what the provider reported) instead of the estimate."""
        self._provider.gate.tokens.change(self._token_slots[0], tokens)
        self._model.tokens.change(self._token_slots[1], tokens)
        self._provider.refusals = 0
        self._budget._pump(self._provider)

    def refused(self, status: int | None, retry_after: float | None) -> None:
        """The provider turned the request down: no tokens used; maybe pause the provider."""
        self._provider.gate.tokens.change(self._token_slots[0], 0)
        self._model.tokens.change(self._token_slots[1], 0)
        self._budget._refused(self._provider, status, retry_after, self._request_slots[0].at)

    def release(self) -> None:
        """Give the connection back (again: nothing). The request and tokens stay counted."""
        if self._released:
            return
        self._released = True
        self._provider.gate.in_flight -= 1
        self._model.in_flight -= 1
        self._budget._pump(self._provider)

    def _revoke(self) -> None:
        """Give everything back, as if never granted (its waiter was cancelled)."""
        provider, model = self._provider, self._model
        provider.gate.requests.change(self._request_slots[0], 0)
        model.requests.change(self._request_slots[1], 0)
        provider.gate.tokens.change(self._token_slots[0], 0)
        model.tokens.change(self._token_slots[1], 0)
        self.release()


def _limits_from(value: object, where: str) -> BudgetLimits:
    if isinstance(value, BudgetLimits):
        return value
    if not isinstance(value, Mapping):
        raise UsageError(f"{where}: expected a table of limits, got {value!r}")
    known = [f.name for f in attrs.fields(BudgetLimits)]
    unknown = [key for key in value if key not in known]
    if unknown:
        raise UsageError(f"{where}: unknown setting {unknown[0]!r}; known: {', '.join(known)}")
    try:
        return BudgetLimits(**value)
    except UsageError as exc:
        raise UsageError(f"{where}.{str(exc).removeprefix('BudgetLimits.')}") from None


def _check_keys(
    mapping: Mapping[str, BudgetLimits], *, model: bool, where: str
) -> dict[str, BudgetLimits]:
    checked: dict[str, BudgetLimits] = {}
    for key, value in mapping.items():
        provider, colon, name = key.partition(":") if isinstance(key, str) else ("", "", "")
        if not provider or (model and not (colon and name)) or (not model and colon):
            shape = "provider:model" if model else "a provider name without ':'"
            raise UsageError(f"{where}[{key!r}]: expected {shape}")
        checked[key] = _limits_from(value, f"{where}[{key!r}]")
    return checked


class ModelBudget:
    """Limits shared by every model built with it; see the module docstring.

    ``providers`` maps a provider (``"openai"``) to its limits, ``models``
    maps ``provider:model`` to a model's own (held besides its provider's);
    ``default`` is for a provider not in ``providers`` (no limits unless
    given). ``backoff`` and ``max_pause`` shape the provider-wide pause after a
    refusal. One budget serves one Trio run at a time (see the module docstring).

    Raises:
        UsageError: a key of the wrong shape, a bad limit or a bad number of seconds.
    """

    def __init__(
        self,
        *,
        providers: Mapping[str, BudgetLimits] | None = None,
        models: Mapping[str, BudgetLimits] | None = None,
        default: BudgetLimits = NO_LIMITS,
        backoff: float = 1.0,
        max_pause: float = 60.0,
    ) -> None:
        self.providers = _check_keys(providers or {}, model=False, where="ModelBudget.providers")
        self.models = _check_keys(models or {}, model=True, where="ModelBudget.models")
        self.default = _limits_from(default, "ModelBudget.default")
        self.backoff = _seconds("ModelBudget.backoff", backoff)
        self.max_pause = _seconds("ModelBudget.max_pause", max_pause)
        self._states: dict[str, _Provider] = {}
        self._run: trio.lowlevel.TrioToken | None = None  # the run whose clock _states keep

    @classmethod
    def from_table(cls, table: Mapping[str, Any], *, where: str = "[budget]") -> ModelBudget:
        """A budget from a TOML table such as ``tak.toml``'s ``[budget]``::

            [budget]
            max_pause = 60                      # optional; backoff too
            [budget.default]                    # any provider not named
            max_connections = 10
            [budget.openai]
            max_connections = 50
            requests_per_minute = 500
            [budget."openai:gpt-4.1-mini"]
            tokens_per_minute = 200000

        A provider is one ``resolve_model`` knows (``openai``, ``anthropic``,
        ``gemini``): a misspelt one would never apply. (``ModelBudget(providers=)``
        takes any name, for adapters of one's own.)

        Raises:
            UsageError: one line naming the table and key that is wrong.
        """
        from ..home import BudgetTable

        checked = BudgetTable.from_table(table, where=where)
        return cls(
            providers={key: BudgetLimits(**v) for key, v in checked.providers.items()},
            models={key: BudgetLimits(**v) for key, v in checked.models.items()},
            default=NO_LIMITS if checked.default is None else BudgetLimits(**checked.default),
            backoff=checked.seconds.get("backoff", 1.0),
            max_pause=checked.seconds.get("max_pause", 60.0),
        )

    def __repr__(self) -> str:
        return (
            f"ModelBudget(providers={self.providers!r}, models={self.models!r}, "
            f"default={self.default!r})"
        )

    # --- asking -------------------------------------------------------------------

    async def acquire(self, provider: str, model: str, tokens: int = 0) -> Grant:
        """Wait for leave to send one request of about ``tokens`` to ``provider:model``.

        Use the grant in a ``with`` block (or ``release`` it): it holds a
        connection until then. Cancelled while waiting, it leaves nothing
        reserved. Always a checkpoint.
        """
        self._check_run("acquire")
        state = self._provider(provider)
        self._model(state, model)  # _pump finds it there
        state.arrivals += 1
        waiter = _Waiter(state.arrivals, model, max(int(tokens), 0), trio.current_time())
        state.queues[model].append(waiter)
        try:
            self._pump(state)
            if waiter.admitted is None:
                await self._wait(state, waiter)
            else:
                await trio.lowlevel.checkpoint()
        except BaseException:
            if waiter.admitted is not None:
                waiter.admitted._revoke()
            else:
                self._leave(state, waiter)
            raise
        assert waiter.admitted is not None
        return waiter.admitted

    async def _wait(self, state: _Provider, waiter: _Waiter) -> None:
        while waiter.admitted is None:
            with trio.CancelScope() as scope:
                waiter.scope = scope
                if state.first() is waiter:
                    scope.deadline = state.wake_at
                await waiter.event.wait()
            waiter.scope = None
            if waiter.admitted is None:
                # Woken by the clock (the first waiter only): look again.
                self._pump(state)

    def _leave(self, state: _Provider, waiter: _Waiter) -> None:
        try:
            state.queues[waiter.model].remove(waiter)
        except ValueError:
            return
        self._pump(state)

    # --- the provider's state ------------------------------------------------------

    def _check_run(self, what: str) -> None:
        """Start afresh in a new Trio run (its clock is not the last one's); refuse two at once."""
        try:
            run = trio.lowlevel.current_trio_token()
        except RuntimeError:
            raise UsageError(
                f"ModelBudget.{what}() needs a running Trio run: the budget keeps Trio's time"
            ) from None
        if run is self._run:
            return
        busy = any(s.gate.in_flight or s.waiting() for s in self._states.values())
        if busy and self._run is not None:
            raise UsageError(
                "ModelBudget: used by two Trio runs at once; one budget serves one run at a time"
            )
        self._run = run
        self._states.clear()

    def _provider(self, name: str) -> _Provider:
        state = self._states.get(name)
        if state is None:
            state = self._states[name] = _Provider(name, self.providers.get(name, self.default))
        return state

    def _model(self, state: _Provider, model: str) -> _Gate:
        gate = state.models.get(model)
        if gate is None:
            limits = self.models.get(f"{state.name}:{model}", NO_LIMITS)
            gate = state.models[model] = _Gate(limits)
            state.queues[model] = collections.deque()
        return gate

    def _refused(
        self, state: _Provider, status: int | None, retry_after: float | None, granted_at: float
    ) -> None:
        now = trio.current_time()
        if retry_after is not None and not retry_after > 0:
            retry_after = None  # 0 (a date past), negative or nan: it did not say
        if status in PAUSE_STATUSES and retry_after is not None:
            pause = retry_after
        elif status in BACKOFF_STATUSES:
            if now >= state.row_ends:
                state.refusals = 0
            if state.refusals == 0 or granted_at > state.refused_at:
                # Sent after the last refusal: the provider refused again. One
                # sent before it was refused in the same breath: no doubling.
                state.refusals = min(state.refusals + 1, _MAX_DOUBLINGS)
                state.refused_at = now
            pause = self.backoff * 2.0 ** (state.refusals - 1)
            state.row_ends = now + min(pause, self.max_pause) + WINDOW
        else:
            return
        state.paused_until = max(state.paused_until, now + min(pause, self.max_pause))
        self._pump(state)

    def _pump(self, state: _Provider) -> None:
        """Admit every waiter that may go now, in order; set the first one's wake-up time."""
        now = trio.current_time()
        provider = state.gate
        provider.expire(now)
        wake_at = _INF
        if now < state.paused_until:
            wake_at = state.paused_until
        else:
            # The models' first waiters, merged in order of arrival: a waiter
            # behind its model's held first one is never looked at.
            heads = [(q[0].seq, 0, model) for model, q in state.queues.items() if q]
            heapq.heapify(heads)
            aside: set[str] = set()  # models with a waiter admitted past one left in place
            while heads:
                _, index, model = heapq.heappop(heads)
                queue = state.queues[model]
                waiter = queue[index]
                gate = state.models[model]
                gate.expire(now)
                if not provider.fits(waiter.tokens):
                    if not _oversize(provider, waiter):
                        wake_at = min(wake_at, provider.next_change())
                        break
                    if now < waiter.since + WINDOW:
                        # Over the whole minute's tokens: it waits for an empty
                        # window (a minute at most), in nobody's way.
                        wake_at = min(wake_at, provider.next_change(), waiter.since + WINDOW)
                        _push(heads, queue, index + 1, model)
                        continue
                if not gate.fits(waiter.tokens):
                    if not _oversize(gate, waiter):
                        wake_at = min(wake_at, gate.next_change())
                        continue  # the model's order is kept: its later waiters wait
                    if now < waiter.since + WINDOW:
                        wake_at = min(wake_at, gate.next_change(), waiter.since + WINDOW)
                        _push(heads, queue, index + 1, model)
                        continue
                self._admit(state, gate, waiter, now)
                if index == 0:
                    queue.popleft()
                    _push(heads, queue, 0, model)
                else:
                    aside.add(model)
                    _push(heads, queue, index + 1, model)
            for model in aside:
                queue = state.queues[model]
                state.queues[model] = collections.deque(w for w in queue if w.admitted is None)
        state.wake_at = wake_at
        first = state.first()
        if first is not None and first.scope is not None:
            first.scope.deadline = wake_at

    def _admit(self, state: _Provider, gate: _Gate, waiter: _Waiter, now: float) -> None:
        """Grant ``waiter`` its leave (the caller takes it out of the queue)."""
        provider = state.gate
        provider.in_flight += 1
        gate.in_flight += 1
        requests = (provider.requests.add(now, 1), gate.requests.add(now, 1))
        tokens = (
            provider.tokens.add(now, waiter.tokens),
            gate.tokens.add(now, waiter.tokens),
        )
        waiter.admitted = Grant(self, state, gate, requests, tokens)
        waiter.event.set()

    # --- looking -------------------------------------------------------------------

    def snapshot(self) -> list[ProviderLoad]:
        """The load now: per provider (``model=None``), then each of its models, by name.

        Raises:
            UsageError: called outside a Trio run (the budget keeps Trio's time).
        """
        self._check_run("snapshot")
        now = trio.current_time()
        rows: list[ProviderLoad] = []
        for name in sorted(self._states):
            state = self._states[name]
            state.gate.expire(now)
            paused = max(state.paused_until - now, 0)
            rows.append(_row(name, None, state.gate, state.waiting(), paused))
            for model in sorted(state.models):
                gate = state.models[model]
                gate.expire(now)
                rows.append(_row(name, model, gate, len(state.queues[model]), 0.0))
        return rows


def _push(
    heads: list[tuple[int, int, str]], queue: collections.deque[_Waiter], index: int, model: str
) -> None:
    """Put ``model``'s waiter at ``index`` (if any) among the heads to look at."""
    if index < len(queue):
        heapq.heappush(heads, (queue[index].seq, index, model))


def _oversize(gate: _Gate, waiter: _Waiter) -> bool:
    """Whether ``waiter`` is held by ``gate`` only for asking more than a minute's tokens."""
    return gate.oversize(waiter.tokens) and gate.fits(0)


def _row(
    provider: str, model: str | None, gate: _Gate, waiting: int, paused: float
) -> ProviderLoad:
    return ProviderLoad(
        provider=provider,
        model=model,
        in_flight=gate.in_flight,
        waiting=waiting,
        limit=gate.limits.max_connections,
        requests_used=gate.requests.used,
        requests_per_minute=gate.limits.requests_per_minute,
        tokens_used=gate.tokens.used,
        tokens_per_minute=gate.limits.tokens_per_minute,
        paused_for=paused,
    )
