"""Typed config sections at their edges: ``$TAK_STORE_URL`` over any section, and the
older mapping form refused where tak.toml would refuse it."""

from __future__ import annotations

from pathlib import Path

import pytest

from kernel.errors import UsageError
from kernel.home import Config, StoreConfig, TakHome
from kernel.store import FileStore, open_store


def test_open_store_takes_the_environment_url_over_any_section(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    home = TakHome.locate(tmp_path)
    monkeypatch.setenv("TAK_STORE_URL", "")  # empty: unset
    assert isinstance(open_store(home, StoreConfig()), FileStore)
    monkeypatch.setenv("TAK_STORE_URL", "postgresql://u:hunter2@db.example/tak")
    shown = repr(open_store(home, StoreConfig(url="postgresql://other/x")))
    assert "db.example" in shown and "hunter2" not in shown
    monkeypatch.setenv("TAK_STORE_URL", "sqlite:///x:hunter2")
    with pytest.raises(UsageError, match=r"\$TAK_STORE_URL: expected a postgresql://") as bad:
        open_store(home, StoreConfig())
    assert "hunter2" not in str(bad.value)
    monkeypatch.setenv("TAK_STORE_URL", " ")
    with pytest.raises(UsageError, match=r"\$TAK_STORE_URL"):
        open_store(home, {"store": {}})


def test_a_mapping_with_a_section_tak_toml_lacks_is_refused_now(tmp_path: Path) -> None:
    """The old mapping form only had its [store] read; now every section is checked
    (a caller that passed its own extra keys gets a one-line refusal)."""
    home = TakHome.locate(tmp_path)
    with pytest.raises(UsageError, match=r"\$: unknown setting 'mine'"):
        open_store(home, {"store": {}, "mine": {"x": 1}})
    assert isinstance(open_store(home, Config.from_toml({"store": {}}).store), FileStore)
