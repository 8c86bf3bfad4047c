"""A seccomp filter built here, as classic BPF, with no system library.

The filter checks the architecture first (any other ABI, such as 32-bit
``int 0x80`` calls, kills the process), then answers ``EPERM`` for the system
calls a plugin never needs and that Landlock does not cover: ptrace and
cross-process memory, mounts and namespaces, device nodes, io_uring, bpf,
perf, keyrings, file handles, System V IPC, metadata changes (chmod, chown,
utime, xattrs: Landlock has no right for them), watches (inotify, fanotify:
Landlock does not check them) and calls that reach other processes by pid
(prlimit, setpriority, scheduler) unless they name the caller.

Arguments are checked where the harm is in a register:

1. no call creates a file or directory with setuid, setgid or sticky bits
   (``open``/``openat`` with ``O_CREAT`` or ``O_TMPFILE``, ``creat``,
   ``mkdir``/``mkdirat``); ``openat2``, whose mode is behind a pointer, answers
   ``ENOSYS`` so that libc and the ``Workspace`` fall back to ``openat``;
2. sockets: without the ``network`` permission only AF_UNIX stream pairs, and no
   socket may connect, bind, listen or accept (abstract names included); with it,
   only TCP over IPv4/IPv6 (no UDP, raw, SCTP, MPTCP, packet or netlink sockets),
   no fast-open data or options, no TCP repair, no ``SO_LINGER``, no
   bind/listen/accept, and ``connect`` only while ``direct_connect`` (Landlock
   then limits the ports); in every worker no socket ioctl (0x8900-0x89ff: the
   host's interfaces, addresses and MACs);
3. without ``subprocess`` no process may be created (threads may) and nothing
   may be executed, unless ``execute``: then ``execve`` may replace the process
   (the confine-then-exec launcher, ``sandbox.exec``, needs it; Landlock names the
   files it may run) while it still cannot fork; ``execveat`` and ``memfd_create`` (an anonymous file runs
   through ``execveat`` or ``/proc/self/fd/N``: code on no disk) are refused always;
4. ``fallocate`` may only punch holes (``FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE``,
   which frees blocks); every mode that allocates answers ``EOPNOTSUPP``, as on a
   file system without it, so that glibc's ``posix_fallocate`` writes the blocks
   instead. The disk budget is a number that changes with every write and a filter
   is fixed when it is installed, so no filter can compare ``len`` with what is
   left of it; ``RLIMIT_FSIZE`` bounds a ``fallocate`` only when it grows the file's
   size (``FALLOC_FL_KEEP_SIZE`` allocates past the end unchecked), and even then
   one call takes a whole ``RLIMIT_FSIZE`` of blocks in a millisecond. Written
   blocks cost a page each, at the page cache's pace, which the disk watchdog
   (``sandbox._diskwatch``) can keep up with.

``setsid``/``setpgid`` are refused so that every descendant stays in the
worker's process group, which the pool kills as one, and ``clone`` with
``CLONE_PARENT`` so that every child is the worker's to reap.

Cost: the kernel (5.11+) caches, per system call number, the calls this filter
allows whatever their arguments, so ``read``, ``write``, ``futex``... never run
it. The calls with argument checks do run it, every time: the hottest
(``openat``, ``ioctl``, and with network the send calls) are tested first.
"""

from __future__ import annotations

import ctypes
import errno
import platform
import struct
from collections.abc import Iterable
from typing import Final

import attrs

from kernel.errors import SandboxError

from . import _syscalls

