"""Reopening a long transcript reads only what follows its checkpoint
(``#checkpoint.json``: the uuids and line count of the first ``size`` bytes
of that very file), and every way the checkpoint can be wrong falls back to
the whole scan: another file at the path, a shorter file, a torn tail, a
damaged checkpoint, another process's appends since."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import pytest

from kernel.store import FileStore, SessionKey, _disk

KEY = SessionKey("proj", "long")
PAD = "x" * 300


def big(n: int) -> dict[str, Any]:
    return {"type": "user", "uuid": f"u{n}", "n": n, "pad": PAD}


def transcript(root: Path) -> Path:
    return root / "proj" / "long" / "transcript.jsonl"


def append_bytes(path: Path, data: bytes) -> None:
    with open(path, "ab") as f:
        f.write(data)


def checkpoint(root: Path) -> Path:
    return root / "proj" / "long" / _disk.CHECKPOINT


async def write_long(root: Path, count: int = 1200) -> None:
    """A transcript past CHECKPOINT_MIN_BYTES, closed (so its checkpoint is written)."""
    async with FileStore(root) as store:
        for start in range(0, count, 200):
            await store.append(KEY, [big(n) for n in range(start, start + 200)])
    assert transcript(root).stat().st_size >= _disk.CHECKPOINT_MIN_BYTES


@pytest.fixture
def no_full_scan(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Record every whole scan instead of forbidding it: tests assert on it."""
    scans: list[str] = []
    real = _disk._scan

    def scan(fd: int, path: str, **kwargs: Any) -> Any:
        scans.append(path)
        return real(fd, path, **kwargs)

    monkeypatch.setattr(_disk, "_scan", scan)
    return scans


async def test_reopening_a_long_transcript_reads_only_its_tail(
    tmp_path: Path, no_full_scan: list[str]
) -> None:
    await write_long(tmp_path)
    cp = json.loads(checkpoint(tmp_path).read_bytes())
    assert cp["size"] == transcript(tmp_path).stat().st_size and len(cp["uuids"]) == 1200
    async with FileStore(tmp_path) as store:
        await store.append(KEY, [big(5), big(2000)])  # u5 is stored already: only u2000
        (summary,) = await store.list_session_summaries("proj")
    assert no_full_scan == []
    assert summary.data.entry_count == 1201
    async with FileStore(tmp_path) as store:
        loaded = await store.load(KEY)
        assert loaded is not None
        assert [e["n"] for e in loaded] == [*range(1200), 2000]


async def test_another_processes_appends_after_the_checkpoint_are_taken_in(
    tmp_path: Path, no_full_scan: list[str]
) -> None:
    await write_long(tmp_path)
    async with FileStore(tmp_path) as other, FileStore(tmp_path) as store:
        await other.append(KEY, [big(3000)])  # still open: the checkpoint is behind
        await store.append(KEY, [big(3000), big(3001)])  # u3000: the other's, stored once
        await other.append(KEY, [big(3001), big(3002)])  # and u3001 is ours, for it
        loaded = await store.load(KEY)
    assert loaded is not None and [e["n"] for e in loaded][-3:] == [3000, 3001, 3002]
    assert no_full_scan == []


async def test_appends_since_a_good_checkpoint_are_scanned_and_deduplicated(
    tmp_path: Path, no_full_scan: list[str]
) -> None:
    await write_long(tmp_path)
    # Another writer appended after the checkpoint and died before closing:
    # the checkpoint is behind the file, and its tail is torn.
    append_bytes(transcript(tmp_path), (json.dumps(big(4000)) + "\n").encode())
    append_bytes(transcript(tmp_path), b'{"type": "user", "uuid": "u4001", "n": 40')
    async with FileStore(tmp_path) as store:
        await store.append(KEY, [big(4000), big(4002)])  # u4000 is in the tail: stored once
        (summary,) = await store.list_session_summaries("proj")
        loaded = await store.load(KEY)
    assert no_full_scan == []
    assert loaded is not None and [e["n"] for e in loaded][-3:] == [1199, 4000, 4002]
    assert summary.data.entry_count == 1202


@pytest.mark.parametrize("change", ["replaced", "shorter", "damaged", "other_version"])
async def test_a_checkpoint_that_does_not_hold_is_not_used(
    tmp_path: Path, no_full_scan: list[str], change: str
) -> None:
    await write_long(tmp_path)
    path = transcript(tmp_path)
    if change == "replaced":  # another file at the path (a repair), same bytes plus one
        shutil.copyfile(path, tmp_path / "copy")
        append_bytes(tmp_path / "copy", (json.dumps(big(5000)) + "\n").encode())
        os.replace(tmp_path / "copy", path)
    elif change == "shorter":  # cut below the checkpoint by hand
        data = path.read_bytes()
        path.write_bytes(data[: data.rindex(b"\n", 0, len(data) - 1) + 1])
    elif change == "damaged":
        checkpoint(tmp_path).write_text('{"version": 1, "uuids": "not a list"}')
    else:
        cp = json.loads(checkpoint(tmp_path).read_bytes())
        checkpoint(tmp_path).write_text(json.dumps({**cp, "version": 99}))
    async with FileStore(tmp_path) as store:
        await store.append(KEY, [big(5000), big(5001)])  # u5000 is in the replaced file
        loaded = await store.load(KEY)
    assert len(no_full_scan) == 1
    assert loaded is not None
    numbers = [e["n"] for e in loaded]
    assert numbers.count(5000) == 1 and numbers[-1] == 5001
    assert len(numbers) == len({e["uuid"] for e in loaded})


async def test_short_transcripts_get_no_checkpoint(tmp_path: Path) -> None:
    async with FileStore(tmp_path) as store:
        await store.append(KEY, [big(0)])
    assert transcript(tmp_path).exists() and not checkpoint(tmp_path).exists()
