"""CPU in the kernel process: the ``fs`` tools run there, so their cost must be bounded.

A tool past its deadline has its thread abandoned, not stopped, and C code that
holds the GIL freezes every session. Each attempt runs one hostile call through
the real executor: the call must end by itself, by its caps or its own clock, and
not at its deadline (nothing keeps burning CPU afterwards). How long the kernel's
loop stalls meanwhile is a figure, printed by bench/bench_kernel_stalls.py: no
test asserts elapsed time.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
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


# -- calls whose cost outlived their deadline before the fixes ----------------------------
#
# Each runs in a child process (``fs_call``), killed at the hang guard: were the call to
# keep burning CPU past its deadline, an abandoned thread here would go on for the rest
# of the suite.


ROOT = Path(__file__).resolve().parents[2]


#: A hang guard, not a measurement: an ``fs`` call that has not ended by itself after
#: this long never will (grep and glob stop on their own clock after ``GREP_SECONDS``,
#: edit_file counts lines once). The inputs below would take hours without the fixes.
HANG_GUARD_S = 120


_FS_CALL = """
import json, logging, sys
sys.path.insert(0, sys.argv[1])
from kernel.plugin import ToolContext, use_context
from plugins import fs
from sandbox import Workspace
workspace, name, arguments = sys.argv[2], sys.argv[3], json.loads(sys.argv[4])
[tool] = [t for t in fs.plugin.tools if t.name == name]
with Workspace(workspace, protected=(".tak",)) as ws:
    with use_context(ToolContext(ws, "p/s", logging.getLogger("tests.security"), {})):
        try:
            print(json.dumps({"returned": str(tool.fn(**arguments))[-2000:]}))
        except Exception as exc:
            print(json.dumps({"raised": f"{type(exc).__name__}: {exc}"[:2000]}))
