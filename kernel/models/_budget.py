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
   tokens per minute goes when the window is empty, alone.
2. **Tokens are reserved, then settled.** A grant reserves its estimate (the
   request's ``max_tokens`` plus a quarter of its bytes, ``estimate_tokens``)
   when it starts, and ``settle`` replaces the estimate by what the provider
   reported: an overestimate frees room at once, an underestimate holds later
   requests back. A grant left unsettled keeps its estimate; a refused one
   (``refused``) counts no tokens, only the request.
3. **Retry-After is everyone's.** A 429, 503 or 529 that says when to come
   back pauses every request to that provider until then (at most
   ``max_pause`` seconds). A 429 or 529 that does not say pauses the provider
   ``backoff`` seconds, doubled for each such refusal in a row (a success ends
   the row), up to ``max_pause``. Grants already given are not taken back.
4. **First come, first served.** Waiters of a provider are served in order;
   one held back by a provider-wide limit (a pause, the provider's
   connections, requests or tokens) holds back everyone behind it, so a big
   request is never starved by small ones slipping past. One held back only
   by its own model's limit lets later waiters for other models go (within a
   model, the order is still kept).
5. **Cancellation leaves nothing behind.** A waiter cancelled before its grant
   reserves nothing; one cancelled as its grant arrives gives it back
   (connection, request and tokens), as if it had never asked.

Everything runs on the caller's tasks: there is no background task. The
first waiter of a provider sleeps until the next time something frees up (a
pause ends, a minute-window entry expires) and looks again; a released grant
wakes the waiters at once.

