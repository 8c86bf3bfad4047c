"""The shared model budget (kernel/models/_budget.py): a test whose name starts with a
number checks that guarantee; the others, beside them, attack it (``test_bug_``: a bug
found and fixed, ``test_held_``: an attack it held against).

Most run real adapters against ``RateLimitedProvider``, a fake OpenAI server at
the HTTP wire that enforces its own limits (requests per fixed minute,
concurrent requests) and answers 429 with ``Retry-After`` past them, on the
mock clock.
"""

from __future__ import annotations

import collections
import functools
import gc
import json
import math
import pathlib
import random
from typing import Any

import httpx
import pytest
import trio
import trio.testing

from kernel.errors import UsageError
from kernel.messages import Attachment, Message, Observation, ToolCall
from kernel.models import (
    AnthropicModel,
    BudgetLimits,
    FallbackModel,
    Grant,
    ModelBudget,
    ModelRequest,
    OpenAIModel,
    ProviderError,
    ProviderLoad,
    RetryPolicy,
    resolve_model,
)
from kernel.session import Session
from kernel.store import MemoryStore, SessionKey

from .test_anthropic import MESSAGE_START, TWO_TOOL_USES, event, first_request
from .wire import FakeServer, collect, final, json_response, sse, sse_response, user

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


def screenshot_request(size: int = 1024 * 1024) -> ModelRequest:
    """A request whose history holds one tool result with a ``size``-byte PNG."""
    call = ToolCall(id="c1", name="browser.screenshot", arguments="{}", index=0)
    # A PNG's signature first: adapters send only media whose bytes are what they say.
    noise = random.Random(1).randbytes(size)
    png = Attachment.of_bytes("image", "image/png", b"\x89PNG\r\n\x1a\n" + noise)
    observation = Observation("c1", "browser.screenshot", 0, "the page", attachments=(png,))
    return ModelRequest(
        (user("look at the page"), Message("assistant", (call,)), Message("tool", (observation,))),
        max_tokens=100,
    )


