"""Frames to JSON text and back: ``encode``, ``decode_request``, ``decode_server_frame``.

The server's frames are always strict JSON in ASCII (what JSON cannot carry
is replaced, as ``JSON.stringify`` does); a client's frame is refused, with
the ``FrameError`` the server sends back, when it is not JSON, not a request
of this protocol version, nested too deep, or holds what cannot be recorded
(a lone surrogate, a non-finite number): the kernel records a request before
it acts on it.
"""

from __future__ import annotations

import functools
import json
import math
import re
from collections.abc import Callable
from typing import Any

from ..errors import ProtocolError
from ..messages import describe_structure_error, json_problem, replace_lone_surrogates
from ._frames import (
    MAX_ID_LENGTH,
    PROTOCOL_VERSION,
    REQUEST_CLASSES,
    REQUEST_TYPES,
    SERVER_TAGS,
    FrameError,
    Request,
    ServerFrame,
    wire_converter,
)


def encode(frame: Request | ServerFrame) -> str:
    """The JSON text of a frame, ``v`` and ``type`` first: always valid JSON in ASCII.

    Non-ASCII text is escaped (``\\uXXXX``). What JSON cannot carry is
    replaced rather than sent or raised, as ``JSON.stringify`` does: a lone
    surrogate becomes U+FFFD, a NaN or infinite float ``null``. Clean input
    never has them (``decode_request`` refuses them), but a tool's or a
    model's output might.
    """
    return _to_json(_body(frame))


def encode_numbered(frame: ServerFrame, seq: int) -> str:
    """``encode(attrs.evolve(frame, seq=seq))``, without building the copy: the server
    numbers every frame it sends."""
    body = _body(frame)
    # Server frames always carry "seq" (never omitted): assigning keeps its place.
    body["seq"] = seq
    return _to_json(body)


def _body(frame: Request | ServerFrame) -> dict[str, Any]:
    """The frame as a dict, ``v`` and ``type`` first, then its fields in their order."""
    cls = type(frame)
    hook = _HOOKS.get(cls)
    if hook is None:
        # The class's own hook, as the tagged unions call it (they add "type" after).
        hook = _HOOKS[cls] = wire_converter.get_unstructure_hook(cls)
    body: dict[str, Any] = hook(frame)
    return {"v": body.pop("v"), "type": _TAGS[cls], **body}


_TAGS: dict[type, str] = {**REQUEST_TYPES, **SERVER_TAGS}
_HOOKS: dict[type, Callable[[Any], dict[str, Any]]] = {}
# One encoder for every frame: json.dumps with options builds a new one per call.
_ENCODER = json.JSONEncoder(separators=(",", ":"), allow_nan=False)


def _to_json(value: dict[str, Any]) -> str:
    try:
        text = _ENCODER.encode(value)
    except ValueError:
        text = None
    # ensure_ascii writes a surrogate as a lowercase "\\udXXX" escape: without one
    # in the text there is nothing for the regular expression to find.
    if text is None or ("\\ud" in text and _LONE_SURROGATE_ESCAPE.search(text)):
        text = _ENCODER.encode(_recordable(value))
    return text


# A \uD800-\uDBFF escape not followed by a \uDC00-\uDFFF one, or the other way round.
# (An escaped backslash before "ud800" also matches: a false alarm costs one more pass.)
_LONE_SURROGATE_ESCAPE = re.compile(
    r"\\u[dD][89abAB][0-9a-fA-F]{2}(?!\\u[dD][c-fC-F])"
    r"|(?<!\\u[dD][89abAB][0-9a-fA-F]{2})\\u[dD][c-fC-F][0-9a-fA-F]{2}"
)


def _recordable(value: Any) -> Any:
    """``value`` with lone surrogates replaced by U+FFFD and non-finite floats by ``None``."""
    if isinstance(value, str):
        return replace_lone_surrogates(value)
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {_recordable(k): _recordable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_recordable(v) for v in value]
    return value


#: How deep objects and arrays in a client frame may nest.
MAX_NESTING = 64


def _deeper_than(value: Any, limit: int) -> bool:
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        children = (
            item.values() if isinstance(item, dict) else item if isinstance(item, list) else ()
        )
        for child in children:
            if isinstance(child, dict | list):
                if depth + 1 > limit:
                    return True
                stack.append((child, depth + 1))
    return False


def _flag_constant(found: list[str], literal: str) -> float:
    # json.loads accepts NaN, Infinity and -Infinity, which are not JSON.
    found.append(literal)
    return float(literal)


# Only what these can match may decode to an unrecordable value, so a frame without
# them skips the walk: a surrogate reaches a decoded string only through a
# \uD800-\uDFFF escape (frame text comes from UTF-8, which cannot hold one), and
# a float overflows to infinity only with a 3-digit exponent or 200+ digits (fewer
# digits times 10**99 stays finite).
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")
_MAY_OVERFLOW = re.compile(r"[eE]\+?0*[1-9][0-9]{2}|[0-9]{200}")


def _may_be_unrecordable(text: str) -> bool:
    return (
        _SURROGATE_ESCAPE.search(text) is not None
        or _MAY_OVERFLOW.search(text) is not None
        or not _is_unicode(text)
    )


