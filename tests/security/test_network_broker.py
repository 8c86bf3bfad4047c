"""Class 4, hosts and DNS: a network plugin reaches exactly its approved host:port pairs.

The worker resolves no name and connects nowhere by itself: ``sandbox._netbroker``
asks the kernel, which decides on the address actually connected to. Each test names
the guarantee of ``sandbox/_netbroker.py`` it attacks; ``test_kit_`` tests check that
what is approved still works (they are not attempts).
"""

from __future__ import annotations

import errno
import ipaddress
import socket
import threading

import pytest
import trio
import trio.testing
from kit import PLUGINS, Arena

from sandbox import Policy, open_worker_pool
from sandbox._netbroker import (
    Addresses,
    Approval,
    Broker,
    Connect,
    Failed,
    Resolve,
)

pytestmark = pytest.mark.usefixtures("confined")

# What an attempt may use to talk to the broker channel directly, bypassing the patches.
_RAW_BROKER = """
import json, struct
broker = sys.modules['sandbox._netbroker']._installed._sock
def ask(message):
    body = json.dumps(message).encode()
    broker.sendall(struct.pack('!I', len(body)) + body)
    data, fds, _, _ = socket.recv_fds(broker, 4, 1)
    (n,) = struct.unpack('!I', data)
    answer = json.loads(broker.recv(n))
    for fd in fds:
        os.close(fd)
    if answer['type'] != 'failed':
        return answer
    raise Refused(answer['message'])
"""


def _denied_with(result: str, *codes: str) -> None:
    assert any(result == f"denied: {code}" for code in codes), result


# --- guarantee 1: only approved host:port pairs -------------------------------------


@pytest.mark.parametrize(
    ("family", "host", "port"),
    [
        ("AF_INET", "127.0.0.1", "forbidden"),  # the approved host, another port
        ("AF_INET", "127.0.0.2", "allowed"),  # another loopback address, the approved port
        ("AF_INET", "0.0.0.0", "allowed"),  # "this host": reaches every local listener
        ("AF_INET6", "::1", "allowed"),  # loopback over IPv6 is not 127.0.0.1
        ("AF_INET6", "::ffff:127.0.0.1", "forbidden"),  # mapped: still the wrong port
        ("AF_INET6", "::", "allowed"),
    ],
)
async def test_connect_to_an_unapproved_address_is_refused(
    arena: Arena, family: str, host: str, port: str
) -> None:
    number = arena.allowed_port if port == "allowed" else arena.forbidden_port
    result = await arena.attack(
        f"s = socket.socket(socket.{family}); s.settimeout(5)\n"
        f"s.connect(({host!r}, {number})); result = s.getpeername()",
        policy=arena.network_policy(),
    )
    _denied_with(result, "EACCES")
    arena.assert_refused(result)


async def test_connect_ex_says_eacces_and_connects_nothing(arena: Arena) -> None:
    result = await arena.attack(
        f"code = socket.socket().connect_ex(('127.0.0.1', {arena.forbidden_port}))\n"
        "if code: raise OSError(code, os.strerror(code))\n"
        "result = code",
        policy=arena.network_policy(),
    )
    _denied_with(result, "EACCES")
    arena.assert_refused(result)


@pytest.mark.parametrize(
    "how",
    [
        "socket.create_connection(('127.0.0.1', {port}), timeout=5)",
        "import http.client; http.client.HTTPConnection('127.0.0.1', {port}, timeout=5).connect()",
    ],
)
async def test_stdlib_clients_reach_no_unapproved_port(arena: Arena, how: str) -> None:
    result = await arena.attack(
        how.format(port=arena.forbidden_port) + "; result = 'connected'",
        policy=arena.network_policy(),
    )
    _denied_with(result, "EACCES")
    arena.assert_refused(result)


