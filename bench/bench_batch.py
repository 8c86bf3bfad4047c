"""What a batch run costs per task beyond the tool calls it makes (issue 16).

Each task: the scripted model asks for 10 no-op tool calls, then answers. Three
ways to do N such tasks, C at a time, all in this process and this run,
alternating round by round (best of the rounds, as ``timeit`` does):

- bare: a loop of ``run_tool_calls`` (the 10 calls of each task) under a
  ``trio.CapacityLimiter(C)``: the executor alone, no model, no transcript;
- turns: ``Kernel.run_turn`` per task (a session each: the model's two
  requests, the calls, the transcript), C at a time;
- batch: ``run_batch`` over a ``DirectoryLedger`` (a claim, a seeded workspace,
  the turn, a result line fsynced, progress) at ``max_concurrency=C``.

The overhead printed is per task: batch minus bare (what the kernel adds to the
calls), and batch minus turns (what the batch machinery adds to the turns).
"""

from __future__ import annotations

import itertools
import math
import tempfile
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path

import trio

from kernel import ToolCall, open_kernel, run_tool_calls, tool
from kernel.batch import BatchTask, open_run_dir, run_batch
from kernel.kernel import Kernel
from kernel.models import ModelRequest, ModelResponse, ScriptedModel

CALLS_PER_TASK = 10
#: (concurrency, tasks per round, rounds): enough tasks that every slot is busy.
SHAPES = ((1, 50, 3), (50, 500, 2), (500, 1000, 2))


@tool
async def noop() -> str:
    """Do nothing."""
    return ""


CALLS = [ToolCall(f"call_{i}", "noop", {}, i) for i in range(CALLS_PER_TASK)]


def script(request: ModelRequest) -> ModelResponse:
    """Ten calls, then (once their observations are back) the answer."""
    last = request.messages[-1]
    if last.role == "tool":
        return ScriptedModel.reply("done")
    return ScriptedModel.reply(calls=[("noop", {})] * CALLS_PER_TASK)


async def bare(n: int, concurrency: int) -> None:
    limiter = trio.CapacityLimiter(concurrency)

    async def one() -> None:
        async with limiter:
            await run_tool_calls(CALLS, [noop])

    async with trio.open_nursery() as nursery:
        for _ in range(n):
            nursery.start_soon(one)


async def turns(k: Kernel, n: int, concurrency: int, project: str) -> None:
    limiter = trio.CapacityLimiter(concurrency)

    async def one(i: int) -> None:
        async with limiter:
            finished = await k.run_turn(k.session(f"t{i}", project=project), "go")
            assert finished.reason == "final", finished

    async with trio.open_nursery() as nursery:
        for i in range(n):
            nursery.start_soon(one, i)


async def batch(k: Kernel, n: int, concurrency: int, run_dir: Path) -> None:
    tasks = [BatchTask(id=f"t{i}", prompt="go") for i in range(n)]
    async with open_run_dir(run_dir) as ledger:
        summary = await run_batch(k, tasks, ledger=ledger, max_concurrency=concurrency)
    assert summary.by_reason == {"final": n}, summary.by_reason


def sides(
    k: Kernel, root: Path, ids: Iterator[int], n: int, concurrency: int
) -> dict[str, Callable[[int], Awaitable[None]]]:
    """The three ways to run ``n`` tasks, ``concurrency`` at a time (each round anew)."""
    return {
        "bare": lambda _: bare(n, concurrency),
        "turns": lambda _: turns(k, n, concurrency, f"turns{next(ids)}"),
        "batch": lambda _: batch(k, n, concurrency, root / f"run{next(ids)}"),
    }


async def best_of(
    ways: dict[str, Callable[[int], Awaitable[None]]], rounds: int
) -> dict[str, float]:
    """Best seconds of each way over ``rounds``, the ways alternating in each round."""
    best = dict.fromkeys(ways, math.inf)
    for round_ in range(rounds):
        for name, side in ways.items():
            start = time.perf_counter()
            await side(round_)
            best[name] = min(best[name], time.perf_counter() - start)
    return best


async def main() -> None:
    print(f"per task: {CALLS_PER_TASK} no-op tool calls, scripted model (2 requests a task)")
    print(
        f"{'concurrency':>11} {'tasks':>6} {'bare':>10} {'turns':>10} {'batch':>10}"
        f" {'batch-bare':>11} {'batch-turns':>12}"
    )
    with tempfile.TemporaryDirectory(prefix="bench-batch-") as tmp:
        root = Path(tmp)
        async with open_kernel(
            home=root / "home", model=ScriptedModel(script), tools=[noop], plugins=[]
        ) as k:
            ids = itertools.count()
            for concurrency, n, rounds in SHAPES:
                best = await best_of(sides(k, root, ids, n, concurrency), rounds)
                per = {name: seconds / n * 1e3 for name, seconds in best.items()}
                print(
                    f"{concurrency:>11} {n:>6} {per['bare']:>7.3f} ms {per['turns']:>7.3f} ms"
                    f" {per['batch']:>7.3f} ms {per['batch'] - per['bare']:>8.3f} ms"
                    f" {per['batch'] - per['turns']:>9.3f} ms"
                )


if __name__ == "__main__":
    trio.run(main)
