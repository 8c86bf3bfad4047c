"""A seccomp filter built here, as classic BPF, with no system library.

The filter checks the architecture first (any other ABI, such as 32-bit
``int 0x80`` calls, kills the process), then answers ``EPERM`` for the system
calls a plugin never needs and that Landlock does not cover: ptrace and
cross-process memory, mounts and namespaces, device nodes, io_uring, bpf,
perf, keyrings, file handles, System V IPC, metadata changes (chmod, chown,
utime, xattrs: Landlock has no right for them), and calls that reach other
processes by pid (prlimit, setpriority, scheduler) unless they name the
caller. Sockets are limited to AF_UNIX stream pairs unless the plugin has
network access; without ``subprocess`` no process may be created (threads
may) and nothing may be executed. ``setsid``/``setpgid`` are refused so that
every descendant stays in the worker's process group, which the pool kills
as one.
"""

from __future__ import annotations

import ctypes
import errno
import socket
import struct
from collections.abc import Iterable
from typing import Final

import attrs

from kernel.errors import SandboxError

from . import _syscalls

# Classic BPF opcodes (linux/filter.h).
_LD_W_ABS: Final = 0x20
_JMP_JEQ_K: Final = 0x15
_JMP_JSET_K: Final = 0x45
_JMP_JGE_K: Final = 0x35
_JMP_JA: Final = 0x05
_ALU_AND_K: Final = 0x54
_RET_K: Final = 0x06

RET_KILL_PROCESS: Final = 0x80000000
RET_ERRNO: Final = 0x00050000
RET_ALLOW: Final = 0x7FFF0000

_SECCOMP_SET_MODE_FILTER: Final = 1
_SECCOMP_FILTER_FLAG_TSYNC: Final = 1

# Offsets into struct seccomp_data.
_NR: Final = 0
_ARCH: Final = 4


def _arg_low(i: int) -> int:
    return 16 + 8 * i  # little-endian: the low 32 bits come first


_X32_SYSCALL_BIT: Final = 0x40000000
_CLONE_THREAD: Final = 0x00010000
_CLONE_NAMESPACES: Final = (
    0x00020000  # NEWNS
    | 0x02000000  # NEWCGROUP
    | 0x04000000  # NEWUTS
    | 0x08000000  # NEWIPC
    | 0x10000000  # NEWUSER
    | 0x20000000  # NEWPID
    | 0x40000000  # NEWNET
)
_SOCK_TYPE_MASK: Final = 0xF
_DENIED_IOCTLS: Final = (
    0x40086602,  # FS_IOC_SETFLAGS
    0x40046602,  # FS_IOC32_SETFLAGS
    0x401C5820,  # FS_IOC_FSSETXATTR
    0x40087602,  # FS_IOC_SETVERSION
    0x40047602,  # FS_IOC32_SETVERSION
    0x5412,  # TIOCSTI: type into a terminal
    0x541C,  # TIOCLINUX
)

#: Refused whatever the plugin's permissions.
ALWAYS_DENIED: Final = (
    # other processes' memory and state
    "ptrace",
    "process_vm_readv",
    "process_vm_writev",
    "pidfd_getfd",
    "process_madvise",
    "process_mrelease",
    "kcmp",
    "migrate_pages",
    "move_pages",
    # mounts, namespaces, the system
    "mount",
    "umount2",
    "pivot_root",
    "chroot",
    "unshare",
    "setns",
    "open_tree",
    "open_tree_attr",
    "move_mount",
    "fsopen",
    "fsconfig",
    "fsmount",
    "fspick",
    "mount_setattr",
    "statmount",
    "listmount",
    "swapon",
    "swapoff",
    "reboot",
    "kexec_load",
    "kexec_file_load",
    "init_module",
    "finit_module",
    "delete_module",
    "acct",
    "syslog",
    "settimeofday",
    "clock_settime",
    "clock_adjtime",
    "adjtimex",
    "iopl",
    "ioperm",
    "quotactl",
    "quotactl_fd",
    "lookup_dcookie",
    "vhangup",
    "fanotify_init",
    "uselib",
    # kernel attack surface
    "io_uring_setup",
    "io_uring_enter",
    "io_uring_register",
    "bpf",
    "perf_event_open",
    "userfaultfd",
    "keyctl",
    "add_key",
    "request_key",
    # files: device nodes, handles, metadata Landlock does not cover
    "mknod",
    "mknodat",
    "name_to_handle_at",
    "open_by_handle_at",
    "chmod",
    "fchmod",
    "fchmodat",
    "fchmodat2",
    "chown",
    "fchown",
    "lchown",
    "fchownat",
    "utime",
    "utimes",
    "futimesat",
    "utimensat",
    "setxattr",
    "lsetxattr",
    "fsetxattr",
    "removexattr",
    "lremovexattr",
    "fremovexattr",
    "setxattrat",
    "removexattrat",
    "file_setattr",
    # IPC without a path
    "shmget",
    "shmat",
    "shmctl",
    "shmdt",
    "semget",
    "semop",
    "semctl",
    "semtimedop",
    "msgget",
    "msgsnd",
    "msgrcv",
    "msgctl",
    "mq_open",
    "mq_unlink",
    "mq_timedsend",
    "mq_timedreceive",
    "mq_notify",
    "mq_getsetattr",
    # leaving the process group the pool kills
    "setsid",
    "setpgid",
)

