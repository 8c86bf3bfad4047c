"""FileStore's blocking file operations; the store runs them in worker threads.

Layout under the store root::

    <project>/<session_id>/transcript.jsonl     the main transcript
    <project>/<session_id>/summary.json         its summary (derived, rebuildable)
    <project>/<session_id>/sub/<subpath>.jsonl  child transcripts
    <project>/<session_id>/quarantine/...       damaged files set aside by repair

Names the store makes for itself (temporary files, directories being
deleted) contain ``#``, which no valid id does, so they never collide with a
session and listing skips them.

Below the root, nothing is reached through a symbolic link: directories are
opened one component at a time with ``O_NOFOLLOW`` from the root's fd, and
files with ``O_NOFOLLOW`` relative to their directory's fd (``open_dir``,
``open_file``). A link planted in place of a session directory or a
transcript is refused (``StoreError``) instead of redirecting a write. The
root itself is the user's choice and may be a link.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import os
import secrets
import shutil
import stat
import time
from collections.abc import Iterator

import attrs

from ..errors import CorruptTranscript, StoreError
from ..messages import converter
from ._entries import Entry, decode_line
from ._key import _NAME, SessionKey
from ._summary import SessionInfo, SessionSummary, SummaryBuilder, SummaryData

TRANSCRIPT = "transcript.jsonl"
SUMMARY = "summary.json"
SUB = "sub"
QUARANTINE = "quarantine"
SUMMARY_VERSION = 1
# Beside the summary of a long main transcript: what the scan on open would
# find (uuids, line count), so reopening it reads only what was appended since.
CHECKPOINT = "#checkpoint.json"
CHECKPOINT_VERSION = 1
# Below this size a transcript is scanned whole on open (a few ms at most);
# from it on, closing it writes a checkpoint.
CHECKPOINT_MIN_BYTES = 256 * 1024

_CHUNK = 1 << 20
_O_CLOEXEC = getattr(os, "O_CLOEXEC", 0)


def is_session_name(name: str) -> bool:
    return _NAME.fullmatch(name) is not None and name not in (".", "..")


def session_dir(root: str, key: SessionKey) -> str:
    return os.path.join(root, key.project, key.session_id)


def transcript_path(root: str, key: SessionKey) -> str:
    sdir = session_dir(root, key)
    if key.subpath is None:
        return os.path.join(sdir, TRANSCRIPT)
    return os.path.join(sdir, SUB, *key.subpath.split("/")) + ".jsonl"


_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | _O_CLOEXEC


def _link_refused(path: str, exc: OSError) -> StoreError:
    return StoreError(f"{path}: a symbolic link (or not a directory) in the store; refused")


def open_dir(root: str, path: str, *, create: bool = False, durable: bool = False) -> int:
    """An fd on directory ``path`` beneath ``root``, no link followed below ``root``.

    With ``create``, missing directories are made (mode 0700; with ``durable``,
    each new entry is fsynced).

    Raises:
        FileNotFoundError: a directory is missing and not ``create``.
        StoreError: a component below the root is a symbolic link or not a directory.
    """
    rel = os.path.relpath(path, root)
    parts = [] if rel == "." else rel.split(os.sep)
    if ".." in parts:
        raise StoreError(f"{path}: outside the store root {root}")
    if create:
        os.makedirs(root, 0o700, exist_ok=True)  # the root is the user's: links allowed
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | _O_CLOEXEC)
    try:
        for part in parts:
            try:
                next_fd = os.open(part, _DIR_FLAGS, dir_fd=fd)
            except FileNotFoundError:
                if not create:
                    raise
                try:
                    os.mkdir(part, 0o700, dir_fd=fd)
                    if durable:
                        os.fsync(fd)
                except FileExistsError:
                    pass
                next_fd = os.open(part, _DIR_FLAGS, dir_fd=fd)
            except OSError as exc:
                if exc.errno in (errno.ELOOP, errno.ENOTDIR):
                    raise _link_refused(path, exc) from None
                raise
            os.close(fd)
            fd = next_fd
    except BaseException:
        os.close(fd)
        raise
    return fd


def open_file(
    root: str,
    path: str,
    flags: int,
    mode: int = 0o600,
    *,
    create_dirs: bool = False,
    durable: bool = False,
) -> int:
    """``os.open`` of ``path`` beneath ``root``, no link followed below ``root``.

    Raises:
        FileNotFoundError, NotADirectoryError: as ``os.open`` (a missing directory too).
        StoreError: a link in the way.
    """
    dfd = open_dir(root, os.path.dirname(path), create=create_dirs, durable=durable)
    try:
        return os.open(os.path.basename(path), flags | os.O_NOFOLLOW | _O_CLOEXEC, mode, dir_fd=dfd)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise _link_refused(path, exc) from None
        raise
    finally:
        os.close(dfd)


def open_regular(
    root: str,
    path: str,
    flags: int,
    mode: int = 0o600,
    *,
    create_dirs: bool = False,
    durable: bool = False,
) -> int:
    """``open_file`` of a regular file: never blocks on, nor returns, anything else.

    Opened ``O_NONBLOCK`` (a FIFO a careless process left at the path would
    block the open until some writer opened it), then refused unless
    ``fstat`` says regular file; ``O_NONBLOCK`` is cleared again.

    Raises:
        FileNotFoundError, NotADirectoryError: as ``os.open``.
        StoreError: a link in the way, or not a regular file at ``path``.
    """
    fd = open_file(
        root, path, flags | os.O_NONBLOCK, mode, create_dirs=create_dirs, durable=durable
    )
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise StoreError(f"{path}: not a regular file; refused")
        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_NONBLOCK)
    except BaseException:
        os.close(fd)
        raise
    return fd


def fsync_dir(root: str, path: str) -> None:
    fd = open_dir(root, path)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# -- reading -----------------------------------------------------------------


class LineReader:
    """Reads a transcript's whole appends from an fd, up to ``limit`` bytes.

    An append of several entries is written as lines that all but the last
    begin with a space (JSON ignores it), so an append cut short by a crash
    is recognisable even when some of its lines are complete. What follows
    the last finished append (a torn line, or the lines of an unfinished
    append) is never returned, and ``good_end`` stops before it.

    Every append returned comes whole from one ``pread``: bytes after an
    unfinished append are never joined to the ones read before. Between two
    reads the next lock holder may cut a dead writer's torn tail and append
    in its place, and the old tail followed by the middle of the new append
    can look like a line (even valid JSON: an entry nobody appended). So
    when a read ends inside an append, the next one starts again at the end
    of the last finished append (``good_end``), reading more each time an
    append is longer than what was read. EOF is a ``pread`` at the end of
    what was read returning nothing.
    """

    def __init__(
        self, fd: int, path: str, limit: int | None = None, *, start: int = 0, lineno: int = 0
    ) -> None:
        self.fd = fd
        self.path = path
        self.limit = limit
        self.offset = start  # the end of what was read; ``start`` is the end of an append
        self.good_end = start  # end of the last finished append
        self.lineno = lineno  # lines before ``start``
        self.good_lines = lineno  # lines up to ``good_end``
        self.good_line = b""  # the last line before ``good_end`` (b"" if none was read)
        self.eof = False

    def _more(self) -> bool:
        """Whether the file has bytes (within ``limit``) after what was read."""
        if self.limit is not None and self.offset >= self.limit:
            return False
        return bool(os.pread(self.fd, 1, self.offset))

    def read(self, max_bytes: int = _CHUNK) -> Iterator[tuple[int, bytes]]:
        """Lines (``lineno``, ``line``) of the finished appends in the next ``max_bytes`` or so."""
        budget = max_bytes
        while not self.eof and budget > 0:
            begin = self.good_end
            unfinished = self.offset - begin  # bytes of an append under way, read before
            if unfinished and not self._more():
                self.eof = True
                break
            want = max(_CHUNK, 2 * unfinished)
            if self.limit is not None:
                want = min(want, self.limit - begin)
            chunk = os.pread(self.fd, want, begin) if want > 0 else b""
            if not chunk:
                self.offset = begin
                self.eof = True
                break
            self.offset = begin + len(chunk)
            budget -= len(chunk)
            lineno = self.good_lines
            unfinished_lines: list[tuple[int, bytes]] = []  # of the append being parsed
            start = 0
            end = chunk.find(b"\n")
            while end >= 0:
                lineno += 1
                line = chunk[start : end + 1]
                start = end + 1
                if line[:1] == b" ":
                    unfinished_lines.append((lineno, line))
                else:  # the last line of an append
                    if unfinished_lines:
                        yield from unfinished_lines
                        unfinished_lines.clear()
                    yield lineno, line
                    self.good_end = begin + start
                    self.good_lines = lineno
                    self.good_line = line
                end = chunk.find(b"\n", start)
            self.lineno = lineno

    @property
    def torn_bytes(self) -> int:
        """Bytes after the last finished append (meaningful once ``eof``)."""
        return self.offset - self.good_end

    def entries(self, max_bytes: int = _CHUNK, first: int = 0) -> list[Entry]:
        """The entries in the next ``max_bytes`` or so, but none of the first ``first``
        of the file (those lines are counted, not decoded)."""
        return [decode_line(line, self.path, n) for n, line in self.read(max_bytes) if n > first]


@attrs.frozen
class Position:
    """Where an append ended in a transcript: ``lines`` entries, ``offset`` bytes, and
    the length and digest of the line ending there, to recognise the spot again.

    The file's identity alone proves nothing once it is closed: a deleted file's
    inode number is handed to the next file created (ext4 does so at once).
    """

    dev: int
    ino: int
    lines: int
    offset: int
    line_len: int
    digest: bytes


def line_digest(line: bytes) -> bytes:
    return hashlib.blake2b(line, digest_size=16).digest()


def position_of(st: os.stat_result, reader: LineReader) -> Position | None:
    """The end of the last finished append ``reader`` read, if it read one."""
    line = reader.good_line
    if not line:
        return None
    return Position(
        st.st_dev, st.st_ino, reader.good_lines, reader.good_end, len(line), line_digest(line)
    )


def position_holds(fd: int, st: os.stat_result, pos: Position) -> bool:
    """Whether ``pos`` is still true of the file ``fd`` (``st``): the same file
    identity, and the very line it remembers ending at its offset, whole (a line
    start or the file's start before it)."""
    begin = pos.offset - pos.line_len
    if (st.st_dev, st.st_ino) != (pos.dev, pos.ino) or begin < 0 or pos.offset > st.st_size:
        return False
    lead = 1 if begin else 0
    data = os.pread(fd, pos.line_len + lead, begin - lead)
    if len(data) != pos.line_len + lead or (lead and data[:1] != b"\n"):
        return False
    return line_digest(data[lead:]) == pos.digest


def batch_bytes(lines: list[bytes]) -> bytes:
    """The bytes of one append: see ``LineReader`` for the leading spaces."""
    if len(lines) == 1:
        return lines[0]
    return b" " + b" ".join(lines[:-1]) + lines[-1]


def open_for_read(root: str, path: str) -> int | None:
    try:
        return open_regular(root, path, os.O_RDONLY)
    except (FileNotFoundError, NotADirectoryError):
        return None


class FdOwner:
    """An fd handed to a worker thread: closed exactly once, by whoever holds it last."""

    def __init__(self, fd: int) -> None:
        self._fd: int | None = fd

    def take(self) -> int:
        fd = self._fd
        if fd is None:
            raise StoreError("file already closed")
        return fd

    def close(self) -> None:
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)


