"""What confinement this machine can give a worker, and what a policy would lack."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import tempfile
from collections.abc import Callable
from typing import Literal

import attrs

from . import _cgroup, _syscalls, landlock, seccomp
from ._policy import Policy
from ._workspace import openat2_available

IsolationLevel = Literal["full", "partial", "none"]

#: The Landlock ABI from which signals and abstract Unix sockets are scoped too.
FULL_LANDLOCK_ABI = 6


@attrs.frozen(kw_only=True)
class IsolationSupport:
    """The confinement available here (``probe_isolation()``; tests build their own).

    Attributes:
        landlock_abi: 0 when Landlock is missing.
        seccomp: seccomp filters can be installed and this architecture has a table.
        openat2: ``openat2`` with ``RESOLVE_BENEATH`` (else the ``O_NOFOLLOW`` walk).
        uid: the kernel's uid (workers keep it, without capabilities).
        capabilities: how many capabilities the kernel holds (workers drop them all).
        process_limit: how subprocess-enabled workers are held to ``Limits.processes``:
            ``"cgroup:<dir>"``, ``"rlimit"`` (non-root) or ``"none"``.
        memory_limit: how a worker is held to ``Limits.memory_bytes``: ``"cgroup:<dir>"``
            (its whole process tree) or ``"rlimit"`` (``RLIMIT_AS``, each process alone).
        cgroup_version: 1 or 2 when a cgroup mechanism above is in force, else 0.
        freezer: on cgroup v1, where the pool makes freezer cgroups (``None``: v2, where
            every cgroup can be frozen, or no freezer).
        syscall_table: the sandbox knows this architecture's system call numbers
            (without them no seccomp filter can be built, and workers are refused).
    """

    landlock_abi: int
    seccomp: bool
    openat2: bool
    uid: int
    capabilities: int
    process_limit: str
    memory_limit: str = "rlimit"
    cgroup_version: int = 0
    freezer: str | None = None
    arch: str = platform.machine()
    syscall_table: bool = _syscalls.NATIVE is not None

    def cgroup_parents(self) -> _cgroup.Parents:
        """Where the pool creates each worker's cgroups (nowhere when rlimits are all)."""
        memory = self.memory_limit.removeprefix("cgroup:")
        pids = self.process_limit.removeprefix("cgroup:")
        return _cgroup.Parents(
            self.cgroup_version,
            memory if self.memory_limit.startswith("cgroup:") else None,
            pids if self.process_limit.startswith("cgroup:") else None,
            self.freezer,
        )

    @property
    def level(self) -> IsolationLevel:
        if self.landlock_abi < 1 or not self.seccomp:
            return "none"
        if self.landlock_abi < FULL_LANDLOCK_ABI or not self.openat2:
            return "partial"
        return "full"

    def missing(self, policy: Policy) -> list[str]:
        """Why a worker with ``policy`` could not be confined here (empty: it can)."""
        reasons = []
        if self.landlock_abi < 1:
            reasons.append("Landlock is not available in this kernel")
        if not self.syscall_table:
            reasons.append(
                f"no seccomp system call table for this CPU architecture ({self.arch}): "
                "the sandbox knows x86_64 and aarch64"
            )
        elif not self.seccomp:
            reasons.append(f"seccomp filters are not available here ({self.arch})")
        if policy.subprocess and self.process_limit == "none":
            reasons.append(
                "no way to limit processes for a plugin with subprocess (running as root "
                "without a writable pids cgroup; RLIMIT_NPROC does not apply to root)"
            )
        return reasons

    def gaps(self) -> list[str]:
        """Protections that are weaker here than on a full-isolation kernel."""
        gaps = []
        if 1 <= self.landlock_abi < 4:
            gaps.append("Landlock ABI < 4: TCP is limited by seccomp only")
        if 1 <= self.landlock_abi < FULL_LANDLOCK_ABI:
            gaps.append(
                "Landlock ABI < 6: signals to other processes of the same user and "
                "abstract Unix sockets are not scoped"
            )
        if not self.openat2:
            gaps.append("no openat2: confined paths use an O_NOFOLLOW walk that refuses symlinks")
        if self.memory_limit == "rlimit":
            gaps.append(
                "memory is limited by RLIMIT_AS per process only: each child of a plugin "
                "with subprocess may use the limit again (no writable memory cgroup)"
            )
        return gaps

    def memory_mechanism(self) -> str:
        """How ``Limits.memory_bytes`` is enforced here, in words."""
        if self.memory_limit.startswith("cgroup:"):
            where = self.memory_limit.removeprefix("cgroup:")
            controller = "memory controller" if self.cgroup_version == 1 else "memory.max"
            return (
                f"{self._cgroup_name()} {controller} (whole process tree, under "
                f"{where}), plus RLIMIT_AS per process"
            )
        return "RLIMIT_AS only (per process)"

    def _cgroup_name(self) -> str:
        return f"cgroup v{self.cgroup_version}" if self.cgroup_version else "cgroup"

    def process_mechanism(self) -> str:
        """How ``Limits.processes`` is enforced here, in words."""
        if self.process_limit.startswith("cgroup:"):
            where = self.process_limit.removeprefix("cgroup:")
            return f"{self._cgroup_name()} pids controller (pids.max, under {where})"
        if self.process_limit == "rlimit":
            return "RLIMIT_NPROC (per user)"
        return "none: plugins with subprocess are refused (root, no writable pids cgroup)"


