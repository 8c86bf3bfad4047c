"""A confined worker reaches nothing outside itself: paths beyond its workspace, /proc
and /sys, its own cgroups, the kernel's process (signals, ``CLONE_PARENT``), or another
system-call ABI (i386, x32).

Each test is one attempt made from inside a real confined worker, with the widest
policy that matters for it; each must be refused.
"""

from __future__ import annotations

import os
import platform
import signal

import pytest
from kit import Arena

from sandbox import Policy

pytestmark = [
    pytest.mark.usefixtures("confined"),
    pytest.mark.skipif(platform.machine() != "x86_64", reason="raw x86-64 syscall numbers"),
]


_WIDE = Policy(subprocess=True)


_LEAVE_CGROUP = """
errors = []
for path in ('/sys/fs/cgroup/freezer/cgroup.procs', '/sys/fs/cgroup/memory/cgroup.procs',
             '/sys/fs/cgroup/pids/cgroup.procs', '/sys/fs/cgroup/unified/cgroup.procs',
             '/sys/fs/cgroup/cgroup.procs'):
    try:
        with open(path, 'w') as f:
            f.write('0')
    except OSError as exc:
        errors.append(exc.errno)
        continue
    result = 'moved via ' + path
    break
else:
    if errors and all(e in (errno.EACCES, errno.EPERM, errno.ENOENT) for e in errors):
        raise OSError(errors[0], 'refused')
"""


async def test_a_worker_cannot_move_itself_out_of_its_cgroups(arena: Arena) -> None:
    result = await arena.attack(_LEAVE_CGROUP, policy=_WIDE)
    arena.assert_refused(result)


# -- the kernel's process -------------------------------------------------------------------
#
# CLONE_PARENT once made the kernel the parent of zombies nobody reaps: the clone check
# refuses CLONE_PARENT with any other flags (test_seccomp_tables.py checks every policy
# on both architectures).


_CLONE_PARENT = """
pid = syscall(56, 0x8000 | 17, 0, 0, 0, 0)  # clone(CLONE_PARENT | SIGCHLD): fork-like
if pid == 0:
    os._exit(0)
time.sleep(0.2)
result = pid
"""


async def test_clone_parent_is_refused(arena: Arena) -> None:
    result = await arena.attack(_CLONE_PARENT, policy=_WIDE)
    try:
        arena.assert_refused(result)
    finally:
        if result.startswith("ALLOWED: "):
            _reap(result.split()[1])  # the zombie is this test process's child


def _reap(pid: str) -> None:
    try:
        os.waitpid(int(pid), os.WNOHANG)
    except (ChildProcessError, ValueError):
        pass


SIGNALS = {
    "tgkill": "syscall(234, os.getppid(), os.getppid(), signal.SIGWINCH)",
    "rt_sigqueueinfo": (
        "syscall(129, os.getppid(), signal.SIGWINCH, ctypes.create_string_buffer(128))"
    ),
    "kill": "os.kill(os.getppid(), signal.SIGWINCH)",
    "sigio_owner_pid": (
        "import fcntl\na, b = socket.socketpair()\n"
        "fcntl.fcntl(a.fileno(), fcntl.F_SETOWN, os.getppid())\n"
        "fcntl.fcntl(a.fileno(), 10, signal.SIGWINCH)\n"  # F_SETSIG
        "fcntl.fcntl(a.fileno(), fcntl.F_SETFL, fcntl.fcntl(a.fileno(), fcntl.F_GETFL) "
        "| os.O_ASYNC)\nb.send(b'x')\ntime.sleep(0.3)\nraise Refused('no effect seen here')"
    ),
    "sigio_owner_group": (
        "import fcntl\na, b = socket.socketpair()\n"
        "fcntl.fcntl(a.fileno(), fcntl.F_SETOWN, -os.getpgid(os.getppid()))\n"
        "fcntl.fcntl(a.fileno(), 10, signal.SIGWINCH)\n"
        "fcntl.fcntl(a.fileno(), fcntl.F_SETFL, fcntl.fcntl(a.fileno(), fcntl.F_GETFL) "
        "| os.O_ASYNC)\nb.send(b'x')\ntime.sleep(0.3)\nraise Refused('no effect seen here')"
    ),
    "prlimit_of_the_kernel": "syscall(302, os.getppid(), 7, 0, ctypes.create_string_buffer(16))",
}


