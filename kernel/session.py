"""A conversation kept in a session store: ``Message``s in, entries on disk.

Each message becomes one transcript entry::

    {"type": "<role>", "uuid": "<hex>", "timestamp": "<ISO 8601 UTC>",
     "message": <kernel.messages.converter.unstructure(message)>,
     ...optional "usage", "model", "cost_usd" on assistant entries}

A title is an entry of its own (``{"type": "title", "title": ...}``). Entries
of other types are kept by the store and skipped when reading messages back.
"""

from __future__ import annotations

import uuid as uuid_module
from collections.abc import Callable, Iterable, Mapping, Sequence
from datetime import UTC, datetime
from typing import Any

from .errors import StoreError, UsageError
from .messages import Message, Observation, converter, describe_structure_error
from .store import SessionKey, SessionStore

_MESSAGE_TYPES = frozenset({"system", "user", "assistant", "tool"})


def utc_timestamp(now: datetime | None = None) -> str:
    """``now`` (default: the current time) as ISO 8601 UTC with milliseconds."""
    moment = now if now is not None else datetime.now(UTC)
    return moment.astimezone(UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def message_entry(
    message: Message, *, timestamp: str, uuid: str | None = None, **extra: Any
) -> dict[str, Any]:
    """The transcript entry for ``message``; ``extra`` fields are added as they are."""
    entry: dict[str, Any] = {
        "type": message.role,
        "uuid": uuid if uuid is not None else uuid_module.uuid4().hex,
        "timestamp": timestamp,
        "message": converter.unstructure(message),
    }
    entry.update(extra)
    return entry


def message_from_entry(entry: Mapping[str, Any]) -> Message | None:
    """The message an entry holds, or ``None`` for an entry that is not a message.

    Raises:
        StoreError: the entry says it is a message but its payload is not one.
    """
    if entry.get("type") not in _MESSAGE_TYPES or "message" not in entry:
        return None
    try:
        return converter.structure(entry["message"], Message)
    except Exception as exc:
        where = entry.get("uuid", "?")
        raise StoreError(
            f"entry {where}: not a message: {describe_structure_error(exc, '$.message')}"
        ) from exc


def messages_from_entries(entries: Iterable[Mapping[str, Any]]) -> list[Message]:
    """The messages among ``entries``, in order.

    Raises:
        StoreError: a message entry's payload is not a message.
    """
    return [m for m in map(message_from_entry, entries) if m is not None]


class Session:
    """One session's transcript in ``store``, read and written as messages.

    ``now`` is the clock for entry timestamps (tests pass a fixed one).
    """

    def __init__(
        self,
        store: SessionStore,
        key: SessionKey,
        *,
        now: Callable[[], datetime] | None = None,
    ) -> None:
        self.store = store
        self.key = key
        self._now = now

    def _timestamp(self) -> str:
        return utc_timestamp(self._now() if self._now is not None else None)

    def child(self, subagent_id: str) -> Session:
        """The transcript of a subagent of this session (``subagents/<id>``).

        Raises:
            UsageError: ``subagent_id`` is not a valid name.
        """
        return Session(self.store, self.key.child(f"subagents/{subagent_id}"), now=self._now)

    async def entries(self) -> list[dict[str, Any]]:
        """Every entry, messages or not (empty for a new session)."""
        return await self.store.load(self.key) or []

    async def messages(self) -> list[Message]:
        """The conversation so far.

        Raises:
            StoreError: a message entry's payload is not a message.
            CorruptTranscript: the transcript is damaged mid-file.
        """
        return messages_from_entries(await self.entries())

    async def append(self, *messages: Message) -> None:
        """Add ``messages`` in one atomic append."""
        timestamp = self._timestamp()
        await self.store.append(self.key, [message_entry(m, timestamp=timestamp) for m in messages])

    async def set_title(self, title: str) -> None:
        """Name the session (the summary keeps the latest title)."""
        await self.store.append(
            self.key,
            [
                {
                    "type": "title",
                    "uuid": uuid_module.uuid4().hex,
                    "timestamp": self._timestamp(),
                    "title": title,
                }
            ],
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
        """Append a model turn: the assistant message, then its tool results.

        The results go in one ``tool`` message, in the order the calls were
        declared (by ``Observation.index``), and both messages go in one
        atomic append: a transcript never holds a call without its result.

        Raises:
            UsageError: ``assistant`` is not an assistant message, or the
                observations do not answer its tool calls one to one.
        """
        if assistant.role != "assistant":
            raise UsageError(f"assistant: expected role 'assistant', got {assistant.role!r}")
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
        timestamp = self._timestamp()
        extra: dict[str, Any] = {}
        if usage is not None:
            extra["usage"] = dict(usage)
        if model is not None:
            extra["model"] = model
        if cost_usd is not None:
            extra["cost_usd"] = cost_usd
        entries = [message_entry(assistant, timestamp=timestamp, **extra)]
        if ordered:
            tool = Message("tool", ordered)
            entries.append(message_entry(tool, timestamp=timestamp))
        await self.store.append(self.key, entries)
