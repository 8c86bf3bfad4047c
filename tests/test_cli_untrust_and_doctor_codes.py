"""Two answers of the exit-code rule (docs/cli.md): a name that names no approval and
a ``--workspace`` that is not a directory are bad input (2), in every command."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from kernel.cli import main
from tests.plugins.fixture_kit import FIXTURES


def test_plugins_untrust_of_a_name_never_trusted_is_bad_input(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # discovered (a .tak/plugins file) but never approved: nothing to withdraw
    workspace = tmp_path / "ws"
    (workspace / ".tak" / "plugins").mkdir(parents=True)
    shutil.copy(FIXTURES / "weather.py", workspace / ".tak" / "plugins" / "weather.py")
    argv = ["--home", str(tmp_path / "home"), "plugins", "untrust", "weather"]
    code = main([*argv, "--workspace", str(workspace)])
    assert code == 2
    assert capsys.readouterr().err.strip().endswith("weather was not trusted")


def test_doctor_refuses_a_workspace_that_is_not_a_directory(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code = main(["--home", str(tmp_path / "home"), "doctor", "--workspace", str(tmp_path / "no")])
    assert code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "not a directory" in err, err
