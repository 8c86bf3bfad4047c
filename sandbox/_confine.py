"""The steps a worker takes on itself, in order, before any plugin code runs.

1. close every fd but stdio and the IPC channel;
2. rlimits (CPU, address space, file size, open files, core 0; processes by rlimit
   when not root);
3. ``PR_SET_PDEATHSIG(SIGKILL)``, then check the kernel is still its parent;
4. join its cgroups (memory for the whole tree, pids, freezer), if the pool made them;
5. ``.tak/`` read-only in a mount namespace of its own (``sandbox._mounts``), where
   it has ``CAP_SYS_ADMIN``;
6. drop every capability: securebits locked, bounding set, ambient, capset;
7. ``no_new_privs``;
8. the seccomp filter;
9. the Landlock ruleset (read-write workspace, read-only runtime).

Each step either succeeds or says why it failed; a required layer that fails
stops the worker (fail closed). Steps 2 to 9 are ``apply_layers``, which the
confine-then-exec launcher (``sandbox.exec``) applies to itself too.
"""

from __future__ import annotations

import ctypes
import errno
import importlib.util
import os
import resource
import signal
import sys
from collections.abc import Callable, Mapping, Sequence

import attrs

from kernel.errors import SandboxError

from . import _cgroup, _mounts, _syscalls, landlock, seccomp
from ._protocol import Confinement, WorkerConfig

#: The fd number the IPC channel has in a worker.
IPC_FD = 3

_SECBIT_NOROOT = 1 << 0
_SECBIT_NOROOT_LOCKED = 1 << 1
_SECBIT_NO_SETUID_FIXUP = 1 << 2
_SECBIT_NO_SETUID_FIXUP_LOCKED = 1 << 3
_SECBIT_KEEP_CAPS_LOCKED = 1 << 5
_CAPABILITY_VERSION_3 = 0x20080522

#: System files the interpreter and libc read.
_SYSTEM_READ = (
    "/usr/lib",
    "/usr/lib64",
    "/lib",
    "/lib64",
    "/etc/ld.so.cache",
    "/etc/localtime",
    "/usr/share/zoneinfo",
)
#: Needed to check certificates and name ports, for plugins with network access. No
#: resolver files: the kernel resolves names for the worker (``sandbox._netbroker``).
_NETWORK_READ = (
    "/etc/services",
    "/etc/protocols",
    "/etc/ssl",
    "/usr/share/ca-certificates",
)
#: Where programs may be executed from, for plugins with ``subprocess``.
_EXECUTABLES = ("/usr/local/bin", "/usr/bin", "/bin", "/usr/libexec")
_DEVICES_READ = ("/dev/urandom", "/dev/random", "/dev/zero")


def close_stray_fds(ipc_fd: int) -> None:
    """Keep 0, 1, 2 and the IPC channel (moved to fd 3); close everything else."""
    if ipc_fd != IPC_FD:
        os.dup2(ipc_fd, IPC_FD, inheritable=False)
        os.close(ipc_fd)
    os.closerange(IPC_FD + 1, _max_fd())


def _max_fd() -> int:
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return max(soft if soft != resource.RLIM_INFINITY else 1 << 20, 1024)


def set_rlimits(
    limits: Mapping[str, int | None],
    report: Confinement,
    *,
    subprocess: bool,
    cgroups: Sequence[str],
) -> None:
    wanted: list[tuple[str, int, int | None]] = [
        ("cpu_seconds", resource.RLIMIT_CPU, limits.get("cpu_seconds")),
        ("memory_bytes", resource.RLIMIT_AS, limits.get("memory_bytes")),
        ("file_size_bytes", resource.RLIMIT_FSIZE, limits.get("file_size_bytes")),
        ("open_files", resource.RLIMIT_NOFILE, limits.get("open_files")),
        ("core", resource.RLIMIT_CORE, 0),
    ]
    if subprocess and os.getuid() != 0 and not _cgroup.limits_processes(list(cgroups)):
        # Per-user count: allow what this user already runs plus the worker's share.
        processes = limits.get("processes") or 128
        wanted.append(("processes", resource.RLIMIT_NPROC, _tasks_of_uid(os.getuid()) + processes))
    for name, which, value in wanted:
        if value is None:
            continue
        _, hard = resource.getrlimit(which)
        if hard != resource.RLIM_INFINITY:
            value = min(value, hard)
        resource.setrlimit(which, (value, value))
        report.rlimits[name] = value


def _tasks_of_uid(uid: int) -> int:
    count = 0
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            if os.stat(f"/proc/{entry}").st_uid == uid:
                count += len(os.listdir(f"/proc/{entry}/task"))
        except OSError:
            continue
    return count


def set_parent_death_signal(kernel_pid: int) -> None:
    """SIGKILL when the thread that started this worker ends (the pool's spawner thread)."""
    _syscalls.prctl(_syscalls.PR_SET_PDEATHSIG, signal.SIGKILL)
    if kernel_pid and os.getppid() != kernel_pid:
        # The kernel died before the signal was armed.
        os._exit(1)


