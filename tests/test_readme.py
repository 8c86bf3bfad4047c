"""The README's Python examples run and print what the README says they print."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

README = Path(__file__).resolve().parent.parent / "README.md"
# a python block, optionally followed by "prints ..." and the output block
EXAMPLE = re.compile(r"```python\n(.*?)```\n(?:\n[^`]*?prints[^`]*?```\n(.*?)```)?", re.S)


def examples() -> list[tuple[str, str | None]]:
    return [(m.group(1), m.group(2)) for m in EXAMPLE.finditer(README.read_text())]


def test_readme_has_the_embedding_examples() -> None:
    found = examples()
    assert len(found) >= 2
    assert all(output is not None for _, output in found)
    first = [line for line in found[0][0].splitlines() if line.strip()]
    assert len(first) <= 25, "the first embedding example stays short"


@pytest.mark.parametrize("number", range(len(examples())))
def test_example_runs_as_documented(number: int, tmp_path: Path) -> None:
    code, output = examples()[number]
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=tmp_path
    )
    assert result.returncode == 0, result.stderr
    if output is not None:
        assert result.stdout == output