async def test_trio_reaches_no_unapproved_port(arena: Arena) -> None:
    result = await arena.attack(
        "import trio\n"
        "async def main():\n"
        f"    return await trio.open_tcp_stream('127.0.0.1', {arena.forbidden_port})\n"
        "try:\n"
        "    result = trio.run(main)\n"
        "except OSError as exc:\n"
        "    cause = exc if exc.errno else exc.__cause__.exceptions[0]\n"
        "    raise cause",
        policy=arena.network_policy(),
    )
    _denied_with(result, "EACCES")
    arena.assert_refused(result)


async def test_reconnecting_a_connected_socket_elsewhere_is_refused(arena: Arena) -> None:
    result = await arena.attack(
        f"s = socket.socket(); s.connect(('127.0.0.1', {arena.allowed_port}))\n"
        f"s.connect(('127.0.0.1', {arena.forbidden_port})); result = s.getpeername()",
        policy=arena.network_policy(),
    )
    _denied_with(result, "EISCONN", "EACCES")
    arena.assert_refused(result)


async def test_a_resolved_name_grants_only_its_own_ports(arena: Arena) -> None:
    # localhost:<allowed> approved: its address, 127.0.0.1, on another port is not.
    policy = Policy(network=(f"localhost:{arena.allowed_port}",))
    result = await arena.attack(
        f"[*_, (_, _, _, _, address)] = socket.getaddrinfo('localhost', {arena.allowed_port})\n"
        f"s = socket.socket(); s.connect((address[0], {arena.forbidden_port}))\n"
        "result = s.getpeername()",
        policy=policy,
    )
    _denied_with(result, "EACCES")
    arena.assert_refused(result)


async def test_a_wildcard_host_does_not_widen_the_port(arena: Arena) -> None:
    result = await arena.attack(
        f"s = socket.socket(); s.connect(('127.0.0.1', {arena.forbidden_port}))",
        policy=Policy(network=(f"*:{arena.allowed_port}",)),
    )
    _denied_with(result, "EACCES")
    arena.assert_refused(result)


# --- guarantee 1, below the patches: the system call itself -------------------------

_SOCKADDR = (
    "import struct\n"
    "def sockaddr(port):\n"
    "    return struct.pack('=HH4s8x', socket.AF_INET, socket.htons(port),"
    " socket.inet_aton('127.0.0.1'))\n"
)


@pytest.mark.parametrize("port", ["forbidden", "allowed"])
@pytest.mark.parametrize(
    "call",
    [
        "syscall(42, s.fileno(), address, len(address))",  # x86-64 connect
        "libc('connect', s.fileno(), address, len(address))",
    ],
)
async def test_connect_below_python_is_refused_by_seccomp(
    arena: Arena, call: str, port: str
) -> None:
    number = arena.allowed_port if port == "allowed" else arena.forbidden_port
    result = await arena.attack(
        _SOCKADDR + f"s = socket.socket(); address = sockaddr({number})\n{call}\nresult = 'sent'",
        policy=arena.network_policy(),
    )
    _denied_with(result, "EPERM")
    arena.assert_refused(result)


async def test_the_unpatched_socket_class_cannot_connect(arena: Arena) -> None:
    result = await arena.attack(
        "import _socket\n"
        f"s = _socket.socket(); s.connect(('127.0.0.1', {arena.forbidden_port}))\n"
        "result = 'connected'",
        policy=arena.network_policy(),
    )
    _denied_with(result, "EPERM")
    arena.assert_refused(result)


async def test_the_original_connect_kept_aside_cannot_connect(arena: Arena) -> None:
    result = await arena.attack(
        "real = sys.modules['sandbox._netbroker']._real_connect\n"
        f"real(socket.socket(), ('127.0.0.1', {arena.allowed_port})); result = 'connected'",
        policy=arena.network_policy(),
    )
    _denied_with(result, "EPERM")
    arena.assert_refused(result)


async def test_fast_open_data_is_refused(arena: Arena) -> None:
    result = await arena.attack(
        "s = socket.socket()\n"
        f"s.sendto(b'GET / HTTP/1.0\\r\\n\\r\\n', 0x20000000, ('127.0.0.1', {arena.forbidden_port}))\n"
        "result = 'sent'",
        policy=arena.network_policy(),
    )
    _denied_with(result, "EPERM")
    arena.assert_refused(result)


