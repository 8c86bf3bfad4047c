"""The ``notes`` built-in plugin: remember, recall (SQLite FTS5, BM25) and forget notes.

The database is ``.notes/notes.sqlite3`` inside the workspace, so notes travel
with it (not under ``.tak/``, which is read-only to every tool; a database left
at the old place, ``.tak/notes.sqlite3``, is copied over on first use). SQLite opens files by path and cannot be handed a confined directory
fd, so the path is built from the workspace's root: that is why this plugin
runs in a sandbox worker (``in_process=False``), where Landlock confines every
file SQLite opens (the database, its journal) to the workspace. The checks
below (the file is created through ``Workspace``, and the path must reach the
very inode the workspace fd resolves) only catch a planted symbolic link early;
they are not the confinement.

Notes are ranked by BM25 over their text and tags (a tag match weighs twice a
text match). Ids are never reused, so a forgotten id stays forgotten.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import sqlite3
import stat
import time
from collections.abc import Iterator, Sequence

from kernel.plugin import Plugin, context

__all__ = ["forget", "plugin", "recall", "remember"]

plugin = Plugin(
    "notes",
    version="0.1.0",
    description="Remember, recall and forget notes kept in the workspace.",
    permissions={"workspace": "write"},
)

DATABASE = ".notes/notes.sqlite3"
#: Where earlier versions kept it: read once, to carry old notes over.
_OLD_DATABASE = ".tak/notes.sqlite3"
MAX_NOTE_CHARS = 20_000
MAX_TAGS = 20
MAX_RECALL = 50
#: BM25 weights of the ``text`` and ``tags`` columns.
_WEIGHTS = (1.0, 2.0)

_SCHEMA = """
CREATE TABLE IF NOT EXISTS notes (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    text TEXT NOT NULL,
    tags TEXT NOT NULL,          -- JSON list
    created REAL NOT NULL,
    session TEXT
);
CREATE VIRTUAL TABLE IF NOT EXISTS notes_fts USING fts5(
    text, tags, content='notes', content_rowid='id', tokenize='porter unicode61'
);
CREATE TRIGGER IF NOT EXISTS notes_insert AFTER INSERT ON notes BEGIN
    INSERT INTO notes_fts(rowid, text, tags) VALUES (new.id, new.text, new.tags);
END;
CREATE TRIGGER IF NOT EXISTS notes_delete AFTER DELETE ON notes BEGIN
    INSERT INTO notes_fts(notes_fts, rowid, text, tags) VALUES ('delete', old.id, old.text, old.tags);
END;
"""


def _database_path() -> str:
    """The host path of the database, after checking it is the workspace's own file."""
    ws = context().workspace
    ws.mkdir(os.path.dirname(DATABASE), exist_ok=True)
    if not ws.exists(DATABASE) and ws.exists(_OLD_DATABASE):
        ws.write_bytes(DATABASE, ws.read_bytes(_OLD_DATABASE, max_bytes=1 << 30))
    os.close(ws.open(DATABASE, os.O_RDWR | os.O_CREAT, 0o600))
    inside = ws.stat(DATABASE)
    host_path = os.path.join(ws.path, DATABASE)
    outside = os.stat(host_path, follow_symlinks=False)
    if not stat.S_ISREG(outside.st_mode) or (outside.st_dev, outside.st_ino) != (
        inside.st_dev,
        inside.st_ino,
    ):
        raise RuntimeError(f"{DATABASE} is not a regular file inside the workspace; refused")
    return host_path


@contextlib.contextmanager
def _database() -> Iterator[sqlite3.Connection]:
    connection = sqlite3.connect(_database_path(), timeout=10, isolation_level=None)
    try:
        connection.executescript(_SCHEMA)
        yield connection
    finally:
        connection.close()


@contextlib.contextmanager
def _transaction(connection: sqlite3.Connection) -> Iterator[None]:
    connection.execute("BEGIN IMMEDIATE")
    try:
        yield
    except BaseException:
        connection.execute("ROLLBACK")
        raise
    connection.execute("COMMIT")


def _match_expression(query: str, *, every_word: bool) -> str:
    """An FTS5 query from free text: each word quoted (no query syntax), OR'd or AND'ed."""
    words = re.findall(r"\w+", query)
    if not words:
        raise ValueError(f"query {query!r} has no words to search for")
    joiner = " AND " if every_word else " OR "
    return joiner.join(f'"{word}"' for word in words)


