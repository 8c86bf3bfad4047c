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
