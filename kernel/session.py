"""A conversation kept in a session store: ``Message``s in, entries on disk.

``Session`` owns the transcript's entry format: each kind of entry is a
record here, turned into the JSON object the store keeps by this module's own
converter (``entry_to_json``), and back (``entry_from_json``)::

    MessageEntry     {"type": "<role>", "uuid": "<hex>", "timestamp": "<ISO 8601 UTC>",
                      "message": <kernel.messages.converter.unstructure(message)>,
                      ...optional "usage", "model", "cost_usd", "partial",
                      "stop_reason" (assistant entries), "answers" and
                      "resume" (tool entries)}
    TitleEntry       {"type": "title", "uuid", "timestamp", "title"}
    CompactionEntry  {"type": "compaction", "uuid", "timestamp", "summary",
                      "through", "usage", "model", ...optional "cost_usd"}

Optional fields that are not set are left out, so the bytes on disk are what
they were before these records existed. Entries of other types are kept by
the store and skipped when reading messages back. The store sees only the
JSON objects (its summary fold reads ``type``, ``usage``, ``cost_usd``,
``timestamp``, ``title`` and ``model``).

A model turn with tool calls is two entries written at two moments: the
assistant entry before any call runs, then the ``tool`` entry with the
results, which names the assistant entry's uuid in ``"answers"``. A call that
could not be recorded never runs. If the kernel stops in between, reading
the messages back gives each call without a result a ``crashed``
observation, so a conversation never holds a call without its result
(providers refuse that). Older transcripts wrote both entries in one append,
without ``"answers"``: a ``tool`` entry right after an assistant entry
answers it.

One turn at a time: a turn holds its session's turn lock
(``Session.hold_turn``) among the sessions sharing a ``HistoryCache``, that is
within one ``Kernel``. Across processes nothing serialises two turns; only
the results a resume records for interrupted calls are written so that two
resumes racing write one entry (``Session.record_interrupted``).

Reading messages back goes through a ``kernel.history.HistoryCache``: each
use reads from the store the entries since the last one it folded (checking
that one is still there), its own appends included; an entry this
``Session`` wrote and reads back unchanged is not structured again.
"""

from __future__ import annotations

import contextlib
import uuid as uuid_module
from collections.abc import Callable, Mapping, Sequence
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any, Literal, TypeAlias, get_args

import attrs
import cattrs
from cattrs.gen import make_dict_unstructure_fn, override

from .errors import StoreError, UsageError
from .history import KERNEL_STOPPED as KERNEL_STOPPED
from .history import HistoryCache, history_from_entries
from .history import message_from_entry as message_from_entry
from .history import messages_from_entries as messages_from_entries
from .home import DEFAULT_PROJECT as DEFAULT_PROJECT
from .messages import (
    Message,
    Observation,
    Role,
    Text,
    converter,
    describe_structure_error,
    recordable,
)
from .store import SessionKey, SessionStore

if TYPE_CHECKING:
    from .models import Usage

__all__ = [
    "KERNEL_STOPPED",
    "CompactionCandidate",
    "CompactionEntry",
    "MessageEntry",
    "Session",
    "TitleEntry",
    "TranscriptEntry",
    "entry_from_json",
    "entry_to_json",
    "message_entry",
    "message_from_entry",
    "messages_from_entries",
    "usage_entry_fields",
    "utc_timestamp",
]


def _new_uuid() -> str:
    return uuid_module.uuid4().hex


def _role_matches(instance: MessageEntry, attribute: attrs.Attribute[Any], value: Role) -> None:
    if value != instance.message.role:
        raise UsageError(f"MessageEntry.type: {value!r} is not the message's role")


