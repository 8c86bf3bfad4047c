"""The embedding API: open_kernel, sessions on disk, call_tools, run_turn, background compaction."""

from __future__ import annotations

from pathlib import Path

import pytest
import trio
import trio.testing

from kernel import ToolCall, UsageError, open_kernel, tool
from kernel.models import ScriptedModel
from kernel.session import Session


@tool
async def double(x: int) -> int:
    """Double x."""
    await trio.sleep(0.01)
    return 2 * x


async def test_call_tools_runs_and_persists_the_batch(tmp_path: Path) -> None:
    calls = [ToolCall("a", "double", {"x": 2}), ToolCall("b", "double", {"x": "no"})]
    async with open_kernel(home=tmp_path / "home", tools=[double]) as k:
        session = k.session("s1")
        observations = await k.call_tools(session, calls)
        assert observations[0].content == "4"
        assert observations[1].error is not None
        assert observations[1].error.kind == "bad_arguments"
    # a new kernel on the same home sees the transcript on disk
    async with open_kernel(home=tmp_path / "home", tools=[double]) as k:
        messages = await k.session("s1").messages()
        assert [m.role for m in messages] == ["assistant", "tool"]
        assert [c.id for c in messages[0].tool_calls] == ["a", "b"]
        assert list(messages[1].observations) == observations
        assert (tmp_path / "home/data/sessions/default/s1/transcript.jsonl").is_file()


async def test_run_turn_with_a_model_and_tools(tmp_path: Path) -> None:
    model = ScriptedModel([ScriptedModel.reply(calls=[("double", {"x": 21})]), "It is 42."])
    async with open_kernel(home=tmp_path, model=model, tools=[double]) as k:
        session = k.session()
        result = await k.run_turn(session, "double 21")
        assert (result.reason, result.text) == ("final", "It is 42.")
        summaries = await k.store.list_session_summaries("default")
        assert [s.session_id for s in summaries] == [session.key.session_id]


async def test_compaction_runs_in_the_kernels_nursery(tmp_path: Path) -> None:
    answers = iter(["one", "two", "SUMMARY", "three"])
    model = ScriptedModel(lambda request: next(answers))
    async with open_kernel(home=tmp_path, model=model, compact_after_tokens=1) as k:
        session = k.session("c")
        await k.run_turn(session, "first")
        await k.run_turn(session, "second")  # compaction starts after this turn
        # Poll: the compaction task is the kernel's, not ours. A generous budget:
        # on a loaded machine its store reads (in threads) took more than 5 s.
        for _ in range(3000):
            if any(e["type"] == "compaction" for e in await session.entries()):
                break
            await trio.sleep(0.01)
        else:
            pytest.fail("no compaction entry after 30 s")
        await k.run_turn(session, "third")
    assert model.requests[-1].messages[0].text.endswith("SUMMARY")


async def test_scripted_model_by_name(tmp_path: Path) -> None:
    async with open_kernel(home=tmp_path, model="scripted:echo") as k:
        result = await k.run_turn(k.session(), "say this back")
        assert "say this back" in result.text


async def test_bad_workspace_and_model_are_usage_errors(tmp_path: Path) -> None:
    with pytest.raises(UsageError, match="not a directory"):
        async with open_kernel(home=tmp_path, workspace=tmp_path / "missing"):
            pass
    with pytest.raises(UsageError, match="nope"):
        async with open_kernel(home=tmp_path, model="nope:model"):
            pass


async def test_an_error_in_the_body_comes_back_as_itself(tmp_path: Path) -> None:
    with pytest.raises(KeyError):
        async with open_kernel(home=tmp_path):
            raise KeyError("mine")


