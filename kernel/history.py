"""A transcript's entries read back as messages, once per entry, and kept between turns.

``messages_from_entries`` and ``history_from_entries`` are the reference
readings of a transcript (the entry format is described in
``kernel.session``). ``MessageFold`` is the first of them done one entry at a
time, so that a transcript already read is never read again: a
``HistoryCache`` keeps, for each session it saw recently, the fold of its
entries from the latest compaction's cut on, and extends it, always with
entries read from the store:

1. at each use, with what was appended since it last looked (by this
   process or others), read with ``iter_entries(key, start=n - 1)``: the
   first entry read must be the last one folded, otherwise the transcript
   was deleted, repaired or rewritten, and the fold is rebuilt from the
   store;
2. never with entries unread: what this process appends (``append``) is
   folded at the next use, read back like anyone else's. Folding our own
   entries unread would break the check of 1: after another process deletes
   the session and writes as many entries as were folded, our next append
   lands where the cache expects it, and the entry at ``n - 1`` would then
   be our own, so the deleted conversation would be kept. Read from the
   entry before them, the entry at ``n - 1`` is the other process's, and
   the fold is rebuilt. Reading at the next use rather than right after
   each append gives the same answer with one read a turn instead of five
   (a turn appends four times, and reads its history once);
3. when a ``compaction`` entry arrives, the fold is rebuilt from the new cut
   (reading only the entries since the previous cut).

A cache is an optimisation checked against the store: what it returns is
what the reference functions give for the transcript as the store holds it.
It holds at most ``max_sessions`` sessions and ``max_entries`` folded
entries; the least recently used session is dropped whole. ``release_idle``
drops the sessions not used for a while (a ``Kernel`` calls it, see
``kernel.kernel.IdleSessions``).
"""

from __future__ import annotations

import contextlib
import math
from collections import OrderedDict
from collections.abc import AsyncIterator, Container, Iterable, Mapping, Sequence
from typing import Any, get_args

import trio

from ._checks import check_positive
from .errors import StoreError, TurnRunning
from .messages import Message, Observation, Role, Text, ToolCall, ToolError, converter
from .messages import describe_structure_error as _describe
from .store import SessionKey, SessionStore

__all__ = [
    "KERNEL_STOPPED",
    "MESSAGE_TYPES",
    "SUMMARY_PREFIX",
    "HistoryCache",
    "MessageFold",
    "compaction_cut",
    "history_from_entries",
    "is_message_entry",
    "message_from_entry",
    "messages_from_entries",
]

#: The entry types that hold a message (the others: a title, a compaction, usage...).
MESSAGE_TYPES = frozenset(get_args(Role))


def is_message_entry(entry: Mapping[str, Any]) -> bool:
    """Whether ``entry`` holds a message (its ``type`` is one and it has a payload)."""
    return entry.get("type") in MESSAGE_TYPES and "message" in entry


#: What a call without a recorded result is answered with when a transcript is read.
KERNEL_STOPPED = ToolError(
    "crashed", "KernelStopped", "the kernel stopped before this call finished"
)

SUMMARY_PREFIX = "[Summary of the earlier conversation]\n"

#: Known messages a cached session keeps between two uses (``HistoryCache.append``).
_MAX_KNOWN = 256


def message_from_entry(entry: Mapping[str, Any]) -> Message | None:
    """The message an entry holds, or ``None`` for an entry that is not a message.

    Raises:
        StoreError: the entry says it is a message but its payload is not one.
    """
    if not is_message_entry(entry):
        return None
    try:
        return converter.structure(entry["message"], Message)
    except Exception as exc:
        where = entry.get("uuid", "?")
        raise StoreError(f"entry {where}: not a message: {_describe(exc, '$.message')}") from exc


def _answer_every_call(calls: Sequence[ToolCall], results: Message | None) -> Message:
    """The tool message for ``calls``: the recorded result of each, else ``KERNEL_STOPPED``."""
    recorded = {
        o.index: o
        for o in (results.observations if results is not None else ())
        if o.index < len(calls) and o.call_id == calls[o.index].id
    }
    if results is not None and len(recorded) == len(calls) == len(results.parts):
        return results
    return Message(
        "tool",
        [
            recorded.get(index) or Observation.failure(call, index, KERNEL_STOPPED)
            for index, call in enumerate(calls)
        ],
    )


