"""Worker text made safe for the kernel's log: one record, one line, no terminal escapes.

A plugin's log records and its stdout/stderr are hostile text. Passed to the
kernel's logger as they are, a ``\\n`` starts what looks like a kernel line
(``2025-01-01 INFO kernel: plugin trusted``), a ``\\r`` overwrites the line
on a terminal, and ``ESC [`` sequences recolour, hide or retitle it. Every
path from worker text to the log goes through ``escape_log_text``.
"""

from __future__ import annotations

#: Longest text one record may carry, in characters, after escaping.
MAX_LOG_TEXT = 8192

_NAMED = {"\n": "\\n", "\r": "\\r", "\x1b": "\\e"}


def _escape_table() -> dict[int, str]:
    table: dict[int, str] = {}
    # C0 but tab, DEL, C1 (NEL and CSI among them).
    for code in [*range(0x20), 0x7F, *range(0x80, 0xA0)]:
        if code != 0x09:
            table[code] = _NAMED.get(chr(code), f"\\x{code:02x}")
    # Line and paragraph separators end a line for some viewers; bidi controls
    # reorder what a reader sees (the "Trojan Source" trick).
    for code in [0x2028, 0x2029, *range(0x202A, 0x202F), *range(0x2066, 0x206A)]:
        table[code] = f"\\u{code:04x}"
    return table


_TABLE = _escape_table()


def escape_log_text(text: str, *, limit: int = MAX_LOG_TEXT) -> str:
    """``text`` with control characters written as escapes (tab kept), cut to ``limit``.

    The result has no character a terminal or a line-based log reader acts on,
    so one call's text is exactly one line of the log.
    """
    escaped = text[: limit + 1].translate(_TABLE)
    if len(escaped) <= limit and len(text) <= limit:
        return escaped
    return f"{escaped[:limit]} [... cut at {limit} characters]"