# --- guarantee 1, the broker channel itself: forged requests -----------------------


@pytest.mark.parametrize(
    "request_",
    [
        "{'type': 'connect', 'address': '127.0.0.1', 'port': FORBIDDEN, 'family': 2}",
        "{'type': 'connect', 'address': '127.0.0.2', 'port': ALLOWED, 'family': 2}",
        "{'type': 'connect', 'address': '127.0.0.1', 'port': ALLOWED, 'family': 1}",
        "{'type': 'connect', 'address': '127.0.0.1', 'port': ALLOWED, 'family': 10}",
        "{'type': 'resolve', 'host': 'localhost', 'port': ALLOWED}",
        "{'type': 'resolve', 'host': 'localhost', 'port': 0}",
        "{'type': 'resolve', 'host': 'a' * 300, 'port': ALLOWED}",
        "{'type': 'connect', 'address': '127.0.0.1', 'port': ALLOWED + 65536, 'family': 2}",
        "{'type': 'connect', 'address': '127.0.0.1', 'port': FORBIDDEN, 'family': 2,"
        " 'timeout': float('nan')}",
    ],
)
async def test_forged_broker_requests_are_refused(arena: Arena, request_: str) -> None:
    message = request_.replace("FORBIDDEN", str(arena.forbidden_port)).replace(
        "ALLOWED", str(arena.allowed_port)
    )
    result = await arena.attack(
        _RAW_BROKER + f"result = ask({message})", policy=arena.network_policy()
    )
    assert result.startswith("denied: refused: "), result
    arena.assert_refused(result)


# --- guarantee 2: no DNS in the worker ----------------------------------------------


@pytest.mark.parametrize(
    "code",
    [
        "result = socket.getaddrinfo('example.org', ALLOWED)",
        "result = socket.getaddrinfo('localhost', ALLOWED)",
        "result = socket.gethostbyname('localhost')",
        "result = socket.gethostbyname_ex('localhost')",
        "s = socket.socket(); s.connect(('localhost', ALLOWED)); result = s.getpeername()",
        "result = socket.create_connection(('localhost', ALLOWED), timeout=5).getpeername()",
        # The C resolver, unpatched: no resolver files and no datagrams.
        "import _socket; result = _socket.getaddrinfo('localhost', ALLOWED)",
        "import _socket; result = _socket.gethostbyname('localhost')",
    ],
)
async def test_unapproved_names_do_not_resolve(arena: Arena, code: str) -> None:
    result = await arena.attack(
        code.replace("ALLOWED", str(arena.allowed_port)), policy=arena.network_policy()
    )
    arena.assert_refused(result)


@pytest.mark.parametrize("path", ["/etc/resolv.conf", "/etc/hosts", "/etc/nsswitch.conf"])
async def test_the_resolver_files_are_unreadable(arena: Arena, path: str) -> None:
    if not await trio.Path(path).exists():
        pytest.skip(f"{path} does not exist here")
    result = await arena.attack(f"result = open({path!r}).read()", policy=arena.network_policy())
    _denied_with(result, "EACCES")
    arena.assert_refused(result)


_DNS_QUERY = "query = bytes.fromhex('abcd01000001000000000000076578616d706c65036f72670000010001')\n"


@pytest.mark.parametrize("port", ["53", "ALLOWED"])
async def test_dns_over_udp_is_refused(arena: Arena, port: str) -> None:
    number = arena.allowed_port if port == "ALLOWED" else 53
    result = await arena.attack(
        _DNS_QUERY
        + "s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)\n"
        + f"s.sendto(query, ('127.0.0.1', {number})); result = 'sent'",
        policy=arena.network_policy(),
    )
    _denied_with(result, "EPERM", "EACCES")
    arena.assert_refused(result)


# --- guarantees 3 and 4: the kernel stays in charge of its own time ----------------