class _Waiting:
    """An assistant message's calls whose ``answers`` entry has not arrived (yet)."""

    __slots__ = ("calls", "legacy", "slot")

    def __init__(self, slot: int, calls: tuple[ToolCall, ...]) -> None:
        self.slot = slot  # where its tool message sits in MessageFold.messages
        self.calls = calls
        # The result of an older transcript, written right after it without
        # "answers": used until (and unless) an "answers" entry turns up.
        self.legacy: Message | None = None


class MessageFold:
    """``messages_from_entries``, one entry at a time.

    After ``add`` of every entry of a transcript, ``messages`` is what
    ``messages_from_entries`` gives for the same entries. An assistant
    message's calls are followed by a tool message at once (``crashed``
    results while none is recorded), replaced when the entry that answers
    them arrives.
    """

    __slots__ = (
        "_after_calls",
        "_answers",
        "_unused",
        "_waiting",
        "known",
        "messages",
        "system_messages",
    )

    def __init__(self) -> None:
        #: By uuid: entries whose message is known already (``HistoryCache.append``),
        #: each with that message; an entry read equal to one is not structured again.
        self.known: dict[str, tuple[Mapping[str, Any], Message]] = {}
        self.messages: list[Message] = []
        self.system_messages = 0
        # By assistant uuid (as str): the results of the first "answers" entry
        # naming it, once used; the raw entry while no assistant used it.
        self._answers: dict[str, Message | None] = {}
        self._unused: dict[str, Mapping[str, Any]] = {}
        self._waiting: dict[str, list[_Waiting]] = {}
        self._after_calls: _Waiting | None = None  # the entry just added, if it had calls

    def add_all(self, entries: Iterable[Mapping[str, Any]]) -> None:
        """``add`` each of ``entries``, in order.

        Raises:
            StoreError: a message entry's payload is not a message.
        """
        for entry in entries:
            self.add(entry)

    def add(self, entry: Mapping[str, Any]) -> None:
        """Fold the transcript's next entry.

        Raises:
            StoreError: a message entry's payload is not a message.
        """
        previous, self._after_calls = self._after_calls, None
        kind = entry.get("type")
        if kind == "tool" and "answers" in entry:
            answers = entry["answers"]
            if isinstance(answers, str):
                self._add_answer(answers, entry)
            return  # a linked result is read with its calls, or has none here
        if kind == "tool" and previous is not None and previous.legacy is None:
            # An older transcript's result, answering the calls just before it
            # unless an "answers" entry does (then it stands on its own).
            results = self._message_of(entry)
            if results is not None:
                previous.legacy = results
                self.messages[previous.slot] = _answer_every_call(previous.calls, results)
            else:
                previous.legacy = _NO_MESSAGE
            return
        message = self._message_of(entry)
        if message is None:
            return
        self.messages.append(message)
        if message.role == "system":
            self.system_messages += 1
        calls = message.tool_calls
        if message.role != "assistant" or not calls:
            return
        key = str(entry.get("uuid"))
        if key in self._unused:
            self._answers[key] = self._message_of(self._unused.pop(key))
        if key in self._answers:
            self.messages.append(_answer_every_call(calls, self._answers[key]))
            return
        waiting = _Waiting(len(self.messages), calls)
        self.messages.append(_answer_every_call(calls, None))
        self._waiting.setdefault(key, []).append(waiting)
        self._after_calls = waiting

    def _add_answer(self, key: str, entry: Mapping[str, Any]) -> None:
        if key in self._answers or key in self._unused:
            return  # the first entry answering an assistant entry is the one
        waiting = self._waiting.get(key)
        if waiting is None:
            self._unused[key] = entry  # its assistant entry may come later
            return
        results = self._answers[key] = self._message_of(entry)
        for w in waiting:  # still listed: an insertion moves the later ones too
            self.messages[w.slot] = _answer_every_call(w.calls, results)
            if w.legacy is not None and w.legacy is not _NO_MESSAGE:
                # The older-format result no longer answers: it stands on its own.
                self._insert_after(w.slot, w.legacy)
        del self._waiting[key]

    def _message_of(self, entry: Mapping[str, Any]) -> Message | None:
        """``message_from_entry``, without structuring an entry that reads as it was written."""
        uuid = entry.get("uuid")
        known = self.known.pop(uuid, None) if self.known and isinstance(uuid, str) else None
        if known is not None and known[0] == entry:
            return known[1]
        return message_from_entry(entry)

    def _insert_after(self, slot: int, message: Message) -> None:
        self.messages.insert(slot + 1, message)
        for group in self._waiting.values():
            for w in group:
                if w.slot > slot:
                    w.slot += 1