@attrs.frozen(kw_only=True)
class MessageEntry:
    """A message of the conversation; ``type`` is its role.

    ``usage``, ``model`` and ``cost_usd`` describe the model response an
    assistant message is; ``answers`` is the uuid of the assistant entry whose
    calls a ``tool`` message answers. ``partial`` marks an assistant message
    whose reply was cut short (the turn was cancelled, or the model failed,
    mid-stream): the text the user already saw streamed. It stays in the
    conversation the model is sent next, as the assistant's words.
    ``stop_reason`` is ``"max_tokens"`` on an assistant message the token
    limit cut, with which its turn ended without a final answer (absent on
    any other). ``resume`` is set on the results a resume recorded for calls
    that were running when the run stopped: the id of that resume
    (``Session.record_interrupted``).
    """

    type: Role = attrs.field(validator=_role_matches)
    uuid: str = attrs.field(factory=_new_uuid)
    timestamp: str
    message: Message
    usage: dict[str, int] | None = None
    model: str | None = None
    cost_usd: float | None = None
    answers: str | None = None
    partial: bool | None = None
    stop_reason: str | None = None
    resume: str | None = None

    @classmethod
    def of(cls, message: Message, **fields: Any) -> MessageEntry:
        """The entry for ``message`` (its role as ``type``)."""
        return cls(type=message.role, message=message, **fields)


@attrs.frozen(kw_only=True)
class TitleEntry:
    """The session's name (the store's summary keeps the latest)."""

    type: Literal["title"] = "title"
    uuid: str = attrs.field(factory=_new_uuid)
    timestamp: str
    title: str


@attrs.frozen(kw_only=True)
class CompactionEntry:
    """A summary of the conversation up to and including the entry ``through`` names.

    The model's view of the transcript starts with ``summary``, then the
    entries after ``through`` (``kernel.history.compaction_cut``); ``through``
    is ``None`` when that entry had no uuid.
    """

    type: Literal["compaction"] = "compaction"
    uuid: str = attrs.field(factory=_new_uuid)
    timestamp: str
    summary: str
    through: str | None
    usage: dict[str, int]
    model: str
    cost_usd: float | None = None


TranscriptEntry: TypeAlias = MessageEntry | TitleEntry | CompactionEntry


@attrs.frozen
class CompactionCandidate:
    """What a compaction would summarise (``Session.compaction_candidate``).

    Attributes:
        messages: the model's view of the conversation before the last turns
            kept (what the summary stands for from then on).
        through: the uuid of the last entry it covers (``CompactionEntry.through``).
        prompt_tokens: how big the next prompt is.
    """

    messages: tuple[Message, ...]
    through: str | None
    prompt_tokens: int


def usage_entry_fields(usage: Usage) -> dict[str, int]:
    """What an entry's ``usage`` records of a model response (the store's summary sums it)."""
    return {
        "input_tokens": usage.total_input_tokens,
        "output_tokens": usage.output_tokens,
        "cache_read_tokens": usage.cache_read_tokens,
        "cache_write_tokens": usage.cache_write_tokens,
    }


_ENTRY_CLASSES: dict[str, type[TranscriptEntry]] = {
    **dict.fromkeys(get_args(Role), MessageEntry),
    "title": TitleEntry,
    "compaction": CompactionEntry,
}


def _make_entry_converter() -> cattrs.Converter:
    # A copy: the entry hooks (optional fields left out when unset, so old and
    # new transcripts are the same bytes) are this module's, not every record's.
    conv = converter.copy()
    # cattrs' copy() leaves out hooks registered for a union type (the message
    # parts' tagged union, a call's arguments): structure messages with the
    # converter that has them.
    conv.register_structure_hook(Message, lambda value, _: converter.structure(value, Message))
    omit = override(omit_if_default=True)
    conv.register_unstructure_hook(
        MessageEntry,
        make_dict_unstructure_fn(
            MessageEntry,
            conv,
            usage=omit,
            model=omit,
            cost_usd=omit,
            answers=omit,
            partial=omit,
            stop_reason=omit,
            resume=omit,
        ),
    )
    conv.register_unstructure_hook(TitleEntry, make_dict_unstructure_fn(TitleEntry, conv))
    conv.register_unstructure_hook(
        CompactionEntry, make_dict_unstructure_fn(CompactionEntry, conv, cost_usd=omit)
    )
    return conv