async def test_call_tools_cancelled_mid_batch_still_records_every_call(tmp_path: Path) -> None:
    @tool
    async def slow(seconds: float) -> str:
        """Sleep."""
        await trio.sleep(seconds)
        return "slept"

    calls = [
        ToolCall("fast", "slow", {"seconds": 0.01}),
        ToolCall("stuck", "slow", {"seconds": 60}),
    ]
    async with open_kernel(home=tmp_path, tools=[slow], plugins=[]) as k:
        session = k.session("cancelled")
        with trio.move_on_after(0.5) as scope:
            await k.call_tools(session, calls)
        assert scope.cancelled_caught
        messages = await session.messages()
    assert [m.role for m in messages] == ["assistant", "tool"]
    observations = messages[1].observations
    assert observations[0].content == "slept"
    assert observations[1].error is not None and observations[1].error.kind == "cancelled"


async def test_call_tools_with_duplicate_ids_records_invalid_calls(tmp_path: Path) -> None:
    calls = [ToolCall("same", "double", {"x": 1}), ToolCall("same", "double", {"x": 2})]
    async with open_kernel(home=tmp_path, tools=[double], plugins=[]) as k:
        observations = await k.call_tools(k.session("dup"), calls)
        messages = await k.session("dup").messages()
    assert [o.error.kind for o in observations if o.error] == ["invalid_call", "invalid_call"]
    assert list(messages[1].observations) == observations


async def test_agents_for_other_models_are_bounded(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A client naming a new model per request must not grow the kernel without bound."""
    from kernel.kernel import MAX_MODEL_AGENTS

    monkeypatch.setenv("OPENAI_API_KEY", "sk-test")  # resolving a model sends nothing
    async with open_kernel(home=tmp_path, plugins=[]) as k:
        assert k.agent_for(None) is k.agent
        first = k.agent_for("openai:m0")
        assert k.agent_for("openai:m0") is first  # kept: the same agent
        for i in range(1, MAX_MODEL_AGENTS):
            k.agent_for(f"openai:m{i}")
        assert k.agent_for("openai:m0") is first  # used again: now the most recent
        k.agent_for("openai:one-more")  # past the bound: m1, the least recently used, goes
        assert len(k._agents) == MAX_MODEL_AGENTS
        assert k.agent_for("openai:m0") is first
        assert "openai:m1" not in k._agents
        assert k.agent_for("openai:m1").model.name == "openai:m1"  # made again on demand


async def test_a_turn_ending_while_compaction_runs_gets_one_after_it(tmp_path: Path) -> None:
    """The compaction after turn 1 may still be reading when turn 2 ends; turn 2's
    must then run after it, not be dropped (it was: 1 run in 3 had no compaction)."""
    async with open_kernel(home=tmp_path, model="scripted:echo", compact_after_tokens=1) as k:
        release = trio.Event()
        calls = 0

        async def compact(session: Session, *, keep_last_turns: int = 1) -> bool:
            nonlocal calls
            calls += 1
            if calls == 1:
                await release.wait()
            return False

        k.agent.compact = compact  # type: ignore[method-assign]
        session = k.session("c")
        k._compact_later(session)  # turn 1's: blocks
        await trio.testing.wait_all_tasks_blocked()
        k._compact_later(session)  # turn 2 ended meanwhile
        k._compact_later(session)  # and turn 3: one more run covers both
        release.set()
        await trio.testing.wait_all_tasks_blocked()
        assert calls == 2
        assert not k._compacting and not k._compact_again


async def test_a_turn_primes_a_spare_worker_only_for_the_kernels_own_workspace(
    tmp_path: Path,
) -> None:
    """A turn starts the pool's spare process (ready by the time calls come); a turn
    in a lent workspace does not (its workers get processes of their own), and a
    kernel that runs no turn starts none."""
    async with open_kernel(home=tmp_path, model="scripted:echo") as k:
        pool = k.plugins.pool
        assert pool._spare is None and not pool._spare_coming
        lent_dir = tmp_path / "lent"
        lent_dir.mkdir()
        async with k.open_workspace(lent_dir) as lent:
            await k.run_turn(k.session("lent"), "hi", workspace=lent)
        await trio.sleep(0.2)  # a spare, had one been asked for, would be coming
        assert pool._spare is None and not pool._spare_coming
        await k.run_turn(k.session("own"), "hi")
        with trio.fail_after(30):
            while pool._spare is None:  # noqa: ASYNC110 (the spare starts in the background)
                await trio.sleep(0.01)
