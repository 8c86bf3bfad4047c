"""A FileStore killed with SIGKILL at random moments loses no acknowledged append."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import trio

from kernel.store import FileStore, SessionKey

KEYS = [SessionKey("p", "s"), SessionKey("p", "s", "subagents/a")]

CHILD = """
import sys, trio
from kernel.store import FileStore, SessionKey

root, start, durability = sys.argv[1], int(sys.argv[2]), sys.argv[3]
keys = [SessionKey("p", "s"), SessionKey("p", "s", "subagents/a")]

async def main():
    async with FileStore(root, durability=durability) as store:
        batch_id = start
        while True:
            size = 1 + batch_id % 4
            batch = [
                {"type": "t", "uuid": f"{batch_id}-{j}", "batch": batch_id, "size": size,
                 "pad": "x" * (batch_id * 37 % 3000)}
                for j in range(size)
            ]
            await store.append(keys[batch_id % 2], batch)
            sys.stdout.write(f"{batch_id}\\n")
            sys.stdout.flush()
            batch_id += 1

trio.run(main)
"""


async def run_child_and_kill(
    root: Path, start: int, durability: str, rng: random.Random
) -> list[int]:
    """Start a writer, SIGKILL it at a random moment, return the batches it acknowledged."""
    proc = await trio.lowlevel.open_process(
        [sys.executable, "-c", CHILD, str(root), str(start), durability],
        stdout=subprocess.PIPE,
    )
    assert proc.stdout is not None
    out = b""
    try:
        if rng.random() < 0.2:
            await trio.sleep(rng.uniform(0, 0.4))  # maybe before the first append
        else:
            while b"\n" not in out:  # started and appending: now any moment
                chunk = await proc.stdout.receive_some()
                if not chunk:
                    break
                out += chunk
            await trio.sleep(rng.uniform(0, 0.03))
    finally:
        proc.kill()
        await proc.wait()
    while chunk := await proc.stdout.receive_some():
        out += chunk
    await proc.stdout.aclose()
    lines = out.split(b"\n")
    return [int(line) for line in lines[:-1]]  # a line without its newline is no ack


async def test_kill_9_loses_no_acknowledged_append(tmp_path: Path, stress: bool) -> None:
    rng = random.Random()
    rounds = 60 if stress else 10
    acked: list[int] = []
    start = 0
    for round_ in range(rounds):
        durability = "fsync" if round_ % 3 == 2 else "flush"
        acked += await run_child_and_kill(tmp_path, start, durability, rng)
        async with FileStore(tmp_path) as store:  # reopen: cuts torn tails, rebuilds summaries
            stored: dict[int, list[dict[str, object]]] = {}
            for key in KEYS:
                entries = await store.load(key) or []
                uuids = [e["uuid"] for e in entries]
                assert len(uuids) == len(set(uuids)), "an entry stored twice"
                batches = [e["batch"] for e in entries]
                assert batches == sorted(batches), "out of order"
                for e in entries:
                    batch_id = int(str(e["batch"]))
                    assert KEYS[batch_id % 2] == key, "stored under the wrong key"
                    stored.setdefault(batch_id, []).append(e)
            # Whole batches only, and no gaps: acknowledged ones plus maybe the one in flight.
            for batch_id, entries in stored.items():
                assert len(entries) == entries[0]["size"], f"batch {batch_id} half stored"
            assert sorted(stored) == list(range(len(stored)))
            assert set(acked) <= set(stored), f"acknowledged but lost: {set(acked) - set(stored)}"
            start = len(stored)
            summaries = await store.list_session_summaries("p")
            main = await store.load(KEYS[0]) or []
            assert [s.data.entry_count for s in summaries] == ([len(main)] if main else [])
    # Opening for append cuts whatever a kill left half written: then every
    # line on disk is whole JSON, and new appends follow the last stored batch.
    async with FileStore(tmp_path) as store:
        for key in KEYS:
            await store.append(key, [{"type": "end", "uuid": "end"}])
            entries = await store.load(key) or []
            assert entries[-1] == {"type": "end", "uuid": "end"}
    for path in [
        tmp_path / "p" / "s" / "transcript.jsonl",
        tmp_path / "p" / "s" / "sub" / "subagents" / "a.jsonl",
    ]:
        data = path.read_bytes()
        assert data.endswith(b"\n")
        for line in data.splitlines():
            json.loads(line)
    assert len(acked) > rounds  # the kills did land while appending
