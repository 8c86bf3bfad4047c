"""Frames between the kernel and a worker: a 4-byte big-endian length, then JSON.

Each frame is one record below, tagged by ``type`` (``structure_frame`` checks every
field and names the one that is wrong, ``$.tools[0].name: ...``):

- kernel to worker: ``WorkerConfig`` once (with
  ``network``, followed by one byte that carries the worker's end of the broker
  channel as ``SCM_RIGHTS``: see ``sandbox._netbroker``), then ``CallFrame`` records;
- worker to kernel: ``ReadyFrame`` (its ``ToolSpec`` records, what it says about its
  plugin, its confinement) or ``FatalFrame`` once, then ``ResultFrame`` records in
  completion order, and ``LogFrame`` records at any time.

The records have a converter of their own (``converter``): the sandbox imports
nothing of the kernel's records, and nothing registered here leaks into them.

Frames from a worker are hostile, and the kernel decodes them on its Trio thread,
where the C JSON decoder holds the GIL (a thread would not help). So their cost is
bounded before ``json.loads`` runs (``FROM_WORKER``): at most 8 MiB, at most
200 000 values in a frame over 256 KiB (counted from the ``[ { , :`` bytes, an upper
bound that ``bytes.count`` reads at C speed), integers of at most 1 000 digits, log
frames of at most 16 KiB. The worst frame within these costs the kernel about 50 ms
(8 MiB of 1 000-digit integers; 20-40 ms for other shapes) and 45 MB, once. The worker applies the same limits to what it sends, so an honest
plugin whose result is too large or too complex gets ``output_too_large``; a frame
past them from the worker kills it.

Descriptors: neither channel carries one from a worker to the kernel. Receiving
one would close it on the Trio thread when it is discarded, and closing a TCP
socket with ``SO_LINGER`` and a full send queue blocks for the linger time; so the
kernel's ends refuse them (``refuse_descriptors``), and where Linux cannot
(before 6.16) ``receive_some`` takes them, closes them in a thread and kills the
worker.
"""

from __future__ import annotations

import array
import functools
import json
import os
import re
import socket
import struct
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Final, TypeAlias, cast

import attrs
import cattrs
from cattrs.strategies import configure_tagged_union
from cattrs.v import format_exception

from kernel.errors import ProtocolError

if TYPE_CHECKING:
    import trio

HEADER: Final = struct.Struct("!I")


@attrs.frozen
class FrameLimits:
    """What one direction accepts.

    Attributes:
        max_bytes: the largest body; a header announcing more ends the connection.
        max_values: in a body over ``COSTLY_BODY`` bytes, the most ``[ { , :`` bytes
            (``None``: no check).
        max_int_digits: the longest integer (``None``: Python's own limit, 4300).
    """

    max_bytes: int
    max_values: int | None = None
    max_int_digits: int | None = None


#: Kernel to worker: call arguments may be large, and the worker is killable.
TO_WORKER: Final = FrameLimits(32 * 1024 * 1024)
#: Worker to kernel, decoded on the kernel's Trio thread. Tool results reaching a
#: model are cut at ``CallLimits.max_output`` (100 KB by default) anyway.
FROM_WORKER: Final = FrameLimits(8 * 1024 * 1024, max_values=200_000, max_int_digits=1000)
#: The largest frame either side accepts (kernel to worker).
MAX_FRAME: Final = TO_WORKER.max_bytes
#: Bodies up to this size are decoded without counting their values.
COSTLY_BODY: Final = 256 * 1024
#: The largest log frame from a worker.
MAX_LOG_FRAME: Final = 16 * 1024
#: The linux/socket.h option (Linux 6.16+, 83 on x86-64 and aarch64: asm-generic).
SO_PASSRIGHTS: Final = 83
# Room for SCM_MAX_FD descriptors: any that did not fit would be closed by the
# kernel inside recvmsg, on the calling (Trio) thread.
_ANCILLARY: Final = socket.CMSG_SPACE(253 * array.array("i").itemsize)


class WorkerFrameError(ProtocolError):
    """A frame broke the protocol (too large or too complex, not JSON, not an object)."""


