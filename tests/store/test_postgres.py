"""PostgresStore against a real server the tests start (tests/store/pg_server.py).

The numbers refer to the guarantees in kernel/store/_postgres.py.
"""

from __future__ import annotations

import functools
import itertools
import json
import math
import os
import random
import subprocess
import sys
import textwrap
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kernel.errors import StoreError, UsageError
from kernel.store import PostgresStore, SessionKey
from tests.store import pg_server

from .conformance import MAIN, MakeStore, StoreConformance, entry

_numbers = itertools.count()


class TestPostgresStore(StoreConformance):
    @pytest.fixture
    def make_store(self, db_url: str) -> MakeStore:
        return lambda **options: PostgresStore(db_url, **options)  # type: ignore[return-value]


def psql(url: str, sql: str, *params: Any) -> list[tuple[Any, ...]]:
    import psycopg

    with psycopg.connect(url, autocommit=True) as conn:
        cur = conn.execute(sql, params or None)  # type: ignore[arg-type]
        return cur.fetchall() if cur.description else []


# -- 1, 2: transactions and order --------------------------------------------


async def test_entries_are_numbered_without_gaps_and_read_from_an_index(db_url: str) -> None:
    """2: seq has no gaps, even when uuids are skipped; iter_entries(start=n) is seq >= n."""
    async with PostgresStore(db_url) as store:
        await store.append(MAIN, [entry(0), entry(1)])
        await store.append(MAIN, [entry(1), entry(2), entry(0), entry(3)])
        await store.append(MAIN, [{"type": "note"}])
        seqs = psql(db_url, "SELECT seq FROM tak_entries ORDER BY seq")
        assert [s for (s,) in seqs] == [0, 1, 2, 3, 4]
        assert [e async for e in store.iter_entries(MAIN, start=3)] == [entry(3), {"type": "note"}]
        assert [e async for e in store.iter_entries(MAIN, start=5)] == []
        with pytest.raises(UsageError, match=r"^start"):
            [e async for e in store.iter_entries(MAIN, start=-1)]


async def test_iter_entries_pages_through_long_transcripts(db_url: str) -> None:
    async with PostgresStore(db_url) as store:
        want = [entry(i, i=i) for i in range(1_234)]
        await store.append(MAIN, want)
        assert [e async for e in store.iter_entries(MAIN)] == want
        assert [e async for e in store.iter_entries(MAIN, start=1_000)] == want[1_000:]


KEY = SessionKey("p", "s0")


def e(n: int, **extra: Any) -> dict[str, Any]:
    return {"type": "t", "uuid": f"u{n}", "n": n, **extra}


async def test_pg_iter_entries_start_agrees_with_load_under_concurrent_appends(
    db_url: str,
) -> None:
    """Pages of iter_entries(start=n) (500 rows a query) while two tasks append: what it
    returns lies between a load before and a load after."""
    async with PostgresStore(db_url, max_connections=4) as store:
        await store.append(KEY, [e(i) for i in range(1200)])
        stop = trio.Event()

        async def appender(t: int) -> None:
            i = 0
            while not stop.is_set():
                await store.append(KEY, [e(10_000 * (t + 1) + i + j) for j in range(3)])
                i += 3

        async with trio.open_nursery() as nursery:
            nursery.start_soon(appender, 0)
            nursery.start_soon(appender, 1)
            for n in (0, 1, 499, 500, 1000, 1199):
                before = await store.load(KEY) or []
                middle = [x async for x in store.iter_entries(KEY, start=n)]
                after = await store.load(KEY) or []
                assert middle[: len(before) - n] == before[n:]
                assert after[n : n + len(middle)] == middle
            stop.set()


# -- round trip: json, not jsonb ---------------------------------------------

_json = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**80), max_value=2**80)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=5), inner, max_size=4)
    ),
    max_leaves=12,
)


def _same(a: Any, b: Any) -> bool:
    """Deep equality that also tells 1 from 1.0 and 0.0 from -0.0."""
    if type(a) is not type(b):
        return False
    if isinstance(a, float):
        return a == b and math.copysign(1, a) == math.copysign(1, b)
    if isinstance(a, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict):
        return list(a) == list(b) and all(_same(a[k], b[k]) for k in a)
    return bool(a == b)


