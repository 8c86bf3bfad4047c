"""The filter off this machine: the aarch64 table, and what any architecture's filter answers.

These are checks of the filter builder, not attempts (``test_kit_*``, left out of
the tally): the attempts themselves run in the other ``test_seccomp_*`` files.
"""

from __future__ import annotations

import errno
import itertools

import pytest
import seccomp_emulator as emulator

from sandbox import _syscalls, seccomp

TABLES = (_syscalls.X86_64, _syscalls.AARCH64)
POLICIES = [
    seccomp.SeccompPolicy(network=n, subprocess=s, direct_connect=d)
    for n, s, d in itertools.product((False, True), repeat=3)
]


def _verdict(
    table: _syscalls.SyscallTable,
    policy: seccomp.SeccompPolicy,
    name: str,
    *args: int,
) -> emulator.Verdict:
    nr = table.get(name)
    assert nr is not None, f"{table.machine} has no {name}"
    program = seccomp.build_filter(policy, table)
    return emulator.run(program, arch=table.audit_arch, nr=nr, args=args)


def test_kit_aarch64_numbers_from_the_generic_table() -> None:
    arm = _syscalls.AARCH64
    assert arm.audit_arch == 0xC00000B7
    known = {
        "read": 63,
        "write": 64,
        "openat": 56,
        "mkdirat": 34,
        "ioctl": 29,
        "inotify_init1": 26,
        "socket": 198,
        "connect": 203,
        "sendto": 206,
        "sendmsg": 211,
        "clone": 220,
        "execve": 221,
        "execveat": 281,
        "seccomp": 277,
        "openat2": 437,
        "pidfd_open": 434,
    }
    assert {name: arm.get(name) for name in known} == known
    for legacy in ("open", "creat", "mkdir", "fork", "vfork", "poll", "inotify_init", "chmod"):
        assert arm.get(legacy) is None, legacy
    # Calls added since Linux 5.1 have one number everywhere.
    for name, nr in _syscalls.X86_64.numbers.items():
        if nr is not None and nr >= 424:
            assert arm.get(name) == nr, name


def test_kit_both_tables_name_the_same_calls() -> None:
    assert set(_syscalls.X86_64.numbers) == set(_syscalls.AARCH64.numbers)
    assert all(nr is not None for nr in _syscalls.X86_64.numbers.values())


@pytest.mark.parametrize("table", TABLES, ids=lambda t: t.machine)
def test_kit_every_policy_assembles(table: _syscalls.SyscallTable) -> None:
    programs = {seccomp.build_filter(policy, table) for policy in POLICIES}
    assert len(programs) == 6  # direct_connect only matters with network
    for program in programs:
        assert len(program) // 8 < 4096  # BPF_MAXINSNS


@pytest.mark.parametrize("table", TABLES, ids=lambda t: t.machine)
def test_kit_another_architecture_is_killed(table: _syscalls.SyscallTable) -> None:
    program = seccomp.build_filter(seccomp.SeccompPolicy(), table)
    other = next(t for t in TABLES if t is not table)
    assert emulator.run(program, arch=other.audit_arch, nr=0).killed
    assert emulator.run(program, arch=0x40000003, nr=0).killed  # i386


@pytest.mark.parametrize("table", TABLES, ids=lambda t: t.machine)
def test_kit_file_modes_on_each_architecture(table: _syscalls.SyscallTable) -> None:
    policy = seccomp.SeccompPolicy()
    creat = 0o100 | 0o1  # O_CREAT | O_WRONLY
    assert _verdict(table, policy, "openat", -100, 0, creat, 0o4755).errno == errno.EPERM
    assert _verdict(table, policy, "openat", -100, 0, 0o20200002, 0o2755).errno == errno.EPERM
    assert _verdict(table, policy, "openat", -100, 0, creat, 0o644).allowed
    assert _verdict(table, policy, "openat", -100, 0, 0, 0o4755).allowed  # no O_CREAT
    assert _verdict(table, policy, "mkdirat", -100, 0, 0o1777).errno == errno.EPERM
    assert _verdict(table, policy, "mkdirat", -100, 0, 0o755).allowed
    assert _verdict(table, policy, "openat2", -100, 0, 0, 24).errno == errno.ENOSYS


@pytest.mark.parametrize("table", TABLES, ids=lambda t: t.machine)
def test_kit_sockets_on_each_architecture(table: _syscalls.SyscallTable) -> None:
    net = seccomp.SeccompPolicy(network=True)
    brokered = seccomp.SeccompPolicy(network=True, direct_connect=False)
    none = seccomp.SeccompPolicy()
    assert _verdict(table, net, "socket", 2, 1 | 0x80800, 0).allowed
    assert _verdict(table, net, "socket", 10, 1, 6).allowed
    assert _verdict(table, net, "socket", 2, 2, 0).errno == errno.EPERM  # UDP
    assert _verdict(table, net, "socket", 2, 1, 262).errno == errno.EPERM  # MPTCP
    assert _verdict(table, net, "socket", 1, 1, 0).errno == errno.EPERM  # AF_UNIX
    assert _verdict(table, net, "connect", 3, 0, 16).allowed
    assert _verdict(table, brokered, "connect", 3, 0, 16).errno == errno.EPERM
    assert _verdict(table, none, "connect", 3, 0, 16).errno == errno.EPERM
    assert _verdict(table, net, "sendto", 3, 0, 1, 0x20000000).errno == errno.EPERM
    assert _verdict(table, net, "sendmsg", 3, 0, 0x20000000).errno == errno.EPERM
    assert _verdict(table, net, "setsockopt", 3, 6, 30).errno == errno.EPERM
    assert _verdict(table, net, "setsockopt", 3, 6, 1).allowed  # TCP_NODELAY
    for policy in (net, none):
        for name in ("bind", "listen", "accept", "accept4"):
            assert _verdict(table, policy, name, 3).errno == errno.EPERM, name