__all__ = [
    "RET_ALLOW",
    "RET_ERRNO",
    "RET_KILL_PROCESS",
    "SeccompPolicy",
    "available",
    "build_filter",
    "install",
]

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
_CLONE_DENIED: Final = (
    # CLONE_PARENT: the child's parent would be the worker's, the kernel, which never
    # reaps it (a zombie per child). CLONE_PARENT_SETTID and the like are harmless.
    0x00008000
    | 0x00020000  # NEWNS
    | 0x02000000  # NEWCGROUP
    | 0x04000000  # NEWUTS
    | 0x08000000  # NEWIPC
    | 0x10000000  # NEWUSER
    | 0x20000000  # NEWPID
    | 0x40000000  # NEWNET
)
# The same values on x86-64 and aarch64 (asm-generic/fcntl.h, linux/socket.h, linux/tcp.h).
_O_CREAT: Final = 0o100
_O_TMPFILE_BIT: Final = 0o20000000  # __O_TMPFILE: O_TMPFILE is this | O_DIRECTORY
_MODE_PRIVILEGE_BITS: Final = 0o7000  # S_ISUID | S_ISGID | S_ISVTX
_AF_UNIX: Final = 1
_AF_INET: Final = 2
_AF_INET6: Final = 10
_SOCK_STREAM: Final = 1
_SOCK_SEQPACKET: Final = 5
_SOCK_TYPE_MASK: Final = 0xF  # the rest of the type is SOCK_NONBLOCK | SOCK_CLOEXEC
_IPPROTO_TCP: Final = 6
_MSG_FASTOPEN: Final = 0x20000000
_DENIED_TCP_OPTIONS: Final = (
    19,  # TCP_REPAIR (and the repair options below): rewrite a connection's state
    20,  # TCP_REPAIR_QUEUE
    21,  # TCP_QUEUE_SEQ
    22,  # TCP_REPAIR_OPTIONS
    29,  # TCP_REPAIR_WINDOW
    23,  # TCP_FASTOPEN: data in the SYN, sent before Landlock sees a connect
    30,  # TCP_FASTOPEN_CONNECT
    33,  # TCP_FASTOPEN_KEY
    34,  # TCP_FASTOPEN_NO_COOKIE
    31,  # TCP_ULP: kernel TLS and other upper layers, attack surface no plugin needs
)
_SOL_SOCKET: Final = 1
# linux/falloc.h: the one fallocate mode a worker may use frees blocks.
_FALLOC_PUNCH_HOLE: Final = 0x01 | 0x02  # FALLOC_FL_KEEP_SIZE | FALLOC_FL_PUNCH_HOLE
# A lingering close blocks whoever holds the last reference; the kernel once did.
_SO_LINGER: Final = 13
_DENIED_IOCTLS: Final = (
    0x40086602,  # FS_IOC_SETFLAGS
    0x40046602,  # FS_IOC32_SETFLAGS
    0x401C5820,  # FS_IOC_FSSETXATTR
    0x40087602,  # FS_IOC_SETVERSION
    0x40047602,  # FS_IOC32_SETVERSION
    0x5412,  # TIOCSTI: type into a terminal
    0x541C,  # TIOCLINUX
)
# Socket ioctls, 0x8900-0x89ff (SIOCGIFCONF, SIOCGIFADDR, SIOCGIFHWADDR...): on any
# socket, the worker's channel included, they fall back to the device ioctls and list
# the host's interfaces, addresses and MACs. Nothing a plugin runtime needs uses them.
_SOCKET_IOCTL_MASK: Final = 0xFFFFFF00
_SOCKET_IOCTLS: Final = 0x8900

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
    # watching files: Landlock does not check inotify or fanotify marks
    "fanotify_init",
    "fanotify_mark",
    # running code that is on no disk (a memfd), so no Landlock execute right applies
    "execveat",
    # descriptors passed over a socket (SCM_RIGHTS, only through sendmsg/sendmmsg): one
    # held in flight in an unread socket keeps an unlinked file's disk out of every
    # count; no runtime a plugin uses sends with them (send/sendto do)
    "sendmsg",
    "sendmmsg",
    # being reached: no plugin declares a listening socket, and Landlock's bind rule
    # does not stop listen()'s automatic bind to an ephemeral port
    "bind",
    "listen",
    "accept",
    "accept4",
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
PROCESS_CREATION: Final = ("fork", "vfork", "execve")

#: Answered ``ENOSYS``, so that callers fall back to a form the filter can check or
#: to a slower way that stays inside the confinement.
NOT_IMPLEMENTED: Final = (
    "clone3",  # flags in memory: libc falls back to clone
    "openat2",  # mode in memory: libc and the Workspace fall back to openat
    "inotify_init",  # watchers fall back to polling, which Landlock does check
    "inotify_init1",
    "inotify_add_watch",
    # An anonymous file can be executed through /proc/self/fd/N (Landlock checks the
    # memfd's own path, on an internal mount, and lets it through): code on no disk.
    "memfd_create",
    # A pidfd of any process carries its uid, cgroup and exit status (PIDFD_GET_INFO);
    # Trio and asyncio fall back to waitid for their own children.
    "pidfd_open",
)

