"""Where the kernel keeps its files: ``TAK_HOME`` (default ``~/.tak``).

::

    $TAK_HOME/config/     tak.toml
    $TAK_HOME/data/       sessions and other state
    $TAK_HOME/workspace/  the default workspace for tools and plugins

Code never writes beside itself: everything goes under a ``TakHome``.
"""

from __future__ import annotations

import os
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Final

import attrs

from .errors import UsageError

STORE_URL_ENV = "TAK_STORE_URL"

#: The project a session belongs to when none is named (``data/sessions/<project>/``):
#: the kernel, the CLI and the WebSocket protocol all default to it.
DEFAULT_PROJECT: Final = "default"


@attrs.frozen
class TakHome:
    root: Path

    @classmethod
    def locate(cls, override: str | os.PathLike[str] | None = None) -> TakHome:
        """``override`` (``--home``), else ``$TAK_HOME``, else ``~/.tak``."""
        if override is not None:
            return cls(Path(override).expanduser().absolute())
        env = os.environ.get("TAK_HOME")
        if env:
            return cls(Path(env).expanduser().absolute())
        return cls(Path.home() / ".tak")

    @property
    def config(self) -> Path:
        return self.root / "config"

    @property
    def config_file(self) -> Path:
        """``config/tak.toml``: ``[sandbox] allow_unsandboxed`` and ``[plugins.<name>]``."""
        return self.config / "tak.toml"

    def load_config(self) -> dict[str, Any]:
        """The parsed ``tak.toml`` (empty when there is none).

        Raises:
            UsageError: the file is not valid TOML (the message names it and the line),
                or a setting this module checks is wrong (``[workspace] max_bytes``,
                ``[store] url``).
        """
        try:
            with open(self.config_file, "rb") as f:
                config = tomllib.load(f)
        except FileNotFoundError:
            return {}
        except tomllib.TOMLDecodeError as exc:
            raise UsageError(f"{self.config_file}: {exc}") from None
        workspace_max_bytes(config, self.config_file)  # refused here, at start, not later
        store_url(config, self.config_file)
        return config

    @property
    def data(self) -> Path:
        return self.root / "data"

    @property
    def sessions(self) -> Path:
        return self.data / "sessions"

    @property
    def workspace(self) -> Path:
        return self.root / "workspace"

    def ensure(self) -> TakHome:
        """Create the directories (mode 0700 for the root) and return self."""
        self.root.mkdir(mode=0o700, parents=True, exist_ok=True)
        for d in (self.config, self.data, self.sessions, self.workspace):
            d.mkdir(parents=True, exist_ok=True)
        return self


def workspace_max_bytes(
    config: Mapping[str, Any], source: str | os.PathLike[str] = "tak.toml"
) -> int | None:
    """``[workspace] max_bytes``: the workspace's disk budget, ``None`` when unset.

    Raises:
        UsageError: not a positive integer (one line naming ``source`` and the key).
    """
    section = config.get("workspace", {})
    if not isinstance(section, Mapping):
        raise UsageError(f"{source}: [workspace] must be a table, got {section!r}")
    value = section.get("max_bytes")
    # bool is an int in Python, and a float would be silently truncated: refuse both.
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise UsageError(
            f"{source}: [workspace] max_bytes must be a positive whole number of bytes, "
            f"got {value!r}"
        )
    return value


def store_url(config: Mapping[str, Any], source: str | os.PathLike[str] = "tak.toml") -> str | None:
    """Where sessions live: ``$TAK_STORE_URL``, else ``[store] url``, else ``None`` (files).

    Only the shape is checked here; the store checks the rest of the URL when
    it is created.

    Raises:
        UsageError: ``[store]`` is not a table, has an unknown key, or its ``url``
            (or ``$TAK_STORE_URL``) is not a ``postgresql://`` URL (one line naming
            ``source`` and the key).
    """
    section = config.get("store", {})
    if not isinstance(section, Mapping):
        raise UsageError(f"{source}: [store] must be a table, got {section!r}")
    unknown = sorted(set(section) - {"url"})
    if unknown:
        raise UsageError(f"{source}: [store] has no setting {unknown[0]!r} (known: url)")
    url = section.get("url")
    where = f"{source}: [store] url"
    env = os.environ.get(STORE_URL_ENV)
    if env:
        url, where = env, f"${STORE_URL_ENV}"
    if url is None:
        return None
    if not isinstance(url, str) or not url.startswith(("postgresql://", "postgres://")):
        shown = url.split("://", 1)[0] + "://..." if isinstance(url, str) and "://" in url else url
        raise UsageError(f"{where} must be a postgresql:// URL, got {shown!r}")
    return url
