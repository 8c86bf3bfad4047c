from __future__ import annotations

from typing import Any

import pytest

from kernel.errors import UsageError
from kernel.store import SessionKey


def test_valid_keys() -> None:
    key = SessionKey("proj-1", "Sess_2.x", "subagents/a.b/subagents/c")
    assert key.subpath == "subagents/a.b/subagents/c"
    assert not key.is_main
    assert key.main == SessionKey("proj-1", "Sess_2.x")
    assert key.main.is_main
    assert SessionKey("p", "s").child("a").child("b") == SessionKey("p", "s", "a/b")
    assert SessionKey("p", "x" * 128).session_id == "x" * 128
    assert SessionKey("p", ".hidden").session_id == ".hidden"


def test_keys_are_values() -> None:
    assert SessionKey("p", "s", "a") == SessionKey("p", "s", "a")
    assert len({SessionKey("p", "s"), SessionKey("p", "s"), SessionKey("p", "s", "a")}) == 2


def test_names_are_unique_and_readable() -> None:
    keys = [
        SessionKey("p", "s"),
        SessionKey("p", "s", "a"),
        SessionKey("p", "s", "a/b"),
        SessionKey("p", "s.a"),
        SessionKey("p.s", "a"),
    ]
    assert len({k.name for k in keys}) == len(keys)
    assert str(SessionKey("p", "s", "a/b")) == "p/s:a/b"


@pytest.mark.parametrize(
    ("args", "field"),
    [
        (("", "s"), "project"),
        (("p/q", "s"), "project"),
        ((".", "s"), "project"),
        (("p", ".."), "session_id"),
        (("p", "a b"), "session_id"),
        (("p", "ü"), "session_id"),
        (("p", "a:b"), "session_id"),
        (("p", "x" * 129), "session_id"),
        (("p", "s\n"), "session_id"),
        (("p", "s", ""), "subpath"),
        (("p", "s", "/a"), "subpath segment 0"),
        (("p", "s", "a/"), "subpath segment 1"),
        (("p", "s", "a//b"), "subpath segment 1"),
        (("p", "s", "a/../b"), "subpath segment 1"),
        (("p", "s", "./a"), "subpath segment 0"),
        (("p", "s", "a\\b"), "subpath segment 0"),
        (("p", "s", "a.jsonl/b"), "subpath segment 0"),
        (("p", "s", "a/b.jsonl"), "subpath segment 1"),
        ((3, "s"), "project"),
        (("p", None), "session_id"),
        (("p", "s", b"a"), "subpath"),
    ],
)
def test_bad_keys_name_the_field(args: tuple[Any, ...], field: str) -> None:
    with pytest.raises(UsageError) as info:
        SessionKey(*args)
    assert str(info.value).startswith(field + ":")