# A legacy result entry that held no message: it answered, with nothing.
_NO_MESSAGE = Message("tool", [])


def messages_from_entries(entries: Iterable[Mapping[str, Any]]) -> list[Message]:
    """The messages among ``entries``, in order, every tool call followed by its result.

    An assistant message's calls are followed by the ``tool`` entry that answers
    them (see ``kernel.session``) wherever it was written; a call it does not
    answer (none was written: the kernel stopped) gets a ``crashed`` observation.
    A ``tool`` entry whose assistant entry is not among ``entries`` (before a
    compaction's cut) is left out.

    Raises:
        StoreError: a message entry's payload is not a message.
    """
    fold = MessageFold()
    fold.add_all(entries)
    return fold.messages


def compaction_cut(entries: Sequence[Mapping[str, Any]]) -> tuple[int, str | None]:
    """Where the model's view of ``entries`` starts, and the summary it starts with.

    The latest ``compaction`` entry summarises every message up to and
    including the entry whose uuid is its ``through``: the view starts after
    that entry (after the compaction entry itself if ``through`` is not
    found). ``(0, None)`` without a compaction.
    """
    start, summary, _ = _find_cut(entries)
    return start, summary


def _find_cut(entries: Sequence[Mapping[str, Any]]) -> tuple[int, str | None, bool]:
    """``compaction_cut``, and whether the ``through`` entry was found (a str uuid)."""
    for position in range(len(entries) - 1, -1, -1):
        entry = entries[position]
        if entry.get("type") == "compaction":
            through = entry.get("through")
            found = next((i for i, e in enumerate(entries) if e.get("uuid") == through), None)
            summary = str(entry.get("summary", ""))
            if found is None:
                return position + 1, summary, False
            return found + 1, summary, isinstance(through, str)
    return 0, None, False


def _model_view(summary: str | None, fold: MessageFold) -> list[Message]:
    view = [] if summary is None else [Message("user", [Text(SUMMARY_PREFIX + summary)])]
    if fold.system_messages:
        view += [m for m in fold.messages if m.role != "system"]
    else:
        view += fold.messages
    return view


def history_from_entries(entries: Sequence[Mapping[str, Any]]) -> list[Message]:
    """The conversation the model sees: the latest compaction summary, then what followed.

    (See ``compaction_cut``.) Every tool call is followed by its result (a
    ``crashed`` one when the kernel stopped before it was recorded); system
    messages are left out (the agent sends its own).

    Raises:
        StoreError: a message entry's payload is not a message.
    """
    start, summary = compaction_cut(entries)
    fold = MessageFold()
    fold.add_all(entries[start:])
    return _model_view(summary, fold)


class _Folded:
    """What a ``HistoryCache`` knows of one transcript."""

    __slots__ = ("count", "cut", "fold", "last", "recut", "store", "summary", "used")

    def __init__(self, store: SessionStore) -> None:
        self.store = store
        self.count = 0  # entries of the transcript seen, from position 0
        self.last: Mapping[str, Any] | None = None  # the entry at count - 1
        self.cut = 0  # position of the first entry folded (after the latest compaction's cut)
        self.summary: str | None = None  # the latest compaction's summary
        self.fold = MessageFold()
        self.recut = False  # a compaction arrived: fold again from its cut before use
        self.used = -math.inf  # trio.current_time() of the last use (release_idle)

    def extend(self, entries: Sequence[Mapping[str, Any]]) -> None:
        """Add the transcript's next ``entries`` (positions ``count`` on)."""
        if not entries:
            return
        for entry in entries:
            if entry.get("type") == "compaction":
                self.recut = True
            if not self.recut:
                self.fold.add(entry)
        self.count += len(entries)
        self.last = entries[-1]
        # What was not read now never will be (the next reads start after these).
        self.fold.known.clear()


def _same_entry(a: Mapping[str, Any], b: Mapping[str, Any]) -> bool:
    uuid = a.get("uuid")
    return uuid == b.get("uuid") if isinstance(uuid, str) else dict(a) == dict(b)


class _TurnLock:
    """A session's turn lock, and how many tasks hold it or wait for it."""

    __slots__ = ("lock", "users")

    def __init__(self) -> None:
        self.lock = trio.Lock()
        self.users = 0