class _CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _CapData(ctypes.Structure):
    _fields_ = [
        ("effective", ctypes.c_uint32),
        ("permitted", ctypes.c_uint32),
        ("inheritable", ctypes.c_uint32),
    ]


def drop_capabilities(report: Confinement) -> None:
    """Lose every capability for good: effective, permitted, inheritable, ambient, bounding.

    Raises:
        SandboxError: a capability is still held afterwards.
    """
    privileged = True
    try:
        _syscalls.prctl(
            _syscalls.PR_SET_SECUREBITS,
            _SECBIT_NOROOT
            | _SECBIT_NOROOT_LOCKED
            | _SECBIT_NO_SETUID_FIXUP
            | _SECBIT_NO_SETUID_FIXUP_LOCKED
            | _SECBIT_KEEP_CAPS_LOCKED,
        )
    except PermissionError:
        privileged = False  # no CAP_SETPCAP: nothing to drop from the bounding set either
    if privileged:
        cap = 0
        while True:
            try:
                _syscalls.prctl(_syscalls.PR_CAPBSET_DROP, cap)
            except OSError:
                break  # EINVAL: past the last capability this kernel knows
            cap += 1
    _syscalls.prctl(_syscalls.PR_CAP_AMBIENT, _syscalls.PR_CAP_AMBIENT_CLEAR_ALL)
    header = _CapHeader(_CAPABILITY_VERSION_3, 0)
    data = (_CapData * 2)()
    try:
        _syscalls.syscall("capset", ctypes.byref(header), ctypes.byref(data))
    except OSError as exc:
        raise SandboxError(f"cannot drop capabilities: {exc.strerror}") from exc
    _syscalls.syscall("capget", ctypes.byref(header), ctypes.byref(data))
    if any(d.effective or d.permitted or d.inheritable for d in data):
        raise SandboxError("capabilities are still held after capset")
    report.capabilities = (
        "all dropped (bounding set and ambient too)" if privileged else "none held"
    )


def protect_tak_dir(workspace: str, report: Confinement) -> None:
    """``.tak/`` read-only in a mount namespace of the worker's own, where it may have one.

    Raises:
        SandboxError: ``.tak`` is not a real directory (a symlink planted in its place).
    """
    try:
        report.protected = _mounts.protect_tak_dir(workspace)
    except OSError as exc:
        if exc.errno not in (errno.EPERM, errno.ENOSYS):
            raise SandboxError(f"cannot make {workspace}/.tak read-only: {exc}") from exc
        # Not root (no CAP_SYS_ADMIN): plugins in .tak/plugins still load only when trusted.
        report.protected = f"not protected: {exc.strerror or exc}"


def set_no_new_privs(report: Confinement) -> None:
    _syscalls.prctl(_syscalls.PR_SET_NO_NEW_PRIVS, 1)
    report.no_new_privs = True


def plugin_read_paths(plugin: str) -> list[str]:
    """Where the plugin's own code lives, found without running any of it.

    ``plugin`` is a module name or a path, optionally with ``:attribute``.
    """
    module, sep, attribute = plugin.rpartition(":")
    if sep and module and attribute.isidentifier():
        plugin = module
    if plugin.endswith(".py") or os.sep in plugin:
        path = os.path.abspath(plugin)
        return [path if os.path.isdir(path) else os.path.dirname(path)]
    top = plugin.partition(".")[0]
    spec = importlib.util.find_spec(top)
    if spec is None:
        return []
    if spec.submodule_search_locations:
        return list(spec.submodule_search_locations)
    return [os.path.dirname(spec.origin)] if spec.origin else []


def runtime_read_paths() -> list[str]:
    """The interpreter, its standard library and site-packages, and loaded packages."""
    paths = {sys.base_prefix, sys.base_exec_prefix, sys.prefix, sys.exec_prefix}
    paths |= {os.path.realpath(p) for p in paths}
    prefixes = tuple(p.rstrip("/") + "/" for p in paths)
    for module in list(sys.modules.values()):
        origin = getattr(module, "__file__", None)
        if not origin or origin.startswith(prefixes):
            continue
        # A package installed in development mode: allow its top-level directory.
        top = sys.modules.get(module.__name__.partition(".")[0])
        top_file = getattr(top, "__file__", None) or origin
        paths.add(os.path.dirname(os.path.abspath(top_file)))
    return sorted(paths)


def landlock_rules(config: WorkerConfig) -> list[landlock.PathRule]:
    execute = landlock.EXECUTE if config.subprocess else 0
    rules = [
        landlock.PathRule(path, landlock.READ | execute)
        for path in [*runtime_read_paths(), *_SYSTEM_READ]
    ]
    rules += [landlock.PathRule(path, landlock.READ) for path in plugin_read_paths(config.plugin)]
    rules += [landlock.PathRule(path, landlock.READ) for path in config.extra_read]
    rules += [landlock.PathRule(path, landlock.READ_FILE) for path in _DEVICES_READ]
    rules.append(landlock.PathRule("/dev/null", landlock.READ_FILE | landlock.WRITE_FILE))
    if config.network:
        rules += [landlock.PathRule(path, landlock.READ) for path in _NETWORK_READ]
    if config.subprocess:
        rules += [
            landlock.PathRule(path, landlock.READ | landlock.EXECUTE) for path in _EXECUTABLES
        ]
    access = landlock.READ_WRITE if config.workspace_access == "write" else landlock.READ
    rules.append(landlock.PathRule(config.workspace, access))
    return rules


