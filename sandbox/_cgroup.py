"""Cgroups per worker: a memory cap for the whole process tree, a process cap, a kill switch.

Rlimits are per process: ``RLIMIT_AS`` lets every child of a subprocess
plugin take as much again, and ``RLIMIT_NPROC`` counts per user and is never
enforced for uid 0. A cgroup holds the whole tree, root included. The pool
makes one *cgroup set* per worker start (``create``): on cgroup v1 one
directory in the memory hierarchy (``memory.limit_in_bytes``, and
``memory.memsw.limit_in_bytes`` so that swap is no way around it) and one in
the pids hierarchy (``pids.max``); on cgroup v2 one directory with
``memory.max``, ``memory.swap.max`` 0 and ``pids.max``. The worker moves
itself in (``join``) before it drops its capabilities; every process it
starts is born inside. When the worker ends, ``destroy`` kills every member
(v2 ``cgroup.kill``; v1 a loop over ``cgroup.procs``), so a background
program that left the worker's process group goes too, and removes the set.

A kernel that is SIGKILLed cannot clean up: its worker dies by its
parent-death signal, but the worker's children are reparented and live on,
in cgroups nobody removes. The directories are named
``tak-worker-<kernel pid>-<hex>``, so the next pool start (``sweep``) finds
those whose kernel is gone, kills what is left in them and removes them.

Where no cgroup is writable (not root, no delegation), ``Parents`` is empty
and the worker's rlimits are all there is.

All functions here do blocking file I/O: call them from a thread. The module
stays light (no pathlib, no attrs): every worker imports it for ``join``.
"""

from __future__ import annotations

import errno
import os
import re
import signal
import stat
import time
from typing import NamedTuple

_MOUNT = "/sys/fs/cgroup"
_NAME = re.compile(r"^tak-worker-(\d+)-[0-9a-f]+$")
#: How long ``destroy`` keeps killing and retrying ``rmdir`` before it gives up.
_DESTROY_S = 2.0


class Parents(NamedTuple):
    """Where this process may create worker cgroups (``None``: not for that controller).

    Attributes:
        version: 1 or 2 (0 when neither controller is usable).
        memory: the directory to create memory cgroups in.
        pids: the directory to create pids cgroups in (on v2, the same as ``memory``
            when both controllers are enabled there).
    """

    version: int = 0
    memory: str | None = None
    pids: str | None = None
    #: v1 only: the directory to create freezer cgroups in (v2 freezes any cgroup).
    freezer: str | None = None

    def directories(self) -> list[str]:
        """Each distinct parent directory, once."""
        return sorted({d for d in (self.memory, self.pids, self.freezer) if d is not None})


NO_PARENTS = Parents()


def find_parents() -> Parents:
    """The cgroup directories this process may create worker cgroups in."""
    own = _own_cgroups()
    if os.path.exists(os.path.join(_MOUNT, "cgroup.controllers")):
        return _v2_parents(own.get(""))
    memory = _v1_parent("memory", own)
    pids = _v1_parent("pids", own)
    if memory is None and pids is None:
        return NO_PARENTS
    return Parents(1, memory, pids, _v1_parent("freezer", own))


def _v1_parent(controller: str, own: dict[str, str]) -> str | None:
    root = os.path.join(_MOUNT, controller)
    if not os.path.exists(os.path.join(root, "cgroup.procs")):
        return None
    base = os.path.join(root, own.get(controller, "/").lstrip("/")).rstrip("/")
    return base if os.access(base, os.W_OK) else None


def _v2_parents(own: str | None) -> Parents:
    if own is None:
        return NO_PARENTS
    base = os.path.join(_MOUNT, own.lstrip("/")).rstrip("/")
    try:
        with open(os.path.join(base, "cgroup.subtree_control")) as f:
            enabled = f.read().split()
    except OSError:
        return NO_PARENTS
    if not os.access(base, os.W_OK):
        return NO_PARENTS
    memory = base if "memory" in enabled else None
    pids = base if "pids" in enabled else None
    return Parents(2, memory, pids) if memory or pids else NO_PARENTS


