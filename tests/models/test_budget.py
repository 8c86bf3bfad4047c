"""The shared model budget (kernel/models/_budget.py): each test names the guarantee it checks.

Most run real adapters against ``RateLimitedProvider``, a fake OpenAI server at
the HTTP wire that enforces its own limits (requests per fixed minute,
concurrent requests) and answers 429 with ``Retry-After`` past them, on the
mock clock.
"""

from __future__ import annotations

import json
import math
from typing import Any

import httpx
import pytest
import trio
import trio.testing

from kernel.errors import UsageError
from kernel.models import (
    BudgetLimits,
    FallbackModel,
    Grant,
    ModelBudget,
    ModelRequest,
    OpenAIModel,
    ProviderLoad,
    RetryPolicy,
    resolve_model,
)

from .wire import collect, final, sse, user

REQUEST = ModelRequest((user("hi"),), max_tokens=100)
PATIENT = RetryPolicy(max_attempts=50, max_total=3600, max_delay=60)


class RateLimitedProvider:
    """An OpenAI-compatible server with a rate limit, answering after ``latency`` seconds.

    Past ``requests_per_minute`` in the current minute (fixed windows, as many
    providers count) it answers 429 with ``Retry-After`` until the next
    minute; past ``max_concurrent`` requests at once, 429 with
    ``Retry-After: 1``; ``retry_after=False`` leaves the header out.
    """

    def __init__(
        self,
        *,
        requests_per_minute: int | None = None,
        max_concurrent: int | None = None,
        latency: float = 1.0,
        retry_after: bool = True,
    ) -> None:
        self.requests_per_minute = requests_per_minute
        self.max_concurrent = max_concurrent
        self.latency = latency
        self.retry_after = retry_after
        self.minute = -1
        self.in_minute = 0
        self.in_flight = 0
        self.most_in_flight = 0
        self.refused = 0
        self.served: list[float] = []  # when each accepted request arrived
        self.refused_at: list[float] = []

    def _refuse(self, now: float, wait: float) -> httpx.Response:
        self.refused += 1
        self.refused_at.append(now)
        headers = {"retry-after": str(math.ceil(wait))} if self.retry_after else {}
        body = {"error": {"message": "Rate limit reached.", "type": "requests"}}
        return httpx.Response(429, json=body, headers=headers)

    async def handler(self, request: httpx.Request) -> httpx.Response:
        now = trio.current_time()
        minute = int(now // 60)
        if minute != self.minute:
            self.minute, self.in_minute = minute, 0
        if self.requests_per_minute is not None and self.in_minute >= self.requests_per_minute:
            return self._refuse(now, (minute + 1) * 60 - now)
        if self.max_concurrent is not None and self.in_flight >= self.max_concurrent:
            return self._refuse(now, 1)
        self.in_minute += 1
        self.served.append(now)
        self.in_flight += 1
        self.most_in_flight = max(self.most_in_flight, self.in_flight)
        try:
            await trio.sleep(self.latency)
        finally:
            self.in_flight -= 1
        usage = {"prompt_tokens": 20, "completion_tokens": 5, "total_tokens": 25}
        if json.loads(request.content).get("stream"):
            choice = {"index": 0, "delta": {"content": "ok"}, "finish_reason": None}
            body = sse({"choices": [choice]}) + sse({"choices": [], "usage": usage})
            body += sse("[DONE]")
            return httpx.Response(200, headers={"content-type": "text/event-stream"}, text=body)
        message = {"role": "assistant", "content": "ok"}
        choices = [{"index": 0, "message": message, "finish_reason": "stop"}]
        return httpx.Response(200, json={"choices": choices, "usage": usage})

    def client(self) -> httpx.AsyncClient:
        return httpx.AsyncClient(transport=httpx.MockTransport(self.handler))


def openai(
    client: httpx.AsyncClient, budget: ModelBudget | None, name: str = "gpt-4.1-mini"
) -> Any:
    return resolve_model(
        f"openai:{name}",
        client=client,
        budget=budget,
        retry=PATIENT,
        env={"OPENAI_API_KEY": "k", "OPENAI_BASE_URL": "http://127.0.0.1:9/v1"},
    )


async def run_all(model: Any, count: int, *, stream: bool = False) -> None:
    async def one() -> None:
        if stream:
            assert final(await collect(model, REQUEST)).message.text == "ok"
        else:
            assert (await model.complete(REQUEST)).message.text == "ok"

    async with trio.open_nursery() as nursery:
        for _ in range(count):
            nursery.start_soon(one)


def most_in_a_minute(times: list[float]) -> int:
    """The most requests that arrived in any 60 seconds."""
    times = sorted(times)
    start = best = 0
    for end, t in enumerate(times):
        while times[start] <= t - 60:
            start += 1
        best = max(best, end - start + 1)
    return best


def row(budget: ModelBudget, provider: str, model: str | None = None) -> ProviderLoad:
    return next(r for r in budget.snapshot() if (r.provider, r.model) == (provider, model))


# --- 1. limits ------------------------------------------------------------------------


async def test_1_max_connections_holds_under_200_concurrent_requests(
    autojump_clock: trio.testing.MockClock,
) -> None:
    provider = RateLimitedProvider(max_concurrent=10)
    budget = ModelBudget(providers={"openai": BudgetLimits(max_connections=10)})
    async with provider.client() as client:
        await run_all(openai(client, budget), 200)
    assert provider.refused == 0
    assert provider.most_in_flight == 10
    assert len(provider.served) == 200
    assert row(budget, "openai").in_flight == 0


async def test_1_without_a_budget_the_same_load_is_refused(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # The fake's limit bites: what the budget prevents above is real.
    provider = RateLimitedProvider(max_concurrent=10)
    async with provider.client() as client:
        await run_all(openai(client, None), 200)
    assert provider.refused > 100


async def test_1_a_streamed_answer_holds_its_connection_until_the_stream_closes(
    autojump_clock: trio.testing.MockClock,
) -> None:
    provider = RateLimitedProvider(max_concurrent=3)
    budget = ModelBudget(providers={"openai": BudgetLimits(max_connections=3)})
    async with provider.client() as client:
        model = openai(client, budget)
        async with model.stream(REQUEST) as events:
            assert row(budget, "openai").in_flight == 1
            assert [e async for e in events]
        assert row(budget, "openai").in_flight == 0
        await run_all(model, 50, stream=True)
    assert provider.refused == 0
    assert provider.most_in_flight == 3


async def test_1_requests_per_minute_pace_200_requests_with_no_429(
    autojump_clock: trio.testing.MockClock,
) -> None:
    provider = RateLimitedProvider(requests_per_minute=50)
    budget = ModelBudget(providers={"openai": BudgetLimits(requests_per_minute=50)})
    async with provider.client() as client:
        start = trio.current_time()
        await run_all(openai(client, budget), 200)
    assert provider.refused == 0
    assert len(provider.served) == 200
    assert most_in_a_minute(provider.served) == 50
    # Four minutes' worth: the last 50 start at 180 s.
    assert trio.current_time() - start == pytest.approx(181.0)


async def test_1_without_a_budget_the_rate_limit_answers_many_429s(
    autojump_clock: trio.testing.MockClock,
) -> None:
    provider = RateLimitedProvider(requests_per_minute=50)
    async with provider.client() as client:
        await run_all(openai(client, None), 200)
    assert provider.refused >= 150


async def test_1_a_model_limit_holds_beside_its_provider_limit(
    autojump_clock: trio.testing.MockClock,
) -> None:
    provider = RateLimitedProvider()
    budget = ModelBudget(
        providers={"openai": BudgetLimits(max_connections=8)},
        models={"openai:small": BudgetLimits(max_connections=2)},
    )
    async with provider.client() as client:
        small, big = openai(client, budget, "small"), openai(client, budget, "big")
        async with trio.open_nursery() as nursery:
            nursery.start_soon(run_all, small, 10)
            await trio.testing.wait_all_tasks_blocked()
            nursery.start_soon(run_all, big, 10)
            await trio.testing.wait_all_tasks_blocked()
            loads = {r.model: r for r in budget.snapshot()}
            assert loads[None].in_flight == 8
            assert loads["small"].in_flight == 2
            assert loads["big"].in_flight == 6
            assert loads["small"].limit == 2
            assert loads[None].limit == 8


async def test_1_the_default_limits_serve_a_provider_not_named(
    autojump_clock: trio.testing.MockClock,
) -> None:
    provider = RateLimitedProvider(max_concurrent=4)
    budget = ModelBudget(default=BudgetLimits(max_connections=4))
    async with provider.client() as client:
        await run_all(openai(client, budget), 40)
    assert provider.refused == 0
    assert provider.most_in_flight == 4


# --- 2. tokens: reserved, then settled --------------------------------------------------


async def test_2_tokens_per_minute_reserve_the_estimate(
    autojump_clock: trio.testing.MockClock,
) -> None:
    budget = ModelBudget(providers={"p": BudgetLimits(tokens_per_minute=1000)})
    with await budget.acquire("p", "m", tokens=600):
        pass
    started = trio.current_time()
    with await budget.acquire("p", "m", tokens=600):  # 1,200 > 1,000: the next minute
        assert trio.current_time() - started == 60
    assert row(budget, "p").tokens_used == 600


async def test_2_settling_lower_frees_the_room_at_once(
    autojump_clock: trio.testing.MockClock,
) -> None:
    budget = ModelBudget(providers={"p": BudgetLimits(tokens_per_minute=1000)})
    admitted: list[float] = []

    async def second() -> None:
        with await budget.acquire("p", "m", tokens=600):
            admitted.append(trio.current_time())

    async with trio.open_nursery() as nursery:
        with await budget.acquire("p", "m", tokens=600) as grant:
            nursery.start_soon(second)
            await trio.sleep(5)
            assert not admitted
            assert row(budget, "p").waiting == 1
            grant.settle(100)
        await trio.testing.wait_all_tasks_blocked()
        assert admitted == [5.0]
    assert row(budget, "p").tokens_used == 700


async def test_2_settling_higher_holds_later_requests_back(
    autojump_clock: trio.testing.MockClock,
) -> None:
    budget = ModelBudget(providers={"p": BudgetLimits(tokens_per_minute=1000)})
    with await budget.acquire("p", "m", tokens=100) as grant:
        grant.settle(950)
    started = trio.current_time()
    with await budget.acquire("p", "m", tokens=100):
        assert trio.current_time() - started == 60


async def test_2_a_request_over_the_whole_minute_goes_alone(
    autojump_clock: trio.testing.MockClock,
) -> None:
    budget = ModelBudget(providers={"p": BudgetLimits(tokens_per_minute=1000)})
    with await budget.acquire("p", "m", tokens=5000):
        assert trio.current_time() == 0
    with await budget.acquire("p", "m", tokens=10):
        assert trio.current_time() == 60


async def test_2_the_adapter_reserves_max_tokens_and_settles_the_usage(
    autojump_clock: trio.testing.MockClock,
) -> None:
    provider = RateLimitedProvider()
    budget = ModelBudget(providers={"openai": BudgetLimits(tokens_per_minute=10_000)})
    async with provider.client() as client:
        model = openai(client, budget)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(model.complete, REQUEST)
            await trio.testing.wait_all_tasks_blocked()
            reserved = row(budget, "openai").tokens_used
            # max_tokens (100) and about a quarter of the body's bytes.
            assert 100 < reserved < 200
        assert row(budget, "openai").tokens_used == 25  # the usage the fake reported
        await collect(model, REQUEST)
        assert row(budget, "openai").tokens_used == 50


async def test_2_a_refused_request_counts_no_tokens(
    autojump_clock: trio.testing.MockClock,
) -> None:
    budget = ModelBudget()
    with await budget.acquire("p", "m", tokens=500) as grant:
        grant.refused(400, None)
    load = row(budget, "p")
    assert (load.requests_used, load.tokens_used) == (1, 0)


# --- 3. Retry-After is everyone's -------------------------------------------------------


async def test_3_a_429_with_retry_after_pauses_every_session_of_the_provider(
    autojump_clock: trio.testing.MockClock,
) -> None:
    refusals: list[float] = []

    async def handler(request: httpx.Request) -> httpx.Response:
        if not refusals:
            refusals.append(trio.current_time())
            return httpx.Response(
                429, json={"error": {"message": "slow down"}}, headers={"retry-after": "10"}
            )
        arrived.append(trio.current_time())
        choices = [{"index": 0, "message": {"content": "ok"}, "finish_reason": "stop"}]
        return httpx.Response(200, json={"choices": choices})

    arrived: list[float] = []
    budget = ModelBudget()
    async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
        first, other = openai(client, budget, "a"), openai(client, budget, "b")
        async with trio.open_nursery() as nursery:
            nursery.start_soon(first.complete, REQUEST)
            await trio.sleep(1)
            assert row(budget, "openai").paused_for == 9
            nursery.start_soon(other.complete, REQUEST)
            await trio.sleep(1)
            assert row(budget, "openai").waiting == 1
    assert refusals == [0.0]
    # The other model's request waited for the pause too; then both went.
    assert arrived == [10.0, 10.0]


async def test_3_the_pause_is_per_provider(autojump_clock: trio.testing.MockClock) -> None:
    budget = ModelBudget()
    with await budget.acquire("openai", "m") as grant:
        grant.refused(429, 30)
    with await budget.acquire("anthropic", "m"):
        assert trio.current_time() == 0
    with await budget.acquire("openai", "m"):
        assert trio.current_time() == 30


async def test_3_a_429_without_retry_after_backs_off_doubling(
    autojump_clock: trio.testing.MockClock,
) -> None:
    budget = ModelBudget(backoff=1.0)
    admitted = []
    for _ in range(3):
        with await budget.acquire("p", "m") as grant:
            admitted.append(trio.current_time())
            grant.refused(429, None)
    with await budget.acquire("p", "m") as grant:
        admitted.append(trio.current_time())
        grant.settle(10)  # a success ends the row
        grant.refused(529, None)
    with await budget.acquire("p", "m"):
        admitted.append(trio.current_time())
    assert admitted == [0, 1, 3, 7, 8]


async def test_3_other_errors_and_the_cap(autojump_clock: trio.testing.MockClock) -> None:
    budget = ModelBudget(max_pause=5)
    with await budget.acquire("p", "m") as grant:
        grant.refused(500, 30)  # a server error does not pause everyone
        grant.refused(400, None)
    assert row(budget, "p").paused_for == 0
    with await budget.acquire("p", "m") as grant:
        grant.refused(503, 3600)
    assert row(budget, "p").paused_for == 5


async def test_3_with_the_provider_limits_200_sessions_see_no_429_at_all(
    autojump_clock: trio.testing.MockClock,
) -> None:
    provider = RateLimitedProvider(requests_per_minute=60, max_concurrent=20)
    budget = ModelBudget(
        providers={"openai": BudgetLimits(max_connections=20, requests_per_minute=60)}
    )
    async with provider.client() as client:
        models = [openai(client, budget) for _ in range(200)]  # a model per session
        async with trio.open_nursery() as nursery:
            for model in models:
                nursery.start_soon(run_all, model, 1)
    assert provider.refused == 0
    assert len(provider.served) == 200


async def test_3_knowing_only_max_connections_one_429_pauses_the_stampede(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # The budget does not know the provider's 50 a minute: the first 429's
    # Retry-After (the next minute) holds everyone, so the 429s are the few
    # requests already in flight, not one per waiting session per retry.
    provider = RateLimitedProvider(requests_per_minute=50)
    budget = ModelBudget(providers={"openai": BudgetLimits(max_connections=5)})
    async with provider.client() as client:
        await run_all(openai(client, budget), 200)
    assert len(provider.served) == 200
    assert provider.refused <= 4 * 5  # at most the in-flight ones, once a minute


# --- 4. first come, first served ----------------------------------------------------


async def test_4_a_big_request_is_not_starved_by_small_ones(
    autojump_clock: trio.testing.MockClock,
) -> None:
    budget = ModelBudget(providers={"p": BudgetLimits(tokens_per_minute=1000)})
    order: list[str] = []

    async def ask(name: str, tokens: int) -> None:
        with await budget.acquire("p", "m", tokens=tokens):
            order.append(name)

    with await budget.acquire("p", "m", tokens=400):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(ask, "big", 800)
            await trio.testing.wait_all_tasks_blocked()
            nursery.start_soon(ask, "small", 100)  # would fit now, but comes after
            await trio.testing.wait_all_tasks_blocked()
            assert order == []
    assert order == ["big", "small"]


async def test_4_a_waiter_held_by_its_own_model_lets_other_models_pass(
    autojump_clock: trio.testing.MockClock,
) -> None:
    budget = ModelBudget(models={"p:slow": BudgetLimits(max_connections=1)})
    order: list[str] = []

    async def ask(model: str, name: str) -> None:
        with await budget.acquire("p", model):
            order.append(name)
            await trio.sleep(1)

    async with trio.open_nursery() as nursery:
        for model, name in [("slow", "s1"), ("slow", "s2"), ("fast", "f1"), ("slow", "s3")]:
            nursery.start_soon(ask, model, name)
            await trio.testing.wait_all_tasks_blocked()
    assert order == ["s1", "f1", "s2", "s3"]


# --- 5. cancellation leaves nothing behind ------------------------------------------------


async def test_5_a_cancelled_waiter_reserves_nothing(
    autojump_clock: trio.testing.MockClock,
) -> None:
    budget = ModelBudget(providers={"p": BudgetLimits(max_connections=1, tokens_per_minute=1000)})
    with await budget.acquire("p", "m", tokens=10):
        with trio.move_on_after(5) as scope:
            await budget.acquire("p", "m", tokens=500)
        assert scope.cancelled_caught
        load = row(budget, "p")
        assert (load.in_flight, load.waiting, load.requests_used, load.tokens_used) == (1, 0, 1, 10)
    with await budget.acquire("p", "m", tokens=990):  # the cancelled 500 is not counted
        assert trio.current_time() == 5


async def test_5_cancelled_as_the_grant_arrives_gives_it_back(
    autojump_clock: trio.testing.MockClock,
) -> None:
    budget = ModelBudget(providers={"p": BudgetLimits(requests_per_minute=1)})
    with trio.CancelScope() as scope:
        scope.cancel()
        await budget.acquire("p", "m")  # admitted at once, then its checkpoint is cancelled
    assert scope.cancelled_caught
    load = row(budget, "p")
    assert (load.in_flight, load.requests_used) == (0, 0)
    with await budget.acquire("p", "m"):
        assert trio.current_time() == 0


async def test_5_cancelling_the_first_waiter_hands_its_timer_on(
    autojump_clock: trio.testing.MockClock,
) -> None:
    budget = ModelBudget(providers={"p": BudgetLimits(requests_per_minute=1)})
    admitted: list[float] = []

    async def ask() -> None:
        with await budget.acquire("p", "m"):
            admitted.append(trio.current_time())

    with await budget.acquire("p", "m"):
        pass
    first = trio.CancelScope()
    with trio.fail_after(3600):  # without the hand-off, the second waiter sleeps forever
        async with trio.open_nursery() as nursery:
            nursery.start_soon(ask_in, first, ask)
            await trio.testing.wait_all_tasks_blocked()
            nursery.start_soon(ask)
            await trio.testing.wait_all_tasks_blocked()
            await trio.sleep(5)
            first.cancel()  # the first waiter, the one whose clock ran
    assert admitted == [60.0]


async def ask_in(scope: trio.CancelScope, ask: Any) -> None:
    with scope:
        await ask()


async def test_5_a_cancelled_request_mid_wait_through_the_adapter(
    autojump_clock: trio.testing.MockClock,
) -> None:
    provider = RateLimitedProvider(latency=100)
    budget = ModelBudget(providers={"openai": BudgetLimits(max_connections=2)})
    async with provider.client() as client:
        model = openai(client, budget)
        with trio.move_on_after(10):
            await run_all(model, 20)
    load = row(budget, "openai")
    assert (load.in_flight, load.waiting) == (0, 0)


# --- snapshot and configuration ---------------------------------------------------------


async def test_snapshot_rows(autojump_clock: trio.testing.MockClock) -> None:
    budget = ModelBudget(
        providers={"openai": BudgetLimits(max_connections=1, requests_per_minute=10)},
        models={"openai:a": BudgetLimits(tokens_per_minute=5000)},
    )
    assert budget.snapshot() == []
    grants: list[Grant] = []

    async def hold(model: str) -> None:
        grants.append(await budget.acquire("openai", model, tokens=300))
        await trio.sleep_forever()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(hold, "a")
        await trio.testing.wait_all_tasks_blocked()
        nursery.start_soon(hold, "b")
        await trio.testing.wait_all_tasks_blocked()
        assert budget.snapshot() == [
            ProviderLoad("openai", None, 1, 1, 1, 1, 10, 300, None),
            ProviderLoad("openai", "a", 1, 0, None, 1, None, 300, 5000),
            ProviderLoad("openai", "b", 0, 1, None, 0, None, 0, None),
        ]
        nursery.cancel_scope.cancel()
    for grant in grants:
        grant.release()
        grant.release()  # a second release does nothing
    assert row(budget, "openai").in_flight == 0
    await trio.sleep(60)
    assert row(budget, "openai").requests_used == 0


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (
            lambda: BudgetLimits(max_connections=0),
            "BudgetLimits.max_connections must be a positive integer or None, got 0",
        ),
        (lambda: BudgetLimits(requests_per_minute=True), "got True"),
        (
            lambda: BudgetLimits(tokens_per_minute=1.5),  # type: ignore[arg-type]
            "BudgetLimits.tokens_per_minute",
        ),
        (
            lambda: ModelBudget(providers={"openai:x": BudgetLimits()}),
            "ModelBudget.providers['openai:x']: expected a provider",
        ),
        (
            lambda: ModelBudget(models={"openai": BudgetLimits()}),
            "ModelBudget.models['openai']: expected provider:model",
        ),
        (lambda: ModelBudget(max_pause=-1), "ModelBudget.max_pause: expected seconds >= 0"),
        (
            lambda: ModelBudget.from_table({"openai": {"max_conections": 3}}),
            "[budget].openai: unknown setting 'max_conections'",
        ),
        (
            lambda: ModelBudget.from_table({"openai": {"max_connections": "3"}}),
            "[budget].openai.max_connections: expected an integer >= 1",
        ),
        (lambda: ModelBudget.from_table({"openai:": {}}), "expected provider:model"),
        (
            lambda: ModelBudget.from_table({"openai": 3}),
            "[budget].openai: expected a table of limits",
        ),
        (
            lambda: ModelBudget.from_table({"backoff": "1s"}),
            "[budget].backoff: expected seconds >= 0",
        ),
    ],
)
def test_bad_limits_are_refused_in_one_line(make: Any, message: str) -> None:
    with pytest.raises(UsageError) as caught:
        make()
    assert message in str(caught.value)
    assert "\n" not in str(caught.value)


def test_from_table_reads_tak_toml_shape() -> None:
    budget = ModelBudget.from_table(
        {
            "max_pause": 30,
            "default": {"max_connections": 10},
            "openai": {"max_connections": 50, "requests_per_minute": 500},
            "openai:gpt-4.1-mini": {"tokens_per_minute": 200_000},
        }
    )
    assert budget.max_pause == 30
    assert budget.default == BudgetLimits(max_connections=10)
    assert budget.providers == {"openai": BudgetLimits(max_connections=50, requests_per_minute=500)}
    assert budget.models == {"openai:gpt-4.1-mini": BudgetLimits(tokens_per_minute=200_000)}


def test_resolve_model_gives_every_http_model_the_budget() -> None:
    budget = ModelBudget()
    env = {"OPENAI_API_KEY": "k", "ANTHROPIC_API_KEY": "k", "GEMINI_API_KEY": "k"}
    client = httpx.AsyncClient()
    model = resolve_model(
        "openai:a", client=client, fallbacks=["anthropic:b", "gemini:c"], env=env, budget=budget
    )
    assert isinstance(model, FallbackModel)
    assert [getattr(m, "budget", None) for m in model.models] == [budget, budget, budget]
    alone = resolve_model("openai:a", client=client, env=env)
    assert isinstance(alone, OpenAIModel)
    assert alone.budget is None


async def test_time_queued_for_the_budget_does_not_use_up_the_retries(
    autojump_clock: trio.testing.MockClock,
) -> None:
    answers = iter([200, 429, 200])

    async def handler(request: httpx.Request) -> httpx.Response:
        status = next(answers)
        if status == 429:
            return httpx.Response(
                429, json={"error": {"message": "busy"}}, headers={"retry-after": "5"}
            )
        await trio.sleep(100)
        choices = [{"index": 0, "message": {"content": "ok"}, "finish_reason": "stop"}]
        return httpx.Response(200, json={"choices": choices})

    budget = ModelBudget(providers={"openai": BudgetLimits(max_connections=1)})
    async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
        model = OpenAIModel(
            "m", client=client, api_key="k", retry=RetryPolicy(max_total=60), budget=budget
        )
        async with trio.open_nursery() as nursery:
            nursery.start_soon(model.complete, REQUEST)
            await trio.testing.wait_all_tasks_blocked()
            # Queued 100 s behind the first, refused once, then served: max_total is not spent.
            response = await model.complete(REQUEST)
    assert response.message.text == "ok"
    assert trio.current_time() == 205


async def test_4_the_clock_wakes_a_waiter_behind_one_held_by_its_model(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # The first waiter waits for its model's connection (no time will free it);
    # the second, of another model, for the provider's next minute.
    budget = ModelBudget(
        providers={"p": BudgetLimits(requests_per_minute=2)},
        models={"p:slow": BudgetLimits(max_connections=1, requests_per_minute=1)},
    )
    admitted: list[tuple[str, float]] = []

    async def ask(model: str) -> None:
        with await budget.acquire("p", model):
            admitted.append((model, trio.current_time()))
            await trio.sleep(1000)

    with trio.fail_after(3600):
        async with trio.open_nursery() as nursery:
            for model in ["slow", "fast", "slow", "fast"]:
                nursery.start_soon(ask, model)
                await trio.testing.wait_all_tasks_blocked()
    assert admitted == [("slow", 0), ("fast", 0), ("fast", 60), ("slow", 1000)]
