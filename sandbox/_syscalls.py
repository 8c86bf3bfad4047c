"""Raw Linux system calls the sandbox needs and the C library does not wrap.

Everything here is a thin ``ctypes`` layer: numbers, structs, and
``syscall(2)`` with errno turned into ``OSError``. x86-64 and aarch64 have a
syscall table; elsewhere ``NATIVE`` is ``None`` and the callers report the
feature as unavailable (fail closed) instead of guessing numbers.
"""

from __future__ import annotations

import ctypes
import errno
import os
import platform
from collections.abc import Mapping
from typing import Final

import attrs

_libc = ctypes.CDLL(None, use_errno=True)
_syscall = _libc.syscall
_syscall.restype = ctypes.c_long
_prctl = _libc["prctl"]
_prctl.restype = ctypes.c_int
_prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]


@attrs.frozen
class SyscallTable:
    """One architecture's system call numbers, as seccomp sees them.

    ``numbers`` maps every name the sandbox uses to its number, or to ``None``
    where the architecture has no such call (aarch64 has no ``open``, ``fork``,
    ``chmod``...: libc uses the ``*at`` forms). A name missing from the map is a
    programming error (``KeyError``), never silently skipped.
    """

    machine: str
    audit_arch: int
    numbers: Mapping[str, int | None]

    def get(self, name: str) -> int | None:
        """The number of ``name``, or ``None`` where this architecture lacks the call."""
        return self.numbers[name]


#: Calls added since Linux 5.1 (number 424 and up): the same number on every architecture
#: (asm-generic/unistd.h and every syscall.tbl take them from one list).
_SINCE_5_1: Final[Mapping[str, int | None]] = {
    "io_uring_setup": 425,
    "io_uring_enter": 426,
    "io_uring_register": 427,
    "open_tree": 428,
    "move_mount": 429,
    "fsopen": 430,
    "fsconfig": 431,
    "fsmount": 432,
    "fspick": 433,
    "pidfd_open": 434,
    "clone3": 435,
    "close_range": 436,
    "openat2": 437,
    "pidfd_getfd": 438,
    "process_madvise": 440,
    "mount_setattr": 442,
    "quotactl_fd": 443,
    "landlock_create_ruleset": 444,
    "landlock_add_rule": 445,
    "landlock_restrict_self": 446,
    "process_mrelease": 448,
    "fchmodat2": 452,
    "statmount": 457,
    "listmount": 458,
    "setxattrat": 463,
    "removexattrat": 466,
    "open_tree_attr": 467,
    "file_setattr": 469,
}


#: x86-64 (``AUDIT_ARCH_X86_64``), from arch/x86/entry/syscalls/syscall_64.tbl.
X86_64: Final = SyscallTable(
    machine="x86_64",
    audit_arch=0xC000003E,
    numbers={
        # the most frequent calls
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
        # creating files: the mode is an argument
        "open": 2,
        "creat": 85,
        "mkdir": 83,
        "mkdirat": 258,
        "mknod": 133,
        "mknodat": 259,
        # file metadata, handles, watches
        "chmod": 90,
        "fchmod": 91,
        "fchmodat": 268,
        "chown": 92,
        "fchown": 93,
        "lchown": 94,
        "fchownat": 260,
        "utime": 132,
        "utimes": 235,
        "futimesat": 261,
        "utimensat": 280,
        "setxattr": 188,
        "lsetxattr": 189,
        "fsetxattr": 190,
        "removexattr": 197,
        "lremovexattr": 198,
        "fremovexattr": 199,
        "ioctl": 16,
        "name_to_handle_at": 303,
        "open_by_handle_at": 304,
        "renameat2": 316,
        "fallocate": 285,
        "uselib": 134,
        "inotify_init": 253,
        "inotify_init1": 294,
        "inotify_add_watch": 254,
        "fanotify_init": 300,
        "fanotify_mark": 301,
        # processes
        "clone": 56,
        "fork": 57,
        "vfork": 58,
        "execve": 59,
        "execveat": 322,
        "memfd_create": 319,
        "kill": 62,
        "setpgid": 109,
        "setsid": 112,
        "ptrace": 101,
        "setpriority": 141,
        "sched_setparam": 142,
        "sched_setscheduler": 144,
        "sched_setaffinity": 203,
        "sched_setattr": 314,
        "ioprio_set": 251,
        "migrate_pages": 256,
        "move_pages": 279,
        "prlimit64": 302,
        "process_vm_readv": 310,
        "process_vm_writev": 311,
        "kcmp": 312,
        "capget": 125,
        "capset": 126,
        # sockets
        "socket": 41,
        "socketpair": 53,
        "connect": 42,
        "bind": 49,
        "listen": 50,
        "accept": 43,
        "accept4": 288,
        "sendmsg": 46,
        "sendmmsg": 307,
        "setsockopt": 54,
        # System V and POSIX message-queue IPC: no path, so no Landlock rule covers them
        "shmget": 29,
        "shmat": 30,
        "shmctl": 31,
        "shmdt": 67,
        "semget": 64,
        "semop": 65,
        "semctl": 66,
        "semtimedop": 220,
        "msgget": 68,
        "msgsnd": 69,
        "msgrcv": 70,
        "msgctl": 71,
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
        "clock_adjtime": 305,
        "setns": 308,
        "finit_module": 313,
        "kexec_file_load": 320,
        "bpf": 321,
        "userfaultfd": 323,
        # Landlock and seccomp
        "seccomp": 317,
        **_SINCE_5_1,
    },
)

