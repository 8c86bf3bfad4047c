"""Confined paths: every path is resolved by the kernel relative to one directory fd.

A path string is never checked and then used: ``openat2(RESOLVE_BENEATH |
RESOLVE_NO_MAGICLINKS)`` makes the kernel refuse, atomically, any resolution
that leaves the workspace (``..``, absolute symlinks, symlinks to outside,
``/proc/self/root``), so swapping a symlink between a check and a use gains
nothing. Where ``openat2`` is missing, a component-by-component walk with
``O_NOFOLLOW`` is used instead; it refuses every symbolic link.
"""

from __future__ import annotations

import ctypes
import errno
import os
import secrets
import stat as stat_module
from pathlib import Path
from typing import Final, Literal

import attrs

from kernel.errors import SandboxError

from . import _syscalls

RESOLVE_NO_MAGICLINKS: Final = 0x02
RESOLVE_BENEATH: Final = 0x08

#: Longest path accepted (``PATH_MAX``) and longest component (``NAME_MAX``), in bytes.
MAX_PATH_BYTES: Final = 4096
MAX_NAME_BYTES: Final = 255
#: How often a resolution is retried when the kernel says the tree changed under it.
_EAGAIN_RETRIES: Final = 64

EntryKind = Literal["file", "dir", "symlink", "other"]


class _OpenHow(ctypes.Structure):
    _fields_ = [
        ("flags", ctypes.c_uint64),
        ("mode", ctypes.c_uint64),
        ("resolve", ctypes.c_uint64),
    ]


@attrs.frozen
class Entry:
    """One directory entry, described without following it."""

    name: str
    kind: EntryKind
    size: int


def _probe_openat2() -> bool:
    root = os.open("/", os.O_PATH | os.O_CLOEXEC)
    try:
        os.close(_openat2(root, ".", os.O_PATH, 0))
    except OSError:
        return False
    finally:
        os.close(root)
    return True


def _openat2(dirfd: int, path: str, flags: int, mode: int) -> int:
    how = _OpenHow(flags | os.O_CLOEXEC, mode, RESOLVE_BENEATH | RESOLVE_NO_MAGICLINKS)
    encoded = os.fsencode(path)
    for _ in range(_EAGAIN_RETRIES):
        try:
            return _syscalls.syscall(
                "openat2",
                ctypes.c_int(dirfd),
                ctypes.c_char_p(encoded),
                ctypes.byref(how),
                ctypes.c_size_t(ctypes.sizeof(how)),
            )
        except OSError as exc:
            if exc.errno != errno.EAGAIN:
                raise
    raise OSError(errno.EAGAIN, "the workspace kept changing during resolution")


def openat2_available() -> bool:
    """Whether this kernel has ``openat2`` with ``RESOLVE_BENEATH``."""
    global _OPENAT2
    if _OPENAT2 is None:
        _OPENAT2 = _probe_openat2()
    return _OPENAT2


_OPENAT2: bool | None = None


def _kind(mode: int) -> EntryKind:
    if stat_module.S_ISREG(mode):
        return "file"
    if stat_module.S_ISDIR(mode):
        return "dir"
    if stat_module.S_ISLNK(mode):
        return "symlink"
    return "other"


def _describe_kind(mode: int) -> str:
    for test, name in (
        (stat_module.S_ISDIR, "a directory"),
        (stat_module.S_ISFIFO, "a FIFO"),
        (stat_module.S_ISCHR, "a character device"),
        (stat_module.S_ISBLK, "a block device"),
        (stat_module.S_ISSOCK, "a socket"),
        (stat_module.S_ISLNK, "a symbolic link"),
    ):
        if test(mode):
            return name
    return "not a regular file"