def read_all(owner: FdOwner, path: str, limit: int | None) -> list[Entry] | None:
    """Every complete line's entry, or ``None`` when there is none."""
    try:
        reader = LineReader(owner.take(), path, limit)
        entries = reader.entries(max_bytes=1 << 62)
    finally:
        owner.close()
    return entries if entries else None


# -- opening for append ------------------------------------------------------


@attrs.define
class StoredSummary:
    """summary.json: a summary and the transcript state it was folded from."""

    version: int
    session_id: str
    transcript_size: int
    mtime_ms: int
    data: SummaryData


def read_summary(root: str, path: str) -> StoredSummary | None:
    """The summary stored at ``path``; ``None`` when missing or unreadable."""
    try:
        with open(open_regular(root, path, os.O_RDONLY), "rb") as f:
            raw = json.loads(f.read())
        stored = converter.structure(raw, StoredSummary)
    except Exception:  # missing, torn, hand-edited: all mean "rebuild it"
        return None
    return stored if stored.version == SUMMARY_VERSION else None


def write_summary(root: str, sdir: str, stored: StoredSummary, *, durable: bool) -> None:
    """Replace ``<sdir>/summary.json`` atomically: temp file, fsync, rename."""
    data = json.dumps(converter.unstructure(stored), separators=(",", ":")).encode()
    _replace(root, sdir, SUMMARY, data, durable=durable)