def _is_unicode(text: str) -> bool:
    """Whether ``text`` is valid Unicode (no lone surrogate), the common case fast."""
    if text.isascii():
        return True
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _id_of(value: dict[str, Any]) -> str | None:
    raw_id = value.get("id")
    return raw_id if isinstance(raw_id, str) and 0 < len(raw_id) <= MAX_ID_LENGTH else None


def decode_request(text: str) -> Request:
    """The request a client frame holds.

    Raises:
        FrameError: ``bad_json`` (not JSON), ``bad_message`` (not a request of
            this protocol version; the message names the path of each
            problem), ``unknown_type``. ``re`` is the frame's id when it had a
            readable one.
    """
    non_finite: list[str] = []
    try:
        # Only a frame that spells NaN or Infinity can hold one (and "-Infinity" holds
        # "Infinity"): the others skip building a decoder that flags them.
        if "NaN" in text or "Infinity" in text:
            value = json.loads(text, parse_constant=functools.partial(_flag_constant, non_finite))
        else:
            value = json.loads(text)
    except (ValueError, RecursionError) as exc:
        # RecursionError: deeply nested arrays are valid JSON but not a request
        raise FrameError("bad_json", f"not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise FrameError("bad_message", f"$: expected an object, got {_json_type(value)}")
    # Each level opens with a bracket: a frame with few of them (counting those in
    # strings too) cannot nest too deep, and skips the walk.
    if text.count("{") + text.count("[") > MAX_NESTING and _deeper_than(value, MAX_NESTING):
        # The kernel records what a client sends (tool arguments go into the
        # transcript); nesting this deep would overflow the recursion there.
        raise FrameError(
            "bad_message", f"$: nested deeper than {MAX_NESTING} levels", re=_id_of(value)
        )
    raw_id = value.get("id")
    re = raw_id if isinstance(raw_id, str) and 0 < len(raw_id) <= MAX_ID_LENGTH else None
    if non_finite or _may_be_unrecordable(text):
        # The kernel records a request before it acts on it; what cannot be
        # recorded (as strict JSON in UTF-8) must not run.
        problem = json_problem(value)
        if problem is not None:
            raise FrameError("bad_message", problem, re=re if re and _is_unicode(re) else None)
    version = value.get("v")
    if type(version) is not int or version != PROTOCOL_VERSION:
        found = "missing" if "v" not in value else json.dumps(version)[:20]
        raise FrameError("bad_message", f"$.v: expected {PROTOCOL_VERSION}, got {found}", re=re)
    kind = value.get("type")
    if not isinstance(kind, str):
        raise FrameError("bad_message", "$.type: expected a request type (a string)", re=re)
    if kind not in REQUEST_CLASSES:
        known = ", ".join(REQUEST_CLASSES)
        raise FrameError(
            "unknown_type", f"$.type: unknown request type {kind[:40]!r}; known: {known}", re=re
        )
    try:
        request: Request = wire_converter.structure(value, Request)  # type: ignore[arg-type]
    except Exception as exc:
        described = describe_structure_error(exc)
        raise FrameError(
            "bad_message", described, re=re, details={"errors": described.split("; ")}
        ) from None
    if not 0 < len(request.id) <= MAX_ID_LENGTH:
        raise FrameError("bad_message", f"$.id: expected 1 to {MAX_ID_LENGTH} characters", re=None)
    return request


def decode_server_frame(text: str | bytes) -> ServerFrame:
    """The server frame a text frame holds (for clients).

    Raises:
        ProtocolError: the frame is not a server frame of this protocol.
    """
    return structure_server_frame(parse_server_frame(text))


def parse_server_frame(text: str | bytes) -> dict[str, Any]:
    """The JSON object of a server frame, not yet a record: a client that routes
    frames by ``re`` structures only those it reads (``structure_server_frame``).

    Raises:
        ProtocolError: not a JSON object with a server frame's ``type``.
    """
    if isinstance(text, bytes):
        raise ProtocolError("the server sent a binary frame")
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise ProtocolError(f"the server sent a frame that is not JSON: {exc}") from None
    if not isinstance(value, dict) or value.get("type") not in SERVER_TAGS.values():
        raise ProtocolError(f"not a server frame: {text[:200]}")
    return value


def structure_server_frame(value: dict[str, Any]) -> ServerFrame:
    """The record of a server frame's JSON object (from ``parse_server_frame``).

    Raises:
        ProtocolError: the object is not a server frame of this protocol.
    """
    try:
        frame: ServerFrame = wire_converter.structure(value, ServerFrame)  # type: ignore[arg-type]
    except Exception as exc:
        raise ProtocolError(f"bad server frame: {describe_structure_error(exc)}") from None
    return frame


def _json_type(value: object) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int | float):
        return "a number"
    if isinstance(value, str):
        return "a string"
    return "an array"


__all__ = [
    "MAX_NESTING",
    "decode_request",
    "decode_server_frame",
    "encode",
    "encode_numbered",
    "parse_server_frame",
    "structure_server_frame",
]
