"""Class 3: the workspace overlaps what the kernel runs, and the store follows links.

A workspace that holds the interpreter, site-packages, the kernel's source tree
or ``$TAK_HOME`` lets a tool plant a ``.pth`` file, edit a module or grant
itself trust, run unconfined by the next start. Every kernel start goes
through ``open_plugin_host``: it must refuse such a workspace before writing
anything into it. These attempts are kernel-side: the arena's canaries and log
are checked, and nothing was created in the guarded directory.
"""

from __future__ import annotations

import os
import site
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import trio
from kit import Arena, own_file_system

import kernel
from kernel.errors import SandboxError, StoreError
from kernel.home import TakHome
from kernel.store import FileStore, SessionKey
from plugins import open_plugin_host
from plugins._host import _check_overlap

SOURCE_TREE = Path(kernel.__file__).resolve().parents[1]
SITE_PACKAGES = Path(site.getsitepackages()[0])


def _home(arena: Arena) -> TakHome:
    return TakHome(arena.root / "home").ensure()


# Each case: (the workspace an attacker steers the user to, given the arena's home).
CASES: dict[str, Callable[[Arena, TakHome], Path]] = {
    "sys.prefix": lambda a, h: Path(sys.prefix),
    "sys.base_prefix": lambda a, h: Path(sys.base_prefix),
    "contains sys.prefix": lambda a, h: Path(sys.prefix).parent,
    "inside site-packages": lambda a, h: SITE_PACKAGES / "trio",
    "site-packages": lambda a, h: SITE_PACKAGES,
    "the source tree": lambda a, h: SOURCE_TREE,
    "inside the kernel package": lambda a, h: SOURCE_TREE / "kernel",
    "the root directory": lambda a, h: Path("/"),
    "$TAK_HOME": lambda a, h: h.root,
    "contains $TAK_HOME": lambda a, h: a.root,
    "$TAK_HOME/config": lambda a, h: h.config,
    "inside $TAK_HOME/data": lambda a, h: h.sessions,
}
LINKED = ["sys.prefix", "the source tree", "$TAK_HOME", "inside site-packages"]


def _refused(workspace: Path, home: TakHome) -> str:
    async def main() -> None:
        async with open_plugin_host(workspace, plugins=[], home=home):
            pass

    with pytest.raises(SandboxError) as caught:
        trio.run(main)
    return str(caught.value)


@pytest.mark.parametrize("case", sorted(CASES))
def test_overlapping_workspace_is_refused(arena: Arena, case: str) -> None:
    home = _home(arena)
    workspace = CASES[case](arena, home)
    existed = (workspace / ".tak").exists()
    message = _refused(workspace, home)
    assert "\n" not in message and str(workspace.resolve()) in message
    assert message.startswith("workspace ")
    assert (workspace / ".tak").exists() == existed  # nothing was written into it
    arena.assert_nothing_seen([message])


@pytest.mark.parametrize("case", LINKED)
def test_overlap_through_a_symlink_is_refused(arena: Arena, case: str) -> None:
    home = _home(arena)
    link = arena.root / "innocent-looking"
    link.symlink_to(CASES[case](arena, home), target_is_directory=True)
    message = _refused(link, home)
    assert "really" in message and "\n" not in message
    arena.assert_nothing_seen([message])


def test_kit_the_default_workspace_is_allowed(arena: Arena) -> None:
    # Not an attempt: the rule allows $TAK_HOME/workspace (the default) and beside it.
    home = _home(arena)

    async def main() -> None:
        for workspace in (home.workspace, arena.workspace):
            async with open_plugin_host(workspace, plugins=[], home=home):
                pass

    trio.run(main)


