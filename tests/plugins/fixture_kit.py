"""The bad and good plugins in fixtures/, by name (for the plugin host and CLI tests).

A module of its own, imported as ``tests.plugins.fixture_kit``: not from ``conftest``,
which names a different module whenever several test folders are selected at once.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

FIXTURES = Path(__file__).parent / "fixtures"


def fixture_plugin(name: str) -> str:
    """The path of a plugin in fixtures/, as ``open_plugin_host(plugins=...)`` takes it."""
    return str(FIXTURES / f"{name}.py")


def import_fixture(name: str) -> ModuleType:
    """Import a fixture plugin in this process, as an embedder holding it would."""
    module_name = f"tak_test_fixture_{name}"
    if module_name in sys.modules:
        return sys.modules[module_name]
    spec = importlib.util.spec_from_file_location(module_name, FIXTURES / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    spec.loader.exec_module(module)
    return module