def _single_threaded() -> bool:
    try:
        return len(os.listdir("/proc/self/task")) == 1
    except OSError:
        return True


@attrs.frozen(kw_only=True)
class Layers:
    """What ``apply_layers`` puts on the calling process: a worker's, or a program's
    that ``sandbox.exec`` runs.

    Attributes:
        env: the whole environment the confined code sees.
        limits: ``Limits`` as a mapping (``cpu_seconds``, ``memory_bytes``, ...).
        workspace: its ``.tak/`` is made read-only when ``protect_tak`` (``None``: no
            workspace at all).
        network: TCP sockets; ``direct_connect``: the process may ``connect`` itself.
        subprocess: may fork and execute; ``execute``: may only replace itself.
        seccomp, landlock: the mechanism is there (else it is reported missing).
        require: a layer that cannot be applied raises (fail closed) instead of
            being reported in ``Confinement.unconfined``.
    """

    env: Mapping[str, str]
    limits: Mapping[str, int | None]
    workspace: str | None
    protect_tak: bool = True
    network: bool = False
    direct_connect: bool = False
    tcp_ports: Sequence[int] = ()
    subprocess: bool = False
    execute: bool = False
    cgroups: Sequence[str] = ()
    kernel_pid: int = 0
    seccomp: bool = True
    landlock: bool = True
    require: bool = True


def confine(config: WorkerConfig) -> Confinement:
    """Steps 2 to 9 for a plugin worker (step 1, closing fds, comes before the config
    is read).

    Raises:
        SandboxError: a required layer could not be applied.
    """
    layers = Layers(
        env=config.env,
        limits=config.limits,
        workspace=config.workspace,
        network=config.network,
        # The kernel connects for it (sandbox._netbroker): no connect() here.
        direct_connect=False,
        tcp_ports=config.tcp_ports,
        subprocess=config.subprocess,
        cgroups=config.cgroups,
        kernel_pid=config.kernel_pid,
        seccomp=config.seccomp,
        landlock=config.landlock,
        require=config.require,
    )
    return apply_layers(layers, lambda: landlock_rules(config))


def apply_layers(layers: Layers, rules: Callable[[], list[landlock.PathRule]]) -> Confinement:
    """Steps 2 to 9 on the calling process; ``rules`` gives the Landlock rules (called
    after ``no_new_privs``, before seccomp: it may read /proc and /sys).

    Raises:
        SandboxError: a required layer could not be applied.
    """
    report = Confinement()
    # The environment the confined code will see, and nothing else.
    os.environ.clear()
    os.environ.update(layers.env)

    def unavailable(reason: str) -> None:
        if layers.require:
            raise SandboxError(f"refusing to run unconfined: {reason}")
        report.unconfined.append(reason)

    set_rlimits(layers.limits, report, subprocess=layers.subprocess, cgroups=layers.cgroups)
    if (
        layers.subprocess
        and os.getuid() == 0
        and not _cgroup.limits_processes(list(layers.cgroups))
    ):
        # RLIMIT_NPROC never binds root: only a pids cgroup bounds a fork bomb.
        unavailable("no process limit: root may fork only under a pids cgroup")
    set_parent_death_signal(layers.kernel_pid)
    if layers.cgroups:
        _cgroup.join(list(layers.cgroups))
        report.cgroup = ", ".join(layers.cgroups)
    if layers.workspace is not None and layers.protect_tak:
        protect_tak_dir(layers.workspace, report)
    drop_capabilities(report)
    set_no_new_privs(report)
    if not _single_threaded():
        raise SandboxError("the process has more than one thread before confinement")
    # The rules are computed before seccomp and Landlock: they read /proc and /sys.
    path_rules = rules()
    if layers.seccomp:
        try:
            count = seccomp.install(
                seccomp.SeccompPolicy(
                    network=layers.network,
                    subprocess=layers.subprocess,
                    direct_connect=layers.direct_connect,
                    execute=layers.execute,
                )
            )
            report.seccomp = f"{count}-instruction filter"
        except SandboxError as exc:
            unavailable(str(exc))
    else:
        unavailable("seccomp is not available")
    if layers.landlock:
        try:
            result = landlock.restrict_self(path_rules, tcp_connect=layers.tcp_ports)
            parts = ["filesystem"]
            if result.network:
                parts.append("TCP")
            if result.scoped:
                parts.append("signals and abstract sockets scoped")
            report.landlock = f"ABI {result.abi}: " + ", ".join(parts)
        except SandboxError as exc:
            unavailable(str(exc))
    else:
        unavailable("Landlock is not available")
    return report
