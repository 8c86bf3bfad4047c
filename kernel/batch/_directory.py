"""A run's ledger as files in one directory: one process runs it (``DirectoryLedger``).

::

    async with open_run_dir("runs/eval-1") as ledger:
        summary = await run_batch(kernel, tasks, ledger=ledger)

The directory holds:

- ``manifest.json``: the run id, its nonce (which names its sessions), when
  it was created, and the run's settings (``RunManifest``; the CLI keeps
  model, concurrency and limits there);
- ``tasks.jsonl``: one ``BatchTask`` per line, in task order;
- ``results.jsonl``: one ``TaskResult`` per line, appended and fsynced (in a
  thread) before ``finish`` returns: a SIGKILL loses no result ``finish``
  acknowledged (guarantee 4 of ``kernel.batch._ledger``);
- ``claims.jsonl``: one line per claim (which attempt a task is on; flushed,
  not fsynced: it only counts attempts);
- ``workspaces/<task id>/``: each task's workspace;
- ``lock``: held (``flock``) by the process running the run, with its pid, so
  a second process is refused with the pid that holds it. The lock goes with
  the process, however it ends.

A crash can tear the last line of an append-only file (the line was being
written). Reopening cuts such a line off, logs that it did, and goes on: the
line was never acknowledged. Any other line that does not parse is an error
naming the file and line.

A write that fails (a full disk) fails the call that made it, with the
``OSError`` naming the file; the file is left as it was. Each write runs in
a thread of its own, outside trio's shared thread limiter (threads a run's
scorers or tools left hanging never hold it up), and is waited for at most
``WRITE_S`` seconds of real time (a test's virtual clock does not cut it
short): a write that does not return by then (a hung disk) is abandoned, and
the file takes no more lines in this process (what became of the abandoned
ones is read on reopening).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import heapq
import json
import logging
import os
import stat
import threading
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs
import cattrs
import outcome
import trio

from kernel._checks import check_positive
from kernel.errors import UsageError
from kernel.messages import describe_structure_error

from ._ledger import Claim, LedgerCounts
from ._records import (
    BatchTask,
    TaskResult,
    check_run_id,
    converter,
    new_run_nonce,
    session_project,
)
from ._view import RunView, model_of, where_of

logger = logging.getLogger("tak.batch")

MANIFEST = "manifest.json"
TASKS = "tasks.jsonl"
RESULTS = "results.jsonl"
CLAIMS = "claims.jsonl"
WORKSPACES = "workspaces"
LOCK = "lock"

#: A task file's lines are read whole; a line longer than this is refused
#: (and a task whose line would be longer is refused when added to a run).
MAX_LINE_BYTES = 16 * 1024 * 1024
#: How long one write (and fsync) of a run's file may take, in real seconds,
#: before it is abandoned (see the module docstring).
WRITE_S = 60.0


@attrs.frozen(kw_only=True)
class RunManifest:
    """What ``manifest.json`` holds: the run id, when it was made, its settings,
    and its nonce (``None`` in a run made before runs had one)."""

    run_id: str
    created: float  # Unix time
    settings: dict[str, Any] = attrs.field(factory=dict)
    nonce: str | None = None


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def _parse_line(line: bytes, where: str) -> Any:
    try:
        return json.loads(line, parse_constant=_refuse_constant)
    except (ValueError, UnicodeDecodeError) as exc:
        raise UsageError(f"{where}: not valid JSON ({exc})") from None


def _structure(value: Any, cls: type[Any], where: str) -> Any:
    if not isinstance(value, dict):
        raise UsageError(f"{where}: $: expected a JSON object, got {type(value).__name__}")
    try:
        return converter.structure(value, cls)
    except UsageError as exc:  # a record's own validator (a task id, a limit)
        raise UsageError(f"{where}: {exc}") from None
    except (cattrs.BaseValidationError, TypeError, ValueError) as exc:
        own = _usage_error_in(exc)
        if own is not None:
            raise UsageError(f"{where}: {own}") from None
        raise UsageError(f"{where}: {describe_structure_error(exc, '$')}") from None


def _usage_error_in(exc: BaseException) -> UsageError | None:
    """The record's own validation error (a task id, a limit) cattrs wrapped, if any:
    it already says what was wrong, in the record's words."""
    if isinstance(exc, UsageError):
        return exc
    if isinstance(exc, BaseExceptionGroup):
        for inner in exc.exceptions:
            found = _usage_error_in(inner)
            if found is not None:
                return found
    return None


