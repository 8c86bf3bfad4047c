"""Google-style docstrings: the description a model reads, and each argument's text."""

from __future__ import annotations

import inspect
import re

_SECTION_HEADER = re.compile(r"([A-Za-z][A-Za-z ]*):")
_ARGS_SECTIONS = frozenset({"args", "arguments", "parameters", "params"})
# Sections that describe the call to a Python caller, not to the model.
_DROPPED_SECTIONS = _ARGS_SECTIONS | {"returns", "return", "yields", "yield", "raises"}
_ARG_ENTRY = re.compile(r"\*{0,2}(\w+)\s*(?:\([^)]*\))?\s*:\s*(.*)")


def parse_docstring(doc: str | None) -> tuple[str, dict[str, str]]:
    """Split a Google-style docstring into the description and per-argument texts."""
    lines = inspect.cleandoc(doc or "").splitlines()
    kept: list[str] = []
    arguments: dict[str, list[str]] = {}
    section: str | None = None
    entry_indent: int | None = None
    current: list[str] | None = None
    for line in lines:
        text = line.strip()
        if text and not line[0].isspace():
            header = _SECTION_HEADER.fullmatch(text)
            name = header.group(1).lower() if header else None
            section = name if name in _DROPPED_SECTIONS else None
            entry_indent, current = None, None
            if section is not None:
                continue
        if section is None:
            kept.append(line)
            continue
        if section not in _ARGS_SECTIONS or not text:
            continue
        indent = len(line) - len(line.lstrip())
        if entry_indent is None:
            entry_indent = indent
        entry = _ARG_ENTRY.fullmatch(text) if indent <= entry_indent else None
        if entry is not None:
            current = arguments.setdefault(entry.group(1), [])
            if entry.group(2):
                current.append(entry.group(2))
        elif current is not None:
            current.append(text)
    description = re.sub(r"\n{3,}", "\n\n", "\n".join(kept)).strip()
    return description, {name: " ".join(parts) for name, parts in arguments.items()}
