"""The project's modules, found by walking its packages' files, and imported."""

from __future__ import annotations

import importlib
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("kernel", "sandbox", "plugins")


def module_names() -> list[str]:
    """Every module of ``PACKAGES`` by its dotted name, ``__main__`` modules left out
    (importing one runs the program: ``kernel/cli/__main__.py`` exits)."""
    names = []
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__main__":
                continue
            if parts[-1] == "__init__":
                parts.pop()
            names.append(".".join(parts))
    return names


def is_public(name: str) -> bool:
    """No part of the dotted name starts with an underscore."""
    return not any(part.startswith("_") for part in name.split("."))


def imported_modules() -> Iterator[ModuleType]:
    for name in module_names():
        yield importlib.import_module(name)