def _capability_count() -> int:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("CapEff:"):
                    return bin(int(line.split()[1], 16)).count("1")
    except OSError:
        pass
    return 0


def process_limit_mechanism(parent: str | None) -> str:
    if parent is not None:
        return f"cgroup:{parent}"
    if os.getuid() != 0:
        return "rlimit"
    return "none"


def probe_isolation() -> IsolationSupport:
    """Look at this machine (blocking but quick: a few syscalls and /proc, /sys reads)."""
    parents = _cgroup.find_parents()
    return IsolationSupport(
        landlock_abi=landlock.abi_version(),
        seccomp=seccomp.available(),
        openat2=openat2_available(),
        uid=os.getuid(),
        capabilities=_capability_count(),
        process_limit=process_limit_mechanism(parents.pids),
        memory_limit=f"cgroup:{parents.memory}" if parents.memory is not None else "rlimit",
        cgroup_version=parents.version,
        freezer=parents.freezer,
    )


def _selftest_child(scratch: str) -> dict[str, str]:
    """In a throwaway process: confine it as a worker would, then try to get out."""
    import errno
    import socket

    from ._confine import landlock_rules, protect_tak_dir
    from ._protocol import Confinement, WorkerConfig

    results: dict[str, str] = {}
    os.makedirs(os.path.join(scratch, ".tak", "tmp"))
    report = Confinement()
    protect_tak_dir(scratch, report)
    _syscalls.prctl(_syscalls.PR_SET_NO_NEW_PRIVS, 1)
    rules = landlock_rules(WorkerConfig(plugin="sandbox", workspace=scratch))
    seccomp.install(seccomp.SeccompPolicy())
    landlock.restrict_self(rules)

    def attempt(name: str, fn: Callable[[], object], expected: int) -> None:
        try:
            fn()
        except OSError as exc:
            ok = exc.errno == expected
            results[name] = "denied" if ok else f"failed differently: {exc}"
            return
        results[name] = "ALLOWED"

    attempt("read /etc/passwd", lambda: open("/etc/passwd").close(), errno.EACCES)
    attempt("read /proc/1/environ", lambda: open("/proc/1/environ").close(), errno.EACCES)
    attempt("open a TCP socket", lambda: socket.socket().close(), errno.EPERM)
    attempt("fork", os.fork, errno.EPERM)
    setuid = os.path.join(scratch, "setuid")
    attempt(
        "create a setuid file", lambda: os.close(os.open(setuid, os.O_CREAT, 0o4755)), errno.EPERM
    )
    if report.protected is not None and report.protected.startswith("not protected"):
        results["write in .tak/"] = f"allowed ({report.protected}; plugins still need approval)"
    else:
        tak_file = os.path.join(scratch, ".tak", "planted.py")
        attempt("write in .tak/", lambda: open(tak_file, "w").close(), errno.EROFS)
    with open(os.path.join(scratch, "ok"), "w") as f:
        f.write("ok")
    results["write in the workspace"] = "allowed"
    return results


def selftest(python: str = sys.executable) -> dict[str, str]:
    """Confine a child process for real and report what it could and could not do.

    Blocking (it runs a Python process): call it from a thread in async code.
    """
    code = (
        "import json, sys, sandbox._probe as p; print(json.dumps(p._selftest_child(sys.argv[1])))"
    )
    with tempfile.TemporaryDirectory(prefix="tak-doctor-") as scratch:
        try:
            result = subprocess.run(
                [python, "-I", "-c", code, scratch], capture_output=True, text=True, timeout=60
            )
        except (OSError, subprocess.TimeoutExpired) as exc:
            return {"self-test": f"could not run: {exc}"}
    if result.returncode != 0:
        tail = (result.stderr.strip().splitlines() or ["no output"])[-1]
        return {"self-test": f"confinement failed: {tail}"}
    parsed: dict[str, str] = json.loads(result.stdout)
    return parsed