def parse_tasks(lines: Sequence[bytes], name: str, *, base: Path | None = None) -> list[BatchTask]:
    """Tasks from ``tasks.jsonl`` lines (blank lines skipped); ``name`` is the file's,
    for errors; a relative ``workspace`` is made absolute against ``base`` when given.

    Raises:
        UsageError: ``NAME:LINE: $.path: what was wrong``; a duplicate id names both lines.
    """
    tasks: list[BatchTask] = []
    seen: dict[str, int] = {}
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"{name}:{number}"
        if len(line) > MAX_LINE_BYTES:
            raise UsageError(f"{where}: line longer than {MAX_LINE_BYTES} bytes")
        task: BatchTask = _structure(_parse_line(line, where), BatchTask, where)
        if base is not None and task.workspace is not None:
            seed = task.workspace
            if not seed.startswith("~") and not os.path.isabs(seed):
                task = attrs.evolve(task, workspace=os.path.normpath(base / seed))
        first = seen.get(task.id)
        if first is not None:
            raise UsageError(f"{where}: duplicate task id {task.id!r} (first at line {first})")
        seen[task.id] = number
        tasks.append(task)
    return tasks


def load_tasks(path: str | os.PathLike[str]) -> list[BatchTask]:
    """The tasks of a ``tasks.jsonl`` file, one JSON object per line (docs/batch.md).

    A relative ``workspace`` is the task file's: it is made absolute against the
    file's directory, so whoever runs or resumes the run, from wherever, copies
    the same seed.

    Blocking: call it in a thread from async code.

    Raises:
        UsageError: the file cannot be read, or ``FILE:LINE: $.path: what was wrong``.
    """
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise UsageError(f"{os.fspath(path)}: cannot read the task file: {exc.strerror}") from None
    base = Path(os.path.abspath(os.path.dirname(os.fspath(path)) or "."))
    return parse_tasks(data.split(b"\n"), os.fspath(path), base=base)


def _encode(record: Any, what: str = "a record") -> bytes:
    """One JSON line. Raises: UsageError: ``what`` holds what JSON cannot (NaN, a lone
    surrogate, an object that is not data)."""
    try:
        text = json.dumps(converter.unstructure(record), ensure_ascii=False, allow_nan=False)
        return text.encode("utf-8") + b"\n"
    except (ValueError, TypeError, UnicodeEncodeError) as exc:
        reason = " ".join(str(exc).split())
        raise UsageError(f"{what} cannot be stored: {reason}") from None


@attrs.define
class _Line:
    data: bytes
    #: Called once, by whoever learns it: True when the line is written, False
    #: when it is not (its write failed, was abandoned, or never began).
    done: Callable[[bool], None] | None = None
    written: bool = False
    error: BaseException | None = None

    @property
    def pending(self) -> bool:
        return not self.written and self.error is None

    def settle(self, error: BaseException | None) -> None:
        self.written, self.error = error is None, error
        if self.done is not None:
            self.done(error is None)


