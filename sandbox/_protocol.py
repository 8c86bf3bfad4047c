"""Frames between the kernel and a worker: a 4-byte big-endian length, then JSON.

Kernel to worker: ``{"type": "config", ...}`` once (with ``network``, followed by one
byte that carries the worker's end of the broker channel as ``SCM_RIGHTS``: see
``sandbox._netbroker``), then
``{"type": "call", "id": n, "tool": name, "arguments": {...}}``.

Worker to kernel: ``{"type": "ready", "tools": [...], "confinement": {...}}``
or ``{"type": "fatal", "message": ...}`` once, then
``{"type": "result", "id": n, "ok": true, "value": ...}`` or
``{"type": "result", "id": n, "ok": false, "error": {"kind", "type", "message"}}``.
"""

from __future__ import annotations

import json
import struct
from typing import Any, Final

HEADER: Final = struct.Struct("!I")
#: The largest frame either side accepts; a bigger one ends the connection.
MAX_FRAME: Final = 32 * 1024 * 1024


class FrameError(Exception):
    """A frame broke the protocol (too large, not JSON, not an object)."""


def encode(message: dict[str, Any]) -> bytes:
    """Header and body of one frame.

    Raises:
        FrameError: the encoded body is larger than ``MAX_FRAME``.
        TypeError, ValueError: ``message`` is not JSON-serializable.
    """
    body = json.dumps(message, ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode(
        "utf-8", errors="surrogatepass"
    )
    if len(body) > MAX_FRAME:
        raise FrameError(f"frame of {len(body)} bytes exceeds the {MAX_FRAME}-byte limit")
    return HEADER.pack(len(body)) + body


def body_length(header: bytes) -> int:
    """The body length a header announces.

    Raises:
        FrameError: it is larger than ``MAX_FRAME``.
    """
    (length,) = HEADER.unpack(header)
    if length > MAX_FRAME:
        raise FrameError(f"peer announced a {length}-byte frame; the limit is {MAX_FRAME}")
    return int(length)


def decode(body: bytes) -> dict[str, Any]:
    """The message in a frame body.

    Raises:
        FrameError: not JSON, or not an object with a string ``type``.
    """
    try:
        message = json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        raise FrameError(f"frame is not JSON: {exc}") from None
    if not isinstance(message, dict) or not isinstance(message.get("type"), str):
        raise FrameError("frame is not an object with a string 'type'")
    return message
