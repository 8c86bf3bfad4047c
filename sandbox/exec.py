"""Confine, then exec: run a program under the sandbox plugin workers have.

::

    python -I -m sandbox.exec POLICY_FD REPORT_FD

reads an ``ExecPolicy`` (JSON) from ``POLICY_FD``, arms ``PDEATHSIG``, starts
the program's process in a PID namespace under an init of ours that dies with
the launcher (``_supervise``: nothing the program starts outlives the kernel),
where it puts on itself the layers of ``sandbox._confine`` in the same order (a
cleared environment, rlimits, ``PDEATHSIG``, cgroups, ``.tak/`` read-only, no
capabilities, ``no_new_privs``, seccomp, Landlock), writes what it applied to
``REPORT_FD`` (one JSON line, ``{"confinement": {...}}``), and replaces itself
with the program (``os.execve``). ``REPORT_FD`` is close-on-exec: its end of file, with no
``{"error": ...}`` line, tells the caller the program is running.

A layer that cannot be applied stops the launch (fail closed): one line on
stderr and on ``REPORT_FD``, exit status 126, unless the policy does not
``require`` confinement (then the gap is reported in ``unconfined``).

The program may execute (Landlock ``EXECUTE``) only what it needs to start:

- its executable (the real file behind ``argv[0]``), the interpreters of its
  ``#!`` line (``/usr/bin/env NAME`` looked up on ``PATH``) and the ELF
  interpreter (``ld.so``) of each; with ``subprocess``, the system's binary
  directories too. Without ``subprocess`` the seccomp filter lets ``execve``
  replace the process (how a ``#!`` script or ``env`` starts) but never fork;

and read:

- the system's libraries (``sandbox._confine``), the installation prefix of the
  program and of each interpreter (``PREFIX`` of ``PREFIX/bin/NAME``, when it
  holds a ``lib`` directory or a ``pyvenv.cfg``: a virtual environment, a
  Python or Node installation), the files its arguments name, and the ``read``
  paths of the policy; ``write`` paths read-write; the workspace read-only,
  read-write or not at all.

Network: with ``network``, TCP sockets, and ``connect`` only to the declared
ports (Landlock). The host part of ``host:port`` cannot be enforced here: the
kernel's connection broker (``sandbox._netbroker``) serves plugin workers over
their channel, which an exec'd program does not speak. UDP (so DNS over UDP) is
refused: Landlock has no UDP rules, and a UDP socket would reach any host.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import select
import shutil
import signal
import struct
import sys
from collections.abc import Iterable, Sequence
from typing import Any, Literal

import attrs

from kernel.errors import SandboxError

from . import _cgroup, _protocol, _syscalls, landlock
from ._confine import (
    _DEVICES_READ,
    _EXECUTABLES,
    _NETWORK_READ,
    _SYSTEM_READ,
    Layers,
    apply_layers,
    set_parent_death_signal,
)
from ._policy import check_network
from ._protocol import Confinement

__all__ = [
    "ExecPolicy",
    "ExecWorkspace",
    "ProgramFiles",
    "cgroups_limit_memory",
    "launcher_argv",
    "main",
    "make_cgroups",
    "parse_report",
    "program_files",
    "remove_cgroups",
    "resolve_program",
]

#: Exit status of a launch that was refused or failed (as shells use for "cannot run").
EXIT_REFUSED = 126
#: The ``PATH`` a program is looked up on when its environment has none.
DEFAULT_PATH = "/usr/local/bin:/usr/bin:/bin"
#: Name resolution from files (DNS itself needs ``RES_OPTIONS=use-vc`` and port 53).
_RESOLVER_READ = (
    "/etc/resolv.conf",
    "/etc/hosts",
    "/etc/nsswitch.conf",
    "/etc/gai.conf",
    "/etc/host.conf",
)
_MAX_POLICY_BYTES = 1 << 20
_CLONE_NEWPID = 0x20000000
_CLONE_NEWUSER = 0x10000000
_PR_SET_CHILD_SUBREAPER = 36
#: How many ``#!`` interpreters deep a program is followed (the kernel allows 4).
_MAX_INTERPRETERS = 4

ExecWorkspace = Literal["read", "write", "none"]


@attrs.frozen(kw_only=True)
class ExecPolicy:
    """What the launcher runs, and under which confinement.

    Attributes:
        argv: the program (``argv[0]``, an absolute path: ``resolve_program``) and
            its arguments.
        env: the program's whole environment.
        workspace: the workspace directory (``None``: none), reached as
            ``workspace_access`` says (``"none"``: not at all).
        read: more paths the program may read.
        write: paths it may read and write (its own state directory).
        network: ``host:port`` entries: TCP to these ports (any host).
        subprocess: may start programs (from the system's binary directories).
        limits: ``sandbox.Limits`` as a mapping.
        cgroups: cgroups to join (made by the caller, which removes them).
        kernel_pid: the process that must be its parent (``PDEATHSIG``).
        require: refuse to run when a layer cannot be applied.
        pid_namespace: run the program in a PID namespace where one can be made
            (``False``: the launcher supervises it by hand, as where none can).
    """

    argv: tuple[str, ...]
    env: dict[str, str] = attrs.Factory(dict)
    workspace: str | None = None
    workspace_access: ExecWorkspace = "none"
    read: tuple[str, ...] = ()
    write: tuple[str, ...] = ()
    network: tuple[str, ...] = ()
    subprocess: bool = False
    limits: dict[str, int | None] = attrs.Factory(dict)
    cgroups: tuple[str, ...] = ()
    kernel_pid: int = 0
    require: bool = True
    pid_namespace: bool = True

    def to_json(self) -> bytes:
        return json.dumps(_protocol.converter.unstructure(self)).encode()

    @classmethod
    def from_json(cls, raw: bytes) -> ExecPolicy:
        """Raises: SandboxError: not a policy (the field is named by path)."""
        try:
            data = json.loads(raw)
        except ValueError as exc:
            raise SandboxError(f"the policy is not JSON: {exc}") from None
        if not isinstance(data, dict):
            raise SandboxError("the policy is not a JSON object")
        try:
            policy: ExecPolicy = _protocol.structure_frame(data, cls)
        except _protocol.WorkerFrameError as exc:
            raise SandboxError(str(exc).replace("malformed None frame", "bad policy")) from None
        if not policy.argv or not os.path.isabs(policy.argv[0]):
            raise SandboxError("bad policy: $.argv[0]: expected an absolute path")
        check_network(policy.network, "$.network")
        return policy

    @property
    def tcp_ports(self) -> tuple[int, ...]:
        return tuple(sorted({int(e.rpartition(":")[2]) for e in self.network}))


# -- the program's files ------------------------------------------------------------


def resolve_program(command: str, *, path: str | None = None, cwd: str | None = None) -> str:
    """``command`` as an absolute path: looked up on ``path`` when it has no ``/``.

    Raises:
        SandboxError: it is not found or not executable.
    """
    if os.sep in command:
        found = os.path.abspath(os.path.join(cwd or os.getcwd(), command))
        if not (os.path.isfile(found) and os.access(found, os.X_OK)):
            raise SandboxError(f"{command}: no such executable file")
        return found
    found_on_path = shutil.which(command, path=path or DEFAULT_PATH)
    if found_on_path is None:
        raise SandboxError(f"{command}: not found on PATH ({path or DEFAULT_PATH})")
    return os.path.abspath(found_on_path)


@attrs.frozen
class ProgramFiles:
    """The files a program runs from, found without running it.

    Attributes:
        executables: its executable and ``#!`` interpreters (real paths), in order.
        loaders: the ELF interpreters (``ld.so``) of those.
        prefixes: installation directories to read (see the module docstring).
        arguments: regular files its arguments name (real paths).
    """

    executables: tuple[str, ...]
    loaders: tuple[str, ...]
    prefixes: tuple[str, ...]
    arguments: tuple[str, ...]

    def digest(self) -> str:
        """SHA-256 over the executables and the argument files (names and bytes).

        Raises:
            OSError: one cannot be read.
        """
        total = hashlib.sha256()
        for path in (*self.executables, *self.arguments):
            total.update(f"{path}\0".encode())
            with open(path, "rb") as f:
                for chunk in iter(lambda: f.read(1 << 20), b""):
                    total.update(chunk)
            total.update(b"\0")
        return total.hexdigest()


def program_files(
    argv: Sequence[str], *, path: str | None = None, cwd: str | None = None
) -> ProgramFiles:
    """The files of ``argv`` (``argv[0]`` absolute; ``path`` is its ``PATH``)."""
    executables: list[str] = []
    given: list[str] = [argv[0]]
    current = argv[0]
    for _ in range(_MAX_INTERPRETERS + 1):
        real = os.path.realpath(current)
        if real in executables:
            break
        executables.append(real)
        interpreters = _shebang_interpreters(real, path)
        if not interpreters:
            break
        # `#!/usr/bin/env NAME`: env runs first, then NAME (env's own real file is
        # executable too).
        *runners, current = interpreters
        executables += [
            os.path.realpath(r) for r in runners if os.path.realpath(r) not in executables
        ]
        given += interpreters
    loaders = [loader for e in executables if (loader := _elf_interpreter(e)) is not None]
    prefixes: list[str] = []
    for program in [*given, *executables]:
        prefix = _installation_prefix(program)
        if prefix is not None and prefix not in prefixes:
            prefixes.append(prefix)
    arguments: list[str] = []
    for arg in argv[1:]:
        candidate = os.path.join(cwd or os.getcwd(), arg)
        if arg and not arg.startswith("-") and os.path.isfile(candidate):
            arguments.append(os.path.realpath(candidate))
    return ProgramFiles(
        tuple(executables),
        tuple(dict.fromkeys(os.path.realpath(p) for p in loaders)),
        tuple(prefixes),
        tuple(dict.fromkeys(arguments)),
    )


def _shebang_interpreters(path: str, search: str | None) -> list[str]:
    """The programs a ``#!`` line runs, in order: ``[interpreter]``, or for
    ``#!/usr/bin/env NAME``, ``[env, NAME found on search]``; empty for no ``#!``."""
    try:
        with open(path, "rb") as f:
            head = f.read(256)
    except OSError:
        return []
    if not head.startswith(b"#!"):
        return []
    words = head[2:].split(b"\n", 1)[0].decode(errors="replace").split()
    if not words:
        return []
    interpreter = words[0]
    if os.path.basename(interpreter) == "env":
        names = [w for w in words[1:] if not w.startswith("-") and "=" not in w]
        found = shutil.which(names[0], path=search or DEFAULT_PATH) if names else None
        if found:
            return [interpreter, os.path.abspath(found)]
    return [interpreter]


def _elf_interpreter(path: str) -> str | None:
    """``PT_INTERP`` of a 64-bit little-endian ELF file, else ``None``."""
    try:
        with open(path, "rb") as f:
            header = f.read(64)
            if len(header) < 64 or header[:4] != b"\x7fELF" or header[4] != 2 or header[5] != 1:
                return None
            phoff = struct.unpack_from("<Q", header, 0x20)[0]
            phentsize, phnum = struct.unpack_from("<HH", header, 0x36)
            for index in range(min(phnum, 64)):
                f.seek(phoff + index * phentsize)
                entry = f.read(56)
                if len(entry) < 56:
                    return None
                p_type, _, p_offset = struct.unpack_from("<IIQ", entry, 0)
                if p_type == 3:  # PT_INTERP
                    p_filesz = struct.unpack_from("<Q", entry, 32)[0]
                    f.seek(p_offset)
                    return f.read(min(p_filesz, 4096)).rstrip(b"\0").decode()
    except (OSError, struct.error, UnicodeDecodeError):
        return None
    return None


def _installation_prefix(program: str) -> str | None:
    folder = os.path.dirname(program)
    if os.path.basename(folder) not in ("bin", "sbin"):
        return None
    prefix = os.path.dirname(folder)
    home = os.path.expanduser("~")
    if prefix in ("/", "") or os.path.commonpath([prefix, home]) == prefix:
        return None  # never all of / or of a home directory
    if os.path.isdir(os.path.join(prefix, "lib")) or os.path.isfile(
        os.path.join(prefix, "pyvenv.cfg")
    ):
        return prefix
    return None


def exec_rules(policy: ExecPolicy, files: ProgramFiles) -> list[landlock.PathRule]:
    """The Landlock rules of ``policy`` for a program made of ``files``."""
    run = landlock.READ | landlock.EXECUTE
    rules = [landlock.PathRule(p, landlock.READ) for p in _SYSTEM_READ]
    rules += [landlock.PathRule(p, run) for p in (*files.executables, *files.loaders)]
    rules += [landlock.PathRule(p, landlock.READ) for p in (*files.prefixes, *files.arguments)]
    rules += [landlock.PathRule(p, landlock.READ) for p in policy.read]
    rules += [landlock.PathRule(p, landlock.READ_WRITE) for p in policy.write]
    rules += [landlock.PathRule(p, landlock.READ_FILE) for p in _DEVICES_READ]
    rules.append(landlock.PathRule("/dev/null", landlock.READ_FILE | landlock.WRITE_FILE))
    if policy.network:
        rules += [landlock.PathRule(p, landlock.READ) for p in (*_NETWORK_READ, *_RESOLVER_READ)]
    if policy.subprocess:
        rules += [landlock.PathRule(p, run) for p in (*_EXECUTABLES, *_SYSTEM_READ)]
    if policy.workspace is not None and policy.workspace_access != "none":
        access = landlock.READ_WRITE if policy.workspace_access == "write" else landlock.READ
        rules.append(landlock.PathRule(policy.workspace, access))
    return rules


# -- cgroups ---------------------------------------------------------------------------


@functools.cache
def _cgroup_parents() -> _cgroup.Parents:
    return _cgroup.find_parents()


def make_cgroups(*, memory_bytes: int | None, processes: int | None) -> list[str]:
    """A cgroup set for one program (memory of its whole process tree, its task count),
    as the pool makes one per worker; empty where this process cannot make cgroups.
    Blocking: call it in a thread; ``remove_cgroups`` when the program has ended.

    Raises:
        OSError: it could not be made (nothing is left behind).
    """
    return _cgroup.create(_cgroup_parents(), memory_bytes=memory_bytes, max_pids=processes)


def cgroups_limit_memory() -> bool:
    """Whether ``make_cgroups`` puts a memory limit on the program's whole tree."""
    return _cgroup_parents().memory is not None


def remove_cgroups(paths: Sequence[str]) -> None:
    """Kill what is left in ``paths`` and remove them (blocking)."""
    _cgroup.destroy(list(paths))


# -- the launcher -------------------------------------------------------------------


def confine_and_exec(policy: ExecPolicy, report_fd: int) -> None:
    """Confine this process as ``policy`` says, report, and exec the program.

    Returns only by raising.

    Raises:
        SandboxError: a required layer could not be applied.
    """
    path = policy.env.get("PATH")
    files = program_files(policy.argv, path=path)
    # The launcher dies with the kernel's spawner thread; everything the server
    # starts dies with the launcher (a PID namespace whose init is ours).
    set_parent_death_signal(policy.kernel_pid)
    supervised = _supervise(policy, report_fd)
    layers = Layers(
        env=policy.env,
        limits=policy.limits,
        workspace=policy.workspace,
        # .tak/ matters only where the program may write.
        protect_tak=policy.workspace_access == "write",
        network=bool(policy.network),
        direct_connect=True,
        tcp_ports=policy.tcp_ports,
        subprocess=policy.subprocess,
        execute=True,
        cgroups=policy.cgroups,
        # Checked above, by the launcher: the server's parent is our init.
        kernel_pid=0,
        seccomp=_seccomp_available(),
        landlock=landlock.abi_version() >= 1,
        require=policy.require,
    )
    report = apply_layers(layers, lambda: exec_rules(policy, files))
    if not supervised:
        report.unconfined.append("no PID namespace: the launcher ends its processes")
    _write_line(report_fd, {"confinement": report.to_json()})
    try:
        os.execve(policy.argv[0], list(policy.argv), policy.env)
    except OSError as exc:
        raise SandboxError(f"cannot execute {policy.argv[0]}: {exc.strerror or exc}") from None


def _supervise(policy: ExecPolicy, report_fd: int) -> bool:
    """Run the rest of the launch (confine, exec) in a child that cannot outlive us.

    The launcher makes a PID namespace (``CLONE_NEWPID``; not root: with a user
    namespace of its own, where the system allows one) and forks its init, a
    process of ours that never runs the server's code: it arms ``PDEATHSIG``
    against the launcher (single-threaded: its one thread is the parent), forks
    the server's process and reaps until that ends, exiting with its status. When
    the init ends (the server ended, or the launcher died with the kernel), the
    kernel kills every process of the namespace: the server, its children, and
    whatever shed its own ``PDEATHSIG``. Neither the launcher nor the init keeps
    the server's stdin, stdout or ``report_fd`` open.

    Where no PID namespace can be made (or the policy asks for none), the launcher
    supervises the server itself (``_supervise_by_hand``).

    Returns (in the server's process) whether it is in a PID namespace.

    Raises:
        SandboxError: the launcher could not fork.
    """
    if policy.pid_namespace:
        try:
            _new_pid_namespace()
        except OSError:
            pass
        else:
            _supervise_in_namespace(report_fd)
            return True
    _supervise_by_hand(policy, report_fd)
    return False


def _supervise_in_namespace(report_fd: int) -> None:
    alive_r, alive_w = os.pipe()
    try:
        init = os.fork()
    except OSError as exc:
        raise SandboxError(f"cannot fork the server's init: {exc.strerror}") from None
    if init:
        # The launcher: waits for the init, exits with its status.
        os.close(alive_r)
        _let_go_of_stdio(report_fd)
        os._exit(_reap(init, any_child=False))
    os.close(alive_w)
    try:
        _syscalls.prctl(_syscalls.PR_SET_PDEATHSIG, signal.SIGKILL)
        # The launcher died before that was armed: its end of the pipe is closed.
        if _hung_up(alive_r):
            os._exit(EXIT_REFUSED)
        server = os.fork()
    except OSError:
        os._exit(EXIT_REFUSED)
    if server:
        _let_go_of_stdio(report_fd)
        os.close(alive_r)
        os._exit(_reap(server, any_child=True))
    os.close(alive_r)


def _supervise_by_hand(policy: ExecPolicy, report_fd: int) -> None:
    """Without a PID namespace: the launcher is the subreaper of the server's tree, and
    ends it (its cgroups, then each process it is left with) when the kernel dies
    (``PDEATHSIG`` is ``SIGTERM`` here, which it handles), when it is sent ``SIGTERM``,
    or when the server ends. Weaker than a namespace: a ``SIGKILL`` the launcher
    receives (the kernel's last resort, or a server that can signal it: without
    Landlock's scopes) leaves the tree to the server's own ``PDEATHSIG``."""
    cgroups = list(policy.cgroups)

    def end(signum: int, frame: object) -> None:
        _end_tree(cgroups)
        os._exit(128 + signum)

    _syscalls.prctl(_PR_SET_CHILD_SUBREAPER, 1)
    signal.signal(signal.SIGTERM, end)
    _syscalls.prctl(_syscalls.PR_SET_PDEATHSIG, signal.SIGTERM)
    if policy.kernel_pid and os.getppid() != policy.kernel_pid:
        os._exit(1)  # the kernel died before that was armed
    try:
        server = os.fork()
    except OSError as exc:
        raise SandboxError(f"cannot fork the server's process: {exc.strerror}") from None
    if server == 0:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        return
    _let_go_of_stdio(report_fd)
    status = _reap(server, any_child=True)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    _end_tree(cgroups)
    os._exit(status)


def _end_tree(cgroups: Sequence[str]) -> None:
    """SIGKILL whatever is left in ``cgroups``, then every child of this process (the
    subreaper: orphans of the tree come to it) until it has none."""
    with contextlib.suppress(OSError):
        _cgroup.thaw(list(cgroups))
    for path in cgroups:
        with contextlib.suppress(OSError):
            _cgroup.kill_members(path)
    me = os.getpid()
    for _ in range(1 << 16):
        try:
            with open(f"/proc/{me}/task/{me}/children") as f:
                children = [int(c) for c in f.read().split()]
        except OSError:
            children = []
        for child in children:
            with contextlib.suppress(OSError):
                os.kill(child, signal.SIGKILL)
        try:
            os.waitpid(-1, 0)
        except ChildProcessError:
            return


def _new_pid_namespace() -> None:
    """The next child of this process starts a PID namespace (and is its init).

    Raises:
        OSError: this process may not make one.
    """
    try:
        _syscalls.syscall("unshare", _CLONE_NEWPID)
        return
    except OSError:
        if os.getuid() == 0:
            raise
    uid, gid = os.getuid(), os.getgid()
    _syscalls.syscall("unshare", _CLONE_NEWUSER | _CLONE_NEWPID)
    # The same ids inside: files keep their owners; setgroups must be off first.
    for name, text in (
        ("setgroups", "deny"),
        ("uid_map", f"{uid} {uid} 1"),
        ("gid_map", f"{gid} {gid} 1"),
    ):
        with open(f"/proc/self/{name}", "w") as f:
            f.write(text)


def _hung_up(fd: int) -> bool:
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    return bool(poller.poll(0))  # readable means end of file: no writer is left


def _let_go_of_stdio(report_fd: int) -> None:
    """Close our copies of the server's stdin, stdout and report (stderr stays: the log)."""
    null = os.open(os.devnull, os.O_RDWR)
    os.dup2(null, 0)
    os.dup2(null, 1)
    os.close(null)
    with contextlib.suppress(OSError):
        os.close(report_fd)


def _reap(child: int, *, any_child: bool) -> int:
    """Wait for ``child`` (as an init, reaping any other on the way); its exit status,
    or 128 + the signal that killed it."""
    while True:
        try:
            pid, status = os.waitpid(-1 if any_child else child, 0)
        except ChildProcessError:
            return EXIT_REFUSED
        if pid == child:
            code = os.waitstatus_to_exitcode(status)
            return 128 - code if code < 0 else code


def _seccomp_available() -> bool:
    from . import seccomp

    return seccomp.available()


def _write_line(fd: int, value: dict[str, Any]) -> None:
    data = json.dumps(value).encode() + b"\n"
    try:
        while data:
            data = data[os.write(fd, data) :]
    except OSError:
        pass  # the caller stopped listening: it learns from the exit status


def read_policy(fd: int) -> ExecPolicy:
    """Raises: SandboxError: unreadable, too big, or not a policy."""
    chunks: list[bytes] = []
    size = 0
    try:
        while chunk := os.read(fd, 65536):
            size += len(chunk)
            if size > _MAX_POLICY_BYTES:
                raise SandboxError(f"the policy is larger than {_MAX_POLICY_BYTES} bytes")
            chunks.append(chunk)
    except OSError as exc:
        raise SandboxError(f"cannot read the policy: {exc.strerror}") from None
    finally:
        os.close(fd)
    return ExecPolicy.from_json(b"".join(chunks))


def parse_report(lines: Iterable[bytes]) -> tuple[Confinement | None, str | None]:
    """What the launcher wrote on its report descriptor: ``(confinement, error)``."""
    confinement: Confinement | None = None
    error: str | None = None
    for line in lines:
        try:
            data = json.loads(line)
        except ValueError:
            continue
        if not isinstance(data, dict):
            continue
        if isinstance(data.get("error"), str):
            error = data["error"]
        elif isinstance(data.get("confinement"), dict):
            try:
                confinement = _protocol.converter.structure(data["confinement"], Confinement)
            except Exception:
                error = "the launcher's report is not a confinement"
    return confinement, error


def launcher_argv(policy_fd: int, report_fd: int, python: str = sys.executable) -> list[str]:
    """The command that runs the launcher with these descriptors."""
    return [python, "-I", "-m", "sandbox.exec", str(policy_fd), str(report_fd)]


def main(argv: Sequence[str]) -> int:
    """``python -m sandbox.exec POLICY_FD REPORT_FD``; returns only on failure."""
    if len(argv) != 2 or not all(a.isdigit() for a in argv):
        print("usage: python -m sandbox.exec POLICY_FD REPORT_FD", file=sys.stderr)
        return 2
    policy_fd, report_fd = int(argv[0]), int(argv[1])
    os.set_inheritable(report_fd, False)  # closed by the exec: its EOF means "running"
    try:
        policy = read_policy(policy_fd)
        confine_and_exec(policy, report_fd)
        reason = "execve returned"  # pragma: no cover (it does not)
    except SandboxError as exc:
        reason = str(exc)
    reason = " ".join(reason.split())
    print(f"sandbox.exec: {reason}", file=sys.stderr, flush=True)
    _write_line(report_fd, {"error": reason})
    return EXIT_REFUSED


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
