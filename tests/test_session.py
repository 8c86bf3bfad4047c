from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import UTC, datetime
from typing import Any

import pytest

from kernel.errors import StoreError, UsageError
from kernel.messages import Message, Observation, Text, ToolCall, ToolError, converter
from kernel.session import Session, message_entry, messages_from_entries, utc_timestamp
from kernel.store import MemoryStore, SessionKey

KEY = SessionKey("proj", "chat")
NOW = datetime(2025, 3, 4, 5, 6, 7, 890_000, tzinfo=UTC)


class CountingStore(MemoryStore):
    def __init__(self) -> None:
        super().__init__()
        self.appends: list[list[dict[str, Any]]] = []

    async def append(self, key: SessionKey, entries: Sequence[Mapping[str, Any]]) -> None:
        self.appends.append([dict(e) for e in entries])
        await super().append(key, entries)


def turn() -> tuple[Message, list[Observation]]:
    assistant = Message(
        "assistant",
        [
            Text("Two lookups."),
            ToolCall("c1", "search", {"q": "trio"}, 0),
            ToolCall("c2", "fetch", '{"url": "http://x"}', 1),
        ],
    )
    failure = Observation.failure(
        ToolCall("c2", "fetch"), 1, ToolError("timeout", "Timeout", "took too long")
    )
    # Completion order, not declared order:
    return assistant, [failure, Observation("c1", "search", 0, "found it")]


async def test_messages_round_trip() -> None:
    session = Session(MemoryStore(), KEY, now=lambda: NOW)
    assert await session.messages() == []
    user = Message("user", [Text("hello")])
    await session.append(Message("system", [Text("be brief")]), user)
    assistant, observations = turn()
    await session.record_turn(assistant, observations)
    messages = await session.messages()
    assert messages[:3] == [Message("system", [Text("be brief")]), user, assistant]
    assert messages[3].role == "tool"
    assert [o.call_id for o in messages[3].observations] == ["c1", "c2"]  # declared order
    assert messages[3].observations[1].error == ToolError("timeout", "Timeout", "took too long")


async def test_a_turn_is_one_append_with_its_entries() -> None:
    store = CountingStore()
    session = Session(store, KEY, now=lambda: NOW)
    assistant, observations = turn()
    await session.record_turn(
        assistant,
        observations,
        usage={"input_tokens": 12, "output_tokens": 5},
        model="scripted:demo",
        cost_usd=0.002,
    )
    assert len(store.appends) == 1
    (batch,) = store.appends
    assert [e["type"] for e in batch] == ["assistant", "tool"]
    first = batch[0]
    assert first["timestamp"] == "2025-03-04T05:06:07.890Z"
    assert first["usage"] == {"input_tokens": 12, "output_tokens": 5}
    assert (first["model"], first["cost_usd"]) == ("scripted:demo", 0.002)
    assert first["message"] == converter.unstructure(assistant)
    assert len({e["uuid"] for e in batch}) == 2
    (summary,) = await store.list_session_summaries("proj")
    assert summary.data.type_counts == {"assistant": 1, "tool": 1}
    assert (summary.data.input_tokens, summary.data.model) == (12, "scripted:demo")


async def test_turn_without_tool_calls() -> None:
    store = CountingStore()
    session = Session(store, KEY)
    await session.record_turn(Message("assistant", [Text("done")]))
    assert [[e["type"] for e in b] for b in store.appends] == [["assistant"]]


@pytest.mark.parametrize(
    ("assistant", "observations", "match"),
    [
        (Message("user", [Text("x")]), [], "assistant: expected role"),
        (turn()[0], turn()[1][:1], "observations"),  # a call without its result
        (turn()[0], [*turn()[1], Observation("c9", "x", 2, "")], "observations"),
        (turn()[0], [turn()[1][0], turn()[1][0]], "observations"),
    ],
)
async def test_turns_that_would_break_a_transcript_are_refused(
    assistant: Message, observations: list[Observation], match: str
) -> None:
    store = CountingStore()
    with pytest.raises(UsageError, match=match):
        await Session(store, KEY).record_turn(assistant, observations)
    assert store.appends == []


async def test_title_and_other_entries() -> None:
    store = MemoryStore()
    session = Session(store, KEY)
    await session.set_title("Research")
    await store.append(KEY, [{"type": "compaction", "uuid": "x", "note": "kept"}])
    await session.append(Message("user", [Text("q")]))
    assert await session.messages() == [Message("user", [Text("q")])]
    assert [e["type"] for e in await session.entries()] == ["title", "compaction", "user"]
    (summary,) = await store.list_session_summaries("proj")
    assert summary.data.title == "Research"


async def test_child_sessions_are_subagent_transcripts() -> None:
    store = MemoryStore()
    session = Session(store, KEY)
    child = session.child("a1")
    assert child.key == SessionKey("proj", "chat", "subagents/a1")
    await child.append(Message("user", [Text("sub task")]))
    assert await session.messages() == []
    assert await store.list_subkeys(KEY) == ["subagents/a1"]
    with pytest.raises(UsageError):
        session.child("../x")


