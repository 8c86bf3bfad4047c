"""Hostile text made safe to show on a terminal: the one function every front door uses.

Text from a workspace (file names, file content), a plugin (names, descriptions,
output), an MCP server or a model is hostile wherever it is shown. Written to a
terminal as it is, ``ESC [ 8 m`` hides what follows, ``ESC ] 0 ;`` retitles the
window, ``\\r`` overwrites a line already printed (a forged ``trusted:`` line),
C1 controls (``\\x9b`` is CSI on some terminals) do the same in one byte, and the
bidi overrides reorder what a reader sees (the "Trojan Source" trick).

``escape_terminal`` writes every such character as a visible escape (``\\e``,
``\\x9b``, ``\\u202e``), so what is shown is what is there. It alters only what
is shown: nothing is ever stored escaped. Tab is kept; newlines are kept only
where the caller shows multi-line content (``keep_newlines=True``).

This module imports nothing of the project (floor 0): the CLI, the REPL and the
sandbox's log text (``sandbox._logtext``) share its table.
"""

from __future__ import annotations

__all__ = ["ESCAPES", "escape_terminal"]

_NAMED = {"\n": "\\n", "\r": "\\r", "\x1b": "\\e"}


def _escape_table() -> dict[int, str]:
    table: dict[int, str] = {}
    # C0 but tab, DEL, C1 (NEL and CSI among them).
    for code in [*range(0x20), 0x7F, *range(0x80, 0xA0)]:
        if code != 0x09:
            table[code] = _NAMED.get(chr(code), f"\\x{code:02x}")
    # Line and paragraph separators end a line for some viewers; bidi controls
    # (embeddings, overrides, isolates, the marks) reorder what a reader sees.
    bidi = [0x061C, 0x200E, 0x200F, *range(0x202A, 0x202F), *range(0x2066, 0x206A)]
    for code in [0x2028, 0x2029, *bidi]:
        table[code] = f"\\u{code:04x}"
    return table


#: ``str.translate`` table: every character a terminal acts on -> its visible escape.
ESCAPES: dict[int, str] = _escape_table()
_KEEP_NEWLINES: dict[int, str] = {k: v for k, v in ESCAPES.items() if k != 0x0A}


def escape_terminal(text: str, *, keep_newlines: bool = False) -> str:
    """``text`` with every terminal control written as a visible escape.

    Escaped: C0 controls but tab (``\\n`` too, unless ``keep_newlines``), DEL,
    C1 controls, U+2028/U+2029 and the bidi controls. Everything else, printable
    non-ASCII included, is kept as it is.
    """
    return text.translate(_KEEP_NEWLINES if keep_newlines else ESCAPES)
