"""Which store a ``TAK_HOME`` uses: ``[store] url`` or ``$TAK_STORE_URL``, else files."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

from ..home import TakHome, store_request_timeout_s, store_url
from ._file import FileStore
from ._postgres import PostgresStore


def open_store(
    home: TakHome,
    config: Mapping[str, Any],
    *,
    durability: Literal["flush", "fsync"] = "flush",
) -> FileStore | PostgresStore:
    """The store of ``home``: a ``PostgresStore`` when a URL is set, else a ``FileStore``.

    ``config`` is the parsed ``tak.toml`` (``home.read_config().to_toml()``).
    The store connects (or opens files) on first use; close it with
    ``aclose`` or ``async with``.

    Raises:
        UsageError: a bad ``[store]`` section or URL, in one line (a password in
            the URL is masked), or psycopg missing for a PostgreSQL URL.
    """
    url = store_url(config, home.config_file)
    if url is None:
        return FileStore(home.sessions, durability=durability)
    return PostgresStore(url, request_timeout_s=store_request_timeout_s(config, home.config_file))


__all__ = ["open_store"]
