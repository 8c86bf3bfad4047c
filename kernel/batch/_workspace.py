"""A task's workspace, seeded before it runs: its ``workspace`` directory copied, then its ``files``.

Both sides go through ``sandbox.Workspace`` (``openat2`` with
``RESOLVE_BENEATH``): a link in the seed directory is copied as the file it
names only while that file is inside the seed (a link leading out, or to a
directory, is left out and logged), and a path of ``task.files`` that leaves
the task's workspace (``..``, absolute, through a link) is refused, by the
kernel's path resolution rather than by looking at the string.

Files are copied as data: a file's mode is not (no execute bit, as for
every file the kernel writes into a workspace; a task runs ``sh run.sh``,
not ``./run.sh``).

The copy is made in ``.<id>.seeding`` beside the workspace and renamed into
place when whole, so a task whose run stopped mid-copy is seeded again, while
a workspace a task has already worked in is never re-seeded (a resumed task
continues where it was). Task ids never start with ``.``: no clash. A
copy that fails is removed.

``.tak/`` is the kernel's own (its temporary files): a seed's is not
copied, and a path of ``task.files`` inside it is refused.
"""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path

import trio

from kernel.errors import SandboxError, UsageError
from sandbox import Workspace

from ._records import BatchTask

logger = logging.getLogger("tak.batch")

#: The largest seed file copied (a bigger one fails the task, saying so).
MAX_SEED_FILE_BYTES = 256 * 1024 * 1024
#: Directories of the seed that are not copied: the kernel's own.
_SKIPPED = frozenset({".tak"})


def _copy_tree(source: Workspace, target: Workspace, rel: str, task_id: str) -> None:
    for entry in source.list(rel):
        path = entry.name if rel == "." else f"{rel}/{entry.name}"
        if rel == "." and entry.name in _SKIPPED:
            continue
        if entry.kind == "dir":
            target.mkdir(path)
            _copy_tree(source, target, path, task_id)
        elif entry.kind in ("file", "symlink"):
            try:
                data = source.read_bytes(path, max_bytes=MAX_SEED_FILE_BYTES)
            except (SandboxError, OSError) as exc:
                if entry.kind != "symlink":
                    raise
                logger.warning(
                    "task %s: seed link %s left out (it leads out of the seed or not to "
                    "a file: %s)",
                    task_id,
                    path,
                    exc,
                )
                continue
            target.write_bytes(path, data)
        # Sockets, fifos, devices: nothing a task needs.


def seed_workspace_sync(root: Path, task: BatchTask) -> Path:
    """The task's workspace ``root/<id>``, made from its seed if it is not there yet.

    Blocking (see ``seed_workspace``).

    Raises:
        UsageError: the seed directory is missing, or a path of ``task.files``
            leaves the workspace or cannot be written (the path is named).
    """
    root.mkdir(parents=True, exist_ok=True)
    final = root / task.id
    if final.is_dir():
        return final
    staging = root / f".{task.id}.seeding"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir()
    try:
        _seed(staging, task)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    os.rename(staging, final)
    return final


def _seed(staging: Path, task: BatchTask) -> None:
    with Workspace(staging, max_read=MAX_SEED_FILE_BYTES, max_write=MAX_SEED_FILE_BYTES) as target:
        if task.workspace is not None:
            seed = Path(task.workspace).expanduser()
            if not seed.is_dir():
                raise UsageError(
                    f"task {task.id!r}: workspace {task.workspace!r} is not a directory"
                )
            with Workspace(seed, max_read=MAX_SEED_FILE_BYTES) as source:
                _copy_tree(source, target, ".", task.id)
        for rel, text in task.files.items():
            first = os.path.normpath(rel).split(os.sep, 1)[0]
            if first in _SKIPPED:
                raise UsageError(
                    f"task {task.id!r}: files[{rel!r}]: {first}/ is the kernel's own; "
                    "write elsewhere"
                )
            try:
                parent = os.path.dirname(rel)
                if parent:
                    target.mkdir(parent, parents=True, exist_ok=True)
                target.write_text(rel, text)
            except (SandboxError, OSError) as exc:
                raise UsageError(f"task {task.id!r}: files[{rel!r}]: {exc}") from None
        target.mkdir(".tak/tmp", parents=True, exist_ok=True)


async def seed_workspace(root: Path, task: BatchTask) -> Path:
    """``seed_workspace_sync`` in a thread: copying a seed is file I/O."""
    return await trio.to_thread.run_sync(seed_workspace_sync, root, task)


__all__ = ["seed_workspace", "seed_workspace_sync"]