def _replace(root: str, sdir: str, name: str, data: bytes, *, durable: bool) -> None:
    """Replace ``<sdir>/<name>`` with ``data`` atomically: temp file, fsync, rename."""
    tmp = f"#summary-{secrets.token_hex(6)}.tmp"  # swept by that name after a crash
    dfd = open_dir(root, sdir)
    try:
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | _O_CLOEXEC
        fd = os.open(tmp, flags, 0o600, dir_fd=dfd)
        try:
            try:
                view = memoryview(data)
                while view:  # OSError (a full disk) is the caller's
                    view = view[os.write(fd, view) :]
                os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, name, src_dir_fd=dfd, dst_dir_fd=dfd)
        except BaseException:
            try:
                os.unlink(tmp, dir_fd=dfd)
            except OSError:
                pass
            raise
        if durable:
            os.fsync(dfd)
    finally:
        os.close(dfd)


@attrs.define
class Checkpoint:
    """#checkpoint.json: the scan of the first ``size`` bytes of the transcript
    file ``(dev, ino)``. Those bytes never change while the file is that file
    (appends only add; a repair writes a new file), so it stays true for it."""

    version: int
    dev: int
    ino: int
    size: int
    lines: int
    last_len: int
    uuids: list[str]


def read_checkpoint(root: str, sdir: str) -> Checkpoint | None:
    """The checkpoint in ``sdir``; ``None`` when missing, unreadable or of another version."""
    try:
        with open(open_regular(root, os.path.join(sdir, CHECKPOINT), os.O_RDONLY), "rb") as f:
            raw = json.loads(f.read())
        if not (isinstance(raw, dict) and raw.get("version") == CHECKPOINT_VERSION):
            return None
        uuids = raw["uuids"]
        fields = (raw["dev"], raw["ino"], raw["size"], raw["lines"], raw["last_len"])
        if not (
            all(type(v) is int and v >= 0 for v in fields)
            and type(uuids) is list
            and all(type(u) is str for u in uuids)
        ):
            return None
        return Checkpoint(CHECKPOINT_VERSION, *fields, uuids)
    except Exception:  # missing, torn, hand-edited: all mean "scan it all"
        return None


