"""Kernel-side writes: no privilege in file modes, ``.tak/`` read-only, a disk budget.

The kernel runs as root and writes for the model (``fs`` tools, ``Workspace``): each
attempt here is one way a hostile model or workspace would try to get a root-owned
setuid file, a plugin file under ``.tak/``, or a full disk. Kernel-side, so instead of
a worker the arena's canaries outside the workspace must be unchanged, and so must
``.tak/``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import platform
import stat
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from kit import Arena

from kernel.errors import SandboxError
from kernel.executor import run_tool_calls
from kernel.messages import ToolCall
from kernel.plugin import ToolContext, use_context
from plugins import fs
from sandbox import Policy, Workspace


@contextlib.contextmanager
def kernel_workspace(arena: Arena, **options: object) -> Iterator[Workspace]:
    """The workspace as the plugin host builds it, set as the tools' context."""
    with Workspace(arena.workspace, protected=(".tak",), **options) as ws:  # type: ignore[arg-type]
        ctx = ToolContext(ws, "p/s", logging.getLogger("tests.security"), {})
        with use_context(ctx):
            yield ws


async def call(tool: str, **arguments: object) -> str:
    [observation] = await run_tool_calls([ToolCall("c", tool, dict(arguments))], fs.plugin.tools)
    return observation.content


def snapshot(root: Path) -> dict[str, tuple[bytes, int]]:
    return {
        str(p.relative_to(root)): (p.read_bytes() if p.is_file() else b"", os.lstat(p).st_mode)
        for p in sorted([root, *root.rglob("*")])
    }


# --- class 1: modes ----------------------------------------------------------------

OLD_MODES = [0o4755, 0o6755, 0o2775, 0o7777, 0o4700]


@pytest.mark.parametrize("old_mode", OLD_MODES, ids=oct)
@pytest.mark.parametrize("how", ["write_file", "edit_file", "write_bytes"])
async def test_replacing_a_setuid_file_gives_no_special_bits(
    arena: Arena, how: str, old_mode: int
) -> None:
    target = arena.workspace / "tool"
    target.write_text("old body\n")
    os.chmod(target, old_mode)
    with kernel_workspace(arena) as ws:
        if how == "write_file":
            await call("write_file", path="tool", content="new body\n")
        elif how == "edit_file":
            await call("edit_file", path="tool", old="old", new="new")
        else:
            ws.write_bytes("tool", b"new body\n")
    mode = stat.S_IMODE(os.lstat(target).st_mode)
    assert target.read_text() == "new body\n"
    assert mode & 0o7000 == 0, oct(mode)
    assert mode & ~old_mode == 0, f"bits added: {oct(mode)} from {oct(old_mode)}"
    arena.assert_nothing_seen()


def _open_create(ws: Workspace) -> str:
    os.close(ws.open("made", os.O_WRONLY | os.O_CREAT, 0o6777))
    return "made"


def _append_new(ws: Workspace) -> str:
    ws.append("made", "x")
    return "made"


def _write_new(ws: Workspace) -> str:
    ws.write_bytes("made", b"#!/bin/sh\n")
    return "made"


def _mkdir_in_setgid_dir(ws: Workspace) -> str:
    os.chmod(ws.path / "sgid", 0o2777)
    ws.mkdir("sgid/sub")
    return "sgid/sub"


def _open_existing_setuid(ws: Workspace) -> str:
    (ws.path / "made").write_text("x")
    os.chmod(ws.path / "made", 0o4755)
    os.close(ws.open("made", os.O_WRONLY | os.O_TRUNC))
    return "made"


@pytest.mark.parametrize(
    "make",
    [_open_create, _append_new, _write_new, _mkdir_in_setgid_dir, _open_existing_setuid],
)
def test_workspace_writes_never_leave_special_bits(
    arena: Arena, make: Callable[[Workspace], str]
) -> None:
    (arena.workspace / "sgid").mkdir()
    with kernel_workspace(arena) as ws:
        made = ws.path / make(ws)
    mode = os.lstat(made).st_mode
    assert mode & 0o7000 == 0, oct(mode)
    if stat.S_ISREG(mode) and make is not _open_existing_setuid:
        assert mode & 0o111 == 0, f"a new file is executable: {oct(mode)}"
    arena.assert_nothing_seen()


# --- class 2: .tak/ is read-only to tools -------------------------------------------