def test_entries_that_claim_to_be_messages_must_be() -> None:
    good = message_entry(Message("user", [Text("hi")]), timestamp="t", uuid="u")
    assert good == {
        "type": "user",
        "uuid": "u",
        "timestamp": "t",
        "message": {"role": "user", "parts": [{"type": "text", "text": "hi"}]},
    }
    assert messages_from_entries([good, {"type": "user"}]) == [Message("user", [Text("hi")])]
    bad = {**good, "uuid": "bad1", "message": {"role": "user", "parts": [{"type": "nope"}]}}
    with pytest.raises(StoreError, match=r"entry bad1: not a message: \$\.message"):
        messages_from_entries([bad])


def test_utc_timestamp() -> None:
    assert utc_timestamp(NOW) == "2025-03-04T05:06:07.890Z"
    assert utc_timestamp().endswith("Z")


# -- entries are records; the bytes on disk are what they always were ---------------------

# Lines as kernels before the entry records wrote them (key order included).
OLD_LINES = [
    '{"type":"title","uuid":"t1","timestamp":"2025-03-04T05:06:07.890Z","title":"Research"}',
    '{"type":"assistant","uuid":"a1","timestamp":"2025-03-04T05:06:07.890Z","message":'
    '{"role":"assistant","parts":[{"id":"c1","name":"search","arguments":{"q":"trio"},'
    '"index":0,"type":"tool_call"}]},"usage":{"input_tokens":3,"output_tokens":1},'
    '"model":"m","cost_usd":0.5}',
    '{"type":"tool","uuid":"r1","timestamp":"2025-03-04T05:06:07.890Z","message":'
    '{"role":"tool","parts":[]},"answers":"a1"}',
    '{"type":"compaction","uuid":"k1","timestamp":"2025-03-04T05:06:07.890Z","summary":"s",'
    '"through":"a1","usage":{"input_tokens":3},"model":"m"}',
]


def test_entry_records_write_the_old_bytes() -> None:
    import json

    from kernel.session import (
        CompactionEntry,
        MessageEntry,
        TitleEntry,
        entry_from_json,
        entry_to_json,
    )

    ts = "2025-03-04T05:06:07.890Z"
    records = [
        TitleEntry(uuid="t1", timestamp=ts, title="Research"),
        MessageEntry.of(
            Message("assistant", [ToolCall("c1", "search", {"q": "trio"}, 0)]),
            uuid="a1",
            timestamp=ts,
            usage={"input_tokens": 3, "output_tokens": 1},
            model="m",
            cost_usd=0.5,
        ),
        MessageEntry.of(Message("tool", []), uuid="r1", timestamp=ts, answers="a1"),
        CompactionEntry(
            uuid="k1", timestamp=ts, summary="s", through="a1", usage={"input_tokens": 3}, model="m"
        ),
    ]
    for record, line in zip(records, OLD_LINES, strict=True):
        assert json.dumps(entry_to_json(record), separators=(",", ":")) == line
        assert entry_from_json(json.loads(line)) == record
    assert entry_from_json({"type": "note", "text": "kept, not ours"}) is None
    with pytest.raises(StoreError, match=r"entry k2: not a compaction entry: .*\$\.summary"):
        entry_from_json({"type": "compaction", "uuid": "k2", "timestamp": ts})
    with pytest.raises(UsageError, match="role"):
        MessageEntry(type="user", timestamp=ts, message=Message("tool", []))


async def test_record_compaction_and_title_go_through_the_session() -> None:
    store = CountingStore()
    session = Session(store, KEY, now=lambda: NOW)
    await session.record_title("Research")
    await session.record_compaction(
        "what happened", through="a1", usage={"input_tokens": 3}, model="m", cost_usd=0.25
    )
    title, compaction = (batch[0] for batch in store.appends)
    assert title == {
        "type": "title", "uuid": title["uuid"], "timestamp": "2025-03-04T05:06:07.890Z",
        "title": "Research",
    }  # fmt: skip
    assert compaction == {
        "type": "compaction", "uuid": compaction["uuid"], "timestamp": "2025-03-04T05:06:07.890Z",
        "summary": "what happened", "through": "a1", "usage": {"input_tokens": 3}, "model": "m",
        "cost_usd": 0.25,
    }  # fmt: skip
    (summary,) = await store.list_session_summaries("proj")
    assert (summary.data.title, summary.data.type_counts) == (
        "Research",
        {"title": 1, "compaction": 1},
    )


async def test_compaction_candidate_keeps_the_last_turns() -> None:
    store = MemoryStore()
    session = Session(store, KEY, now=lambda: NOW)
    for n in range(3):
        await session.append(Message("user", [Text(f"q{n}")]))
        await session.record_turn(Message("assistant", [Text(f"a{n}")]), usage={"input_tokens": 90})
    assert await session.compaction_candidate(keep_last_turns=1, min_prompt_tokens=91) is None
    assert await session.compaction_candidate(keep_last_turns=3, min_prompt_tokens=1) is None
    candidate = await session.compaction_candidate(keep_last_turns=1, min_prompt_tokens=90)
    assert candidate is not None
    assert [m.text for m in candidate.messages] == ["q0", "a0", "q1", "a1"]
    entries = await session.entries()
    assert candidate.through == entries[3]["uuid"]  # the assistant entry before "q2"
    assert candidate.prompt_tokens == 90
    await session.record_compaction("sum", through=candidate.through, usage={}, model="m")
    # Since the compaction: one user prompt (q2), so nothing more to summarise.
    assert await session.compaction_candidate(keep_last_turns=1, min_prompt_tokens=0) is None
