"""A kernel that runs turn after turn does not grow (issue 13).

Each turn used to build the ``delegate`` tool anew: an attrs class and its
cattrs code per turn, kept for good by the converters' dispatch caches
(~23 KB a turn). These tests count what a long run keeps: the caches' entries
(exactly) and the bytes Python allocated (tracemalloc, with a bound far below
what the per-turn ``delegate`` kept). Time is not measured here: the turn rows of issue 13 live
in bench/bench_agent.py.
"""

from __future__ import annotations

import gc
import tracemalloc
from collections.abc import Iterator
from pathlib import Path

import cattrs
import pytest

from kernel import Kernel, open_kernel, tool
from kernel.messages import converter as messages_converter
from kernel.models import ModelRequest, ModelResponse, ScriptedModel
from kernel.store import MemoryStore
from kernel.tools._strict import converter as tools_converter

# The HistoryCache keeps up to 64 sessions (subagents' too) before it evicts:
# the warm-up fills it, so what follows measures turns, not a cache filling up.
WARM_UP = 80
#: Bytes a run may seem to keep without a leak: Trio's deadline heap holds
#: expired cancel scopes (a turn makes several) until it has about a thousand,
#: then prunes them, so up to ~0.5 MB comes and goes. The per-turn ``delegate``
#: kept ~23 KB a turn: 7 MB over ``TURNS``.
NOISE_BYTES = 1_500_000
TURNS = 300


@tool
async def lookup(key: str) -> str:
    """Look a key up.

    Args:
        key: The key.
    """
    return f"value of {key}"


def script(request: ModelRequest) -> ModelResponse:
    """A parent turn calls ``lookup`` and ``delegate`` at once; the subagent calls
    ``lookup``; each answers once its results are back."""
    last = request.messages[-1]
    if last.role == "tool":
        return ScriptedModel.reply("done")
    if last.text == "sub":
        return ScriptedModel.reply(calls=[("lookup", {"key": "b"})])
    return ScriptedModel.reply(
        calls=[("lookup", {"key": "a"}), ("delegate", {"task": "sub", "tools": ["lookup"]})]
    )


def dispatch_cache_sizes() -> list[int]:
    """Entries in the structure and unstructure dispatch caches of the kernel's converters."""
    sizes = []
    for conv in (tools_converter, messages_converter):
        assert isinstance(conv, cattrs.Converter)
        for dispatch in (conv._structure_func, conv._unstructure_func):
            sizes.append(dispatch.dispatch.cache_info().currsize)
    return sizes


async def turns(k: Kernel, count: int) -> None:
    """``count`` turns, each on a new session deleted after it: the store keeps nothing."""
    for _ in range(count):
        session = k.session()
        finished = await k.run_turn(session, "go")
        assert (finished.reason, finished.text) == ("final", "done")
        await k.store.delete(session.key)
        k.history.forget(session.key)


@pytest.fixture
def traced() -> Iterator[None]:
    tracemalloc.start()
    try:
        yield
    finally:
        tracemalloc.stop()


def allocated() -> int:
    gc.collect()
    return tracemalloc.get_traced_memory()[0]


async def test_turns_with_subagents_keep_nothing(
    tmp_path: Path, stress: bool, traced: None
) -> None:
    count = 3_000 if stress else TURNS
    model = ScriptedModel(script, name="scripted:leak", keep_requests=1)
    async with open_kernel(
        home=tmp_path, store=MemoryStore(), model=model, tools=[lookup], plugins=[]
    ) as k:
        assert k.agent.subagents  # the kernel's default, and the path that leaked
        await turns(k, WARM_UP)
        caches, before = dispatch_cache_sizes(), allocated()
        await turns(k, count)
        grown = allocated() - before
        assert dispatch_cache_sizes() == caches
        assert grown < NOISE_BYTES, f"{grown / count:.0f} bytes kept a turn"
        # the subagent did run (the last turn's child answered its task)
        last = model.requests[-1].messages
        assert [o.content for o in last[-1].observations] == ["value of a", "done"]
