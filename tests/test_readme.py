"""The README's embedding example runs and prints what the README says it prints."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

README = Path(__file__).resolve().parent.parent / "README.md"


def test_embedding_example_runs_as_documented() -> None:
    text = README.read_text()
    section = text[text.index("## Embedding") :]
    code = re.search(r"```python\n(.*?)```", section, re.S)
    output = re.search(r"prints.*?```\n(.*?)```", section, re.S)
    assert code is not None and output is not None
    assert len([line for line in code.group(1).splitlines() if line.strip()]) <= 25
    result = subprocess.run(
        [sys.executable, "-c", code.group(1)], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout == output.group(1)