def test_tak_run_in_the_repository_is_refused(arena: Arena) -> None:
    # `tak run --workspace .` inside a project whose .venv lies in it.
    result = subprocess.run(
        [sys.executable, "-m", "kernel.cli", "--home", str(_home(arena).root), "run",
         "--workspace", ".", "hello"],
        cwd=SOURCE_TREE, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert result.returncode == 2
    [line] = result.stderr.splitlines()
    assert line.startswith(f"tak run: workspace {SOURCE_TREE} contains sys.prefix")
    arena.assert_nothing_seen([result.stdout, result.stderr])


def test_workspace_holding_a_missing_sys_path_directory_is_refused(
    arena: Arena, monkeypatch: pytest.MonkeyPatch
) -> None:
    planned = arena.workspace / "lib"  # does not exist yet: a tool can make it
    monkeypatch.setattr(sys, "path", [*sys.path, str(planned)])
    with pytest.raises(SandboxError, match=r"sys\.path"):
        _check_overlap(arena.workspace, TakHome(arena.root / "home"))
    arena.assert_nothing_seen()


def test_workspace_holding_a_zip_on_sys_path_is_refused(
    arena: Arena, monkeypatch: pytest.MonkeyPatch
) -> None:
    import zipfile

    archive = arena.workspace / "deps.zip"
    with zipfile.ZipFile(archive, "w") as z:
        z.writestr("depmod.py", "VALUE = 1\n")
    monkeypatch.setattr(sys, "path", [*sys.path, str(archive)])
    with pytest.raises(SandboxError, match=r"sys\.path"):
        _check_overlap(arena.workspace, TakHome(arena.root / "home"))
    arena.assert_nothing_seen()


def test_workspace_holding_an_existing_sys_path_directory_is_refused(
    arena: Arena, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Refused: the same, with the directory already there."""
    (arena.workspace / "lib").mkdir()
    monkeypatch.setattr(sys, "path", [*sys.path, str(arena.workspace / "lib") + "/"])
    with pytest.raises(SandboxError, match=r"sys\.path"):
        _check_overlap(str(arena.workspace) + "/.", TakHome(arena.root / "home"))
    arena.assert_nothing_seen()


# -- the session store never follows a link below its root ---------------------------------


@pytest.mark.parametrize("planted", ["session_dir", "project_dir", "transcript", "sub_dir"])
async def test_store_link_planted_in_the_store_is_refused(arena: Arena, planted: str) -> None:
    root = arena.root / "sessions"
    key = SessionKey("proj", "chat")
    async with FileStore(root) as store:
        await store.append(SessionKey("proj", "other"), [{"type": "note", "uuid": "u0"}])
    target = arena.outside
    if planted == "project_dir":
        os.symlink(target, root / "proj2")
        key = SessionKey("proj2", "sub")
    elif planted == "session_dir":
        os.symlink(target, root / "proj" / "chat")
    elif planted == "transcript":
        (root / "proj" / "chat").mkdir()
        os.symlink(arena.canary, root / "proj" / "chat" / "transcript.jsonl")
    else:
        (root / "proj" / "chat").mkdir()
        os.symlink(target, root / "proj" / "chat" / "sub")
        key = SessionKey("proj", "chat", "deep")
    entry = {"type": "note", "uuid": "u1", "text": "written where?"}
    async with FileStore(root) as store:
        with pytest.raises(StoreError, match="symbolic link"):
            await store.append(key, [entry])
        with pytest.raises(StoreError, match="symbolic link"):  # nor read through it
            await store.load(key)
    arena.assert_nothing_seen()


# -- the workspace disk budget, kernel side ---------------------------------------------


@pytest.mark.parametrize("how", ["one_big_file", "many_files"])
async def test_worker_write_past_the_budget_fails_the_call(
    arena: Arena, how: str, confined: None
) -> None:
    from kernel.executor import run_tool_calls
    from kernel.messages import ToolCall
    from kernel.plugin import use_context

    code = {
        "one_big_file": "open('big', 'wb').write(b'x' * 300_000)",
        "many_files": "[open(f'f{i}', 'wb').write(b'x' * 8192) for i in range(40)]",
    }[how]
    config = {"workspace": {"max_bytes": 100_000}}
    async with open_plugin_host(
        arena.workspace, plugins=["python", "fs"], config=config, home=_home(arena)
    ) as host:
        with use_context(host.context()):
            [ran] = await run_tool_calls([ToolCall("1", "run_python", {"code": code})], host.tools)
            [then] = await run_tool_calls(
                [ToolCall("2", "write_file", {"path": "more.txt", "content": "y" * 10})],
                host.tools,
            )
    assert ran.is_error and "workspace over its budget" in ran.content
    assert "max_bytes 100000 ([workspace] max_bytes in tak.toml)" in ran.content
    assert then.is_error  # fs tools refuse further writes (sandbox.Workspace)
    arena.assert_nothing_seen([ran.content, then.content])


@pytest.mark.parametrize("value", ["0", "-5", "1.5", "true", '"10"'])
def test_kit_a_bad_budget_is_one_clear_line(tmp_path: Path, value: str) -> None:
    home = TakHome(tmp_path).ensure()
    home.config_file.write_text(f"[workspace]\nmax_bytes = {value}\n")
    with pytest.raises(Exception) as caught:
        home.load_config()
    assert str(caught.value).startswith(f"{home.config_file}: $.workspace.max_bytes: expected")


_CHURN = r"""
import os, subprocess, sys
os.makedirs('a/hidden', exist_ok=True)
os.makedirs('b', exist_ok=True)
with open('a/hidden/blob', 'wb') as f:
    f.write(os.urandom(4 << 20))
churn = '''
import os
while True:
    for src, dst in (('a/hidden', 'b/hidden'), ('b/hidden', 'a/hidden')):
        try:
            os.rename(src, dst)
        except OSError:
            pass
'''
subprocess.Popen([sys.executable, '-c', churn], start_new_session=False,
                 stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
print('churning')
"""


async def test_a_directory_a_worker_keeps_moving_cannot_hide_from_the_budget(
    arena: Arena, confined: None
) -> None:
    """A program left running by a worker moves a directory back and forth so that a
    walk of the tree misses it: the walk runs with every worker frozen."""
    from kernel.executor import run_tool_calls
    from kernel.messages import ToolCall
    from kernel.plugin import use_context

    config = {"workspace": {"max_bytes": 1 << 20}}
    async with open_plugin_host(
        arena.workspace, plugins=["python"], config=config, home=_home(arena)
    ) as host:
        with use_context(host.context()):
            seen = []
            for i in range(12):
                code = _CHURN if i == 0 else "print('nothing written')"
                [obs] = await run_tool_calls(
                    [ToolCall(str(i), "run_python", {"code": code})], host.tools
                )
                seen.append(obs)
    # The first call may pass (the data was still being written); from then on the
    # workspace holds 4 MiB against a 1 MiB budget, and every check must see it.
    later = seen[2:]
    missed = [o.content for o in later if "workspace over its budget" not in o.content]
    assert not missed, f"{len(missed)} of {len(later)} checks missed the moving 4 MiB: {missed[:3]}"
    arena.assert_nothing_seen([o.content for o in seen])


_HIDDEN = r"""
import subprocess, sys
hold = '''
import os, time
fd = os.open('hidden', os.O_CREAT | os.O_WRONLY, 0o600)
os.unlink('hidden')
for _ in range(4):
    os.write(fd, os.urandom(1 << 20))
os.fsync(fd)
print('held', flush=True)
time.sleep(600)
'''
p = subprocess.Popen([sys.executable, '-c', hold], stdout=subprocess.PIPE,
                     stdin=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
print(p.stdout.readline().decode().strip())
"""


async def test_a_file_kept_open_after_unlinking_counts_against_the_budget(
    arena: Arena, confined: None
) -> None:
    """4 MiB in a file a worker's program keeps open after unlinking it: in no
    directory, so no walk sees it, yet it takes the disk until it is closed. The disk
    watchdog counts it and kills the holder (its worker's cgroups), which frees it."""
    from kernel.executor import run_tool_calls
    from kernel.messages import ToolCall
    from kernel.plugin import use_context

    config = {"workspace": {"max_bytes": 1 << 20}}
    # On a file system of its own: space other tests free on /tmp cannot hide the 4 MiB.
    with own_file_system(arena.workspace):
        async with open_plugin_host(
            arena.workspace, plugins=["python"], config=config, home=_home(arena)
        ) as host:
            with use_context(host.context()):
                seen = []
                for i in range(4):
                    code = _HIDDEN if i == 0 else "print('nothing written')"
                    [obs] = await run_tool_calls(
                        [ToolCall(str(i), "run_python", {"code": code})], host.tools
                    )
                    seen.append(obs)
    # Counted and over; or, on a machine so loaded that the writer (in its fsync) did
    # not stop within the watchdog's SUSPECT_FREEZE_S, killed for that: either way the
    # call fails and the holder is gone. What must never be seen is "held": a pass.
    assert seen[0].is_error, seen[0].content
    assert (
        "workspace over its budget" in seen[0].content
        or "could not be stopped to measure the workspace" in seen[0].content
    ), seen[0].content
    # Refused until the watchdog's next look has killed the holder (with its worker):
    # then the 4 MiB are free, and the next calls run.
    assert seen[-1].content == "stdout:\nnothing written", seen
    arena.assert_nothing_seen([o.content for o in seen])
