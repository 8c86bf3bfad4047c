"""examples/batch_eval.py, as a user runs it: to the end, again, and killed midway then resumed."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "batch_eval.py"
FINISHED = {"final", "max_steps", "max_tokens", "max_cost", "wall_time", "model_error", "error"}


def run_example(out: Path, *args: str) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(
        [sys.executable, str(EXAMPLE), str(out), *args],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    return result


def result_lines(out: Path) -> list[dict[str, object]]:
    path = out / "run" / "results.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.endswith("}")]


def table_counts(stdout: str) -> dict[str, int]:
    counts = {}
    for line in stdout.splitlines():
        words = line.split()
        if len(words) == 2 and words[0] in FINISHED and words[1].isdigit():
            counts[words[0]] = int(words[1])
    return counts


def test_the_example_runs_once_and_then_does_nothing(tmp_path: Path) -> None:
    first = run_example(tmp_path)
    assert table_counts(first.stdout) == {"final": 189, "model_error": 10, "wall_time": 1}
    # 169 right: 20 corrupt questions, 10 model errors (scored 0), one hang (not scored)
    assert "score mean  0.849 over 199 scored" in first.stdout
    lines = result_lines(tmp_path)
    assert len(lines) == 200
    before = (tmp_path / "run" / "results.jsonl").read_bytes()
    second = run_example(tmp_path)
    assert "nothing to do: all 200 tasks of run batch-eval finished" in second.stdout
    assert table_counts(second.stdout) == table_counts(first.stdout)
    assert (tmp_path / "run" / "results.jsonl").read_bytes() == before


def example_results(out: Path) -> list[dict[str, Any]]:
    path = out / "run" / "results.jsonl"
    if not path.exists():
        return []
    return [
        json.loads(line)
        for line in path.read_bytes().splitlines(keepends=True)
        if line.endswith(b"\n")
    ]


@pytest.mark.parametrize(
    "kill_after", [-1, 0, 37, 79], ids=["writing_tasks", "no_result", "midway", "last_left"]
)
def test_sigkilled_at_any_point_then_resumed_no_task_runs_twice_or_is_lost(
    tmp_path: Path, kill_after: int
) -> None:
    """A real SIGKILL at several points of the example's run (as its task file is
    being written: -1; before any result; midway, with tasks in flight; one task
    left): the resume finishes every task once, with the outcomes of a run never
    killed, keeps every line written before the kill, sends each prompt once (tasks
    go on from their transcripts, never start over) and runs no task's tool twice;
    a third run has nothing to do. (The one "killed, resumed, exactly once" test of
    the example; test_the_example_runs_once_and_then_does_nothing runs it whole.)"""
    import signal
    import time

    argv = [sys.executable, str(EXAMPLE), str(tmp_path), "--tasks", "80", "--concurrency", "20"]
    process = subprocess.Popen([*argv, "--delay", "0.2"], stdout=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while not (
            (tmp_path / "run" / "tasks.jsonl").exists()
            if kill_after < 0
            else (tmp_path / "run" / "claims.jsonl").exists()
            and len(example_results(tmp_path)) >= kill_after
        ):
            assert process.poll() is None, "the example ended before it could be killed"
            assert time.monotonic() < deadline, "nothing within 120 s"
            time.sleep(0.005)
    finally:
        process.send_signal(signal.SIGKILL)
        process.wait()
    results = tmp_path / "run" / "results.jsonl"
    before = results.read_bytes() if results.exists() else b""
    acknowledged = before[: before.rfind(b"\n") + 1]

    resumed = subprocess.run(argv, capture_output=True, text=True, timeout=300, check=False)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    if kill_after == 37:  # results written, tasks in flight: it says it goes on
        assert "resuming: " in resumed.stdout, resumed.stdout
    # As a run never killed ends: 80 tasks, every 20th one's model failing.
    assert table_counts(resumed.stdout) == {"final": 76, "model_error": 4}, resumed.stdout
    assert results.read_bytes().startswith(acknowledged)
    finished: dict[str, int] = {}
    for line in example_results(tmp_path):
        if line["reason"] in FINISHED:
            finished[line["id"]] = finished.get(line["id"], 0) + 1
    assert len(finished) == 80 and set(finished.values()) == {1}
    (sessions,) = (tmp_path / "home" / "data" / "sessions").glob("batch.batch-eval.*")
    for i in range(80):
        task_id = f"q{i:03d}"
        transcript = (sessions / task_id / "transcript.jsonl").read_text().splitlines()
        assert sum(json.loads(line)["type"] == "user" for line in transcript) == 1, task_id
        ran = tmp_path / "run" / "workspaces" / task_id / "ran.txt"
        assert (ran.read_text().count("read_question") if ran.exists() else 0) <= 1, task_id
    written = len(example_results(tmp_path))
    again = subprocess.run(argv, capture_output=True, text=True, timeout=300, check=False)
    assert "nothing to do" in again.stdout, again.stdout + again.stderr
    assert len(example_results(tmp_path)) == written