def _plant(arena: Arena) -> None:
    plugins = arena.workspace / ".tak" / "plugins"
    plugins.mkdir(parents=True)
    (plugins / "trusted.py").write_text("# trusted\n")
    (arena.workspace / "a").mkdir()
    (arena.workspace / "payload.py").write_text("import os\n")


TOOL_ATTEMPTS = [
    ("write_file", {"path": ".tak/plugins/evil.py", "content": "x"}),
    ("write_file", {"path": "./.tak/plugins/evil.py", "content": "x"}),
    ("write_file", {"path": "a/../.tak/plugins/evil.py", "content": "x"}),
    ("write_file", {"path": "tak-link/plugins/evil.py", "content": "x"}),
    ("write_file", {"path": "plugins-link/evil.py", "content": "x"}),
    ("write_file", {"path": ".tak/plugins/trusted.py", "content": "x"}),
    ("write_file", {"path": ".tak/newdir/evil.py", "content": "x"}),
    ("edit_file", {"path": ".tak/plugins/trusted.py", "old": "trusted", "new": "evil"}),
    ("edit_file", {"path": "tak-link/plugins/trusted.py", "old": "trusted", "new": "evil"}),
    ("edit_file", {"path": "a/../plugins-link/trusted.py", "old": "trusted", "new": "evil"}),
]


@pytest.mark.parametrize(("tool", "arguments"), TOOL_ATTEMPTS, ids=lambda v: str(v)[:40])
async def test_tools_cannot_write_under_dot_tak(
    arena: Arena, tool: str, arguments: dict[str, str]
) -> None:
    _plant(arena)
    (arena.workspace / "tak-link").symlink_to(".tak")
    (arena.workspace / "plugins-link").symlink_to(".tak/plugins")
    before = snapshot(arena.workspace / ".tak")
    with kernel_workspace(arena):
        result = await call(tool, **arguments)
    assert result.startswith("Error (denied)"), result
    assert ".tak/ is read-only to tools" in result
    assert snapshot(arena.workspace / ".tak") == before
    arena.assert_nothing_seen()


WORKSPACE_ATTEMPTS: list[tuple[str, Callable[[Workspace], object]]] = [
    ("mkdir", lambda ws: ws.mkdir(".tak/plugins/pkg")),
    ("mkdir-parents", lambda ws: ws.mkdir(".tak/x/y", parents=True)),
    ("rename-into", lambda ws: ws.rename("payload.py", ".tak/plugins/payload.py")),
    ("rename-into-link", lambda ws: ws.rename("payload.py", "tak-link/plugins/payload.py")),
    ("rename-out", lambda ws: ws.rename(".tak/plugins/trusted.py", "a/t.py")),
    ("rename-dot-tak", lambda ws: ws.rename(".tak", "moved")),
    ("rename-plugins", lambda ws: ws.rename(".tak/plugins", "a/plugins")),
    ("rename-over-dot-tak", lambda ws: ws.rename("a", ".tak", overwrite=True)),
    ("remove-file", lambda ws: ws.remove(".tak/plugins/trusted.py")),
    ("remove-dot-tak", lambda ws: ws.remove(".tak")),
    ("append", lambda ws: ws.append(".tak/plugins/trusted.py", "evil\n")),
    ("append-via-link", lambda ws: ws.append("file-link", "evil\n")),
    ("open-create", lambda ws: ws.open(".tak/plugins/new.py", os.O_WRONLY | os.O_CREAT)),
    ("open-truncate", lambda ws: ws.open("tak-link/plugins/trusted.py", os.O_WRONLY | os.O_TRUNC)),
]


@pytest.mark.parametrize(
    ("name", "attempt"), WORKSPACE_ATTEMPTS, ids=[n for n, _ in WORKSPACE_ATTEMPTS]
)
def test_workspace_refuses_writes_touching_dot_tak(
    arena: Arena, name: str, attempt: Callable[[Workspace], object]
) -> None:
    _plant(arena)
    (arena.workspace / "tak-link").symlink_to(".tak")
    (arena.workspace / "file-link").symlink_to(".tak/plugins/trusted.py")
    before = snapshot(arena.workspace / ".tak")
    with (
        kernel_workspace(arena) as ws,
        pytest.raises(SandboxError, match=r"read-only to tools|symbolic link"),
    ):
        attempt(ws)
    assert snapshot(arena.workspace / ".tak") == before
    arena.assert_nothing_seen()