def encode(message: dict[str, Any], limits: FrameLimits = TO_WORKER) -> bytes:
    """Header and body of one frame that the other side will accept.

    Raises:
        WorkerFrameError: the encoded body is past ``limits``.
        TypeError, ValueError: ``message`` is not JSON-serializable.
    """
    body = json.dumps(message, ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode(
        "utf-8", errors="surrogatepass"
    )
    check_size(len(body), limits)
    check_cost(body, limits)
    digits = limits.max_int_digits
    if digits is not None and re.search(rb"[0-9]{%d}" % (digits + 1), body):
        decode(body, limits)  # rare: is the long run of digits an integer, or in a string?
    return HEADER.pack(len(body)) + body


def encode_log(level: int, text: str) -> bytes:
    """A log frame of at most ``MAX_LOG_FRAME`` bytes: ``text`` is cut to fit."""
    text = text[:8192]
    while True:
        try:
            frame = encode_frame(LogFrame(level=level, message=text), FROM_WORKER)
        except WorkerFrameError:
            frame = b""
        if HEADER.size < len(frame) <= HEADER.size + MAX_LOG_FRAME:
            return frame
        text = text[: len(text) // 2]


def check_size(length: int, limits: FrameLimits) -> None:
    """Raises WorkerFrameError when a body of ``length`` bytes is past ``limits``."""
    if length > limits.max_bytes:
        raise WorkerFrameError(
            f"a frame of {length} bytes exceeds the {limits.max_bytes}-byte limit "
            f"({limits.max_bytes // (1024 * 1024)} MiB)"
        )


def check_cost(body: bytes, limits: FrameLimits) -> None:
    """Raises WorkerFrameError when ``body`` may hold more values than ``limits`` allow."""
    if limits.max_values is None or len(body) <= COSTLY_BODY:
        return
    values = sum(body.count(mark) for mark in (b"[", b"{", b",", b":"))
    if values > limits.max_values:
        raise WorkerFrameError(
            f"a frame of {len(body)} bytes is too complex: up to {values} JSON values, "
            f"the limit is {limits.max_values} in a frame over {COSTLY_BODY} bytes"
        )


def body_length(header: bytes, limits: FrameLimits = TO_WORKER) -> int:
    """The body length a header announces.

    Raises:
        WorkerFrameError: it is past ``limits``.
    """
    (length,) = HEADER.unpack(header)
    check_size(length, limits)
    return int(length)


def decode(body: bytes, limits: FrameLimits = TO_WORKER) -> dict[str, Any]:
    """The message in a frame body.

    Raises:
        WorkerFrameError: past ``limits``, not JSON (any decoding error: bad UTF-8, too
            deep, an integer too long), or not an object with a string ``type``.
    """
    check_size(len(body), limits)
    check_cost(body, limits)
    parse_int = None
    if limits.max_int_digits is not None:
        parse_int = functools.partial(_parse_int, limits.max_int_digits)
    try:
        message = json.loads(body, parse_int=parse_int)
    except (ValueError, RecursionError) as exc:  # JSONDecodeError, UnicodeDecodeError too
        raise WorkerFrameError(
            f"frame is not JSON: {type(exc).__name__}: {str(exc)[:200]}"
        ) from None
    if not isinstance(message, dict) or not isinstance(message.get("type"), str):
        raise WorkerFrameError("frame is not an object with a string 'type'")
    return message


def _parse_int(max_digits: int, text: str) -> int:
    # int() is quadratic in the digits: 2 000 integers of 4 300 digits cost 140 ms.
    if len(text) > max_digits and len(text.lstrip("-")) > max_digits:
        raise ValueError(f"an integer of {len(text)} digits (the limit is {max_digits})")
    return int(text)


# --- records ---------------------------------------------------------------------


@attrs.frozen(kw_only=True)
class ToolSpec:
    """One tool as a worker's greeting describes it (its function stays in the worker).

    Attributes:
        parameters: the tool's JSON Schema for its arguments.
        timeout: its own deadline in seconds, or ``None``.
        max_output: the most characters of its result, or ``None``.
    """

    name: str
    description: str
    parameters: dict[str, Any]
    is_async: bool = False
    timeout: float | None = None
    exclusive: bool = False
    max_output: int | None = None


@attrs.frozen(kw_only=True)
class CallFrame:
    """Kernel to worker: run ``tool`` with ``arguments`` (a JSON object).

    Attributes:
        id: answered by the ``ResultFrame`` with the same id.
        session: the session key of the caller, or ``None``.
        config: what the worker's host hands the tool along with the call.
    """

    id: int
    tool: str
    arguments: dict[str, Any]
    session: str | None = None
    config: dict[str, Any] = attrs.Factory(dict)


@attrs.frozen(kw_only=True)
class CallError:
    """Why a call failed: ``kind`` (the observation's error kind), the exception's
    ``type`` name, and a ``message`` for people."""

    kind: str
    type: str
    message: str


@attrs.frozen(kw_only=True)
class ResultFrame:
    """Worker to kernel: the ``value`` of call ``id`` (``ok``), or its ``error``."""

    id: int
    ok: bool
    value: Any = None
    error: CallError | None = None

    def __attrs_post_init__(self) -> None:
        if not self.ok and self.error is None:
            raise ValueError("a failed result without an error object")


@attrs.frozen(kw_only=True)
class WorkerConfig:
    """What the pool tells a worker in its first frame (``type: config``).

    Attributes:
        plugin: the code the worker serves (a module name or a path, optionally
            with ``:attribute``); its directory is readable once confined.
        path: directories the worker appends to ``sys.path`` before it loads the
            plugin (where a plugin that is not installed lives).
    """

    plugin: str
    workspace: str
    workspace_access: str = "write"
    tcp_ports: list[int] = attrs.Factory(list)
    network: bool = False
    subprocess: bool = False
    limits: dict[str, int | None] = attrs.Factory(dict)
    landlock: bool = True
    seccomp: bool = True
    require: bool = True
    cgroups: list[str] = attrs.Factory(list)
    kernel_pid: int = 0
    path: list[str] = attrs.Factory(list)
    extra_read: list[str] = attrs.Factory(list)
    env: dict[str, str] = attrs.Factory(dict)

    def to_json(self) -> dict[str, Any]:
        return {"type": "config", **converter.unstructure(self)}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> WorkerConfig:
        """Raises: WorkerFrameError: not a configuration (the field is named by path)."""
        if data.get("type") != "config":
            raise WorkerFrameError(
                f"$.type: expected a config frame, got {str(data.get('type'))[:40]!r}"
            )
        config: WorkerConfig = structure_frame(data, cls)
        return config


@attrs.define
class Confinement:
    """What a worker applied to itself; ``unconfined`` lists what is missing."""

    landlock: str | None = None
    seccomp: str | None = None
    capabilities: str | None = None
    no_new_privs: bool = False
    cgroup: str | None = None
    rlimits: dict[str, int] = attrs.Factory(dict)
    unconfined: list[str] = attrs.Factory(list)
    #: How ``.tak/`` is kept read-only (``sandbox._mounts``), or why it is not.
    protected: str | None = None

    def to_json(self) -> dict[str, Any]:
        return attrs.asdict(self)


@attrs.frozen(kw_only=True)
class ReadyFrame:
    """Worker to kernel, once: it is confined and serves ``tools``.

    Attributes:
        plugin: what the code the worker serves says about itself (opaque here: the
            host that started the worker reads it), or ``None``.
        confinement: what the worker applied to itself.
    """

    pid: int
    tools: list[ToolSpec]
    confinement: Confinement
    plugin: dict[str, Any] | None = None


@attrs.frozen(kw_only=True)
class FatalFrame:
    """Worker to kernel, instead of ``ReadyFrame``: it cannot serve, and why."""

    message: str


@attrs.frozen(kw_only=True)
class LogFrame:
    """Worker to kernel: one record its code logged (``level`` as in ``logging``)."""

    level: int
    message: str


FromWorker: TypeAlias = ReadyFrame | FatalFrame | ResultFrame | LogFrame
"""What a worker sends."""

_TAGS: Final[dict[type, str]] = {
    CallFrame: "call",
    ReadyFrame: "ready",
    FatalFrame: "fatal",
    ResultFrame: "result",
    LogFrame: "log",
}


def strict_converter() -> cattrs.Converter:
    """A new converter that refuses what JSON did not say: unknown keys, ``"3"`` for
    an int, ``true`` for an int (bool is an int in Python), an int for a bool."""
    conv = cattrs.Converter(forbid_extra_keys=True)

    def strict(expected: type) -> Callable[[Any, Any], Any]:
        def hook(value: Any, _: Any) -> Any:
            if type(value) is not expected and not (expected is float and type(value) is int):
                raise TypeError(f"expected {expected.__name__}, got {type(value).__name__}")
            return cast(Any, expected)(value)

        return hook

    for t in (str, int, float, bool):
        conv.register_structure_hook(t, strict(t))

    def json_object(value: Any, _: Any) -> dict[str, Any]:
        if not isinstance(value, dict):
            raise TypeError(f"expected an object, got {type(value).__name__}")
        return value

    conv.register_structure_hook_func(lambda t: t == dict[str, Any], json_object)
    return conv


converter: Final = strict_converter()
"""Structures and unstructures the frame records; private to the worker protocol."""

#: Whether ``converter`` knows the ``FromWorker`` union yet. Only the kernel reads that
#: union, so it is taught on first use: the code cattrs generates for it would cost
#: every worker's start a few milliseconds for nothing.
_from_worker_ready = False


def _union_converter() -> cattrs.Converter:
    global _from_worker_ready
    if not _from_worker_ready:
        tag_of = _TAGS.__getitem__
        configure_tagged_union(FromWorker, converter, tag_name="type", tag_generator=tag_of)
        _from_worker_ready = True
    return converter


def structure_error(exc: BaseException, root: str = "$") -> str:
    """A cattrs failure as one line: ``$.tools[0].name: expected str, got int; ...``."""
    if not isinstance(exc, cattrs.BaseValidationError):
        return f"{root}: {exc}"
    parts = []
    for line in cattrs.transform_error(exc, path=root, format_exception=_reason):
        reason, sep, path = line.rpartition(" @ ")
        parts.append(f"{path}: {reason}" if sep else line)
    return "; ".join(parts)


def _reason(exc: BaseException, type_: type | None) -> str:
    # A record's own check (``ResultFrame``) says best what is wrong.
    if type(exc) is ValueError and str(exc):
        return str(exc)
    return format_exception(exc, type_)


def unstructure_frame(frame: CallFrame | FromWorker | Any) -> dict[str, Any]:
    """The JSON object of a frame record, with its ``type`` tag first."""
    if isinstance(frame, ResultFrame):
        # The value is JSON already: no walk over (and copy of) a large result.
        result: dict[str, Any] = {"type": "result", "id": frame.id, "ok": frame.ok}
        if frame.error is None:
            result["value"] = frame.value
        else:
            result["error"] = attrs.asdict(frame.error)
        return result
    body = converter.unstructure(frame)
    if type(frame) in _TAGS:
        body.pop("type", None)
        return {"type": _TAGS[type(frame)], **body}
    return cast(dict[str, Any], body)


def encode_frame(frame: Any, limits: FrameLimits = TO_WORKER) -> bytes:
    """``encode`` of a frame record.

    Raises:
        WorkerFrameError: the encoded body is past ``limits``.
        TypeError, ValueError: a value in it is not JSON-serializable.
    """
    return encode(unstructure_frame(frame), limits)


def structure_frame(message: dict[str, Any], kind: Any) -> Any:
    """The record of ``kind`` (a frame class or ``FromWorker``) a decoded frame holds.

    Raises:
        WorkerFrameError: a field is missing, unknown or of the wrong type; the message
            names it by path (``$.tools[0].name``).
    """
    tag = message.get("type")
    conv = converter
    if kind is not FromWorker:
        message = {k: v for k, v in message.items() if k != "type"}
    elif tag not in _TAGS.values() or tag == "call":
        raise WorkerFrameError(f"$.type: unexpected frame type {str(tag)[:40]!r}")
    else:
        conv = _union_converter()
    try:
        return conv.structure(message, kind)
    except (cattrs.BaseValidationError, TypeError, ValueError, KeyError) as exc:
        raise WorkerFrameError(f"malformed {str(tag)[:40]} frame: {structure_error(exc)}") from None


# --- descriptors ------------------------------------------------------------------


def refuse_descriptors(sock: socket.socket) -> bool:
    """Make Linux refuse descriptors sent to ``sock``: the sender's ``sendmsg`` fails.

    Returns False where this Linux lacks ``SO_PASSRIGHTS`` (before 6.16); then read
    the socket with ``receive_some(..., refused=False)``.
    """
    try:
        sock.setsockopt(socket.SOL_SOCKET, SO_PASSRIGHTS, 0)
    except OSError:
        return False
    return True


async def receive_some(sock: trio.socket.SocketType, max_bytes: int, *, refused: bool) -> bytes:
    """Up to ``max_bytes`` from a worker (``b""`` at the end), never taking a descriptor.

    ``refused``: what ``refuse_descriptors`` returned for this socket. When it is
    False, descriptors are received (with room for the most one message carries)
    and closed in a thread: never on the Trio thread, where a lingering socket's
    close would block the kernel.

    Raises:
        WorkerFrameError: the worker sent descriptors.
        OSError: the socket failed.
    """
    if refused:
        return await sock.recv(max_bytes)
    data, ancillary, flags, _ = await sock.recvmsg(max_bytes, _ANCILLARY, socket.MSG_CMSG_CLOEXEC)
    fds = array.array("i")
    for level, kind, payload in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(payload[: len(payload) - len(payload) % fds.itemsize])
    if fds or flags & socket.MSG_CTRUNC:
        import trio

        trio.lowlevel.start_thread_soon(functools.partial(_close_all, list(fds)), _ignore)
        raise WorkerFrameError(f"the worker sent {len(fds)} file descriptor(s) to the kernel")
    return bytes(data)


def _close_all(fds: list[int]) -> None:
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass


def _ignore(result: object) -> None:
    pass
