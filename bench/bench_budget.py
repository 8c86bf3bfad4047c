"""The shared model budget against a rate-limited provider (issue 16), each row beside its baseline.

200 concurrent sessions, one agent turn each (a tool call, then an answer:
two streamed requests), all on the OpenAI adapter with its default retry
policy, against a fake OpenAI server at the HTTP wire that allows 120
requests a minute (fixed minutes, as providers count) and 20 at once,
answers each after 2 seconds, and refuses past its limits with 429 and
``Retry-After``. Three runs in the same process:

1. no budget (the baseline): every session retries on its own;
2. ``ModelBudget`` that knows only ``max_connections=20``: the first 429's
   ``Retry-After`` pauses every session;
3. ``ModelBudget`` with the provider's limits (20 connections, 120 requests a
   minute): target 0 429s.

For each: the 429s the server sent, the turns that failed (retries
exhausted), the simulated time to finish (Trio's mock clock jumps over the
waits: the provider's limits, not this machine, set it) and the real time
spent (the kernel's own cost). Target for row 3: 0 429s, and a simulated
time near the floor: 400 requests at 120 a minute start over four minutes,
the last at 180 s.

Run: ``.venv/bin/python bench/bench_budget.py`` (``make bench``). Prints a table;
never fails on timing.
"""

from __future__ import annotations

import json
import math
import time
from typing import Any

import httpx
import trio
import trio.testing

from kernel import tool
from kernel.agent import Agent
from kernel.models import BudgetLimits, ModelBudget, resolve_model
from kernel.session import Session
from kernel.store import MemoryStore, SessionKey

SESSIONS = 200
RPM = 120
CONCURRENT = 20
LATENCY = 2.0


@tool
def lookup(term: str) -> str:
    """Look a term up.

    Args:
        term: What to look up.
    """
    return f"{term}: found"


def sse(data: Any) -> str:
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n"


class RateLimitedProvider:
    """An OpenAI-compatible chat server with a rate limit (see the module docstring)."""

    def __init__(self) -> None:
        self.minute = -1
        self.in_minute = 0
        self.in_flight = 0
        self.refused = 0
        self.served = 0

    def _refuse(self, wait: float) -> httpx.Response:
        self.refused += 1
        body = {"error": {"message": "Rate limit reached.", "type": "requests"}}
        return httpx.Response(429, json=body, headers={"retry-after": str(math.ceil(wait))})

    async def handler(self, request: httpx.Request) -> httpx.Response:
        now = trio.current_time()
        minute = int(now // 60)
        if minute != self.minute:
            self.minute, self.in_minute = minute, 0
        if self.in_minute >= RPM:
            return self._refuse((minute + 1) * 60 - now)
        if self.in_flight >= CONCURRENT:
            return self._refuse(1)
        self.in_minute += 1
        self.in_flight += 1
        try:
            await trio.sleep(LATENCY)
        finally:
            self.in_flight -= 1
        self.served += 1
        last = json.loads(request.content)["messages"][-1]
        if last["role"] == "tool":
            delta: dict[str, Any] = {"content": "Found it."}
            finish = "stop"
        else:
            call = {"index": 0, "id": "call_1", "type": "function"}
            call["function"] = {"name": "lookup", "arguments": '{"term": "x"}'}
            delta, finish = {"tool_calls": [call]}, "tool_calls"
        usage = {"prompt_tokens": 50, "completion_tokens": 10, "total_tokens": 60}
        body = sse({"choices": [{"index": 0, "delta": delta, "finish_reason": None}]})
        body += sse({"choices": [{"index": 0, "delta": {}, "finish_reason": finish}]})
        body += sse({"choices": [], "usage": usage}) + sse("[DONE]")
        return httpx.Response(200, headers={"content-type": "text/event-stream"}, text=body)


async def run(budget: ModelBudget | None) -> tuple[int, int, float, float]:
    """(429s, failed turns, simulated seconds, real seconds) of 200 concurrent sessions."""
    provider = RateLimitedProvider()
    store = MemoryStore()
    failed = 0
    env = {"OPENAI_API_KEY": "k", "OPENAI_BASE_URL": "http://127.0.0.1:9/v1"}
    async with httpx.AsyncClient(transport=httpx.MockTransport(provider.handler)) as client:
        model = resolve_model("openai:gpt-4.1-mini", client=client, env=env, budget=budget)
        agent = Agent(model, [lookup], subagents=False)

        async def one(n: int) -> None:
            nonlocal failed
            result = await agent.run_turn(Session(store, SessionKey("bench", f"s{n}")), "go")
            failed += result.reason != "final"

        started, wall = trio.current_time(), time.perf_counter()
        async with trio.open_nursery() as nursery:
            for n in range(SESSIONS):
                nursery.start_soon(one, n)
        return (
            provider.refused,
            failed,
            trio.current_time() - started,
            time.perf_counter() - wall,
        )


async def main() -> None:
    rows = [
        ("no budget (baseline)", None),
        (
            "budget: max_connections only",
            ModelBudget(providers={"openai": BudgetLimits(max_connections=CONCURRENT)}),
        ),
        (
            "budget: the provider's limits",
            ModelBudget(
                providers={
                    "openai": BudgetLimits(max_connections=CONCURRENT, requests_per_minute=RPM)
                }
            ),
        ),
    ]
    print(
        f"{SESSIONS} concurrent sessions, 2 requests each; provider: {RPM} requests/min, "
        f"{CONCURRENT} at once, {LATENCY:g} s per answer"
    )
    print(f"{'row':<34}{'429s':>7}{'failed':>8}{'simulated':>12}{'real':>10}")
    for label, budget in rows:
        refused, failed, simulated, real = await run(budget)
        print(f"{label:<34}{refused:>7}{failed:>8}{simulated:>10.0f} s{real:>8.2f} s")
    # 400 requests at 120 a minute start over 4 minutes: the last at 180 s.
    floor = (math.ceil(SESSIONS * 2 / RPM) - 1) * 60 + LATENCY
    print(
        f"  (target: 0 429s with the provider's limits; no run can finish before "
        f"{floor:.0f} s simulated)"
    )


if __name__ == "__main__":
    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
