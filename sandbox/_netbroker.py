"""Network access through the kernel: names are resolved and connections made there.

A worker whose plugin may use the network never resolves a name and never
calls ``connect()`` itself (its seccomp filter refuses the system call). It
asks the kernel over a socket pair of its own, the *broker channel*:

- ``resolve host port``: the kernel checks that ``host:port`` is approved (the
  exact name, a ``*.suffix`` entry, or a ``*:port`` entry), resolves it in a
  thread, remembers which addresses it handed out for which ports, and answers
  with at most ``MAX_ADDRESSES`` numeric addresses;
- ``connect address port family``: the kernel checks that the address is
  approved (an IP literal of the policy, an address it resolved for an approved
  name on that port, or any address for a ``*:port`` entry), connects, and
  sends the connected socket back with ``SCM_RIGHTS``; the worker puts it in
  place of its own socket's descriptor (``dup2``), so the caller's socket
  object, its timeout and its blocking mode stay as they were.

Guarantees (each test in ``tests/security/test_network_broker.py`` names the
one it checks):

1. A worker reaches only approved ``host:port`` pairs: the decision is the
   kernel's, made on the address actually connected to (an IPv4-mapped IPv6
   address counts as its IPv4 address; ``::1`` is not ``127.0.0.1``).
2. No DNS in the worker: it has no resolver files (``/etc/resolv.conf``,
   ``/etc/hosts``...) and no datagram sockets; names it may use are resolved
   by the kernel, and only those.
3. The kernel never blocks on a worker: resolution runs in a thread (one per
   worker at a time, abandoned after ``RESOLVE_TIMEOUT_S``), connections are
   Trio's, under a deadline.
4. A worker cannot make the kernel hold more for it than one request at a
   time: requests are read one by one and answered before the next is read;
   frames are at most ``MAX_FRAME`` bytes; answers that the worker does not
   read fill a small socket buffer and then stop the kernel reading its
   requests; a malformed request kills the worker.
5. The kernel never takes a descriptor from a worker, on this channel or the call
   channel: its ends refuse them (``SO_PASSRIGHTS`` 0), or, before Linux 6.16,
   receive them with room for all, close them in a thread and kill the worker.

Why a channel of its own rather than frames on the worker's call channel:
answers carry descriptors, which must be received with ``recvmsg`` by the
thread that asked, while the call channel is read by the worker's main loop.
The spare worker process is started before anyone knows whether it will get
the network, so its end of the broker channel is sent to it over the call
channel (``SCM_RIGHTS``) right after its configuration, and only when the
configuration says ``network``.

The worker side (``receive_channel``, ``install``) runs in ``sandbox.worker.start``
and never imports Trio; the kernel side (``start``, ``Broker``) runs in the pool.
"""

from __future__ import annotations

import array
import errno
import ipaddress
import logging
import os
import socket
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any, Final, Literal, TypeAlias

import attrs
import cattrs
from cattrs.strategies import configure_tagged_union

from kernel.errors import ProtocolError

from . import _protocol

if TYPE_CHECKING:
    import trio

logger = logging.getLogger("sandbox.netbroker")

#: The largest request or answer frame (a header announcing more kills the worker).
MAX_FRAME: Final = 4096
#: The most addresses one resolution answers with.
MAX_ADDRESSES: Final = 16
#: The most resolved addresses the kernel remembers per worker (oldest forgotten first).
MAX_REMEMBERED: Final = 1024
#: How long a name may take to resolve.
RESOLVE_TIMEOUT_S: Final = 10.0
#: The longest connect; a socket with a shorter timeout gets its own.
CONNECT_TIMEOUT_S: Final = 30.0
#: The kernel end's send buffer: answers a worker leaves unread stop the kernel here.
_SEND_BUFFER: Final = 16 * 1024
#: The byte that carries the worker's end of the broker channel over the call channel.
_HANDOVER: Final = b"B"

IPAddress: TypeAlias = ipaddress.IPv4Address | ipaddress.IPv6Address
#: ``resolver(host, port)``: the numeric addresses of ``host``; blocking, run in a thread.
Resolver: TypeAlias = Callable[[str, int], Sequence[str]]


# --- records ------------------------------------------------------------------------


@attrs.frozen
class Resolve:
    """Worker to kernel: the addresses of ``host`` (``port`` 0: for any approved port)."""

    host: str
    port: int


@attrs.frozen
class Connect:
    """Worker to kernel: a ``family`` stream socket connected to ``address:port``."""

    address: str
    port: int
    family: int
    timeout: float | None = None


