"""A hostile review of the shared model budget and of ReplayModel.

Each ``xfail(strict=True)`` test is a bug found: it fails today and passes
once the bug is fixed. The unmarked tests are guarantees that held under
attack, where they add to tests/models/test_budget.py and test_replay.py.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import gc
import math
import pathlib
import random
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
import trio
import trio.testing

from kernel import tool
from kernel.agent import COMPACTION_PROMPT, Agent, RunLimits
from kernel.errors import ModelAPIError, UsageError
from kernel.messages import Attachment, Message, Observation, Text, ToolCall
from kernel.models import (
    AnthropicModel,
    BudgetLimits,
    ModelBudget,
    ModelEvent,
    ModelRequest,
    OpenAIModel,
    ProviderError,
    ReplayModel,
    RetryPolicy,
    ScriptedModel,
    TextDelta,
    Usage,
)
from kernel.session import Session
from kernel.store import MemoryStore, SessionKey

from .test_anthropic import MESSAGE_START, TWO_TOOL_USES, event, first_request
from .test_budget import REQUEST, RateLimitedProvider, openai, row, run_all
from .wire import FakeServer, collect, json_response, sse_response, tool_results, user

OK = {"choices": [{"index": 0, "message": {"content": "ok"}, "finish_reason": "stop"}]}


def refusal(status: int = 429, **headers: str) -> httpx.Response:
    return json_response(status, {"error": {"message": "slow down"}}, headers=headers)


# --- bugs: the budget ---------------------------------------------------------------------


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


def test_fixed_the_retry_delay_neither_overflows_nor_takes_nan() -> None:
    policy = RetryPolicy(max_attempts=10_000, base_delay=0.5, max_delay=20, jitter=0)
    assert policy.delay(5000) == 20  # 2.0 ** 4999 raised OverflowError
    assert policy.delay(3, math.nan) == 2.0  # a nan Retry-After: as if none was sent


def test_fixed_snapshot_outside_a_trio_run_says_so() -> None:
    with pytest.raises(UsageError, match=r"snapshot\(\) needs a running Trio run"):
        ModelBudget().snapshot()


# --- bugs: ReplayModel ----------------------------------------------------------------------

ran: list[str] = []


@tool
def note(text: str) -> str:
    """Write a note down."""
    ran.append(text)
    return f"noted {text} ({len(ran)}, {random.random()})"


def session(store: MemoryStore, name: str) -> Session:
    return Session(store, SessionKey("p", name))


async def test_bug_a_session_with_a_subagent_cannot_be_replayed() -> None:
    # docs/models.md: "a subagent's requests need a ReplayModel of their own";
    # but delegate builds Agent(parent.model, ...): there is no way to give one.
    store = MemoryStore()
    recorder = ScriptedModel(
        [
            ScriptedModel.reply(calls=[("delegate", {"task": "note x"})]),
            ScriptedModel.reply(calls=[("note", {"text": "x"})]),  # the child
            "child done",  # the child
            "parent done",
        ]
    )
    recorded = session(store, "recorded")
    first = await Agent(recorder, [note], subagents=True).run_turn(recorded, "go")
    assert first.text == "parent done"
    ran.clear()
    model = await ReplayModel.from_session(recorded)
    replayed = session(store, "replayed")
    result = await Agent(model, [note], subagents=True).run_turn(replayed, "go")
    assert result.text == "parent done"
    assert ran == ["x"]  # the subagent's tool ran again


async def test_bug_a_reply_cut_short_replays_as_a_finished_answer() -> None:
    class FailsMidStream:
        """Streams some text, then the connection drops (not retried)."""

        name = "fails:mid"

        async def complete(self, request: ModelRequest) -> Any:
            raise AssertionError("the agent streams")

        @contextlib.asynccontextmanager
        async def stream(self, request: ModelRequest) -> AsyncIterator[AsyncIterator[ModelEvent]]:
            async def events() -> AsyncIterator[ModelEvent]:
                yield TextDelta("Half an ans")
                raise ProviderError("fails", "connection lost", error_type="incomplete_stream")

            yield events()

    store = MemoryStore()
    recorded = session(store, "recorded")
    first = await Agent(FailsMidStream(), [note]).run_turn(recorded, "go")
    assert first.reason == "model_error"
    await Agent(ScriptedModel(["Fine."]), [note]).run_turn(recorded, "again")
    model = await ReplayModel.from_session(recorded)
    replayed = session(store, "replayed")
    result = await Agent(model, [note]).run_turn(replayed, "go")
    assert result.reason == "model_error"  # as recorded (a divergence error would do too)


async def test_bug_a_turn_stopped_by_its_token_limit_diverges_on_replay() -> None:
    store = MemoryStore()
    limits = RunLimits(max_tokens=1000)
    spent = Usage(input_tokens=900, output_tokens=200)
    recorder = ScriptedModel(
        [
            ScriptedModel.reply(calls=[("note", {"text": "a"})], usage=spent),
            ScriptedModel.reply(calls=[("note", {"text": "never"})]),
            "Done.",
        ]
    )
    recorded = session(store, "recorded")
    agent = Agent(recorder, [note], limits=limits)
    assert (await agent.run_turn(recorded, "go")).reason == "max_tokens"
    assert (await agent.run_turn(recorded, "go on")).text == "Done."
    model = await ReplayModel.from_session(recorded)
    replayed = session(store, "replayed")
    agent = Agent(model, [note], limits=limits)
    first = await agent.run_turn(replayed, "go")
    second = await agent.run_turn(replayed, "go on")
    assert (first.reason, second.reason, second.text) == ("max_tokens", "final", "Done.")


async def test_bug_a_reply_cut_by_the_token_limit_replays_as_final() -> None:
    store = MemoryStore()
    recorder = ScriptedModel([ScriptedModel.reply("It was the best of", stop_reason="max_tokens")])
    recorded = session(store, "recorded")
    assert (await Agent(recorder, [note]).run_turn(recorded, "go")).reason == "max_tokens"
    model = await ReplayModel.from_session(recorded)
    result = await Agent(model, [note]).run_turn(session(store, "replayed"), "go")
    assert (result.reason, result.text) == ("max_tokens", "It was the best of")


# --- held: cancellation and leaks ------------------------------------------------------------


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


# --- held: Retry-After ------------------------------------------------------------------------


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


# --- held: tokens, fairness, scale ------------------------------------------------------------


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


# --- held: configuration ----------------------------------------------------------------------


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


# --- held: ReplayModel -------------------------------------------------------------------------


async def test_held_tools_giving_other_results_on_replay_do_not_diverge() -> None:
    # note() returns a random number: every result text differs from the recording's.
    store = MemoryStore()
    recorder = ScriptedModel(
        [
            ScriptedModel.reply(calls=[("note", {"text": "a"}), ("note", {"text": "b"})]),
            ScriptedModel.reply(calls=[("note", {"text": "c"}), ("missing", {})]),
            "Done.",
        ]
    )
    recorded = session(store, "recorded")
    await Agent(recorder, [note]).run_turn(recorded, "go")
    ran.clear()
    model = await ReplayModel.from_session(recorded)
    replayed = session(store, "replayed")
    result = await Agent(model, [note]).run_turn(replayed, "go")
    assert (result.reason, result.text) == ("final", "Done.")
    assert sorted(ran) == ["a", "b", "c"]
    then, now = await recorded.messages(), await replayed.messages()
    assert [m.role for m in then] == [m.role for m in now]
    tool_then = [m for m in then if m.role == "tool"]
    tool_now = [m for m in now if m.role == "tool"]
    assert tool_then != tool_now  # the observations differ; the replay went on regardless


async def test_held_results_in_another_order_do_not_diverge() -> None:
    calls = [ToolCall(id=f"c{i}", name="note", arguments="{}", index=i) for i in range(3)]
    recording = [
        user("go"),
        Message("assistant", tuple(calls)),
        tool_results(calls, ["x", "y", "z"]),
        Message("assistant", (Text("Done."),)),
    ]
    model = ReplayModel(recording)
    await model.complete(ModelRequest(recording[:1]))
    shuffled = tool_results(list(reversed(calls)), ["z", "y", "x"])
    response = await model.complete(ModelRequest([*recording[:2], shuffled]))
    assert response.message.text == "Done."


async def test_held_a_run_that_skips_a_call_diverges_even_with_the_same_count() -> None:
    # The false negative to fear: as many results as recorded, but one call
    # answered twice and another not at all.
    calls = [ToolCall(id=f"c{i}", name="note", arguments="{}", index=i) for i in range(2)]
    recording = [
        user("go"),
        Message("assistant", tuple(calls)),
        tool_results(calls, ["x", "y"]),
        Message("assistant", (Text("Done."),)),
    ]
    model = ReplayModel(recording)
    await model.complete(ModelRequest(recording[:1]))
    twice = tool_results([calls[0], calls[0]], ["x", "x"])
    with pytest.raises(ModelAPIError, match="missing c1"):
        await model.complete(ModelRequest([*recording[:2], twice]))


async def test_held_a_turn_that_failed_in_the_recording_fails_again_on_replay() -> None:
    # A model error with nothing streamed leaves no answer in the recording:
    # the replay refuses that turn (model_error, as recorded) and goes on.
    store = MemoryStore()
    outage = ProviderError("x", "down", status=500)
    recorder = ScriptedModel(
        [ScriptedModel.reply(calls=[("note", {"text": "a"})]), outage, "Later."]
    )
    recorded = session(store, "recorded")
    agent = Agent(recorder, [note])
    assert (await agent.run_turn(recorded, "go")).reason == "model_error"
    assert (await agent.run_turn(recorded, "retry")).text == "Later."
    model = await ReplayModel.from_session(recorded)
    replayed = session(store, "replayed")
    agent = Agent(model, [note])
    first = await agent.run_turn(replayed, "go")
    second = await agent.run_turn(replayed, "retry")
    assert (first.reason, second.reason, second.text) == ("model_error", "final", "Later.")


async def test_held_a_compaction_request_is_refused_not_answered() -> None:
    recording = [user("go"), Message("assistant", (Text("ok"),)), user("next")]
    model = ReplayModel([*recording, Message("assistant", (Text("bye"),))])
    await model.complete(ModelRequest(recording[:1]))
    with pytest.raises(ModelAPIError, match="replay_diverged"):
        await model.complete(ModelRequest([*recording, user(COMPACTION_PROMPT)]))
    assert model.served == 1
