"""What one worker may do: the operating-system form of a plugin's permissions.

``kernel.plugin.Permissions`` (what a plugin declares) maps onto ``Policy`` field
by field in the plugin host (``plugins.policy_for``): ``workspace`` (read |
write), ``network`` (a host:port allow-list), ``subprocess`` (may start
programs). Both check their values with the validators here.
"""

from __future__ import annotations

from typing import Any, Literal

import attrs

from kernel._checks import positive
from kernel.errors import UsageError

WorkspaceAccess = Literal["read", "write"]

_GIB = 1024**3
_COUNT = positive(integer=True)
_COUNT_OR_NONE = positive(integer=True, optional=True)


@attrs.frozen(kw_only=True)
class Limits:
    """Resource limits of one worker process (``setrlimit``; processes via a pids cgroup).

    Attributes:
        cpu_seconds: CPU time over the worker's whole life (``RLIMIT_CPU``); past it the
            worker is killed and restarted for the next call.
        memory_bytes: address space (``RLIMIT_AS``): a memory bomb gets ``MemoryError``.
        file_size_bytes: largest file the worker may write (``RLIMIT_FSIZE``).
        open_files: file descriptors (``RLIMIT_NOFILE``).
        processes: tasks (processes and threads) the worker and its children may have,
            enforced only for plugins with ``subprocess`` (the others cannot fork at all).
    """

    cpu_seconds: int | None = attrs.field(default=3600, validator=_COUNT_OR_NONE)
    memory_bytes: int | None = attrs.field(default=4 * _GIB, validator=_COUNT_OR_NONE)
    file_size_bytes: int | None = attrs.field(default=_GIB, validator=_COUNT_OR_NONE)
    open_files: int = attrs.field(default=256, validator=_COUNT)
    processes: int = attrs.field(default=128, validator=_COUNT)


def check_workspace_access(value: Any, where: str) -> None:
    """Raises UsageError unless ``value`` is ``"read"`` or ``"write"`` (``where`` names it)."""
    if value not in ("read", "write"):
        raise UsageError(f"{where}: expected 'read' or 'write', got {value!r}")


def check_network(entries: Any, where: str) -> None:
    """Raises UsageError unless every entry is ``host:port`` (``where[i]`` names the bad one)."""
    for position, entry in enumerate(entries):
        host, sep, port = str(entry).rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise UsageError(
                f"{where}[{position}]: expected 'host:port' (host may be '*'), got {entry!r}"
            )


def _check_workspace(instance: object, attribute: attrs.Attribute[Any], value: Any) -> None:
    check_workspace_access(value, "Policy.workspace")


def _check_network(instance: object, attribute: attrs.Attribute[Any], value: Any) -> None:
    check_network(value, "Policy.network")


@attrs.frozen(kw_only=True)
class Policy:
    """The confinement of one worker.

    Attributes:
        workspace: ``"write"`` (read, create, change, remove inside the workspace) or
            ``"read"``.
        network: ``"host:port"`` entries the plugin may connect to; empty means no
            network at all. The kernel enforces host:port pairs: it resolves approved
            names and makes every connection itself (``sandbox._netbroker``);
            Landlock's TCP port rules remain as a second layer.
        subprocess: may start programs (from the system's binary directories only).
        isolate: the plugin must run confined; when confinement is unavailable it is
            refused unless the pool allows unsandboxed plugins.
        limits: resource limits.
    """

    workspace: WorkspaceAccess = attrs.field(default="write", validator=_check_workspace)
    network: tuple[str, ...] = attrs.field(default=(), converter=tuple, validator=_check_network)
    subprocess: bool = False
    isolate: bool = True
    limits: Limits = Limits()

    @property
    def tcp_ports(self) -> tuple[int, ...]:
        """The TCP ports ``network`` allows, sorted, without repeats."""
        return tuple(sorted({int(e.rpartition(":")[2]) for e in self.network}))