class Workspace:
    """A directory that every path is confined to.

    Paths are relative to the workspace (``"notes/a.txt"``); absolute paths,
    ``..`` that climbs out, and symbolic links that lead out are refused with
    ``SandboxError``. Only regular files are read or written: a FIFO, a device
    or a socket is refused without being opened for I/O. ``~`` and ``$HOME``
    mean nothing special: they are ordinary names inside the workspace.

    Raises (every method):
        SandboxError: the path was refused; the message says which and why.
        FileNotFoundError, FileExistsError, IsADirectoryError, NotADirectoryError:
            as the operating system reports them, naming the workspace path.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        max_read: int = 16 * 1024 * 1024,
        max_write: int = 64 * 1024 * 1024,
        use_openat2: bool | None = None,
    ) -> None:
        self.path = Path(os.path.abspath(path))
        self.max_read = max_read
        self.max_write = max_write
        self._openat2 = openat2_available() if use_openat2 is None else use_openat2
        try:
            self._fd = os.open(self.path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except OSError as exc:
            raise SandboxError(f"cannot open workspace {self.path}: {exc.strerror}") from exc

    # -- lifetime ---------------------------------------------------------

    def fileno(self) -> int:
        return self._fd

    @property
    def uses_openat2(self) -> bool:
        """``True`` when paths resolve with ``openat2``, ``False`` for the ``O_NOFOLLOW`` walk."""
        return self._openat2

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __enter__(self) -> Workspace:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Workspace({str(self.path)!r})"

    # -- files ------------------------------------------------------------

    def open(self, path: str, flags: int = os.O_RDONLY, mode: int = 0o666) -> int:
        """A file descriptor for the regular file at ``path`` (the caller closes it).

        With ``os.O_CREAT`` a missing file is created (never through a
        symbolic link). ``flags`` may not ask for a directory or ``O_PATH``.
        """
        rel = self._check(path)
        if flags & (os.O_PATH | os.O_DIRECTORY):
            raise SandboxError(f"{rel!r}: Workspace.open opens regular files only")
        flags &= ~os.O_NOFOLLOW  # links are handled by the resolution, not by the caller
        try:
            probe = self._resolve(rel, os.O_PATH)
        except FileNotFoundError:
            if not flags & os.O_CREAT:
                raise
            return self._create(rel, flags, mode)
        try:
            expected = os.fstat(probe)
        finally:
            os.close(probe)
        if flags & os.O_EXCL:
            raise FileExistsError(errno.EEXIST, "file exists", rel)
        self._require_regular(rel, expected.st_mode)
        fd = self._resolve(rel, (flags & ~os.O_CREAT) | os.O_NONBLOCK | os.O_NOCTTY)
        try:
            actual = os.fstat(fd)
            if (actual.st_dev, actual.st_ino) != (expected.st_dev, expected.st_ino):
                raise SandboxError(f"{rel!r} was replaced while it was being opened; not used")
            self._require_regular(rel, actual.st_mode)
        except BaseException:
            os.close(fd)
            raise
        return fd

    def read_bytes(self, path: str, *, max_bytes: int | None = None) -> bytes:
        """The content of a regular file, refused when larger than ``max_bytes``."""
        rel = self._check(path)
        cap = self.max_read if max_bytes is None else max_bytes
        fd = self.open(rel)
        try:
            size = os.fstat(fd).st_size
            if size > cap:
                raise SandboxError(f"{rel!r} is {size} bytes, more than the {cap}-byte cap")
            chunks: list[bytes] = []
            total = 0
            while True:
                chunk = os.read(fd, min(1 << 20, cap + 1 - total))
                if not chunk:
                    break
                chunks.append(chunk)
                total += len(chunk)
                if total > cap:
                    raise SandboxError(f"{rel!r} grew past the {cap}-byte cap while read")
            return b"".join(chunks)
        finally:
            os.close(fd)

    def read_text(
        self,
        path: str,
        *,
        start_line: int | None = None,
        end_line: int | None = None,
        max_bytes: int | None = None,
        encoding: str = "utf-8",
    ) -> str:
        """Text of a file; ``start_line``..``end_line`` (1-based, inclusive) picks lines.

        Undecodable bytes become U+FFFD rather than failing the read.
        """
        text = self.read_bytes(path, max_bytes=max_bytes).decode(encoding, errors="replace")
        if start_line is None and end_line is None:
            return text
        if (start_line is not None and start_line < 1) or (end_line is not None and end_line < 1):
            raise ValueError("line numbers start at 1")
        lines = text.splitlines(keepends=True)
        first = (start_line or 1) - 1
        return "".join(lines[first : end_line if end_line is not None else len(lines)])

    def write_bytes(self, path: str, data: bytes) -> None:
        """Replace the file atomically: readers see the old or the new content, never a mix."""
        rel = self._check(path)
        if len(data) > self.max_write:
            raise SandboxError(
                f"writing {len(data)} bytes to {rel!r} exceeds the {self.max_write}-byte cap"
            )
        with self._parent(rel) as (parent, name):
            mode = 0o666
            try:
                existing = os.stat(name, dir_fd=parent, follow_symlinks=False)
            except FileNotFoundError:
                pass
            else:
                if stat_module.S_ISDIR(existing.st_mode):
                    raise IsADirectoryError(errno.EISDIR, "is a directory", rel)
                if not (
                    stat_module.S_ISREG(existing.st_mode) or stat_module.S_ISLNK(existing.st_mode)
                ):
                    raise SandboxError(
                        f"{rel!r} is {_describe_kind(existing.st_mode)}, not a regular file; "
                        "refused"
                    )
                if stat_module.S_ISREG(existing.st_mode):
                    mode = stat_module.S_IMODE(existing.st_mode)
            tmp = f".{name[:200]}.{secrets.token_hex(6)}.tmp"
            fd = os.open(
                tmp,
                os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                mode,
                dir_fd=parent,
            )
            try:
                with open(fd, "wb", closefd=False) as f:
                    f.write(data)
                os.replace(tmp, name, src_dir_fd=parent, dst_dir_fd=parent)
            except BaseException:
                try:
                    os.unlink(tmp, dir_fd=parent)
                except OSError:
                    pass
                raise
            finally:
                os.close(fd)

    def write_text(self, path: str, text: str, *, encoding: str = "utf-8") -> None:
        self.write_bytes(path, text.encode(encoding))

    def append(self, path: str, data: bytes | str) -> None:
        """Append to a regular file, creating it when missing."""
        rel = self._check(path)
        raw = data.encode("utf-8") if isinstance(data, str) else data
        fd = self.open(rel, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
        try:
            size = os.fstat(fd).st_size
            if size + len(raw) > self.max_write:
                raise SandboxError(
                    f"appending {len(raw)} bytes to {rel!r} would pass the "
                    f"{self.max_write}-byte cap"
                )
            view = memoryview(raw)
            while view:
                view = view[os.write(fd, view) :]
        finally:
            os.close(fd)

    # -- directories and names --------------------------------------------

    def list(self, path: str = ".") -> list[Entry]:
        """The entries of a directory, sorted by name; symbolic links are not followed."""
        rel = self._check(path)
        fd = self._resolve(rel, os.O_RDONLY | os.O_DIRECTORY)
        try:
            entries = []
            with os.scandir(fd) as it:
                for e in it:
                    st = e.stat(follow_symlinks=False)
                    entries.append(Entry(e.name, _kind(st.st_mode), st.st_size))
        finally:
            os.close(fd)
        return sorted(entries, key=lambda e: e.name)

    def stat(self, path: str, *, follow_symlinks: bool = True) -> os.stat_result:
        """``stat`` of a path; a symbolic link is followed only while it stays inside."""
        rel = self._check(path)
        if not follow_symlinks:
            with self._parent(rel, allow_root=True) as (parent, name):
                return os.stat(name, dir_fd=parent, follow_symlinks=False)
        fd = self._resolve(rel, os.O_PATH)
        try:
            return os.fstat(fd)
        finally:
            os.close(fd)

    def exists(self, path: str) -> bool:
        try:
            self.stat(path)
        except FileNotFoundError:
            return False
        return True

    def mkdir(self, path: str, *, parents: bool = False, exist_ok: bool = False) -> None:
        rel = self._check(path)
        if parents:
            parts = [p for p in rel.split("/") if p not in ("", ".")]
            for i in range(1, len(parts) + 1):
                self.mkdir("/".join(parts[:i]), exist_ok=exist_ok or i < len(parts))
            return
        with self._parent(rel) as (parent, name):
            try:
                os.mkdir(name, 0o777, dir_fd=parent)
            except FileExistsError:
                st = os.stat(name, dir_fd=parent, follow_symlinks=False)
                if not (exist_ok and stat_module.S_ISDIR(st.st_mode)):
                    raise FileExistsError(errno.EEXIST, "file exists", rel) from None

    def remove(self, path: str) -> None:
        """Remove a file, a symbolic link (not its target) or an empty directory."""
        rel = self._check(path)
        with self._parent(rel) as (parent, name):
            st = os.stat(name, dir_fd=parent, follow_symlinks=False)
            if stat_module.S_ISDIR(st.st_mode):
                os.rmdir(name, dir_fd=parent)
            else:
                os.unlink(name, dir_fd=parent)

    def rename(self, src: str, dst: str, *, overwrite: bool = False) -> None:
        """Rename within the workspace; both ends are resolved inside it."""
        src_rel, dst_rel = self._check(src), self._check(dst)
        with self._parent(src_rel) as (sp, sname), self._parent(dst_rel) as (dp, dname):
            if overwrite:
                os.rename(sname, dname, src_dir_fd=sp, dst_dir_fd=dp)
                return
            try:
                _syscalls.syscall(
                    "renameat2",
                    ctypes.c_int(sp),
                    ctypes.c_char_p(os.fsencode(sname)),
                    ctypes.c_int(dp),
                    ctypes.c_char_p(os.fsencode(dname)),
                    ctypes.c_uint(1),  # RENAME_NOREPLACE
                )
            except OSError as exc:
                if exc.errno == errno.EEXIST:
                    raise FileExistsError(errno.EEXIST, "file exists", dst_rel) from None
                if exc.errno == errno.ENOENT:
                    raise FileNotFoundError(errno.ENOENT, "no such file", src_rel) from None
                raise

    # -- resolution -------------------------------------------------------

    def _check(self, path: str) -> str:
        if not isinstance(path, str):
            raise SandboxError(f"paths are strings, got {type(path).__name__}")
        if "\x00" in path:
            raise SandboxError(f"{path[:80]!r}: a path may not contain a NUL byte")
        encoded = os.fsencode(path)
        if len(encoded) > MAX_PATH_BYTES:
            raise SandboxError(f"path of {len(encoded)} bytes is longer than {MAX_PATH_BYTES}")
        if any(len(part) > MAX_NAME_BYTES for part in encoded.split(b"/")):
            raise SandboxError(f"{path[:80]!r}: a path component is longer than 255 bytes")
        if path.startswith("/"):
            raise SandboxError(
                f"{path!r}: absolute paths are refused; paths are relative to the workspace"
            )
        return path or "."

    def _resolve(self, rel: str, flags: int, mode: int = 0) -> int:
        if self._fd < 0:
            raise SandboxError("the workspace is closed")
        try:
            if self._openat2:
                return _openat2(self._fd, rel, flags, mode)
            return self._walk(rel, flags, mode)
        except OSError as exc:
            raise self._translate(rel, exc) from None

    def _walk(self, rel: str, flags: int, mode: int) -> int:
        """The fallback resolver: one component at a time, never following a link."""
        parts = [p for p in rel.split("/") if p not in ("", ".")]
        stack = [os.dup(self._fd)]
        try:
            for i, part in enumerate(parts):
                last = i == len(parts) - 1
                if part == "..":
                    if len(stack) == 1:
                        raise OSError(errno.EXDEV, "escapes the workspace")
                    os.close(stack.pop())
                    continue
                fd = os.open(part, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=stack[-1])
                stack.append(fd)
                st = os.fstat(fd)
                if stat_module.S_ISLNK(st.st_mode):
                    raise OSError(errno.ELOOP, "symbolic link")
                if last:
                    # Reopened by name with O_NOFOLLOW: a link swapped in since the
                    # check above is refused (ELOOP) or opened as the link itself.
                    stack.pop()
                    os.close(fd)
                    final = flags | os.O_NOFOLLOW | os.O_CLOEXEC
                    return os.open(part, final, mode, dir_fd=stack[-1])
                if not stat_module.S_ISDIR(st.st_mode):
                    raise OSError(errno.ENOTDIR, "not a directory")
            return os.open(".", flags | os.O_CLOEXEC, mode, dir_fd=stack[-1])
        finally:
            for fd in stack:
                os.close(fd)

    def _translate(self, rel: str, exc: OSError) -> Exception:
        if exc.errno == errno.EXDEV:
            return SandboxError(f"{rel!r} resolves outside the workspace; refused")
        if exc.errno == errno.ELOOP:
            how = (
                "a magic link or a symbolic-link loop"
                if self._openat2
                else "a symbolic link (not followed without openat2)"
            )
            return SandboxError(f"{rel!r} goes through {how}; refused")
        if exc.errno == errno.EAGAIN:
            return SandboxError(f"{rel!r}: the workspace kept changing during resolution")
        if exc.errno == errno.ENXIO:
            return SandboxError(f"{rel!r} is not a regular file (FIFO without reader); refused")
        return type(exc)(exc.errno, exc.strerror, rel)

    def _require_regular(self, rel: str, mode: int) -> None:
        if stat_module.S_ISDIR(mode):
            raise IsADirectoryError(errno.EISDIR, "is a directory", rel)
        if not stat_module.S_ISREG(mode):
            raise SandboxError(f"{rel!r} is {_describe_kind(mode)}, not a regular file; refused")

    def _create(self, rel: str, flags: int, mode: int) -> int:
        # O_CREAT|O_EXCL never follows a final symlink, so a link planted at
        # this name cannot redirect the creation.
        with self._parent(rel) as (parent, name):
            try:
                return os.open(
                    name,
                    flags | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                    mode,
                    dir_fd=parent,
                )
            except FileExistsError:
                if flags & os.O_EXCL:
                    raise FileExistsError(errno.EEXIST, "file exists", rel) from None
        # Created by someone else in between: open what is there now, checked.
        return self.open(rel, flags & ~os.O_CREAT, mode)

    def _parent(self, rel: str, *, allow_root: bool = False) -> _ParentDir:
        head, _, name = rel.rstrip("/").rpartition("/")
        if name in ("", ".", ".."):
            if allow_root and name in ("", "."):
                return _ParentDir(self, ".", ".")
            raise SandboxError(f"{rel!r} does not name an entry inside the workspace")
        return _ParentDir(self, head or ".", name)


class _ParentDir:
    """``with ws._parent(rel) as (dirfd, name)``: the confined parent directory and a name."""

    def __init__(self, ws: Workspace, head: str, name: str) -> None:
        self._ws = ws
        self._head = head
        self._name = name
        self._fd = -1

    def __enter__(self) -> tuple[int, str]:
        self._fd = self._ws._resolve(self._head, os.O_PATH | os.O_DIRECTORY)
        return self._fd, self._name

    def __exit__(self, *exc_info: object) -> None:
        os.close(self._fd)