def _own_cgroups() -> dict[str, str]:
    """This process's cgroup per v1 controller, and its v2 cgroup under ``""``."""
    try:
        with open("/proc/self/cgroup") as f:
            lines = f.read().splitlines()
    except OSError:
        return {}
    own: dict[str, str] = {}
    for line in lines:
        _, controllers, path = line.split(":", 2)
        for controller in controllers.split(","):
            own[controller] = path
    return own


def create(parents: Parents, *, memory_bytes: int | None, max_pids: int | None) -> list[str]:
    """A new cgroup set for one worker, limited to ``memory_bytes`` and ``max_pids``.

    Returns its directories (one on v2, one per hierarchy on v1); empty when
    ``parents`` has nowhere to put the limits asked for.

    Raises:
        OSError: it could not be made (nothing is left behind).
    """
    import secrets

    name = f"tak-worker-{os.getpid()}-{secrets.token_hex(4)}"
    settings: dict[str, list[tuple[str, str]]] = {}
    if parents.memory is not None and memory_bytes is not None:
        if parents.version == 2:
            memory = [("memory.max", str(memory_bytes)), ("memory.swap.max", "0")]
        else:
            memory = [
                ("memory.limit_in_bytes", str(memory_bytes)),
                ("memory.memsw.limit_in_bytes", str(memory_bytes)),
            ]
        settings.setdefault(parents.memory, []).extend(memory)
    if parents.pids is not None and max_pids is not None:
        settings.setdefault(parents.pids, []).append(("pids.max", str(max_pids)))
    if settings and parents.freezer is not None:
        settings.setdefault(parents.freezer, [])  # no limit: only to stop the set (``freeze``)
    made: list[str] = []
    try:
        for parent, files in settings.items():
            path = os.path.join(parent, name)
            os.mkdir(path, 0o755)
            made.append(path)
            for filename, value in files:
                target = os.path.join(path, filename)
                if filename in ("memory.swap.max", "memory.memsw.limit_in_bytes"):
                    if not os.path.exists(target):
                        continue  # no swap accounting here: there is no swap to limit
                with open(target, "w") as f:
                    f.write(value)
    except BaseException:
        destroy(made)
        raise
    return made


def join(paths: list[str]) -> None:
    """Move the calling process into every cgroup in ``paths``.

    On v1, a process with one thread moves that thread (``tasks``): Linux moves the
    calling thread without the lock that moving a whole process takes
    (``cgroup_threadgroup_rwsem``), whose write side waits for an RCU grace period,
    5-25 ms per hierarchy on a busy machine. With one thread, the thread is the
    process; with more (or no way to count them), the whole process moves.
    """
    single = _single_threaded()
    for path in paths:
        tasks = os.path.join(path, "tasks")  # v1 only
        target = tasks if single and os.path.exists(tasks) else os.path.join(path, "cgroup.procs")
        with open(target, "w") as f:
            f.write("0")


def _single_threaded() -> bool:
    """Whether the calling process has one thread; ``False`` when it cannot tell."""
    try:
        return len(os.listdir("/proc/self/task")) == 1
    except OSError:
        return False


def limits_processes(paths: list[str]) -> bool:
    """Whether one of ``paths`` holds a ``pids.max``."""
    return any(os.path.exists(os.path.join(path, "pids.max")) for path in paths)


def oom_kill_limit(paths: list[str]) -> int | None:
    """The memory limit of the set in ``paths`` if its OOM killer has killed in it, else ``None``.

    v1 counts kills in ``memory.oom_control`` (``oom_kill``), v2 in
    ``memory.events``; ``memory.failcnt`` (v1) only says the limit was reached,
    which reclaim may have survived, so it is not proof of a kill.
    """
    for path in paths:
        for events, limit_file in (
            ("memory.events", "memory.max"),
            ("memory.oom_control", "memory.limit_in_bytes"),
        ):
            try:
                with open(os.path.join(path, events)) as f:
                    counters = dict(line.split(None, 1) for line in f.read().splitlines() if line)
                with open(os.path.join(path, limit_file)) as f:
                    limit = f.read().strip()
            except (OSError, ValueError):
                continue
            if int(counters.get("oom_kill", "0")) > 0 and limit.isdigit():
                return int(limit)
    return None