Request: TypeAlias = Resolve | Connect


@attrs.frozen
class Addresses:
    """Kernel to worker: numeric addresses of the name asked for."""

    addresses: tuple[str, ...]


@attrs.frozen
class Connected:
    """Kernel to worker: the connected socket is in this frame's ancillary data."""


@attrs.frozen
class Failed:
    """Kernel to worker: no. ``kind`` says which exception the worker raises.

    ``refused``: ``PermissionError`` (connect) or ``gaierror`` (resolve), not
    approved; ``no_name``: ``gaierror``, the name does not resolve; ``timeout``:
    ``TimeoutError``; ``os``: ``OSError(errno)`` from the kernel's connect.
    """

    kind: Literal["refused", "no_name", "timeout", "os"]
    errno: int
    message: str


Answer: TypeAlias = Addresses | Connected | Failed

_TAGS: Final[dict[type, str]] = {
    Resolve: "resolve",
    Connect: "connect",
    Addresses: "addresses",
    Connected: "connected",
    Failed: "failed",
}


def _make_converter() -> cattrs.Converter:
    conv = _protocol.strict_converter()
    configure_tagged_union(Request, conv, tag_name="type", tag_generator=_TAGS.__getitem__)
    configure_tagged_union(Answer, conv, tag_name="type", tag_generator=_TAGS.__getitem__)
    return conv


_converter: Final = _make_converter()


class BrokerError(ProtocolError):
    """A frame on the broker channel broke its protocol."""


def encode(message: Request | Answer) -> bytes:
    """One frame: the header of ``sandbox._protocol``, then the JSON body.

    Raises:
        BrokerError: the body is larger than ``MAX_FRAME``.
    """
    union: Any = Request if isinstance(message, Resolve | Connect) else Answer
    frame = _protocol.encode(_converter.unstructure(message, union))
    if len(frame) - _protocol.HEADER.size > MAX_FRAME:
        raise BrokerError(f"a {len(frame)}-byte broker frame exceeds {MAX_FRAME} bytes")
    return frame


def body_length(header: bytes) -> int:
    """The body length a header announces.

    Raises:
        BrokerError: more than ``MAX_FRAME``.
    """
    (length,) = _protocol.HEADER.unpack(header)
    if length > MAX_FRAME:
        raise BrokerError(f"a broker frame announced {length} bytes; the limit is {MAX_FRAME}")
    return int(length)


def decode(body: bytes, union: Any) -> Any:
    """The ``Request`` or ``Answer`` in a frame body.

    Raises:
        BrokerError: not JSON, or not a record of ``union``.
    """
    try:
        return _converter.structure(_protocol.decode(body), union)
    except (_protocol.WorkerFrameError, cattrs.BaseValidationError, TypeError, ValueError) as exc:
        raise BrokerError(f"malformed broker frame: {exc}") from None


# --- the decision -------------------------------------------------------------------


def _split_entry(entry: str) -> tuple[str, int]:
    host, _, port = entry.rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    return host.lower().rstrip("."), int(port)


def _ip(text: str) -> IPAddress | None:
    """``text`` as an address (an IPv4-mapped IPv6 address as its IPv4 one), else None."""
    try:
        address = ipaddress.ip_address(text)
    except ValueError:
        return None
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped
    return address


def _endpoint(address: str, port: int) -> str:
    return f"[{address}]:{port}" if ":" in address else f"{address}:{port}"


