"""A second engineer's attack on the worker side (issue 10 review).

Each test is one attempt made from inside a real confined worker, with the
widest policy that matters for it. Seven got through at first (H1-H6 below,
then strict xfails); they are closed, each as its class, with the wider
attempts of the class beside them. The others were refused from the start and
join the adversarial suite.

Stalls are measured with a 10 ms sleeper on the Trio loop (the gap between
two wake-ups), not with calls: ``responsive.while_responsive`` only times its
pings, so a freeze that falls between two pings goes unseen.
"""

from __future__ import annotations

import logging
import os
import platform
import signal
import socket
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from kit import PLUGINS, Arena

from kernel.executor import run_tool_calls
from kernel.messages import Observation, ToolCall
from plugins import remote_tools
from sandbox import Policy, open_worker_pool
from tests.security.frame_counter import assert_decoding_bounded, decoded_frames

pytestmark = [
    pytest.mark.usefixtures("confined"),
    pytest.mark.skipif(platform.machine() != "x86_64", reason="raw x86-64 syscall numbers"),
]

_WIDE = Policy(subprocess=True)


async def _attack_then_second_worker(arena: Arena, code: str) -> tuple[Observation, Observation]:
    """The attempt in one worker, then a call in a second worker of the same pool."""
    async with open_worker_pool(arena.workspace, spare=False) as pool:
        first = await pool.start(str(PLUGINS / "attack.py"), policy=_WIDE)
        [attempt] = await run_tool_calls(
            [ToolCall("a", "attack", {"code": code})], remote_tools(first)
        )
        second = await pool.start(str(PLUGINS / "attack.py"), name="second")
        [check] = await run_tool_calls(
            [ToolCall("b", "attack", {"code": "result = 1"})], remote_tools(second)
        )
    return attempt, check


def _snapshot(root: Path) -> list[tuple[str, int, int]]:
    return sorted(
        (str(p.relative_to(root)), p.lstat().st_ino, p.lstat().st_mode) for p in root.rglob("*")
    )


# ======================================================================================
# Closed holes (H1-H6) and their classes
# ======================================================================================

# --- H1: one integer of more than 4300 digits in a worker frame takes the pool down ----
# Closed: any decoding error is a FrameError, and whatever the kernel's reader of a
# worker raises costs that worker only (sandbox.pool._Connection._worker_only).

_HUGE_INT = """
import struct
body = ('{"type":"result","id":999,"ok":true,"value":' + '1' * 5000 + '}').encode()
os.write(3, struct.pack('!I', len(body)) + body)
time.sleep(1)
result = 'sent'
"""


async def test_a_frame_with_a_huge_integer_costs_the_worker_only(arena: Arena) -> None:
    attempt, check = await _attack_then_second_worker(arena, _HUGE_INT)
    assert attempt.is_error and "broke the protocol" in attempt.content, attempt.content
    assert check.content == "ALLOWED: 1", check.content
    arena.assert_nothing_seen([attempt.content])


_RAW_FRAME = """
import struct
body = BODY
os.write(3, struct.pack('!I', len(body)) + body)
time.sleep(1)
result = 'sent'
"""

#: Frames json.loads refuses in other ways, or accepts and the kernel must not.
BAD_FRAMES = {
    "int_past_the_kernel_limit": b'b\'{"type":"result","id":1,"ok":true,"value":\' + b"1" * 1001 + b"}"',
    "negative_huge_int": b'b\'{"type":"log","level":-\' + b"9" * 4400 + b\',"message":"x"}\'',
    "bad_utf8": rb"""b'{"type":"log","level":20,"message":"\xff\xfe"}'""",
    "log_message_not_text": rb"""b'{"type":"log","level":20,"message":[[[]]]}'""",
    "log_frame_over_16k": rb"""b'{"type":"log","level":20,"message":"' + b'x' * 17000 + b'"}'""",
    "too_many_values": (
        rb"""b'{"type":"log","level":20,"message":"x","pad":[' + b'0,' * 200001 + b'0]}'"""
    ),
    "too_many_keys": (
        rb"""b'{"type":"log","level":20,"message":"x","pad":{'"""
        rb""" + b','.join(b'"%x":0' % i for i in range(150000)) + b'}}'"""
    ),
    "float_overflow_id": rb"""b'{"type":"result","id":1e999,"ok":true,"value":1}'""",
}