def members(path: str) -> list[int]:
    """The pids in the cgroup at ``path`` (empty when it is gone)."""
    try:
        with open(os.path.join(path, "cgroup.procs")) as f:
            return [int(line) for line in f.read().split()]
    except FileNotFoundError:
        return []


def unlinked_open_bytes(paths: list[str], device: int) -> int:
    """Disk held by files on ``device`` that processes of the set keep open after unlinking.

    Such a file is in no directory, so a walk of the workspace cannot see it, yet
    it takes space until its last fd or mapping goes: a worker could fill the disk that way
    past any budget. Each inode counts once. Best read while the set is frozen.
    """
    seen: set[int] = set()
    mapped: set[tuple[str, str]] = set()
    total = 0
    pids = {pid for path in paths for pid in members(path)}
    for pid in pids:
        # Open fds (at most RLIMIT_NOFILE each), and mappings (an mmap outlives the fd it
        # was made from): those of unlinked files only, each file once, from one read of
        # ``maps``. A stat per ``map_files`` entry let a worker with 65,000 one-page
        # mappings make every walk take seconds, and so space the watchdog's walks out.
        try:
            links = [f"/proc/{pid}/fd/{name}" for name in os.listdir(f"/proc/{pid}/fd")]
        except OSError:
            continue  # gone
        links += _unlinked_mappings(pid, mapped)
        for link in links:
            try:
                st = os.stat(link)
            except OSError:
                continue
            if (
                st.st_nlink == 0
                and st.st_dev == device
                and stat.S_ISREG(st.st_mode)
                and st.st_ino not in seen
            ):
                seen.add(st.st_ino)
                total += st.st_blocks * 512
    return total


def _unlinked_mappings(pid: int, seen: set[tuple[str, str]]) -> list[str]:
    """A ``map_files`` link for each unlinked file ``pid`` maps that is not in ``seen``.

    ``/proc/<pid>/maps`` marks a mapping of an unlinked file ``(deleted)``; its device
    and inode (fields 4 and 5) name the file, so each one is stat'ed once however many
    times it is mapped (a name that merely ends so costs a stat, once per inode too).
    """
    try:
        with open(f"/proc/{pid}/maps", "rb") as f:
            lines = f.read().splitlines()
    except OSError:
        return []
    links = []
    for line in lines:
        if not line.endswith(b" (deleted)"):
            continue
        fields = line.split(None, 5)
        if len(fields) < 6 or fields[4] == b"0":
            continue
        key = (fields[3].decode(), fields[4].decode())
        if key in seen:
            continue
        seen.add(key)
        links.append(f"/proc/{pid}/map_files/{fields[0].decode()}")
    return links


def kill_members(path: str) -> None:
    """SIGKILL every process in the cgroup at ``path``, children they fork meanwhile too."""
    kill_file = os.path.join(path, "cgroup.kill")
    if os.path.exists(kill_file):
        try:
            with open(kill_file, "w") as f:
                f.write("1")
            return
        except FileNotFoundError:
            return
        except OSError:
            pass  # fall back to the loop
    # v1: a member may fork while we read, so read again until a pass finds nobody.
    # Killed processes cannot fork, so each pass leaves fewer forkers.
    deadline = time.monotonic() + _DESTROY_S
    while (pids := members(path)) and time.monotonic() < deadline:
        for pid in pids:
            _kill_if_member(pid, path)
        time.sleep(0.001)


def signal_members(paths: list[str]) -> None:
    """SIGKILL every process of a set once: v2 ``cgroup.kill``, v1 each member by pidfd.

    For a frozen set (the disk watchdog's kill): no member can fork while frozen, so
    one pass reaches them all, and each dies as it thaws, before it runs again. A
    set that is not frozen is better killed with ``kill_members``, which reads again.
    """
    for path in paths:
        try:
            with open(os.path.join(path, "cgroup.kill"), "w") as f:
                f.write("1")
            continue
        except FileNotFoundError:
            if not os.path.isdir(path):
                continue  # the set is gone already
        except OSError:
            pass  # no cgroup.kill here (cgroupfs refuses to create it): one pass
        for pid in members(path):
            _kill_if_member(pid, path)


