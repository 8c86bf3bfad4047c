"""``tak plugins new`` round trip, and the example made with it."""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
from pathlib import Path

from tests.cli_kit import tak
from tests.entry_points_kit import SHOW_INSTALLED_ENV

#: This test installs a plugin into the environment on purpose, and looks for it.
SEE_INSTALLED = {SHOW_INSTALLED_ENV: "1"}

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "hello_plugin"


def pip(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "pip", *args], capture_output=True, text=True, timeout=300
    )


def install_editable(project: Path) -> None:
    # the test extras bring setuptools >= 70.1, which builds editables in place
    done = pip("install", "--no-deps", "--no-build-isolation", "-e", str(project))
    assert done.returncode == 0, done.stdout + done.stderr


def test_new_install_list_call_and_its_own_test(tmp_path: Path) -> None:
    home = tmp_path / "home"
    made = tak("plugins", "new", "tak-roundtrip", cwd=tmp_path)
    assert made.returncode == 0, made.stderr
    project = tmp_path / "tak-roundtrip"
    assert {p.name for p in project.iterdir()} >= {"pyproject.toml", "README.md", "tests"}
    checked = tak("plugins", "check", str(project))
    assert checked.returncode == 0, checked.stderr
    assert '"name": "greet"' in checked.stdout
    install_editable(project)
    try:
        # An installed entry point is skipped until approved, with the command to do so.
        untrusted = tak("plugins", "ls", "--json", home=home, env=SEE_INSTALLED)
        [skipped] = [
            e for e in json.loads(untrusted.stdout)["errors"] if "tak-roundtrip" in e["source"]
        ]
        assert skipped["reason"].startswith("not trusted: never approved")
        words = shlex.split(skipped["trust_command"])  # tak, or the venv's when not on PATH
        assert Path(words[0]).name == "tak"
        assert words[1:] == ["--home", str(home), "plugins", "trust", "tak-roundtrip"]
        trusted = tak("plugins", "trust", "tak-roundtrip", home=home, env=SEE_INSTALLED)
        assert trusted.returncode == 0, trusted.stderr
        assert "trusted: tak-roundtrip 0.1.0" in trusted.stdout
        listed = tak("plugins", "ls", "--json", home=home, env=SEE_INSTALLED)
        assert listed.returncode == 0, listed.stderr
        plugin = next(
            p for p in json.loads(listed.stdout)["plugins"] if p["name"] == "tak-roundtrip"
        )
        assert plugin["tools"] == {"greet": "greet"}
        assert plugin["source"].startswith("entry point tak-roundtrip")
        called = tak("call", "greet", '{"name": "Ada", "times": 2}', home=home, env=SEE_INSTALLED)
        assert (called.returncode, called.stdout) == (0, "Hello, Ada! Hello, Ada!\n")
        module = project / "tak_roundtrip" / "__init__.py"
        module.write_text(module.read_text() + "\n# edited\n")
        edited = tak("plugins", "ls", "--json", home=home, env=SEE_INSTALLED)
        [changed] = [
            e for e in json.loads(edited.stdout)["errors"] if "tak-roundtrip" in e["source"]
        ]
        assert changed["reason"].startswith("not trusted: changed since it was approved")
        tested = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"],
            cwd=project,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert tested.returncode == 0, tested.stdout + tested.stderr
    finally:
        pip("uninstall", "-y", "tak-roundtrip")


def test_new_refuses_a_directory_in_use(tmp_path: Path) -> None:
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "file").write_text("x")
    result = tak("plugins", "new", "taken", cwd=tmp_path)
    assert result.returncode == 2 and "not empty" in result.stderr


def test_the_hello_plugin_example_passes_its_own_tests() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"],
        cwd=EXAMPLE,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "4 passed" in result.stdout