@pytest.mark.parametrize("name", list(SIGNALS))
async def test_no_signal_reaches_the_kernel(arena: Arena, name: str) -> None:
    received: list[int] = []
    old = signal.signal(signal.SIGWINCH, lambda signum, frame: received.append(signum))
    try:
        code = "import signal\n" + SIGNALS[name]
        result = await arena.attack(code, policy=_WIDE)
    finally:
        signal.signal(signal.SIGWINCH, old)
    assert received == [], f"the kernel received {received}"
    arena.assert_refused(result)


# -- outside the workspace -------------------------------------------------------------------


OUTSIDE = {
    "rename_the_workspace": "os.rename(os.getcwd(), os.getcwd() + '-x')",
    "list_the_parent": "result = os.listdir('..')",
    "openat_from_an_o_path_parent": (
        "d = os.open('..', os.O_PATH)\nresult = os.read(os.open('outside/canary.txt', "
        "os.O_RDONLY, dir_fd=d), 100)"
    ),
    "through_proc_self_cwd": "result = open('/proc/self/cwd/../outside/canary.txt').read()",
    "hard_link_a_setuid_binary_in": "os.link('/usr/bin/su', 'su')",
    "proc_sys": "result = open('/proc/sys/kernel/hostname').read()",
    "sysfs_class_net": "result = os.listdir('/sys/class/net')",
    "dev_shm": "open('/dev/shm/x', 'w')",
    "cgroup_tasks_move_init": "open('/sys/fs/cgroup/pids/tasks', 'w').write('1')",
    "cgroup_procs_leave": "open('/sys/fs/cgroup/memory/cgroup.procs', 'w').write(str(os.getpid()))",
    "own_cgroup_file": "result = open('/proc/self/cgroup').read()",
    "kernel_cwd_link": "result = os.readlink(f'/proc/{os.getppid()}/cwd')",
}


@pytest.mark.parametrize("name", list(OUTSIDE))
async def test_nothing_outside_the_workspace(arena: Arena, name: str) -> None:
    result = await arena.attack(OUTSIDE[name], policy=_WIDE)
    arena.assert_refused(result)


# -- other ABIs ------------------------------------------------------------------------------


_INT80 = """
import mmap
code = bytes([0xB8, 0x14, 0, 0, 0, 0xCD, 0x80, 0xC3])  # mov eax, 20 (i386 getpid); int 0x80; ret
m = mmap.mmap(-1, 4096, prot=mmap.PROT_READ | mmap.PROT_WRITE | mmap.PROT_EXEC)
m.write(code)
result = ctypes.CFUNCTYPE(ctypes.c_int)(ctypes.addressof(ctypes.c_char.from_buffer(m)))()
"""


async def test_a_32_bit_system_call_kills_the_worker(arena: Arena) -> None:
    result = await arena.attack(_INT80, policy=_WIDE)
    assert result.startswith("failed: ") and "SIGSYS" in result, result
    arena.assert_nothing_seen([result])


@pytest.mark.parametrize(
    "code",
    [
        "result = syscall(0x40000000 | 39)",  # x32 getpid
        "result = syscall(0x40000000 | 2, b'x', 0o101, 0o4755)",  # x32 open, setuid mode
        "result = syscall(0x40000000 | 41, 2, 2, 0)",  # x32 socket(AF_INET, SOCK_DGRAM)
    ],
    ids=["getpid", "open_setuid", "udp_socket"],
)
async def test_the_x32_abi_is_refused(arena: Arena, code: str) -> None:
    result = await arena.attack(code, policy=arena.network_policy(subprocess=True))
    assert result == "denied: EPERM", result
    arena.assert_refused(result)
    assert not (arena.workspace / "x").exists()