@attrs.frozen
class Approval:
    """What one plugin's network permission approves, parsed once.

    Attributes:
        plugin: the plugin's name, for messages.
        entries: the permission as declared (``host:port``, ``*:port``, ``*.suffix:port``).
    """

    plugin: str
    entries: tuple[str, ...]
    _any_host: frozenset[int]
    _addresses: frozenset[tuple[IPAddress, int]]
    _names: tuple[tuple[str, int], ...]

    @classmethod
    def of(cls, plugin: str, entries: Iterable[str]) -> Approval:
        """Parse ``Policy.network`` entries (already checked by ``Policy``)."""
        entries = tuple(entries)
        any_host: set[int] = set()
        addresses: set[tuple[IPAddress, int]] = set()
        names: list[tuple[str, int]] = []
        for entry in entries:
            host, port = _split_entry(entry)
            address = _ip(host)
            if host == "*":
                any_host.add(port)
            elif address is not None:
                addresses.add((address, port))
            else:
                names.append((host, port))
        return cls(plugin, entries, frozenset(any_host), frozenset(addresses), tuple(names))

    def ports_of_name(self, host: str) -> frozenset[int]:
        """The ports approved for the name ``host`` by name (exact or ``*.suffix``)."""
        host = host.lower().rstrip(".")
        ports = set()
        for pattern, port in self._names:
            if pattern == host or (
                pattern.startswith("*.") and host.endswith(pattern[1:]) and host != pattern[2:]
            ):
                ports.add(port)
        return frozenset(ports)

    def name_approved(self, host: str, port: int) -> bool:
        """Whether the worker may resolve ``host`` to connect on ``port`` (0: any port)."""
        ports = self.ports_of_name(host) | self._any_host
        return bool(ports) if port == 0 else port in ports

    def address_approved(
        self, address: IPAddress, port: int, resolved: dict[IPAddress, frozenset[int]]
    ) -> bool:
        """Whether ``address:port`` may be connected to, given what was resolved."""
        return (
            port in self._any_host
            or (address, port) in self._addresses
            or port in resolved.get(address, frozenset())
        )

    def refusal(self, what: str) -> str:
        listed = ", ".join(self.entries) or "nothing"
        return f"{what} is not approved for plugin {self.plugin} (approved: {listed})"[:1024]


# --- the kernel side ----------------------------------------------------------------


def resolve_with_system(host: str, port: int) -> list[str]:
    """The system resolver (blocking): ``host``'s stream addresses, in its order.

    Raises:
        socket.gaierror: the name does not resolve.
    """
    found: list[str] = []
    for family, _, _, _, sockaddr in socket.getaddrinfo(host, port or None, 0, socket.SOCK_STREAM):
        if family in (socket.AF_INET, socket.AF_INET6) and sockaddr[0] not in found:
            found.append(str(sockaddr[0]))
    return found