class _AppendFile:
    """An append-only JSON-lines file: whole lines, in order, optionally fsynced.

    Appends that arrive while a write is under way go together in the next one
    (one write and one fsync for all of them): 500 tasks finishing at once pay a
    few fsyncs, not 500 in a row.
    """

    def __init__(self, path: Path, *, durable: bool) -> None:
        self.path = path
        self.durable = durable
        self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o644)
        self._lock = trio.Lock()  # one write at a time, in the order the lines came
        self._queue: list[_Line] = []
        self._broken: OSError | None = None  # once a write was abandoned

    def _write(self, data: bytes) -> None:
        size = os.fstat(self._fd).st_size
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(self._fd, view) :]
            if self.durable:
                os.fsync(self._fd)
        except BaseException:
            # A half-written line must not be followed by whole ones (only a
            # torn *last* line is cut off on reopening): take it back.
            with contextlib.suppress(OSError):
                os.ftruncate(self._fd, size)
            raise

    async def _write_in_thread(self, data: bytes) -> bool:
        """``_write(data)`` in a thread of its own (not trio's shared limiter: threads
        a scorer or a tool left hanging must not hold a result up); False when it
        did not return within ``WRITE_S`` real seconds. A timer thread, not a trio
        deadline, bounds it: a test's autojumping clock must not cut an fsync short.

        Raises:
            OSError: the write failed.
        """
        token = trio.lowlevel.current_trio_token()
        done = trio.Event()
        box: list[outcome.Outcome[None]] = []

        def wake() -> None:
            with contextlib.suppress(trio.RunFinishedError):
                token.run_sync_soon(done.set)

        def deliver(result: outcome.Outcome[None]) -> None:
            box.append(result)
            wake()

        timer = threading.Timer(WRITE_S, wake)
        timer.daemon = True
        trio.lowlevel.start_thread_soon(lambda: self._write(data), deliver)
        timer.start()
        try:
            await done.wait()
        finally:
            timer.cancel()
        if not box:
            return False
        box[0].unwrap()
        return True

    async def _write_lines(self, batch: list[_Line]) -> None:
        if self._broken is None:
            try:
                written = await self._write_in_thread(b"".join(line.data for line in batch))
            except OSError as exc:
                failed = OSError(exc.errno, exc.strerror, str(self.path))
                for line in batch:
                    line.settle(failed)
                return
            if written:
                for line in batch:
                    line.settle(None)
                return
            self._broken = OSError(
                errno.EIO,
                f"a write did not return within {WRITE_S:g} s (abandoned); no more lines "
                "are written to it in this process",
                str(self.path),
            )
        for line in batch:
            line.settle(self._broken)

    async def append(self, data: bytes, done: Callable[[bool], None] | None = None) -> None:
        """Return once ``data`` is written (and fsynced when durable); ``done(True)``
        is called as it is written, ``done(False)`` if it is not.

        Not cancellable (a cancellation arrives at the caller's next checkpoint):
        a line, once queued, is written, and its caller must know it was. Bounded
        by ``WRITE_S`` instead (see the module docstring).

        Raises:
            OSError: the write failed (naming the file), or the file takes no
                more lines (a write was abandoned).
        """
        line = _Line(data, done)
        self._queue.append(line)
        with trio.CancelScope(shield=True):
            async with self._lock:
                if line.pending:
                    batch, self._queue = self._queue, []
                    await self._write_lines(batch)
        if line.error is not None:
            raise line.error

    def close(self) -> None:
        os.close(self._fd)


def _read_lines(path: Path, *, repair: bool = True) -> list[bytes]:
    """The file's whole lines; a torn last line (no newline) is cut off the file
    (``repair``), else only left out (a reader that does not hold the run: the line
    may be being written)."""
    try:
        data = _read_regular(path)
    except FileNotFoundError:
        return []
    if data and not data.endswith(b"\n") and not repair:
        data = data[: data.rfind(b"\n") + 1]
    if data and not data.endswith(b"\n"):
        keep = data.rfind(b"\n") + 1
        with open(path, "r+b") as f:
            f.truncate(keep)
            os.fsync(f.fileno())
        logger.warning(
            "%s: cut off a torn last line (%d bytes) left by a run that stopped while "
            "writing it; it was never acknowledged",
            path,
            len(data) - keep,
        )
        data = data[:keep]
    return data.split(b"\n")[:-1] if data else []


def _read_regular(path: Path) -> bytes:
    """The bytes of ``path``, a regular file: a FIFO (which would wait for a writer)
    or a device (``/dev/zero``, endless) in a run's directory is refused, not read.

    Raises:
        UsageError: not a regular file.
        FileNotFoundError: no such file.
    """
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise UsageError(f"{path}: not a regular file (a run's files are files)")
        return f.read()


def _lock(path: Path) -> int:
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
            os.close(fd)
            raise
        holder = os.pread(fd, 64, 0).decode("ascii", "replace").strip() or "unknown"
        os.close(fd)
        raise UsageError(
            f"{path.parent}: the run is in use by process {holder} (it holds {path}); "
            "wait for it to finish or stop it"
        ) from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd


