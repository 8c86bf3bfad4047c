"""kernel.history: the fold gives what the whole-transcript reading gives; the cache reads only what is new."""

from __future__ import annotations

import random
from collections.abc import AsyncIterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest

from kernel.errors import StoreError, UsageError
from kernel.history import (
    KERNEL_STOPPED,
    HistoryCache,
    MessageFold,
    history_from_entries,
    message_from_entry,
    messages_from_entries,
)
from kernel.messages import Message, Observation, Text, ToolCall
from kernel.session import Session, message_entry
from kernel.store import FileStore, MemoryStore, SessionKey

KEY = SessionKey("p", "s")
TS = "2025-01-01T00:00:00.000Z"


# -- the reference: messages_from_entries as it was before the fold (whole list at once) -----


def reference_messages(entries: Sequence[Mapping[str, Any]]) -> list[Message]:
    listed = list(entries)
    answered_at: dict[str, int] = {}
    for position, entry in enumerate(listed):
        answers = entry.get("answers")
        if entry.get("type") == "tool" and isinstance(answers, str):
            answered_at.setdefault(answers, position)
    messages: list[Message] = []
    used: set[int] = set()
    for position, entry in enumerate(listed):
        if position in used or (entry.get("type") == "tool" and "answers" in entry):
            continue
        message = message_from_entry(entry)
        if message is None:
            continue
        messages.append(message)
        calls = message.tool_calls
        if message.role != "assistant" or not calls:
            continue
        where = answered_at.get(str(entry.get("uuid")))
        if where is None and (
            position + 1 < len(listed)
            and listed[position + 1].get("type") == "tool"
            and "answers" not in listed[position + 1]
        ):
            where = position + 1
        results = message_from_entry(listed[where]) if where is not None else None
        if where is not None:
            used.add(where)
        recorded = {
            o.index: o
            for o in (results.observations if results is not None else ())
            if o.index < len(calls) and o.call_id == calls[o.index].id
        }
        if results is not None and len(recorded) == len(calls) == len(results.parts):
            messages.append(results)
        else:
            messages.append(
                Message(
                    "tool",
                    [
                        recorded.get(i) or Observation.failure(c, i, KERNEL_STOPPED)
                        for i, c in enumerate(calls)
                    ],
                )
            )
    return messages


KINDS = ("user", "calls", "calls", "answer", "answer", "legacy", "final", "title", "system")
KINDS += ("compaction", "stray")


def random_transcript(rng: random.Random, length: int) -> list[dict[str, Any]]:
    """Entries of every shape a transcript may hold, old and new formats, damage included."""
    entries: list[dict[str, Any]] = []
    assistants: list[tuple[str, list[ToolCall]]] = []
    for n in range(length):
        kind = rng.choice(KINDS)
        if kind == "user":
            entries.append(message_entry(Message("user", [Text(f"u{n}")]), timestamp=TS))
        elif kind == "system":
            entries.append(message_entry(Message("system", [Text(f"s{n}")]), timestamp=TS))
        elif kind == "final":
            entries.append(message_entry(Message("assistant", [Text(f"a{n}")]), timestamp=TS))
        elif kind == "calls":
            calls = [ToolCall(f"c{n}-{i}", "t", {}) for i in range(rng.randint(1, 2))]
            entry = message_entry(Message("assistant", list(calls)), timestamp=TS)
            if rng.random() < 0.1 and assistants:  # a uuid seen before (no store dedups here)
                entry["uuid"] = rng.choice(assistants)[0]
            assistants.append((entry["uuid"], calls))
            entries.append(entry)
        elif kind in ("answer", "legacy") and assistants:
            uuid, calls = rng.choice(assistants) if rng.random() < 0.3 else assistants[-1]
            observations = [
                Observation(call_id=c.id, name="t", index=i, content=f"r{n}")
                for i, c in enumerate(calls)
                if rng.random() < 0.9
            ]
            extra = {"answers": uuid} if kind == "answer" else {}
            entries.append(message_entry(Message("tool", observations), timestamp=TS, **extra))
        elif kind == "stray":  # an answer for an assistant entry that comes later, or never
            entries.append(
                message_entry(
                    Message("tool", []), timestamp=TS, answers=rng.choice(["nobody", "later"])
                )
            )
        elif kind == "compaction" and entries:
            through = rng.choice(entries).get("uuid")
            entries.append(
                {"type": "compaction", "uuid": f"k{n}", "summary": f"sum{n}", "through": through}
            )
        else:
            entries.append({"type": "title", "uuid": f"t{n}", "title": "x"})
    return entries