def write_checkpoint(root: str, sdir: str, checkpoint: Checkpoint, *, durable: bool) -> None:
    data = json.dumps(attrs.asdict(checkpoint), separators=(",", ":")).encode()
    _replace(root, sdir, CHECKPOINT, data, durable=durable)


@attrs.define
class Opened:
    """A transcript opened for appending, as the scan on open found it."""

    fd: int
    dev: int
    ino: int
    size: int
    lines: int
    uuids: set[str]
    summary: SummaryBuilder | None
    mtime_ms: int
    summary_dirty: bool
    last_len: int = 0  # bytes of the line ending at ``size`` (0: none)


def _scan(
    fd: int, path: str, *, main: bool, truncate: bool, durable: bool
) -> tuple[int, int, int, set[str], SummaryBuilder | None]:
    """Check every line, collect uuids, fold the summary, and (with ``truncate``)
    cut off what follows the last finished append.

    Raises:
        CorruptTranscript: a complete line is not a JSON object with a ``type``.
    """
    reader = LineReader(fd, path)
    uuids: set[str] = set()
    summary = SummaryBuilder() if main else None
    while not reader.eof:
        for entry in reader.entries():
            uuid = entry.get("uuid")
            if isinstance(uuid, str):
                uuids.add(uuid)
            if summary is not None:
                summary.add(entry)
    if reader.torn_bytes and truncate:
        os.ftruncate(fd, reader.good_end)
        if durable:
            os.fsync(fd)
    return reader.good_end, reader.good_lines, len(reader.good_line), uuids, summary


def _resume(
    root: str, key: SessionKey, fd: int, path: str, stored: StoredSummary, *, durable: bool
) -> tuple[int, int, int, set[str], SummaryBuilder] | None:
    """What ``_scan`` would find, from the checkpoint and the stored summary of
    the same first bytes plus a scan of what follows them; ``None``: scan it all."""
    checkpoint = read_checkpoint(root, session_dir(root, key))
    if checkpoint is None or checkpoint.size != stored.transcript_size:
        return None
    st = os.fstat(fd)
    if (checkpoint.dev, checkpoint.ino) != (st.st_dev, st.st_ino) or st.st_size < checkpoint.size:
        return None  # another file (repaired), or cut shorter than we know: not ours to trust
    uuids = set(checkpoint.uuids)
    summary = SummaryBuilder(stored.data)
    tail = read_tail(fd, path, checkpoint.size, checkpoint.lines, durable=durable)
    for entry in tail.entries:
        uuid = entry.get("uuid")
        if isinstance(uuid, str):
            uuids.add(uuid)
        summary.add(entry)
    last_len = tail.last_len if tail.entries else checkpoint.last_len
    return tail.end, tail.lines, last_len, uuids, summary


