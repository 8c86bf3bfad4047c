"""Raw Linux system calls the sandbox needs and the C library does not wrap.

Everything here is a thin ``ctypes`` layer: numbers, structs, and
``syscall(2)`` with errno turned into ``OSError``. Only x86-64 has a syscall
table; elsewhere ``SYSCALLS`` is ``None`` and the callers report the feature
as unavailable (fail closed) instead of guessing numbers.
"""

from __future__ import annotations

import ctypes
import errno
import os
import platform
from typing import Final

_libc = ctypes.CDLL(None, use_errno=True)
_syscall = _libc.syscall
_syscall.restype = ctypes.c_long
_prctl = _libc["prctl"]
_prctl.restype = ctypes.c_int
_prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]

#: ``AUDIT_ARCH_X86_64``: what seccomp sees in ``seccomp_data.arch`` on this machine.
AUDIT_ARCH_X86_64: Final = 0xC000003E

#: x86-64 syscall numbers (arch/x86/entry/syscalls/syscall_64.tbl).
X86_64: Final[dict[str, int]] = {
    # the most frequent calls (the seccomp filter answers them first)
    "read": 0,
    "write": 1,
    "close": 3,
    "fstat": 5,
    "poll": 7,
    "lseek": 8,
    "mmap": 9,
    "munmap": 11,
    "brk": 12,
    "getpid": 39,
    "sendto": 44,
    "recvfrom": 45,
    "futex": 202,
    "clock_gettime": 228,
    "openat": 257,
    "newfstatat": 262,
    # files and metadata
    "chmod": 90,
    "fchmod": 91,
    "chown": 92,
    "fchown": 93,
    "lchown": 94,
    "utime": 132,
    "mknod": 133,
    "uselib": 134,
    "utimes": 235,
    "futimesat": 261,
    "fchownat": 260,
    "mknodat": 259,
    "fchmodat": 268,
    "utimensat": 280,
    "fchmodat2": 452,
    "setxattr": 188,
    "lsetxattr": 189,
    "fsetxattr": 190,
    "removexattr": 197,
    "lremovexattr": 198,
    "fremovexattr": 199,
    "setxattrat": 463,
    "removexattrat": 466,
    "file_setattr": 469,
    "ioctl": 16,
    "name_to_handle_at": 303,
    "open_by_handle_at": 304,
    "openat2": 437,
    "renameat2": 316,
    "close_range": 436,
    # processes
    "clone": 56,
    "fork": 57,
    "vfork": 58,
    "execve": 59,
    "kill": 62,
    "setpgid": 109,
    "setsid": 112,
    "ptrace": 101,
    "setpriority": 141,
    "sched_setparam": 142,
    "sched_setscheduler": 144,
    "sched_setaffinity": 203,
    "ioprio_set": 251,
    "migrate_pages": 256,
    "move_pages": 279,
    "prlimit64": 302,
    "process_vm_readv": 310,
    "process_vm_writev": 311,
    "kcmp": 312,
    "sched_setattr": 314,
    "execveat": 322,
    "clone3": 435,
    "pidfd_getfd": 438,
    "process_madvise": 440,
    "process_mrelease": 448,
    "capget": 125,
    "capset": 126,
    # sockets
    "socket": 41,
    "connect": 42,
    "socketpair": 53,
    # System V and POSIX message-queue IPC: no path, so no Landlock rule covers them
    "shmget": 29,
    "shmat": 30,
    "shmctl": 31,
    "semget": 64,
    "semop": 65,
    "semctl": 66,
    "shmdt": 67,
    "msgget": 68,
    "msgsnd": 69,
    "msgrcv": 70,
    "msgctl": 71,
    "semtimedop": 220,
    "mq_open": 240,
    "mq_unlink": 241,
    "mq_timedsend": 242,
    "mq_timedreceive": 243,
    "mq_notify": 244,
    "mq_getsetattr": 245,
    # the system itself
    "syslog": 103,
    "vhangup": 153,
    "pivot_root": 155,
    "adjtimex": 159,
    "chroot": 161,
    "acct": 163,
    "settimeofday": 164,
    "mount": 165,
    "umount2": 166,
    "swapon": 167,
    "swapoff": 168,
    "reboot": 169,
    "iopl": 172,
    "ioperm": 173,
    "init_module": 175,
    "delete_module": 176,
    "quotactl": 179,
    "lookup_dcookie": 212,
    "clock_settime": 227,
    "kexec_load": 246,
    "add_key": 248,
    "request_key": 249,
    "keyctl": 250,
    "unshare": 272,
    "perf_event_open": 298,
    "fanotify_init": 300,
    "clock_adjtime": 305,
    "setns": 308,
    "finit_module": 313,
    "kexec_file_load": 320,
    "bpf": 321,
    "userfaultfd": 323,
    "io_uring_setup": 425,
    "io_uring_enter": 426,
    "io_uring_register": 427,
    "open_tree": 428,
    "move_mount": 429,
    "fsopen": 430,
    "fsconfig": 431,
    "fsmount": 432,
    "fspick": 433,
    "mount_setattr": 442,
    "quotactl_fd": 443,
    "statmount": 457,
    "listmount": 458,
    "open_tree_attr": 467,
    # Landlock and seccomp
    "seccomp": 317,
    "landlock_create_ruleset": 444,
    "landlock_add_rule": 445,
    "landlock_restrict_self": 446,
}

SYSCALLS: Final[dict[str, int] | None] = X86_64 if platform.machine() == "x86_64" else None
AUDIT_ARCH: Final[int | None] = AUDIT_ARCH_X86_64 if SYSCALLS is not None else None

# prctl(2) options
PR_SET_PDEATHSIG: Final = 1
PR_SET_SECCOMP: Final = 22
PR_CAPBSET_READ: Final = 23
PR_CAPBSET_DROP: Final = 24
PR_GET_SECUREBITS: Final = 27
PR_SET_SECUREBITS: Final = 28
PR_SET_NO_NEW_PRIVS: Final = 38
PR_GET_NO_NEW_PRIVS: Final = 39
PR_CAP_AMBIENT: Final = 47
PR_CAP_AMBIENT_CLEAR_ALL: Final = 4
PR_GET_SECCOMP: Final = 21


def number(name: str) -> int:
    """The syscall number of ``name`` on this machine.

    Raises:
        OSError(ENOSYS): this architecture has no table here.
    """
    if SYSCALLS is None:
        raise OSError(errno.ENOSYS, f"no syscall table for {platform.machine()}")
    return SYSCALLS[name]


def syscall(name: str, *args: object) -> int:
    """``syscall(2)``; a negative return becomes ``OSError`` with the call's errno."""
    result: int = _syscall(ctypes.c_long(number(name)), *args)
    if result < 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{name}: {os.strerror(err)}")
    return result


def prctl(option: int, arg2: int = 0, arg3: int = 0, arg4: int = 0, arg5: int = 0) -> int:
    """``prctl(2)``; a negative return becomes ``OSError``."""
    result: int = _prctl(option, arg2, arg3, arg4, arg5)
    if result < 0:
        err = ctypes.get_errno()
        raise OSError(err, f"prctl({option}): {os.strerror(err)}")
    return result
