from __future__ import annotations

import pytest
import trio
import trio.testing

from kernel.store._locks import KeyedLocks, SessionGates


async def test_table_empties_after_100k_keys() -> None:
    idle: list[str] = []
    locks: KeyedLocks[str] = KeyedLocks(on_idle=idle.append)
    for i in range(100_000):
        async with locks.hold(f"k{i}"):
            assert len(locks) == 1
    assert len(locks) == 0
    assert len(idle) == 100_000


async def test_one_holder_per_key(autojump_clock: trio.testing.MockClock) -> None:
    locks: KeyedLocks[str] = KeyedLocks()
    inside = 0
    most = 0

    async def worker() -> None:
        nonlocal inside, most
        async with locks.hold("k"):
            inside += 1
            most = max(most, inside)
            await trio.sleep(1)
            inside -= 1

    async with trio.open_nursery() as nursery:
        for _ in range(10):
            nursery.start_soon(worker)
        await trio.testing.wait_all_tasks_blocked()
        assert len(locks) == 1
    assert most == 1
    assert trio.current_time() == pytest.approx(10)
    assert len(locks) == 0


async def test_different_keys_do_not_wait(autojump_clock: trio.testing.MockClock) -> None:
    locks: KeyedLocks[str] = KeyedLocks()
    async with locks.hold("a"):
        with trio.fail_after(1):
            async with locks.hold("b"):
                assert "a" in locks and "b" in locks
    assert len(locks) == 0


async def test_cancelled_waiter_leaves_no_entry(autojump_clock: trio.testing.MockClock) -> None:
    locks: KeyedLocks[str] = KeyedLocks()
    release = trio.Event()

    async def holder() -> None:
        async with locks.hold("k"):
            await release.wait()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(holder)
        await trio.testing.wait_all_tasks_blocked()
        with trio.move_on_after(1):
            async with locks.hold("k"):
                pytest.fail("got a held lock")
        assert "k" in locks
        release.set()
    assert len(locks) == 0
    entry = locks.acquire_nowait("k")
    assert entry is not None
    assert locks.acquire_nowait("k") is None
    locks.release("k", entry)
    assert len(locks) == 0


async def test_gate_delete_waits_for_opens_and_holds_back_new_ones(
    autojump_clock: trio.testing.MockClock,
) -> None:
    gates: SessionGates[str] = SessionGates()
    log: list[str] = []

    async def opener(name: str, delay: float) -> None:
        await trio.sleep(delay)
        await gates.enter_open("s")
        log.append(f"{name} opens")
        await trio.sleep(1)
        log.append(f"{name} opened")
        gates.exit_open("s")

    async def deleter() -> None:
        await trio.sleep(0.5)
        await gates.enter_delete("s")
        log.append("delete")
        await trio.sleep(1)
        gates.exit_delete("s")

    async with trio.open_nursery() as nursery:
        nursery.start_soon(opener, "a", 0)
        nursery.start_soon(deleter)
        nursery.start_soon(opener, "b", 0.7)
        nursery.start_soon(opener, "other", 0.7)
    # The delete waited for a's open; b and the other opener waited for it.
    assert log[:3] == ["a opens", "a opened", "delete"]
    assert sorted(log[3:]) == ["b opened", "b opens", "other opened", "other opens"]
    assert len(gates) == 0


async def test_gate_of_another_session_is_not_held(autojump_clock: trio.testing.MockClock) -> None:
    gates: SessionGates[str] = SessionGates()
    await gates.enter_delete("s")
    with trio.fail_after(1):
        await gates.enter_open("t")
    gates.exit_open("t")
    gates.exit_delete("s")
    assert len(gates) == 0
