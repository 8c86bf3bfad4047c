"""Confined paths: every path is resolved by the kernel relative to one directory fd.

A path string is never checked and then used: ``openat2(RESOLVE_BENEATH |
RESOLVE_NO_MAGICLINKS)`` makes the kernel refuse, atomically, any resolution
that leaves the workspace (``..``, absolute symlinks, symlinks to outside,
``/proc/self/root``), so swapping a symlink between a check and a use gains
nothing. Where ``openat2`` is missing, a component-by-component walk with
``O_NOFOLLOW`` is used instead; it refuses every symbolic link.

Three more guarantees hold for every write, because the kernel writes as root
on behalf of a hostile model:

- no file or directory written through a ``Workspace`` carries setuid, setgid
  or sticky bits, and no write adds an execute bit (a replaced file keeps at
  most the old file's ``0o777`` bits);
- nothing is written beneath a *protected* directory (``.tak/``, where plugins
  are discovered): the check compares the identity (device, inode) of the
  resolved parent and each of its ancestors, so ``..``, symbolic links, a
  renamed ``.tak`` or a new one made in its place all meet it;
- with ``max_bytes``, a write that would take the workspace past its disk
  budget is refused; with ``max_files``, so is one that would make it hold
  more names (files, directories, links) than that.
"""

from __future__ import annotations

import builtins
import ctypes
import errno
import os
import stat as stat_module
import threading
import time
from collections.abc import Sequence
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

#: Ancestors a protection check climbs before it gives up (refusing the write).
_MAX_DEPTH: Final = 8192
#: Mode bits a ``Workspace`` never writes: setuid, setgid, sticky.
_SPECIAL_BITS: Final = 0o7000
#: Which ``open`` flags write to an existing file in place.
_IN_PLACE: Final = os.O_WRONLY | os.O_RDWR | os.O_TRUNC | os.O_APPEND
#: The workspace disk budget the host applies when tak.toml does not set one.
DEFAULT_MAX_BYTES: Final = 4 * 1024**3
#: How many names (files, directories, links) a workspace may hold unless tak.toml
#: says otherwise. Empty files cost no blocks, so bytes alone do not bound them; and
#: every walk of the tree (the budget's, fs grep's) costs one step per name: 200,000
#: is what fs grep walks at most, a walk of ~0.5 s.
DEFAULT_MAX_FILES: Final = 200_000

EntryKind = Literal["file", "dir", "symlink", "other"]
_Identity = tuple[int, int]
#: A directory and its ancestors below the workspace root, innermost first.
_Chain = list[_Identity]


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


def _identity(st: os.stat_result) -> _Identity:
    return (st.st_dev, st.st_ino)


def _disk_bytes(st: os.stat_result) -> int:
    """What an inode costs on disk: allocated blocks, so a sparse file costs what it holds."""
    return st.st_blocks * 512


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


#: ``settle_usage`` walks the tree at least once in this many calls.
_WALK_EVERY = 32
#: A settle walks whenever the file system changed since the last walk and that walk
#: took at most this much CPU time; a slower walk is spaced out so that it costs about this
#: much a settle (every ``walk time / CHEAP_WALK_S`` settles, at most ``_WALK_EVERY``).
CHEAP_WALK_S = 0.002