@pytest.mark.parametrize("name", list(BAD_FRAMES))
async def test_a_frame_the_kernel_cannot_take_costs_the_worker_only(
    arena: Arena, name: str
) -> None:
    code = _RAW_FRAME.replace("BODY", BAD_FRAMES[name].decode())
    attempt, check = await _attack_then_second_worker(arena, code)
    assert attempt.is_error and "broke the protocol" in attempt.content, attempt.content
    assert check.content == "ALLOWED: 1", check.content
    arena.assert_nothing_seen([attempt.content])


# --- H2: a 32 MiB frame of tiny JSON values: seconds of frozen loop, ~1 GB of kernel RSS
# Closed: frames from a worker are bounded before json.loads (sandbox._protocol.FROM_WORKER).

_AMPLIFIED = """
import struct
n = (32 * 1024 * 1024 - 100) // 3
body = ('{"type":"log","level":20,"message":[' + '[],' * (n - 1) + '[]]}').encode()
os.write(3, struct.pack('!I', len(body)) + body)
time.sleep(0.5)
result = len(body)
"""


async def test_a_huge_frame_of_tiny_values_does_not_freeze_the_kernel(arena: Arena) -> None:
    with decoded_frames() as decoded:
        result = await arena.attack(_AMPLIFIED)
    assert_decoding_bounded(decoded)  # the 32 MiB frame was refused before json.loads
    assert result.startswith("failed: ") and "broke the protocol" in result, result
    arena.assert_nothing_seen([result])


# The class: the costliest frames the kernel still accepts (8 MiB, 200 000 values),
# then just past each limit. Decoding one costs the kernel ~25 ms (a figure, not
# asserted: what is checked is what it decodes); a frame past a limit is refused
# before json.loads runs.
_COSTLY = """
import struct
n = VALUES
head = b'{"type":"log","level":20,"message":"x","pad":[' + b'[],' * (n // 2) + b'0],"fill":"'
body = head + b'a' * (SIZE - len(head) - 2) + b'"}'
os.write(3, struct.pack('!I', len(body)) + body)
time.sleep(0.5)
result = len(body)
"""


@pytest.mark.parametrize(
    ("values", "size", "accepted"),
    [
        (199_970, 8 * 1024 * 1024, True),
        (200_010, 8 * 1024 * 1024, False),
        (1000, 8 * 1024 * 1024 + 1, False),
    ],
    ids=["at_the_limits", "too_many_values", "too_large"],
)
async def test_the_costliest_frames_do_not_freeze_the_kernel(
    arena: Arena, values: int, size: int, accepted: bool
) -> None:
    # A log frame over 16 KiB kills the worker, but only after it was decoded.
    code = _COSTLY.replace("VALUES", str(values)).replace("SIZE", str(size))
    with decoded_frames() as decoded:
        result = await arena.attack(code)
    assert_decoding_bounded(decoded)
    assert (size in [s for s, _ in decoded]) == accepted, decoded  # refused before json.loads
    assert result.startswith("failed: ") and "broke the protocol" in result, result
    assert ("log frame" in result) == accepted, result
    arena.assert_nothing_seen([result])


# --- H3: a lingering TCP socket sent to the kernel is closed on the Trio thread ----------
# Closed twice: the kernel's ends refuse descriptors, and SO_LINGER is refused.

