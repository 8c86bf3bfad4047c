"""Frames between the kernel and a worker: a 4-byte big-endian length, then JSON.

Kernel to worker: ``{"type": "config", ...}`` once (with ``network``, followed by one
byte that carries the worker's end of the broker channel as ``SCM_RIGHTS``: see
``sandbox._netbroker``), then
``{"type": "call", "id": n, "tool": name, "arguments": {...}}``.

Worker to kernel: ``{"type": "ready", "tools": [...], "confinement": {...}}``
or ``{"type": "fatal", "message": ...}`` once, then
``{"type": "result", "id": n, "ok": true, "value": ...}`` or
``{"type": "result", "id": n, "ok": false, "error": {"kind", "type", "message"}}``,
and ``{"type": "log", "level": n, "message": text}`` at any time.

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
from typing import TYPE_CHECKING, Any, Final

import attrs

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


class FrameError(Exception):
    """A frame broke the protocol (too large or too complex, not JSON, not an object)."""


def encode(message: dict[str, Any], limits: FrameLimits = TO_WORKER) -> bytes:
    """Header and body of one frame that the other side will accept.

    Raises:
        FrameError: the encoded body is past ``limits``.
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
            frame = encode({"type": "log", "level": level, "message": text}, FROM_WORKER)
        except FrameError:
            frame = b""
        if HEADER.size < len(frame) <= HEADER.size + MAX_LOG_FRAME:
            return frame
        text = text[: len(text) // 2]


def check_size(length: int, limits: FrameLimits) -> None:
    """Raises FrameError when a body of ``length`` bytes is past ``limits``."""
    if length > limits.max_bytes:
        raise FrameError(
            f"a frame of {length} bytes exceeds the {limits.max_bytes}-byte limit "
            f"({limits.max_bytes // (1024 * 1024)} MiB)"
        )


def check_cost(body: bytes, limits: FrameLimits) -> None:
    """Raises FrameError when ``body`` may hold more values than ``limits`` allow."""
    if limits.max_values is None or len(body) <= COSTLY_BODY:
        return
    values = sum(body.count(mark) for mark in (b"[", b"{", b",", b":"))
    if values > limits.max_values:
        raise FrameError(
            f"a frame of {len(body)} bytes is too complex: up to {values} JSON values, "
            f"the limit is {limits.max_values} in a frame over {COSTLY_BODY} bytes"
        )


def body_length(header: bytes, limits: FrameLimits = TO_WORKER) -> int:
    """The body length a header announces.

    Raises:
        FrameError: it is past ``limits``.
    """
    (length,) = HEADER.unpack(header)
    check_size(length, limits)
    return int(length)


def decode(body: bytes, limits: FrameLimits = TO_WORKER) -> dict[str, Any]:
    """The message in a frame body.

    Raises:
        FrameError: past ``limits``, not JSON (any decoding error: bad UTF-8, too
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
        raise FrameError(f"frame is not JSON: {type(exc).__name__}: {str(exc)[:200]}") from None
    if not isinstance(message, dict) or not isinstance(message.get("type"), str):
        raise FrameError("frame is not an object with a string 'type'")
    return message


def _parse_int(max_digits: int, text: str) -> int:
    # int() is quadratic in the digits: 2 000 integers of 4 300 digits cost 140 ms.
    if len(text) > max_digits and len(text.lstrip("-")) > max_digits:
        raise ValueError(f"an integer of {len(text)} digits (the limit is {max_digits})")
    return int(text)


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
        FrameError: the worker sent descriptors.
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
        raise FrameError(f"the worker sent {len(fds)} file descriptor(s) to the kernel")
    return bytes(data)


def _close_all(fds: list[int]) -> None:
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass


def _ignore(result: object) -> None:
    pass