class Broker:
    """The kernel's side of one worker's broker channel."""

    def __init__(self, approval: Approval, resolver: Resolver = resolve_with_system) -> None:
        import trio

        self.approval = approval
        self._resolver = resolver
        # Addresses handed out for approved names, and the ports approved for them.
        self._resolved: OrderedDict[IPAddress, frozenset[int]] = OrderedDict()
        # One resolution at a time per worker, even once abandoned after its deadline:
        # a worker cannot tie up more than one thread of the kernel.
        self._limiter = trio.CapacityLimiter(1)

    async def answer(self, request: Request) -> tuple[Answer, int | None]:
        """The answer to ``request``, and the connected descriptor it carries (if any)."""
        if isinstance(request, Resolve):
            return await self._resolve(request), None
        return await self._connect(request)

    async def _resolve(self, request: Resolve) -> Answer:
        import trio

        host, port = request.host, request.port
        if not 0 <= port < 65536 or not _plausible_name(host):
            return Failed("refused", socket.EAI_NONAME, f"{host[:80]!r} is not a host name")
        if _ip(host) is not None:
            return Addresses((host,))  # nothing to look up; connect decides
        if not self.approval.name_approved(host, port):
            what = f"name {host}:{port}" if port else f"name {host}"
            return Failed("refused", socket.EAI_NONAME, self.approval.refusal(what))
        found: Sequence[str] | None = None
        try:
            with trio.move_on_after(RESOLVE_TIMEOUT_S):
                found = await trio.to_thread.run_sync(
                    self._resolver, host, port, abandon_on_cancel=True, limiter=self._limiter
                )
        except OSError as exc:
            code = exc.errno if isinstance(exc, socket.gaierror) and exc.errno else -2
            return Failed("no_name", code, f"{host}: {exc.strerror or exc}")
        except (UnicodeError, ValueError) as exc:  # a label the IDNA codec refuses
            return Failed("no_name", socket.EAI_NONAME, f"{host}: {exc}")
        if found is None:
            return Failed("timeout", socket.EAI_AGAIN, f"{host}: no answer within the deadline")
        addresses: list[str] = []
        ports = self.approval.ports_of_name(host)
        for text in found:
            address = _ip(text)
            if address is None or text in addresses:
                continue
            addresses.append(text)
            if ports:
                self._remember(address, ports)
            if len(addresses) == MAX_ADDRESSES:
                break
        if not addresses:
            return Failed("no_name", socket.EAI_NONAME, f"{host}: no address")
        return Addresses(tuple(addresses))

    def _remember(self, address: IPAddress, ports: frozenset[int]) -> None:
        self._resolved[address] = self._resolved.get(address, frozenset()) | ports
        self._resolved.move_to_end(address)
        while len(self._resolved) > MAX_REMEMBERED:
            self._resolved.popitem(last=False)

    async def _connect(self, request: Connect) -> tuple[Answer, int | None]:
        import trio

        family, port = request.family, request.port
        address = _ip(request.address)
        text = _endpoint(request.address[:64], port)
        if family not in (socket.AF_INET, socket.AF_INET6) or address is None:
            return Failed("os", errno.EAFNOSUPPORT, f"connect to {text}: not an IP address"), None
        if (family == socket.AF_INET) != (ipaddress.ip_address(request.address).version == 4):
            return Failed("os", errno.EAFNOSUPPORT, f"connect to {text}: wrong family"), None
        if not 0 < port < 65536 or not self.approval.address_approved(
            address, port, self._resolved
        ):
            return Failed(
                "refused", errno.EACCES, self.approval.refusal(f"connect to {text}")
            ), None
        timeout = CONNECT_TIMEOUT_S
        if request.timeout is not None and 0 < request.timeout < CONNECT_TIMEOUT_S:
            timeout = request.timeout  # NaN and infinity fail the test: the default
        sock = trio.socket.socket(family, socket.SOCK_STREAM)
        try:
            target: tuple[Any, ...] = (request.address, port)
            if family == socket.AF_INET6:
                target = (request.address, port, 0, 0)
            with trio.move_on_after(timeout):
                await sock.connect(target)
                return Connected(), sock.detach()
            return Failed("timeout", errno.ETIMEDOUT, f"connect to {text}: timed out"), None
        except OSError as exc:
            code = exc.errno or errno.ECONNREFUSED
            return Failed("os", code, f"connect to {text}: {os.strerror(code)}"), None
        finally:
            sock.close()  # after detach() this closes nothing

    async def serve(
        self,
        sock: trio.socket.SocketType,
        kill: Callable[[str], None],
        *,
        descriptors_refused: bool = True,
    ) -> None:
        """Answer requests one at a time until the worker closes its end.

        ``descriptors_refused``: whether ``_protocol.refuse_descriptors`` held for
        ``sock``. A malformed request, or a descriptor sent to the kernel, kills
        the worker (``kill(reason)``); nothing raises.
        """

        async def receive(n: int) -> bytes | None:
            return await _receive_exactly(sock, n, refused=descriptors_refused)

        try:
            while True:
                header = await receive(_protocol.HEADER.size)
                if header is None:
                    return
                body = await receive(body_length(header))
                if body is None:
                    return
                request = decode(body, Request)
                answer, fd = await self.answer(request)
                try:
                    await _send_frame(sock, encode(answer), fd)
                finally:
                    if fd is not None:
                        os.close(fd)
        except (BrokerError, _protocol.WorkerFrameError) as exc:
            kill(f"broke the network broker protocol ({exc})")
        except OSError:
            return  # the worker is gone
        except Exception as exc:  # a bug here must cost the worker, never the pool
            logger.exception("network broker for plugin %s failed", self.approval.plugin)
            kill(f"its network broker failed ({type(exc).__name__})")


def _plausible_name(host: str) -> bool:
    return 0 < len(host) <= 253 and host.isascii() and host.isprintable() and " " not in host


async def _send_frame(sock: trio.socket.SocketType, frame: bytes, fd: int | None) -> None:
    """All of ``frame``; ``fd`` travels with its first byte."""
    ancillary = []
    if fd is not None:
        ancillary = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [fd]))]
    sent = await sock.sendmsg([frame], ancillary)
    while sent < len(frame):
        sent += await sock.sendmsg([frame[sent:]])


async def _receive_exactly(sock: trio.socket.SocketType, n: int, *, refused: bool) -> bytes | None:
    """``n`` bytes, or None at end of stream (a frame cut short is an end too).

    Raises:
        FrameError: the worker sent a descriptor (see ``_protocol.receive_some``).
    """
    buffer = bytearray()
    while len(buffer) < n:
        chunk = await _protocol.receive_some(sock, n - len(buffer), refused=refused)
        if not chunk:
            return None
        buffer += chunk
    return bytes(buffer)