_LINGER = """
import struct
s = socket.socket()
s.connect(('127.0.0.1', PORT))  # approved; the peer never reads
s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack('ii', 1, 3))
s.setblocking(False)
try:
    while True:
        s.send(b'x' * 65536)
except BlockingIOError:
    pass
import json
broker = sys.modules['sandbox._netbroker']._installed._sock
fd = s.detach()
# Requests whose answers go unread: the kernel answers until its 16 KiB send buffer is
# full, then stops reading. The descriptor rides on the next byte, and this process lets
# go of its own reference before the kernel reads it.
body = json.dumps({'type': 'resolve', 'host': '127.0.0.1', 'port': PORT}).encode()
broker.sendall((struct.pack('!I', len(body)) + body) * 300)
time.sleep(0.3)
socket.send_fds(broker, [b'\\0'], [fd])  # the kernel's recv drops it: the last fput
os.close(fd)
broker.settimeout(1)
try:
    while broker.recv(65536):  # let the kernel go on
        pass
except TimeoutError:
    pass
time.sleep(0.2)
result = 'sent'
"""


async def test_a_lingering_socket_sent_to_the_kernel_does_not_freeze_it(arena: Arena) -> None:
    sink = socket.socket()
    sink.bind(("127.0.0.1", 0))
    sink.listen(8)  # never accepted, never read: a zero window
    port = sink.getsockname()[1]
    try:
        policy = Policy(network=(f"127.0.0.1:{port}",))
        code = _LINGER.replace("PORT", str(port))
        result = await arena.attack(code, policy=policy)
    finally:
        sink.close()
    # Refused at the worker's sendmsg: the descriptor never reaches the kernel, so no
    # close of it can block the kernel's loop for the linger time.
    arena.assert_refused(result)
    arena.assert_nothing_seen([result])


# The class: any descriptor a worker sends the kernel, on either channel, is refused at
# its sendmsg (SO_PASSRIGHTS 0 on the kernel's ends); SO_LINGER is refused besides
# (test_seccomp_network.py), and Linux before 6.16 is test_sandbox_pool.py's.
_SEND_A_DESCRIPTOR = """
channel = CHANNEL
r, w = os.pipe()
socket.send_fds(channel, [b'x'], [w])
result = 'sent'
"""
CHANNELS = {
    "call_channel": "socket.socket(fileno=os.dup(3))",
    "broker_channel": "sys.modules['sandbox._netbroker']._installed._sock",
}


@pytest.mark.parametrize("channel", list(CHANNELS))
async def test_no_descriptor_reaches_the_kernel(arena: Arena, channel: str) -> None:
    code = _SEND_A_DESCRIPTOR.replace("CHANNEL", CHANNELS[channel])
    result = await arena.attack(code, policy=arena.network_policy())
    assert result == "denied: EPERM", result
    arena.assert_refused(result)


# --- H4: a stdout flood is logged line by line, unbounded, on the Trio thread -----------
# Closed: each worker has a log budget (LogBudget: 1 000 lines at once, then 100 lines
# and 100 KiB a second); what is past it is dropped, counted, and said once.

_FLOOD_LINES = 100_000
_FLOOD = f"os.write(1, b'x\\n' * {_FLOOD_LINES})\nresult = 'flooded'"