#: Refused unless the plugin has the ``subprocess`` permission.
PROCESS_CREATION: Final = ("fork", "vfork", "execve", "execveat")

#: Common calls answered first, before the long lists are searched (speed only).
_FAST_ALLOW: Final = (
    "read",
    "write",
    "futex",
    "close",
    "mmap",
    "munmap",
    "fstat",
    "newfstatat",
    "openat",
    "lseek",
    "brk",
    "poll",
    "recvfrom",
    "sendto",
    "getpid",
    "clock_gettime",
)


@attrs.frozen
class SeccompPolicy:
    """What the filter lets through beyond the baseline."""

    network: bool = False
    subprocess: bool = False


def available() -> bool:
    """Whether filters can be installed here (kernel support and a known syscall table)."""
    if _syscalls.SYSCALLS is None:
        return False
    try:
        _syscalls.prctl(_syscalls.PR_GET_SECCOMP)
    except OSError:
        return False
    return True


class _Program:
    """A tiny assembler: instructions with symbolic jump targets."""

    def __init__(self) -> None:
        self._code: list[tuple[int, str | int, str | int, int]] = []
        self._labels: dict[str, int] = {}

    def label(self, name: str) -> None:
        self._labels[name] = len(self._code)

    def load(self, offset: int) -> None:
        self._code.append((_LD_W_ABS, 0, 0, offset))

    def and_(self, mask: int) -> None:
        self._code.append((_ALU_AND_K, 0, 0, mask))

    def jump_if(self, op: int, k: int, true: str | int, false: str | int = 0) -> None:
        self._code.append((op, true, false, k))

    def goto(self, target: str) -> None:
        self._code.append((_JMP_JA, target, 0, 0))

    def ret(self, value: int) -> None:
        self._code.append((_RET_K, 0, 0, value))

    def assemble(self) -> bytes:
        out = bytearray()
        for pc, (code, jt, jf, k) in enumerate(self._code):
            if code == _JMP_JA:
                k = self._offset(pc, jt, limit=2**32 - 1)
                jt = 0
            else:
                jt = self._offset(pc, jt, limit=255)
                jf = self._offset(pc, jf, limit=255)
            out += struct.pack("=HBBI", code, jt, jf, k)
        return bytes(out)

    def _offset(self, pc: int, target: str | int, *, limit: int) -> int:
        if isinstance(target, int):
            return target
        offset = self._labels[target] - pc - 1
        if not 0 <= offset <= limit:
            raise AssertionError(f"seccomp program: jump to {target} out of range ({offset})")
        return offset