async def test_awkward_values_round_trip_exactly(db_url: str) -> None:
    odd = {"type": "t", "nul": "a\u0000b", "big": 1e300, "neg0": -0.0, "one": 1.0, "int": 2**70,
           "z": 1, "a": 2, "dup": {"b": 1, "a": 2}}  # fmt: skip
    async with PostgresStore(db_url) as store:
        await store.append(MAIN, [odd])
        (loaded,) = await store.load(MAIN) or []
        assert _same(loaded, json.loads(json.dumps(odd)))


@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
@given(values=st.lists(_json, min_size=1, max_size=5))
def test_generated_entries_round_trip_exactly(db_url: str, values: list[Any]) -> None:
    entries = [{"type": "t", "v": v} for v in values]

    async def main() -> list[dict[str, Any]] | None:
        async with PostgresStore(db_url) as store:
            key = SessionKey("gen", f"s{next(_numbers)}")
            await store.append(key, entries)
            return await store.load(key)

    loaded = trio.run(main)
    assert loaded is not None
    assert _same(loaded, json.loads(json.dumps(entries, ensure_ascii=False)))


# -- 4: the database clock ---------------------------------------------------


async def test_mtime_comes_from_the_database_clock(db_url: str) -> None:
    """4: without clock=, mtime_ms is the server's clock_timestamp() and strictly grows."""
    async with PostgresStore(db_url) as store:
        seen = []
        for i in range(20):
            await store.append(MAIN, [entry(i)])
            (info,) = await store.list_sessions("proj")
            seen.append(info.mtime_ms)
        ((now,),) = psql(db_url, "SELECT floor(extract(epoch FROM clock_timestamp()) * 1000)")
        assert seen == sorted(set(seen))
        assert now - 60_000 < seen[0] <= now + 20


# -- 6: cancellation ---------------------------------------------------------


async def test_cancel_stops_the_query_on_the_server(db_url: str) -> None:
    """6: a cancelled task cancels its thread's query and waits for the connection back."""
    async with PostgresStore(db_url, max_connections=1) as store:
        await store.list_sessions("proj")  # connected
        with trio.move_on_after(0.3) as scope:
            await store.run_in_thread(lambda conn: conn.execute("SELECT pg_sleep(30)").fetchall())
        assert scope.cancelled_caught
        # The only connection is free again at once: the sleep ended on the server.
        with trio.fail_after(5):
            await store.append(MAIN, [entry(0)])
        rows = psql(
            db_url, "SELECT count(*) FROM pg_stat_activity WHERE query LIKE 'SELECT pg_sleep%'"
        )
        assert rows == [(0,)]


async def test_cancel_is_prompt_while_waiting_for_a_connection(db_url: str) -> None:
    """6: a thread waiting for a connection (here: the pool's only one is taken, as when
    the server is down) stops at once when its task is cancelled; uncancelled, it fails
    with StoreError after connect_timeout_s."""
    async with PostgresStore(db_url, max_connections=1, connect_timeout_s=0.5) as store:
        await store.append(MAIN, [entry(0)])
        pool = store._pool
        assert pool is not None
        held = await trio.to_thread.run_sync(pool.getconn)
        try:
            # Cancelled before connect_timeout_s: the cancel is what ends the wait (it
            # arrives first, so the StoreError of the timeout cannot be what is seen).
            with trio.move_on_after(0.2) as scope:
                await store.append(MAIN, [entry(1)])
            assert scope.cancelled_caught
            with pytest.raises(
                StoreError, match=r"^PostgreSQL [^ ]+ unreachable: no connection within 0.5 s$"
            ):
                await store.append(MAIN, [entry(2)])
        finally:
            await trio.to_thread.run_sync(pool.putconn, held)
        with trio.fail_after(5):
            await store.append(MAIN, [entry(3)])
        assert [e["uuid"] for e in await store.load(MAIN) or []] == ["u0", "u3"]


