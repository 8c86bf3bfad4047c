"""The test suite sees no ``tak.plugins`` entry point installed in the environment.

A plugin the user installed into the venv (``pip install -e .``, as docs/plugins.md
says) is skipped as untrusted on every ``tak`` command, and changed what a dozen of
the project's own tests printed. So ``importlib.metadata.entry_points`` leaves out
the ``tak.plugins`` entry points of distributions installed in the interpreter's
site directories; those a test makes itself (a dist-info under its tmp_path) are
seen. A test that installs one on purpose sets ``SHOW_INSTALLED_ENV`` (for its
subprocesses too: tests/site_hooks/sitecustomize.py applies the same filter there).

Kept cheap to import: a ``tak`` subprocess loads it at start-up, and the import-cost
tests count what ``tak --help`` imports. ``importlib.metadata`` is patched when
something imports it, not before.
"""

from __future__ import annotations

import os
import sys
from typing import Any

GROUP = "tak.plugins"
#: Set (to anything), the installed entry points are seen again.
SHOW_INSTALLED_ENV = "TAK_TEST_INSTALLED_PLUGINS"


def _installed(ep: Any) -> bool:
    import site

    path = getattr(ep.dist, "_path", None)
    if path is None:
        return False
    where = os.path.realpath(os.fspath(path))
    dirs = [*site.getsitepackages(), site.getusersitepackages()]
    return any(where.startswith(os.path.realpath(d) + os.sep) for d in dirs)


def _patch(metadata: Any) -> None:
    real = metadata.entry_points
    if getattr(real, "_tak_hides_installed", False):
        return

    def entry_points(**params: Any) -> Any:
        found = real(**params)
        if os.environ.get(SHOW_INSTALLED_ENV) or not params:
            return found
        return type(found)(ep for ep in found if ep.group != GROUP or not _installed(ep))

    entry_points._tak_hides_installed = True  # type: ignore[attr-defined]
    metadata.entry_points = entry_points


class _PatchOnImport:
    """A meta path finder that patches ``importlib.metadata`` right after it loads."""

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> Any:
        if name != "importlib.metadata":
            return None
        import importlib.util

        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None:
            return spec
        loader = spec.loader
        exec_module = loader.exec_module

        def exec_and_patch(module: Any) -> None:
            exec_module(module)
            _patch(module)

        loader.exec_module = exec_and_patch  # type: ignore[method-assign]
        return spec


def hide_installed_entry_points() -> None:
    """From now on, this process sees no installed ``tak.plugins`` entry point."""
    metadata = sys.modules.get("importlib.metadata")
    if metadata is not None:
        _patch(metadata)
    elif not any(isinstance(f, _PatchOnImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _PatchOnImport())
