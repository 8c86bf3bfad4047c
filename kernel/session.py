"""A conversation kept in a session store: ``Message``s in, entries on disk.

Each message becomes one transcript entry::

    {"type": "<role>", "uuid": "<hex>", "timestamp": "<ISO 8601 UTC>",
     "message": <kernel.messages.converter.unstructure(message)>,
     ...optional "usage", "model", "cost_usd" on assistant entries}

A title is an entry of its own (``{"type": "title", "title": ...}``). Entries
of other types are kept by the store and skipped when reading messages back.

A model turn with tool calls is two entries written at two moments: the
assistant entry before any call runs, then the ``tool`` entry with the
results, which names the assistant entry's uuid in ``"answers"``. A call that
could not be recorded never runs. If the kernel stops in between, reading
the messages back gives each call without a result a ``crashed``
observation, so a conversation never holds a call without its result
(providers refuse that). Older transcripts wrote both entries in one append,
without ``"answers"``: a ``tool`` entry right after an assistant entry
answers it.

Reading messages back goes through a ``kernel.history.HistoryCache``: what a
``Session`` appends goes through it, which reads back from the store the
entries since the last one it folded (checking that one is still there), and
each use reads only what was appended since.
"""

from __future__ import annotations

import uuid as uuid_module
from collections.abc import Callable, Mapping, Sequence
from datetime import UTC, datetime
from typing import Any

from .errors import UsageError
from .history import KERNEL_STOPPED as KERNEL_STOPPED
from .history import HistoryCache
from .history import message_from_entry as message_from_entry
from .history import messages_from_entries as messages_from_entries
from .messages import Message, Observation, converter, recordable
from .store import SessionKey, SessionStore


