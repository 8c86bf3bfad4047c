"""Class 1, worker side: no call a worker makes leaves a setuid, setgid or sticky file.

The worker runs as root in CI, so a setuid file it leaves in the workspace is a
setuid-root binary any local user could run after the worker is gone. Every
creating call is tried, through Python, libc and raw system call numbers
(x86-64), and the workspace is then searched for a file with any 07000 bit.
"""

from __future__ import annotations

import os
import platform
import stat
from pathlib import Path

import pytest
from kit import Arena

from sandbox import Policy

pytestmark = [
    pytest.mark.usefixtures("confined"),
    pytest.mark.skipif(platform.machine() != "x86_64", reason="raw x86-64 syscall numbers"),
]

_O_CREAT_W = "os.O_CREAT | os.O_WRONLY"


def _assert_no_privileged_modes(workspace: Path) -> None:
    for path in [workspace, *workspace.rglob("*")]:
        mode = os.lstat(path).st_mode
        assert not mode & 0o7000, f"{path} has mode {stat.filemode(mode)}"


ATTEMPTS = {
    "open_setuid": f"os.open('x', {_O_CREAT_W}, 0o4755)",
    "open_setgid": f"os.open('x', {_O_CREAT_W}, 0o2755)",
    "open_sticky": f"os.open('x', {_O_CREAT_W}, 0o1755)",
    "open_all_bits_excl": f"os.open('x', {_O_CREAT_W} | os.O_EXCL, 0o7777)",
    "open_mode_with_type_bits": f"os.open('x', {_O_CREAT_W}, 0o104755)",
    "python_open_opener": (
        "open('x', 'w', opener=lambda p, f: os.open(p, f | os.O_CREAT, 0o4755)).write('#!')"
    ),
    "mkdir_setgid": "os.mkdir('d', 0o2755)",
    "mkdir_sticky": "os.mkdir('d', 0o1777)",
    "mkdir_setuid": "os.mkdir('d', 0o4755)",
    "makedirs_setgid": "os.makedirs('a/b', 0o2775)",
    "libc_creat": "libc('creat', b'x', 0o4755)",
    "libc_open_variadic": "libc('open', b'x', 0o101, 0o4755)",
    "libc_mkdir": "libc('mkdir', b'd', 0o2755)",
    "raw_open": "syscall(2, b'x', 0o101, 0o4755)",
    "raw_creat": "syscall(85, b'x', 0o6755)",
    "raw_mkdir": "syscall(83, b'd', 0o2755)",
    "raw_mkdirat": "syscall(258, -100, b'd', 0o3755)",
    "raw_openat": "syscall(257, -100, b'x', 0o101, 0o4755)",
    # The mode is an int in the kernel: only its low bits count, and they are checked.
    "raw_openat_mode_high_bits": "syscall(257, -100, b'x', 0o101, (1 << 32) | 0o4755)",
    "o_tmpfile_setuid": "os.open('.', os.O_TMPFILE | os.O_WRONLY, 0o4755)",
    # O_TMPFILE then a name: the mode is set at creation and fchmod is refused.
    "o_tmpfile_then_fchmod": (
        "fd = os.open('.', os.O_TMPFILE | os.O_WRONLY, 0o755)\nos.fchmod(fd, 0o4755)"
    ),
    "raw_open_o_tmpfile": "syscall(2, b'.', os.O_TMPFILE | os.O_WRONLY, 0o2755)",
    # openat2 carries the mode in memory, where seccomp cannot see it: ENOSYS.
    "raw_openat2": (
        "how = (ctypes.c_uint64 * 3)(0o101, 0o4755, 0)\n"
        "syscall(437, -100, b'x', ctypes.byref(how), ctypes.c_size_t(24))"
    ),
    "mknod_regular_file": "os.mknod('x', stat.S_IFREG | 0o4755)",
    "raw_mknodat": "syscall(259, -100, b'x', stat.S_IFREG | 0o4755, 0)",
    "chmod_after_create": "open('x', 'w').close()\nos.chmod('x', 0o4755)",
    "raw_fchmodat2": "open('x', 'w').close()\nsyscall(452, -100, b'x', 0o4755, 0)",
    # File capabilities would make a root binary just as well as setuid.
    "file_capability_xattr": (
        "open('x', 'w').close()\n"
        "os.setxattr('x', 'security.capability', b'\\x01\\x00\\x00\\x02' + bytes(16))"
    ),
}


@pytest.mark.parametrize("code", ATTEMPTS.values(), ids=ATTEMPTS.keys())
async def test_no_privileged_mode_on_create(arena: Arena, code: str) -> None:
    result = await arena.attack(code)
    arena.assert_refused(result)
    _assert_no_privileged_modes(arena.workspace)


async def test_privileged_modes_with_subprocess_permission(arena: Arena) -> None:
    # A plugin allowed to run programs gets the same filter for the mode bits.
    code = f"os.open('x', {_O_CREAT_W}, 0o4755)"
    result = await arena.attack(code, policy=Policy(subprocess=True))
    arena.assert_refused(result)
    _assert_no_privileged_modes(arena.workspace)


async def test_privileged_modes_from_a_child_process(arena: Arena) -> None:
    # The filter is inherited: a program the plugin runs is held to it too.
    code = (
        "r = subprocess.run([sys.executable, '-I', '-c', "
        "\"import os; os.open('x', os.O_CREAT | os.O_WRONLY, 0o4755)\"], "
        "capture_output=True, text=True)\n"
        "if 'PermissionError' in r.stderr: raise OSError(errno.EPERM, r.stderr[-200:])\n"
        "result = (r.returncode, r.stderr[-300:])"
    )
    result = await arena.attack(code, policy=Policy(subprocess=True))
    arena.assert_refused(result)
    _assert_no_privileged_modes(arena.workspace)


async def test_kit_ordinary_modes_still_work(arena: Arena) -> None:
    code = (
        "os.close(os.open('f', os.O_CREAT | os.O_WRONLY, 0o644))\n"
        "os.mkdir('d', 0o755)\n"
        "os.close(os.open('.', os.O_TMPFILE | os.O_WRONLY, 0o600))\n"
        # without O_CREAT the mode register is garbage and must not matter
        "os.close(os.open('f', os.O_RDONLY, 0o7777))\n"
        "result = (oct(os.stat('f').st_mode & 0o7777), oct(os.stat('d').st_mode & 0o7000))"
    )
    result = await arena.attack(code)
    assert result.startswith("ALLOWED: ("), result
    assert (arena.workspace / "f").is_file() and (arena.workspace / "d").is_dir()
    _assert_no_privileged_modes(arena.workspace)


async def test_kit_workspace_object_falls_back_to_the_walk(arena: Arena) -> None:
    # openat2 answers ENOSYS in a worker: the Workspace must use its O_NOFOLLOW walk.
    code = (
        "from kernel.plugin import context\n"
        "ws = context().workspace\n"
        "ws.mkdir('sub/dir', parents=True)\n"
        "ws.write_text('sub/dir/f.txt', 'hello')\n"
        "result = (ws.uses_openat2, ws.read_text('sub/dir/f.txt'))"
    )
    result = await arena.attack(code)
    assert result == "ALLOWED: (False, 'hello')", result