@attrs.define
class _State:
    """What the files say, read once at open; kept current by this process."""

    tasks: dict[str, BatchTask] = attrs.Factory(dict)  # in task order
    encoded: dict[str, bytes] = attrs.Factory(dict)
    finished: dict[str, TaskResult] = attrs.Factory(dict)
    latest: dict[str, TaskResult] = attrs.Factory(dict)
    attempts: dict[str, int] = attrs.Factory(dict)


def _load_state(root: Path, *, repair: bool = True) -> _State:
    """What the run's files say; ``repair``: cut a torn last line off its file
    (only the process holding the run may)."""
    state = _State()
    tasks_file, results_file = root / TASKS, root / RESULTS
    # The results before the tasks: a task's line is written before it can have a
    # result, so a reader that does not hold the run finds every result's task.
    result_lines = _read_lines(results_file, repair=repair)
    for task in parse_tasks(_read_lines(tasks_file, repair=repair), str(tasks_file)):
        state.tasks[task.id] = task
        if repair:
            state.encoded[task.id] = _encode(task)
    for number, line in enumerate(result_lines, 1):
        if not line.strip():
            continue
        where = f"{results_file}:{number}"
        result: TaskResult = _structure(_parse_line(line, where), TaskResult, where)
        if result.id not in state.tasks:
            raise UsageError(f"{where}: a result for task {result.id!r}, which is not in {TASKS}")
        if result.finished:  # a task's first finished result is its last word
            state.finished.setdefault(result.id, result)
        if result.id not in state.finished or state.finished[result.id] is result:
            state.latest[result.id] = result
    if not repair:
        return state
    claims_file = root / CLAIMS
    for line in _read_lines(claims_file):
        with contextlib.suppress(ValueError, AttributeError, TypeError):
            record = json.loads(line)
            task_id, attempt = record["id"], record["attempt"]
            if isinstance(attempt, int) and not isinstance(attempt, bool):
                state.attempts[task_id] = max(state.attempts.get(task_id, 0), attempt)
    return state


