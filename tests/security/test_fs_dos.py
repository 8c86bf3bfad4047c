"""CPU in the kernel process: the ``fs`` tools run there, so their cost must be bounded.

A tool past its deadline has its thread abandoned, not stopped, and C code that
holds the GIL freezes every session. Each attempt runs one hostile call through
the real executor: the call must end by itself, by its caps or its own clock, and
not at its deadline (nothing keeps burning CPU afterwards). How long the kernel's
loop stalls meanwhile is a figure, printed by bench/bench_kernel_stalls.py: no
test asserts elapsed time.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from kit import Arena

from kernel.executor import CallLimits, run_tool_calls
from kernel.messages import Observation, ToolCall
from kernel.plugin import ToolContext, use_context
from plugins import fs
from sandbox import Workspace

#: The call's deadline: it must end by itself before (the tool's own clock stops grep and
#: glob after fs.GREP_SECONDS, the caps stop the rest).
DEADLINE = 10.0


@pytest.fixture
def ws(arena: Arena) -> Iterator[Path]:
    with Workspace(arena.workspace, protected=(".tak",)) as w:
        with use_context(ToolContext(w, "p/s", logging.getLogger("tests.security"), {})):
            yield arena.workspace


async def attack(tool: str, **arguments: Any) -> Observation:
    """Run the call through the real executor; it must end by itself, not at its deadline."""
    [observation] = await run_tool_calls(
        [ToolCall("c", tool, arguments)], fs.plugin.tools, limits=CallLimits(timeout=DEADLINE)
    )
    assert "did not finish within" not in observation.content, "ran into its deadline"
    return observation


def _redos_file(ws: Path) -> None:
    # Lines that make backtracking engines explode: a run of one letter, then a misfit.
    lines = [("a" * 40 + "!"), ("ab" * 30 + "!"), ("x" * 50 + "\t")]
    (ws / "big.txt").write_text("\n".join(lines * 12_000) + "\n" + "a" * 300_000 + "!\n")


CATASTROPHIC = [
    r"(a+)+$",
    r"(a|aa)*b",
    r"(a*)*b",
    r"((a+)+)+c",
    r"(.*a){12}x",
    r"(\w+\s?)*$",
    r"^(([a-z])+.)+[A-Z]([a-z])+$",
    r"(x+x+)+y",
    r"(ab|a|b)*c$",
    r"(a?){30}a{30}",
]


@pytest.mark.parametrize("pattern", CATASTROPHIC)
async def test_grep_with_a_catastrophic_regex_keeps_the_kernel_responsive(
    arena: Arena, ws: Path, pattern: str
) -> None:
    _redos_file(ws)
    observation = await attack("grep", pattern=pattern, path="big.txt")
    assert not observation.is_error, observation.content[:200]
    arena.assert_nothing_seen([observation.content])


@pytest.mark.parametrize(
    ("pattern", "message"),
    [
        (r"(a)\1", "Python-only syntax"),
        (r"(?=a)a", "Python-only syntax"),
        (r"(?<!x)a+", "Python-only syntax"),
        (r"(?>a+)+b", "Python-only syntax"),
        (r"a++b", "Python-only syntax"),
        (r"(a", "invalid regular expression"),
        ("a" * (fs.MAX_PATTERN_CHARS + 1), "more than"),
        ("(" * 500 + ")" * 500, ""),
    ],
)
async def test_grep_refuses_what_cannot_run_in_linear_time_with_a_clear_error(
    arena: Arena, ws: Path, pattern: str, message: str
) -> None:
    _redos_file(ws)
    observation = await attack("grep", pattern=pattern, path="big.txt")
    if message:
        assert observation.is_error and message in observation.content, observation.content[:300]
    arena.assert_nothing_seen([observation.content])


async def test_edit_file_closest_match_on_a_big_file_is_bounded(arena: Arena, ws: Path) -> None:
    body = "".join(f"    value_{n} = compute(value_{n - 1}, {n}) + offset\n" for n in range(36_000))
    (ws / "big.py").write_text(body)
    assert len(body) > 1_900_000
    old = "".join(f"    value_{n} = compute(value_{n - 1}, {n}) - offset\n" for n in range(300))
    observation = await attack("edit_file", path="big.py", old=old, new="x")
    assert observation.is_error and "old text not found" in observation.content
    arena.assert_nothing_seen([observation.content])


async def test_edit_file_closest_match_with_a_long_one_line_old_is_bounded(
    arena: Arena, ws: Path
) -> None:
    (ws / "wide.txt").write_text(("ab" * 5000 + "\n") * 150)
    observation = await attack("edit_file", path="wide.txt", old="ab" * 9000 + "c", new="x")
    assert observation.is_error and "old text not found" in observation.content
    arena.assert_nothing_seen([observation.content])


def _deep_tree(ws: Path, depth: int = 25) -> None:
    path = ws
    for n in range(depth):
        path = path / f"d{n}"
        path.mkdir()
        (path / "f.txt").write_text("needle\n")


@pytest.mark.parametrize(
    ("tool", "arguments"),
    [
        ("grep", {"pattern": "needle", "glob": "**/" * 30 + "zz"}),
        ("grep", {"pattern": "needle", "glob": "**/*/" * 20 + "zz"}),
        ("glob", {"pattern": "**/*/" * 20 + "zz"}),
        ("glob", {"pattern": "**/" * 200 + "*.txt"}),
        ("glob", {"pattern": "/".join(["*a*a*a*a*a*a*a*a*b"] * 20)}),
    ],
    ids=["grep-double-stars", "grep-alternating", "glob-alternating", "glob-many", "glob-stars"],
)
async def test_glob_patterns_cost_linear_time(
    arena: Arena, ws: Path, tool: str, arguments: dict[str, str]
) -> None:
    _deep_tree(ws)
    observation = await attack(tool, **arguments)
    arena.assert_nothing_seen([observation.content])


async def test_list_dir_of_a_huge_directory_is_capped(
    arena: Arena, ws: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(fs, "MAX_WALK_ENTRIES", 1500)
    (ws / "huge").mkdir()
    for n in range(2500):
        (ws / "huge" / f"{n:05}").touch()
    observation = await attack("list_dir", path="huge")
    assert "huge has more" in observation.content
    arena.assert_nothing_seen([observation.content])


async def test_read_file_of_one_huge_line_is_bounded(arena: Arena, ws: Path) -> None:
    (ws / "line.txt").write_text("z" * (fs.MAX_FILE_BYTES - 10))
    observation = await attack("read_file", path="line.txt")
    assert "[line cut:" in observation.content
    arena.assert_nothing_seen([observation.content])