"""


def fs_call(workspace: Path, tool: str, **arguments: object) -> dict[str, str]:
    """What one ``fs`` call returned (``{"returned": text}``) or raised (``{"raised":
    "Type: message"}``), run by itself to its end in a child process.

    In a child process, killed at the hang guard: an abandoned thread in this process
    would keep burning CPU for the rest of the suite.
    """
    try:
        done = subprocess.run(
            [
                sys.executable,
                "-c",
                _FS_CALL,
                str(ROOT),
                str(workspace),
                tool,
                json.dumps(arguments),
            ],
            capture_output=True,
            text=True,
            timeout=HANG_GUARD_S,
            check=True,
        )
    except subprocess.TimeoutExpired:
        pytest.fail(f"{tool} was still running after {HANG_GUARD_S} s: it never stops itself")
    outcome: dict[str, str] = json.loads(done.stdout.strip().splitlines()[-1])
    return outcome


def assert_stopped_by_its_clock(outcome: dict[str, str]) -> None:
    """The call ended by itself: the search stopped on its own clock and said so."""
    from plugins import fs

    returned = outcome.get("returned", "")
    assert f"[stopped after {fs.GREP_SECONDS:g} s: " in returned, outcome


def test_edit_file_with_an_old_text_occurring_everywhere_is_bounded(arena: Arena) -> None:
    # 400 000 occurrences took ~20 s before the fix, growing with their square: these
    # 4 Mi would take over half an hour, past the hang guard on any machine.
    many = 4 * 1024 * 1024
    (arena.workspace / "many.txt").write_text("a" * many)
    outcome = fs_call(arena.workspace, "edit_file", path="many.txt", old="a", new="b")
    assert outcome["raised"].startswith(f"ValueError: old text occurs {many} times in many.txt")
    assert (arena.workspace / "many.txt").read_text() == "a" * many
    arena.assert_nothing_seen()


def _ab_lines(path: Path, size: int) -> None:
    """Random ``a``/``b`` lines of 1000 characters: the DFA of ``[ab]*a[ab]{999}c`` explodes."""
    table = bytes(97 + (i & 1) for i in range(256))
    raw = bytearray(os.urandom(size).translate(table))
    raw[1000::1001] = b"\n" * len(raw[1000::1001])
    path.write_bytes(bytes(raw))


def test_grep_with_a_dfa_exploding_pattern_is_bounded(arena: Arena) -> None:
    _ab_lines(arena.workspace / "ab.txt", 8 * 1024 * 1024 - 1)
    outcome = fs_call(arena.workspace, "grep", pattern=r"[ab]*a[ab]{999}c", path=".")
    assert_stopped_by_its_clock(outcome)
    arena.assert_nothing_seen()


def test_grep_with_the_largest_program_it_runs_is_bounded(arena: Arena) -> None:
    """Refused: 33 of those patterns in one alternation (32 575 instructions, just under
    MAX_GREP_PROGRAM) cost ~40 us/byte; the window shrinks to 1 KiB and the clock stops it."""
    from plugins import fs

    pattern = "|".join(f"[ab]*a[ab]{{{999 - i}}}c" for i in range(33))
    assert fs.MAX_GREP_PROGRAM / 2 < fs._compile_grep(pattern).programsize <= fs.MAX_GREP_PROGRAM
    _ab_lines(arena.workspace / "ab.txt", 8 * 1024 * 1024 - 1)
    outcome = fs_call(arena.workspace, "grep", pattern=pattern, path=".")
    assert_stopped_by_its_clock(outcome)
    arena.assert_nothing_seen()


def test_edit_file_with_a_few_occurrences_answers_quickly(arena: Arena) -> None:
    """Not the hole above: the error for several occurrences on a big file names them."""
    (arena.workspace / "few.txt").write_text(("x" * 1000 + "\n") * 8000 + "needle\n" * 3)
    outcome = fs_call(arena.workspace, "edit_file", path="few.txt", old="needle", new="n")
    assert outcome == {
        "raised": "ValueError: old text occurs 3 times in few.txt, starting at lines 8001, "
        "8002, 8003; include more surrounding text so that it matches exactly once"
    }
    arena.assert_nothing_seen()


# -- grep's clock while it walks -----------------------------------------------------------
#
# grep checked its deadline before each file it reads and between RE2 windows, never
# while ``_walk_files`` lists directories: a tree of directories only (or a glob nothing
# matches) was walked to MAX_WALK_ENTRIES without a look at the clock. And each directory
# is listed by its path from the workspace root, so one at depth d costs d lookups: 1 900
# levels with 50 subdirectories each (95 000 entries, under the 200 000 cap) made the walk
# quadratic, the kernel's thread held past grep's deadline, unkillable.


def _deep_and_wide(root: Path, depth: int = 1900, width: int = 50) -> None:
    here = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for _ in range(depth):
            os.mkdir("a", dir_fd=here)
            for j in range(width):
                os.mkdir(f"b{j}", dir_fd=here)
            nxt = os.open("a", os.O_RDONLY | os.O_DIRECTORY, dir_fd=here)
            os.close(here)
            here = nxt
    finally:
        os.close(here)


def test_grep_walking_a_deep_tree_of_directories_is_bounded(arena: Arena, stress: bool) -> None:
    # Building 95,000 directories takes half a minute: `make stress` builds the whole
    # tree, `make test` one deep enough to pass the depth cap (tests/plugins/test_fs.py
    # checks the cap and the clock per directory with a fake clock).
    _deep_and_wide(arena.workspace, depth=1900 if stress else 300, width=50 if stress else 5)
    try:
        outcome = fs_call(arena.workspace, "grep", pattern="x", path=".", glob="*.py")
    finally:
        # Python's rmtree recurses once per level (pytest's cleanup of tmp_path would
        # fail at this depth); rm walks without recursion.
        subprocess.run(["rm", "-rf", str(arena.workspace / "a")], check=True)
    # It ended by itself (within the hang guard), at its depth cap or its clock, and says so.
    returned = outcome.get("returned", "")
    assert "[did not enter directories more than" in returned or "[stopped after " in returned, (
        outcome
    )
    arena.assert_nothing_seen()