async def test_bug_a_screenshot_in_one_history_stalls_every_session_of_the_provider(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # A provider bills an image ~1-2k tokens. Every later request of a session
    # that took a screenshot carries it, so each waits for a minute with no
    # tokens used at all, and every other session queues behind it.
    provider = RateLimitedProvider(latency=1.0)
    budget = ModelBudget(providers={"openai": BudgetLimits(tokens_per_minute=100_000)})
    async with provider.client() as client:
        model = openai(client, budget)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(model.complete, REQUEST)  # served at 0, settled (25) at 1
            await trio.sleep(2)
            nursery.start_soon(model.complete, screenshot_request())
            await trio.sleep(1)
            nursery.start_soon(model.complete, REQUEST)
    # 25 + ~2k + 25 tokens in three seconds, against 100,000 a minute.
    assert provider.served == [0.0, 2.0, 3.0]


async def test_fixed_a_request_over_the_minute_holds_nobody_and_waits_a_minute_at_most(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # Before: it waited, first in line, for an empty window, and every request
    # behind it with it; small ones arriving meanwhile kept the window from emptying.
    budget = ModelBudget(providers={"p": BudgetLimits(tokens_per_minute=1000)})
    admitted: list[tuple[str, float]] = []

    async def ask(name: str, tokens: int) -> None:
        with await budget.acquire("p", "m", tokens=tokens):
            admitted.append((name, trio.current_time()))

    with trio.fail_after(3600):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(ask, "small", 100)
            await trio.sleep(1)
            nursery.start_soon(ask, "big", 5000)
            for _ in range(2):
                await trio.sleep(1)
                nursery.start_soon(ask, "small", 100)
    assert admitted == [("small", 0.0), ("small", 2.0), ("small", 3.0), ("big", 61.0)]


async def test_held_requests_each_over_the_tokens_per_minute_go_one_a_minute(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # tokens_per_minute below every request's estimate: no deadlock, no
    # starvation; each goes alone into an empty window.
    budget = ModelBudget(providers={"p": BudgetLimits(tokens_per_minute=10)})
    admitted: list[float] = []

    async def ask() -> None:
        with await budget.acquire("p", "m", tokens=1000):
            admitted.append(trio.current_time())

    with trio.fail_after(3600):
        async with trio.open_nursery() as nursery:
            for _ in range(5):
                nursery.start_soon(ask)
    assert admitted == [0, 60, 120, 180, 240]


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


OK = {"choices": [{"index": 0, "message": {"content": "ok"}, "finish_reason": "stop"}]}


def refusal(status: int = 429, **headers: str) -> httpx.Response:
    return json_response(status, {"error": {"message": "slow down"}}, headers=headers)


async def test_bug_a_long_run_of_429s_without_retry_after_overflows_the_backoff(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # An overloaded provider refusing for hours: 1,100 refusals in a row, each
    # of a request sent after the last pause (concurrent refusals count once,
    # see the next test), raised OverflowError out of _send in place of the
    # ProviderError the turn would have handled.
    budget = ModelBudget(backoff=1.0, max_pause=60)
    for _ in range(1100):
        with await budget.acquire("anthropic", "m") as grant:
            grant.refused(529, None)
    assert row(budget, "anthropic").paused_for == 60


async def test_bug_concurrent_refusals_compound_the_backoff(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # "Doubled for each such refusal in a row": ten requests already in
    # flight when the provider starts refusing are one refusal of the
    # provider, not ten rounds of backing off. With max_pause=600 (to honour
    # long Retry-Afters) one burst stalls every session 512 s.
    budget = ModelBudget(backoff=1.0, max_pause=600)
    grants = [await budget.acquire("anthropic", "m") for _ in range(10)]
    for grant in grants:
        grant.refused(529, None)
        grant.release()
    assert row(budget, "anthropic").paused_for < 10


async def test_bug_a_retry_after_of_nan_crashes_the_request(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # float("nan") parses; so do "inf" and "1e999" (those are capped, nan is not).
    server = FakeServer(refusal(429, **{"retry-after": "nan"}), json_response(200, OK))
    budget = ModelBudget()
    async with server.client() as client:
        model = OpenAIModel("m", client=client, api_key="k", budget=budget)
        response = await model.complete(REQUEST)
    assert response.message.text == "ok"


async def test_bug_a_429_with_a_nan_retry_after_pauses_nobody(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # Gemini's RetryInfo "nans" and an HTTP "Retry-After: nan" both reach
    # Grant.refused as nan; min(nan, max_pause) is nan and max(-inf, nan) is
    # -inf: no pause, and no backoff either (retry_after is not None).
    budget = ModelBudget(backoff=1.0)
    with await budget.acquire("p", "m") as grant:
        grant.refused(429, math.nan)
    assert row(budget, "p").paused_for > 0


async def test_bug_an_overloaded_error_event_in_a_stream_pauses_nobody(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # Anthropic sends "overloaded" as an SSE error event once the 200 is out:
    # the adapter retries it (a 529 by another name), but the budget is told
    # nothing, so every other session keeps sending into the overload.
    overloaded = event(
        {"type": "error", "error": {"type": "overloaded_error", "message": "Overloaded"}}
    )
    server = FakeServer(sse_response(MESSAGE_START + overloaded), sse_response(TWO_TOOL_USES))
    budget = ModelBudget(backoff=1.0)
    async with server.client() as client:
        model = AnthropicModel(
            "claude-sonnet-4-5",
            client=client,
            api_key="k",
            retry=RetryPolicy(jitter=0),
            budget=budget,
        )
        async with trio.open_nursery() as nursery:
            nursery.start_soon(collect, model, first_request())
            await trio.sleep(0.25)  # the retry waits 0.5 s
            paused = row(budget, "anthropic").paused_for
    assert len(server.requests) == 2
    assert paused > 0


def test_fixed_the_retry_delay_neither_overflows_nor_takes_nan() -> None:
    policy = RetryPolicy(max_attempts=10_000, base_delay=0.5, max_delay=20, jitter=0)
    assert policy.delay(5000) == 20  # 2.0 ** 4999 raised OverflowError
    assert policy.delay(3, math.nan) == 2.0  # a nan Retry-After: as if none was sent


@pytest.mark.parametrize(
    ("header", "paused"),
    [
        # A date in the past (come back now) or a negative number on a 429: a
        # refusal that names no wait backs off (the budget's minimum), else
        # every session would come back at once, into the same 429.
        ("Wed, 21 Oct 2015 07:28:00 GMT", 1.0),
        ("Fri, 31 Dec 9999 23:59:59 GMT", 60.0),  # a date centuries away: max_pause
        ("99999999999", 60.0),
        ("1e999", 60.0),
        ("-30", 1.0),
        ("nan", 1.0),
        ("soon", 1.0),  # garbage: as if it did not say (backoff)
    ],
)
async def test_held_retry_after_values_are_bounded(
    autojump_clock: trio.testing.MockClock, header: str, paused: float
) -> None:
    server = FakeServer(refusal(429, **{"retry-after": header}))
    budget = ModelBudget(backoff=1.0, max_pause=60)
    async with server.client() as client:
        model = OpenAIModel(
            "m", client=client, api_key="k", retry=RetryPolicy(max_attempts=1), budget=budget
        )
        with pytest.raises(ProviderError):
            await model.complete(REQUEST)
    assert row(budget, "openai").paused_for == paused


async def test_held_a_provider_that_429s_forever_stalls_nobody_past_max_pause(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # Every answer is a 429 asking for a day. 40 sessions each give up after
    # their retries; the budget never pauses longer than max_pause at a time.
    pauses: list[float] = []

    def handler(request: httpx.Request) -> httpx.Response:
        return refusal(429, **{"retry-after": "86400"})

    budget = ModelBudget(providers={"openai": BudgetLimits(max_connections=5)}, max_pause=30)
    failures: list[ProviderError] = []

    async def one(model: OpenAIModel) -> None:
        try:
            await model.complete(REQUEST)
        except ProviderError as exc:
            failures.append(exc)

    async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
        model = OpenAIModel(
            "m",
            client=client,
            api_key="k",
            retry=RetryPolicy(max_attempts=4, max_delay=20, max_total=3600),
            budget=budget,
        )
        with trio.fail_after(24 * 3600):
            async with trio.open_nursery() as nursery:
                for _ in range(40):
                    nursery.start_soon(one, model)
                await trio.testing.wait_all_tasks_blocked()
                while len(failures) < 40:
                    pauses.append(row(budget, "openai").paused_for)
                    await trio.sleep(1)
    assert len(failures) == 40
    assert all(f.status == 429 and f.attempts == 4 for f in failures)
    assert max(pauses) <= 30
    # 40 sessions, 4 attempts, 5 at a time, 30 s pauses: minutes, not a day.
    assert trio.current_time() < 3600
    load = row(budget, "openai")
    assert (load.in_flight, load.waiting) == (0, 0)


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


async def test_held_a_model_over_its_own_tokens_per_minute_does_not_starve_under_other_models(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # The big request waits only for its own model's window to empty; the
    # small requests of another model flow past it meanwhile, and once its
    # window is empty the provider's is not in its way.
    budget = ModelBudget(
        providers={"p": BudgetLimits(tokens_per_minute=100_000)},
        models={"p:big": BudgetLimits(tokens_per_minute=100)},
    )
    order: list[tuple[str, float]] = []

    async def ask(model: str, tokens: int) -> None:
        with await budget.acquire("p", model, tokens=tokens):
            order.append((model, trio.current_time()))

    with trio.fail_after(3600):
        with await budget.acquire("p", "big", tokens=50):
            pass
        async with trio.open_nursery() as nursery:
            nursery.start_soon(ask, "big", 500)
            await trio.testing.wait_all_tasks_blocked()
            for _ in range(30):
                nursery.start_soon(ask, "small", 10)
                await trio.sleep(3)
    assert ("big", 60.0) in order
    assert [t for m, t in order if m == "small"] == [3.0 * i for i in range(30)]


async def test_held_within_a_model_order_is_kept_while_others_pass(
    autojump_clock: trio.testing.MockClock,
) -> None:
    budget = ModelBudget(models={"p:slow": BudgetLimits(max_connections=1)})
    order: list[str] = []

    async def ask(model: str, name: str) -> None:
        with await budget.acquire("p", model):
            order.append(name)
            await trio.sleep(1)

    names = [("slow", f"s{i}") if i % 2 == 0 else ("fast", f"f{i}") for i in range(20)]
    async with trio.open_nursery() as nursery:
        for model, name in names:
            nursery.start_soon(ask, model, name)
            await trio.testing.wait_all_tasks_blocked()
    slow = [n for n in order if n.startswith("s")]
    assert slow == [f"s{i}" for i in range(0, 20, 2)]
    # Every fast one went at once, past the nine slow ones queued.
    assert order[:11] == ["s0"] + [f"f{i}" for i in range(1, 20, 2)]


class CountWakeups(trio.abc.Instrument):
    def __init__(self) -> None:
        self.scheduled = 0

    def task_scheduled(self, task: trio.lowlevel.Task) -> None:
        self.scheduled += 1


async def test_held_a_thousand_waiters_are_woken_a_bounded_number_of_times(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # Each release wakes the one waiter it admits; only the first waiter has
    # a timer. Wakeups grow with the waiters, not with their square.
    counts = {}
    for waiters in (250, 1000):
        budget = ModelBudget(
            providers={"p": BudgetLimits(max_connections=10, requests_per_minute=600)}
        )
        done = 0

        async def ask(budget: ModelBudget = budget) -> None:
            nonlocal done
            with await budget.acquire("p", "m"):
                await trio.sleep(0.5)
            done += 1

        counter = CountWakeups()
        trio.lowlevel.add_instrument(counter)
        try:
            async with trio.open_nursery() as nursery:
                for _ in range(waiters):
                    nursery.start_soon(ask)
        finally:
            trio.lowlevel.remove_instrument(counter)
        assert done == waiters
        counts[waiters] = counter.scheduled
    assert counts[1000] < 4.5 * counts[250]
    assert counts[1000] < 10 * 1000


async def test_held_the_requests_per_minute_window_is_sliding_under_a_burst(
    autojump_clock: trio.testing.MockClock,
) -> None:
    budget = ModelBudget(providers={"p": BudgetLimits(requests_per_minute=10)})
    started: list[float] = []

    async def ask() -> None:
        with await budget.acquire("p", "m"):
            started.append(trio.current_time())

    async with trio.open_nursery() as nursery:
        for _ in range(35):
            nursery.start_soon(ask)
            await trio.sleep(1)
    for i, t in enumerate(started):
        assert sum(1 for u in started[i:] if u < t + 60) <= 10
    assert collections.Counter(started)[60.0] == 1  # the 11th, as the first leaves


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


async def test_held_cancelled_just_before_its_grant_arrives_gives_it_back(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # The waiter's cancel lands first, then (same tick, before it runs) a
    # release admits it: _pump still sees it queued and grants it; the
    # waiter must revoke, and the connection goes on to the next in line.
    budget = ModelBudget(providers={"p": BudgetLimits(max_connections=1, requests_per_minute=10)})
    got: list[str] = []

    async def ask(name: str, scope: trio.CancelScope) -> None:
        with scope:
            with await budget.acquire("p", "m", tokens=100):
                got.append(name)
                await trio.sleep(1)

    holder = await budget.acquire("p", "m", tokens=7)
    doomed, patient = trio.CancelScope(), trio.CancelScope()
    with trio.fail_after(60):  # a grant kept by the cancelled waiter would block the other
        async with trio.open_nursery() as nursery:
            nursery.start_soon(ask, "doomed", doomed)
            await trio.testing.wait_all_tasks_blocked()
            nursery.start_soon(ask, "patient", patient)
            await trio.testing.wait_all_tasks_blocked()
            doomed.cancel()  # its wait is aborted first ...
            holder.release()  # ... then, before it runs, the release admits it
    assert got == ["patient"]
    load = row(budget, "p")
    assert (load.in_flight, load.waiting, load.requests_used, load.tokens_used) == (0, 0, 2, 107)


async def test_held_cancelling_at_every_await_of_a_streamed_request_leaks_nothing(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # The stream is cancelled after 0, 0.1, ... seconds: while queued, while
    # sending, mid-body, while draining. No grant may outlive it.
    budget = ModelBudget(providers={"openai": BudgetLimits(max_connections=2)})
    provider = RateLimitedProvider(latency=1.0)
    async with provider.client() as client:
        model = openai(client, budget)
        async with trio.open_nursery() as nursery:  # a neighbour keeps the queue busy
            nursery.start_soon(functools.partial(run_all, model, 30, stream=True))
            for tenth in range(40):
                with trio.move_on_after(tenth / 10):
                    await collect(model, REQUEST)
        load = row(budget, "openai")
        assert (load.in_flight, load.waiting) == (0, 0)


async def test_held_cancelling_at_every_await_of_complete_leaks_nothing(
    autojump_clock: trio.testing.MockClock,
) -> None:
    budget = ModelBudget(providers={"openai": BudgetLimits(max_connections=2)})
    provider = RateLimitedProvider(latency=1.0, max_concurrent=2)
    async with provider.client() as client:
        model = openai(client, budget)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(run_all, model, 30)
            for tenth in range(40):
                with trio.move_on_after(tenth / 10):
                    await model.complete(REQUEST)
        load = row(budget, "openai")
        assert (load.in_flight, load.waiting) == (0, 0)
    assert provider.refused == 0


async def test_held_cancelled_just_after_its_grant_arrives_it_is_released(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # The other order: the release wakes the waiter first, then its scope is
    # cancelled. acquire() has succeeded (as trio.Lock would); the caller's
    # with-block gives the connection back at its next checkpoint. The
    # request stays counted for the minute: the budget errs on the safe side.
    budget = ModelBudget(providers={"p": BudgetLimits(max_connections=1)})
    holder = await budget.acquire("p", "m")
    scope = trio.CancelScope()
    sent: list[str] = []

    async def ask() -> None:
        with scope:
            with await budget.acquire("p", "m"):
                await trio.lowlevel.checkpoint()
                sent.append("sent")

    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(ask)
            await trio.testing.wait_all_tasks_blocked()
            holder.release()
            scope.cancel()
        with await budget.acquire("p", "m"):
            pass
    assert sent == []
    assert row(budget, "p").in_flight == 0


async def test_held_two_budgets_share_nothing(autojump_clock: trio.testing.MockClock) -> None:
    # No module-level state: each budget's limits and pauses are its own.
    one = ModelBudget(providers={"p": BudgetLimits(max_connections=1)})
    two = ModelBudget(providers={"p": BudgetLimits(max_connections=1)})
    with await one.acquire("p", "m") as grant:
        grant.refused(429, 30)
        with await two.acquire("p", "m"):
            assert trio.current_time() == 0
    assert row(two, "p").paused_for == 0


async def test_held_a_stream_closed_early_releases_its_grant(
    autojump_clock: trio.testing.MockClock,
) -> None:
    budget = ModelBudget(providers={"openai": BudgetLimits(max_connections=1)})
    async with RateLimitedProvider().client() as client:
        model = openai(client, budget)
        for _ in range(3):  # with a leak, the second would wait forever
            with trio.fail_after(60):
                async with model.stream(REQUEST) as events:
                    async for _event in events:
                        break
        assert row(budget, "openai").in_flight == 0


async def test_held_a_stream_abandoned_without_aclose_is_released_once_collected(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # The careless caller: enters the stream by hand and drops it. Trio's
    # async-generator finalizer closes the context manager's generator, whose
    # finally releases the grant.
    budget = ModelBudget(providers={"openai": BudgetLimits(max_connections=1)})
    async with RateLimitedProvider().client() as client:
        model = openai(client, budget)
        manager = model.stream(REQUEST)
        events = await manager.__aenter__()
        await anext(events)
        assert row(budget, "openai").in_flight == 1
        del manager, events
        gc.collect()
        with trio.fail_after(60):
            await collect(model, REQUEST)
        assert row(budget, "openai").in_flight == 0


async def test_held_an_exception_raised_in_the_stream_block_releases_the_grant(
    autojump_clock: trio.testing.MockClock,
) -> None:
    budget = ModelBudget(providers={"openai": BudgetLimits(max_connections=1)})
    async with RateLimitedProvider().client() as client:
        model = openai(client, budget)
        with pytest.raises(KeyError):
            async with model.stream(REQUEST) as events:
                await anext(events)
                raise KeyError("the caller's own bug")
        assert row(budget, "openai").in_flight == 0


@pytest.mark.parametrize(
    "answer",
    [
        pytest.param(lambda: json_response(200, ["not", "a", "response"]), id="bad-shape"),
        pytest.param(lambda: httpx.Response(200, text="{not json"), id="not-json"),
        pytest.param(lambda: httpx.ConnectError("refused"), id="connection-error"),
        pytest.param(lambda: json_response(400, {"error": {"message": "no"}}), id="400"),
    ],
)
async def test_held_no_error_path_of_complete_leaks_a_grant(
    autojump_clock: trio.testing.MockClock, answer: Any
) -> None:
    server = FakeServer(answer(), json_response(200, OK))
    budget = ModelBudget(providers={"openai": BudgetLimits(max_connections=1)})
    async with server.client() as client:
        model = OpenAIModel(
            "m", client=client, api_key="k", retry=RetryPolicy(max_attempts=1), budget=budget
        )
        with pytest.raises(ProviderError):
            await model.complete(REQUEST)
        with trio.fail_after(60):
            assert (await model.complete(REQUEST)).message.text == "ok"
    assert row(budget, "openai").in_flight == 0


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


def _clock() -> trio.testing.MockClock:
    return trio.testing.MockClock(autojump_threshold=0)


def test_bug_a_budget_used_by_a_second_trio_run_stalls() -> None:
    # A module-level budget in a test suite (one trio.run per test) or a
    # program that runs twice. trio's real clock starts at a random offset
    # (10,000 to 200,000 s) each run: the first run's window entries can lie
    # days in the second run's future. Mock clocks make it deterministic.
    budget = ModelBudget(providers={"p": BudgetLimits(requests_per_minute=1)})

    async def first() -> None:
        autojump = trio.lowlevel.current_clock()
        assert isinstance(autojump, trio.testing.MockClock)
        autojump.jump(100_000)
        with await budget.acquire("p", "m"):
            pass

    waited: list[float] = []

    async def second() -> None:
        with trio.move_on_after(3600):
            with await budget.acquire("p", "m"):
                waited.append(trio.current_time())

    trio.run(first, clock=_clock())
    try:
        trio.run(second, clock=_clock())
    except UsageError:
        return  # refusing a second run, in one line, is a fix too
    assert waited == [0.0]


def test_bug_from_table_with_a_non_string_key_is_a_type_error() -> None:
    # ModelBudget(providers=...) checks its keys' type; from_table does not.
    with pytest.raises(UsageError, match=r"\[budget\]"):
        ModelBudget.from_table({1: {"max_connections": 3}})  # type: ignore[dict-item]


def test_bug_from_table_with_mixed_setting_names_is_a_type_error() -> None:
    with pytest.raises(UsageError, match=r"\[budget\]\.openai: unknown setting"):
        ModelBudget.from_table({"openai": {1: 2, "max_conections": 3}})


def test_bug_from_table_accepts_a_provider_that_does_not_exist() -> None:
    # Inside a table an unknown setting is refused ("unknown setting
    # 'max_conections'"); an unknown provider name, the likelier typo, is not.
    with pytest.raises(UsageError, match="opnai"):
        ModelBudget.from_table({"opnai": {"max_connections": 50}})


async def test_bug_gemini_model_does_not_take_budget() -> None:
    from kernel.models import GeminiModel

    budget = ModelBudget()
    async with httpx.AsyncClient() as client:
        model = GeminiModel(
            "gemini-2.5-flash",
            client=client,
            api_key="k",
            budget=budget,  # type: ignore[call-arg]
        )
    assert model.budget is budget


async def test_bug_the_documented_budget_table_of_tak_toml_is_refused(
    tmp_path: pathlib.Path,
) -> None:
    from kernel.kernel import open_kernel

    (tmp_path / "home" / "config").mkdir(parents=True)
    (tmp_path / "work").mkdir()
    (tmp_path / "home" / "config" / "tak.toml").write_text(
        '[budget.openai]\nmax_connections = 5\n[budget."openai:gpt-4.1-mini"]\n'
        "tokens_per_minute = 200000\n"
    )
    async with open_kernel(home=tmp_path / "home", workspace=tmp_path / "work") as kernel:
        budget = kernel.budget
    assert budget is not None
    assert budget.providers == {"openai": BudgetLimits(max_connections=5)}


def test_fixed_snapshot_outside_a_trio_run_says_so() -> None:
    with pytest.raises(UsageError, match=r"snapshot\(\) needs a running Trio run"):
        ModelBudget().snapshot()


def session(store: MemoryStore, name: str) -> Session:
    return Session(store, SessionKey("p", name))


async def test_held_the_snapshot_adds_up_under_random_load(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # Grants settled, refused, revoked (cancelled) and released at random;
    # at every step the model rows add up to the provider row and nothing is
    # negative.
    rng = random.Random(7)
    budget = ModelBudget(
        providers={"p": BudgetLimits(max_connections=6, requests_per_minute=40)},
        models={
            "p:a": BudgetLimits(tokens_per_minute=3000),
            "p:b": BudgetLimits(max_connections=2),
        },
        backoff=0.5,
        max_pause=3,
    )

    async def session() -> None:
        for _ in range(8):
            model = rng.choice("abc")
            with trio.move_on_after(rng.choice([0.5, 5, 600])):
                with await budget.acquire("p", model, tokens=rng.randrange(0, 900)) as grant:
                    await trio.sleep(rng.random() * 3)
                    outcome = rng.random()
                    if outcome < 0.5:
                        grant.settle(rng.randrange(0, 1500))
                    elif outcome < 0.6:
                        grant.refused(rng.choice([429, 503, 529, 500]), rng.choice([None, 2.0]))

    def check() -> None:
        rows = budget.snapshot()
        if not rows:
            return
        provider, models = rows[0], rows[1:]
        assert provider.model is None
        for field in ("in_flight", "waiting", "requests_used", "tokens_used"):
            total = sum(getattr(r, field) for r in models)
            assert getattr(provider, field) == total, field
            assert all(getattr(r, field) >= 0 for r in rows), field
        assert provider.in_flight <= 6
        assert all(r.in_flight <= 2 for r in models if r.model == "b")

    with trio.fail_after(3600):
        async with trio.open_nursery() as nursery:
            for _ in range(40):
                nursery.start_soon(session)
            while nursery.child_tasks:
                check()
                await trio.sleep(0.25)
    check()
    assert (row(budget, "p").in_flight, row(budget, "p").waiting) == (0, 0)


@pytest.mark.parametrize(
    ("table", "message"),
    [
        ({"openai": {"max_connections": True}}, "[budget].openai.max_connections"),
        ({"openai": {"requests_per_minute": {"per": 1}}}, "[budget].openai.requests_per_minute"),
        ({"openai": {"max_connections": [3]}}, "[budget].openai.max_connections"),
        ({"openai": {"max_connections": -1}}, "[budget].openai.max_connections"),
        ({"openai": {"max_connections": 2.0}}, "got 2.0"),
        ({"openai": {"limits": {"max_connections": 3}}}, "unknown setting 'limits'"),
        ({"openai": None}, "[budget].openai: expected a table of limits"),
        ({"openai": [1, 2]}, "[budget].openai: expected a table of limits"),
        ({"max_pause": True}, "[budget].max_pause: expected seconds >= 0"),
        ({"max_pause": float("nan")}, "[budget].max_pause"),
        ({"backoff": float("inf")}, "[budget].backoff"),
        ({":gpt": {}}, "expected provider:model"),
        ({"default": 5}, "[budget].default: expected a table of limits"),
        ("openai", "[budget]: expected a table"),
        ([("openai", {})], "[budget]: expected a table"),
    ],
)
def test_held_from_table_refuses_hostile_input_in_one_line(table: Any, message: str) -> None:
    with pytest.raises(UsageError) as caught:
        ModelBudget.from_table(table)
    assert message in str(caught.value)
    assert "\n" not in str(caught.value)


def test_held_budget_limits_refuse_a_bool_and_a_string() -> None:
    for value in (True, False, "3", 3.0, 0, -5):
        with pytest.raises(UsageError):
            BudgetLimits(max_connections=value)  # type: ignore[arg-type]


async def test_held_the_budget_keeps_time_on_trio_clock_not_the_wall(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # A day of mock time passes in no wall time: the minute windows and the
    # pause follow trio.current_time().
    budget = ModelBudget(providers={"p": BudgetLimits(requests_per_minute=1)})
    with await budget.acquire("p", "m") as grant:
        grant.refused(429, 45)
    with await budget.acquire("p", "m"):
        assert trio.current_time() == 60
    autojump_clock.jump(86_400)
    with await budget.acquire("p", "m"):
        assert trio.current_time() == 86_460