async def start(
    nursery: trio.Nursery,
    channel: trio.SocketStream,
    approval: Approval,
    *,
    finished: trio.Event,
    kill: Callable[[str], None],
    resolver: Resolver = resolve_with_system,
) -> None:
    """Give a worker its broker channel over its call ``channel`` and serve it in ``nursery``.

    The service ends when the worker closes its end or when ``finished`` is set
    (the worker was reaped).

    Raises:
        OSError: the worker's call channel is broken (it died).
    """
    import trio

    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    # A descriptor sent to the kernel would be closed on its Trio thread, and a
    # lingering TCP socket's close blocks: refuse them (see sandbox._protocol).
    refused = _protocol.refuse_descriptors(ours)
    try:
        ours.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, _SEND_BUFFER)
        fds = array.array("i", [theirs.fileno()])
        await channel.socket.sendmsg([_HANDOVER], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, fds)])
    except BaseException:
        ours.close()
        raise
    finally:
        theirs.close()
    sock = trio.socket.from_stdlib_socket(ours)
    broker = Broker(approval, resolver)

    async def serve_until_finished() -> None:
        with sock:
            async with trio.open_nursery() as inner:

                async def stop() -> None:
                    await finished.wait()
                    inner.cancel_scope.cancel()

                inner.start_soon(stop)
                await broker.serve(sock, kill, descriptors_refused=refused)
                inner.cancel_scope.cancel()

    nursery.start_soon(serve_until_finished)


# --- the worker side ----------------------------------------------------------------


def receive_channel(channel: socket.socket) -> socket.socket:
    """The broker channel's worker end, sent by the kernel after the configuration.

    Raises:
        EOFError: the kernel closed the channel, or sent something else.
    """
    data, fds, _, _ = socket.recv_fds(channel, 1, 1, socket.MSG_CMSG_CLOEXEC)
    if data != _HANDOVER or len(fds) != 1:
        for fd in fds:
            os.close(fd)
        raise EOFError("no broker channel after the configuration")
    return socket.socket(fileno=fds[0])