async def test_cancel_is_prompt_while_connecting_to_a_silent_host() -> None:
    """6: the first connection, to a host that accepts TCP and never answers, is
    abandoned at once on cancel; uncancelled, it fails after libpq's connect_timeout."""
    listener = trio.socket.socket()
    await listener.bind(("127.0.0.1", 0))
    listener.listen(8)  # never accepted: the kernel completes the handshake, nobody speaks
    port = listener.getsockname()[1]
    try:
        url = f"postgresql://tak@127.0.0.1:{port}/silent"
        async with PostgresStore(url, connect_timeout_s=0.5) as store:
            with trio.move_on_after(0.2) as scope:  # before libpq's own timeout
                await store.list_sessions("p")
            assert scope.cancelled_caught  # the cancel ended it, not a StoreError
            with trio.fail_after(10), pytest.raises(StoreError, match=r"^PostgreSQL 127.0.0.1:"):
                await store.list_sessions("p")
    finally:
        listener.close()


@pytest.mark.parametrize("bad", [0, -1.0, math.inf, math.nan, True, "5"])
def test_connect_timeout_must_be_a_positive_number(bad: Any) -> None:
    with pytest.raises(UsageError, match=r"^connect_timeout_s: expected a positive number"):
        PostgresStore("postgresql://h/db", connect_timeout_s=bad)


async def test_statement_timeout_bounds_a_query(db_url: str) -> None:
    """6: a statement running longer than statement_timeout_s fails with StoreError."""
    async with PostgresStore(db_url, statement_timeout_s=0.2) as store:
        with trio.fail_after(10), pytest.raises(StoreError, match="statement timeout"):
            await store.run_in_thread(lambda conn: conn.execute("SELECT pg_sleep(5)").fetchall())


REPO = str(Path(__file__).parents[2])


ENV = dict(os.environ, PYTHONPATH=REPO)


async def test_pg_cancelled_appends_store_all_or_nothing_and_free_the_connection(
    db_url: str,
) -> None:
    """Appends cancelled at random moments: one that raised Cancelled stored nothing,
    one that returned stored all; the only connection is free again each time."""
    rng = random.Random(3)
    async with PostgresStore(db_url, max_connections=1) as store:
        await store.list_sessions("p")
        # Deadlines around what one append takes on this machine now (a loaded CI
        # runner is slower), so that some appends finish and some are cancelled.
        started = trio.current_time()
        warm = [e(-1000 - j, b=-1, pad="z" * 4000) for j in range(200)]
        await store.append(SessionKey("p", "warm"), warm)
        full = trio.current_time() - started
        outcomes: dict[int, bool] = {}
        for n in range(40):
            batch = [e(n * 1000 + j, b=n, pad="z" * 4000) for j in range(200)]
            returned = False
            with trio.move_on_after(rng.uniform(0, 2 * full)):
                await store.append(KEY, batch)
                returned = True
            outcomes[n] = returned
        with trio.fail_after(5):
            await store.append(KEY, [e(-1)])
        stored = Counter(x.get("b") for x in await store.load(KEY) or [])
        for n, returned in outcomes.items():
            assert stored.get(n, 0) == (200 if returned else 0), (n, returned, stored.get(n))
        assert 0 < sum(outcomes.values()) < len(outcomes)  # both kinds happened
        rows = await store.run_in_thread(
            lambda c: c.execute(
                "SELECT count(*) FROM pg_stat_activity WHERE state LIKE 'idle in transaction%'"
            ).fetchall()
        )
        assert rows == [(0,)]


@pytest.fixture
def own_server(pg_to_break: pg_server.PgServer) -> pg_server.PgServer:
    """A server other tests do not use, to kill (running again after the test)."""
    return pg_to_break


def test_pg_cancel_is_prompt_while_the_server_is_down(own_server: pg_server.PgServer) -> None:
    # In a child process: the wait is not interruptible, the test must not sit it out.
    child = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(CANCEL_WHILE_DOWN), own_server.url()],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=ENV,
    )
    try:
        assert child.stdin is not None and child.stdout is not None
        assert child.stdout.readline().strip() == "appended"
        pg_server.stop(own_server, "immediate")
        child.stdin.write("go\n")
        child.stdin.flush()
        try:
            out, _ = child.communicate(timeout=6)
        except subprocess.TimeoutExpired:
            pytest.fail("an append cancelled after 1 s had not returned after 6 s")
        assert child.returncode == 0 and out.strip() == "prompt", out
    finally:
        child.kill()
        child.wait()


