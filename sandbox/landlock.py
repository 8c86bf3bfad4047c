"""Landlock: the kernel's unprivileged access control, applied by a process to itself.

``restrict_self`` builds one ruleset that *handles* every filesystem right the
running ABI knows (so anything not granted is denied), TCP bind/connect when
the ABI has network rights (4+), and the abstract-Unix-socket and signal
scopes when it has scopes (6+). It then checks that the ruleset is in force
and raises rather than report a confinement that is not there.
"""

from __future__ import annotations

import ctypes
import errno
import os
import stat
from collections.abc import Iterable, Sequence
from typing import Final

import attrs

from kernel.errors import SandboxError

from . import _syscalls

__all__ = [
    "EXECUTE",
    "FILE_RIGHTS",
    "IOCTL_DEV",
    "MAKE_BLOCK",
    "MAKE_CHAR",
    "MAKE_DIR",
    "MAKE_FIFO",
    "MAKE_REG",
    "MAKE_SOCK",
    "MAKE_SYM",
    "NET_BIND_TCP",
    "NET_CONNECT_TCP",
    "READ",
    "READ_DIR",
    "READ_FILE",
    "READ_WRITE",
    "REFER",
    "REMOVE_DIR",
    "REMOVE_FILE",
    "SCOPE_ABSTRACT_UNIX_SOCKET",
    "SCOPE_SIGNAL",
    "TRUNCATE",
    "WRITE_FILE",
    "LandlockResult",
    "PathRule",
    "abi_version",
    "handled_fs_rights",
    "restrict_self",
]

# Filesystem rights, with the ABI that introduced each.
EXECUTE: Final = 1 << 0
WRITE_FILE: Final = 1 << 1
READ_FILE: Final = 1 << 2
READ_DIR: Final = 1 << 3
REMOVE_DIR: Final = 1 << 4
REMOVE_FILE: Final = 1 << 5
MAKE_CHAR: Final = 1 << 6
MAKE_DIR: Final = 1 << 7
MAKE_REG: Final = 1 << 8
MAKE_SOCK: Final = 1 << 9
MAKE_FIFO: Final = 1 << 10
MAKE_BLOCK: Final = 1 << 11
MAKE_SYM: Final = 1 << 12
REFER: Final = 1 << 13  # ABI 2
TRUNCATE: Final = 1 << 14  # ABI 3
IOCTL_DEV: Final = 1 << 15  # ABI 5

# Network rights (ABI 4) and scopes (ABI 6).
NET_BIND_TCP: Final = 1 << 0
NET_CONNECT_TCP: Final = 1 << 1
SCOPE_ABSTRACT_UNIX_SOCKET: Final = 1 << 0
SCOPE_SIGNAL: Final = 1 << 1

#: The rights that make sense on a file (not a directory) in a path-beneath rule.
FILE_RIGHTS: Final = EXECUTE | WRITE_FILE | READ_FILE | TRUNCATE | IOCTL_DEV
READ: Final = READ_FILE | READ_DIR
#: Everything a read-write workspace needs; device creation is never granted.
READ_WRITE: Final = (
    READ
    | WRITE_FILE
    | REMOVE_DIR
    | REMOVE_FILE
    | MAKE_DIR
    | MAKE_REG
    | MAKE_SOCK
    | MAKE_FIFO
    | MAKE_SYM
    | REFER
    | TRUNCATE
)

_CREATE_RULESET_VERSION: Final = 1 << 0
_RULE_PATH_BENEATH: Final = 1
_RULE_NET_PORT: Final = 2


class _RulesetAttr(ctypes.Structure):
    _fields_ = [
        ("handled_access_fs", ctypes.c_uint64),
        ("handled_access_net", ctypes.c_uint64),
        ("scoped", ctypes.c_uint64),
    ]


class _PathBeneathAttr(ctypes.Structure):
    _pack_ = 1
    _fields_ = [("allowed_access", ctypes.c_uint64), ("parent_fd", ctypes.c_int32)]


class _NetPortAttr(ctypes.Structure):
    _pack_ = 1
    _fields_ = [("allowed_access", ctypes.c_uint64), ("port", ctypes.c_uint64)]


def abi_version() -> int:
    """The Landlock ABI this kernel offers; 0 when Landlock is missing or disabled."""
    try:
        return _syscalls.syscall(
            "landlock_create_ruleset", None, ctypes.c_size_t(0), ctypes.c_uint32(1)
        )
    except OSError:
        return 0