async def test_dot_tak_renamed_away_by_a_worker_stays_protected_and_a_new_one_too(
    arena: Arena,
) -> None:
    _plant(arena)
    with kernel_workspace(arena):
        # What a worker could do behind the kernel's back (Landlock allows it there).
        os.rename(arena.workspace / ".tak", arena.workspace / "moved")
        (arena.workspace / ".tak" / "plugins").mkdir(parents=True)
        old = await call("write_file", path="moved/plugins/evil.py", content="x")
        new = await call("write_file", path=".tak/plugins/evil.py", content="x")
    assert old.startswith("Error (denied)") and new.startswith("Error (denied)"), (old, new)
    assert not (arena.workspace / "moved/plugins/evil.py").exists()
    assert not (arena.workspace / ".tak/plugins/evil.py").exists()
    arena.assert_nothing_seen()


async def test_dot_tak_removed_by_a_worker_cannot_be_made_again_by_a_tool(arena: Arena) -> None:
    with kernel_workspace(arena):
        os.rmdir(arena.workspace / ".tak")
        result = await call("write_file", path=".tak/plugins/evil.py", content="x")
    assert result.startswith("Error (denied)"), result
    assert not (arena.workspace / ".tak").exists()
    arena.assert_nothing_seen()


@pytest.mark.parametrize("how", ["append", "open", "write_file"])
async def test_a_hard_link_into_dot_tak_is_not_written_through(arena: Arena, how: str) -> None:
    _plant(arena)
    os.link(arena.workspace / ".tak/plugins/trusted.py", arena.workspace / "hard.py")
    before = snapshot(arena.workspace / ".tak")
    with kernel_workspace(arena) as ws:
        if how == "write_file":
            # Allowed, but as a new file: the link is replaced, .tak/ keeps its content.
            await call("write_file", path="hard.py", content="evil\n")
        else:
            with pytest.raises(SandboxError, match="hard links"):
                if how == "append":
                    ws.append("hard.py", "evil\n")
                else:
                    ws.open("hard.py", os.O_RDWR)
    assert snapshot(arena.workspace / ".tak") == before
    arena.assert_nothing_seen()


def test_ordinary_writes_still_work_beside_dot_tak(arena: Arena) -> None:
    with kernel_workspace(arena) as ws:
        ws.mkdir("src/pkg", parents=True)
        ws.write_text("src/pkg/a.py", "x = 1\n")
        ws.append("log.txt", "line\n")
        ws.rename("src/pkg/a.py", "src/b.py")
        ws.remove("log.txt")
        assert ws.read_text(".tak/../src/b.py") == "x = 1\n"


# .tak/ stays read-only in a worker too: its mount namespace, attacked.


_WIDE = Policy(subprocess=True)


def _snapshot(root: Path) -> list[tuple[str, int, int]]:
    return sorted(
        (str(p.relative_to(root)), p.lstat().st_ino, p.lstat().st_mode) for p in root.rglob("*")
    )


DOT_TAK = {
    "create_in_dot_tak": "open('.tak/x.py', 'w')",
    "rename_dot_tak": "os.rename('.tak', 'moved')",
    "exchange_dot_tak": "os.mkdir('d')\nsyscall(316, -100, b'.tak', -100, b'd', 2)",
    "rmdir_dot_tak_tmp": "os.rmdir('.tak/tmp')",
    "rename_dot_tak_tmp": "os.rename('.tak/tmp', 'moved')",
    "hard_link_into_dot_tak": "open('p.py', 'w').write('x')\nos.link('p.py', '.tak/plugins/p.py')",
    "tmpfile_linked_by_proc": (
        "fd = os.open('.tak/tmp', os.O_TMPFILE | os.O_WRONLY, 0o600)\n"
        "os.link(f'/proc/self/fd/{fd}', '.tak/plugins/p.py')"
    ),
    "tmpfile_linked_by_empty_path": (
        "fd = os.open('.', os.O_TMPFILE | os.O_WRONLY, 0o600)\n"
        "libc('linkat', fd, b'', -100, b'.tak/plugins/p.py', 0x1000)"
    ),
    "up_from_the_tmpfs": "open('.tak/tmp/../plugins/p.py', 'w')",
    "dirfd_of_the_tmpfs": (
        "d = os.open('.tak/tmp', os.O_RDONLY)\n"
        "os.open('../plugins/p.py', os.O_CREAT | os.O_WRONLY, 0o600, dir_fd=d)"
    ),
    "cwd_in_dot_tak": "os.chdir('.tak/plugins')\nopen('p.py', 'w')",
    "umount_dot_tak": "libc('umount2', os.path.abspath('.tak').encode(), 2)",
    "umount_the_tmpfs": "libc('umount2', os.path.abspath('.tak/tmp').encode(), 2)",
    "remount_read_write": (
        "libc('mount', None, os.path.abspath('.tak').encode(), None, 0x20 | 0x1000, None)"
    ),
    "open_tree_clone": "syscall(428, -100, b'.', 1 | 0x80000)",
    "move_mount": "syscall(429, -100, b'.tak/tmp', -100, b'x', 0)",
    "fsopen": "syscall(430, b'tmpfs', 0)",
    "unshare_user_and_mount": "syscall(272, 0x10000000 | 0x20000)",
    "clone_new_user": "syscall(56, 0x10000000 | 17, 0, 0, 0, 0)",
}