async def test_a_malformed_broker_frame_costs_the_worker_only(arena: Arena) -> None:
    async with open_worker_pool(arena.workspace, spare=False) as pool:
        policy = arena.network_policy()
        attacker = await pool.start(str(PLUGINS / "attack.py"), policy=policy, name="attacker")
        bystander = await pool.start(str(PLUGINS / "attack.py"), policy=policy, name="bystander")
        code = (
            "broker = sys.modules['sandbox._netbroker']._installed._sock\n"
            "broker.sendall(b'\\xff\\xff\\xff\\xff' + b'x' * 64); time.sleep(5)"
        )
        with trio.fail_after(4):
            with pytest.raises(Exception, match="broke the network broker protocol"):
                await attacker.invoke("attack", {"code": code})
            check = f"socket.create_connection(('127.0.0.1', {arena.allowed_port})); result = 1"
            assert await bystander.invoke("attack", {"code": check}) == "ALLOWED: 1"
    arena.assert_nothing_seen()


async def test_a_worker_flooding_the_broker_is_held_back(arena: Arena) -> None:
    # Requests it never reads the answers of: the kernel's small send buffer fills, the
    # kernel stops reading, and the worker's own writes stop. Nothing else waits.
    flood = (
        "import json, struct\n"
        "broker = sys.modules['sandbox._netbroker']._installed._sock\n"
        "body = json.dumps({'type': 'connect', 'address': '127.0.0.1', "
        f"'port': {arena.forbidden_port}, 'family': 2}}).encode()\n"
        "frame = struct.pack('!I', len(body)) + body\n"
        "broker.setblocking(False); sent = 0; deadline = time.monotonic() + 1\n"
        "while time.monotonic() < deadline:\n"
        "    try:\n"
        "        sent += broker.send(frame * 64)\n"
        "    except BlockingIOError:\n"
        "        time.sleep(0.01)\n"
        "raise Refused(f'the kernel stopped reading after {sent} bytes')"
    )
    async with open_worker_pool(arena.workspace, spare=False) as pool:
        policy = arena.network_policy()
        attacker = await pool.start(str(PLUGINS / "attack.py"), policy=policy, name="attacker")
        bystander = await pool.start(str(PLUGINS / "attack.py"), policy=policy, name="bystander")
        results: list[str] = []
        async with trio.open_nursery() as nursery:

            async def attack() -> None:
                results.append(await attacker.invoke("attack", {"code": flood}))

            nursery.start_soon(attack)
            await trio.sleep(0.3)
            with trio.fail_after(1):
                check = f"socket.create_connection(('127.0.0.1', {arena.allowed_port})); result=1"
                assert await bystander.invoke("attack", {"code": check}) == "ALLOWED: 1"
    [result] = results
    assert result.startswith("denied: refused: the kernel stopped reading after"), result
    sent = int(result.rsplit(" ", 2)[1])
    assert sent < 4 * 1024 * 1024, "the kernel buffered without bound"
    arena.assert_refused(result)


def _approval(*entries: str) -> Approval:
    return Approval.of("attacker", entries)


async def test_resolution_runs_off_the_trio_thread_one_at_a_time(
    autojump_clock: trio.testing.MockClock,
) -> None:
    release, started = threading.Event(), threading.Event()
    calls: list[str] = []

    def hanging_resolver(host: str, port: int) -> list[str]:
        calls.append(host)
        started.set()
        release.wait(10)
        return ["192.0.2.1"]

    broker = Broker(_approval("api.example:443"), hanging_resolver)
    ticks = 0

    async def heartbeat() -> None:
        nonlocal ticks
        while True:
            await trio.sleep(1)
            ticks += 1

    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(heartbeat)
            first, _ = await broker.answer(Resolve("api.example", 443))
            # The first thread is still stuck: the second waits for it, not for a new one.
            second, _ = await broker.answer(Resolve("api.example", 443))
            nursery.cancel_scope.cancel()
        assert started.wait(5)
        assert calls == ["api.example"], "a second resolution thread was started"
    finally:
        release.set()
    assert isinstance(first, Failed) and first.kind == "timeout"
    assert isinstance(second, Failed) and second.kind == "timeout"
    assert ticks >= 15, "the Trio thread was blocked while a name resolved"


