"""examples/batch_eval.py, as a user runs it: to the end, again, and killed midway then resumed."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

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


def user_prompts(out: Path, task_id: str) -> int:
    (sessions,) = (out / "home/data/sessions").glob("batch.batch-eval.*")  # the run's own
    transcript = sessions / task_id / "transcript.jsonl"
    return sum(json.loads(line)["type"] == "user" for line in transcript.read_text().splitlines())


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


def test_killed_midway_and_resumed_every_task_runs_exactly_once(tmp_path: Path) -> None:
    """A real SIGKILL while 50 tasks run; the resume finishes the rest: one finished
    result per task, each transcript holds its prompt once (continued, never started
    over), and no task's tool ran twice."""
    process = subprocess.Popen(
        [sys.executable, str(EXAMPLE), str(tmp_path), "--delay", "0.3"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    try:
        deadline = time.monotonic() + 120
        while len(result_lines(tmp_path)) < 40:
            assert process.poll() is None, "the example ended before it could be killed"
            assert time.monotonic() < deadline, "no results within 120 s"
            time.sleep(0.02)
    finally:
        process.send_signal(signal.SIGKILL)
        process.wait()
    done_before = len(result_lines(tmp_path))
    assert done_before < 200
    on_disk = (tmp_path / "run" / "results.jsonl").read_bytes()
    acknowledged = on_disk[: on_disk.rfind(b"\n") + 1]

    resumed = run_example(tmp_path)
    assert "resuming: " in resumed.stdout
    assert table_counts(resumed.stdout) == {"final": 189, "model_error": 10, "wall_time": 1}
    # Nothing written before the kill was lost or rewritten.
    assert (tmp_path / "run" / "results.jsonl").read_bytes().startswith(acknowledged)
    lines = result_lines(tmp_path)
    finished = Counter(str(line["id"]) for line in lines if line["reason"] in FINISHED)
    assert len(finished) == 200 and set(finished.values()) == {1}
    # Tasks running at the kill went on from their transcripts: the prompt was sent once.
    for i in range(200):
        task_id = f"q{i:03d}"
        assert user_prompts(tmp_path, task_id) == 1, task_id
        ran = tmp_path / "run" / "workspaces" / task_id / "ran.txt"
        runs = ran.read_text().count("read_question") if ran.exists() else 0
        assert runs <= 1, f"{task_id} ran its tool {runs} times"
    again = run_example(tmp_path)
    assert "nothing to do" in again.stdout
    assert len(result_lines(tmp_path)) == len(lines)