@pytest.mark.usefixtures("confined")
@pytest.mark.skipif(platform.machine() != "x86_64", reason="raw x86-64 syscall numbers")
@pytest.mark.parametrize("name", list(DOT_TAK))
async def test_dot_tak_stays_read_only_in_the_worker(arena: Arena, name: str) -> None:
    for directory in ("plugins", "tmp"):  # .tak/tmp: what the pool makes
        (arena.workspace / ".tak" / directory).mkdir(parents=True, exist_ok=True)
    (arena.workspace / ".tak" / "plugins" / "trusted.py").write_text("x = 1\n")
    before = _snapshot(arena.workspace / ".tak")
    result = await arena.attack(DOT_TAK[name], policy=_WIDE)
    arena.assert_refused(result)
    assert _snapshot(arena.workspace / ".tak") == before
    assert (arena.workspace / ".tak" / "plugins" / "trusted.py").read_text() == "x = 1\n"


# --- class 6: disk budget -----------------------------------------------------------


@pytest.mark.parametrize("how", ["write_file", "append", "edit_file"])
async def test_writes_past_the_disk_budget_are_refused(arena: Arena, how: str) -> None:
    (arena.workspace / "big.bin").write_bytes(os.urandom(512 * 1024))
    (arena.workspace / "small.txt").write_text("small\n")
    with kernel_workspace(arena, max_bytes=1024 * 1024) as ws:
        used = ws.usage()
        assert 512 * 1024 <= used < 1024 * 1024
        if how == "write_file":
            result = await call("write_file", path="more.txt", content="y" * 600_000)
        elif how == "edit_file":
            result = await call("edit_file", path="small.txt", old="small", new="y" * 600_000)
        else:
            with pytest.raises(SandboxError) as info:
                ws.append("small.txt", "y" * 600_000)
            result = f"Error (denied): {info.value}"
        assert result.startswith("Error (denied)"), result[:200]
        assert "disk budget of 1048576 bytes" in result and "bytes in use" in result
        # Shrinking is always allowed, and the budget sees what others wrote after a refresh.
        ws.write_text("small.txt", "")
        (arena.workspace / "big.bin").unlink()
        assert ws.refresh_usage() < 64 * 1024
        ws.write_text("more.txt", "y" * 600_000)
    assert not (arena.workspace / "small.txt").read_text()
    arena.assert_nothing_seen()


def test_usage_counts_hard_links_once_and_does_not_follow_links(arena: Arena) -> None:
    (arena.workspace / "a.bin").write_bytes(b"x" * 100_000)
    os.link(arena.workspace / "a.bin", arena.workspace / "b.bin")
    (arena.workspace / "out").symlink_to(arena.outside)
    deep = arena.workspace
    for _ in range(300):  # deeper than one fd per level would like
        deep = deep / "d"
    deep.mkdir(parents=True)
    (deep / "c.bin").write_bytes(b"y" * 100_000)
    with Workspace(arena.workspace, max_bytes=10**9) as ws:
        used = ws.usage()
    assert 200_000 <= used < 200_000 + 300 * 4096 + 64 * 1024
    arena.assert_nothing_seen()
