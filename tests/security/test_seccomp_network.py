"""Class 4, transports: a plugin reaches exactly the TCP ports it declared, and nothing else.

Landlock's network rules cover TCP connect and bind only. With the ``network``
permission (here: ``127.0.0.1:<allowed_port>``) a worker may create TCP sockets
and nothing else; fast-open data, repair mode, bind, listen and accept are refused.
Without it, the worker's Unix sockets can neither reach nor be reached, abstract
names included. The arena's UDP socket sits on the *allowed* port number, so a
datagram to it would prove that a port rule was bypassed.
"""

from __future__ import annotations

import platform
import socket

import pytest
import trio
from kit import Arena, Listener
from seccomp_refusal import ONLY_THE_FILTER

pytestmark = [
    pytest.mark.usefixtures("confined"),
    pytest.mark.skipif(platform.machine() != "x86_64", reason="raw x86-64 syscall numbers"),
]

#: socket() arguments refused even with the network permission.
FORBIDDEN_SOCKETS = {
    "udp": "socket.AF_INET, socket.SOCK_DGRAM, 0",
    "udp_nonblocking_cloexec": "socket.AF_INET, socket.SOCK_DGRAM | 0o4000 | 0o2000000, 0",
    "udp6": "socket.AF_INET6, socket.SOCK_DGRAM, 0",
    "icmp_ping": "socket.AF_INET, socket.SOCK_DGRAM, 1",
    "udplite": "socket.AF_INET, socket.SOCK_DGRAM, 136",
    "mptcp": "socket.AF_INET, socket.SOCK_STREAM, 262",
    "mptcp6": "socket.AF_INET6, socket.SOCK_STREAM, 262",
    "sctp_stream": "socket.AF_INET, socket.SOCK_STREAM, 132",
    "sctp_seqpacket": "socket.AF_INET, socket.SOCK_SEQPACKET, 132",
    "dccp": "socket.AF_INET, 6, 33",
    "raw_icmp": "socket.AF_INET, socket.SOCK_RAW, 1",
    "raw_ip": "socket.AF_INET, socket.SOCK_RAW, 255",
    "packet": "17, socket.SOCK_RAW, 0x0300",
    "packet_dgram": "17, socket.SOCK_DGRAM, 0x0300",
    "netlink_route": "16, socket.SOCK_RAW, 0",
    "netlink_as_stream": "16, socket.SOCK_DGRAM, 0",
    "unix_stream": "socket.AF_UNIX, socket.SOCK_STREAM, 0",
    "unix_dgram": "socket.AF_UNIX, socket.SOCK_DGRAM, 0",
    "vsock": "40, socket.SOCK_STREAM, 0",
    "alg": "38, socket.SOCK_SEQPACKET, 0",
    "tipc": "30, socket.SOCK_STREAM, 0",
    "xdp": "44, socket.SOCK_RAW, 0",
}


@pytest.mark.parametrize("args", FORBIDDEN_SOCKETS.values(), ids=FORBIDDEN_SOCKETS.keys())
async def test_only_tcp_sockets_with_network(arena: Arena, args: str) -> None:
    code = (
        f"fd = syscall(41, {args})\n"
        f"s = socket.socket(fileno=fd)\n"
        f"s.sendto(b'x', ('127.0.0.1', {arena.allowed_port}))\n"
        f"result = 'sent'"
    )
    result = await arena.attack(code, policy=arena.network_policy())
    arena.assert_refused(result)


async def test_udp_datagram_to_the_allowed_port_number(arena: Arena) -> None:
    code = (
        "s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)\n"
        f"s.sendto(b'leak', ('127.0.0.1', {arena.allowed_port}))\n"
        "result = 'sent'"
    )
    result = await arena.attack(code, policy=arena.network_policy())
    arena.assert_refused(result)


FAST_OPEN = {
    "sendto_msg_fastopen": (
        "s = socket.socket()\ns.sendto(b'GET / HTTP/1.0\\r\\n\\r\\n', 0x20000000, {addr})"
    ),
    "sendmsg_msg_fastopen": "s = socket.socket()\ns.sendmsg([b'x'], [], 0x20000000, {addr})",
    # vec is NULL: without the filter the kernel would answer EFAULT, not EPERM
    "raw_sendmmsg_msg_fastopen": (
        ONLY_THE_FILTER
        + "s = socket.socket()\nresult = filtered(307, s.fileno(), None, 1, 0x20000000)"
    ),
    "setsockopt_fastopen_connect": (
        "s = socket.socket()\ns.setsockopt(6, 30, 1)\ns.connect({addr})\ns.send(b'x')"
    ),
    "setsockopt_fastopen": "s = socket.socket()\ns.setsockopt(6, 23, 5)",
    "setsockopt_fastopen_no_cookie": "s = socket.socket()\ns.setsockopt(6, 34, 1)",
    "setsockopt_repair": "s = socket.socket()\ns.setsockopt(6, 19, 1)",
    "setsockopt_repair_queue": "s = socket.socket()\ns.setsockopt(6, 20, 1)",
    "setsockopt_ulp_tls": "s = socket.socket()\ns.setsockopt(6, 31, b'tls')",
    "sendto_fastopen_ipv6": (
        "s = socket.socket(socket.AF_INET6)\ns.sendto(b'x', 0x20000000, ('::1', {port}))"
    ),
    # A lingering close blocks whoever drops the last reference: once, the kernel.
    "setsockopt_so_linger": (
        "import struct\ns = socket.socket()\n"
        "s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack('ii', 1, 30))\n"
        "result = 'lingers'"
    ),
}


