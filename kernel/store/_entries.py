"""Transcript entries as the stores write them: one JSON object per line.

Both backends keep the encoded line, so they accept and return exactly the
same things: what ``load`` gives back is ``json.loads`` of what ``append``
was given (tuples come back as lists).
"""

from __future__ import annotations

import json
import json.encoder
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, TypeAlias

from ..errors import CorruptTranscript, UsageError

Entry = dict[str, Any]

EncodedEntry: TypeAlias = tuple[Mapping[str, Any], str | None, bytes]
"""An entry checked and serialized: (entry, uuid, line)."""


def _not_json(value: object) -> object:
    raise TypeError(f"{type(value).__name__} is not a JSON value")


def _make_encoder() -> Callable[[object, int], Sequence[str]]:
    # json.dumps builds a new C encoder on every call; an append is small
    # enough that building it once halves the cost of serializing.
    make = getattr(json.encoder, "c_make_encoder", None)
    if make is None:  # pragma: no cover - CPython always has the C encoder
        py = json.JSONEncoder(
            ensure_ascii=False, separators=(",", ":"), allow_nan=False, default=_not_json
        )
        return lambda value, _: (py.encode(value),)
    encode: Callable[[object, int], Sequence[str]] = make(
        {}, _not_json, json.encoder.encode_basestring, None, ":", ",", False, False, False
    )
    return encode


_encode = _make_encoder()
_join = "".join


def encode_entries(entries: Sequence[Mapping[str, Any]]) -> list[EncodedEntry]:
    """Check and serialize a batch; the first of several entries with one uuid wins.

    Raises:
        UsageError: naming the entry's index, when an entry is not a mapping,
            has no string ``type``, has a ``uuid`` that is not a string, or
            cannot be written as JSON (NaN, non-string keys, other objects).
    """
    global _encode
    out: list[EncodedEntry] = []
    seen: set[str] | None = None
    for i, entry in enumerate(entries):
        if type(entry) is not dict and not isinstance(entry, Mapping):
            raise UsageError(f"entries[{i}]: expected a JSON object, got {type(entry).__name__}")
        if type(entry.get("type")) is not str:
            raise UsageError(f"entries[{i}].type: expected a string")
        uuid = entry.get("uuid")
        if uuid is not None:
            if type(uuid) is not str:
                raise UsageError(f"entries[{i}].uuid: expected a string")
            if seen is None:
                seen = {uuid}
            elif uuid in seen:
                continue
            else:
                seen.add(uuid)
        try:
            line = (_join(_encode(entry, 0)) + "\n").encode()
        except (TypeError, ValueError, RecursionError) as exc:
            _encode = _make_encoder()  # its cycle-detection memo may hold leftovers
            raise UsageError(f"entries[{i}]: not writable as JSON: {exc}") from exc
        out.append((entry, uuid, line))
    return out


def decode_line(line: bytes, path: str, lineno: int) -> Entry:
    """One stored line back into its entry.

    Raises:
        CorruptTranscript: the line is not a JSON object with a string ``type``.
    """
    try:
        entry = json.loads(line)
    except ValueError as exc:
        raise CorruptTranscript(path, lineno, f"not JSON ({exc})") from None
    if not isinstance(entry, dict) or not isinstance(entry.get("type"), str):
        raise CorruptTranscript(path, lineno, "not an object with a string 'type'")
    return entry


def decode_lines(lines: Iterable[bytes]) -> list[Entry]:
    """Lines this process encoded itself (no checks needed)."""
    return [json.loads(line) for line in lines]