#: aarch64 (``AUDIT_ARCH_AARCH64``), from include/uapi/asm-generic/unistd.h (scripts/
#: syscall.tbl since Linux 6.11, ABIs common, 64, renameat, newstat, rlimit,
#: memfd_secret). Every call added since 5.1 (number 424 and up) has the same number
#: on every architecture.
AARCH64: Final = SyscallTable(
    machine="aarch64",
    audit_arch=0xC00000B7,
    numbers={
        # the most frequent calls
        "read": 63,
        "write": 64,
        "close": 57,
        "fstat": 80,
        "poll": None,
        "lseek": 62,
        "mmap": 222,
        "munmap": 215,
        "brk": 214,
        "getpid": 172,
        "sendto": 206,
        "recvfrom": 207,
        "futex": 98,
        "clock_gettime": 113,
        "openat": 56,
        "newfstatat": 79,
        # creating files: the mode is an argument
        "open": None,
        "creat": None,
        "mkdir": None,
        "mkdirat": 34,
        "mknod": None,
        "mknodat": 33,
        # file metadata, handles, watches
        "chmod": None,
        "fchmod": 52,
        "fchmodat": 53,
        "chown": None,
        "fchown": 55,
        "lchown": None,
        "fchownat": 54,
        "utime": None,
        "utimes": None,
        "futimesat": None,
        "utimensat": 88,
        "setxattr": 5,
        "lsetxattr": 6,
        "fsetxattr": 7,
        "removexattr": 14,
        "lremovexattr": 15,
        "fremovexattr": 16,
        "ioctl": 29,
        "name_to_handle_at": 264,
        "open_by_handle_at": 265,
        "renameat2": 276,
        "fallocate": 47,
        "uselib": None,
        "inotify_init": None,
        "inotify_init1": 26,
        "inotify_add_watch": 27,
        "fanotify_init": 262,
        "fanotify_mark": 263,
        # processes
        "clone": 220,
        "fork": None,
        "vfork": None,
        "execve": 221,
        "execveat": 281,
        "memfd_create": 279,
        "kill": 129,
        "setpgid": 154,
        "setsid": 157,
        "ptrace": 117,
        "setpriority": 140,
        "sched_setparam": 118,
        "sched_setscheduler": 119,
        "sched_setaffinity": 122,
        "sched_setattr": 274,
        "ioprio_set": 30,
        "migrate_pages": 238,
        "move_pages": 239,
        "prlimit64": 261,
        "process_vm_readv": 270,
        "process_vm_writev": 271,
        "kcmp": 272,
        "capget": 90,
        "capset": 91,
        # sockets
        "socket": 198,
        "socketpair": 199,
        "connect": 203,
        "bind": 200,
        "listen": 201,
        "accept": 202,
        "accept4": 242,
        "sendmsg": 211,
        "sendmmsg": 269,
        "setsockopt": 208,
        # System V and POSIX message-queue IPC: no path, so no Landlock rule covers them
        "shmget": 194,
        "shmat": 196,
        "shmctl": 195,
        "shmdt": 197,
        "semget": 190,
        "semop": 193,
        "semctl": 191,
        "semtimedop": 192,
        "msgget": 186,
        "msgsnd": 189,
        "msgrcv": 188,
        "msgctl": 187,
        "mq_open": 180,
        "mq_unlink": 181,
        "mq_timedsend": 182,
        "mq_timedreceive": 183,
        "mq_notify": 184,
        "mq_getsetattr": 185,
        # the system itself
        "syslog": 116,
        "vhangup": 58,
        "pivot_root": 41,
        "adjtimex": 171,
        "chroot": 51,
        "acct": 89,
        "settimeofday": 170,
        "mount": 40,
        "umount2": 39,
        "swapon": 224,
        "swapoff": 225,
        "reboot": 142,
        "iopl": None,
        "ioperm": None,
        "init_module": 105,
        "delete_module": 106,
        "quotactl": 60,
        "lookup_dcookie": 18,
        "clock_settime": 112,
        "kexec_load": 104,
        "add_key": 217,
        "request_key": 218,
        "keyctl": 219,
        "unshare": 97,
        "perf_event_open": 241,
        "clock_adjtime": 266,
        "setns": 268,
        "finit_module": 273,
        "kexec_file_load": 294,
        "bpf": 280,
        "userfaultfd": 282,
        # Landlock and seccomp
        "seccomp": 277,
        **_SINCE_5_1,
    },
)

#: The tables by ``platform.machine()``.
TABLES: Final[Mapping[str, SyscallTable]] = {t.machine: t for t in (X86_64, AARCH64)}

#: This machine's table; ``None`` where the sandbox knows no numbers (fail closed).
NATIVE: Final[SyscallTable | None] = TABLES.get(platform.machine())

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
        OSError(ENOSYS): this architecture has no table here, or lacks the call.
    """
    if NATIVE is None:
        raise OSError(errno.ENOSYS, f"no syscall table for {platform.machine()}")
    nr = NATIVE.get(name)
    if nr is None:
        raise OSError(errno.ENOSYS, f"{platform.machine()} has no {name} system call")
    return nr


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
