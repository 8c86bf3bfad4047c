"""The behaviour every batch ``Ledger`` shares (the guarantees of kernel/batch/_ledger.py).

A backend's test module subclasses ``LedgerConformance`` and provides the
``open_ledger`` fixture: ``open_ledger(run_id, lease_seconds=...)`` is an
async context manager giving a ledger on that run, as a worker process
would open it. ``peer`` is a second worker's handle on the same run: a
second ``open_ledger`` by default (another connection, as another host
would have); a one-process ledger overrides it to share ``ledger``.
``leases = False`` skips what needs claims that lapse.

Each test names the guarantee it checks.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import AsyncIterator, Callable
from typing import Any

import attrs
import pytest
import trio

from kernel.batch import BatchTask, Claim, Ledger, TaskResult
from kernel.batch._directory import MAX_LINE_BYTES
from kernel.errors import UsageError

OpenLedger = Callable[..., contextlib.AbstractAsyncContextManager[Ledger]]

RUN = "run-1"


def task(n: int | str, **fields: Any) -> BatchTask:
    name = f"t{n:03d}" if isinstance(n, int) else n
    return BatchTask(id=name, prompt=fields.pop("prompt", f"question {n}"), **fields)


def result(task_id: str, reason: str = "final", **fields: Any) -> TaskResult:
    return TaskResult(id=task_id, reason=reason, **fields)  # type: ignore[arg-type]


def ids(claims: list[Claim]) -> list[str]:
    return [c.task.id for c in claims]


async def claim_until(ledger: Ledger, worker: str, *, limit: int = 1) -> list[Claim]:
    """Claims as soon as there is something to claim (a lease lapsing), polling briefly."""
    with trio.fail_after(30):
        while True:
            claims = await ledger.claim(worker, limit)
            if claims:
                return claims
            await trio.sleep(0.02)


# Text a task or result might carry from a hostile dataset or model.
HOSTILE = (
    "nul \x00 byte; quotes ' \" `; sql '); DROP TABLE tak_batch_tasks; --"
    " \\u0000 \\ backslashes \u2028\u2029 line seps, 🙂 astral, \ufeff bom, \r\n crlf, "
    "$$ dollar $$ %s %(x)s placeholders"
)


class LedgerConformance:
    #: Claims lapse after ``lease_seconds`` (a ledger shared by processes).
    leases: bool = True

    @pytest.fixture
    def open_ledger(self) -> OpenLedger:
        raise NotImplementedError

    @pytest.fixture
    async def ledger(self, open_ledger: OpenLedger) -> AsyncIterator[Ledger]:
        async with open_ledger(RUN) as ledger:
            yield ledger

    @pytest.fixture
    async def peer(self, open_ledger: OpenLedger, ledger: Ledger) -> AsyncIterator[Ledger]:
        async with open_ledger(RUN) as other:
            yield other

    def needs_leases(self) -> None:
        if not self.leases:
            pytest.skip("this ledger's claims do not lapse")

    # -- 1: add_tasks ----------------------------------------------------------

    async def test_run_id(self, ledger: Ledger) -> None:
        assert ledger.run_id == RUN

    async def test_add_tasks_is_idempotent(self, ledger: Ledger, peer: Ledger) -> None:
        """1: the same tasks again, from any handle, change nothing."""
        tasks = [task(i, metadata={"i": i, "tags": ["a"]}) for i in range(5)]
        await ledger.add_tasks(tasks)
        await ledger.add_tasks(tasks)
        await peer.add_tasks(tasks[2:])
        counts = await peer.counts()
        assert (counts.total, counts.finished, counts.running) == (5, 0, 0)
        assert ids(await ledger.claim("w", 10)) == [t.id for t in tasks]

    async def test_add_tasks_appends_new_ones_in_order(self, ledger: Ledger) -> None:
        """1: tasks added later come after the earlier ones, known ones keep their place."""
        await ledger.add_tasks([task(5), task(1)])
        await ledger.add_tasks([task(1), task(9), task(0)])
        assert ids(await ledger.claim("w", 10)) == ["t005", "t001", "t009", "t000"]

    async def test_a_task_id_with_other_content_is_refused(self, ledger: Ledger) -> None:
        """1: an id stored with other content is refused, and nothing of the call is added."""
        await ledger.add_tasks([task(1)])
        with pytest.raises(UsageError, match="t001"):
            await ledger.add_tasks([task(2), task(1, prompt="something else")])
        assert (await ledger.counts()).total == 1
        with pytest.raises(UsageError, match="t003"):
            await ledger.add_tasks([task(3), task(3, prompt="twice, differently")])
        assert (await ledger.counts()).total == 1

    # -- 2: claim --------------------------------------------------------------

    async def test_claim_hands_out_tasks_in_order_once(self, ledger: Ledger, peer: Ledger) -> None:
        """2: up to limit tasks in task order, attempt 1; a live claim is not handed out again."""
        tasks = [task(i) for i in range(7)]
        await ledger.add_tasks(tasks)
        first = await ledger.claim("a", 3)
        assert ids(first) == ["t000", "t001", "t002"]
        assert [c.attempt for c in first] == [1, 1, 1]
        assert first[0].task == tasks[0]
        assert ids(await peer.claim("b", 3)) == ["t003", "t004", "t005"]
        assert ids(await ledger.claim("a", 3)) == ["t006"]
        assert await peer.claim("b", 3) == []
        assert await ledger.claim("c", 1) == []
        assert (await ledger.counts()).running == 7

    async def test_claim_refuses_a_bad_limit(self, ledger: Ledger) -> None:
        await ledger.add_tasks([task(1)])
        for bad in (0, -1, True):
            with pytest.raises(UsageError):
                await ledger.claim("w", bad)

    async def test_concurrent_claims_never_share_a_task(self, ledger: Ledger, peer: Ledger) -> None:
        """2: two workers, each claiming from several tasks at once, never get the same task."""
        n = 60
        await ledger.add_tasks([task(i) for i in range(n)])
        got: dict[str, list[str]] = {"a": [], "b": []}

        async def worker(handle: Ledger, name: str) -> None:
            while claims := await handle.claim(name, 2):
                got[name].extend(ids(claims))
                await trio.lowlevel.checkpoint()

        async with trio.open_nursery() as nursery:
            for _ in range(3):
                nursery.start_soon(worker, ledger, "a")
                nursery.start_soon(worker, peer, "b")
        everything = got["a"] + got["b"]
        assert sorted(everything) == [f"t{i:03d}" for i in range(n)]  # each exactly once
        if peer is not ledger:  # two handles: both took part
            assert got["a"] and got["b"]

    async def test_a_lapsed_lease_is_claimed_again_as_the_next_attempt(
        self, open_ledger: OpenLedger
    ) -> None:
        """2: a claim not renewed within its lease goes to another worker, attempt 2."""
        self.needs_leases()
        async with open_ledger(RUN, lease_seconds=0.2) as ledger:
            await ledger.add_tasks([task(1), task(2)])
            assert ids(await ledger.claim("dead", 1)) == ["t001"]
            taken = await claim_until(ledger, "alive", limit=2)
            # t002 was free; t001 only once its lease lapsed (it comes back first: task order)
            if ids(taken) == ["t002"]:
                taken = await claim_until(ledger, "alive")
            assert ids(taken)[0] == "t001"
            assert taken[0].attempt == 2

    async def test_renew_keeps_a_claim(self, open_ledger: OpenLedger) -> None:
        """2: a renewed claim outlives its first lease; renewing another's claim does nothing."""
        self.needs_leases()
        async with open_ledger(RUN, lease_seconds=2.0) as ledger:
            await ledger.add_tasks([task(1), task(2)])
            assert ids(await ledger.claim("a", 2)) == ["t001", "t002"]
            await trio.sleep(1.2)
            assert await ledger.renew("a", ["t001", "t999"]) == ["t999"]  # not a's
            # not b's: no effect, and b learns it holds neither
            assert await ledger.renew("b", ["t001", "t002"]) == ["t001", "t002"]
            assert await ledger.renew("a", []) == []
            await trio.sleep(1.2)  # past the first lease, within the renewed one
            claims = await ledger.claim("b", 2)
            assert [(c.task.id, c.attempt) for c in claims] == [("t002", 2)]
            claims = await claim_until(ledger, "b")  # t001 lapses in the end
            assert (ids(claims), claims[0].attempt) == (["t001"], 2)

    async def test_a_worker_that_lost_its_lease_cannot_take_it_back(
        self, open_ledger: OpenLedger
    ) -> None:
        """2, 3: once another worker took a task over, the first one's renew and its
        cancelled result leave the new claim alone; its finished result still counts once."""
        self.needs_leases()
        async with open_ledger(RUN, lease_seconds=0.2) as ledger:
            await ledger.add_tasks([task(1)])
            await ledger.claim("slow", 1)
            await claim_until(ledger, "fast")
        async with open_ledger(RUN, lease_seconds=30.0) as ledger:
            assert await ledger.renew("fast", ["t001"]) == []  # now a long lease
            assert await ledger.renew("slow", ["t001"]) == ["t001"]  # slow learns it lost it
            assert await ledger.finish("slow", result("t001", "cancelled")) is True
            assert await ledger.claim("third", 1) == []  # fast's claim stands
            assert await ledger.finish("fast", result("t001", text="fast")) is True
            assert await ledger.finish("slow", result("t001", text="slow")) is False
            assert [r.text for r in await ledger.results()] == ["fast"]

    # -- 3: finish -------------------------------------------------------------

    async def test_finish_is_written_once(self, ledger: Ledger, peer: Ledger) -> None:
        """3: the first finished result wins; a later one (any worker) returns False."""
        await ledger.add_tasks([task(1), task(2)])
        await ledger.claim("a", 2)
        first = result("t001", text="first", score=1.0, input_tokens=3, attempt=1, worker="a")
        assert await ledger.finish("a", first) is True
        assert await peer.finish("b", result("t001", "error", text="second")) is False
        assert await ledger.finish("a", result("t001", "cancelled")) is False
        (stored,) = await peer.results()
        assert attrs.evolve(stored, finished_at=0.0) == attrs.evolve(first, finished_at=0.0)
        assert await ledger.claim("c", 5) == []  # t002 is still a's
        counts = await ledger.counts()
        assert (counts.total, counts.finished, counts.running) == (2, 1, 1)

    async def test_a_finished_task_is_never_claimed_again(self, ledger: Ledger) -> None:
        """2, 3: a finished task is done, whether or not its worker held a claim."""
        await ledger.add_tasks([task(1), task(2)])
        assert await ledger.finish("a", result("t002", "max_steps")) is True
        claims = await ledger.claim("a", 5)
        assert ids(claims) == ["t001"]
        assert await ledger.finish("a", result("t001", "model_error", error="boom")) is True
        assert await ledger.claim("a", 5) == []
        assert (await ledger.counts()).finished == 2

    async def test_cancelled_releases_the_claim(self, ledger: Ledger) -> None:
        """3: a cancelled result releases the claim and is the latest result until one finishes."""
        await ledger.add_tasks([task(1), task(2)])
        assert ids(await ledger.claim("a", 1)) == ["t001"]
        assert await ledger.finish("a", result("t001", "cancelled", attempt=1)) is True
        assert [(r.id, r.reason) for r in await ledger.results()] == [("t001", "cancelled")]
        counts = await ledger.counts()
        assert (counts.finished, counts.running) == (0, 0)
        again = await ledger.claim("b", 2)
        assert [(c.task.id, c.attempt) for c in again] == [("t001", 2), ("t002", 1)]
        assert await ledger.finish("b", result("t001", attempt=2)) is True
        assert [(r.id, r.reason, r.attempt) for r in await ledger.results()] == [
            ("t001", "final", 2)
        ]

    async def test_finish_of_an_unknown_task_is_refused(self, ledger: Ledger) -> None:
        await ledger.add_tasks([task(1)])
        with pytest.raises(UsageError, match="t404"):
            await ledger.finish("a", result("t404"))

    async def test_results_are_in_task_order(self, ledger: Ledger) -> None:
        """results: the latest result of every task that has one, in task order."""
        order = ["zeta", "alpha", "mid", "b2", "b10"]
        await ledger.add_tasks([task(name) for name in order])
        claims = await ledger.claim("w", 5)
        for name in reversed(order):
            if name != "mid":
                assert await ledger.finish("w", result(name, text=name))
        assert [r.id for r in await ledger.results()] == ["zeta", "alpha", "b2", "b10"]
        assert len(claims) == 5

    # -- payloads ---------------------------------------------------------------

    async def test_hostile_payloads_round_trip(self, ledger: Ledger, peer: Ledger) -> None:
        """Whatever text a dataset or a model brings comes back exactly."""
        hostile = task(
            "DROP.TABLE_x--1",
            prompt=HOSTILE,
            files={"a.txt": HOSTILE, "dir/b.py": "print('\x00')"},
            metadata={HOSTILE: [HOSTILE, {"n": -0.0, "big": 1e300, "int": 2**70}], "": None},
            expected={"answer": HOSTILE},
        )
        await ledger.add_tasks([hostile])
        await ledger.add_tasks([hostile])  # still the same content
        (claim,) = await peer.claim("w", 1)
        assert claim.task == hostile
        stored = result(
            hostile.id, text=HOSTILE * 3, error=HOSTILE, metadata={"echo": HOSTILE}, score=0.5
        )
        assert await peer.finish("w", stored) is True
        (back,) = await ledger.results()
        assert (back.text, back.error, back.metadata) == (
            stored.text,
            stored.error,
            stored.metadata,
        )

    async def test_huge_payloads_round_trip(self, ledger: Ledger) -> None:
        big = "é🙂x" * 500_000  # 3.5 MB of UTF-8
        tasks = [task(1, prompt=big, files={"big.txt": big}), task(2)]
        await ledger.add_tasks(tasks)
        claims = await ledger.claim("w", 2)
        assert [c.task for c in claims] == tasks
        assert await ledger.finish("w", result("t001", text=big)) is True
        assert (await ledger.results())[0].text == big

    async def test_unstorable_input_is_refused_in_one_line(self, ledger: Ledger) -> None:
        with pytest.raises(UsageError) as info:
            await ledger.add_tasks([task(1, metadata={"x": float("nan")})])
        assert "t001" in str(info.value) and "\n" not in str(info.value)
        await ledger.add_tasks([task(2)])
        with pytest.raises(UsageError, match="t002"):
            await ledger.finish("w", result("t002", score=float("inf")))
        assert await ledger.results() == []

    # -- 4: durable --------------------------------------------------------------

    async def test_results_and_tasks_outlive_the_handle(self, open_ledger: OpenLedger) -> None:
        """4: what finish returned True for is there when the run is opened again."""
        async with open_ledger(RUN) as ledger:
            await ledger.add_tasks([task(1), task(2), task(3)])
            await ledger.claim("w", 3)
            assert await ledger.finish("w", result("t002", text="kept")) is True
        async with open_ledger(RUN) as ledger:
            await ledger.add_tasks([task(1), task(2), task(3)])  # a resume adds them again
            assert [(r.id, r.text) for r in await ledger.results()] == [("t002", "kept")]
            assert (await ledger.counts()).finished == 1

    async def test_renew_says_a_finished_task_is_not_held(self, ledger: Ledger) -> None:
        """5: a task finished meanwhile is no longer the worker's to run."""
        await ledger.add_tasks([task(1), task(2)])
        await ledger.claim("a", 2)
        assert await ledger.finish("b", result("t001")) is True
        assert await ledger.renew("a", ["t001", "t002"]) == ["t001"]

    # -- 6: session_project ----------------------------------------------------

    async def test_the_runs_sessions_are_its_own(self, open_ledger: OpenLedger) -> None:
        """6: every handle of a run names the same project, batch.<run id>.<nonce>;
        another run's differs."""
        async with open_ledger(RUN) as first:
            project = first.session_project
        assert re.fullmatch(rf"batch\.{RUN}\.[0-9a-f]{{8}}", project), project
        async with open_ledger(RUN) as again:
            assert again.session_project == project
        async with open_ledger("run-x") as other:
            assert re.fullmatch(r"batch\.run-x\.[0-9a-f]{8}", other.session_project)
            assert other.session_project[-8:] != project[-8:]

    async def test_a_task_too_long_to_read_back_is_refused(self, ledger: Ledger) -> None:
        """4: a task over MAX_LINE_BYTES as JSON is refused when added, not stored."""
        big = task(1, prompt="x" * MAX_LINE_BYTES)
        with pytest.raises(UsageError, match=r"t001.*at most 16777216"):
            await ledger.add_tasks([big])
        assert (await ledger.counts()).total == 0

    async def test_runs_are_separate(self, open_ledger: OpenLedger) -> None:
        async with open_ledger("run-a") as a, open_ledger("run-b") as b:
            await a.add_tasks([task(1)])
            await b.add_tasks([task(1, prompt="other run, other content")])
            assert await a.finish("w", result("t001", text="a")) is True
            assert await b.finish("w", result("t001", text="b")) is True
            assert [r.text for r in await a.results()] == ["a"]
            assert [r.text for r in await b.results()] == ["b"]


@contextlib.asynccontextmanager
async def shared(ledger: Ledger) -> AsyncIterator[Ledger]:
    """A handle that is ``ledger`` itself (for one-process ledgers' ``peer``)."""
    yield ledger
