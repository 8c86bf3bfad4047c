"""What the kernel decodes of a worker's frames: counted, not timed.

A frame from a worker costs the kernel's Trio thread what ``json.loads`` does with it
(sandbox/_protocol.py bounds that before decoding); so the tests that guard the
kernel's loop against hostile frames count the bytes and values it decodes. How long
the loop stalls is a figure for a benchmark (bench/), never asserted.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from sandbox import _protocol


@contextmanager
def decoded_frames() -> Iterator[list[tuple[int, int]]]:
    """The frame bodies the kernel hands to ``json.loads`` meanwhile: (bytes, an upper
    bound of the JSON values, counted as ``sandbox._protocol.check_cost`` does).

    What a frame costs the kernel's loop is what it decodes: counted, not timed.
    """
    decoded: list[tuple[int, int]] = []

    class _Counting:
        def __getattr__(self, name: str) -> Any:
            return getattr(json, name)

        def loads(self, body: bytes, **kwargs: Any) -> Any:
            values = sum(body.count(mark) for mark in (b"[", b"{", b",", b":"))
            decoded.append((len(body), values))
            return json.loads(body, **kwargs)

    real = _protocol.json
    _protocol.json = _Counting()  # type: ignore[assignment]
    try:
        yield decoded
    finally:
        _protocol.json = real


def assert_decoding_bounded(decoded: list[tuple[int, int]]) -> None:
    """No frame the kernel decoded was past the limits its loop can afford."""
    limits = _protocol.FROM_WORKER
    assert limits.max_values is not None
    for size, values in decoded:
        assert size <= limits.max_bytes, f"a {size}-byte frame was decoded"
        assert size <= _protocol.COSTLY_BODY or values <= limits.max_values, (
            f"a {size}-byte frame of up to {values} values was decoded"
        )
