"""The behaviour every ``SessionStore`` backend shares.

A backend's test module subclasses ``StoreConformance`` and provides the
``make_store`` fixture: a factory taking the store's keyword options (``clock``).
"""

from __future__ import annotations

import math
import random
import re
from collections.abc import Callable
from typing import Any

import pytest
import trio
import trio.lowlevel

from kernel.errors import StoreError, UsageError
from kernel.store import SessionKey, SessionStore, fold_session_summary
from kernel.store._base import BaseStore

MakeStore = Callable[..., BaseStore]

MAIN = SessionKey("proj", "s1")


def entry(n: int, kind: str = "user", **extra: Any) -> dict[str, Any]:
    return {"type": kind, "uuid": f"u{n}", "timestamp": f"2024-01-01T00:00:{n % 60:02d}Z", **extra}


class FakeClock:
    """A store clock that stands still unless told otherwise."""

    def __init__(self, now: int = 1_000) -> None:
        self.now = now

    def __call__(self) -> int:
        return self.now


class StoreConformance:
    @pytest.fixture
    def make_store(self) -> MakeStore:
        raise NotImplementedError

    @pytest.fixture
    async def store(self, make_store: MakeStore) -> Any:
        async with make_store() as s:
            yield s

    # -- round trip ----------------------------------------------------------

    async def test_is_a_session_store(self, store: BaseStore) -> None:
        assert isinstance(store, SessionStore)

    async def test_round_trip_keeps_order(self, store: BaseStore) -> None:
        batches = [[entry(0)], [entry(1, "assistant"), entry(2, "tool")], [entry(3)]]
        for batch in batches:
            await store.append(MAIN, batch)
        want = [e for batch in batches for e in batch]
        assert await store.load(MAIN) == want
        assert [e async for e in store.iter_entries(MAIN)] == want

    async def test_round_trip_is_deep_and_json_shaped(self, store: BaseStore) -> None:
        nested = entry(
            0,
            payload={"text": "héllo\nworld \u2028 🙂", "n": [1, 2.5, None, True, {"x": []}]},
            as_tuple=(1, 2),
        )
        await store.append(MAIN, [nested])
        (loaded,) = await store.load(MAIN) or []
        assert loaded["payload"] == nested["payload"]
        assert loaded["as_tuple"] == [1, 2]  # JSON has no tuples

    async def test_stored_entries_are_copies(self, store: BaseStore) -> None:
        e = entry(0, data={"k": [1]})
        await store.append(MAIN, [e])
        e["data"]["k"].append(2)
        loaded = await store.load(MAIN)
        assert loaded == [entry(0, data={"k": [1]})]
        assert loaded is not None
        loaded[0]["data"]["k"].append(3)
        assert await store.load(MAIN) == [entry(0, data={"k": [1]})]

    async def test_unknown_key(self, store: BaseStore) -> None:
        assert await store.load(MAIN) is None
        assert [e async for e in store.iter_entries(MAIN)] == []
        assert await store.list_sessions("proj") == []
        assert await store.list_session_summaries("proj") == []
        assert await store.list_subkeys(MAIN) == []
        assert await store.delete(MAIN) is False

    async def test_append_nothing_is_a_no_op(self, make_store: MakeStore) -> None:
        clock = FakeClock()
        async with make_store(clock=clock) as store:
            await store.append(MAIN, [])
            assert await store.load(MAIN) is None
            assert await store.list_sessions("proj") == []
            await store.append(MAIN, [entry(0)])
            before = await store.list_sessions("proj")
            clock.now += 50
            await store.append(MAIN, [])
            assert await store.load(MAIN) == [entry(0)]
            assert await store.list_sessions("proj") == before

    @pytest.mark.parametrize(
        ("bad", "where"),
        [
            ("not a dict", "entries[1]"),
            ({"uuid": "x"}, "entries[1].type"),
            ({"type": 3}, "entries[1].type"),
            ({"type": "t", "uuid": 7}, "entries[1].uuid"),
            ({"type": "t", "x": math.nan}, "entries[1]"),
            ({"type": "t", "x": object()}, "entries[1]"),
            ({"type": "t", "x": "\ud800"}, "entries[1]"),
        ],
    )
    async def test_bad_entries_are_refused_whole(
        self, store: BaseStore, bad: Any, where: str
    ) -> None:
        with pytest.raises(UsageError, match="^" + re.escape(where)):
            await store.append(MAIN, [entry(0), bad])
        assert await store.load(MAIN) is None
        await store.append(MAIN, [entry(1)])  # the store is still usable
        assert await store.load(MAIN) == [entry(1)]

    # -- isolation -----------------------------------------------------------

    async def test_keys_projects_and_subpaths_are_isolated(self, store: BaseStore) -> None:
        keys = [
            SessionKey("proj", "s1"),
            SessionKey("proj", "s2"),
            SessionKey("other", "s1"),
            SessionKey("proj", "s1", "subagents/a"),
            SessionKey("proj", "s1", "subagents/a/subagents/b"),
            SessionKey("proj", "s2", "subagents/a"),
        ]
        for i, key in enumerate(keys):
            await store.append(key, [entry(100 + i, note=str(key))])
        for i, key in enumerate(keys):
            assert await store.load(key) == [entry(100 + i, note=str(key))]
        assert [s.session_id for s in await store.list_sessions("proj")] == ["s1", "s2"]
        assert [s.session_id for s in await store.list_sessions("other")] == ["s1"]
        summaries = await store.list_session_summaries("proj")
        assert [s.data.entry_count for s in summaries] == [1, 1]

    async def test_child_alone_is_not_a_session(self, store: BaseStore) -> None:
        child = MAIN.child("subagents/x")
        await store.append(child, [entry(0)])
        assert await store.load(MAIN) is None
        assert await store.list_sessions("proj") == []
        assert await store.list_session_summaries("proj") == []
        assert await store.list_subkeys(MAIN) == ["subagents/x"]

    # -- summaries -----------------------------------------------------------

    async def test_summary_is_the_fold_of_the_transcript(self, store: BaseStore) -> None:
        await store.append(MAIN, [entry(0, title="first"), entry(1, model="m1")])
        await store.append(
            MAIN,
            [
                entry(2, "assistant", usage={"input_tokens": 10, "output_tokens": 3}),
                entry(3, "tool", cost_usd=0.25),
                {"type": "note"},  # no uuid, no timestamp
            ],
        )
        await store.append(MAIN, [entry(4, "assistant", cost_usd=0.1, title="second")])
        (summary,) = await store.list_session_summaries("proj")
        loaded = await store.load(MAIN)
        assert loaded is not None
        folded = fold_session_summary(None, MAIN, loaded)
        assert summary.session_id == "s1"
        assert summary.data == folded.data
        assert summary.data.type_counts == {"user": 2, "assistant": 2, "tool": 1, "note": 1}
        assert (summary.data.input_tokens, summary.data.output_tokens) == (10, 3)
        assert summary.data.cost_nano_usd == 350_000_000
        assert summary.data.title == "second"
        assert summary.data.model == "m1"
        assert summary.data.first_timestamp == "2024-01-01T00:00:00Z"
        assert summary.data.last_timestamp == "2024-01-01T00:00:04Z"
        (info,) = await store.list_sessions("proj")
        assert summary.mtime_ms >= info.mtime_ms

    async def test_child_appends_leave_the_main_summary_alone(self, store: BaseStore) -> None:
        await store.append(MAIN, [entry(0)])
        before = await store.list_session_summaries("proj")
        listed = await store.list_sessions("proj")
        await store.append(MAIN.child("subagents/a"), [entry(1, "assistant", cost_usd=1.0)])
        assert await store.list_session_summaries("proj") == before
        assert await store.list_sessions("proj") == listed

    # -- idempotency ---------------------------------------------------------

    async def test_uuid_dedup(self, make_store: MakeStore) -> None:
        clock = FakeClock()
        async with make_store(clock=clock) as store:
            await store.append(MAIN, [entry(0), entry(1), entry(0, note="dup in batch")])
            assert await store.load(MAIN) == [entry(0), entry(1)]
            (before,) = await store.list_sessions("proj")
            clock.now += 100
            await store.append(MAIN, [entry(1, note="retry"), entry(0)])  # all known
            assert await store.load(MAIN) == [entry(0), entry(1)]
            assert await store.list_sessions("proj") == [before]
            await store.append(MAIN, [entry(1), entry(2)])  # one new
            assert await store.load(MAIN) == [entry(0), entry(1), entry(2)]
            no_uuid = {"type": "note"}
            await store.append(MAIN, [no_uuid, no_uuid])
            assert (await store.load(MAIN) or [])[-2:] == [no_uuid, no_uuid]
            (summary,) = await store.list_session_summaries("proj")
            assert summary.data.entry_count == 5
            # The same uuid under another key is another entry.
            await store.append(MAIN.child("sub"), [entry(0)])
            assert await store.load(MAIN.child("sub")) == [entry(0)]

    # -- mtime ---------------------------------------------------------------

    async def test_mtime_comes_from_the_store_clock_and_only_grows(
        self, make_store: MakeStore
    ) -> None:
        clock = FakeClock(5_000)
        async with make_store(clock=clock) as store:
            seen = []
            skews = [
                "1970-01-01T00:00:00Z",
                "2999-12-31T23:59:59Z",
                "not a time",
                "2024-01-01T00:00:00Z",
            ]
            for i, (now, stamp) in enumerate(zip([5_000, 5_000, 4_000, 9_000], skews, strict=True)):
                clock.now = now  # stands still, goes back, jumps ahead
                await store.append(MAIN, [{"type": "user", "uuid": f"m{i}", "timestamp": stamp}])
                (info,) = await store.list_sessions("proj")
                (summary,) = await store.list_session_summaries("proj")
                assert summary.mtime_ms >= info.mtime_ms
                seen.append(info.mtime_ms)
            assert seen == [5_000, 5_001, 5_002, 9_000]

    async def test_mtime_is_per_key(self, make_store: MakeStore) -> None:
        clock = FakeClock(7_000)
        async with make_store(clock=clock) as store:
            for sid in ["a", "b", "c"]:
                await store.append(SessionKey("proj", sid), [entry(0)])
            assert [i.mtime_ms for i in await store.list_sessions("proj")] == [7_000] * 3

    # -- delete --------------------------------------------------------------

    async def test_delete_main_removes_children_and_summary(self, store: BaseStore) -> None:
        other = SessionKey("proj", "s2")
        await store.append(MAIN, [entry(0)])
        await store.append(MAIN.child("subagents/a"), [entry(1)])
        await store.append(MAIN.child("subagents/a/subagents/b"), [entry(2)])
        await store.append(other, [entry(3)])
        assert await store.delete(MAIN) is True
        assert await store.load(MAIN) is None
        assert await store.load(MAIN.child("subagents/a")) is None
        assert await store.list_subkeys(MAIN) == []
        assert [s.session_id for s in await store.list_session_summaries("proj")] == ["s2"]
        assert await store.load(other) == [entry(3)]
        assert await store.delete(MAIN) is False
        # The key is usable again, from scratch.
        await store.append(MAIN, [entry(0, note="again")])
        assert await store.load(MAIN) == [entry(0, note="again")]
        (summary, _) = await store.list_session_summaries("proj")
        assert summary.data.entry_count == 1

    async def test_delete_child_removes_only_it(self, store: BaseStore) -> None:
        a, ab = MAIN.child("subagents/a"), MAIN.child("subagents/a/subagents/b")
        await store.append(MAIN, [entry(0)])
        await store.append(a, [entry(1)])
        await store.append(ab, [entry(2)])
        assert await store.delete(a) is True
        assert await store.load(a) is None
        assert await store.load(ab) == [entry(2)]
        assert await store.load(MAIN) == [entry(0)]
        assert await store.list_subkeys(MAIN) == ["subagents/a/subagents/b"]
        assert await store.delete(a) is False
        assert await store.delete(ab) is True
        assert await store.list_subkeys(MAIN) == []
        assert await store.load(MAIN) == [entry(0)]

    async def test_list_subkeys(self, store: BaseStore) -> None:
        subs = ["z", "subagents/b", "subagents/a", "subagents/a/subagents/c"]
        for i, sub in enumerate(subs):
            await store.append(MAIN.child(sub), [entry(i)])
        await store.append(SessionKey("proj", "s2", "subagents/q"), [entry(9)])
        assert await store.list_subkeys(MAIN) == sorted(subs)
        assert await store.list_subkeys(MAIN.child("subagents/a")) == ["subagents/a/subagents/c"]
        assert await store.list_subkeys(MAIN.child("subagents")) == [
            "subagents/a",
            "subagents/a/subagents/c",
            "subagents/b",
        ]

    async def test_bad_project_names_are_refused(self, store: BaseStore) -> None:
        for bad in ["", "..", "a/b", "x" * 129]:
            with pytest.raises(UsageError, match=r"^project"):
                await store.list_sessions(bad)
            with pytest.raises(UsageError, match=r"^project"):
                await store.list_session_summaries(bad)

    # -- concurrency ---------------------------------------------------------

    async def test_no_lost_update(self, store: BaseStore, stress: bool) -> None:
        # 20 writers interleave as 50 do; make stress writes 10,000 entries.
        tasks, per_task = (50, 200) if stress else (20, 100)

        async def writer(t: int) -> None:
            for i in range(per_task):
                await store.append(MAIN, [{"type": "w", "uuid": f"{t}-{i}", "t": t, "i": i}])
                if i % 7 == t % 7:
                    await trio.lowlevel.checkpoint()

        async with trio.open_nursery() as nursery:
            for t in range(tasks):
                nursery.start_soon(writer, t)
        loaded = await store.load(MAIN)
        assert loaded is not None
        assert len(loaded) == tasks * per_task
        for t in range(tasks):
            assert [e["i"] for e in loaded if e["t"] == t] == list(range(per_task))
        (summary,) = await store.list_session_summaries("proj")
        assert summary.data.entry_count == tasks * per_task

    async def test_a_held_key_does_not_hold_up_others(self, store: BaseStore) -> None:
        # An append in progress holds exactly its key's lock; hold it for it.
        other = SessionKey("proj", "s2")
        child = MAIN.child("subagents/a")
        await store.append(MAIN, [entry(0)])
        appended = trio.Event()

        async def blocked_append() -> None:
            await store.append(MAIN, [entry(1)])
            appended.set()

        async with trio.open_nursery() as nursery:
            async with store._locks.hold(MAIN.name):
                nursery.start_soon(blocked_append)
                with trio.fail_after(5):
                    await store.append(other, [entry(2)])
                    await store.append(child, [entry(3)])
                    assert await store.load(other) == [entry(2)]
                    assert await store.load(child) == [entry(3)]
                    assert [i.session_id for i in await store.list_sessions("proj")] == [
                        "s1",
                        "s2",
                    ]
                    assert await store.delete(child) is True
                assert not appended.is_set()
        assert appended.is_set()
        assert await store.load(MAIN) == [entry(0), entry(1)]

    async def test_cancelled_appends_are_all_or_nothing(self, store: BaseStore) -> None:
        rng = random.Random(1234)
        for attempt in range(30):
            with trio.move_on_after(rng.uniform(0, 0.002)):
                for b in range(1000):
                    size = rng.randint(1, 6)
                    batch = [
                        {
                            "type": "b",
                            "uuid": f"{attempt}-{b}-{j}",
                            "batch": f"{attempt}-{b}",
                            "n": size,
                        }
                        for j in range(size)
                    ]
                    await store.append(MAIN, batch)
        counts: dict[str, int] = {}
        for e in await store.load(MAIN) or []:
            counts[e["batch"]] = counts.get(e["batch"], 0) + 1
        sizes = {e["batch"]: e["n"] for e in await store.load(MAIN) or []}
        assert counts == sizes

    # -- closing -------------------------------------------------------------

    async def test_closed_store_refuses_work(self, make_store: MakeStore) -> None:
        store = make_store()
        await store.append(MAIN, [entry(0)])
        await store.aclose()
        await store.aclose()  # twice is fine
        with pytest.raises(StoreError, match="closed"):
            await store.append(MAIN, [entry(1)])
        with pytest.raises(StoreError, match="closed"):
            await store.load(MAIN)

    async def test_aclose_finishes_when_cancelled(self, make_store: MakeStore) -> None:
        store = make_store()
        await store.append(MAIN, [entry(0)])
        with trio.CancelScope() as scope:
            scope.cancel()
            await store.aclose()
        with pytest.raises(StoreError):
            await store.append(MAIN, [entry(1)])
