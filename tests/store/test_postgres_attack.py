"""Attacks on PostgresStore's bounded calls (issue 22, items 7 and 8): settings at
their edges and a user's own socket settings, on a real server (tests/store/pg_server.py).

Each test names the guarantee of kernel/store/_postgres.py it attacks.
"""

from __future__ import annotations

from typing import Any

import pytest

from kernel.store import PostgresStore, SessionKey

KEY = SessionKey("p", "s")


def entry(n: int) -> dict[str, Any]:
    return {"type": "t", "uuid": f"u{n}", "n": n}


def with_query(url: str, query: str) -> str:
    return url + ("&" if "?" in url else "?") + query


@pytest.mark.parametrize("timeout_s", [3e6, 1e9, 1e300])
async def test_a_request_timeout_longer_than_postgres_counts_still_works(
    db_url: str, timeout_s: float
) -> None:
    """10: a ``request_timeout_s`` that is a positive number of seconds but more
    milliseconds than a C int (about 24.8 days) is accepted, so the store works
    with it: the statement timeout and ``tcp_user_timeout`` it sets are at
    PostgreSQL's longest, not a number libpq refuses on every connection."""
    async with PostgresStore(db_url, request_timeout_s=timeout_s) as store:
        await store.append(KEY, [entry(0)])
        assert await store.load(KEY) == [entry(0)]

        def settings(conn: Any) -> tuple[str, str]:
            row = conn.execute("SHOW statement_timeout").fetchone()
            return row[0], conn.info.get_parameters()["tcp_user_timeout"]

        statement, user_timeout = await store.run_in_thread(settings)
        assert user_timeout == str(2**31 - 1)
        assert statement == f"{2**31 - 1}ms"


async def test_the_urls_own_socket_settings_win(db_url: str) -> None:
    """10: keepalives, ``tcp_user_timeout`` and ``connect_timeout`` set in the URL
    are the user's: the store's defaults fill in only what the URL leaves unset
    (psycopg would let them override the URL's silently)."""
    url = with_query(db_url, "keepalives_idle=77&tcp_user_timeout=1234&connect_timeout=3")
    async with PostgresStore(url, request_timeout_s=9) as store:
        params: dict[str, str] = await store.run_in_thread(lambda c: c.info.get_parameters())
    assert params["keepalives_idle"] == "77"
    assert params["tcp_user_timeout"] == "1234"
    assert params["connect_timeout"] == "3"
    # What the URL leaves unset is still the store's.
    assert params["keepalives"] == "1"
    assert params["keepalives_interval"] == "5" and params["keepalives_count"] == "3"


async def test_keepalives_the_url_turns_off_stay_off(db_url: str) -> None:
    """10: ``keepalives=0`` in the URL is the user's choice (the client's deadline
    still bounds every call)."""
    async with PostgresStore(with_query(db_url, "keepalives=0")) as store:
        params: dict[str, str] = await store.run_in_thread(lambda c: c.info.get_parameters())
        await store.append(KEY, [entry(1)])
    assert params["keepalives"] == "0"
    assert params["tcp_user_timeout"] == "30000"
