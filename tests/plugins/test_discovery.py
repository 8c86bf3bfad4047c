"""Discovery: the ``tak.plugins`` entry points and ``<workspace>/.tak/plugins``."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest

from kernel.home import TakHome
from plugins import ENTRY_POINT_GROUP, discover_plugins, open_plugin_host
from plugins._host import trust_plugin
from tests.plugins.fixture_kit import FIXTURES


def test_entry_points_of_installed_distributions(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    dist = tmp_path / "site" / "tak_weather-1.0.dist-info"
    dist.mkdir(parents=True)
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: tak-weather\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text(f"[{ENTRY_POINT_GROUP}]\nweather = tak_weather:plugin\n")
    monkeypatch.setattr(sys, "path", [str(tmp_path / "site"), *sys.path])
    found = [s for s in discover_plugins(tmp_path) if s.kind == "entry_point"]
    assert [(s.target, s.label) for s in found] == [
        ("tak_weather:plugin", "entry point weather (tak-weather 1.0)")
    ]


async def test_workspace_plugins_load_beside_the_builtins(workspace: Path) -> None:
    # A workspace plugin loads once the user approved it (see tests/security/test_trust.py).
    folder = workspace / ".tak" / "plugins"
    folder.mkdir(parents=True)
    shutil.copy(FIXTURES / "weather.py", folder / "weather.py")
    (folder / "_helper.py").write_text("raise RuntimeError('not a plugin')\n")
    [weather] = [s for s in discover_plugins(workspace) if s.kind == "workspace"]
    await trust_plugin(weather, home=TakHome.locate(), workspace=workspace)
    async with open_plugin_host(workspace) as host:
        names = [p.name for p in host.plugins]
        assert names[0] == "fs" and names[-1] == "weather"
        assert host.plugins[-1].source.label == ".tak/plugins/weather.py"
        assert "forecast" in host.tools
        assert not [e for e in host.errors if "_helper" in e.source.target]