CANCEL_WHILE_DOWN = """
    import sys, time, trio
    from kernel.errors import StoreError
    from kernel.store import PostgresStore, SessionKey
    key = SessionKey("p", "s0")
    async def main():
        async with PostgresStore(sys.argv[1], max_connections=1) as store:
            await store.append(key, [{"type": "t", "uuid": "u0"}])
            print("appended", flush=True)
            await trio.to_thread.run_sync(sys.stdin.readline)  # the server is killed
            try:
                await store.append(key, [{"type": "t", "uuid": "u1"}])
            except StoreError:
                pass  # the broken connection: an error at once
            t0 = time.monotonic()
            with trio.move_on_after(1):
                await store.append(key, [{"type": "t", "uuid": "u2"}])
            print("prompt" if time.monotonic() - t0 < 3 else "slow", flush=True)
    trio.run(main)
"""


# -- 8: schema versions ------------------------------------------------------


async def test_schema_is_applied_once_by_processes_starting_together(db_url: str) -> None:
    """8: eight stores opening at once apply version 1 once; a newer schema is refused."""
    stores = [PostgresStore(db_url) for _ in range(8)]
    async with trio.open_nursery() as nursery:
        for i, store in enumerate(stores):
            nursery.start_soon(store.append, SessionKey("p", f"s{i}"), [entry(0)])
    for store in stores:
        await store.aclose()
    assert psql(db_url, "SELECT version FROM tak_schema_version") == [(1,)]
    psql(db_url, "INSERT INTO tak_schema_version (version) VALUES (99)")
    async with PostgresStore(db_url) as store:
        with pytest.raises(StoreError, match="schema version 99 is newer"):
            await store.list_sessions("p")


# -- urls and errors ---------------------------------------------------------


@pytest.mark.parametrize(
    ("url", "match"),
    [
        ("mysql://x/y", "expected postgresql://"),
        (
            "postgresql://u:hunter2@h:notaport/db",
            r"^store url 'postgresql://u:\*\*\*@h.*port 'notaport'",
        ),
        ("postgresql://u:hunter2@h/db?bogus=1", 'invalid URI query parameter: "bogus"'),
        ("postgresql://u:hunter2@[::1/db", r"matching \"]\""),
        (3, "expected postgresql://"),
    ],
)
def test_bad_urls_are_refused_in_one_line(url: Any, match: str) -> None:
    with pytest.raises(UsageError, match=match) as info:
        PostgresStore(url)
    assert "\n" not in str(info.value)
    assert "hunter2" not in str(info.value)


async def test_unreachable_server_is_a_store_error(pg: pg_server.PgServer) -> None:
    async with PostgresStore(f"postgresql://postgres@127.0.0.1:{pg.port}/no_such_db") as store:
        with pytest.raises(StoreError, match=r"^PostgreSQL 127.0.0.1:\d+/no_such_db: .*no_such_db"):
            await store.load(MAIN)


# -- many processes ----------------------------------------------------------

WRITER = """
import sys, trio
from kernel.store import PostgresStore, SessionKey

url, proc, sessions, per_task, tasks = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])

async def main():
    async with PostgresStore(url, max_connections=tasks) as store:
        async def task(t):
            for i in range(per_task):
                n = i * tasks + t
                key = SessionKey("p", f"s{n % sessions}")
                size = 1 + n % 3
                batch = [{"type": "t", "uuid": f"{proc}-{n}-{j}", "proc": proc, "n": n, "size": size}
                         for j in range(size)]
                await store.append(key, batch)
                sys.stdout.write(f"{n}\\n")  # no checkpoint since append returned
                sys.stdout.flush()
                if n % 5 == 0:  # a retry of an acknowledged append adds nothing
                    await store.append(key, batch)
        async with trio.open_nursery() as nursery:
            for t in range(tasks):
                nursery.start_soon(task, t)

trio.run(main)
"""


