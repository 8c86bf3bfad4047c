"""The project's modules, found by walking its packages' files, and imported."""

from __future__ import annotations

import importlib
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("kernel", "sandbox", "plugins")


def module_files() -> dict[str, Path]:
    """Every module of ``PACKAGES``: its dotted name and its file."""
    found: dict[str, Path] = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = path
    return found


def module_names() -> list[str]:
    """Every module's dotted name, ``__main__`` modules left out (importing one runs
    the program: ``kernel/cli/__main__.py`` exits)."""
    return [name for name in module_files() if not name.endswith(".__main__")]


def is_public(name: str) -> bool:
    """No part of the dotted name starts with an underscore."""
    return not any(part.startswith("_") for part in name.split("."))


def imported_modules() -> Iterator[ModuleType]:
    for name in module_names():
        yield importlib.import_module(name)