class _Counter(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.count = 0

    def emit(self, record: logging.LogRecord) -> None:
        self.count += 1


@contextmanager
def _info_logging(arena: Arena) -> Iterator[_Counter]:
    """Log at INFO as ``tak serve`` does, counting records instead of keeping them."""
    root = logging.getLogger()
    counter = _Counter()
    level, kept = root.level, arena._log.level
    root.setLevel(logging.INFO)
    arena._log.setLevel(logging.WARNING)  # the arena keeps every record it sees
    root.addHandler(counter)
    try:
        yield counter
    finally:
        root.removeHandler(counter)
        root.setLevel(level)
        arena._log.setLevel(kept)


async def test_a_stdout_flood_is_not_logged_line_by_line(arena: Arena) -> None:
    with _info_logging(arena) as counter:
        result = await arena.attack(_FLOOD)
    assert result == "ALLOWED: 'flooded'", result
    assert counter.count <= 10_000, f"the kernel logged {counter.count} lines for one call"
    arena.assert_nothing_seen([result])


FLOODS = {
    "stderr": f"os.write(2, b'x\\n' * {_FLOOD_LINES})",
    "log_records": (
        "from kernel.plugin import context\nlog = context().logger\n"
        "for i in range(20_000):\n    log.warning('x %d', i)"
    ),
    "long_lines": "for _ in range(200):\n    os.write(1, b'y' * 50_000 + b'\\n')",
    # The worker is never blocked on a full pipe: dropped lines are read all the same.
    "eight_mib": "os.write(1, b'z\\n' * (4 * 1024 * 1024))",
}


@pytest.mark.parametrize("name", list(FLOODS))
async def test_every_flood_is_held_to_the_log_budget(arena: Arena, name: str) -> None:
    code = FLOODS[name] + "\nresult = 'flooded'"
    with _info_logging(arena) as counter:
        result = await arena.attack(code)
    # Finished (a worker blocked on a full pipe would have met its deadline), and the
    # kernel's work for it is bounded: counted in lines logged, not timed.
    assert result == "ALLOWED: 'flooded'", result
    assert counter.count <= 1_500, f"the kernel logged {counter.count} lines for one call"
    dropped = [r for r in arena._log.records if "lines dropped" in r.getMessage()]
    assert dropped, "no record says that lines were dropped"
    arena.assert_nothing_seen([result])


# --- H5: CLONE_PARENT makes the kernel the parent: zombies nobody reaps -----------------
# Closed: the clone check refuses CLONE_PARENT with any other flags
# (test_seccomp_tables.py checks every policy on both architectures).

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


# --- H6: network interfaces, addresses and MAC through socket ioctls --------------------
# Closed: every ioctl from 0x8900 to 0x89ff is refused in every worker.

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


# ======================================================================================
# Refused (the adversarial suite)
# ======================================================================================

# --- <workspace>/.tak stays read-only: the mount namespace, attacked --------------------

DOT_TAK = {
    "create_in_dot_tak": "open('.tak/x.py', 'w')",
    "rename_dot_tak": "os.rename('.tak', 'moved')",
    "exchange_dot_tak": "os.mkdir('d')\nsyscall(316, -100, b'.tak', -100, b'd', 2)",
    "rmdir_dot_tak_tmp": "os.rmdir('.tak/tmp')",
    "rename_dot_tak_tmp": "os.rename('.tak/tmp', 'moved')",
    "hard_link_into_dot_tak": "open('p.py', 'w').write('x')\nos.link('p.py', '.tak/plugins/p.py')",
    "tmpfile_linked_by_proc": (
        "fd = os.open('.tak/tmp', os.O_TMPFILE | os.O_WRONLY, 0o600)\n"
        "os.link(f'/proc/self/fd/{fd}', '.tak/plugins/p.py')"
    ),
    "tmpfile_linked_by_empty_path": (
        "fd = os.open('.', os.O_TMPFILE | os.O_WRONLY, 0o600)\n"
        "libc('linkat', fd, b'', -100, b'.tak/plugins/p.py', 0x1000)"
    ),
    "up_from_the_tmpfs": "open('.tak/tmp/../plugins/p.py', 'w')",
    "dirfd_of_the_tmpfs": (
        "d = os.open('.tak/tmp', os.O_RDONLY)\n"
        "os.open('../plugins/p.py', os.O_CREAT | os.O_WRONLY, 0o600, dir_fd=d)"
    ),
    "cwd_in_dot_tak": "os.chdir('.tak/plugins')\nopen('p.py', 'w')",
    "umount_dot_tak": "libc('umount2', os.path.abspath('.tak').encode(), 2)",
    "umount_the_tmpfs": "libc('umount2', os.path.abspath('.tak/tmp').encode(), 2)",
    "remount_read_write": (
        "libc('mount', None, os.path.abspath('.tak').encode(), None, 0x20 | 0x1000, None)"
    ),
    "open_tree_clone": "syscall(428, -100, b'.', 1 | 0x80000)",
    "move_mount": "syscall(429, -100, b'.tak/tmp', -100, b'x', 0)",
    "fsopen": "syscall(430, b'tmpfs', 0)",
    "unshare_user_and_mount": "syscall(272, 0x10000000 | 0x20000)",
    "clone_new_user": "syscall(56, 0x10000000 | 17, 0, 0, 0, 0)",
}


@pytest.mark.parametrize("name", list(DOT_TAK))
async def test_dot_tak_stays_read_only_in_the_worker(arena: Arena, name: str) -> None:
    for directory in ("plugins", "tmp"):  # .tak/tmp: what the pool makes
        (arena.workspace / ".tak" / directory).mkdir(parents=True, exist_ok=True)
    (arena.workspace / ".tak" / "plugins" / "trusted.py").write_text("x = 1\n")
    before = _snapshot(arena.workspace / ".tak")
    result = await arena.attack(DOT_TAK[name], policy=_WIDE)
    arena.assert_refused(result)
    assert _snapshot(arena.workspace / ".tak") == before
    assert (arena.workspace / ".tak" / "plugins" / "trusted.py").read_text() == "x = 1\n"


# --- outside the workspace ---------------------------------------------------------------

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


# --- other ABIs ---------------------------------------------------------------------------

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


# --- signals to the kernel ------------------------------------------------------------------

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


# --- what a worker holds and what it can hand the kernel --------------------------------

_FDS = """
import fcntl
held = []
for fd in range(4096):
    try:
        fcntl.fcntl(fd, fcntl.F_GETFD)
    except OSError:
        continue
    held.append(fd)
result = held
"""


async def test_a_worker_holds_only_stdio_and_its_channel(arena: Arena) -> None:
    result = await arena.attack(_FDS, policy=_WIDE)
    assert result == "ALLOWED: [0, 1, 2, 3]", result
    arena.assert_nothing_seen([result])


_FDS_TO_KERNEL = """
fd = os.open('f', os.O_CREAT | os.O_RDWR, 0o600)
channel = socket.socket(fileno=os.dup(3))
for _ in range(50):
    socket.send_fds(channel, [b''], [fd, 0, 1, 2])
    socket.send_fds(channel, [b''], [channel.fileno()])
time.sleep(0.3)
raise Refused('sent')
"""


def _open_files() -> list[str]:
    """What this (the kernel's) process has open."""
    targets = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            targets.append(os.readlink(f"/proc/self/fd/{fd}"))
        except OSError:
            continue  # the listing's own descriptor
    return targets


async def test_descriptors_sent_to_the_kernel_are_not_kept(arena: Arena) -> None:
    before = _open_files()
    result = await arena.attack(_FDS_TO_KERNEL, policy=_WIDE)
    after = _open_files()
    assert len(after) <= len(before), (before, after)
    assert str(arena.workspace / "f") not in after
    arena.assert_refused(result)


_DEEP_LOG = """
import struct
body = ('{"type":"log","level":20,"message":' + '[' * 5000 + ']' * 5000 + '}').encode()
os.write(3, struct.pack('!I', len(body)) + body)
time.sleep(1)
result = 'sent'
"""


async def test_a_deeply_nested_frame_costs_the_worker_only(arena: Arena) -> None:
    attempt, check = await _attack_then_second_worker(arena, _DEEP_LOG)
    assert attempt.is_error and "broke the protocol" in attempt.content, attempt.content
    assert check.content == "ALLOWED: 1", check.content
    arena.assert_nothing_seen([attempt.content])