class DirectoryLedger:
    """A run's tasks and results in a directory (see the module docstring and
    ``kernel.batch._ledger`` for the guarantees). Made by ``open_run_dir``."""

    #: Claims live as long as this process: nothing to renew (``run_batch`` checks).
    lease_seconds: float | None = None

    def __init__(self, path: Path, manifest: RunManifest, state: _State, lock_fd: int) -> None:
        self.path = path
        self.manifest = manifest
        #: Where ``run_batch`` puts each task's workspace.
        self.workspaces = path / WORKSPACES
        self._state = state
        self._lock_fd = lock_fd
        self._running: dict[str, str] = {}  # task id -> worker
        # What claim hands out next: the task order indices of the tasks neither
        # finished nor running, smallest first (a released task keeps its place).
        self._ids: list[str] = list(state.tasks)
        self._index: dict[str, int] = {t: i for i, t in enumerate(self._ids)}
        self._free: list[int] = [i for i, t in enumerate(self._ids) if t not in state.finished]
        # Tasks whose finished result is being written: a second one is refused,
        # but they count as finished only once the line is on the disk.
        self._finishing: set[str] = set()
        self._tasks_file = _AppendFile(path / TASKS, durable=True)
        self._results_file = _AppendFile(path / RESULTS, durable=True)
        self._claims_file = _AppendFile(path / CLAIMS, durable=False)
        self._adding = trio.Lock()

    @property
    def run_id(self) -> str:
        return self.manifest.run_id

    @property
    def session_project(self) -> str:
        """The store project of the run's task sessions (``Ledger`` guarantee 6)."""
        return session_project(self.manifest.run_id, self.manifest.nonce)

    @property
    def settings(self) -> dict[str, Any]:
        """The settings the run was created with (``open_run_dir(settings=)``)."""
        return self.manifest.settings

    @property
    def created(self) -> float:
        """When the run was created (Unix time)."""
        return self.manifest.created

    async def add_tasks(self, tasks: Sequence[BatchTask]) -> None:
        """Add the tasks not here yet (guarantee 1).

        Raises:
            UsageError: a task id is here with other content, or twice in ``tasks``;
                a task longer than ``MAX_LINE_BYTES`` as a JSON line (reopening
                the run could not read it back).
        """
        async with self._adding:
            new: dict[str, bytes] = {}
            for index, task in enumerate(tasks):
                line = _encode(task, f"task {task.id!r} (tasks[{index}])")
                if len(line) - 1 > MAX_LINE_BYTES:
                    raise UsageError(
                        f"task {task.id!r} (tasks[{index}]) is {len(line) - 1} bytes as a "
                        f"JSON line; a task may be at most {MAX_LINE_BYTES}"
                    )
                known = self._state.encoded.get(task.id) or new.get(task.id)
                if known is None:
                    new[task.id] = line
                elif known != line:
                    raise UsageError(
                        f"task {task.id!r} (tasks[{index}]) is already in run "
                        f"{self.run_id!r} with other content; give it another id or "
                        "start another run"
                    )
            if not new:
                return
            by_id = {t.id: t for t in tasks}

            def added(written: bool) -> None:
                if not written:
                    return
                for task_id, line in new.items():
                    self._state.tasks[task_id] = by_id[task_id]
                    self._state.encoded[task_id] = line
                    self._index[task_id] = len(self._ids)
                    heapq.heappush(self._free, len(self._ids))
                    self._ids.append(task_id)

            await self._tasks_file.append(b"".join(new.values()), added)

    async def claim(self, worker: str, limit: int) -> list[Claim]:
        """Up to ``limit`` tasks not finished and not running, in task order (guarantee 2).

        Raises:
            UsageError: ``limit`` is not a positive int.
        """
        check_positive(limit, "claim: limit", integer=True)
        claims: list[Claim] = []
        state = self._state
        while self._free and len(claims) < limit:
            task_id = self._ids[heapq.heappop(self._free)]
            if task_id in state.finished or task_id in self._running:
                continue  # finished without a claim: it simply leaves the heap
            attempt = state.attempts.get(task_id, 0) + 1
            state.attempts[task_id] = attempt
            self._running[task_id] = worker
            claims.append(Claim(task=state.tasks[task_id], attempt=attempt))
        if claims:
            lines = b"".join(
                _encode({"id": c.task.id, "attempt": c.attempt, "worker": worker}) for c in claims
            )
            await self._claims_file.append(lines)
        return claims

    async def renew(self, worker: str, task_ids: Sequence[str]) -> list[str]:
        """Claims last as long as this process holds the directory: nothing to
        extend; the tasks of ``task_ids`` that ``worker`` does not hold are returned."""
        await trio.lowlevel.checkpoint()
        return [task_id for task_id in task_ids if self._running.get(task_id) != worker]

    async def finish(self, worker: str, result: TaskResult) -> bool:
        """Record ``result`` (guarantees 3 and 4); False when the task had finished
        already, or another finished result of it is being written.

        The task counts as finished once the line is written, not before; a
        result that could not be written releases the task's claim.

        Raises:
            UsageError: ``result`` is for a task not in the run.
            OSError: the write failed (naming the file).
        """
        state = self._state
        if result.id not in state.tasks:
            raise UsageError(
                f"a result for task {result.id!r}, which is not in run {self.run_id!r}"
            )
        line = _encode(result, f"the result of task {result.id!r}")
        if result.id in state.finished:
            self._running.pop(result.id, None)
            return False
        if result.id in self._finishing:  # another finished result is on its way
            return False
        if result.finished:
            self._finishing.add(result.id)  # first wins, decided before the write

        def recorded(written: bool) -> None:
            # Whoever writes the line calls this, even when this call was cancelled
            # meanwhile: what this process says of the task follows the file.
            self._finishing.discard(result.id)
            if written and result.finished:
                state.finished[result.id] = result
            if written and state.finished.get(result.id, result) is result:
                state.latest[result.id] = result
            if self._running.pop(result.id, None) is not None and not (written and result.finished):
                heapq.heappush(self._free, self._index[result.id])  # claimable again

        await self._results_file.append(line, recorded)
        return True

    async def results(self) -> list[TaskResult]:
        """The latest result of each task that has one (its finished one), in task order."""
        latest = self._state.latest
        return [latest[task_id] for task_id in self._state.tasks if task_id in latest]

    async def tasks(self) -> list[BatchTask]:
        """Every task of the run, in task order."""
        return list(self._state.tasks.values())

    async def counts(self) -> LedgerCounts:
        return LedgerCounts(
            total=len(self._state.tasks),
            finished=len(self._state.finished),
            running=len(self._running),
        )

    async def aclose(self) -> None:
        for file in (self._tasks_file, self._results_file, self._claims_file):
            file.close()
        os.close(self._lock_fd)  # releases the lock


