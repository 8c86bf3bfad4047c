"""A slow store is waited for; a cancelled turn waits only its grace (kernel.agent).

The store bounds its own calls (``[store] request_timeout_s``: a PostgreSQL
restart of 8-12 s is ridden out inside it). A turn that gave up on its own after
a fixed 10 s dropped the results the store was about to take — or refused to run
calls whose record was being written — so a database restart failed every turn
writing at the time.
"""

from __future__ import annotations

from typing import Any

import pytest
import trio

from kernel import tool
from kernel.agent import Agent, RunLimits
from kernel.errors import StoreError
from kernel.models import ScriptedModel
from kernel.session import Session
from kernel.store import MemoryStore, SessionKey

reply = ScriptedModel.reply


@tool
async def lookup(term: str) -> str:
    """Look a term up."""
    return f"{term}: found"


class SlowStore(MemoryStore):
    """Appends of the given entry type take ``seconds`` (a store riding out a restart)."""

    def __init__(self, entry_type: str, seconds: float) -> None:
        super().__init__()
        self.entry_type, self.seconds = entry_type, seconds

    async def append(self, key: SessionKey, entries: Any) -> None:
        if any(e.get("type") == self.entry_type for e in entries):
            await trio.sleep(self.seconds)
        await super().append(key, entries)


@pytest.mark.parametrize("entry_type", ["assistant", "tool"])
async def test_a_write_slower_than_the_grace_still_lands_when_nothing_was_cancelled(
    autojump_clock: trio.abc.Clock, entry_type: str
) -> None:
    store = SlowStore(entry_type, 25)  # within the store's 30 s, past the old 10 s
    session = Session(store, SessionKey("p", "s1"))
    model = ScriptedModel([reply(calls=[("lookup", {"term": "x"})]), "done"])
    result = await Agent(model, [lookup]).run_turn(session, "go")
    assert (result.reason, result.text) == ("final", "done")
    messages = await session.messages()
    assert [m.role for m in messages] == ["user", "assistant", "tool", "assistant"]
    assert messages[2].observations[0].content == "x: found"


async def test_a_cancelled_turn_waits_for_its_record_only_the_grace(
    autojump_clock: trio.abc.Clock,
) -> None:
    store = SlowStore("assistant", 3600)  # a store that never answers in time
    session = Session(store, SessionKey("p", "s1"))
    model = ScriptedModel([reply(calls=[("lookup", {"term": "x"})]), "unreached"])
    with pytest.raises(StoreError, match="cancelled"):
        await Agent(model, [lookup], limits=RunLimits(wall_time=1)).run_turn(session, "go")