def open_transcript(
    root: str, key: SessionKey, *, durable: bool, create: bool = True, truncate: bool = True
) -> Opened:
    """Open (with ``create``, creating if needed) ``key``'s transcript for appending.

    The caller holds the session's lock (``SessionFlock``): only a lock
    holder may cut a file, since anyone else may be looking at another
    process's append half-way through its ``write()``. What follows the last finished append (a torn line, an unfinished
    append) is truncated away; the summary is rebuilt from the transcript,
    and marked dirty when the stored one does not match.

    Raises:
        CorruptTranscript: damage before the last line.
        FileNotFoundError: there is no transcript and not ``create``.
        OSError: the file system refused.
    """
    path = transcript_path(root, key)
    flags = os.O_RDWR | os.O_APPEND
    try:
        fd = open_regular(root, path, flags)
        created = False
    except FileNotFoundError:
        if not create:
            raise
        fd = open_regular(root, path, flags | os.O_CREAT, create_dirs=True, durable=durable)
        created = True
        if durable:
            fsync_dir(root, os.path.dirname(path))
    try:
        size = lines = last_len = 0
        uuids: set[str] = set()
        summary = SummaryBuilder() if key.is_main else None
        stored = None
        if summary is not None and not created:
            stored = read_summary(root, os.path.join(session_dir(root, key), SUMMARY))
        resumed = None
        if stored is not None and truncate:  # only a lock holder may cut a torn tail
            resumed = _resume(root, key, fd, path, stored, durable=durable)
        if resumed is not None:
            size, lines, last_len, uuids, summary = resumed
        elif not created:
            size, lines, last_len, uuids, summary = _scan(
                fd, path, main=key.is_main, truncate=truncate, durable=durable
            )
        st = os.fstat(fd)
        mtime_ms = st.st_mtime_ns // 1_000_000 if size else 0
        dirty = False
        if summary is not None:
            if stored is not None:
                mtime_ms = max(mtime_ms, stored.mtime_ms)
            dirty = size > 0 and (
                stored is None
                or stored.transcript_size != size
                or stored.mtime_ms != mtime_ms
                or stored.data != summary.data()
            )
        return Opened(
            fd, st.st_dev, st.st_ino, size, lines, uuids, summary, mtime_ms, dirty, last_len
        )
    except BaseException:
        os.close(fd)
        raise


def write_all(fd: int, data: bytes, size_before: int, *, written: bool = False) -> None:
    """Append ``data`` with as few ``write()`` calls as the OS allows; all or nothing.

    With ``written``, some prefix of ``data`` is already in the file (a short
    write): the file's size says how much.

    Raises:
        StoreError: the write failed; the file was cut back to ``size_before``.
    """
    try:
        done = os.fstat(fd).st_size - size_before if written else os.write(fd, data)
        view = memoryview(data)[done:]
        while view:  # a short write happens only on a full disk or a signal
            view = view[os.write(fd, view) :]
    except OSError as exc:
        cut_back(fd, size_before)
        raise StoreError(f"append failed: {exc}") from exc


def cut_back(fd: int, size: int) -> None:
    """Truncate a failed append away; if even that fails, the next open will."""
    try:
        os.ftruncate(fd, size)
    except OSError:
        pass


def close_transcript(
    root: str,
    key: SessionKey,
    fd: int,
    *,
    size: int,
    summary: SummaryBuilder | None,
    mtime_ms: int,
    dirty: bool,
    durable: bool,
    lines: int = 0,
    last_len: int = 0,
    uuids: set[str] | None = None,
) -> None:
    """Stamp the file's mtime, store the summary (and, for a long transcript
    with its ``uuids`` given, the checkpoint), close. Best effort: the summary,
    checkpoint and mtime are derived data, rebuilt on the next open if lost.

    Only when the file is still ``size`` bytes long: if another process
    appended since, this summary is behind and its mtime older than the
    file's, and leaving both alone lets the next listing rebuild them.
    """
    try:
        st = os.fstat(fd)
        if dirty and size and st.st_size == size:
            ns = mtime_ms * 1_000_000
            os.utime(fd, ns=(ns, ns))
            if summary is not None:
                sdir = session_dir(root, key)
                if uuids is not None and size >= CHECKPOINT_MIN_BYTES:
                    # Before the summary: a checkpoint is used only beside a
                    # summary of the same size, so a crash between leaves none.
                    checkpoint = Checkpoint(
                        CHECKPOINT_VERSION, st.st_dev, st.st_ino, size, lines, last_len,
                        list(uuids),
                    )  # fmt: skip
                    write_checkpoint(root, sdir, checkpoint, durable=durable)
                stored = StoredSummary(
                    SUMMARY_VERSION, key.session_id, size, mtime_ms, summary.data()
                )
                write_summary(root, sdir, stored, durable=durable)
    except OSError:
        pass
    finally:
        os.close(fd)


# -- listing -----------------------------------------------------------------


