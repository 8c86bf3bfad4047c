"""JSON for a terminal: valid JSON in which no character a terminal acts on is raw.

``json.dumps`` writes the C0 controls of a string as ``\\uXXXX`` but DEL, the C1
controls (``\\x9b`` is CSI), U+2028/U+2029 and the bidi controls as they are
(with ``ensure_ascii=False``, which keeps other text readable). Those are
written here as JSON's own ``\\uXXXX`` escapes, from ``kernel.terminal``'s table:
a program reading the output gets the same strings back, a person sees what
is there. Outside strings JSON has only ASCII punctuation and the newlines of
``indent``, which are kept.
"""

from __future__ import annotations

import json
from typing import Any

from ..terminal import ESCAPES

__all__ = ["terminal_json"]

_JSON_ESCAPES: dict[int, str] = {code: f"\\u{code:04x}" for code in ESCAPES if code != 0x0A}


def terminal_json(value: Any, *, indent: int | None = None) -> str:
    """``json.dumps(value, ensure_ascii=False, indent=indent)`` with every terminal
    control escaped as JSON (``\\u001b``, ``\\u009b``, ``\\u202e``)."""
    return json.dumps(value, ensure_ascii=False, indent=indent).translate(_JSON_ESCAPES)