def _kill_if_member(pid: int, path: str) -> None:
    # The pidfd pins the process: if the number was reused between reading
    # cgroup.procs and now, the membership check or the signal (ESRCH) misses.
    try:
        pidfd = os.pidfd_open(pid)
    except OSError:
        return
    try:
        relative = _hierarchy_path(path)
        with open(f"/proc/{pid}/cgroup") as f:
            if not any(line.endswith(":" + relative) for line in f.read().splitlines()):
                return
        signal.pidfd_send_signal(pidfd, signal.SIGKILL)
    except OSError:
        pass
    finally:
        os.close(pidfd)


def _hierarchy_path(path: str) -> str:
    """``path`` as ``/proc/<pid>/cgroup`` shows it: relative to its hierarchy's mount."""
    relative = os.path.relpath(path, _MOUNT)
    if not os.path.exists(os.path.join(_MOUNT, "cgroup.controllers")):
        relative = relative.partition("/")[2]  # v1: drop the hierarchy's directory
    return "/" + relative


#: How long ``freeze`` waits for every task of a set to stop, unless told otherwise.
FREEZE_S = 2.0


def freeze(paths: list[str], wait_s: float = FREEZE_S) -> bool:
    """Stop every process in the set (v1 ``freezer.state``, v2 ``cgroup.freeze``).

    Returns whether the set is frozen: ``False`` when it has no freezer (nothing
    was changed). Tasks stay frozen until ``thaw``; a frozen set is still killed
    by ``destroy``.

    Raises:
        OSError: the set did not freeze within ``wait_s`` (it is thawed again).
    """
    for path in paths:
        if os.path.exists(os.path.join(path, "freezer.state")):
            _write(path, "freezer.state", "FROZEN")
        elif os.path.exists(os.path.join(path, "cgroup.freeze")):
            _write(path, "cgroup.freeze", "1")
        else:
            continue
        deadline = time.monotonic() + wait_s
        while not _is_frozen(path):
            if time.monotonic() > deadline:
                thaw(paths)
                raise OSError(errno.ETIMEDOUT, f"cgroup {path} did not freeze")
            time.sleep(0.001)
        return True
    return False


def _is_frozen(path: str) -> bool:
    if os.path.exists(os.path.join(path, "freezer.state")):
        return _read(path, "freezer.state") == "FROZEN"  # not FREEZING: every task stopped
    return "frozen 1" in _read(path, "cgroup.events").splitlines()


def thaw(paths: list[str]) -> None:
    """Let the processes of a set stopped by ``freeze`` run again (gone sets are skipped)."""
    for path in paths:
        for filename, value in (("freezer.state", "THAWED"), ("cgroup.freeze", "0")):
            if not os.path.exists(os.path.join(path, filename)):
                continue  # not this controller (cgroupfs refuses to create files: EACCES)
            try:
                _write(path, filename, value)
            except FileNotFoundError:
                continue  # the set went away meanwhile


def _write(path: str, filename: str, value: str) -> None:
    with open(os.path.join(path, filename), "w") as f:
        f.write(value)


def _read(path: str, filename: str) -> str:
    with open(os.path.join(path, filename)) as f:
        return f.read().strip()


def destroy(paths: list[str], *, wait_s: float = _DESTROY_S) -> None:
    """Kill every process in the set and remove it (retries while it empties).

    Raises:
        OSError: a directory could not be removed within ``wait_s``.
    """
    # A frozen task takes SIGKILL only once thawed (v1): thaw first, kill, remove.
    thaw(paths)
    for path in paths:
        kill_members(path)
    for path in paths:
        _remove(path, wait_s)


def _remove(path: str, wait_s: float) -> None:
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
        kill_members(path)
        time.sleep(0.01)


def sweep(parents: Parents) -> list[str]:
    """Destroy the worker cgroups left by kernels that are no longer running.

    Returns the directories removed. A directory whose kernel pid is alive is
    left alone (that kernel may still use it, or the number was reused; either
    way it is not known to be stale); so are this process's own.

    Raises:
        OSError: a stale cgroup could not be removed.
    """
    removed = []
    for parent in parents.directories():
        try:
            entries = os.listdir(parent)
        except OSError:
            continue
        for entry in entries:
            match = _NAME.match(entry)
            if match is None or _is_running(int(match.group(1))):
                continue
            path = os.path.join(parent, entry)
            destroy([path])
            removed.append(path)
    return removed


def _is_running(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