@pytest.mark.parametrize("seed", range(300))
def test_the_fold_reads_a_transcript_as_the_whole_list_reading_did(seed: int) -> None:
    rng = random.Random(seed)
    entries = random_transcript(rng, rng.randint(0, 40))
    assert messages_from_entries(entries) == reference_messages(entries)
    fold = MessageFold()
    for entry in entries:  # one at a time, as a cache sees them
        fold.add(entry)
    assert fold.messages == reference_messages(entries)


def test_an_answer_after_an_older_format_result_takes_over() -> None:
    call = ToolCall("c1", "t", {})
    assistant = message_entry(Message("assistant", [call]), timestamp=TS)
    legacy = message_entry(
        Message("tool", [Observation(call_id="c1", name="t", index=0, content="old")]),
        timestamp=TS,
    )
    new = message_entry(
        Message("tool", [Observation(call_id="c1", name="t", index=0, content="new")]),
        timestamp=TS,
        answers=assistant["uuid"],
    )
    fold = MessageFold()
    fold.add_all([assistant, legacy])
    assert fold.messages[1].observations[0].content == "old"
    fold.add(new)
    assert [m.observations[0].content for m in fold.messages[1:]] == ["new", "old"]
    assert fold.messages == reference_messages([assistant, legacy, new])


# -- the cache --------------------------------------------------------------------------


class CountingStore(MemoryStore):
    """A MemoryStore that records the ``start`` of every ``iter_entries`` and its yield."""

    def __init__(self) -> None:
        super().__init__()
        self.reads: list[tuple[int, int]] = []  # (start, entries yielded)

    async def iter_entries(
        self, key: SessionKey, *, start: int = 0
    ) -> AsyncIterator[dict[str, Any]]:
        count = 0
        self.reads.append((start, 0))
        async for entry in super().iter_entries(key, start=start):
            count += 1
            self.reads[-1] = (start, count)
            yield entry


def turn(i: int) -> list[dict[str, Any]]:
    call = ToolCall(f"c{i}", "t", {})
    calls = message_entry(Message("assistant", [call]), timestamp=TS)
    return [
        message_entry(Message("user", [Text(f"q{i}")]), timestamp=TS),
        calls,
        message_entry(
            Message("tool", [Observation(call_id=call.id, name="t", index=0, content=f"r{i}")]),
            timestamp=TS,
            answers=calls["uuid"],
        ),
        message_entry(Message("assistant", [Text(f"a{i}")]), timestamp=TS),
    ]


async def test_each_use_reads_from_the_last_known_entry_only_and_an_append_not_at_all() -> None:
    store = CountingStore()
    session = Session(store, KEY)
    for i in range(50):
        await store.append(KEY, turn(i))
    assert len(await session.history()) == 200
    store.reads.clear()
    for i in range(50, 60):
        await session.append_entries(turn(i))
        history = await session.history()
        assert history == history_from_entries(await store.load(KEY) or [])
    # An append reads nothing; the use after it, the last entry it knew and the four
    # appended since: nothing of the history.
    assert store.reads == [(4 * i - 1, 5) for i in range(50, 60)]


async def test_another_writers_appends_are_picked_up_from_the_last_known_entry() -> None:
    store = CountingStore()
    mine, theirs = Session(store, KEY), Session(store, KEY)  # two caches: two processes
    await mine.append_entries(turn(0))
    assert len(await mine.history()) == 4
    await theirs.append_entries(turn(1))
    await mine.append_entries(turn(2))  # lands after theirs: the next use notices
    store.reads.clear()
    expected = history_from_entries(await store.load(KEY) or [])
    assert await mine.history() == expected
    assert await theirs.history() == expected
    assert await mine.messages() == messages_from_entries(await store.load(KEY) or [])


@pytest.mark.parametrize("change", ["deleted", "shortened", "replaced"])
async def test_a_transcript_changed_behind_the_cache_is_read_again(change: str) -> None:
    store = MemoryStore()
    session = Session(store, KEY)
    await session.append_entries(turn(0) + turn(1))
    assert len(await session.history()) == 8
    await store.delete(KEY)
    if change == "shortened":
        await store.append(KEY, turn(0))
    elif change == "replaced":  # as many entries as before, other ones
        await store.append(KEY, turn(2) + turn(3))
    assert await session.history() == history_from_entries(await store.load(KEY) or [])