def _stat_transcripts(root: str, project_dir: str) -> Iterator[tuple[str, os.stat_result]]:
    try:
        dfd = open_dir(root, project_dir)
    except (FileNotFoundError, NotADirectoryError):
        return
    try:
        for name in os.listdir(dfd):
            if not is_session_name(name):
                if name.startswith("#deleted-"):
                    sweep_deleted(dfd, name)
                continue
            try:
                # A session directory that is a link is not listed (it is refused when used).
                if not stat.S_ISDIR(os.stat(name, dir_fd=dfd, follow_symlinks=False).st_mode):
                    continue
                st = os.stat(f"{name}/{TRANSCRIPT}", dir_fd=dfd, follow_symlinks=False)
            except (FileNotFoundError, NotADirectoryError):
                continue
            if st.st_size and stat.S_ISREG(st.st_mode):
                yield name, st
    finally:
        os.close(dfd)


def list_sessions(root: str, project_dir: str) -> list[SessionInfo]:
    """Sessions with a non-empty transcript, from directory metadata only."""
    return [
        SessionInfo(name, st.st_mtime_ns // 1_000_000)
        for name, st in _stat_transcripts(root, project_dir)
    ]


def list_summaries(root: str, project_dir: str) -> tuple[list[SessionSummary], list[str]]:
    """Stored summaries that match their transcript, and the ids whose do not."""
    good: list[SessionSummary] = []
    stale: list[str] = []
    for name, st in _stat_transcripts(root, project_dir):
        stored = read_summary(root, os.path.join(project_dir, name, SUMMARY))
        if (
            stored is None
            or stored.session_id != name
            or stored.transcript_size != st.st_size
            or stored.mtime_ms < st.st_mtime_ns // 1_000_000
        ):
            stale.append(name)
        else:
            good.append(SessionSummary(name, stored.mtime_ms, stored.data))
    return good, stale


def rebuild_summary(root: str, key: SessionKey, *, durable: bool) -> SessionSummary | None:
    """Fold ``key``'s transcript into a summary, and store it if the session is free.

    Reads whole appends only. When this call can take the session's lock
    without waiting, it also cuts a torn tail and replaces summary.json;
    otherwise (a writer holds it, maybe in this very process) it stores
    nothing and cuts nothing.

    Raises:
        CorruptTranscript: damage before the last line.
    """
    try:
        dfd = open_dir(root, session_dir(root, key))
    except (FileNotFoundError, NotADirectoryError):
        return None
    try:  # dfd is a description of our own: its flock is this call's alone
        locked = try_flock(dfd) and session_is_at(root, key, dfd)
        try:
            opened = open_transcript(root, key, durable=durable, create=False, truncate=locked)
        except (FileNotFoundError, NotADirectoryError):
            return None
        summary = opened.summary
        assert summary is not None
        close_transcript(
            root,
            key,
            opened.fd,
            size=opened.size,
            summary=summary,
            mtime_ms=opened.mtime_ms,
            dirty=locked,
            durable=durable,
        )
    finally:
        os.close(dfd)  # releases the lock
    if not opened.size:
        return None
    return SessionSummary(key.session_id, opened.mtime_ms, summary.data())


# -- the session lock ----------------------------------------------------------


def try_flock(fd: int) -> bool:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


def open_session_dir(root: str, key: SessionKey, *, create: bool, durable: bool) -> int:
    """An fd on ``key``'s session directory, the thing ``SessionFlock`` locks.

    Raises:
        FileNotFoundError: no such session and not ``create``.
        StoreError: a link in the way.
    """
    return open_dir(root, session_dir(root, key), create=create, durable=durable)


def session_is_at(root: str, key: SessionKey, fd: int) -> bool:
    """Whether ``fd`` is still the directory at ``key``'s session path.

    A lock on a directory that was renamed aside (deleted) protects nothing:
    whoever takes the lock checks this before trusting it.
    """
    st = os.fstat(fd)
    try:
        now = os.stat(session_dir(root, key), follow_symlinks=False)
    except (FileNotFoundError, NotADirectoryError):
        return False
    return (now.st_ino, now.st_dev) == (st.st_ino, st.st_dev) and st.st_nlink > 0


def transcript_stat(path: str) -> os.stat_result | None:
    """The file now at ``path`` (``None`` if none): an append checks its fd is still it."""
    try:
        return os.stat(path, follow_symlinks=False)
    except (FileNotFoundError, NotADirectoryError):
        return None


@attrs.define
class Tail:
    """Whole appends another process made after the end this process knew."""

    entries: list[Entry]
    end: int
    lines: int
    mtime_ms: int
    last_len: int  # bytes of the line ending at ``end`` (0: none read)


def read_tail(fd: int, path: str, start: int, lineno: int, *, durable: bool) -> Tail:
    """The entries after byte ``start`` (line ``lineno``), the caller holding the lock.

    A torn tail there is an append whose writer died: nobody else can be
    writing, so it is cut.

    Raises:
        CorruptTranscript: a complete line is not an entry.
    """
    reader = LineReader(fd, path, start=start, lineno=lineno)
    entries: list[Entry] = []
    while not reader.eof:
        entries += reader.entries()
    if reader.torn_bytes:
        os.ftruncate(fd, reader.good_end)
        if durable:
            os.fsync(fd)
    mtime_ms = os.fstat(fd).st_mtime_ns // 1_000_000
    return Tail(entries, reader.good_end, reader.good_lines, mtime_ms, len(reader.good_line))


# Leftovers younger than this may belong to a writer that does not hold the
# lock (a summary written on close): they are left alone.
_LEFTOVER_AGE_S = 60.0


def sweep_leftovers(dfd: int, *, now: float | None = None) -> int:
    """Remove ``#summary-*.tmp`` / ``#repair-*.tmp`` that a crash left in directory ``dfd``.

    Best effort; returns how many were removed.
    """
    cutoff = (time.time() if now is None else now) - _LEFTOVER_AGE_S
    removed = 0
    try:
        names = [n for n in os.listdir(dfd) if n.startswith("#") and n.endswith(".tmp")]
    except OSError:
        return 0
    for name in names:
        try:
            if os.stat(name, dir_fd=dfd, follow_symlinks=False).st_mtime < cutoff:
                os.unlink(name, dir_fd=dfd)
                removed += 1
        except OSError:
            pass
    return removed


def sweep_deleted(dfd: int, name: str) -> None:
    """Finish removing ``#deleted-*`` (a delete that crashed after its rename).

    Nobody appends there: an append checks that its session directory is
    still at its name.
    """
    shutil.rmtree(name, dir_fd=dfd, ignore_errors=True)
    try:
        os.rmdir(name, dir_fd=dfd)
    except OSError:
        pass


def list_subkeys(root: str, key: SessionKey) -> list[str]:
    base = os.path.join(session_dir(root, key), SUB)
    out: list[str] = []

    def walk(directory: str, prefix: str) -> None:
        try:
            fd = open_dir(root, directory)
        except (FileNotFoundError, NotADirectoryError, StoreError):
            return
        try:  # an fd-based scandir entry stats through the fd: use it while it is open
            entries = [
                (
                    e.name,
                    e.is_dir(follow_symlinks=False),
                    e.is_file(follow_symlinks=False) and e.stat(follow_symlinks=False).st_size > 0,
                )
                for e in os.scandir(fd)
            ]
        finally:
            os.close(fd)
        for name, is_dir, non_empty_file in entries:
            if is_dir:
                if is_session_name(name):
                    walk(os.path.join(directory, name), f"{prefix}{name}/")
            elif name.endswith(".jsonl") and is_session_name(name[: -len(".jsonl")]):
                if non_empty_file:
                    out.append(prefix + name[: -len(".jsonl")])

    walk(base, "")
    below = "" if key.subpath is None else key.subpath + "/"
    return sorted(s for s in out if s.startswith(below))


# -- deleting and repairing --------------------------------------------------


def delete_session(root: str, key: SessionKey, *, durable: bool) -> bool:
    """Remove a session directory: renamed aside first, so a crash never leaves half.

    A session "directory" that is a link is removed as a link: nothing it points
    to is touched.
    """
    sdir = session_dir(root, key)
    try:
        dfd = open_dir(root, os.path.dirname(sdir))
    except (FileNotFoundError, NotADirectoryError):
        return False
    doomed = f"#deleted-{secrets.token_hex(8)}"
    try:
        try:
            os.rename(key.session_id, doomed, src_dir_fd=dfd, dst_dir_fd=dfd)
        except (FileNotFoundError, NotADirectoryError):
            return False
        if durable:
            os.fsync(dfd)
        if stat.S_ISLNK(os.stat(doomed, dir_fd=dfd, follow_symlinks=False).st_mode):
            os.unlink(doomed, dir_fd=dfd)
        else:
            shutil.rmtree(doomed, dir_fd=dfd, ignore_errors=True)
    finally:
        os.close(dfd)
    return True


def delete_subkey(root: str, key: SessionKey, *, durable: bool) -> bool:
    path = transcript_path(root, key)
    try:
        dfd = open_dir(root, os.path.dirname(path))
    except (FileNotFoundError, NotADirectoryError):
        return False
    try:
        os.unlink(os.path.basename(path), dir_fd=dfd)
        if durable:
            os.fsync(dfd)
    except (FileNotFoundError, NotADirectoryError):
        return False
    finally:
        os.close(dfd)
    stop = os.path.join(session_dir(root, key), SUB)
    parent = os.path.dirname(path)
    while len(parent) >= len(stop):  # tidy directories left empty, up to sub/
        try:
            dfd = open_dir(root, os.path.dirname(parent))
            try:
                os.rmdir(os.path.basename(parent), dir_fd=dfd)
            finally:
                os.close(dfd)
        except (OSError, StoreError):
            break
        parent = os.path.dirname(parent)
    return True


def _exists(root: str, path: str) -> bool:
    try:
        dfd = open_dir(root, os.path.dirname(path))
    except (FileNotFoundError, NotADirectoryError):
        return False
    try:
        os.stat(os.path.basename(path), dir_fd=dfd, follow_symlinks=False)
        return True
    except FileNotFoundError:
        return False
    finally:
        os.close(dfd)


@attrs.frozen
class RepairReport:
    """What ``FileStore.repair`` did to one transcript.

    ``quarantined`` is where the damaged file now is (``None`` when nothing
    was damaged mid-file); ``kept`` is the number of entries left in place;
    ``first_bad_line`` the line where the damage starts; ``torn_bytes`` what
    was cut from an unfinished last line.
    """

    path: str
    kept: int
    first_bad_line: int | None = None
    quarantined: str | None = None
    torn_bytes: int = 0


def repair_transcript(root: str, key: SessionKey, *, durable: bool) -> RepairReport | None:
    """Set a damaged transcript aside and keep its good prefix in its place.

    The damaged file stays whole under ``quarantine/``: nothing is deleted.
    Returns ``None`` when the transcript does not exist.
    """
    path = transcript_path(root, key)
    try:
        fd = open_regular(root, path, os.O_RDWR)
    except (FileNotFoundError, NotADirectoryError):
        return None
    try:
        reader = LineReader(fd, path)
        kept = good_end = 0  # entries and bytes up to the last good append
        count = pos = 0
        bad_line = None
        try:
            while not reader.eof:
                for lineno, line in reader.read():
                    decode_line(line, path, lineno)
                    count += 1
                    pos += len(line)
                    if line[:1] != b" ":
                        kept, good_end = count, pos
        except CorruptTranscript as exc:
            bad_line = exc.line
        if bad_line is None:
            torn = reader.torn_bytes
            if torn:
                os.ftruncate(fd, reader.good_end)
                if durable:
                    os.fsync(fd)
            return RepairReport(path, kept, torn_bytes=torn)
        sdir = session_dir(root, key)
        stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
        rel = os.path.relpath(path, sdir)
        dest_dir = os.path.join(sdir, QUARANTINE, stamp)
        n = 1
        while _exists(root, os.path.join(dest_dir, rel)):
            n += 1
            dest_dir = os.path.join(sdir, QUARANTINE, f"{stamp}-{n}")
        dest = os.path.join(dest_dir, rel)
        dest_fd = open_dir(root, os.path.dirname(dest), create=True, durable=durable)
        parent_fd = -1
        try:
            parent_fd = open_dir(root, os.path.dirname(path))
            name = os.path.basename(path)
            tmp = f"#repair-{secrets.token_hex(6)}.tmp"
            flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | _O_CLOEXEC
            out = os.open(tmp, flags, 0o600, dir_fd=parent_fd)
            try:
                copied = 0
                while copied < good_end:
                    chunk = os.pread(fd, min(_CHUNK, good_end - copied), copied)
                    os.write(out, chunk)
                    copied += len(chunk)
                os.fsync(out)
            finally:
                os.close(out)
            # A second name for the damaged file first, then swap the good prefix
            # in: at every moment every byte is reachable under some name.
            os.link(
                name,
                os.path.basename(dest),
                src_dir_fd=parent_fd,
                dst_dir_fd=dest_fd,
                follow_symlinks=False,
            )
            os.replace(tmp, name, src_dir_fd=parent_fd, dst_dir_fd=parent_fd)
            if durable:
                os.fsync(dest_fd)
                os.fsync(parent_fd)
        finally:
            os.close(dest_fd)
            if parent_fd >= 0:
                os.close(parent_fd)
        if key.is_main:
            sfd = open_dir(root, sdir)
            try:
                os.unlink(SUMMARY, dir_fd=sfd)
            except FileNotFoundError:
                pass
            finally:
                os.close(sfd)
        return RepairReport(path, kept, first_bad_line=bad_line, quarantined=dest)
    finally:
        os.close(fd)