def handled_fs_rights(abi: int) -> int:
    """Every filesystem right ABI ``abi`` knows: all of them are handled (denied unless granted)."""
    if abi < 1:
        return 0
    rights = (1 << 13) - 1
    if abi >= 2:
        rights |= REFER
    if abi >= 3:
        rights |= TRUNCATE
    if abi >= 5:
        rights |= IOCTL_DEV
    return rights


@attrs.frozen
class PathRule:
    """Grant ``access`` beneath ``path`` (a directory) or on it (a file)."""

    path: str
    access: int


@attrs.frozen
class LandlockResult:
    """What ``restrict_self`` put in force."""

    abi: int
    handled_fs: int
    network: bool
    scoped: bool
    skipped: tuple[str, ...]  # paths that did not exist


def restrict_self(
    rules: Sequence[PathRule],
    *,
    tcp_connect: Iterable[int] = (),
    tcp_bind: Iterable[int] = (),
    check_denied: str = "/",
) -> LandlockResult:
    """Confine the calling thread (and its future children) to ``rules``.

    Call it while the process has a single thread: Landlock applies to the
    calling thread only. ``no_new_privs`` must already be set. Network rules
    and scopes apply when the ABI has them; TCP not granted here is denied.
    ``check_denied`` is a directory no rule covers; reading it must fail
    afterwards, or the confinement is reported as not in force.

    Raises:
        SandboxError: Landlock is missing, a rule could not be added, or the
            ruleset is not enforced.
    """
    abi = abi_version()
    if abi < 1:
        raise SandboxError("Landlock is not available in this kernel (or is disabled)")
    handled = handled_fs_rights(abi)
    net = NET_BIND_TCP | NET_CONNECT_TCP if abi >= 4 else 0
    scoped = SCOPE_ABSTRACT_UNIX_SOCKET | SCOPE_SIGNAL if abi >= 6 else 0
    attr = _RulesetAttr(handled, net, scoped)
    size = 8 if abi < 4 else 16 if abi < 6 else 24
    try:
        ruleset = _syscalls.syscall(
            "landlock_create_ruleset", ctypes.byref(attr), ctypes.c_size_t(size), ctypes.c_uint32(0)
        )
    except OSError as exc:
        raise SandboxError(f"Landlock: cannot create a ruleset: {exc.strerror}") from exc
    skipped: list[str] = []
    try:
        for rule in rules:
            if not _add_path_rule(ruleset, rule, handled):
                skipped.append(rule.path)
        if net:
            for port, access in [(p, NET_CONNECT_TCP) for p in tcp_connect] + [
                (p, NET_BIND_TCP) for p in tcp_bind
            ]:
                net_attr = _NetPortAttr(access, port)
                _add_rule(ruleset, _RULE_NET_PORT, net_attr, f"TCP port {port}")
        try:
            _syscalls.syscall("landlock_restrict_self", ctypes.c_int(ruleset), ctypes.c_uint32(0))
        except OSError as exc:
            raise SandboxError(f"Landlock: restrict_self failed: {exc.strerror}") from exc
    finally:
        os.close(ruleset)
    _check_enforced(check_denied)
    return LandlockResult(abi, handled, bool(net), bool(scoped), tuple(skipped))


def _add_path_rule(ruleset: int, rule: PathRule, handled: int) -> bool:
    try:
        fd = os.open(rule.path, os.O_PATH | os.O_CLOEXEC)
    except FileNotFoundError:
        return False
    except OSError as exc:
        raise SandboxError(f"Landlock: cannot open {rule.path} for a rule: {exc.strerror}") from exc
    try:
        access = rule.access & handled
        if not stat.S_ISDIR(os.fstat(fd).st_mode):
            access &= FILE_RIGHTS
        if access:
            _add_rule(ruleset, _RULE_PATH_BENEATH, _PathBeneathAttr(access, fd), rule.path)
    finally:
        os.close(fd)
    return True


def _add_rule(ruleset: int, rule_type: int, attr: ctypes.Structure, what: str) -> None:
    try:
        _syscalls.syscall(
            "landlock_add_rule",
            ctypes.c_int(ruleset),
            ctypes.c_int(rule_type),
            ctypes.byref(attr),
            ctypes.c_uint32(0),
        )
    except OSError as exc:
        raise SandboxError(f"Landlock: cannot add the rule for {what}: {exc.strerror}") from exc


def _check_enforced(denied_dir: str) -> None:
    try:
        fd = os.open(denied_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as exc:
        if exc.errno == errno.EACCES:
            return
        raise SandboxError(
            f"Landlock: cannot verify the ruleset ({denied_dir}: {exc.strerror})"
        ) from exc
    os.close(fd)
    raise SandboxError(f"Landlock: the ruleset is not enforced ({denied_dir} is still readable)")
