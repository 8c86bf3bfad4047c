"""``<workspace>/.tak/`` read-only inside a worker: a private mount namespace.

Landlock grants rights on a whole hierarchy and cannot carve a subdirectory
out of the read-write workspace, yet nothing a tool writes may land under
``.tak/`` (what the kernel reads there, a tool must not be able to plant).
So a worker enters a mount namespace of its own before it drops its
capabilities, and there:

1. makes every mount private (``MS_REC | MS_PRIVATE``): without it a new
   mount under a shared mount would propagate back to the kernel's namespace;
2. bind-mounts ``.tak`` onto itself and remounts the bind read-only,
   ``nosuid`` and ``nodev`` (the directory is named by an ``O_PATH |
   O_NOFOLLOW`` fd, so a symlink planted as ``.tak`` redirects nothing);
3. mounts a small private ``tmpfs`` on ``.tak/tmp`` (the worker's
   ``TMPDIR``), so temporary files stay writable, die with the worker and
   count against its memory cgroup.

A mount point cannot be renamed or removed (``EBUSY``), so the worker cannot
swap ``.tak`` for a directory of its own either. Programs the worker starts
inherit the namespace. The kernel's own namespace never changes. Without
``CAP_SYS_ADMIN`` (a kernel not running as root) the step is skipped and the
report says so; plugins still load only when trusted by hash, so a file
planted in ``.tak/plugins`` is never run.
"""

from __future__ import annotations

import ctypes
import os
import stat

_libc = ctypes.CDLL(None, use_errno=True)
_mount = _libc.mount
_mount.argtypes = [
    ctypes.c_char_p,
    ctypes.c_char_p,
    ctypes.c_char_p,
    ctypes.c_ulong,
    ctypes.c_char_p,
]
_mount.restype = ctypes.c_int
_unshare = _libc.unshare
_unshare.argtypes = [ctypes.c_int]
_unshare.restype = ctypes.c_int

_CLONE_NEWNS = 0x00020000
_MS_RDONLY = 0x1
_MS_NOSUID = 0x2
_MS_NODEV = 0x4
_MS_NOEXEC = 0x8
_MS_REMOUNT = 0x20
_MS_BIND = 0x1000
_MS_REC = 0x4000
_MS_PRIVATE = 0x40000

#: The directory inside the workspace that tools may read but never change.
PROTECTED_DIR = ".tak"
#: The worker's ``TMPDIR``, a private tmpfs inside the protected directory.
TMP_DIR = ".tak/tmp"
#: Size of that tmpfs.
TMP_BYTES = 256 * 1024 * 1024


def _check(result: int, what: str) -> None:
    if result != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def _mount_call(
    source: str | None, target: str, fstype: str | None, flags: int, data: str | None = None
) -> None:
    _check(
        _mount(
            source.encode() if source is not None else None,
            target.encode(),
            fstype.encode() if fstype is not None else None,
            flags,
            data.encode() if data is not None else None,
        ),
        f"mount {target}",
    )


def _directory_fd(parent_fd: int, name: str) -> int:
    """An ``O_PATH`` fd of ``name`` under ``parent_fd``, which must be a real directory."""
    fd = os.open(name, os.O_PATH | os.O_NOFOLLOW | os.O_DIRECTORY | os.O_CLOEXEC, dir_fd=parent_fd)
    if not stat.S_ISDIR(os.fstat(fd).st_mode):  # pragma: no cover - O_DIRECTORY says so
        os.close(fd)
        raise OSError(f"{name} is not a directory")
    return fd


def protect_tak_dir(workspace: str) -> str:
    """Enter a private mount namespace where ``<workspace>/.tak`` is read-only.

    Needs ``CAP_SYS_ADMIN``; call it before capabilities are dropped and before
    seccomp (which refuses ``mount`` and ``unshare``). Returns what it did.

    Raises:
        OSError: a step failed (``EPERM`` without the capability); the caller decides
            whether that is fatal.
    """
    _check(_unshare(_CLONE_NEWNS), "unshare(CLONE_NEWNS)")
    _mount_call(None, "/", None, _MS_REC | _MS_PRIVATE)
    # Opened after unshare: a bind's source must be a mount of this namespace.
    root = os.open(workspace, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        tak = _directory_fd(root, PROTECTED_DIR)
        try:
            os.close(_directory_fd(tak, os.path.basename(TMP_DIR)))
            # Named through the fd: what was checked is what gets mounted.
            tak_path = f"/proc/self/fd/{tak}"
            _mount_call(tak_path, tak_path, None, _MS_BIND | _MS_REC)
        finally:
            os.close(tak)
    finally:
        os.close(root)
    # The bind now hides the directory: remount it, and mount on it, by path.
    protected = os.path.join(workspace, PROTECTED_DIR)
    _mount_call(None, protected, None, _MS_REMOUNT | _MS_BIND | _MS_RDONLY | _MS_NOSUID | _MS_NODEV)
    _mount_call(
        "tmpfs",
        os.path.join(workspace, TMP_DIR),
        "tmpfs",
        _MS_NOSUID | _MS_NODEV,
        f"size={TMP_BYTES},mode=0700",
    )
    return f"{PROTECTED_DIR}/ read-only, {TMP_DIR} a private tmpfs (mount namespace)"
