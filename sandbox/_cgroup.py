"""A pids cgroup per worker: the process limit that also holds for root.

``RLIMIT_NPROC`` counts per user and is never enforced for uid 0, so a
kernel running as root cannot stop a fork bomb with rlimits. A cgroup's
``pids.max`` can: the pool makes one cgroup per worker (when it may write to
the pids hierarchy), the worker moves itself into it before it drops its
capabilities, and the pool removes it once the worker's group is dead.

All functions here do blocking file I/O: call them from a thread. The module
stays light (no pathlib): every worker imports it for ``join``.
"""

from __future__ import annotations

import errno
import os
import time
from collections.abc import Callable

_V1_ROOT = "/sys/fs/cgroup/pids"
_V2_MOUNT = "/sys/fs/cgroup"


def pids_parent() -> str | None:
    """A directory this process may create pids cgroups in, or ``None``."""
    if os.path.exists(os.path.join(_V1_ROOT, "cgroup.procs")):
        own = _own_cgroup(lambda controllers: "pids" in controllers.split(","))
        base = os.path.join(_V1_ROOT, (own or "/").lstrip("/"))
        return base if os.access(base, os.W_OK) else None
    if os.path.exists(os.path.join(_V2_MOUNT, "cgroup.controllers")):
        own = _own_cgroup(lambda controllers: controllers == "")
        if own is None:
            return None
        base = os.path.join(_V2_MOUNT, own.lstrip("/"))
        try:
            with open(os.path.join(base, "cgroup.subtree_control")) as f:
                enabled = f.read().split()
        except OSError:
            return None
        if "pids" in enabled and os.access(base, os.W_OK):
            return base
    return None


def _own_cgroup(matches: Callable[[str], bool]) -> str | None:
    try:
        with open("/proc/self/cgroup") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if matches(controllers):
            return path
    return None


def create(parent: str, max_pids: int) -> str:
    """A new cgroup under ``parent`` limited to ``max_pids`` tasks.

    Raises:
        OSError: it could not be made.
    """
    import secrets

    path = os.path.join(parent, f"tak-worker-{os.getpid()}-{secrets.token_hex(4)}")
    os.mkdir(path, 0o755)
    try:
        with open(os.path.join(path, "pids.max"), "w") as f:
            f.write(str(max_pids))
    except OSError:
        os.rmdir(path)
        raise
    return path


def join(path: str) -> None:
    """Move the calling process into the cgroup at ``path``."""
    with open(os.path.join(path, "cgroup.procs"), "w") as f:
        f.write("0")


def remove(path: str, *, wait_s: float = 2.0) -> None:
    """Remove a cgroup whose processes are dead or dying (retries while it empties)."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            os.rmdir(path)
            return
        except FileNotFoundError:
            return
        except OSError as exc:
            if exc.errno != errno.EBUSY or time.monotonic() > deadline:
                raise
        time.sleep(0.01)