_entry_converter = _make_entry_converter()


def entry_to_json(entry: TranscriptEntry) -> dict[str, Any]:
    """The JSON object the store keeps for ``entry``."""
    data: dict[str, Any] = _entry_converter.unstructure(entry, type(entry))
    return data


def entry_from_json(data: Mapping[str, Any]) -> TranscriptEntry | None:
    """The record a stored entry is, or ``None`` for a type this module does not write.

    Raises:
        StoreError: the entry has a known type but is not that record
            (``entry <uuid>: $.path: reason``).
    """
    kind = data.get("type")
    cls = _ENTRY_CLASSES.get(kind) if isinstance(kind, str) else None
    if cls is None:
        return None
    try:
        entry: TranscriptEntry = _entry_converter.structure(dict(data), cls)
    except Exception as exc:
        where = data.get("uuid", "?")
        raise StoreError(
            f"entry {where}: not a {data['type']} entry: {describe_structure_error(exc)}"
        ) from exc
    return entry


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
    record = MessageEntry.of(
        recordable(message), timestamp=timestamp, **({} if uuid is None else {"uuid": uuid})
    )
    entry = entry_to_json(record)
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

    def hold_turn(self, *, wait: bool = True) -> contextlib.AbstractAsyncContextManager[None]:
        """Hold this session's turn lock for a block (``HistoryCache.hold_turn``).

        Every ``Agent`` turn holds it: turns on one session, from sessions that
        share the cache (a ``Kernel``'s do), run one after the other.

        Raises:
            UsageError: not ``wait``, and a turn holds the session.
        """
        return self.cache.hold_turn(self.key, wait=wait)

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

    async def compaction_candidate(
        self, *, keep_last_turns: int, min_prompt_tokens: int
    ) -> CompactionCandidate | None:
        """What to summarise so that the last ``keep_last_turns`` user prompts stay as they are.

        ``None`` when the next prompt is smaller than ``min_prompt_tokens`` or
        there are no more user prompts than that since the latest compaction.
        Reads from the entry the latest compaction summarised through: what is
        before it is in that summary already.

        Raises:
            StoreError: a message entry's payload is not a message.
            CorruptTranscript: the transcript is damaged mid-file.
        """
        entries = await self.entries_since_cut()
        tokens = _prompt_tokens(entries)
        if tokens < min_prompt_tokens:
            return None
        start = _after_latest_compaction(entries)
        user_positions = [i for i in range(start, len(entries)) if entries[i].get("type") == "user"]
        if len(user_positions) <= keep_last_turns:
            return None
        cut = user_positions[-keep_last_turns]
        through = entries[cut - 1].get("uuid")
        return CompactionCandidate(
            messages=tuple(history_from_entries(entries[:cut])),
            through=through if isinstance(through, str) else None,
            prompt_tokens=tokens,
        )

    async def append_entries(self, entries: Sequence[Mapping[str, Any]]) -> None:
        """Add raw transcript ``entries`` in one atomic append (see ``SessionStore.append``).

        Raises:
            UsageError: an entry is not a JSON object with a string ``type``.
            StoreError: the store could not write (nothing was appended).
        """
        await self.cache.append(self.store, self.key, entries)

    async def record(self, *entries: TranscriptEntry) -> None:
        """Add ``entries`` in one atomic append.

        Raises:
            UsageError: an entry cannot be written as JSON.
            StoreError: the store could not write (nothing was appended).
        """
        # The cache is told each entry's message: read back as written, it is not
        # structured again.
        await self.cache.append(
            self.store,
            self.key,
            [entry_to_json(e) for e in entries],
            messages=[e.message if isinstance(e, MessageEntry) else None for e in entries],
        )

    async def append(self, *messages: Message) -> list[Message]:
        """Add ``messages`` in one atomic append (as ``message_entry`` writes them);
        the messages as recorded (what the model is sent from now on)."""
        timestamp = self._timestamp()
        entries = [MessageEntry.of(recordable(m), timestamp=timestamp) for m in messages]
        await self.record(*entries)
        return [e.message for e in entries]

    async def record_title(self, title: str) -> None:
        """Name the session (the summary keeps the latest title)."""
        await self.record(TitleEntry(timestamp=self._timestamp(), title=title))

    async def set_title(self, title: str) -> None:
        """``record_title`` (the older name)."""
        await self.record_title(title)

    async def record_compaction(
        self,
        summary: str,
        *,
        through: str | None,
        usage: Mapping[str, int],
        model: str,
        cost_usd: float | None = None,
    ) -> None:
        """Record that ``summary`` stands for the conversation up to entry ``through``.

        ``usage``, ``model`` and ``cost_usd`` describe the model response that
        wrote the summary. The model's view of the session starts from it (see
        ``kernel.history.compaction_cut``).

        Raises:
            StoreError: the store could not write (nothing was appended).
        """
        await self.record(
            CompactionEntry(
                timestamp=self._timestamp(),
                summary=summary,
                through=through,
                usage=dict(usage),
                model=model,
                cost_usd=cost_usd,
            )
        )

    async def record_partial(self, text: str, *, model: str | None = None) -> None:
        """Record the text of an assistant reply that was cut short mid-stream
        (``partial: true``), so the transcript holds what the user saw."""
        message = recordable(Message("assistant", [Text(text)]))
        await self.record(
            MessageEntry.of(message, timestamp=self._timestamp(), model=model, partial=True)
        )

    async def record_turn(
        self,
        assistant: Message,
        observations: Sequence[Observation] = (),
        *,
        usage: Mapping[str, int] | None = None,
        model: str | None = None,
        cost_usd: float | None = None,
        stop_reason: str | None = None,
    ) -> Message:
        """Append a model turn whose calls already have results, in one atomic append;
        the assistant message as recorded.

        A turn whose calls have yet to run is recorded in two steps instead
        (``record_calls`` before they run, ``record_results`` after).
        ``stop_reason``: see ``MessageEntry``.

        Raises:
            UsageError: ``assistant`` is not an assistant message, or the
                observations do not answer its tool calls one to one.
        """
        entry = self._assistant_entry(assistant, usage=usage, model=model, cost_usd=cost_usd)
        if stop_reason is not None:
            entry = attrs.evolve(entry, stop_reason=stop_reason)
        entries: list[TranscriptEntry] = [entry]
        if assistant.tool_calls or observations:
            entries.append(self._results_entry(entry.message, observations, answers=entry.uuid))
        await self.record(*entries)
        return entry.message

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
        entry = await self.record_assistant(assistant, usage=usage, model=model, cost_usd=cost_usd)
        return entry.uuid

    async def record_assistant(
        self,
        assistant: Message,
        *,
        usage: Mapping[str, int] | None = None,
        model: str | None = None,
        cost_usd: float | None = None,
    ) -> MessageEntry:
        """``record_calls``, giving the entry: its ``uuid`` and its ``message`` as
        recorded (``kernel.messages.recordable``), whose calls are the ones to run.

        Raises:
            UsageError, StoreError: as ``record_calls``.
        """
        entry = self._assistant_entry(assistant, usage=usage, model=model, cost_usd=cost_usd)
        await self.record(entry)
        return entry

    async def record_results(
        self, assistant: Message, observations: Sequence[Observation], *, answers: str
    ) -> None:
        """Append the results of the calls of ``assistant``, recorded as entry ``answers``.

        The results go in one ``tool`` message, in the order the calls were
        declared (by ``Observation.index``).

        Raises:
            UsageError: the observations do not answer the calls one to one.
        """
        await self.record(self._results_entry(assistant, observations, answers=answers))

    async def record_interrupted(
        self, assistant: Message, observations: Sequence[Observation], *, answers: str
    ) -> bool:
        """``record_results`` for a resume; whether these are the results that count.

        The results that count are the first entry answering ``answers``
        (``kernel.history``). Two resumes of one transcript (in two
        processes: within one, turns hold the session's lock) write one entry
        under one uuid made from ``answers``, which the store keeps once, each
        marked with its own ``resume`` id: reading it back, the one whose id
        is there goes on, the other knows it lost. ``False`` as well when
        other results came first (the turn itself still running elsewhere):
        those are looked for right before writing, so as not to write a
        second answer when it can be helped.

        Raises:
            UsageError: the observations do not answer the calls one to one.
            StoreError: the store failed.
        """
        entry = attrs.evolve(
            self._results_entry(assistant, observations, answers=answers),
            uuid=uuid_module.uuid5(_INTERRUPTED_NAMESPACE, answers).hex,
            resume=_new_uuid(),
        )
        # Read right before: results that came meanwhile are not answered twice.
        if await self._first_answer(answers) is not None:
            return False
        await self.record(entry)
        first = await self._first_answer(answers)
        # None: rewritten meanwhile (deleted?), not ours to go on with.
        return (
            first is not None
            and first.get("uuid") == entry.uuid
            and first.get("resume") == entry.resume
        )

    async def _first_answer(self, answers: str) -> Mapping[str, Any] | None:
        """The first entry that records results for the assistant entry ``answers``."""
        for stored in await self.entries_since_cut():
            if stored.get("type") == "tool" and stored.get("answers") == answers:
                return stored
        return None

    def _assistant_entry(
        self,
        assistant: Message,
        *,
        usage: Mapping[str, int] | None,
        model: str | None,
        cost_usd: float | None,
    ) -> MessageEntry:
        if assistant.role != "assistant":
            raise UsageError(f"assistant: expected role 'assistant', got {assistant.role!r}")
        return MessageEntry.of(
            recordable(assistant),
            timestamp=self._timestamp(),
            usage=None if usage is None else dict(usage),
            model=model,
            cost_usd=cost_usd,
        )

    def _results_entry(
        self, assistant: Message, observations: Sequence[Observation], *, answers: str
    ) -> MessageEntry:
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
        return MessageEntry.of(
            recordable(Message("tool", ordered)), timestamp=self._timestamp(), answers=answers
        )


