"""Which store a ``TAK_HOME`` uses: ``[store] url`` or ``$TAK_STORE_URL``, else files."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

from ..home import Config, StoreConfig, TakHome, env_store_url
from ._file import FileStore
from ._postgres import PostgresStore


def open_store(
    home: TakHome,
    config: StoreConfig | Mapping[str, Any] | None = None,
    *,
    durability: Literal["flush", "fsync"] = "flush",
) -> FileStore | PostgresStore:
    """The store of ``home``: a ``PostgresStore`` when a URL is set, else a ``FileStore``.

    ``config`` is ``[store]`` of the home's config (``home.read_config().store``);
    ``None`` reads it (blocking I/O). The parsed ``tak.toml`` as a mapping, the form
    this took before, is checked into a ``Config`` first. ``$TAK_STORE_URL`` wins
    over ``[store] url``. The store connects (or opens files) on first use; close
    it with ``aclose`` or ``async with``.

    Raises:
        UsageError: a bad ``[store]`` section or URL, in one line (a password in
            the URL is masked), or psycopg missing for a PostgreSQL URL.
    """
    if config is None:
        section = home.read_config().store
    elif isinstance(config, StoreConfig):
        section = config
    else:
        section = Config.from_toml(config, source=home.config_file).store
    url = env_store_url() or section.url
    if url is None:
        return FileStore(home.sessions, durability=durability)
    return PostgresStore(url, request_timeout_s=section.request_timeout_s)


__all__ = ["open_store"]