class _Client:
    """The worker's end: one request at a time, whichever thread asks."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        self._lock = threading.Lock()

    def ask(self, request: Request) -> tuple[Answer, int | None]:
        """The kernel's answer, and the descriptor that came with it.

        Raises:
            OSError: the channel is closed (the kernel is gone) or broke its protocol.
        """
        with self._lock:
            self._sock.sendall(encode(request))
            fds: list[int] = []
            header = self._receive(_protocol.HEADER.size, fds)
            try:
                body = self._receive(body_length(header), fds)
                answer = decode(body, Answer)
            except BrokerError as exc:
                for fd in fds:
                    os.close(fd)
                raise OSError(errno.EPROTO, f"network broker: {exc}") from None
        if len(fds) > 1 or (fds and not isinstance(answer, Connected)):
            for fd in fds:
                os.close(fd)
            raise OSError(errno.EPROTO, "network broker: unexpected descriptors")
        return answer, (fds[0] if fds else None)

    def _receive(self, n: int, fds: list[int]) -> bytes:
        buffer = bytearray()
        while len(buffer) < n:
            data, received, _, _ = socket.recv_fds(
                self._sock, n - len(buffer), 1, socket.MSG_CMSG_CLOEXEC
            )
            fds.extend(received)
            if not data:
                for fd in fds:
                    os.close(fd)
                raise OSError(errno.ECONNRESET, "network broker: the kernel closed the channel")
            buffer += data
        return bytes(buffer)


_real_getaddrinfo = socket.getaddrinfo
_real_connect = socket.socket.connect
_installed: _Client | None = None


def install(sock: socket.socket) -> None:
    """Route this process's name lookups and stream connects through the broker.

    Patches ``socket.getaddrinfo``, ``gethostbyname``, ``gethostbyname_ex`` and
    ``socket.socket.connect``/``connect_ex``: the standard library, Trio, httpx and
    urllib all go through them. Code that bypasses them (``_socket``, ctypes, a raw
    system call) meets the seccomp filter, which refuses ``connect`` and datagrams.
    """
    global _installed
    _installed = _Client(sock)
    socket.getaddrinfo = _getaddrinfo
    socket.gethostbyname = _gethostbyname
    socket.gethostbyname_ex = _gethostbyname_ex
    socket.socket.connect = _connect  # type: ignore[method-assign,assignment]
    socket.socket.connect_ex = _connect_ex  # type: ignore[method-assign,assignment]


def _client() -> _Client:
    if _installed is None:
        raise OSError(errno.EACCES, "no network broker in this process")
    return _installed


def _port_number(port: Any) -> int:
    if port is None:
        return 0
    if isinstance(port, bytes):
        port = port.decode("ascii")
    if isinstance(port, str):
        if port.isdigit():
            return int(port)
        return socket.getservbyname(port, "tcp")  # /etc/services stays readable
    if isinstance(port, int) and not isinstance(port, bool):
        return port
    raise TypeError(f"port must be an int, a str or None, not {type(port).__name__}")


def _getaddrinfo(
    host: Any, port: Any, family: int = 0, type: int = 0, proto: int = 0, flags: int = 0
) -> list[tuple[Any, ...]]:
    try:
        return _real_getaddrinfo(host, port, family, type, proto, flags | socket.AI_NUMERICHOST)
    except socket.gaierror as exc:
        # Only a name that is not numeric goes to the kernel.
        if exc.errno != socket.EAI_NONAME or flags & socket.AI_NUMERICHOST or host is None:
            raise
    try:
        name = host.decode("ascii") if isinstance(host, bytes) else host.encode("idna").decode()
    except (UnicodeError, AttributeError):
        raise socket.gaierror(socket.EAI_NONAME, f"{host!r} is not a host name") from None
    answer, _ = _client().ask(Resolve(name, _port_number(port)))
    if isinstance(answer, Failed):
        if answer.kind == "timeout":
            raise socket.gaierror(socket.EAI_AGAIN, answer.message)
        raise socket.gaierror(
            answer.errno if answer.errno < 0 else socket.EAI_NONAME, answer.message
        )
    if not isinstance(answer, Addresses):
        raise socket.gaierror(socket.EAI_FAIL, "network broker: unexpected answer")
    found: list[tuple[Any, ...]] = []
    for address in answer.addresses:
        try:
            found += _real_getaddrinfo(
                address, port, family, type, proto, flags | socket.AI_NUMERICHOST
            )
        except socket.gaierror:
            continue  # another family than the caller asked for
    if not found:
        raise socket.gaierror(socket.EAI_ADDRFAMILY, f"{name}: no address of the family asked for")
    return found


def _gethostbyname(host: str) -> str:
    return str(_getaddrinfo(host, None, socket.AF_INET, socket.SOCK_STREAM)[0][4][0])


def _gethostbyname_ex(host: str) -> tuple[str, list[str], list[str]]:
    infos = _getaddrinfo(host, None, socket.AF_INET, socket.SOCK_STREAM)
    return host, [], list(dict.fromkeys(str(info[4][0]) for info in infos))


def _connect(self: socket.socket, address: Any) -> None:
    if self.family not in (socket.AF_INET, socket.AF_INET6) or self.type != socket.SOCK_STREAM:
        _real_connect(self, address)  # not the broker's: the seccomp filter decides
        return
    import sys

    sys.audit("socket.connect", self, address)  # what the worker's denial messages read
    if not isinstance(address, tuple) or not 2 <= len(address) <= 4:
        raise TypeError(f"connect(): an address tuple is required, got {address!r}")
    host, port = address[0], address[1]
    if not isinstance(port, int) or isinstance(port, bool) or not 0 <= port < 65536:
        raise OverflowError("connect(): port must be 0-65535.")
    # Numeric or not, the address as the kernel will see it: one of this family.
    [(_, _, _, _, sockaddr), *_] = _getaddrinfo(host, port, self.family, socket.SOCK_STREAM)
    try:
        self.getpeername()
    except OSError:
        pass
    else:
        raise OSError(errno.EISCONN, os.strerror(errno.EISCONN))
    timeout = self.gettimeout()
    answer, fd = _client().ask(Connect(str(sockaddr[0]), port, self.family, timeout))
    if isinstance(answer, Connected) and fd is not None:
        try:
            os.dup2(fd, self.fileno(), inheritable=False)
        finally:
            os.close(fd)
        self.settimeout(timeout)  # the new descriptor's blocking mode, as the caller set it
        return
    if not isinstance(answer, Failed):
        raise OSError(errno.EPROTO, "network broker: unexpected answer")
    if answer.kind == "refused":
        raise PermissionError(errno.EACCES, answer.message)
    if answer.kind == "timeout":
        raise TimeoutError(errno.ETIMEDOUT, answer.message)
    raise OSError(answer.errno, answer.message)


def _connect_ex(self: socket.socket, address: Any) -> int:
    try:
        _connect(self, address)
    except socket.gaierror:
        raise  # as the real connect_ex does: a name that does not resolve raises
    except OSError as exc:
        return exc.errno or errno.EIO
    return 0
