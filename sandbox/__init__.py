"""Workspace confinement: confined paths, Landlock/seccomp, worker processes.

``import sandbox`` stays cheap (every worker imports it): the public names
below load their modules on first use, and only ``open_worker_pool`` and
its kin bring in Trio.

- ``Workspace``: paths resolved by the kernel beneath one directory fd.
- ``Policy``, ``Limits``: what one worker may do.
- ``open_worker_pool``, ``WorkerPool``, ``Worker``: plugin tools in confined processes.
- ``probe_isolation``, ``IsolationSupport``: what this machine can confine.
- ``sandbox.landlock``, ``sandbox.seccomp``: the two kernel mechanisms.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kernel._lazy import lazy_exports

_EXPORTS: dict[str, str] = {
    "Workspace": "_workspace",
    "Entry": "_workspace",
    "openat2_available": "_workspace",
    "Policy": "_policy",
    "Limits": "_policy",
    "IsolationSupport": "_probe",
    "probe_isolation": "_probe",
    "open_worker_pool": "pool",
    "WorkerPool": "pool",
    "Worker": "pool",
}

__all__ = list(_EXPORTS)

if TYPE_CHECKING:
    from ._policy import Limits as Limits
    from ._policy import Policy as Policy
    from ._probe import IsolationSupport as IsolationSupport
    from ._probe import probe_isolation as probe_isolation
    from ._workspace import Entry as Entry
    from ._workspace import Workspace as Workspace
    from ._workspace import openat2_available as openat2_available
    from .pool import Worker as Worker
    from .pool import WorkerPool as WorkerPool
    from .pool import open_worker_pool as open_worker_pool


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