@pytest.mark.parametrize("table", TABLES, ids=lambda t: t.machine)
def test_kit_side_channels_on_each_architecture(table: _syscalls.SyscallTable) -> None:
    everything = seccomp.SeccompPolicy(network=True, subprocess=True)
    assert _verdict(table, everything, "inotify_init1", 0).errno == errno.ENOSYS
    assert _verdict(table, everything, "inotify_add_watch", 3, 0, 0xFFF).errno == errno.ENOSYS
    assert _verdict(table, everything, "fanotify_init", 0, 0).errno == errno.EPERM
    assert _verdict(table, everything, "execveat", 3, 0, 0, 0, 0x1000).errno == errno.EPERM
    assert _verdict(table, everything, "execve", 0, 0, 0).allowed
    assert _verdict(table, everything, "pidfd_open", 1, 0).errno == errno.ENOSYS


@pytest.mark.parametrize("policy", POLICIES, ids=repr)
@pytest.mark.parametrize("table", TABLES, ids=lambda t: t.machine)
def test_kit_hot_calls_never_read_their_arguments(
    table: _syscalls.SyscallTable, policy: seccomp.SeccompPolicy
) -> None:
    # The kernel caches a call the filter allows without looking at its arguments,
    # and then never runs the filter for it: the per-call cost is nil.
    program = seccomp.build_filter(policy, table)
    for name in ("read", "write", "futex", "close", "mmap", "recvfrom", "getpid"):
        nr = table.get(name)
        assert nr is not None
        verdict = emulator.run(program, arch=table.audit_arch, nr=nr, args=(3, 0, 0, 0))
        assert verdict.allowed and not verdict.read_arguments, name


_CLONE_PARENT = 0x8000
_SIGCHLD = 17
_PTHREAD_FLAGS = 0x3D0F00  # VM|FS|FILES|SIGHAND|THREAD|SYSVSEM|SETTLS|PARENT_SETTID|CHILD_CLEARTID
_FORK_FLAGS = 0x01200000 | _SIGCHLD  # CHILD_SETTID | CHILD_CLEARTID: glibc's fork
_VFORK_FLAGS = 0x4000 | 0x100 | _SIGCHLD  # CLONE_VFORK | CLONE_VM: posix_spawn


@pytest.mark.parametrize("policy", POLICIES, ids=repr)
@pytest.mark.parametrize("table", TABLES, ids=lambda t: t.machine)
def test_kit_clone_parent_is_refused_whatever_the_other_flags(
    table: _syscalls.SyscallTable, policy: seccomp.SeccompPolicy
) -> None:
    # CLONE_PARENT makes the child the kernel's, which never reaps it.
    for flags in (_SIGCHLD, _FORK_FLAGS, _VFORK_FLAGS, _PTHREAD_FLAGS, 0):
        verdict = _verdict(table, policy, "clone", flags | _CLONE_PARENT, 0, 0, 0, 0)
        assert verdict.errno == errno.EPERM, hex(flags)
    assert _verdict(table, policy, "clone", _PTHREAD_FLAGS, 0, 0, 0, 0).allowed
    fork = _verdict(table, policy, "clone", _FORK_FLAGS, 0, 0, 0, 0)
    assert fork.allowed == policy.subprocess
    vfork = _verdict(table, policy, "clone", _VFORK_FLAGS, 0, 0, 0, 0)
    assert vfork.allowed == policy.subprocess


@pytest.mark.parametrize("policy", POLICIES, ids=repr)
@pytest.mark.parametrize("table", TABLES, ids=lambda t: t.machine)
def test_kit_socket_ioctls_are_refused_everywhere(
    table: _syscalls.SyscallTable, policy: seccomp.SeccompPolicy
) -> None:
    # 0x8900-0x89ff: SIOCGIFCONF, SIOCGIFADDR, SIOCGIFHWADDR, SIOCGIFINDEX... on any socket.
    for cmd in (0x8900, 0x8910, 0x8912, 0x8915, 0x8927, 0x8933, 0x89FF, 0x1_0000_8912):
        assert _verdict(table, policy, "ioctl", 3, cmd, 0).errno == errno.EPERM, hex(cmd)
    # Their neighbours, and what runtimes use: FIONREAD, TCGETS, FIONBIO, FIOCLEX.
    for cmd in (0x88FF, 0x8A00, 0x541B, 0x5401, 0x5421, 0x5451, 0x18900):
        assert _verdict(table, policy, "ioctl", 3, cmd, 0).allowed, hex(cmd)


@pytest.mark.parametrize("table", TABLES, ids=lambda t: t.machine)
def test_kit_so_linger_is_refused_with_network(table: _syscalls.SyscallTable) -> None:
    # A lingering close blocks whoever drops the last reference to the socket.
    for policy in POLICIES:
        if not policy.network:
            continue
        assert _verdict(table, policy, "setsockopt", 3, 1, 13).errno == errno.EPERM
        assert _verdict(table, policy, "setsockopt", 3, 1, 9).allowed  # SO_KEEPALIVE
        assert _verdict(table, policy, "setsockopt", 3, 1, 20).allowed  # SO_RCVTIMEO
        assert _verdict(table, policy, "setsockopt", 3, 6, 13).allowed  # TCP 13, not linger
        assert _verdict(table, policy, "setsockopt", 3, 6, 19).errno == errno.EPERM