def _check_stored(
    stored: dict[str, list[dict[str, Any]]], acked: dict[int, list[int]], sessions: int
) -> int:
    """0 lost, 0 duplicated, whole batches, per-session order = each process's ack order."""
    total = 0
    for sid, entries in stored.items():
        uuids = [e["uuid"] for e in entries]
        assert len(uuids) == len(set(uuids)), f"{sid}: an entry stored twice"
        total += len(entries)
        batches: dict[tuple[int, int], int] = {}
        for e in entries:
            assert f"s{e['n'] % sessions}" == sid, "stored under the wrong key"
            batches[(e["proc"], e["n"])] = batches.get((e["proc"], e["n"]), 0) + 1
        for (proc, n), count in batches.items():
            assert count == 1 + n % 3, f"batch {proc}-{n} half stored"
        for proc in acked:
            mine = [n for n in acked[proc] if f"s{n % sessions}" == sid]
            in_store = list(dict.fromkeys(e["n"] for e in entries if e["proc"] == proc))
            # Acknowledged ones in ack order, then at most the one in flight at a kill.
            assert in_store[: len(mine)] == mine, f"{sid}: proc {proc} out of ack order"
            assert len(in_store) - len(mine) <= 1
    return total


async def _load_all(url: str, sessions: int) -> dict[str, list[dict[str, Any]]]:
    async with PostgresStore(url) as store:
        out = {}
        for sid in range(sessions):
            key = SessionKey("p", f"s{sid}")
            out[key.session_id] = await store.load(key) or []
            (summary,) = [
                s for s in await store.list_session_summaries("p") if s.session_id == key.session_id
            ] or [None]
            if out[key.session_id]:
                assert summary is not None
                assert summary.data.entry_count == len(out[key.session_id])
        return out


async def _run_writer(args: list[str]) -> bytes:
    done = await trio.run_process(
        [sys.executable, "-c", WRITER, *args], capture_stdout=True, capture_stderr=True
    )
    return done.stdout


@pytest.mark.parametrize("sessions", [1, 100])
async def test_four_processes_lose_and_duplicate_nothing(
    db_url: str, sessions: int, stress: bool
) -> None:
    """1-3: 4 OS processes x 4 tasks append to 1 or 100 sessions at once."""
    per_task = (1_000 if stress else 60) if sessions == 1 else (400 if stress else 50)
    procs, tasks = 4, 4
    outputs: dict[int, bytes] = {}

    async def writer(proc: int) -> None:
        outputs[proc] = await _run_writer(
            [db_url, str(proc), str(sessions), str(per_task), str(tasks)]
        )

    async with trio.open_nursery() as nursery:
        for proc in range(procs):
            nursery.start_soon(writer, proc)
    acked = {p: [int(x) for x in out.split()] for p, out in outputs.items()}
    assert all(len(a) == per_task * tasks for a in acked.values())
    stored = await _load_all(db_url, sessions)
    total = _check_stored(stored, acked, sessions)
    assert total == procs * sum(1 + n % 3 for n in range(per_task * tasks))


async def test_kill_9_loses_no_acknowledged_append(db_url: str, stress: bool) -> None:
    """1: writers SIGKILLed at random moments: every acknowledged batch stored once, whole."""
    rng = random.Random()
    rounds, sessions = (30 if stress else 6), 3
    acked: dict[int, list[int]] = {}
    for round_ in range(rounds):
        proc = await trio.lowlevel.open_process(
            [sys.executable, "-c", WRITER, db_url, str(round_), str(sessions), "100000", "3"],
            stdout=subprocess.PIPE,
        )
        assert proc.stdout is not None
        out = b""
        try:
            while out.count(b"\n") < rng.randint(1, 40):
                chunk = await proc.stdout.receive_some()
                if not chunk:
                    break
                out += chunk
            await trio.sleep(rng.uniform(0, 0.02))
        finally:
            proc.kill()
            await proc.wait()
        while chunk := await proc.stdout.receive_some():
            out += chunk
        await proc.stdout.aclose()
        acked[round_] = [int(x) for x in out.split(b"\n")[:-1]]
    stored = await _load_all(db_url, sessions)
    _check_stored(stored, acked, sessions)
    assert sum(len(a) for a in acked.values()) > rounds  # the kills landed while appending