class HistoryCache:
    """The messages of recently used sessions, extended as entries are appended.

    See the module docstring. One cache serves one process's sessions (a
    ``Kernel`` holds one; a ``Session`` made without one has its own);
    sessions are told apart by key and store. It also holds each session's
    turn lock (``hold_turn``): one turn at a time per session among the
    sessions that share the cache.

    Raises:
        UsageError: a bound is below 1.
    """

    def __init__(self, *, max_sessions: int = 64, max_entries: int = 500_000) -> None:
        check_positive(max_sessions, "HistoryCache: max_sessions", integer=True)
        check_positive(max_entries, "HistoryCache: max_entries", integer=True)
        self.max_sessions = max_sessions
        self.max_entries = max_entries
        self._sessions: OrderedDict[str, _Folded] = OrderedDict()  # by SessionKey.name, LRU first
        self._entries = 0  # folded entries held, over every session
        # By SessionKey.name, while held or waited for (never evicted then; dropped after).
        self._turns: dict[str, _TurnLock] = {}

    def __len__(self) -> int:
        return len(self._sessions)

    @contextlib.asynccontextmanager
    async def hold_turn(self, key: SessionKey, *, wait: bool = True) -> AsyncIterator[None]:
        """Hold ``key``'s turn lock for the block: one turn at a time on a session.

        A turn appends in several steps (prompt, calls, results, answer), each
        atomic, the whole not: two turns at once would interleave them. With
        ``wait``, the block waits for the turn before it (first come, first
        served); without, it refuses at once.

        Raises:
            UsageError: not ``wait``, and a turn holds the session.
        """
        name = key.name
        held = self._turns.get(name)
        if held is None:
            held = self._turns[name] = _TurnLock()
        held.users += 1
        try:
            if wait:
                await held.lock.acquire()
            else:
                try:
                    held.lock.acquire_nowait()
                except trio.WouldBlock:
                    raise TurnRunning(
                        f"session {name}: a turn of this session is running in this process"
                    ) from None
            try:
                yield
            finally:
                held.lock.release()
        finally:
            held.users -= 1
            if not held.users and self._turns.get(name) is held:
                del self._turns[name]

    def forget(self, key: SessionKey) -> None:
        """Drop what is known of ``key`` (the next use reads it from the store)."""
        state = self._sessions.pop(key.name, None)
        if state is not None:
            self._entries -= state.count - state.cut

    async def append(
        self,
        store: SessionStore,
        key: SessionKey,
        entries: Sequence[Mapping[str, Any]],
        *,
        messages: Sequence[Message | None] = (),
    ) -> None:
        """``store.append(key, entries)``; the next use of ``key`` folds them.

        Nothing is folded here (see the module docstring, 2): the next use
        reads them back from the last entry folded (which must still be there,
        or the fold is rebuilt), with whatever others appended before or after
        them. So reading back cannot fail the append: an entry that does not
        read as a message (only entries not made by a ``Session`` can) is
        reported by that use. ``messages``, when given, are the messages
        ``entries`` hold (``None`` for an entry that holds none): an entry read
        back equal to what was written is then not structured again.

        Raises:
            UsageError: an entry is not a JSON object with a string ``type``.
            StoreError: the store could not write (nothing was appended).
        """
        await store.append(key, entries)
        state = self._sessions.get(key.name)
        if state is None or state.store is not store:
            return
        known = state.fold.known
        if len(known) > _MAX_KNOWN:  # appended to without being used: stop remembering
            known.clear()
        for entry, message in zip(entries, messages, strict=False):
            uuid = entry.get("uuid")
            if message is not None and isinstance(uuid, str):
                known[uuid] = (entry, message)

    async def history(self, store: SessionStore, key: SessionKey) -> list[Message]:
        """``history_from_entries`` of ``key``'s transcript as ``store`` holds it now.

        Raises:
            StoreError: a message entry's payload is not a message.
            CorruptTranscript: the transcript is damaged mid-file.
        """
        state = await self._current(store, key)
        return _model_view(state.summary, state.fold)

    async def messages(self, store: SessionStore, key: SessionKey) -> list[Message]:
        """``messages_from_entries`` of ``key``'s whole transcript as ``store`` holds it now.

        Reads the entries before the latest compaction's cut from the store.

        Raises:
            StoreError: a message entry's payload is not a message.
            CorruptTranscript: the transcript is damaged mid-file.
        """
        state = await self._current(store, key)
        if state.cut == 0:
            return list(state.fold.messages)
        return messages_from_entries(await store.load(key) or [])

    async def since_cut(self, store: SessionStore, key: SessionKey) -> list[dict[str, Any]]:
        """The entries from the one the latest compaction summarised through (all without one).

        What ``compaction_cut`` and ``history_from_entries`` need to give the
        same answer as on the whole transcript. One read, from the cut this
        cache knows (a compaction it has not seen yet is after it); the whole
        transcript when it knows nothing of ``key``.

        Raises:
            CorruptTranscript: the transcript is damaged mid-file.
        """
        state = self._sessions.get(key.name)
        start = state.cut - 1 if state is not None and state.store is store and state.cut else 0
        return [e async for e in store.iter_entries(key, start=start)]

    async def _current(self, store: SessionStore, key: SessionKey) -> _Folded:
        state = self._sessions.get(key.name)
        if state is not None and state.store is not store:
            self.forget(key)
            state = None
        while True:
            if state is None:
                # Read whole just now: nothing to read again before using it.
                state = await self._build(store, key, hint=0)
                return self._used(key, state)
            count = state.count
            new = [
                e async for e in store.iter_entries(key, start=max(0, count - 1))
            ]  # one entry already seen, to check it is still there
            if self._sessions.get(key.name) is not state or state.count != count:
                state = self._sessions.get(key.name)  # changed while we read: again
                continue
            if count > 0 and (not new or state.last is None or not _same_entry(new[0], state.last)):
                self.forget(key)  # deleted, repaired or written around: read it all again
                state = None
                continue
            before = state.count
            try:
                state.extend(new[1:] if count > 0 else new)
            except StoreError:
                self.forget(key)  # half folded: do not keep it
                raise
            self._entries += state.count - before
            if state.recut:
                state = await self._build(store, key, hint=state.cut)
            return self._used(key, state)

    def release_idle(
        self, *, keep: int, used_before: float = -math.inf, busy: Container[str] = ()
    ) -> int:
        """Drop the sessions last used before ``used_before`` (a ``trio.current_time()``),
        and the least recently used beyond the ``keep`` most recent of those not
        in use; how many.

        In use, and kept: a session whose turn is held (``hold_turn``), and those
        whose main transcript's name (``SessionKey.name``) is in ``busy`` (their
        child transcripts too). A session dropped is read again from the store at
        its next use.
        """
        # keep counts idle sessions: those in use are kept besides them.
        candidates = [
            (name, state)
            for name, state in self._sessions.items()
            if name not in self._turns and name.partition(":")[0] not in busy
        ]
        excess = len(candidates) - keep
        idle = [
            name
            for at, (name, state) in enumerate(candidates)
            if at < excess or state.used < used_before
        ]
        for name in idle:
            state = self._sessions.pop(name)
            self._entries -= state.count - state.cut
        return len(idle)

    def _used(self, key: SessionKey, state: _Folded) -> _Folded:
        state.used = trio.current_time()
        self._sessions.move_to_end(key.name)
        self._evict(keep=key.name)
        return state

    async def _build(self, store: SessionStore, key: SessionKey, *, hint: int) -> _Folded:
        """Fold ``key``'s transcript from scratch; ``hint``: the latest cut is not before it."""
        entries = [e async for e in store.iter_entries(key, start=hint)]
        cut, summary, found = _find_cut(entries)
        if hint > 0 and not found:
            # The latest compaction or its ``through`` is not after the hint
            # (the transcript changed meanwhile?): look at all of it.
            return await self._build(store, key, hint=0)
        state = _Folded(store)
        state.cut = hint + cut
        state.summary = summary
        state.fold.add_all(entries[cut:])  # raises before anything is kept
        state.count = hint + len(entries)
        state.last = entries[-1] if entries else None
        self.forget(key)
        self._sessions[key.name] = state
        self._entries += state.count - state.cut
        return state

    def _evict(self, *, keep: str) -> None:
        while len(self._sessions) > self.max_sessions or (
            self._entries > self.max_entries and len(self._sessions) > 1
        ):
            name = next(iter(self._sessions))
            if name == keep:
                self._sessions.move_to_end(name)
                name = next(iter(self._sessions))
            state = self._sessions.pop(name)
            self._entries -= state.count - state.cut
