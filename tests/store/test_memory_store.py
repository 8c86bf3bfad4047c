from __future__ import annotations

from typing import Any

import pytest
import trio

from kernel.store import MemoryStore, SessionKey

from .conformance import MakeStore, StoreConformance


class TestMemoryStore(StoreConformance):
    @pytest.fixture
    def make_store(self) -> MakeStore:
        return lambda **options: MemoryStore(**options)


async def test_lock_table_empties_after_100k_sessions() -> None:
    store = MemoryStore()
    peak = 0

    async def writer(t: int) -> None:
        nonlocal peak
        for i in range(100):
            key = SessionKey("p", f"s{t}-{i}")
            await store.append(key, [{"type": "t"}])
            peak = max(peak, len(store._locks))

    async with trio.open_nursery() as nursery:
        for t in range(1_000):
            nursery.start_soon(writer, t)
    assert len(await store.list_sessions("p")) == 100_000
    assert len(store._locks) == 0
    assert peak <= 1_000  # bounded by the tasks, not by the keys


async def test_waiting_append_keeps_its_lock_entry_until_done() -> None:
    store = MemoryStore()
    key = SessionKey("p", "s")
    events: list[Any] = []
    async with trio.open_nursery() as nursery:
        async with store._locks.hold(key.name):
            nursery.start_soon(store.append, key, [{"type": "t"}])
            await trio.testing.wait_all_tasks_blocked()
            assert key.name in store._locks
            events.append(await store.load(key))
    assert events == [None]
    assert len(store._locks) == 0
    assert await store.load(key) == [{"type": "t"}]