SAME_UUIDS = """
import sys, trio
from kernel.store import PostgresStore, SessionKey
async def main():
    async with PostgresStore(sys.argv[1], max_connections=2) as store:
        key = SessionKey("p", "s0")
        async def task(t):
            for n in range(t, 300, 2):
                await store.append(key, [{"type": "t", "uuid": f"u-{n}-{j}", "n": n}
                                         for j in range(1 + n % 3)])
        async with trio.open_nursery() as nursery:
            for t in range(2):
                nursery.start_soon(task, t)
trio.run(main)
"""


async def test_pg_same_uuids_from_two_processes_at_once_are_stored_once(db_url: str) -> None:
    """Two processes append the same uuids to a session that does not exist yet (both
    create its row): no error, every entry once, in seq order without gaps."""
    async with trio.open_nursery() as nursery:
        for _ in range(2):
            nursery.start_soon(
                functools.partial(
                    trio.run_process, [sys.executable, "-c", SAME_UUIDS, db_url], env=ENV
                )
            )
    async with PostgresStore(db_url) as store:
        entries = await store.load(KEY) or []
        (summary,) = await store.list_session_summaries("p")
    uuids = Counter(x["uuid"] for x in entries)
    assert len(uuids) == sum(1 + n % 3 for n in range(300))
    assert max(uuids.values()) == 1
    assert summary.data.entry_count == len(entries)


# -- choosing the store ------------------------------------------------------