async def test_answers_are_bounded_and_unresolved_addresses_stay_refused() -> None:
    many = [f"192.0.2.{i}" for i in range(1, 200)]
    broker = Broker(_approval("api.example:443"), lambda host, port: many)
    answer, _ = await broker.answer(Resolve("api.example", 443))
    assert isinstance(answer, Addresses) and len(answer.addresses) == 16
    # An address the kernel never handed out is not approved by the name.
    refused, fd = await broker.answer(Connect("192.0.2.100", 443, socket.AF_INET))
    assert isinstance(refused, Failed) and refused.errno == errno.EACCES and fd is None
    # One it did hand out, on another port, neither.
    refused, fd = await broker.answer(Connect("192.0.2.1", 80, socket.AF_INET))
    assert isinstance(refused, Failed) and refused.kind == "refused" and fd is None


# --- what is approved still works (checks of the mechanism, not attempts) ----------


@pytest.mark.parametrize(
    "code",
    [
        "s = socket.socket(); s.settimeout(5); s.connect(('127.0.0.1', PORT))\n"
        "result = (s.getpeername(), s.gettimeout())",
        "s = socket.socket(); s.setblocking(False)\n"
        "try:\n    s.connect(('127.0.0.1', PORT))\nexcept BlockingIOError:\n    pass\n"
        "result = (s.getpeername(), s.gettimeout())",
        "s = socket.socket(socket.AF_INET6); s.connect(('::ffff:127.0.0.1', PORT))\n"
        "result = s.getpeername()[:2]",
        "result = socket.socket().connect_ex(('127.0.0.1', PORT))",
        "import http.client\nc = http.client.HTTPConnection('127.0.0.1', PORT, timeout=5)\n"
        "c.connect(); result = c.sock.getpeername()",
        "import trio\n"
        "async def main():\n"
        "    stream = await trio.open_tcp_stream('127.0.0.1', PORT)\n"
        "    async with stream:\n"
        "        return stream.socket.getpeername()\n"
        "result = trio.run(main)",
    ],
)
async def test_kit_approved_connections_work(arena: Arena, code: str) -> None:
    result = await arena.attack(
        code.replace("PORT", str(arena.allowed_port)), policy=arena.network_policy()
    )
    assert result.startswith("ALLOWED: "), result
    assert "127.0.0.1" in result or result == "ALLOWED: 0", result
    for _ in range(40):
        if arena.allowed_tcp.seen:
            break
        await trio.sleep(0.05)
    assert arena.allowed_tcp.seen
    arena.assert_nothing_seen([result])


async def test_kit_approved_names_resolve_in_the_kernel(arena: Arena) -> None:
    result = await arena.attack(
        f"import httpx\nc = socket.create_connection(('localhost', {arena.allowed_port}))\n"
        f"infos = socket.getaddrinfo('localhost', {arena.allowed_port}, socket.AF_INET)\n"
        "result = (c.getpeername()[0], sorted({i[4][0] for i in infos}),"
        " socket.gethostbyname('localhost'))",
        policy=Policy(network=(f"localhost:{arena.allowed_port}",)),
    )
    assert result == "ALLOWED: ('127.0.0.1', ['127.0.0.1'], '127.0.0.1')", result
    arena.assert_nothing_seen([result])


def test_kit_policy_entries_parse() -> None:
    approval = _approval("[::1]:443", "Api.Example.:80", "*.example.net:443", "*:8080")
    assert approval.name_approved("api.example", 80)
    assert approval.name_approved("www.example.net", 443)
    assert not approval.name_approved("example.net", 443)
    assert approval.name_approved("anything", 8080)
    assert not approval.name_approved("api.example", 443)
    assert approval.address_approved(ipaddress.ip_address("::1"), 443, {})
    assert approval.address_approved(ipaddress.ip_address("::ffff:10.0.0.1"), 8080, {})
    assert not approval.address_approved(ipaddress.ip_address("127.0.0.1"), 443, {})
