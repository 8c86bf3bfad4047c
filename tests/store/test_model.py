"""Any sequence of appends and deletes leaves a store where a plain model says."""

from __future__ import annotations

import tempfile
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kernel.store import FileStore, MemoryStore, SessionKey, fold_session_summary
from kernel.store._base import BaseStore

KEYS = [
    SessionKey(project, sid, sub)
    for project in ("p", "q")
    for sid in ("a", "b")
    for sub in (None, "x", "x/y")
]

entry_st = st.fixed_dictionaries(
    {"type": st.sampled_from(["user", "assistant", "tool"])},
    optional={
        "uuid": st.sampled_from([f"u{i}" for i in range(6)]),
        "usage": st.fixed_dictionaries({"input_tokens": st.integers(0, 100)}),
        "cost_usd": st.floats(0, 1),
        "title": st.text(max_size=3),
    },
)
op_st = st.one_of(
    st.tuples(st.just("append"), st.integers(0, len(KEYS) - 1), st.lists(entry_st, max_size=4)),
    st.tuples(st.just("delete"), st.integers(0, len(KEYS) - 1), st.just([])),
)


class Model:
    def __init__(self) -> None:
        self.entries: dict[SessionKey, list[dict[str, Any]]] = {}

    def append(self, key: SessionKey, batch: list[dict[str, Any]]) -> bool:
        have = self.entries.setdefault(key, [])
        uuids = {e["uuid"] for e in have if "uuid" in e}
        added = False
        for e in batch:
            if "uuid" in e:
                if e["uuid"] in uuids:
                    continue
                uuids.add(e["uuid"])
            have.append(e)
            added = True
        return added

    def delete(self, key: SessionKey) -> None:
        for k in list(self.entries):
            if k == key or (key.is_main and k.main == key):
                del self.entries[k]

    def load(self, key: SessionKey) -> list[dict[str, Any]] | None:
        return self.entries.get(key) or None


async def check(store: BaseStore, model: Model) -> None:
    for key in KEYS:
        assert await store.load(key) == model.load(key), key
    for project in ("p", "q"):
        mains = sorted(
            k.session_id for k in KEYS if k.project == project and k.is_main and model.load(k)
        )
        assert [i.session_id for i in await store.list_sessions(project)] == mains
        summaries = await store.list_session_summaries(project)
        assert [s.session_id for s in summaries] == mains
        for s in summaries:
            key = SessionKey(project, s.session_id)
            assert s.data == fold_session_summary(None, key, model.load(key) or []).data
        for sid in ("a", "b"):
            main = SessionKey(project, sid)
            subs = [k.subpath for k in KEYS if k.main == main and k.subpath and model.load(k)]
            assert await store.list_subkeys(main) == sorted(s for s in subs if s)


async def run_ops(store: BaseStore, ops: list[tuple[str, int, list[dict[str, Any]]]]) -> None:
    model = Model()
    last_mtime: dict[SessionKey, int] = {}
    for op, index, batch in ops:
        key = KEYS[index]
        if op == "append":
            added = model.append(key, batch)
            await store.append(key, batch)
            if key.is_main and added:
                (info,) = [
                    i
                    for i in await store.list_sessions(key.project)
                    if i.session_id == key.session_id
                ]
                assert info.mtime_ms > last_mtime.get(key, 0)
                last_mtime[key] = info.mtime_ms
        else:
            model.delete(key)
            await store.delete(key)
            if key.is_main:
                last_mtime.pop(key, None)
    await check(store, model)


@settings(max_examples=150, deadline=None)
@given(ops=st.lists(op_st, max_size=25))
async def test_memory_store_matches_model(ops: list[tuple[str, int, list[dict[str, Any]]]]) -> None:
    async with MemoryStore() as store:
        await run_ops(store, ops)


@pytest.mark.parametrize("max_open", [1, 64])
@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(ops=st.lists(op_st, max_size=25))
async def test_file_store_matches_model(
    max_open: int, ops: list[tuple[str, int, list[dict[str, Any]]]]
) -> None:
    with tempfile.TemporaryDirectory() as root:
        async with FileStore(root, max_open=max_open) as store:
            await run_ops(store, ops)
        async with FileStore(root) as store:  # and the same after reopening
            model = Model()
            for op, index, batch in ops:
                if op == "append":
                    model.append(KEYS[index], batch)
                else:
                    model.delete(KEYS[index])
            await check(store, model)
