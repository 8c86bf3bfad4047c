"""A turn that crashed while its calls ran, as the resume and tracing tests make it.

``crash_while_calls_run`` runs a real turn (scripted model, the tools below) until a
``hang`` call runs and gives back the entries the store held at that moment: what a
SIGKILL leaves. ``memory_copy`` puts them in a fresh store. The tools count their runs in
``RUNS``, which a test module resets before each test (``RUNS.reset()`` in an autouse
fixture): the object is never replaced, so ``from tests.crashed_turn_kit import RUNS``
stays the one the tools write to.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import trio

from kernel import tool
from kernel.agent import Agent
from kernel.models import ScriptedModel
from kernel.session import Session
from kernel.store import MemoryStore, SessionKey

KEY = SessionKey("p", "task-1")


class Runs:
    """How many times each tool ran; set when a hanging call has started."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        """As new: no run counted, neither event set (each test's own trio run)."""
        self.count: dict[str, int] = {}
        self.hanging = trio.Event()
        self.release = trio.Event()

    def ran(self, name: str) -> None:
        self.count[name] = self.count.get(name, 0) + 1


RUNS = Runs()


@tool
async def hang() -> str:
    """Run until cancelled (a side effect happens first)."""
    RUNS.ran("hang")
    RUNS.hanging.set()
    await trio.sleep_forever()
    raise AssertionError("unreachable")


@tool
async def slow() -> str:
    """Run until released, then return a real result."""
    RUNS.ran("slow")
    RUNS.hanging.set()
    await RUNS.release.wait()
    return "the real result"


@tool
async def note(text: str) -> str:
    """Write a note (a side effect)."""
    RUNS.ran("note")
    return f"noted {text}"


@tool
async def read_file(path: str) -> str:
    """Read a file (fails as ``open`` does, naming the path)."""
    raise FileNotFoundError(2, "No such file or directory", path)


TOOLS = [hang, slow, note, read_file]


async def crash_while_calls_run(model: ScriptedModel, *, agent: Agent | None = None) -> list[Any]:
    """Run a turn until a ``hang`` call runs; the entries the store held at that moment."""
    session = Session(MemoryStore(), KEY)
    runner = agent if agent is not None else Agent(model, TOOLS)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(runner.run_turn, session, "go")
        await RUNS.hanging.wait()
        entries = await session.entries()
        nursery.cancel_scope.cancel()
    return entries


async def memory_copy(entries: Sequence[Any]) -> Session:
    store = MemoryStore()
    await store.append(KEY, entries)
    return Session(store, KEY)


def answering(entries: Sequence[dict[str, Any]], uuid: str) -> list[dict[str, Any]]:
    return [e for e in entries if e.get("type") == "tool" and e.get("answers") == uuid]
