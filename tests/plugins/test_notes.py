"""The ``notes`` built-in plugin: a real SQLite FTS5 database inside a temporary workspace."""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator
from pathlib import Path

import pytest
from builtin_kit import run_calls, tool_context

from kernel.errors import SandboxError
from plugins import notes


@pytest.fixture
def ws(tmp_path: Path) -> Iterator[Path]:
    root = tmp_path / "ws"
    root.mkdir()
    with tool_context(root):
        yield root


def _ids(recalled: str) -> list[int]:
    return [int(line[1:].split()[0]) for line in recalled.splitlines() if line.startswith("#")]


def test_remember_recall_forget(ws: Path) -> None:
    deploy = notes.remember.fn("The deploy key lives in vault under ops/deploy", ["ops"])
    tests = notes.remember.fn("Running the tests needs `make test`", ["dev", "testing"])
    lunch = notes.remember.fn("Lunch is at noon")
    assert (deploy, tests, lunch) == (1, 2, 3)
    assert (ws / ".notes" / "notes.sqlite3").is_file()

    recalled = notes.recall.fn("how to run tests")
    assert recalled.startswith(
        "1 note matching 'how to run tests', best first:\n#2 [dev, testing] ("
    )
    assert recalled.endswith("UTC)\n    Running the tests needs `make test`")
    assert _ids(notes.recall.fn("vault noon")) in ([1, 3], [3, 1])
    assert notes.recall.fn("banana") == "no notes match 'banana'"

    assert notes.forget.fn(id=3) == "forgot 1 note: #3"
    assert notes.recall.fn("noon") == "no notes match 'noon'"
    assert notes.forget.fn(query="deploy vault") == "forgot 1 note: #1"
    assert (
        notes.forget.fn(query="deploy")
        == "no notes contain every word of 'deploy'; nothing forgotten"
    )
    # Ids are never reused, so an old id cannot name a new note.
    assert notes.remember.fn("new") == 4


def test_tags_weigh_more_than_text_and_k_limits(ws: Path) -> None:
    in_text = notes.remember.fn("python packaging is confusing")
    in_tag = notes.remember.fn("use uv for environments", ["python"])
    assert _ids(notes.recall.fn("python")) == [in_tag, in_text]
    assert _ids(notes.recall.fn("python", k=1)) == [in_tag]
    for n in range(10):
        notes.remember.fn(f"python fact {n}")
    assert len(_ids(notes.recall.fn("python", k=7))) == 7


def test_query_syntax_is_not_interpreted(ws: Path) -> None:
    notes.remember.fn('he said "NEAR(x y)" AND OR -- not a query')
    assert _ids(notes.recall.fn('NEAR( "x" AND OR *')) == [1]
    with pytest.raises(ValueError, match="has no words to search for"):
        notes.recall.fn("?! -- ()")


def test_bad_arguments(ws: Path) -> None:
    with pytest.raises(ValueError, match="give exactly one of id and query"):
        notes.forget.fn()
    with pytest.raises(ValueError, match="give exactly one of id and query"):
        notes.forget.fn(id=1, query="x")
    with pytest.raises(LookupError, match="there is no note #9"):
        notes.forget.fn(id=9)
    with pytest.raises(ValueError, match="text is empty"):
        notes.remember.fn("  ")
    with pytest.raises(ValueError, match="tags may not be empty"):
        notes.remember.fn("x", [" "])
    with pytest.raises(ValueError, match="k must be from 1 to 50"):
        notes.recall.fn("x", k=0)


def test_a_planted_symlink_is_refused(ws: Path) -> None:
    outside = ws.parent / "outside.sqlite3"
    sqlite3.connect(outside).close()
    (ws / ".notes").mkdir()
    (ws / ".notes" / "notes.sqlite3").symlink_to(outside)
    with pytest.raises(SandboxError, match=r"notes.sqlite3' resolves outside the workspace"):
        notes.remember.fn("x")
    (ws / ".notes" / "notes.sqlite3").unlink()
    (ws / ".notes").rmdir()
    (ws / ".notes").symlink_to(ws.parent)
    with pytest.raises(Exception, match=r"\.notes"):
        notes.remember.fn("x")
    assert outside.stat().st_size == 0


async def test_notes_through_the_executor(ws: Path) -> None:
    [remembered] = await run_calls(
        notes.plugin, [("remember", {"text": "the cat is grey", "tags": ["pets"]})]
    )
    assert remembered.content == "1"
    recalled, bad, forgot = await run_calls(
        notes.plugin,
        [
            ("recall", {"query": "cat"}),
            ("recall", {"query": "cat", "k": "5"}),
            ("forget", {}),
        ],
    )
    assert recalled.content.startswith("1 note matching 'cat', best first:\n#1 [pets]")
    assert bad.error is not None and bad.error.kind == "bad_arguments"
    assert forgot.error is not None and forgot.error.kind == "exception"
    assert forgot.content == "Error (exception): give exactly one of id and query"


def test_notes_runs_in_a_worker() -> None:
    assert not notes.plugin.in_process
    assert notes.plugin.permissions.workspace == "write"


def test_notes_kept_under_the_old_path_are_carried_over(ws: Path) -> None:
    notes.remember.fn("kept since the old days", ["legacy"])
    (ws / ".tak").mkdir(exist_ok=True)
    (ws / ".notes" / "notes.sqlite3").rename(ws / ".tak" / "notes.sqlite3")
    (ws / ".notes").rmdir()
    assert "kept since the old days" in notes.recall.fn("old days")
    assert (ws / ".notes" / "notes.sqlite3").is_file()