@pytest.mark.parametrize("code", FAST_OPEN.values(), ids=FAST_OPEN.keys())
async def test_no_fast_open_or_repair(arena: Arena, code: str) -> None:
    addr = f"('127.0.0.1', {arena.forbidden_port})"
    attempt = code.replace("{addr}", addr).replace("{port}", str(arena.forbidden_port))
    attempt += "\nresult = result or 'sent'"
    result = await arena.attack(attempt, policy=arena.network_policy())
    arena.assert_refused(result)


BE_REACHED = {
    "listen_autobind": "s = socket.socket()\ns.listen()\nresult = s.getsockname()",
    "bind_any_port": "s = socket.socket()\ns.bind(('127.0.0.1', 0))\nresult = s.getsockname()",
    "bind_allowed_port": "s = socket.socket()\ns.bind(('0.0.0.0', {port}))",
    "bind_ipv6": "s = socket.socket(socket.AF_INET6)\ns.bind(('::', 0))",
    "raw_accept": ONLY_THE_FILTER
    + "s = socket.socket()\nresult = filtered(43, s.fileno(), None, None)",
    "raw_accept4": (
        ONLY_THE_FILTER + "s = socket.socket()\nresult = filtered(288, s.fileno(), None, None, 0)"
    ),
}


@pytest.mark.parametrize("code", BE_REACHED.values(), ids=BE_REACHED.keys())
async def test_no_listening_with_network(arena: Arena, code: str) -> None:
    attempt = code.replace("{port}", str(arena.allowed_port))
    result = await arena.attack(attempt, policy=arena.network_policy())
    arena.assert_refused(result)


async def test_tcp_to_a_port_not_declared(arena: Arena) -> None:
    code = f"socket.create_connection(('127.0.0.1', {arena.forbidden_port}), timeout=2)"
    result = await arena.attack(code, policy=arena.network_policy())
    arena.assert_refused(result)


def _unix(kind: str = "SOCK_STREAM") -> str:
    return f"s = socket.socket(socket.AF_UNIX, socket.{kind})\n"


WITHOUT_NETWORK = {
    "connect_abstract": _unix() + "s.connect('\\0{abstract}')",
    "connect_abstract_seqpacket": _unix("SOCK_SEQPACKET") + "s.connect('\\0{abstract}')",
    "raw_connect_abstract": (
        _unix() + "a = b'\\x01\\x00\\x00' + b'{abstract}'\nsyscall(42, s.fileno(), a, len(a))"
    ),
    "connect_workspace_socket": _unix() + "s.connect('served.sock')",
    "bind_abstract": _unix() + "s.bind('\\0tak-redteam-bound')\ns.listen()",
    "listen_autobind_abstract": _unix() + "s.listen()\nresult = s.getsockname()",
    "bind_path_in_workspace": _unix() + "s.bind('mine.sock')",
    "dgram_to_abstract": (
        "s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)\ns.sendto(b'x', '\\0{abstract}')"
    ),
    "raw_accept_on_pair": (
        ONLY_THE_FILTER
        + "a, b = socket.socketpair()\nresult = filtered(43, a.fileno(), None, None)"
    ),
    "tcp_socket": "socket.socket().connect(('127.0.0.1', {port}))",
    "udp_socket": "socket.socket(socket.AF_INET, socket.SOCK_DGRAM).sendto(b'x', ('127.0.0.1', {port}))",
}


@pytest.mark.parametrize("code", WITHOUT_NETWORK.values(), ids=WITHOUT_NETWORK.keys())
async def test_no_reaching_out_without_network(arena: Arena, code: str) -> None:
    # A socket served by someone outside, but at a path inside the workspace.
    served = Listener(socket.AF_UNIX, socket.SOCK_STREAM, str(arena.workspace / "served.sock"))
    try:
        attempt = code.replace("{abstract}", arena.abstract_name)
        attempt = attempt.replace("{port}", str(arena.allowed_port))
        result = await arena.attack(attempt + "\nresult = result or 'reached'")
        arena.assert_refused(result)
        assert served.seen == [], served.seen
        assert arena.allowed_tcp.seen == []
    finally:
        served.close()


async def test_kit_tcp_to_the_declared_port_works(arena: Arena) -> None:
    code = (
        f"s = socket.create_connection(('127.0.0.1', {arena.allowed_port}), timeout=5)\n"
        "s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)\n"
        "s6 = socket.socket(socket.AF_INET6, socket.SOCK_STREAM | socket.SOCK_NONBLOCK, 6)\n"
        "a, b = socket.socketpair()\n"
        "result = 'connected'"
    )
    result = await arena.attack(code, policy=arena.network_policy())
    assert result == "ALLOWED: 'connected'", result
    for _ in range(40):
        if arena.allowed_tcp.seen:
            break
        await trio.sleep(0.05)
    assert arena.allowed_tcp.seen
    arena.assert_nothing_seen([result])


async def test_kit_socketpair_without_network(arena: Arena) -> None:
    code = "a, b = socket.socketpair()\na.sendall(b'x')\nresult = b.recv(1)"
    result = await arena.attack(code)
    assert result == "ALLOWED: b'x'", result
