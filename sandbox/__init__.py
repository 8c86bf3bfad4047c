"""The mechanism floor: confined paths, Landlock/seccomp, worker processes, their frames.

The sandbox knows processes, confinement and frames, not plugins: it imports
nothing of the project but ``kernel.errors``. Plugin
loading, the worker's program (``plugins._worker``) and the mapping of a plugin's
``Permissions`` onto a ``Policy`` live a floor up, in ``plugins``.

``import sandbox`` stays cheap (every worker imports it): the public names
below load their modules on first use, and only ``open_worker_pool`` and
its kin bring in Trio.

- ``Workspace``: paths resolved by the kernel beneath one directory fd
  (``DEFAULT_MAX_BYTES``, ``DEFAULT_MAX_FILES``: its default disk budget);
  ``DiskWatch``, ``measure_budget``: that budget held while workers run
  (``WorkerPool.watch_budget``); ``check_workspace_overlap``:
  refuse a workspace over guarded paths; ``escape_log_text``: worker text made
  log-safe.
- ``Policy``, ``Limits``, ``WorkspaceAccess``: what one worker may do, and the
  validators (``check_workspace_access``, ``check_network``) permissions share.
- ``open_worker_pool``, ``WorkerPool``, ``Worker``, ``WorkerCallError``: confined
  processes, and calls to them.
- ``ToolSpec``, ``CallFrame``, ``ResultFrame``, ``CallError``, ``ReadyFrame``,
  ``FatalFrame``, ``LogFrame``, ``WorkerConfig``, ``Confinement``,
  ``WorkerFrameError``: the frames
  between the kernel and a worker (``sandbox._protocol``).
- ``sandbox.worker``: the worker's side (confine, serve frames with a handler).
- ``probe_isolation``, ``IsolationSupport``, ``selftest``: what this machine can confine.
- ``sandbox.landlock``, ``sandbox.seccomp``: the two kernel mechanisms.
- ``sandbox.exec``: confine, then exec a program (``python -m sandbox.exec``), with the
  workers' layers: how a local MCP server runs.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS: dict[str, str] = {
    "Workspace": "_workspace",
    "Entry": "_workspace",
    "openat2_available": "_workspace",
    "DEFAULT_MAX_BYTES": "_workspace",
    "DEFAULT_MAX_FILES": "_workspace",
    "DiskWatch": "_diskwatch",
    "measure_budget": "_diskwatch",
    "check_workspace_overlap": "_overlap",
    "escape_log_text": "_logtext",
    "Policy": "_policy",
    "Limits": "_policy",
    "WorkspaceAccess": "_policy",
    "check_workspace_access": "_policy",
    "check_network": "_policy",
    "IsolationSupport": "_probe",
    "probe_isolation": "_probe",
    "selftest": "_probe",
    "open_worker_pool": "pool",
    "WorkerPool": "pool",
    "Worker": "pool",
    "WorkerCallError": "pool",
    "ToolSpec": "_protocol",
    "CallFrame": "_protocol",
    "CallError": "_protocol",
    "ResultFrame": "_protocol",
    "ReadyFrame": "_protocol",
    "FatalFrame": "_protocol",
    "LogFrame": "_protocol",
    "WorkerFrameError": "_protocol",
    "WorkerConfig": "_protocol",
    "Confinement": "_protocol",
}

__all__ = list(_EXPORTS)

if TYPE_CHECKING:
    from ._diskwatch import DiskWatch as DiskWatch
    from ._diskwatch import measure_budget as measure_budget
    from ._logtext import escape_log_text as escape_log_text
    from ._overlap import check_workspace_overlap as check_workspace_overlap
    from ._policy import Limits as Limits
    from ._policy import Policy as Policy
    from ._policy import WorkspaceAccess as WorkspaceAccess
    from ._policy import check_network as check_network
    from ._policy import check_workspace_access as check_workspace_access
    from ._probe import IsolationSupport as IsolationSupport
    from ._probe import probe_isolation as probe_isolation
    from ._probe import selftest as selftest
    from ._protocol import CallError as CallError
    from ._protocol import CallFrame as CallFrame
    from ._protocol import Confinement as Confinement
    from ._protocol import FatalFrame as FatalFrame
    from ._protocol import LogFrame as LogFrame
    from ._protocol import ReadyFrame as ReadyFrame
    from ._protocol import ResultFrame as ResultFrame
    from ._protocol import ToolSpec as ToolSpec
    from ._protocol import WorkerConfig as WorkerConfig
    from ._protocol import WorkerFrameError as WorkerFrameError
    from ._workspace import DEFAULT_MAX_BYTES as DEFAULT_MAX_BYTES
    from ._workspace import DEFAULT_MAX_FILES as DEFAULT_MAX_FILES
    from ._workspace import Entry as Entry
    from ._workspace import Workspace as Workspace
    from ._workspace import openat2_available as openat2_available
    from .pool import Worker as Worker
    from .pool import WorkerCallError as WorkerCallError
    from .pool import WorkerPool as WorkerPool
    from .pool import open_worker_pool as open_worker_pool


# As ``kernel._lazy.lazy_exports`` does, written out: the sandbox imports nothing of
# the kernel but ``kernel.errors`` (tests/test_layers.py).
def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value  # the next lookup skips this function
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
