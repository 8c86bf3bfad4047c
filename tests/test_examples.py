"""Every example runs."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def test_streaming_calls_example() -> None:
    result = subprocess.run(
        [sys.executable, str(EXAMPLES / "streaming_calls.py")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    in_order = [line for line in result.stdout.splitlines() if line.startswith("in order:")]
    assert [line.split()[2] for line in in_order] == ["#0", "#1", "#2", "#3"]
    assert "Error (cancelled): the call was cancelled by request" in in_order[2]
    assert in_order[3].endswith("wrote 'findings'")


def test_research_agent_demo(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, str(EXAMPLES / "research_agent.py"), "--home", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    lines = result.stdout.splitlines()
    start = lines.index("The parallel step, in declared order:")
    rows = [line.split() for line in lines[start:] if line[:1].isdigit()][:6]
    assert [r[0] for r in rows] == ["0", "1", "2", "3", "4", "5"]
    assert [r[2] for r in rows] == [
        "read_file", "fetch_url", "fetch_url", "run_python", "run_command", "read_file",
    ]  # fmt: skip
    assert [r[3] for r in rows] == ["ok", "ok", "ok", "ok", "ok", "exception"]
    assert "value: 270270" in result.stdout  # the table folds the newline
    report = tmp_path / "workspace/research-demo/report.md"
    assert "At 3.7 µs per task: 270270 tool calls per second." in report.read_text()
    assert "structured concurrency" in report.read_text()
    assert "notes.md" in report.read_text()  # wc -w ran in the shell worker
    show = next(line for line in lines if line.startswith("show it:")).split("tak ", 1)[1]
    shown = subprocess.run(
        [sys.executable, "-m", "kernel.cli", *show.split()], capture_output=True, text=True
    )
    assert shown.returncode == 0 and "report.md" in shown.stdout