def _clean_tags(tags: Sequence[str]) -> list[str]:
    cleaned = []
    for tag in tags:
        tag = tag.strip()
        if not tag:
            raise ValueError("tags may not be empty")
        if tag not in cleaned:
            cleaned.append(tag)
    if len(cleaned) > MAX_TAGS:
        raise ValueError(f"at most {MAX_TAGS} tags, got {len(cleaned)}")
    return cleaned


def _format(row: tuple[int, str, str, float]) -> str:
    note_id, text, tags, created = row
    when = time.strftime("%Y-%m-%d %H:%M", time.gmtime(created))
    tag_list = json.loads(tags)
    shown_tags = f" [{', '.join(tag_list)}]" if tag_list else ""
    body = text.replace("\n", "\n    ")
    return f"#{note_id}{shown_tags} ({when} UTC)\n    {body}"


@plugin.tool
def remember(text: str, tags: list[str] = []) -> int:  # noqa: B006 - the schema's default; copied per call
    """Store a note in the workspace's notes and return its id.

    Args:
        text: What to remember.
        tags: Words to file it under; they count twice as much as text when recalling.
    """
    text = text.strip()
    if not text:
        raise ValueError("text is empty; nothing to remember")
    if len(text) > MAX_NOTE_CHARS:
        raise ValueError(f"text is {len(text)} characters; a note holds at most {MAX_NOTE_CHARS}")
    clean = _clean_tags(tags)
    with _database() as db, _transaction(db):
        cursor = db.execute(
            "INSERT INTO notes(text, tags, created, session) VALUES (?, ?, ?, ?)",
            (text, json.dumps(clean, ensure_ascii=False), time.time(), context().session),
        )
        note_id = cursor.lastrowid
    assert note_id is not None
    return note_id


@plugin.tool
def recall(query: str, k: int = 5) -> str:
    """Find the notes that best match a query, best first (BM25 over text and tags).

    A note matches when it contains any word of the query (words are stemmed:
    "running" finds "run").

    Args:
        query: Words to look for.
        k: How many notes to return, 1 to 50.
    """
    if not 1 <= k <= MAX_RECALL:
        raise ValueError(f"k must be from 1 to {MAX_RECALL}, got {k}")
    expression = _match_expression(query, every_word=False)
    with _database() as db:
        rows = db.execute(
            "SELECT notes.id, notes.text, notes.tags, notes.created FROM notes_fts "
            "JOIN notes ON notes.id = notes_fts.rowid "
            f"WHERE notes_fts MATCH ? ORDER BY bm25(notes_fts, {_WEIGHTS[0]}, {_WEIGHTS[1]}) "
            "LIMIT ?",
            (expression, k),
        ).fetchall()
    if not rows:
        return f"no notes match {query!r}"
    header = f"{len(rows)} note{'s' if len(rows) != 1 else ''} matching {query!r}, best first:"
    return "\n".join([header, *(_format(row) for row in rows)])


@plugin.tool
def forget(id: int | None = None, query: str | None = None) -> str:
    """Delete one note by id, or every note that contains all the words of a query.

    Give exactly one of ``id`` and ``query``.

    Args:
        id: The id of the note to delete.
        query: Delete the notes that contain every word of this query.
    """
    if (id is None) == (query is None):
        raise ValueError("give exactly one of id and query")
    with _database() as db, _transaction(db):
        if id is not None:
            if db.execute("DELETE FROM notes WHERE id = ?", (id,)).rowcount == 0:
                raise LookupError(f"there is no note #{id}")
            deleted = [id]
        else:
            assert query is not None
            expression = _match_expression(query, every_word=True)
            deleted = [
                row[0]
                for row in db.execute(
                    "SELECT rowid FROM notes_fts WHERE notes_fts MATCH ?", (expression,)
                ).fetchall()
            ]
            db.executemany("DELETE FROM notes WHERE id = ?", [(n,) for n in deleted])
    if not deleted:
        return f"no notes contain every word of {query!r}; nothing forgotten"
    listed = ", ".join(f"#{n}" for n in sorted(deleted))
    return f"forgot {len(deleted)} note{'s' if len(deleted) != 1 else ''}: {listed}"
