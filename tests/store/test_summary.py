from __future__ import annotations

import copy
import enum
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kernel.errors import UsageError
from kernel.store import FileStore, SessionKey, SessionSummary, SummaryData, fold_session_summary

KEY = SessionKey("p", "s")

scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-5, 10**6),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=5),
)
usage = st.one_of(
    scalars,
    st.fixed_dictionaries(
        {}, optional={"input_tokens": scalars, "output_tokens": scalars, "other": scalars}
    ),
)
entries = st.lists(
    st.fixed_dictionaries(
        {"type": st.sampled_from(["user", "assistant", "tool", "title", "x"])},
        optional={
            "uuid": st.text(max_size=4),
            "timestamp": scalars,
            "usage": usage,
            "cost_usd": st.one_of(scalars, st.floats(0, 10)),
            "title": scalars,
            "model": scalars,
        },
    ),
    max_size=8,
)
prevs = st.one_of(
    st.none(),
    st.builds(
        lambda es, mtime: SessionSummary("s", mtime, fold_session_summary(None, KEY, es).data),
        entries,
        st.integers(0, 2**42),
    ),
)


@settings(max_examples=300)
@given(prev=prevs, a=entries, b=entries)
def test_fold_is_associative(prev: SessionSummary | None, a: list[Any], b: list[Any]) -> None:
    assert fold_session_summary(fold_session_summary(prev, KEY, a), KEY, b) == (
        fold_session_summary(prev, KEY, a + b)
    )


@settings(max_examples=200)
@given(prev=prevs, a=entries)
def test_fold_is_pure(prev: SessionSummary | None, a: list[Any]) -> None:
    prev_before = copy.deepcopy(prev)
    a_before = copy.deepcopy(a)
    first = fold_session_summary(prev, KEY, a)
    assert fold_session_summary(prev, KEY, a) == first  # no clock, no hidden state
    assert prev == prev_before and a == a_before  # nothing mutated
    assert first.mtime_ms == (prev.mtime_ms if prev is not None else 0)  # never stamped
    assert fold_session_summary(prev, KEY, []) == (
        prev if prev is not None else SessionSummary("s", 0, SummaryData())
    )


def test_fold_counts_what_it_should() -> None:
    es = [
        {"type": "user", "timestamp": "t1", "title": "first"},
        {"type": "assistant", "usage": {"input_tokens": 7, "output_tokens": 2}, "model": "m"},
        {"type": "assistant", "usage": {"input_tokens": True, "output_tokens": -3}},
        {"type": "tool", "cost_usd": 0.1, "timestamp": 5},
        {"type": "tool", "cost_usd": 0.2, "timestamp": "t2"},
        {"type": "title", "title": "second"},
    ]
    data = fold_session_summary(None, KEY, es).data
    assert data.entry_count == 6
    assert data.type_counts == {"user": 1, "assistant": 2, "tool": 2, "title": 1}
    assert (data.input_tokens, data.output_tokens) == (7, 2)
    assert data.cost_nano_usd == 300_000_000
    assert data.cost_usd == pytest.approx(0.3)
    assert (data.first_timestamp, data.last_timestamp) == ("t1", "t2")
    assert (data.title, data.model) == ("second", "m")


def test_fold_refuses_child_keys_and_other_sessions() -> None:
    with pytest.raises(UsageError, match="main transcripts"):
        fold_session_summary(None, KEY.child("sub"), [])
    with pytest.raises(UsageError, match="prev"):
        fold_session_summary(SessionSummary("other", 0), KEY, [])


def test_type_counts_of_prev_are_not_shared() -> None:
    prev = fold_session_summary(None, KEY, [{"type": "a"}])
    fold_session_summary(prev, KEY, [{"type": "a"}, {"type": "b"}])
    assert prev.data.type_counts == {"a": 1}


async def test_the_stored_summary_equals_the_fold_of_what_loads(tmp_path: Path) -> None:
    """Numbers of a subclass (IntEnum) are written as JSON numbers: the fold counts them so."""

    class Tokens(enum.IntEnum):
        MANY = 7

    key = SessionKey("p", "s")
    async with FileStore(tmp_path) as store:
        await store.append(
            key,
            [
                {
                    "type": "assistant",
                    "uuid": "u1",
                    "usage": {"input_tokens": Tokens.MANY},
                    "cost_usd": Tokens.MANY,
                }
            ],
        )
    async with FileStore(tmp_path) as store:
        loaded = await store.load(key)
        [stored] = await store.list_session_summaries("p")
    assert loaded is not None
    expected = fold_session_summary(None, key, loaded)
    assert stored.data == expected.data
    assert stored.data.input_tokens == 7