def _open(
    path: Path, run_id: str | None, create: bool, settings: Mapping[str, Any] | None
) -> tuple[RunManifest, _State, int]:
    manifest_path = path / MANIFEST
    if not path.is_dir():
        if not create:
            raise UsageError(f"{path}: no such run directory")
        path.mkdir(parents=True, exist_ok=True)
    elif not manifest_path.exists() and not create:
        raise UsageError(f"{path}: not a run directory (no {MANIFEST})")
    lock_fd = _lock(path / LOCK)
    try:
        if manifest_path.exists():
            manifest = _read_manifest(manifest_path)
            if run_id is not None and run_id != manifest.run_id:
                raise UsageError(f"{path} holds run {manifest.run_id!r}, not {run_id!r}")
        else:
            if run_id is None:
                run_id = path.resolve().name
                check_run_id(run_id, f"the run id (the directory's name, {path})")
            else:
                check_run_id(run_id, "run_id")
            manifest = RunManifest(
                run_id=run_id,
                created=time.time(),
                settings=dict(settings or {}),
                nonce=new_run_nonce(),
            )
            _write_atomically(manifest_path, _encode(manifest, "the run's settings"))
        (path / WORKSPACES).mkdir(exist_ok=True)
        return manifest, _load_state(path), lock_fd
    except BaseException:
        os.close(lock_fd)
        raise


def _read_manifest(path: Path) -> RunManifest:
    where = str(path)
    manifest: RunManifest = _structure(_parse_line(_read_regular(path), where), RunManifest, where)
    return manifest


def read_run_dir(path: str | os.PathLike[str]) -> RunView:
    """The run in directory ``path`` as its files say now, by the rules ``open_run_dir``
    reads them with, without taking the run (it may be going on; a last line still
    being written is left out). Blocking I/O.

    Raises:
        UsageError: not a run's directory, or a file is damaged (``FILE:LINE: ...``).
        OSError: a file cannot be read.
    """
    root = Path(path)
    manifest_path = root / MANIFEST
    if not manifest_path.is_file():
        raise UsageError(f"{root}: not a run directory (no {MANIFEST})")
    manifest = _read_manifest(manifest_path)
    state = _load_state(root, repair=False)
    return RunView(
        run_id=manifest.run_id,
        where=where_of(root),
        created=manifest.created,
        model=model_of(manifest.settings),
        session_project=session_project(manifest.run_id, manifest.nonce),
        total=len(state.tasks),
        results=tuple(state.latest[t] for t in state.tasks if t in state.latest),
    )


def _write_atomically(path: Path, data: bytes) -> None:
    temporary = path.with_name(path.name + ".tmp")
    with open(temporary, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(temporary, path)
    directory = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(directory)
    finally:
        os.close(directory)


@contextlib.asynccontextmanager
async def open_run_dir(
    path: str | os.PathLike[str],
    *,
    run_id: str | None = None,
    create: bool = True,
    settings: Mapping[str, Any] | None = None,
) -> AsyncIterator[DirectoryLedger]:
    """The run in directory ``path``, held by this process until the block ends.

    Args:
        run_id: the run's id (default: the directory's name); a directory holding
            another run is refused.
        create: make the directory and its manifest when missing (else refuse).
        settings: stored in a new run's manifest (``ledger.manifest.settings``);
            an existing run keeps its own.

    Raises:
        UsageError: another process holds the run (its pid is named); the
            directory is not a run and ``create`` is off; a file in it is
            damaged (``FILE:LINE: ...``); the run id is not a valid name.
    """
    where = Path(await trio.to_thread.run_sync(os.path.abspath, path))
    manifest, state, lock_fd = await trio.to_thread.run_sync(_open, where, run_id, create, settings)
    ledger = DirectoryLedger(where, manifest, state, lock_fd)
    try:
        yield ledger
    finally:
        await ledger.aclose()


__all__ = [
    "DirectoryLedger",
    "RunManifest",
    "load_tasks",
    "open_run_dir",
    "parse_tasks",
    "read_run_dir",
]