class Workspace:
    """A directory that every path is confined to.

    Paths are relative to the workspace (``"notes/a.txt"``); absolute paths,
    ``..`` that climbs out, and symbolic links that lead out are refused with
    ``SandboxError``. Only regular files are read or written: a FIFO, a device
    or a socket is refused without being opened for I/O. ``~`` and ``$HOME``
    mean nothing special: they are ordinary names inside the workspace.

    ``protected`` names directories (relative to the workspace, created when
    missing) that no write may touch: creating, replacing, appending, making a
    directory, removing or renaming anything into, out of or beneath them, or
    renaming or removing them (or their ancestors). ``max_bytes`` is the disk
    budget of the whole workspace (allocated blocks, hard links counted once,
    symbolic links not followed, other file systems mounted inside not
    counted): ``usage()`` measures it once, writes through this object adjust
    the figure, ``refresh_usage()`` measures again after someone else wrote.
    ``max_files`` bounds the names it holds (every file, directory and link
    below the root, each hard link once per name): ``files()``, measured by
    the same walk.

    Raises (every method):
        SandboxError: the path was refused; the message says which and why.
        FileNotFoundError, FileExistsError, IsADirectoryError, NotADirectoryError:
            as the operating system reports them, naming the workspace path.
    """

    max_bytes: int | None = None
    max_files: int | None = None
    _protected: tuple[str, ...] = ()
    _usage: int | None = None
    _files: int | None = None
    _ffree_seen: int | None = None
    _usage_lock: threading.Lock = threading.Lock()
    _settles: int = 0
    _free_seen: int | None = None
    _walk_s: float = 0.0
    _free_walked: tuple[int, int | None] | None = None

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        max_read: int = 16 * 1024 * 1024,
        max_write: int = 64 * 1024 * 1024,
        use_openat2: bool | None = None,
        protected: Sequence[str] = (),
        max_bytes: int | None = None,
        max_files: int | None = None,
        lazy: bool = False,
    ) -> None:
        """Open ``path`` now, or with ``lazy`` on first use.

        A lazy workspace holds no descriptor until a method needs one (a worker whose
        tools never touch it keeps only stdio and its channel open); the error an
        eager one raises here is then raised by that first method.

        Raises:
            SandboxError: the directory cannot be opened (not with ``lazy``).
        """
        self.path = Path(os.path.abspath(path))
        self.max_read = max_read
        self.max_write = max_write
        self.max_bytes = max_bytes
        self.max_files = max_files
        self._use_openat2 = use_openat2
        self._usage_lock = threading.Lock()
        self._open_lock = threading.Lock()
        self._settles = 0
        self._free_seen = None
        self._walk_s = 0.0
        self._free_walked = None
        self._dirfd: int | None = None
        self._protect_on_open = tuple(protected)
        if not lazy:
            _ = self._fd

    @property
    def _fd(self) -> int:
        """The directory's descriptor, opened (and protection set up) on first use."""
        fd = self._dirfd
        if fd is not None:
            return fd
        with self._open_lock:
            if self._dirfd is None:
                try:
                    self._dirfd = os.open(self.path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
                except OSError as exc:
                    raise SandboxError(
                        f"cannot open workspace {self.path}: {exc.strerror}"
                    ) from exc
                try:
                    # Re-enters ``_fd``, which now returns the descriptor without the lock.
                    self._protect(self._protect_on_open)
                except BaseException:
                    self.close()
                    raise
            return self._dirfd

    @_fd.setter
    def _fd(self, value: int) -> None:
        self._dirfd = value

    @property
    def _openat2(self) -> bool:
        choice = self._use_openat2
        return openat2_available() if choice is None else choice

    # -- lifetime ---------------------------------------------------------

    def fileno(self) -> int:
        return self._fd

    @property
    def uses_openat2(self) -> bool:
        """``True`` when paths resolve with ``openat2``, ``False`` for the ``O_NOFOLLOW`` walk."""
        return self._openat2

    def close(self) -> None:
        fd, self._dirfd = self._dirfd, -1  # a lazy one never opened stays closed
        if fd is not None and fd >= 0:
            os.close(fd)

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
        symbolic link) with ``mode & 0o666``: never executable, never setuid.
        ``flags`` may not ask for a directory or ``O_PATH``. Opening an existing
        file for writing clears its setuid/setgid/sticky bits; with protected
        directories it is refused through a symbolic link or a hard link (the
        other name could be under ``.tak/``). The disk budget is not checked
        here: the caller writes to the descriptor.
        """
        rel = self._check(path)
        if flags & (os.O_PATH | os.O_DIRECTORY):
            raise SandboxError(f"{rel!r}: Workspace.open opens regular files only")
        flags &= ~os.O_NOFOLLOW  # links are handled by the resolution, not by the caller
        mode &= 0o666
        writes = bool(flags & (_IN_PLACE | os.O_CREAT))
        # ``self._fd`` first: a lazy workspace sets up its protection when it opens.
        if writes and self._fd >= 0 and self._protected:
            with self._parent(rel) as (parent, name):
                self._guard(parent, name, rel)
                fd = self._open(rel, flags, mode)
                try:
                    self._require_same(rel, fd, parent, name, flags)
                except BaseException:
                    os.close(fd)
                    raise
                return fd
        return self._open(rel, flags, mode)

    def _open(self, rel: str, flags: int, mode: int) -> int:
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
            if flags & _IN_PLACE and actual.st_mode & _SPECIAL_BITS:
                os.fchmod(fd, stat_module.S_IMODE(actual.st_mode) & 0o777)
        except BaseException:
            os.close(fd)
            raise
        return fd

    def _require_same(self, rel: str, fd: int, parent: int, name: str, flags: int) -> None:
        """The written file is the entry ``name`` of the guarded ``parent``, its only name."""
        if not flags & _IN_PLACE:
            return
        actual = os.fstat(fd)
        try:
            entry = os.stat(name, dir_fd=parent, follow_symlinks=False)
        except FileNotFoundError:
            entry = None
        if entry is None or _identity(entry) != _identity(actual):
            raise SandboxError(
                f"{rel!r} is a symbolic link or was replaced; writing in place through it "
                "is refused (protected directories)"
            )
        if actual.st_nlink > 1:
            raise SandboxError(
                f"{rel!r} has {actual.st_nlink} hard links; writing it in place is refused "
                "(another name could be in a protected directory)"
            )

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
            self._guard(parent, name, rel)
            mode: int | None = None  # a new file: 0o666 less the umask
            freed = 0
            new_name = False  # a name more for max_files
            try:
                existing = os.stat(name, dir_fd=parent, follow_symlinks=False)
            except FileNotFoundError:
                new_name = True
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
                    # Never the old setuid/setgid/sticky bits: the kernel writes as
                    # root, and a copied setuid bit would make a root-owned setuid file.
                    mode = stat_module.S_IMODE(existing.st_mode) & 0o777
                    if existing.st_nlink == 1:
                        freed = _disk_bytes(existing)
                else:
                    freed = _disk_bytes(existing)
            reserved = len(data) - freed
            if new_name:
                self._reserve_files(rel)
            try:
                self._reserve(rel, reserved)
            except BaseException:
                self._adjust_files(-int(new_name))
                raise
            # os.urandom as secrets.token_hex does: ``secrets`` (hmac, hashlib) would
            # cost every worker's start its import.
            tmp = f".{name[:200]}.{os.urandom(6).hex()}.tmp"
            try:
                fd = os.open(
                    tmp,
                    os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                    0o666 if mode is None else 0o600,
                    dir_fd=parent,
                )
            except BaseException:
                self._adjust(-max(reserved, 0))
                self._adjust_files(-int(new_name))
                raise
            try:
                if mode is not None:
                    os.fchmod(fd, mode)  # exactly the old bits, not less the umask
                with open(fd, "wb", closefd=False) as f:
                    f.write(data)
                os.replace(tmp, name, src_dir_fd=parent, dst_dir_fd=parent)
                self._adjust(_disk_bytes(os.fstat(fd)) - freed - max(reserved, 0))
            except BaseException:
                self._adjust(-max(reserved, 0))
                self._adjust_files(-int(new_name))
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
        with self._parent(rel) as (parent, name):
            new = not self._lexists(parent, name)
        if new:
            self._reserve_files(rel)
        try:
            fd = self.open(rel, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
        except BaseException:
            self._adjust_files(-int(new))
            raise
        try:
            before = os.fstat(fd)
            if before.st_size + len(raw) > self.max_write:
                raise SandboxError(
                    f"appending {len(raw)} bytes to {rel!r} would pass the "
                    f"{self.max_write}-byte cap"
                )
            self._reserve(rel, len(raw))
            view = memoryview(raw)
            try:
                while view:
                    view = view[os.write(fd, view) :]
            finally:
                self._adjust(_disk_bytes(os.fstat(fd)) - _disk_bytes(before) - len(raw))
        finally:
            os.close(fd)

    # -- directories and names --------------------------------------------

    def list(self, path: str = ".", *, limit: int | None = None) -> list[Entry]:
        """The entries of a directory, sorted by name; symbolic links are not followed.

        With ``limit``, reading stops after that many entries (in directory order,
        then sorted): a directory of millions of entries costs no more than that.
        """
        rel = self._check(path)
        fd = self._resolve(rel, os.O_RDONLY | os.O_DIRECTORY)
        try:
            entries: builtins.list[Entry] = []
            with os.scandir(fd) as it:
                for e in it:
                    if limit is not None and len(entries) >= limit:
                        break
                    try:
                        st = e.stat(follow_symlinks=False)
                    except FileNotFoundError:
                        continue  # removed since it was read
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
                st = os.stat(name, dir_fd=parent, follow_symlinks=False)
            except FileNotFoundError:
                pass
            else:
                if not (exist_ok and stat_module.S_ISDIR(st.st_mode)):
                    raise FileExistsError(errno.EEXIST, "file exists", rel)
                return
            self._guard(parent, name, rel)
            self._reserve_files(rel)
            try:
                self._reserve(rel, 4096)
            except BaseException:
                self._adjust_files(-1)
                raise
            try:
                os.mkdir(name, 0o777, dir_fd=parent)
            except FileExistsError:
                self._adjust(-4096)
                self._adjust_files(-1)
                st = os.stat(name, dir_fd=parent, follow_symlinks=False)
                if not (exist_ok and stat_module.S_ISDIR(st.st_mode)):
                    raise FileExistsError(errno.EEXIST, "file exists", rel) from None
                return
            except BaseException:
                self._adjust(-4096)
                self._adjust_files(-1)
                raise
            self._settle_dir(parent, name)

    def _settle_dir(self, parent: int, name: str) -> None:
        """A new directory inherits setgid from a setgid parent: clear it; count its size."""
        try:
            fd = os.open(
                name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=parent
            )
        except OSError:
            return  # already replaced by someone else: not ours to change
        try:
            st = os.fstat(fd)
            if st.st_mode & _SPECIAL_BITS:
                os.fchmod(fd, stat_module.S_IMODE(st.st_mode) & 0o777)
            self._adjust(_disk_bytes(st) - 4096)
        finally:
            os.close(fd)

    def remove(self, path: str) -> None:
        """Remove a file, a symbolic link (not its target) or an empty directory."""
        rel = self._check(path)
        with self._parent(rel) as (parent, name):
            self._guard(parent, name, rel, entry=True)
            st = os.stat(name, dir_fd=parent, follow_symlinks=False)
            if stat_module.S_ISDIR(st.st_mode):
                os.rmdir(name, dir_fd=parent)
            else:
                os.unlink(name, dir_fd=parent)
            if stat_module.S_ISDIR(st.st_mode) or st.st_nlink == 1:
                self._adjust(-_disk_bytes(st))
            self._adjust_files(-1)

    @staticmethod
    def _lexists(parent: int, name: str) -> bool:
        try:
            os.stat(name, dir_fd=parent, follow_symlinks=False)
        except FileNotFoundError:
            return False
        return True

    def rename(self, src: str, dst: str, *, overwrite: bool = False) -> None:
        """Rename within the workspace; both ends are resolved inside it."""
        src_rel, dst_rel = self._check(src), self._check(dst)
        with self._parent(src_rel) as (sp, sname), self._parent(dst_rel) as (dp, dname):
            self._guard(sp, sname, src_rel, entry=True)
            self._guard(dp, dname, dst_rel, entry=True)
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

    # -- disk budget ------------------------------------------------------

    def usage(self) -> int:
        """Bytes the workspace takes on disk; the first call walks the tree (blocking).

        Later calls return the figure kept up to date by this object's own writes;
        ``refresh_usage()`` walks again.

        Raises:
            SandboxError: the tree kept changing while it was measured.
        """
        with self._usage_lock:
            cached = self._usage
        return self.refresh_usage() if cached is None else cached

    def files(self) -> int:
        """Names the workspace holds (see ``max_files``); walks the tree the first time.

        Raises:
            SandboxError: the tree kept changing while it was measured.
        """
        with self._usage_lock:
            cached = self._files
        if cached is None:
            self.refresh_usage()
            with self._usage_lock:
                cached = self._files
        return cached or 0

    def refresh_usage(self) -> int:
        """Measure the workspace again (after writes that did not go through this object).

        Returns the bytes; the names are measured by the same walk (``files()``). A
        walk that finds more than ``max_files`` names stops there: its figures are
        then a floor, and the workspace is over its budget either way.
        """
        # Read before the walk: what is written during it counts in the next settle.
        free = self._free() if self._fd >= 0 else (None, None)
        # The walk's cost is its thread's CPU time: a loaded machine makes its wall
        # time long without making it any dearer (and would space the walks out).
        started = time.thread_time()
        measured, names = self._measure()
        with self._usage_lock:
            self._usage, self._files = measured, names
            self._free_seen, self._ffree_seen = free
            self._walk_s = time.thread_time() - started
            self._free_walked = free if free[0] is not None else None
        return measured

    def free_bytes(self) -> int:
        """Free space on the file system that holds the workspace (``fstatvfs``)."""
        st = os.fstatvfs(self.fileno())
        return st.f_bfree * st.f_frsize

    def free_inodes(self) -> int | None:
        """Free inodes on that file system; ``None`` where it counts none (btrfs)."""
        st = os.fstatvfs(self.fileno())
        return st.f_ffree if st.f_files else None

    def _free(self) -> tuple[int, int | None]:
        return self.free_bytes(), self.free_inodes()

    def bounded_usage(self, *, settle: bool = True) -> int | None:
        """The usage after writes that did not go through this object, without a walk.

        The file system lost at most ``free space when the figure was last settled -
        free space now`` bytes since, whoever wrote them, so the kept figure plus that
        is an upper bound on the usage; free inodes bound the new names the same way
        -- unless space was freed elsewhere on the same file system meanwhile, which
        hides as much growth (another workspace's files removed; a loaded machine
        does it all the time), and a hard link takes a name but no inode.
        The bound is returned (and kept) while it is within the budget; ``None`` means
        the tree must be walked (``refresh_usage``): the bound passed ``max_bytes`` or
        ``max_files``, nothing was measured yet, or (with ``settle``, the host's call
        after each worker's call) the file system changed since the last walk and a
        walk is due: at once when the last one took at most ``CHEAP_WALK_S``, else
        once in ``walk time / CHEAP_WALK_S`` settles (at most ``_WALK_EVERY``), so
        that a call in a workspace of 100,000 files does not pay a 250 ms walk. The
        disk watchdog passes ``settle=False`` and walks on a clock of its own.
        """
        free_now, ffree_now = self._free()
        with self._usage_lock:
            current, seen = self._usage, self._free_seen
            names, fseen = self._files, self._ffree_seen
            if settle:
                self._settles += 1
            if current is not None and seen is not None and self.max_bytes is not None:
                bound = current + max(0, seen - free_now)
                files = names
                if names is not None and fseen is not None and ffree_now is not None:
                    files = names + max(0, fseen - ffree_now)
                within = files is None or self.max_files is None or files <= self.max_files
                due = settle and self._walk_due((free_now, ffree_now))
                if bound <= self.max_bytes and within and not due:
                    self._usage, self._free_seen = bound, free_now
                    self._files, self._ffree_seen = files, ffree_now
                    return bound
            if settle:
                self._settles = 0
        return None

    def _walk_due(self, free: tuple[int, int | None]) -> bool:
        """Whether a settle must walk (see ``bounded_usage``); the usage lock is held."""
        if free == self._free_walked:
            return False  # nothing on the file system changed since the walk
        every = min(_WALK_EVERY, int(self._walk_s / CHEAP_WALK_S))
        return self._settles >= every

    def far_over(self, fraction: float) -> bool:
        """Whether the free-space bound (``bounded_usage``) passes ``max_bytes`` or
        ``max_files`` by more than ``fraction`` of it, or cannot be formed. Blocking
        (two ``fstatvfs``); it keeps nothing."""
        free_now, ffree_now = self._free()
        with self._usage_lock:
            current, seen = self._usage, self._free_seen
            names, fseen = self._files, self._ffree_seen
        if current is None or seen is None:
            return True
        if self.max_bytes is not None:
            if current + max(0, seen - free_now) > self.max_bytes * (1 + fraction):
                return True
        if self.max_files is not None and names is not None:
            if fseen is not None and ffree_now is not None:
                names += max(0, fseen - ffree_now)
            if names > self.max_files * (1 + fraction):
                return True
        return False

    def add_usage(self, n: int) -> int:
        """Count ``n`` bytes the walk could not see (files open but unlinked); the usage."""
        with self._usage_lock:
            self._usage = (self._usage or 0) + n
            return self._usage

    def settle_usage(self) -> int:
        """``bounded_usage()``, or a walk of the tree when it cannot bound it. Blocking.

        Raises:
            SandboxError: the tree kept changing while it was measured.
        """
        bound = self.bounded_usage()
        return self.refresh_usage() if bound is None else bound

    def over_budget(self) -> str | None:
        """What the kept figures say is over the budget (one line), or ``None``.

        No walk and no system call: the figures are those of the last settle and of
        this object's own writes since.
        """
        with self._usage_lock:
            used, names = self._usage, self._files
        if self.max_bytes is not None and used is not None and used > self.max_bytes:
            return f"{used} bytes > max_bytes {self.max_bytes} ([workspace] max_bytes in tak.toml)"
        if self.max_files is not None and names is not None and names > self.max_files:
            return f"{names} files > max_files {self.max_files} ([workspace] max_files in tak.toml)"
        return None

    def _reserve(self, rel: str, n: int) -> None:
        """Count ``n`` more bytes against the budget, or refuse the write that needs them."""
        if self.max_bytes is None or n <= 0:
            return  # a write that frees space is allowed even over the budget
        measured = self.usage()
        over = self.over_budget()
        with self._usage_lock:
            current = measured if self._usage is None else self._usage
            if current + n > self.max_bytes or over is not None:
                raise SandboxError(
                    f"writing {n} more bytes to {rel!r} would take the workspace past its "
                    f"disk budget of {self.max_bytes} bytes ({current} bytes in use); refused"
                )
            self._usage = current + n

    def _reserve_files(self, rel: str) -> None:
        """Count one more name against ``max_files``, or refuse the write that makes it."""
        if self.max_files is None:
            return
        names = self.files()
        with self._usage_lock:
            current = names if self._files is None else self._files
            if current + 1 > self.max_files:
                raise SandboxError(
                    f"creating {rel!r} would take the workspace past its budget of "
                    f"{self.max_files} files ({current} in use; [workspace] max_files); refused"
                )
            self._files = current + 1

    def _adjust_files(self, delta: int) -> None:
        if self.max_files is None or not delta:
            return
        with self._usage_lock:
            if self._files is not None:
                self._files = max(0, self._files + delta)
            if self._ffree_seen is not None:
                self._ffree_seen -= delta  # see _adjust

    def _adjust(self, delta: int) -> None:
        """Count ``delta`` bytes this object wrote (or freed: negative).

        The free-space baseline moves by as much: what this object's own write took
        or gave back is in the kept figure already, and must not be counted again by
        the next bound -- above all not credited twice, which would let a worker
        write as much as an in-process write freed without the bound seeing it.
        """
        if self.max_bytes is None or not delta:
            return
        with self._usage_lock:
            if self._usage is not None:
                self._usage = max(0, self._usage + delta)
            if self._free_seen is not None:
                self._free_seen -= delta

    def _measure(self) -> tuple[int, int]:
        for _ in range(3):
            try:
                return self._walk_usage()
            except _TreeChanged:
                continue
        raise SandboxError("the workspace kept changing while its disk usage was measured")

    def _walk_usage(self) -> tuple[int, int]:
        """Bytes and names, depth first, holding one directory fd at a time (climbing
        back with ``..``); it stops once it has counted more than ``max_files`` names.

        Holding one fd per level would let a deep tree exhaust the kernel's fds, and
        paths from the root would pass ``PATH_MAX``: neither bounds how deep it goes.
        The stop bounds how long it takes: a tree of millions of empty files costs no
        more than one just over the budget.
        """
        if self._fd < 0:
            raise SandboxError("the workspace is closed")
        cap = self.max_files
        flags = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
        fd = os.open(".", flags, dir_fd=self._fd)
        try:
            top = os.fstat(fd)
            total = _disk_bytes(top)
            links = _Seen()
            # (identity, names of subdirectories still to visit) for each level
            stack: list[tuple[_Identity, list[str]]] = []
            links.limit = cap
            subdirs, size, names = _scan(fd, links)
            total += size
            stack.append((_identity(top), subdirs))
            while stack:
                if cap is not None and names > cap:
                    return total, names
                pending = stack[-1][1]
                if pending:
                    try:
                        child = os.open(pending.pop(), flags, dir_fd=fd)
                    except OSError:
                        # Gone, or replaced by a link, since it was listed: skipping it
                        # would let a directory moved back and forth hide what it holds.
                        raise _TreeChanged from None
                    st = os.fstat(child)
                    if st.st_dev != top.st_dev:
                        os.close(child)  # another file system mounted inside
                        continue
                    os.close(fd)
                    fd = child
                    total += _disk_bytes(st)
                    links.limit = None if cap is None else cap - names
                    subdirs, size, count = _scan(fd, links)
                    total += size
                    names += count
                    stack.append((_identity(st), subdirs))
                    continue
                stack.pop()
                if not stack:
                    break
                up = os.open("..", flags, dir_fd=fd)
                os.close(fd)
                fd = up
                if _identity(os.fstat(fd)) != stack[-1][0]:
                    raise _TreeChanged  # a directory was moved while we were inside it
            return total, names
        finally:
            os.close(fd)

    # -- protected directories ---------------------------------------------

    def _protect(self, protected: Sequence[str]) -> None:
        names = tuple(self._check(p).strip("/") for p in protected)
        if not names:
            return
        self._root_id = _identity(os.fstat(self._fd))
        for rel in names:
            self.mkdir(rel, parents=True, exist_ok=True)  # so that its identity exists
        # The identities seen now stay protected wherever the directories move.
        self._first_ids: dict[_Identity, str] = {}
        self._first_guarded: set[_Identity] = set()
        self._protected = names
        self._first_ids, self._first_guarded, _ = self._protection_now()

    def _protection_now(
        self,
    ) -> tuple[dict[_Identity, str], set[_Identity], dict[tuple[_Identity, str], str]]:
        """Protected identities (first seen and current), their ancestors, and their names.

        A worker may rename ``.tak`` and make a new one: both are protected, the
        moved one by identity and the new one because it resolves from the name.
        """
        ids = dict(self._first_ids)
        guarded = set(self._first_guarded)
        names: dict[tuple[_Identity, str], str] = {}
        for rel in self._protected:
            head, _, name = rel.rpartition("/")
            try:
                head_fd = self._resolve(head or ".", os.O_PATH | os.O_DIRECTORY)
            except (OSError, SandboxError):
                continue
            try:
                names[(_identity(os.fstat(head_fd)), name)] = rel
            finally:
                os.close(head_fd)
            try:
                fd = self._resolve(rel, os.O_PATH | os.O_DIRECTORY)
            except (OSError, SandboxError):
                continue
            try:
                chain = self._ancestry(fd, rel)
            finally:
                os.close(fd)
            if chain:
                ids.setdefault(chain[0], rel)
                guarded.update(chain[1:])
        return ids, guarded, names

    def _ancestry(self, fd: int, rel: str) -> _Chain:
        """The identities of directory ``fd`` and its ancestors below the workspace root.

        Raises:
            SandboxError: the directory is not beneath the workspace (or is too deep).
        """
        current = os.open(".", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC, dir_fd=fd)
        chain: _Chain = []
        try:
            for _ in range(_MAX_DEPTH):
                ident = _identity(os.fstat(current))
                if ident == self._root_id:
                    return chain
                if chain and ident == chain[-1]:
                    break  # "/" is its own parent: we climbed past the root
                chain.append(ident)
                up = os.open("..", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC, dir_fd=current)
                os.close(current)
                current = up
        finally:
            os.close(current)
        raise SandboxError(f"{rel!r} is not beneath the workspace root any more; refused")

    def _guard(self, parent: int, name: str, rel: str, *, entry: bool = False) -> None:
        """Refuse to write ``name`` in directory ``parent`` when that touches a protected one.

        ``entry`` is for removing or moving the entry itself: a protected directory
        or one of its ancestors may not go either.

        Raises:
            SandboxError: ``.tak/`` (or another protected directory) is read-only to tools.
        """
        if not self._protected:
            return
        ids, guarded, names = self._protection_now()
        hit = names.get((_identity(os.fstat(parent)), name))
        if hit is None:
            hit = next((ids[i] for i in self._ancestry(parent, rel) if i in ids), None)
        if hit is None and entry:
            try:
                st = os.stat(name, dir_fd=parent, follow_symlinks=False)
            except FileNotFoundError:
                pass
            else:
                ident = _identity(st)
                if stat_module.S_ISDIR(st.st_mode) and (ident in ids or ident in guarded):
                    hit = ids.get(ident, self._protected[0])
        if hit is not None:
            raise SandboxError(f"{rel!r}: {hit}/ is read-only to tools; refused")

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


class _TreeChanged(Exception):
    """The tree moved under a usage walk; the walk starts again."""


class _Seen(set[_Identity]):
    """The hard links a walk has counted, and how many names its next ``_scan`` may read."""

    limit: int | None = None


def _scan(fd: int, links: set[_Identity]) -> tuple[list[str], int, int]:
    """Names of the subdirectories of ``fd``, the bytes its other entries take, and how
    many entries it holds (each name once: a hard link's blocks count once, its names
    each). It stops once it has counted more than ``links.limit`` names (a ``_Seen``): one directory of
    millions of hard links (names without inodes, which no free-inode bound sees) then
    costs no more than one just over ``max_files``."""
    subdirs: list[str] = []
    total = 0
    names = 0
    limit = links.limit if isinstance(links, _Seen) else None
    with os.scandir(fd) as it:
        for entry in it:
            names += 1
            if limit is not None and names > limit:
                break
            try:
                st = entry.stat(follow_symlinks=False)
            except OSError:
                continue
            if stat_module.S_ISDIR(st.st_mode):
                subdirs.append(entry.name)
                continue
            if st.st_nlink > 1:
                ident = _identity(st)
                if ident in links:
                    continue  # a hard link counts once
                links.add(ident)
            total += _disk_bytes(st)
    return subdirs, total, names


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
