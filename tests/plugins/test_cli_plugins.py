"""``tak plugins ls`` and ``tak plugins check`` as real subprocesses."""

from __future__ import annotations

import json
import shlex
import shutil
from pathlib import Path

from tests.cli_kit import tak
from tests.plugins.fixture_kit import FIXTURES, fixture_plugin


def test_ls_shows_builtins_workspace_plugins_and_load_errors(tmp_path: Path) -> None:
    # A workspace plugin is skipped until `tak plugins trust` (the command ls prints)
    # approved it; a plugin that crashes on import cannot be approved.
    home = ("--home", str(tmp_path / "home"))
    workspace = tmp_path / "ws"
    folder = workspace / ".tak" / "plugins"
    folder.mkdir(parents=True)
    for name in ("weather", "crash_on_import"):
        shutil.copy(FIXTURES / f"{name}.py", folder)
    listed = tak(*home, "plugins", "ls", "--workspace", str(workspace))
    assert listed.returncode == 0, listed.stderr
    assert "skipped: .tak/plugins/weather.py" in listed.stdout
    assert "not trusted: never approved" in listed.stdout
    command = next(
        line.split("to trust it: ", 1)[1]
        for line in listed.stdout.splitlines()
        if "to trust it:" in line and "weather.py" in line
    )
    words = shlex.split(command)  # runnable as printed: tak, or the venv's when not on PATH
    assert Path(words[0]).name == "tak" and words[1] == "--home"
    trusted = tak(*shlex.split(command)[1:])
    assert trusted.returncode == 0, trusted.stderr
    assert "trusted: weather 1.2.0" in trusted.stdout
    assert "permissions: workspace: read, no network, no subprocess" in trusted.stdout
    crashed = tak(*home, "plugins", "trust", str(folder / "crash_on_import.py"))
    assert crashed.returncode == 2
    assert "RuntimeError: this plugin crashes on import" in crashed.stderr
    result = tak(*home, "plugins", "ls", "--workspace", str(workspace))
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "fs 0.1.0  (built-in)\n" in out and "isolation:   in process" in out
    assert "weather 1.2.0  (.tak/plugins/weather.py)" in out
    assert "tools:       forecast" in out
    assert "skipped: .tak/plugins/crash_on_import.py" in out
    as_json = tak(*home, "plugins", "ls", "--workspace", str(workspace), "--json")
    data = json.loads(as_json.stdout)
    weather = next(p for p in data["plugins"] if p["name"] == "weather")
    assert weather["isolation"].startswith("worker")
    assert weather["permissions"] == "workspace: read, no network, no subprocess"
    called = tak(*home, "call", "forecast", '{"city": "Bergen"}', "--workspace", str(workspace))
    assert called.stdout == "sunny in Bergen\n"
    untrusted = tak(*home, "plugins", "untrust", "weather", "--workspace", str(workspace))
    assert untrusted.returncode == 0, untrusted.stderr
    again = tak(*home, "plugins", "ls", "--workspace", str(workspace), "--json")
    [skipped] = [e for e in json.loads(again.stdout)["errors"] if "weather" in e["source"]]
    assert skipped["trust_command"] == command


def test_check_prints_the_specs_or_why_not() -> None:
    good = tak("plugins", "check", fixture_plugin("weather"))
    assert good.returncode == 0, good.stderr
    assert "weather 1.2.0" in good.stdout
    assert '"name": "forecast"' in good.stdout
    bad = tak("plugins", "check", fixture_plugin("duplicate_tools"))
    assert bad.returncode == 1
    assert "two tools are named 'look'" in bad.stderr


def test_tools_lists_every_builtin_tool_with_its_schema() -> None:
    result = tak("tools", "--format", "openai")
    names = {s["function"]["name"] for s in json.loads(result.stdout)}
    assert {"read_file", "write_file", "edit_file", "list_dir", "glob", "grep"} <= names
    assert {"run_command", "fetch_url", "run_python", "remember", "recall", "forget"} <= names
