"""The README's Python examples, and the docs' blocks marked ```` ```python run ````,
run and print what the page says they print (a "prints" block after them)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
# a python block, optionally followed by "prints ..." and the output block
EXAMPLE = re.compile(r"```python\n(.*?)```\n(?:\n[^`]*?prints[^`]*?```\n(.*?)```)?", re.S)
RUNNABLE = re.compile(r"```python run\n(.*?)```\n(?:\n[^`]*?prints[^`]*?```\n(.*?)```)?", re.S)


def examples() -> list[tuple[str, str | None]]:
    return [(m.group(1), m.group(2)) for m in EXAMPLE.finditer(README.read_text())]


def doc_examples() -> list[tuple[str, str, str | None]]:
    return [
        (f"{page.name}:{page.read_text().count(chr(10), 0, m.start()) + 1}", m.group(1), m.group(2))
        for page in DOCS
        for m in RUNNABLE.finditer(page.read_text())
    ]


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


@pytest.mark.parametrize(("where", "code", "output"), doc_examples(), ids=lambda v: str(v)[:40])
def test_doc_example_runs_as_written(
    where: str, code: str, output: str | None, tmp_path: Path
) -> None:
    env = {**os.environ, "TAK_HOME": str(tmp_path / "home")}
    result = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
        env=env,
    )
    assert result.returncode == 0, f"{where}: {result.stderr}"
    if output is not None:
        assert result.stdout == output, where


def test_docs_have_runnable_examples() -> None:
    assert len(doc_examples()) >= 1


def test_every_python_block_in_the_docs_is_run_or_marked_a_sketch() -> None:
    """A block that is neither is one nobody checks: mark it ```python run (and
    make it a whole program) or ```python sketch (a fragment, on purpose)."""
    unmarked = [
        f"{page.name}:{n}"
        for page in DOCS
        for n, line in enumerate(page.read_text().splitlines(), 1)
        if line.strip() == "```python"
    ]
    assert not unmarked, f"unmarked python blocks: {unmarked}"