def utc_timestamp(now: datetime | None = None) -> str:
    """``now`` (default: the current time) as ISO 8601 UTC with milliseconds."""
    moment = now if now is not None else datetime.now(UTC)
    return moment.astimezone(UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def message_entry(
    message: Message, *, timestamp: str, uuid: str | None = None, **extra: Any
) -> dict[str, Any]:
    """The transcript entry for ``message``; ``extra`` fields are added as they are.

    The message is written as ``kernel.messages.recordable`` makes it (lone
    surrogates replaced or escaped), so text from a model or a tool never makes
    an entry unwritable.
    """
    entry: dict[str, Any] = {
        "type": message.role,
        "uuid": uuid if uuid is not None else uuid_module.uuid4().hex,
        "timestamp": timestamp,
        "message": converter.unstructure(recordable(message)),
    }
    entry.update(extra)
    return entry


class Session:
    """One session's transcript in ``store``, read and written as messages.

    ``now`` is the clock for entry timestamps (tests pass a fixed one).
    ``cache`` keeps the messages read between turns; a ``Kernel`` passes its
    own, shared by its sessions; without one, the session has a cache of its
    own (of one session).
    """

    def __init__(
        self,
        store: SessionStore,
        key: SessionKey,
        *,
        now: Callable[[], datetime] | None = None,
        cache: HistoryCache | None = None,
    ) -> None:
        self.store = store
        self.key = key
        self._now = now
        self.cache = cache if cache is not None else HistoryCache(max_sessions=1)

    def _timestamp(self) -> str:
        return utc_timestamp(self._now() if self._now is not None else None)

    def child(self, subagent_id: str) -> Session:
        """The transcript of a subagent of this session (``subagents/<id>``).

        Raises:
            UsageError: ``subagent_id`` is not a valid name.
        """
        key = self.key.child(f"subagents/{subagent_id}")
        return Session(self.store, key, now=self._now, cache=self.cache)

    async def entries(self) -> list[dict[str, Any]]:
        """Every entry, messages or not (empty for a new session)."""
        return await self.store.load(self.key) or []

    async def messages(self) -> list[Message]:
        """The conversation so far (``messages_from_entries`` of every entry).

        Raises:
            StoreError: a message entry's payload is not a message.
            CorruptTranscript: the transcript is damaged mid-file.
        """
        return await self.cache.messages(self.store, self.key)

    async def history(self) -> list[Message]:
        """The conversation the model sees (``kernel.history.history_from_entries``).

        Raises:
            StoreError: a message entry's payload is not a message.
            CorruptTranscript: the transcript is damaged mid-file.
        """
        return await self.cache.history(self.store, self.key)

    async def entries_since_cut(self) -> list[dict[str, Any]]:
        """The entries from the one the latest compaction summarised through (all without one).

        Raises:
            CorruptTranscript: the transcript is damaged mid-file.
        """
        return await self.cache.since_cut(self.store, self.key)

    async def append_entries(self, entries: Sequence[Mapping[str, Any]]) -> None:
        """Add raw transcript ``entries`` in one atomic append (see ``SessionStore.append``).

        Raises:
            UsageError: an entry is not a JSON object with a string ``type``.
            StoreError: the store could not write (nothing was appended).
        """
        await self.cache.append(self.store, self.key, entries)

    async def append(self, *messages: Message) -> None:
        """Add ``messages`` in one atomic append."""
        timestamp = self._timestamp()
        await self.append_entries([message_entry(m, timestamp=timestamp) for m in messages])

    async def set_title(self, title: str) -> None:
        """Name the session (the summary keeps the latest title)."""
        await self.append_entries(
            [
                {
                    "type": "title",
                    "uuid": uuid_module.uuid4().hex,
                    "timestamp": self._timestamp(),
                    "title": title,
                }
            ]
        )

    async def record_turn(
        self,
        assistant: Message,
        observations: Sequence[Observation] = (),
        *,
        usage: Mapping[str, int] | None = None,
        model: str | None = None,
        cost_usd: float | None = None,
    ) -> None:
        """Append a model turn whose calls already have results, in one atomic append.

        A turn whose calls have yet to run is recorded in two steps instead
        (``record_calls`` before they run, ``record_results`` after).

        Raises:
            UsageError: ``assistant`` is not an assistant message, or the
                observations do not answer its tool calls one to one.
        """
        entry = self._assistant_entry(assistant, usage=usage, model=model, cost_usd=cost_usd)
        entries = [entry]
        if assistant.tool_calls or observations:
            entries.append(self._results_entry(assistant, observations, answers=entry["uuid"]))
        await self.append_entries(entries)

    async def record_calls(
        self,
        assistant: Message,
        *,
        usage: Mapping[str, int] | None = None,
        model: str | None = None,
        cost_usd: float | None = None,
    ) -> str:
        """Append the assistant message whose calls are about to run; return its entry's uuid.

        Its calls must not run unless this returned: then every call that runs
        has a record. ``record_results(..., answers=uuid)`` follows.

        Raises:
            UsageError: ``assistant`` is not an assistant message, or the entry
                cannot be written as JSON.
            StoreError: the store failed.
        """
        entry = self._assistant_entry(assistant, usage=usage, model=model, cost_usd=cost_usd)
        await self.append_entries([entry])
        return str(entry["uuid"])

    async def record_results(
        self, assistant: Message, observations: Sequence[Observation], *, answers: str
    ) -> None:
        """Append the results of the calls of ``assistant``, recorded as entry ``answers``.

        The results go in one ``tool`` message, in the order the calls were
        declared (by ``Observation.index``).

        Raises:
            UsageError: the observations do not answer the calls one to one.
        """
        await self.append_entries([self._results_entry(assistant, observations, answers=answers)])

    def _assistant_entry(
        self,
        assistant: Message,
        *,
        usage: Mapping[str, int] | None,
        model: str | None,
        cost_usd: float | None,
    ) -> dict[str, Any]:
        if assistant.role != "assistant":
            raise UsageError(f"assistant: expected role 'assistant', got {assistant.role!r}")
        extra: dict[str, Any] = {}
        if usage is not None:
            extra["usage"] = dict(usage)
        if model is not None:
            extra["model"] = model
        if cost_usd is not None:
            extra["cost_usd"] = cost_usd
        return message_entry(assistant, timestamp=self._timestamp(), **extra)

    def _results_entry(
        self, assistant: Message, observations: Sequence[Observation], *, answers: str
    ) -> dict[str, Any]:
        calls = assistant.tool_calls
        ordered = sorted(observations, key=lambda o: o.index)
        # One observation per call, matched by position: ids may repeat (a model can
        # send duplicates, which the executor answers with invalid_call observations).
        if [o.index for o in ordered] != list(range(len(calls))) or any(
            o.call_id != calls[o.index].id for o in ordered
        ):
            raise UsageError(
                f"observations: answer {[(o.index, o.call_id) for o in ordered]}, "
                f"but the assistant made calls {[(i, c.id) for i, c in enumerate(calls)]}"
            )
        return message_entry(Message("tool", ordered), timestamp=self._timestamp(), answers=answers)
