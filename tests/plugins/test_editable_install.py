"""An editable install (``pip install -e .``, the README's way) does not refuse every workspace.

setuptools' editable install appends ``__editable__.NAME.finder.__path_hook__`` to
``sys.path``: a name its own path hook serves, not a file. Read as a path it is a
name in the current directory, and ``--workspace .`` was always refused ("contains
an entry of sys.path"). The project's own ``.venv`` is such an install: these tests
run its ``tak`` for real.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import trio

from kernel.errors import SandboxError
from kernel.home import TakHome
from plugins import open_plugin_host
from plugins._host import guarded_paths

TAK = str(Path(sys.executable).with_name("tak"))
HOOK_ENTRIES = [e for e in sys.path if e.startswith("__editable__") and "__path_hook__" in e]

pytestmark = pytest.mark.skipif(
    not HOOK_ENTRIES, reason="this environment is not a setuptools editable install"
)


def _tak(
    cwd: Path, home: Path, *words: str, stdin: str | None = None
) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "TAK_HOME"}
    return subprocess.run(
        [TAK, "--home", str(home), *words],
        cwd=cwd, env=env, input=stdin, capture_output=True, text=True, timeout=120,
    )  # fmt: skip


@pytest.mark.parametrize(
    "words",
    [
        ("call", "--workspace", ".", "list_dir", '{"path": "."}'),
        ("run", "--workspace", ".", "hello"),
        ("mcp", "serve", "--workspace", "{cwd}"),
    ],
    ids=["call", "run", "mcp-serve"],
)
def test_workspace_dot_is_allowed_under_an_editable_install(
    tmp_path: Path, words: tuple[str, ...]
) -> None:
    project = tmp_path / "project"
    project.mkdir()
    args = [w.replace("{cwd}", str(project)) for w in words]
    result = _tak(project, tmp_path / "home", *args, stdin="")
    assert "sys.path" not in result.stderr, result.stderr
    assert result.returncode == 0, result.stderr


def test_the_path_hook_entry_is_not_guarded_but_a_directory_of_that_name_is(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    home = TakHome(tmp_path / "home").ensure()
    workspace = tmp_path / "project"
    workspace.mkdir()
    monkeypatch.chdir(workspace)
    _, not_inside = guarded_paths(home)
    hooked = {os.path.join(str(workspace), e) for e in HOOK_ENTRIES}
    assert not hooked & {os.path.join(str(workspace), p) for _, p in not_inside}

    async def open_here() -> None:
        async with open_plugin_host(workspace, plugins=[], home=home):
            pass

    trio.run(open_here)
    # A tool creates a directory of that name: now it is one the next start imports from.
    (workspace / HOOK_ENTRIES[0]).mkdir()
    with pytest.raises(SandboxError, match=r"contains an entry of sys\.path"):
        trio.run(open_here)
