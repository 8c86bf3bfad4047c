"""examples/batch_eval.py, as a user runs it: to the end, again, and killed midway then resumed."""

from __future__ import annotations

import json
import subprocess
import sys
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
