"""Lazy re-exports for a package's ``__init__``: a name loads its module on first use.

``import kernel`` and ``import plugins`` stay cheap this way (every sandbox
worker imports them), while ``from kernel import run_tool_calls`` still works.
(``sandbox`` has its own few lines: it imports nothing of the kernel but
``kernel.errors``.)
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Mapping
from typing import Any


def lazy_exports(
    package: str, exports: Mapping[str, str]
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """The ``__getattr__`` and ``__dir__`` of ``package``, whose ``exports`` map each public
    name to the submodule (relative to ``package``) that defines it."""

    def __getattr__(name: str) -> Any:
        module = exports.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(f".{module}", package), name)
        setattr(sys.modules[package], name, value)  # the next lookup skips this function
        return value

    def __dir__() -> list[str]:
        return sorted(getattr(sys.modules[package], "__all__", exports))

    return __getattr__, __dir__
