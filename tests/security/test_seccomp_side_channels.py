"""Class 5: watching outside the workspace, pidfds of other processes, code on no disk.

Decided here (docs/sandbox.md, "The seccomp filter"): inotify answers ENOSYS
(Landlock does not check watches; watchers fall back to polling, which it does
check), fanotify and ``execveat`` are refused, ``pidfd_open`` answers ENOSYS
(a pidfd of any process tells its uid, cgroup and exit status), and so does
``memfd_create``: Landlock lets ``execve("/proc/self/fd/N")`` of a memfd through.
"""

from __future__ import annotations

import platform

import pytest
from kit import Arena
from seccomp_refusal import ONLY_THE_FILTER

from sandbox import Policy

pytestmark = [
    pytest.mark.usefixtures("confined"),
    pytest.mark.skipif(platform.machine() != "x86_64", reason="raw x86-64 syscall numbers"),
]

_MEMFD_OF_PYTHON = (
    "fd = os.memfd_create('payload', 0)\n"
    "with open(sys.executable, 'rb') as exe: os.write(fd, exe.read())\n"
)


def _attempts(outside: str, ppid_expr: str = "os.getppid()") -> dict[str, str]:
    return {
        "inotify_watch_outside": (
            "fd = libc('inotify_init1', 0)\n"
            f"result = libc('inotify_add_watch', fd, {outside!r}.encode(), 0xFFF)"
        ),
        "raw_inotify_init": ONLY_THE_FILTER + "result = filtered(253)",
        "raw_inotify_add_watch": (
            ONLY_THE_FILTER + f"result = filtered(254, -1, {outside!r}.encode(), 0xFFF)"
        ),
        "fanotify_init": "result = libc('fanotify_init', 0, 0)",
        "raw_fanotify_mark": (
            ONLY_THE_FILTER + f"result = filtered(301, -1, 1, 0x3F, -100, {outside!r}.encode())"
        ),
        "pidfd_open_kernel": ONLY_THE_FILTER + f"result = filtered(434, {ppid_expr}, 0)",
        "pidfd_open_init": "result = os.pidfd_open(1)",
    }


@pytest.mark.parametrize("permissions", ["none", "network+subprocess"])
@pytest.mark.parametrize("name", list(_attempts("/")))
async def test_side_channels_are_refused(arena: Arena, name: str, permissions: str) -> None:
    code = _attempts(str(arena.outside))[name]
    policy = Policy() if permissions == "none" else arena.network_policy(subprocess=True)
    result = await arena.attack(code, policy=policy)
    arena.assert_refused(result)


EXECUTE_FROM_MEMORY = {
    "memfd_create": "result = os.memfd_create('payload', 0)",
    "raw_memfd_create": ONLY_THE_FILTER + "result = filtered(319, b'payload', 0)",
    # Landlock lets /proc/self/fd/N of a memfd through (it checks the memfd's own
    # path): this is why memfd_create is refused.
    "execve_proc_self_fd_memfd": (
        _MEMFD_OF_PYTHON
        + "r = subprocess.run([f'/proc/self/fd/{fd}', '-c', 'print(1)'], pass_fds=(fd,),"
        " capture_output=True)\nresult = r.returncode, r.stdout"
    ),
    # glibc's fexecve is execveat(fd, "", ..., AT_EMPTY_PATH)
    "fexecve": (
        "fd = os.open(sys.executable, os.O_RDONLY)\n"
        "argv = (ctypes.c_char_p * 2)(b'python', None)\n"
        "result = libc('fexecve', fd, argv, argv)"
    ),
    "raw_execveat_fd": (
        ONLY_THE_FILTER + "fd = os.open(sys.executable, os.O_RDONLY)\n"
        "argv = (ctypes.c_char_p * 2)(b'python', None)\n"
        "result = filtered(322, fd, b'', argv, None, 0x1000)"
    ),
    "raw_execveat_by_path": (
        ONLY_THE_FILTER + "argv = (ctypes.c_char_p * 2)(b'true', None)\n"
        "result = filtered(322, -100, b'/bin/true', argv, None, 0)"
    ),
    # An anonymous file in the workspace: Landlock checks the workspace's rights.
    "execve_proc_self_fd_tmpfile": (
        "fd = os.open('.', os.O_TMPFILE | os.O_WRONLY, 0o700)\n"
        "with open(sys.executable, 'rb') as exe: os.write(fd, exe.read())\n"
        "r = subprocess.run([f'/proc/self/fd/{fd}', '-c', 'print(1)'], pass_fds=(fd,),"
        " capture_output=True)\nresult = r.returncode, r.stdout"
    ),
    "copy_to_workspace_and_execute": (
        "import shutil\nshutil.copyfile(sys.executable, 'py')\n"
        "r = subprocess.run(['./py', '-c', 'print(1)'], capture_output=True)\n"
        "result = r.returncode, r.stdout"
    ),
}


@pytest.mark.parametrize("code", EXECUTE_FROM_MEMORY.values(), ids=EXECUTE_FROM_MEMORY.keys())
async def test_no_code_from_memory_or_the_workspace(arena: Arena, code: str) -> None:
    result = await arena.attack(code, policy=Policy(subprocess=True))
    arena.assert_refused(result)


async def test_kit_subprocess_still_runs(arena: Arena) -> None:
    code = "r = subprocess.run(['/bin/true'])\nresult = r.returncode"
    result = await arena.attack(code, policy=Policy(subprocess=True))
    assert result == "ALLOWED: 0", result


# -- network interfaces, addresses and MAC through socket ioctls --------------------------------
#
# Every ioctl from 0x8900 to 0x89ff is refused in every worker.


_IFCONF = """
import array, fcntl, struct
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
buf = array.array('B', bytes(4096))
n, _ = struct.unpack('iL', fcntl.ioctl(s.fileno(), 0x8912, struct.pack('iL', 4096, buf.buffer_info()[0])))
result = [(bytes(buf[i:i + 16]).rstrip(b'\\0'), socket.inet_ntoa(bytes(buf[i + 20:i + 24])))
          for i in range(0, n, 40)]
"""


_HWADDR = """
import fcntl, struct
result = fcntl.ioctl(3, 0x8927, struct.pack('256s', b'lo'))[16:24].hex()  # on the channel
"""


_IFADDR_TCP = """
import fcntl, struct
s = socket.socket()
result = socket.inet_ntoa(fcntl.ioctl(s.fileno(), 0x8915, struct.pack('256s', b'lo'))[20:24])
"""


_IFINDEX = "result = socket.if_nametoindex('lo')"


_HIGH_BITS = """
buf = ctypes.create_string_buffer(b'lo', 64)
syscall(16, 3, ctypes.c_ulong(0xFFFF_FFFF_0000_8927), buf)  # the command is an unsigned int
result = buf.raw[18:24].hex()
"""


@pytest.mark.parametrize("code", [_IFCONF, _HWADDR], ids=["SIOCGIFCONF", "SIOCGIFHWADDR"])
async def test_interfaces_are_not_listed_without_network(arena: Arena, code: str) -> None:
    result = await arena.attack(code)
    arena.assert_refused(result)


@pytest.mark.parametrize(
    "code",
    [_IFCONF, _HWADDR, _IFADDR_TCP, _IFINDEX, _HIGH_BITS],
    ids=["SIOCGIFCONF", "SIOCGIFHWADDR", "SIOCGIFADDR_tcp", "if_nametoindex", "high_bits"],
)
async def test_no_socket_ioctl_with_every_permission(arena: Arena, code: str) -> None:
    result = await arena.attack(code, policy=arena.network_policy(subprocess=True))
    arena.assert_refused(result)
