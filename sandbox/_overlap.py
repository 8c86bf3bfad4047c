"""Refuse a workspace that overlaps what the kernel runs or trusts.

Everything under the workspace is writable by tools. If the workspace holds
the interpreter's environment, the kernel's own packages or the kernel's
configuration, a tool can plant a ``.pth`` file, edit a module or grant a
plugin trust, and the *next* kernel start (or a spare worker, which starts
before it is confined) runs that unconfined. This module is the mechanism;
the kernel decides which paths are guarded (``plugins._host``).

Paths are compared as the operating system sees them: real paths
(``os.path.realpath``: symbolic links and ``..`` resolved) compared by whole
components (``os.path.commonpath``), plus device and inode identity of every
ancestor, so that a bind mount or a second name for the same directory is
caught too. A string prefix on unresolved paths would miss both (and would
call ``/srv/app2`` a child of ``/srv/app``).
"""

from __future__ import annotations

import os
from collections.abc import Iterable

from kernel.errors import WorkspaceRefused

PathArg = str | os.PathLike[str]


def _identity(path: str) -> tuple[int, int] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino


def _contains(outer: str, inner: str) -> bool:
    """Whether real path ``inner`` is ``outer`` or lies beneath it."""
    if os.path.commonpath([outer, inner]) == outer:
        return True
    wanted = _identity(outer)
    if wanted is None:
        return False
    current = inner
    while True:  # the same directory under another name (a bind mount)
        if _identity(current) == wanted:
            return True
        parent = os.path.dirname(current)
        if parent == current:
            return False
        current = parent


def check_workspace_overlap(
    workspace: PathArg,
    *,
    disjoint: Iterable[tuple[str, PathArg]] = (),
    not_inside: Iterable[tuple[str, PathArg]] = (),
) -> None:
    """Refuse ``workspace`` when it overlaps a guarded directory.

    Args:
        workspace: the directory tools may write.
        disjoint: ``(what, path)`` pairs the workspace may neither contain nor lie
            inside (``("sys.prefix", "/venv")``).
        not_inside: ``(what, path)`` pairs the workspace may not contain, but may lie
            inside (``$TAK_HOME``, whose ``workspace/`` is the default workspace).

    Raises:
        WorkspaceRefused: (a SandboxError and a UsageError) one line naming the
            workspace, the guarded path and what it is.
    """
    ws = os.path.realpath(workspace)
    for what, path in disjoint:
        guarded = os.path.realpath(path)
        if _contains(guarded, ws) and _contains(ws, guarded):
            relation = "is"
        elif _contains(ws, guarded):
            relation = "contains"
        elif _contains(guarded, ws):
            relation = "lies inside"
        else:
            continue
        raise WorkspaceRefused(_message(workspace, ws, relation, what, guarded))
    for what, path in not_inside:
        guarded = os.path.realpath(path)
        if _contains(ws, guarded):
            relation = "is" if _contains(guarded, ws) else "contains"
            raise WorkspaceRefused(_message(workspace, ws, relation, what, guarded))


def _message(given: PathArg, real: str, relation: str, what: str, guarded: str) -> str:
    shown = os.fspath(given)
    name = shown if os.path.abspath(shown) == real else f"{shown} (really {real})"
    return (
        f"workspace {name} {relation} {what} {guarded}: tools could change what the "
        "next start runs or trusts; choose a workspace that does not overlap it"
    )


__all__ = ["check_workspace_overlap"]