``snapshot()`` shows the load: a ``ProviderLoad`` row per provider and per
model seen.
"""

from __future__ import annotations

import collections
import math
from collections.abc import Mapping
from types import TracebackType
from typing import Any

import attrs
import trio

from ..errors import UsageError

WINDOW = 60.0
"""Seconds of the requests- and tokens-per-minute windows."""
PAUSE_STATUSES = frozenset({429, 503, 529})
"""Statuses whose ``Retry-After`` pauses the whole provider."""
BACKOFF_STATUSES = frozenset({429, 529})
"""Statuses that pause the provider even without ``Retry-After`` (rate limited, overloaded)."""
_INF = math.inf


def _positive_int_or_none(owner: str) -> Any:
    def check(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
        # bool is an int in Python: refuse it, as every other non-integer.
        if value is None:
            return
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise UsageError(
                f"{owner}.{attribute.name}: expected an integer >= 1 (or none for no limit), "
                f"got {value!r}"
            )

    return check


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
        default=None, validator=_positive_int_or_none("BudgetLimits")
    )
    requests_per_minute: int | None = attrs.field(
        default=None, validator=_positive_int_or_none("BudgetLimits")
    )
    tokens_per_minute: int | None = attrs.field(
        default=None, validator=_positive_int_or_none("BudgetLimits")
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


def estimate_tokens(max_tokens: int | None, body_bytes: int) -> int:
    """What a request may use, before it is sent: its ``max_tokens`` (the most it can
    answer) plus its body's bytes over four (about a token each; images and tools
    count by their JSON, which errs high)."""
    return (max_tokens or 0) + body_bytes // 4


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


class _Waiter:
    __slots__ = ("admitted", "event", "model", "scope", "tokens")

    def __init__(self, model: str, tokens: int) -> None:
        self.model = model
        self.tokens = tokens
        self.event = trio.Event()
        self.scope: trio.CancelScope | None = None
        self.admitted: Grant | None = None


class _Provider:
    """A provider's gate, its models' gates, its pause and its queue of waiters."""

    def __init__(self, name: str, limits: BudgetLimits) -> None:
        self.name = name
        self.gate = _Gate(limits)
        self.models: dict[str, _Gate] = {}
        self.waiting: collections.deque[_Waiter] = collections.deque()
        self.paused_until = -_INF
        self.refusals = 0  # in a row, without Retry-After
        self.wake_at = _INF


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
        self._budget._refused(self._provider, status, retry_after)

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
    known = {f.name for f in attrs.fields(BudgetLimits)}
    unknown = sorted(set(value) - known)
    if unknown:
        raise UsageError(
            f"{where}: unknown setting {unknown[0]!r}; known: {', '.join(sorted(known))}"
        )
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
    refusal. One budget serves one Trio run.

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

        Raises:
            UsageError: one line naming the table and key that is wrong.
        """
        if not isinstance(table, Mapping):
            raise UsageError(f"{where}: expected a table, got {table!r}")
        providers: dict[str, BudgetLimits] = {}
        models: dict[str, BudgetLimits] = {}
        default = NO_LIMITS
        seconds: dict[str, float] = {}
        for key, value in table.items():
            if key in ("backoff", "max_pause"):
                seconds[key] = _seconds(f"{where}.{key}", value)
                continue
            inner = f"{where}.{key}" if ":" not in key else f'{where}."{key}"'
            limits = _limits_from(value, inner)
            if key == "default":
                default = limits
            elif ":" in key:
                if not key.partition(":")[2] or not key.partition(":")[0]:
                    raise UsageError(f"{inner}: expected provider:model")
                models[key] = limits
            else:
                providers[key] = limits
        return cls(providers=providers, models=models, default=default, **seconds)

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
        state = self._provider(provider)
        self._model(state, model)  # _pump finds it there
        waiter = _Waiter(model, max(int(tokens), 0))
        state.waiting.append(waiter)
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
                if state.waiting and state.waiting[0] is waiter:
                    scope.deadline = state.wake_at
                await waiter.event.wait()
            waiter.scope = None
            if waiter.admitted is None:
                # Woken by the clock (the first waiter only): look again.
                self._pump(state)

    def _leave(self, state: _Provider, waiter: _Waiter) -> None:
        try:
            state.waiting.remove(waiter)
        except ValueError:
            return
        self._pump(state)

    # --- the provider's state ------------------------------------------------------

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
        return gate

    def _refused(self, state: _Provider, status: int | None, retry_after: float | None) -> None:
        now = trio.current_time()
        if status in PAUSE_STATUSES and retry_after is not None:
            pause = retry_after
        elif status in BACKOFF_STATUSES:
            state.refusals += 1
            pause = self.backoff * 2.0 ** (state.refusals - 1)
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
            held: set[str] = set()  # models held back by their own limits
            for waiter in list(state.waiting):
                if waiter.model in held:
                    continue
                if not provider.fits(waiter.tokens):
                    wake_at = min(wake_at, provider.next_change())
                    break
                gate = state.models[waiter.model]
                gate.expire(now)
                if not gate.fits(waiter.tokens):
                    held.add(waiter.model)
                    wake_at = min(wake_at, gate.next_change())
                    continue
                self._admit(state, gate, waiter, now)
        state.wake_at = wake_at
        if state.waiting:
            first = state.waiting[0]
            if first.scope is not None:
                first.scope.deadline = wake_at

    def _admit(self, state: _Provider, gate: _Gate, waiter: _Waiter, now: float) -> None:
        provider = state.gate
        provider.in_flight += 1
        gate.in_flight += 1
        requests = (provider.requests.add(now, 1), gate.requests.add(now, 1))
        tokens = (
            provider.tokens.add(now, waiter.tokens),
            gate.tokens.add(now, waiter.tokens),
        )
        waiter.admitted = Grant(self, state, gate, requests, tokens)
        state.waiting.remove(waiter)
        waiter.event.set()

    # --- looking -------------------------------------------------------------------

    def snapshot(self) -> list[ProviderLoad]:
        """The load now: per provider (``model=None``), then each of its models, by name."""
        now = trio.current_time()
        rows: list[ProviderLoad] = []
        for name in sorted(self._states):
            state = self._states[name]
            state.gate.expire(now)
            waiting = collections.Counter(w.model for w in state.waiting)
            rows.append(
                _row(name, None, state.gate, len(state.waiting), max(state.paused_until - now, 0))
            )
            for model in sorted(state.models):
                gate = state.models[model]
                gate.expire(now)
                rows.append(_row(name, model, gate, waiting[model], 0.0))
        return rows


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
