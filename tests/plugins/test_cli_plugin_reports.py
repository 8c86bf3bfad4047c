"""What ``tak`` says about plugins, as a new user meets it (issue 22, item 12).

- A discovered plugin not approved yet is told where it matters (``tak plugins
  ls``, ``tak doctor``), never as a line on every other command.
- ``tak plugins check`` of a missing or broken file says why in one line; the
  worker's traceback only with ``tak --debug``.
- ``tak plugins trust`` shows the tool names it grants; the trust command ``ls``
  suggests is quoted once for the shell, and said not pasteable when a file's
  name holds control characters.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from pathlib import Path

TAK = str(Path(sys.executable).with_name("tak"))

HELPER = '''
from kernel import Plugin
plugin = Plugin("helper", version="1.0", description="Harmless.")

@plugin.tool
def hello(name: str) -> str:
    """Say hello."""
    return f"hello {name}"
'''


def tak(
    *words: str, home: Path, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    full = {k: v for k, v in os.environ.items() if k != "TAK_HOME"} | (env or {})
    return subprocess.run(
        [TAK, "--home", str(home), *words], capture_output=True, text=True, timeout=120, env=full
    )


def installed_package(tmp_path: Path) -> dict[str, str]:
    """A distribution with a ``tak.plugins`` entry point, importable through
    PYTHONPATH: an installed plugin nobody approved yet."""
    site = tmp_path / "site"
    dist = site / "tak_helper-1.0.dist-info"
    dist.mkdir(parents=True)
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: tak-helper\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text("[tak.plugins]\nhelper = tak_helper:plugin\n")
    (site / "tak_helper.py").write_text(HELPER)
    return {"PYTHONPATH": str(site)}


def test_an_unapproved_installed_plugin_is_told_by_ls_and_doctor_only(tmp_path: Path) -> None:
    env = installed_package(tmp_path)
    home = tmp_path / "home"
    for words in (("tools",), ("call", "list_dir", '{"path": "."}')):
        quiet = tak(*words, home=home, env=env)
        assert quiet.returncode == 0, quiet.stderr
        assert "helper" not in quiet.stderr and "trust" not in quiet.stderr, quiet.stderr
    listed = tak("plugins", "ls", home=home, env=env)
    assert "skipped: entry point helper (tak-helper 1.0)" in listed.stdout
    assert "plugins trust helper" in listed.stdout
    doctor = tak("doctor", "--no-selftest", home=home, env=env)
    assert (
        "plugin not loaded: entry point helper (tak-helper 1.0) (never approved)" in doctor.stdout
    )
    [hint] = [line for line in doctor.stdout.splitlines() if "to trust it:" in line]
    assert shlex.split(hint.partition("to trust it:")[2])[-3:] == ["plugins", "trust", "helper"]


def test_plugins_check_of_a_missing_file_is_one_line(tmp_path: Path) -> None:
    result = tak("plugins", "check", str(tmp_path / "nope.py"), home=tmp_path / "home")
    assert result.returncode == 2
    assert result.stderr.splitlines() == [
        f"tak plugins check: {tmp_path / 'nope.py'}: no such file or directory"
    ]


def test_plugins_check_of_a_broken_file_is_one_line_and_its_traceback_asked_for(
    tmp_path: Path,
) -> None:
    broken = tmp_path / "broken.py"
    broken.write_text("import a_module_that_is_not_there\n")
    result = tak("plugins", "check", str(broken), home=tmp_path / "home")
    assert result.returncode == 1
    [line] = result.stderr.splitlines()
    assert line.startswith("tak plugins check: ") and "a_module_that_is_not_there" in line
    debug = tak("--debug", "plugins", "check", str(broken), home=tmp_path / "home")
    assert debug.returncode == 1 and "Traceback" in debug.stderr


def test_trust_shows_the_tool_names_it_grants(tmp_path: Path) -> None:
    folder = tmp_path / "ws" / ".tak" / "plugins"
    folder.mkdir(parents=True)
    (folder / "helper.py").write_text(HELPER)
    result = tak("plugins", "trust", str(folder / "helper.py"), home=tmp_path / "home")
    assert result.returncode == 0, result.stderr
    assert "  tools:       hello" in result.stdout.splitlines()


def test_the_suggested_trust_command_is_quoted_once_and_works(tmp_path: Path) -> None:
    workspace = tmp_path / "ws"
    folder = workspace / ".tak" / "plugins"
    folder.mkdir(parents=True)
    (folder / "it's mine.py").write_text(HELPER)
    home = tmp_path / "home"
    listed = tak("plugins", "ls", "--workspace", str(workspace), home=home)
    [hint] = [line for line in listed.stdout.splitlines() if "to trust it:" in line]
    words = shlex.split(hint.partition("to trust it:")[2])
    assert words[-1] == str(folder / "it's mine.py")
    pasted = subprocess.run(words, capture_output=True, text=True, timeout=120)
    assert pasted.returncode == 0, pasted.stderr
    assert "trusted: helper 1.0" in pasted.stdout


def test_a_hostile_file_name_is_escaped_and_its_command_not_pasteable(tmp_path: Path) -> None:
    workspace = tmp_path / "ws"
    folder = workspace / ".tak" / "plugins"
    folder.mkdir(parents=True)
    (folder / "x\ntrusted: evil 1.0\x1b[8m.py").write_text(HELPER)
    listed = tak("plugins", "ls", "--workspace", str(workspace), home=tmp_path / "home")
    assert listed.returncode == 0, listed.stderr
    assert "\x1b" not in listed.stdout
    assert not [line for line in listed.stdout.splitlines() if line.startswith("trusted:")]
    [hint] = [line for line in listed.stdout.splitlines() if "to trust it:" in line]
    assert "not pasteable" in hint
