"""The tests see no ``tak.plugins`` entry point installed in the environment
(tests/entry_points_kit.py), in this process and in the ``tak`` they start; a test
asks for them with ``SHOW_INSTALLED_ENV``."""

from __future__ import annotations

import json
import shutil
import site
from collections.abc import Iterator
from pathlib import Path

import pytest

from plugins import discover_plugins
from tests.cli_kit import tak
from tests.entry_points_kit import SHOW_INSTALLED_ENV

NAME = "tak_test_installed_entry_point"


@pytest.fixture
def installed(tmp_path: Path) -> Iterator[str]:
    """A distribution with a ``tak.plugins`` entry point, in the venv's site-packages
    (as ``pip install -e`` of a plugin leaves it)."""
    dist = Path(site.getsitepackages()[0]) / f"{NAME}-1.0.dist-info"
    dist.mkdir()
    try:
        (dist / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {NAME}\nVersion: 1.0\n")
        (dist / "entry_points.txt").write_text(f"[tak.plugins]\n{NAME} = {NAME}:plugin\n")
        yield NAME
    finally:
        shutil.rmtree(dist)


def _entry_points(workspace: Path) -> list[str]:
    return [s.name for s in discover_plugins(workspace) if s.kind == "entry_point"]


def test_this_process_does_not_see_them(
    installed: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert installed not in _entry_points(tmp_path)
    monkeypatch.setenv(SHOW_INSTALLED_ENV, "1")
    assert installed in _entry_points(tmp_path)


def test_a_tak_subprocess_does_not_see_them(installed: str, tmp_path: Path) -> None:
    def listed(**env: str) -> str:
        result = tak("plugins", "ls", "--json", home=tmp_path / "home", env=env)
        assert result.returncode == 0, result.stderr
        return result.stdout

    assert installed not in listed()
    assert installed in listed(**{SHOW_INSTALLED_ENV: "1"})
    json.loads(listed())  # still the whole listing


def test_those_a_test_makes_itself_are_seen(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    dist = tmp_path / "site" / f"{NAME}-1.0.dist-info"
    dist.mkdir(parents=True)
    (dist / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {NAME}\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text(f"[tak.plugins]\n{NAME} = {NAME}:plugin\n")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    assert _entry_points(tmp_path) == [NAME]