def test_open_store_follows_the_config_and_the_environment(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    from kernel.home import TakHome
    from kernel.store import FileStore, open_store

    monkeypatch.delenv("TAK_STORE_URL", raising=False)
    home = TakHome(tmp_path)
    assert isinstance(open_store(home, {}), FileStore)
    url = "postgresql://tak@db.example:5433/tak"
    assert (
        repr(open_store(home, {"store": {"url": url}}))
        == "PostgresStore(PostgreSQL db.example:5433/tak)"
    )
    monkeypatch.setenv("TAK_STORE_URL", "postgresql://tak@other/x")
    assert repr(open_store(home, {})) == "PostgresStore(PostgreSQL other:5432/x)"
    monkeypatch.setenv("TAK_STORE_URL", "sqlite:///x")
    with pytest.raises(UsageError, match=r"^\$TAK_STORE_URL: expected a postgresql:// URL"):
        open_store(home, {})
    monkeypatch.delenv("TAK_STORE_URL")
    for bad, match in [
        # checked as tak.toml is (Config): one rule, in its words
        ({"store": "x"}, r"tak.toml: \$.store: expected a table"),
        ({"store": {"path": "x"}}, r"tak.toml: \$.store: unknown setting 'path'"),
        ({"store": {"url": 5}}, r"tak.toml: \$.store.url: expected a string, got 5"),
        ({"store": {"url": "sqlite:///x"}}, r"tak.toml: \$.store.url: .*postgresql://"),
        ({"store": {"url": "postgresql://u:pw@h:99999/d"}}, r"port '99999' is not a port number"),
    ]:
        with pytest.raises(UsageError, match=match) as info:
            open_store(home, bad)
        assert "\n" not in str(info.value) and "pw" not in str(info.value)


def test_request_timeout_comes_from_tak_toml_and_is_checked_there(tmp_path: Any) -> None:
    """10: ``[store] request_timeout_s`` bounds every call of the store tak.toml makes
    (30 s when unset); a value that is no positive number of seconds is refused at
    start, in one line naming the file and the setting, by both readers of tak.toml."""
    from kernel.home import Config, TakHome
    from kernel.store import open_store

    home = TakHome(tmp_path)
    url = "postgresql://tak@db.example/tak"
    store = open_store(home, {"store": {"url": url, "request_timeout_s": 4.5}})
    assert isinstance(store, PostgresStore) and store._request_timeout_s == 4.5
    store = open_store(home, {"store": {"url": url}})
    assert isinstance(store, PostgresStore) and store._request_timeout_s == 30.0
    assert Config.from_toml({"store": {"request_timeout_s": 2}}).store.request_timeout_s == 2.0
    for bad in (0, -1, True, "5", float("inf"), float("nan")):
        with pytest.raises(UsageError) as info:
            open_store(home, {"store": {"url": url, "request_timeout_s": bad}})
        assert str(info.value).startswith(
            f"{home.config_file}: $.store.request_timeout_s: expected a "
        )
        with pytest.raises(UsageError) as parsed:
            Config.from_toml({"store": {"request_timeout_s": bad}})
        assert str(parsed.value).startswith("tak.toml: $.store.request_timeout_s: expected ")
        assert "\n" not in str(info.value) + str(parsed.value)
    config = tmp_path / "config"
    config.mkdir()
    (config / "tak.toml").write_text("[store]\nrequest_timeout_s = 0\n")
    with pytest.raises(UsageError, match=r"tak.toml: \$.store.request_timeout_s: expected"):
        home.load_config()


@pytest.mark.parametrize("bad", [0, -1.0, True, "30", math.inf])
def test_request_timeout_must_be_a_positive_number(bad: Any) -> None:
    with pytest.raises(UsageError, match=r"^request_timeout_s: expected a positive number"):
        PostgresStore("postgresql://tak@db/tak", request_timeout_s=bad)


async def test_a_kernel_keeps_its_sessions_in_postgres(
    db_url: str, tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    from kernel import open_kernel
    from kernel.messages import Message, Text

    monkeypatch.delenv("TAK_STORE_URL", raising=False)
    (tmp_path / "config").mkdir()
    (tmp_path / "config" / "tak.toml").write_text(f'[store]\nurl = "{db_url}"\n')
    async with open_kernel(home=tmp_path, plugins=[]) as kernel:
        assert isinstance(kernel.store, PostgresStore)
        chat = kernel.session("chat-1")
        await chat.append(Message("user", [Text("hello")]))
    async with PostgresStore(db_url) as store:
        assert [s.session_id for s in await store.list_sessions("default")] == ["chat-1"]


def test_psycopg_loads_only_when_a_postgres_store_is_made() -> None:
    code = (
        "import sys, kernel, kernel.store; from kernel import open_kernel;"
        "print(any(m.startswith('psycopg') for m in sys.modules));"
        "kernel.store.PostgresStore('postgresql://x@h/d');"
        "print(any(m.startswith('psycopg') for m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "True"]


def test_tak_sessions_works_on_postgres(
    db_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`tak sessions ls | show | rm` use the store tak.toml (here TAK_STORE_URL) selects."""
    from kernel.cli import main as tak_main
    from kernel.messages import Message, Text
    from kernel.session import Session

    async def seed() -> None:
        async with PostgresStore(db_url) as store:
            session = Session(store, SessionKey("default", "pg-chat"))
            await session.set_title("Kept in PostgreSQL")
            await session.append(Message("user", [Text("hello from postgres")]))

    trio.run(seed)
    monkeypatch.setenv("TAK_STORE_URL", db_url)
    home = str(tmp_path / "home")
    assert tak_main(["--home", home, "sessions", "ls"]) == 0
    out = capsys.readouterr().out
    assert "pg-chat" in out and "Kept in PostgreSQL" in out
    assert tak_main(["--home", home, "sessions", "show", "pg-chat"]) == 0
    assert "hello from postgres" in capsys.readouterr().out
    assert tak_main(["--home", home, "sessions", "repair", "pg-chat"]) == 2
    assert "repair applies to the file store" in capsys.readouterr().err
    assert tak_main(["--home", home, "sessions", "rm", "pg-chat"]) == 0
    assert "removed default/pg-chat" in capsys.readouterr().out
    assert tak_main(["--home", home, "sessions", "ls"]) == 0
    assert "pg-chat" not in capsys.readouterr().out
