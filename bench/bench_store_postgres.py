"""PostgresStore with many writer processes, beside a bare psycopg loop, same server, same run.

Starts its own PostgreSQL (tests/store/pg_server.py: Debian's binaries, a
temporary directory, fsync on), then, for 1 session and for 100 sessions:

- ``PostgresStore``: 4 OS processes x 4 Trio tasks, 1-entry appends (one
  transaction each), for a fixed time;
- baseline: 4 OS processes x 4 threads, each with its own connection, a bare
  ``INSERT`` of the same JSON text with one commit per entry (the same commit
  policy), into a table with the same primary key.

Every process starts at the same moment after connecting; entries/s is what
they stored in the window, over the window. Run:
``.venv/bin/python bench/bench_store_postgres.py`` (``make bench``). Prints a
table; never fails on timing, and says why when no server can be started.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.store import pg_server

PROCS, TASKS, SECONDS = 4, 4, 3.0

STORE_WRITER = """
import sys, time, trio
from kernel.store import PostgresStore, SessionKey

url, proc, sessions, tasks, start, seconds = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), float(sys.argv[5]), float(sys.argv[6])

async def main():
    counts = [0] * tasks
    async with PostgresStore(url, max_connections=tasks) as store:
        await store.list_sessions("p")  # connected and migrated before the start
        await trio.sleep(max(0.0, start - time.time()))
        end = trio.current_time() + seconds
        async def task(t):
            i = 0
            while trio.current_time() < end:
                n = i * tasks + t
                key = SessionKey("p", f"s{(proc * tasks + n) % sessions}")
                await store.append(key, [{"type": "user", "uuid": f"{proc}-{n}", "text": "hello world"}])
                counts[t] += 1
                i += 1
        async with trio.open_nursery() as nursery:
            for t in range(tasks):
                nursery.start_soon(task, t)
    print(sum(counts))

trio.run(main)
"""

BARE_WRITER = """
import json, sys, threading, time
import psycopg

url, proc, sessions, tasks, start, seconds = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), float(sys.argv[5]), float(sys.argv[6])
counts = [0] * tasks

def task(t, conn):
    time.sleep(max(0.0, start - time.time()))
    end = time.monotonic() + seconds
    i = 0
    while time.monotonic() < end:
        n = i * tasks + t
        text = json.dumps({"type": "user", "uuid": f"{proc}-{n}", "text": "hello world"})
        conn.execute(
            "INSERT INTO bare (session_id, seq, uuid, entry) VALUES (%s, %s, %s, %s::json)",
            (f"s{(proc * tasks + n) % sessions}", proc * 10**9 + n, f"{proc}-{n}", text),
        )  # autocommit: one commit per entry, like one append
        counts[t] += 1
        i += 1

conns = [psycopg.connect(url, autocommit=True) for _ in range(tasks)]
threads = [threading.Thread(target=task, args=(t, conns[t])) for t in range(tasks)]
for th in threads:
    th.start()
for th in threads:
    th.join()
print(sum(counts))
"""

BARE_TABLE = """
CREATE TABLE bare (
    session_id text COLLATE "C" NOT NULL, seq bigint NOT NULL, uuid text, entry json NOT NULL,
    PRIMARY KEY (session_id, seq))
"""


def run_writers(code: str, url: str, sessions: int) -> float:
    """Entries/s of PROCS writer processes running ``code`` for SECONDS together."""
    start = time.time() + 2.0  # time for every process to import, connect, migrate
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-c",
                code,
                url,
                str(p),
                str(sessions),
                str(TASKS),
                str(start),
                str(SECONDS),
            ],
            stdout=subprocess.PIPE,
            text=True,
        )
        for p in range(PROCS)
    ]
    total = 0
    for proc in procs:
        out, _ = proc.communicate(timeout=120)
        if proc.returncode != 0:
            raise RuntimeError(f"a writer failed (exit {proc.returncode})")
        total += int(out.split()[-1])
    return total / SECONDS


def main() -> None:
    reason = pg_server.unavailable_reason()
    if reason is not None:
        print(f"bench_store_postgres: skipped: {reason}")
        return
    import psycopg

    with pg_server.running_server(fsync=True) as server:
        print(
            f"bench_store_postgres: PostgresStore vs a bare psycopg INSERT loop, one commit per "
            f"entry, {PROCS} processes x {TASKS} writers, {SECONDS:.0f} s each, same server "
            "(PostgreSQL, fsync on), same run"
        )
        print(f"{'sessions':<10} {'PostgresStore':>16} {'bare INSERT':>16} {'ratio':>7}")
        for sessions in (1, 100):
            ours_url = pg_server.create_database(server, f"store{sessions}")
            bare_url = pg_server.create_database(server, f"bare{sessions}")
            with psycopg.connect(bare_url, autocommit=True) as conn:
                conn.execute(BARE_TABLE)
            ours = run_writers(STORE_WRITER, ours_url, sessions)
            bare = run_writers(BARE_WRITER, bare_url, sessions)
            with psycopg.connect(ours_url) as conn:
                row = conn.execute(
                    "SELECT count(*), count(DISTINCT uuid) FROM tak_entries"
                ).fetchone()
            assert row is not None and row[0] == row[1], "an entry stored twice"
            print(f"{sessions:<10} {ours:>12,.0f} e/s {bare:>12,.0f} e/s {ours / bare:>6.0%}")


if __name__ == "__main__":
    main()