def build_filter(policy: SeccompPolicy) -> bytes:
    """The BPF program (an array of ``struct sock_filter``) for ``policy``.

    Raises:
        SandboxError: this architecture has no syscall table here.
    """
    table = _syscalls.SYSCALLS
    if table is None or _syscalls.AUDIT_ARCH is None:
        raise SandboxError("seccomp: no syscall table for this architecture")
    deny = RET_ERRNO | errno.EPERM
    p = _Program()
    p.load(_ARCH)
    p.jump_if(_JMP_JEQ_K, _syscalls.AUDIT_ARCH, true=1)
    p.ret(RET_KILL_PROCESS)
    p.load(_NR)
    p.jump_if(_JMP_JGE_K, _X32_SYSCALL_BIT, true=0, false=1)
    p.ret(deny)

    # Classic BPF jumps only forward, at most 255 instructions with a condition:
    # the long lists answer inline, and the argument checks come after them.
    def answer_each(names: Iterable[str], value: int) -> None:
        for name in names:
            p.jump_if(_JMP_JEQ_K, table[name], true=0, false=1)
            p.ret(value)

    def deny_each(names: Iterable[str]) -> None:
        answer_each(names, deny)

    answer_each(_FAST_ALLOW, RET_ALLOW)

    def dispatch(name: str, target: str) -> None:
        p.jump_if(_JMP_JEQ_K, table[name], true=0, false=1)
        p.goto(target)

    deny_each(ALWAYS_DENIED)
    if not policy.subprocess:
        deny_each(PROCESS_CREATION)
    if not policy.network:
        deny_each(("connect",))
    p.jump_if(_JMP_JEQ_K, table["clone3"], true=0, false=1)
    p.ret(RET_ERRNO | errno.ENOSYS)  # its flags are in memory: make libc fall back to clone
    for name, target in (
        ("clone", "clone"),
        ("socket", "socket"),
        ("socketpair", "socketpair"),
        ("kill", "kill"),
        ("prlimit64", "arg0_self"),
        ("sched_setaffinity", "arg0_self"),
        ("sched_setparam", "arg0_self"),
        ("sched_setscheduler", "arg0_self"),
        ("sched_setattr", "arg0_self"),
        ("setpriority", "setpriority"),
        ("ioprio_set", "ioprio_set"),
        ("ioctl", "ioctl"),
    ):
        dispatch(name, target)
    p.ret(RET_ALLOW)

    # clone(flags, ...): never new namespaces; only threads without `subprocess`.
    p.label("clone")
    p.load(_arg_low(0))
    p.jump_if(_JMP_JSET_K, _CLONE_NAMESPACES, true="deny")
    if not policy.subprocess:
        p.jump_if(_JMP_JSET_K, _CLONE_THREAD, true="allow", false="deny")
    p.goto("allow")

    # socket(domain, type, protocol)
    p.label("socket")
    p.load(_arg_low(0))
    if policy.network:
        # AF_UNIX is refused here: a pathname socket would reach outside the workspace.
        p.jump_if(_JMP_JEQ_K, socket.AF_INET, true="allow")
        p.jump_if(_JMP_JEQ_K, socket.AF_INET6, true="allow", false="deny")
    else:
        p.jump_if(_JMP_JEQ_K, socket.AF_UNIX, true="stream_type", false="deny")

    # socketpair(AF_UNIX, SOCK_STREAM | SOCK_SEQPACKET, ...): never datagrams, which
    # could be sent to an address outside the workspace.
    p.label("socketpair")
    p.load(_arg_low(0))
    p.jump_if(_JMP_JEQ_K, socket.AF_UNIX, true=0, false="deny")
    p.label("stream_type")
    p.load(_arg_low(1))
    p.and_(_SOCK_TYPE_MASK)
    p.jump_if(_JMP_JEQ_K, socket.SOCK_STREAM, true="allow")
    p.jump_if(_JMP_JEQ_K, socket.SOCK_SEQPACKET, true="allow", false="deny")

    # kill(-1, sig) signals every process the caller may signal.
    p.label("kill")
    p.load(_arg_low(0))
    p.jump_if(_JMP_JEQ_K, 0xFFFFFFFF, true="deny", false="allow")

    # prlimit64 / sched_set*(pid, ...): only the caller itself (pid 0).
    p.label("arg0_self")
    p.load(_arg_low(0))
    p.jump_if(_JMP_JEQ_K, 0, true="allow", false="deny")

    # setpriority(PRIO_PROCESS, 0, prio) only: PRIO_USER 0 would mean every root process.
    p.label("setpriority")
    p.load(_arg_low(0))
    p.jump_if(_JMP_JEQ_K, 0, true=0, false="deny")
    p.load(_arg_low(1))
    p.jump_if(_JMP_JEQ_K, 0, true="allow", false="deny")

    # ioprio_set(IOPRIO_WHO_PROCESS, 0, prio) only.
    p.label("ioprio_set")
    p.load(_arg_low(0))
    p.jump_if(_JMP_JEQ_K, 1, true=0, false="deny")
    p.load(_arg_low(1))
    p.jump_if(_JMP_JEQ_K, 0, true="allow", false="deny")

    # ioctl(fd, cmd, ...): refuse inode-flag changes and terminal injection.
    p.label("ioctl")
    p.load(_arg_low(1))
    for cmd in _DENIED_IOCTLS:
        p.jump_if(_JMP_JEQ_K, cmd, true="deny")
    p.label("allow")
    p.ret(RET_ALLOW)
    p.label("deny")
    p.ret(deny)
    return p.assemble()


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]


def install(policy: SeccompPolicy) -> int:
    """Install the filter for ``policy`` on every thread of the process.

    ``no_new_privs`` must already be set. Returns the number of instructions.

    Raises:
        SandboxError: the filter could not be installed.
    """
    program = build_filter(policy)
    count = len(program) // 8
    buffer = ctypes.create_string_buffer(program, len(program))
    prog = _SockFprog(count, ctypes.cast(buffer, ctypes.c_void_p))
    try:
        _syscalls.syscall(
            "seccomp",
            ctypes.c_uint(_SECCOMP_SET_MODE_FILTER),
            ctypes.c_uint(_SECCOMP_FILTER_FLAG_TSYNC),
            ctypes.byref(prog),
        )
    except OSError as exc:
        raise SandboxError(f"seccomp: cannot install the filter: {exc.strerror}") from exc
    return count