#: The uuids of results recorded for interrupted calls: one per assistant entry.
_INTERRUPTED_NAMESPACE = uuid_module.UUID("6d1f2f7e-5c57-4a8e-9a57-2a1c0b3e7d41")


def _after_latest_compaction(entries: Sequence[Mapping[str, Any]]) -> int:
    for position in range(len(entries) - 1, -1, -1):
        if entries[position].get("type") == "compaction":
            return position + 1
    return 0


_ATTACHMENT_TOKENS = 1600


def _prompt_tokens(entries: Sequence[Mapping[str, Any]]) -> int:
    """How big the next prompt is: the provider's own count from the latest response.

    Falls back to about four characters a token when no entry carries usage.
    """
    for entry in reversed(entries):
        if entry.get("type") == "compaction":
            break  # counts from before it are stale
        usage = entry.get("usage")
        if entry.get("type") == "assistant" and isinstance(usage, Mapping):
            counted = int(usage.get("input_tokens", 0)) + int(usage.get("output_tokens", 0))
            if counted > 0:  # zero: the model reported nothing (a scripted one, say)
                return counted
            break
    history = history_from_entries(entries)
    characters = sum(
        len(part.text) if isinstance(part, Text) else len(str(part))
        for message in history
        for part in message.parts
    )
    # A provider bills an image by its pixels, not its bytes (about 1,600 tokens
    # for a screenshot: kernel.models ATTACHMENT_TOKENS); its repr is short.
    attachments = sum(len(o.attachments) for message in history for o in message.observations)
    return characters // 4 + attachments * _ATTACHMENT_TOKENS
