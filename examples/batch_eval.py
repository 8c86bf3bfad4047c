"""A batch eval, offline: 200 arithmetic tasks, 50 at a time, on a scripted model.

    python examples/batch_eval.py OUT            # runs, prints the summary table
    python examples/batch_eval.py OUT            # again: nothing to do
    (kill it midway, run it again: it finishes the rest, running no task twice)

Each task is its own session (``<task id>`` of project ``batch.<run>.<nonce>``)
with its own workspace holding ``question.json``; the model (a script standing
in for a provider) calls ``read_question`` and answers with the sum. To show that one task's
trouble stays its own: 10% of the questions are corrupt (the tool raises; the
model sees the error and gives up: score 0), 5% of the tasks meet a model that
fails (``model_error``), and one task's model hangs past its 2-second wall
time (``wall_time``). Results stream to ``OUT/run/results.jsonl``.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Any

import trio

from kernel import open_kernel, tool
from kernel.batch import BatchTask, TaskLimits, TaskOutcome, open_run_dir, run_batch
from kernel.errors import KernelError, ModelAPIError
from kernel.models import ModelRequest, ScriptedModel, Usage
from kernel.plugin import context

TASKS = 200
CONCURRENCY = 50
HANGS = "q150"


def make_tasks(n: int = TASKS) -> list[BatchTask]:
    tasks = []
    for i in range(n):
        a, b = i * 7 % 101, i * 13 % 97
        question = {"a": a, "b": b, "corrupt": i % 10 == 3}
        tasks.append(
            BatchTask(
                id=f"q{i:03d}",
                prompt=f"task q{i:03d}: add the two numbers in question.json",
                files={"question.json": json.dumps(question)},
                expected=a + b,
                metadata={"fails": "model" if i % 20 == 7 else None},
                limits=TaskLimits(wall_time=2.0) if f"q{i:03d}" == HANGS else None,
            )
        )
    return tasks


@tool
def read_question() -> str:
    """Read this task's question (question.json in its workspace)."""
    workspace = context().workspace
    # A marker per run of the tool: the tests check that no task ran it twice.
    workspace.append("ran.txt", "read_question\n")
    question = json.loads(workspace.read_text("question.json"))
    if question["corrupt"]:
        raise ValueError("question.json is corrupt")
    return f"{question['a']} {question['b']}"


def scripted(delay: float) -> ScriptedModel:
    """A stand-in for a provider: it reads the question, then answers the sum."""

    async def answer(request: ModelRequest) -> Any:
        first = next(m for m in request.messages if m.role == "user").text
        task_id = first.split()[1].rstrip(":")
        number = int(task_id[1:])
        await trio.sleep(delay)
        if task_id == HANGS:
            await trio.sleep_forever()
        if number % 20 == 7:
            raise ModelAPIError("scripted: HTTP 503 from the provider (overloaded)")
        usage = Usage(input_tokens=40, output_tokens=8, cost_usd=0.0001)
        last = request.messages[-1]
        if last.role == "user":
            return ScriptedModel.reply(calls=[("read_question", {})], usage=usage)
        observation = last.observations[0]
        if observation.error is not None:
            return ScriptedModel.reply(f"I cannot answer: {observation.error.message}", usage=usage)
        a, b = (int(x) for x in observation.content.split())
        return ScriptedModel.reply(f"The sum is {a + b}.", usage=usage)

    return ScriptedModel(answer, name="scripted:batch-eval", keep_requests=0)


def score(task: BatchTask, outcome: TaskOutcome) -> float:
    """1.0 for the sum of the task's own question.json, read through its workspace:
    ``outcome.workspace`` is confined to the task's directory, so a link the task
    left there (to another task's files, say) is refused, never followed."""
    question = json.loads(outcome.workspace.read_text("question.json"))
    numbers = re.findall(r"-?\d+", outcome.text)
    return 1.0 if numbers and int(numbers[-1]) == question["a"] + question["b"] else 0.0


async def main(out: Path, *, delay: float, concurrency: int, n: int) -> None:
    settings = {"model": "scripted:batch-eval", "concurrency": concurrency}
    async with (
        open_kernel(
            home=out / "home", model=scripted(delay), tools=[read_question], plugins=[]
        ) as kernel,
        open_run_dir(out / "run", run_id="batch-eval", settings=settings) as ledger,
    ):
        tasks = make_tasks(n)
        await ledger.add_tasks(tasks)
        counts = await ledger.counts()
        if counts.finished == counts.total:
            print(f"nothing to do: all {counts.total} tasks of run {ledger.run_id} finished")
        elif counts.finished:
            print(f"resuming: {counts.finished} of {counts.total} tasks finished already")
        summary = await run_batch(
            kernel, None, ledger=ledger, max_concurrency=concurrency, scorer=score
        )
        print(summary.table())
        print(f"results: {ledger.path / 'results.jsonl'}")


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, help="where the run and the kernel's home go")
    parser.add_argument("--delay", type=float, default=0.0, help="seconds per model request")
    parser.add_argument("--concurrency", type=int, default=CONCURRENCY)
    parser.add_argument("--tasks", type=int, default=TASKS)
    return parser.parse_args(argv)


if __name__ == "__main__":
    args = parse(sys.argv[1:])
    try:
        trio.run(
            lambda: main(args.out, delay=args.delay, concurrency=args.concurrency, n=args.tasks)
        )
    except KernelError as exc:  # a bad OUT (inside the checkout, say): one line
        sys.exit(f"batch_eval: {type(exc).__name__}: {exc}")