async def test_a_turn_reads_from_the_latest_compaction_not_from_the_start() -> None:
    store = CountingStore()
    session = Session(store, KEY)
    for i in range(30):
        await session.append_entries(turn(i))
    await session.history()
    entries = await store.load(KEY) or []
    store.reads.clear()
    await session.append_entries(
        [{"type": "compaction", "uuid": "k1", "summary": "S", "through": entries[99]["uuid"]}]
    )
    await session.append_entries(turn(30))
    history = await session.history()
    assert history == history_from_entries(await store.load(KEY) or [])
    assert history[0].text.endswith("S") and len(history) == 1 + 20 + 4
    # The use read from the last entry (the compaction and the turn after it), then
    # the entries since the cut (none before it); the appends read nothing.
    assert [start for start, _ in store.reads] == [119, 0]
    store.reads.clear()
    await session.append_entries(
        [{"type": "compaction", "uuid": "k2", "summary": "T", "through": "k1"}]
    )
    history = await session.history()
    assert history == history_from_entries(await store.load(KEY) or [])
    assert [start for start, _ in store.reads] == [124, 100]  # from the previous cut only
    assert await session.messages() == messages_from_entries(await store.load(KEY) or [])


class RewritingStore(MemoryStore):
    """A MemoryStore where "another process" deletes the session and writes it again,
    once, just before or just after the next ``append`` (as many entries as then held)."""

    def __init__(self) -> None:
        super().__init__()
        self.rewrite: str | None = None  # "before" or "after" the next append

    async def append(self, key: SessionKey, entries: Sequence[Mapping[str, Any]]) -> None:
        when, self.rewrite = self.rewrite, None
        if when == "before":
            await self._rewrite(key)
        await super().append(key, entries)
        if when == "after":
            await self._rewrite(key)

    async def _rewrite(self, key: SessionKey) -> None:
        count = len(await self.load(key) or [])
        await self.delete(key)
        other = [
            message_entry(Message("user", [Text(f"other {i}")]), timestamp=TS) for i in range(count)
        ]
        await super().append(key, other)


@pytest.mark.parametrize("when", ["before", "after"])
async def test_a_same_count_rewrite_around_our_append_is_read_again(when: str) -> None:
    """Hole 4 of the issue 11 review: another process deletes the session and writes as
    many entries as this cache folded; our append then lands where the cache expects it.
    The cache folds it as read back from the store, from the entry before it: another
    one, so the deleted conversation is not kept."""
    store = RewritingStore()
    session = Session(store, KEY)
    await session.append_entries(turn(0))
    assert len(await session.messages()) == 4
    store.rewrite = when
    await session.append_entries(turn(1)[:1])
    stored = await store.load(KEY) or []
    assert [e["message"]["parts"][0]["text"] for e in stored][:1] == ["other 0"]
    assert await session.messages() == messages_from_entries(stored)
    assert await session.history() == history_from_entries(stored)


async def test_an_entry_that_does_not_read_back_does_not_fail_its_append() -> None:
    store = MemoryStore()
    session = Session(store, KEY)
    await session.append_entries(turn(0))
    await session.history()
    bad = {"type": "user", "uuid": "bad", "message": {"role": "user", "parts": 3}}
    await session.append_entries([bad])  # stored: the cache lets go of the session
    assert (await store.load(KEY) or [])[-1]["uuid"] == "bad"
    with pytest.raises(StoreError, match="entry bad: not a message"):
        await session.history()


async def test_the_cache_drops_the_least_recently_used_session_whole() -> None:
    store = MemoryStore()
    cache = HistoryCache(max_sessions=2, max_entries=10)
    sessions = [Session(store, SessionKey("p", f"s{i}"), cache=cache) for i in range(3)]
    for s in sessions:
        await s.append_entries(turn(0))
        await s.history()
    assert len(cache) == 2
    await sessions[0].append_entries(turn(1) + turn(2))  # not cached: nothing to extend
    assert len(await sessions[0].history()) == 12  # read again, whole
    assert len(cache) == 1  # 12 entries: over max_entries, the others went
    with pytest.raises(UsageError):
        HistoryCache(max_sessions=0)


async def test_iter_entries_from_a_position() -> None:
    store = MemoryStore()
    await store.append(KEY, turn(0) + turn(1))
    everything = await store.load(KEY) or []
    assert [e async for e in store.iter_entries(KEY, start=5)] == everything[5:]
    assert [e async for e in store.iter_entries(KEY, start=8)] == []
    assert [e async for e in store.iter_entries(KEY, start=99)] == []
    assert [e async for e in store.iter_entries(SessionKey("p", "none"), start=1)] == []
    with pytest.raises(UsageError):
        [e async for e in store.iter_entries(KEY, start=-1)]


async def test_the_base_store_default_reads_and_skips() -> None:
    from kernel.store._base import BaseStore

    store = MemoryStore()
    await store.append(KEY, turn(0))
    default = BaseStore.iter_entries(store, KEY, start=2)
    assert [e async for e in default] == (await store.load(KEY) or [])[2:]


