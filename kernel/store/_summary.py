"""Session summaries and the pure fold that builds them.

``fold_session_summary(prev, key, entries)`` reads only the entries' top-level
fields the summary is about (``type``, ``usage``, ``cost_usd``, ``timestamp``,
``title``, ``model``); everything else in an entry is opaque to it. The fold
is associative, ``fold(fold(p, a), b) == fold(p, a + b)``, which lets a store
fold an append's entries onto the summary it already has, or catch a stale
summary up by folding only the entries written after it.

Cost is summed in whole nano-dollars (each entry's ``cost_usd`` rounded
once), because float addition is not associative.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any

import attrs

from ..errors import UsageError
from ._key import SessionKey


@attrs.frozen
class SessionInfo:
    """A main transcript as ``list_sessions`` sees it: no entry is read."""

    session_id: str
    mtime_ms: int


@attrs.frozen(hash=False)
class SummaryData:
    """What the fold keeps about a transcript.

    ``type_counts`` maps an entry ``type`` to how many entries have it;
    tokens come from ``entry["usage"]["input_tokens"|"output_tokens"]``;
    timestamps, ``title`` and ``model`` are the first/last such string seen.
    """

    entry_count: int = 0
    type_counts: dict[str, int] = attrs.field(factory=dict)
    input_tokens: int = 0
    output_tokens: int = 0
    cost_nano_usd: int = 0
    first_timestamp: str | None = None
    last_timestamp: str | None = None
    title: str | None = None
    model: str | None = None

    @property
    def cost_usd(self) -> float:
        return self.cost_nano_usd / 1e9


@attrs.frozen(hash=False)
class SessionSummary:
    """A main transcript's summary.

    ``mtime_ms`` is stamped by the store after it persists an append (epoch
    milliseconds from the store's clock); the fold never changes it. ``problem``
    is set, and ``data`` empty, for a transcript too damaged to read.
    """

    session_id: str
    mtime_ms: int
    data: SummaryData = attrs.field(factory=SummaryData)
    #: Why the summary could not be built (a damaged transcript), else ``None``.
    problem: str | None = None


def _count(value: object) -> int:
    # Subclasses (IntEnum) count as the JSON number they are written as; bool does not.
    if isinstance(value, int) and not isinstance(value, bool) and value > 0:
        return int(value)
    return 0


class SummaryBuilder:
    """The fold's working state: entries are added in place, ``data()`` freezes it.

    ``fold_session_summary`` is this builder run once; a store keeps one per
    open session so an append costs a few dict lookups, not a new record.
    """

    __slots__ = (
        "_cache",
        "_cost",
        "_count",
        "_first",
        "_input",
        "_last",
        "_model",
        "_output",
        "_title",
        "_types",
    )

    def __init__(self, start: SummaryData | None = None) -> None:
        s = start if start is not None else SummaryData()
        self._count = s.entry_count
        self._types = dict(s.type_counts)
        self._input = s.input_tokens
        self._output = s.output_tokens
        self._cost = s.cost_nano_usd
        self._first = s.first_timestamp
        self._last = s.last_timestamp
        self._title = s.title
        self._model = s.model
        self._cache: SummaryData | None = s if start is not None else None

    def add(self, entry: Mapping[str, Any]) -> None:
        self._cache = None
        self._count += 1
        kind = entry.get("type")
        if isinstance(kind, str):
            self._types[kind] = self._types.get(kind, 0) + 1
        usage = entry.get("usage")
        if usage is not None and isinstance(usage, Mapping):
            self._input += _count(usage.get("input_tokens"))
            self._output += _count(usage.get("output_tokens"))
        cost = entry.get("cost_usd")
        if cost is not None:
            if isinstance(cost, int) and not isinstance(cost, bool):
                self._cost += int(cost) * 1_000_000_000
            elif isinstance(cost, float):
                nanos = float(cost) * 1e9
                if math.isfinite(nanos):
                    self._cost += round(nanos)
        timestamp = entry.get("timestamp")
        if isinstance(timestamp, str):
            if self._first is None:
                self._first = timestamp
            self._last = timestamp
        title = entry.get("title")
        if isinstance(title, str):
            self._title = title
        model = entry.get("model")
        if isinstance(model, str):
            self._model = model

    def add_all(self, entries: Iterable[Mapping[str, Any]]) -> None:
        for entry in entries:
            self.add(entry)

    def data(self) -> SummaryData:
        if self._cache is None:
            self._cache = SummaryData(
                entry_count=self._count,
                type_counts=dict(self._types),
                input_tokens=self._input,
                output_tokens=self._output,
                cost_nano_usd=self._cost,
                first_timestamp=self._first,
                last_timestamp=self._last,
                title=self._title,
                model=self._model,
            )
        return self._cache


def fold_session_summary(
    prev: SessionSummary | None, key: SessionKey, entries: Iterable[Mapping[str, Any]]
) -> SessionSummary:
    """``prev`` with ``entries`` (appended to ``key``'s main transcript) folded in.

    Pure: no I/O, no clock, ``prev`` is not changed; ``mtime_ms`` is carried
    over from ``prev`` (0 when there is none), since only the store stamps it.

    Raises:
        UsageError: ``key`` names a child transcript (summaries are kept for
            main transcripts only), or ``prev`` belongs to another session.
    """
    if key.subpath is not None:
        raise UsageError(f"{key}: summaries are kept for main transcripts only")
    if prev is not None and prev.session_id != key.session_id:
        raise UsageError(f"prev: summary of session {prev.session_id!r}, not {key.session_id!r}")
    builder = SummaryBuilder(prev.data if prev is not None else None)
    builder.add_all(entries)
    return SessionSummary(
        session_id=key.session_id,
        mtime_ms=prev.mtime_ms if prev is not None else 0,
        data=builder.data(),
    )