#: Common calls answered early, for kernels without the seccomp action cache (speed only).
_FAST_ALLOW: Final = (
    "read",
    "write",
    "futex",
    "close",
    "mmap",
    "munmap",
    "fstat",
    "newfstatat",
    "lseek",
    "brk",
    "poll",
    "recvfrom",
    "getpid",
    "clock_gettime",
)


@attrs.frozen
class SeccompPolicy:
    """What the filter lets through beyond the baseline.

    Attributes:
        network: TCP sockets over IPv4/IPv6 (Landlock limits the ports).
        subprocess: fork and execve.
        direct_connect: with ``network``, the worker may call ``connect`` itself. False
            when the kernel makes the connections and passes the sockets over the channel.
        execute: without ``subprocess``, ``execve`` is still allowed: the process may
            replace itself (never fork), with a program Landlock lets it execute.
    """

    network: bool = False
    subprocess: bool = False
    direct_connect: bool = True
    execute: bool = False


def available() -> bool:
    """Whether filters can be installed here (kernel support and a known syscall table)."""
    if _syscalls.NATIVE is None:
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


def build_filter(policy: SeccompPolicy, table: _syscalls.SyscallTable | None = None) -> bytes:
    """The BPF program (an array of ``struct sock_filter``) for ``policy``.

    ``table`` is this machine's unless given (tests assemble other architectures').
    Calls the architecture does not have are left out.

    Raises:
        SandboxError: this architecture has no syscall table here.
    """
    if table is None:
        table = _syscalls.NATIVE
    if table is None:
        raise SandboxError(f"seccomp: no syscall table for {platform.machine()}")
    deny = RET_ERRNO | errno.EPERM
    p = _Program()
    p.load(_ARCH)
    p.jump_if(_JMP_JEQ_K, table.audit_arch, true=1)
    p.ret(RET_KILL_PROCESS)
    p.load(_NR)
    p.jump_if(_JMP_JGE_K, _X32_SYSCALL_BIT, true=0, false=1)
    p.ret(deny)

    # Classic BPF jumps only forward, at most 255 instructions with a condition:
    # the long lists answer inline, and the argument checks come after them.
    def answer_each(names: Iterable[str], value: int) -> None:
        for name in names:
            nr = table.get(name)
            if nr is not None:
                p.jump_if(_JMP_JEQ_K, nr, true=0, false=1)
                p.ret(value)

    def dispatch(name: str, target: str) -> None:
        nr = table.get(name)
        if nr is not None:
            p.jump_if(_JMP_JEQ_K, nr, true=0, false=1)
            p.goto(target)

    # The calls with argument checks run the filter every time: the hot ones first.
    dispatch("openat", "openat")
    dispatch("ioctl", "ioctl")
    if policy.network:
        dispatch("sendto", "msg_flags_arg3")
    answer_each(_FAST_ALLOW, RET_ALLOW)

    answer_each(ALWAYS_DENIED, deny)
    if not policy.subprocess:
        creation: tuple[str, ...] = PROCESS_CREATION
        if policy.execute:
            creation = tuple(n for n in creation if n != "execve")
        answer_each(creation, deny)
    if not (policy.network and policy.direct_connect):
        answer_each(("connect",), deny)
    answer_each(NOT_IMPLEMENTED, RET_ERRNO | errno.ENOSYS)
    for name, target in (
        ("open", "open"),
        ("creat", "mode_arg1"),
        ("mkdir", "mode_arg1"),
        ("mkdirat", "mode_arg2"),
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
        ("fallocate", "fallocate"),
    ):
        dispatch(name, target)
    if policy.network:
        dispatch("setsockopt", "setsockopt")
    p.ret(RET_ALLOW)

    # openat(dfd, path, flags, mode) and open(path, flags, mode): the mode counts only
    # when the call creates (O_CREAT, O_TMPFILE); otherwise its register is garbage.
    p.label("openat")
    p.load(_arg_low(2))
    p.jump_if(_JMP_JSET_K, _O_CREAT | _O_TMPFILE_BIT, true="mode_arg3", false="allow")
    p.label("open")
    p.load(_arg_low(1))
    p.jump_if(_JMP_JSET_K, _O_CREAT | _O_TMPFILE_BIT, true="mode_arg2", false="allow")
    # creat(path, mode), mkdir(path, mode), mkdirat(dfd, path, mode): a setuid root
    # file or setgid directory in the workspace would outlive the worker.
    for arg in (1, 2, 3):
        p.label(f"mode_arg{arg}")
        p.load(_arg_low(arg))
        p.jump_if(_JMP_JSET_K, _MODE_PRIVILEGE_BITS, true="deny", false="allow")

    # sendto(fd, buf, len, flags, ...): MSG_FASTOPEN connects and sends in one call, and
    # Landlock sees no connect (sendmsg and sendmmsg are refused outright).
    # An address on a connected or unconnected TCP socket is otherwise ignored or refused.
    p.label("msg_flags_arg3")
    p.load(_arg_low(3))
    p.jump_if(_JMP_JSET_K, _MSG_FASTOPEN, true="deny", false="allow")

    # setsockopt(fd, level, name, ...): no fast open, no repair, no upper-layer protocol,
    # no SO_LINGER. Other options are harmless without bind: SO_BINDTODEVICE picks an
    # interface, the destination port is still Landlock's; SO_MARK and IP_TRANSPARENT
    # need capabilities.
    p.label("setsockopt")
    p.load(_arg_low(1))
    p.jump_if(_JMP_JEQ_K, _SOL_SOCKET, true=0, false=2)
    p.load(_arg_low(2))
    p.jump_if(_JMP_JEQ_K, _SO_LINGER, true="deny", false="allow")
    p.jump_if(_JMP_JEQ_K, _IPPROTO_TCP, true=0, false="allow")
    p.load(_arg_low(2))
    for option in _DENIED_TCP_OPTIONS:
        p.jump_if(_JMP_JEQ_K, option, true="deny")
    p.goto("allow")

    # clone(flags, ...): never new namespaces or CLONE_PARENT; only threads without
    # `subprocess`.
    p.label("clone")
    p.load(_arg_low(0))
    p.jump_if(_JMP_JSET_K, _CLONE_DENIED, true="deny")
    if not policy.subprocess:
        p.jump_if(_JMP_JSET_K, _CLONE_THREAD, true="allow", false="deny")
    p.goto("allow")

    # socket(domain, type, protocol)
    p.label("socket")
    p.load(_arg_low(0))
    if policy.network:
        # TCP only: Landlock's port rules cover TCP connect and nothing else (not UDP,
        # not MPTCP, not SCTP). AF_UNIX is refused: a pathname socket reaches outside.
        p.jump_if(_JMP_JEQ_K, _AF_INET, true=1)
        p.jump_if(_JMP_JEQ_K, _AF_INET6, true=0, false="deny")
        p.load(_arg_low(1))
        p.and_(_SOCK_TYPE_MASK)
        p.jump_if(_JMP_JEQ_K, _SOCK_STREAM, true=0, false="deny")
        p.load(_arg_low(2))
        p.jump_if(_JMP_JEQ_K, 0, true="allow")
        p.jump_if(_JMP_JEQ_K, _IPPROTO_TCP, true="allow", false="deny")
    else:
        p.jump_if(_JMP_JEQ_K, _AF_UNIX, true="stream_type", false="deny")

    # socketpair(AF_UNIX, SOCK_STREAM | SOCK_SEQPACKET, ...): never datagrams, which
    # could be sent to an address outside the workspace.
    p.label("socketpair")
    p.load(_arg_low(0))
    p.jump_if(_JMP_JEQ_K, _AF_UNIX, true=0, false="deny")
    p.label("stream_type")
    p.load(_arg_low(1))
    p.and_(_SOCK_TYPE_MASK)
    p.jump_if(_JMP_JEQ_K, _SOCK_STREAM, true="allow")
    p.jump_if(_JMP_JEQ_K, _SOCK_SEQPACKET, true="allow", false="deny")

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

    # fallocate(fd, mode, offset, len): only a hole punch (mode is an int: its low half).
    p.label("fallocate")
    p.load(_arg_low(1))
    p.jump_if(_JMP_JEQ_K, _FALLOC_PUNCH_HOLE, true="allow", false=0)
    p.ret(RET_ERRNO | errno.EOPNOTSUPP)

    # ioctl(fd, cmd, ...): refuse inode-flag changes, terminal injection and the socket
    # ioctls (a range: the command is an unsigned int, its high half ignored).
    p.label("ioctl")
    p.load(_arg_low(1))
    for cmd in _DENIED_IOCTLS:
        p.jump_if(_JMP_JEQ_K, cmd, true="deny")
    p.and_(_SOCKET_IOCTL_MASK)
    p.jump_if(_JMP_JEQ_K, _SOCKET_IOCTLS, true="deny", false="allow")
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