@pytest.mark.parametrize("seed", range(40))
async def test_two_writers_in_random_steps_read_as_the_whole_transcript(seed: int) -> None:
    rng = random.Random(seed)
    store = MemoryStore()
    writers = [Session(store, KEY), Session(store, KEY)]
    entries = [e for e in random_transcript(rng, 60) if e["type"] != "system"]
    for e in entries:  # the store keeps one entry per uuid: make them unique
        e["uuid"] = f"{rng.getrandbits(64):x}"
    while entries:
        step, entries = entries[: rng.randint(1, 5)], entries[5:]
        writer = rng.choice(writers)
        await writer.append_entries(step)
        if rng.random() < 0.5:
            reader = rng.choice(writers)
            stored = await store.load(KEY) or []
            assert await reader.history() == history_from_entries(stored)
            assert await reader.messages() == reference_messages(stored)


async def record_a_turn(session: Session, i: int) -> None:
    """What an agent's one-call turn writes through its ``Session``."""
    await session.append(Message("user", [Text(f"q{i}")]))
    calls = Message("assistant", [Text("calling"), ToolCall(f"c{i}", "t", {"n": i}, 0)])
    answers = await session.record_calls(calls, usage={"input_tokens": 1}, model="m")
    result = Observation(call_id=f"c{i}", name="t", index=0, content=f"r{i}")
    await session.record_results(calls, [result], answers=answers)
    await session.record_turn(Message("assistant", [Text(f"a{i}")]), model="m")


async def test_a_sessions_own_entries_read_back_unchanged_are_not_structured_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    store = MemoryStore()
    session = Session(store, KEY)
    await session.history()
    structured: list[object] = []

    def counting(entry: Mapping[str, Any]) -> Message | None:
        structured.append(entry.get("uuid"))
        return message_from_entry(entry)

    monkeypatch.setattr("kernel.history.message_from_entry", counting)
    for i in range(3):
        await record_a_turn(session, i)
        history = await session.history()
        assert structured == []
        assert history == history_from_entries(await store.load(KEY) or [])
        structured.clear()  # the reference reading structures every entry
    await store.append(KEY, turn(9))  # another writer's entries are structured as read
    history = await session.history()
    assert len(structured) == 4
    assert history == history_from_entries(await store.load(KEY) or [])


async def test_an_own_entry_changed_in_the_store_reads_as_the_store_holds_it() -> None:
    store = MemoryStore()
    session = Session(store, KEY)
    await session.history()
    await record_a_turn(session, 0)
    # Behind the cache's back: the same entries (same uuids) with other words.
    entries = await store.load(KEY) or []
    await store.delete(KEY)
    changed = [dict(e) for e in entries]
    changed[-1]["message"] = {"role": "assistant", "parts": [{"type": "text", "text": "other"}]}
    await store.append(KEY, changed)
    history = await session.history()
    assert history == history_from_entries(await store.load(KEY) or [])
    assert history[-1].text == "other"


def msg(text: str) -> Message:
    return Message("user", [Text(text)])


async def fresh(root: Path) -> list[dict[str, Any]]:
    async with FileStore(root) as store:
        return await store.load(KEY) or []


async def test_history_cache_follows_another_process(tmp_path: Path) -> None:
    """Process A caches; B appends, compacts, deletes and writes again (a different
    count): A's messages() and history() equal a fresh read each time."""
    async with FileStore(tmp_path) as sa, FileStore(tmp_path) as sb:
        a, b = Session(sa, KEY), Session(sb, KEY)

        async def same() -> None:
            entries = await fresh(tmp_path)
            assert await a.messages() == messages_from_entries(entries)
            assert await a.history() == history_from_entries(entries)

        await a.append(msg("a1"), msg("a2"))
        await same()
        await b.append(msg("b1"))
        await a.append(msg("a3"))  # lands after B's: A's cache must notice
        await same()
        through = (await fresh(tmp_path))[-1]["uuid"]
        await b.append_entries([{"type": "compaction", "uuid": "c1", "through": through,
                                 "summary": "so far"}])  # fmt: skip
        await b.append(msg("b2"))
        await same()
        await a.append(msg("a4"))
        await same()
        await sb.delete(KEY)
        await b.append(msg("b3"))
        await same()
        await sb.delete(KEY)
        await a.append(msg("a5"))
        await same()


async def test_history_cache_after_another_process_rewrites_the_same_count(
    tmp_path: Path,
) -> None:
    async with FileStore(tmp_path) as sa, FileStore(tmp_path) as sb:
        a, b = Session(sa, KEY), Session(sb, KEY)
        await a.append(msg("old question"), msg("old detail"))
        assert len(await a.messages()) == 2
        await sb.delete(KEY)
        await b.append(msg("new question"), msg("new detail"))
        await a.append(msg("reply"))
        assert await a.messages() == messages_from_entries(await fresh(tmp_path))
