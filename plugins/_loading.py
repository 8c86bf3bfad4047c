"""Finding a plugin in a module, and what a worker says about it in its greeting.

Shared by the host (trusted plugins it imports itself) and the worker
(``plugins._worker``, which imports every other plugin, confined). It imports
only the authoring API: every worker imports this module.

A plugin target is a module name, a ``.py`` path or a package directory, with
an optional ``:attribute`` (the entry-point form ``module:plugin``). The served
``Plugin`` is that attribute, else the module's ``plugin``, else its only
``Plugin``; modules without one keep the older forms (``TOOLS``, or every
``Tool`` attribute).

A plugin's own package (or module, or file) is imported from its source files
only (``source_only``): the bytes an approval hashed are the bytes compiled,
never a ``.pyc`` beside them (``__pycache__`` is not hashed), nor bytecode
without source, nor a zip archive.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
import zipimport
from collections.abc import Sequence
from importlib.machinery import ModuleSpec
from types import CodeType, ModuleType
from typing import Any

import attrs

from kernel.errors import SandboxError
from kernel.plugin import Plugin
from kernel.tools import Tool
from sandbox import ToolSpec


@attrs.frozen(kw_only=True)
class PluginInfo:
    """What the host learns about a plugin from its worker's greeting (``$.plugin``).

    Attributes:
        permissions: as ``Plugin(permissions=...)`` takes them; the host checks them
            with ``Permissions.from_mapping``.
    """

    name: str
    version: str
    description: str
    permissions: dict[str, Any]
    in_process: bool = False

    @classmethod
    def of(cls, plugin: Plugin) -> PluginInfo:
        permissions = plugin.permissions
        return cls(
            name=plugin.name,
            version=plugin.version,
            description=plugin.description,
            permissions={
                "workspace": permissions.workspace,
                "network": list(permissions.network),
                "subprocess": permissions.subprocess,
            },
            in_process=plugin.in_process,
        )


def tool_spec(tool: Tool) -> ToolSpec:
    """How a worker's greeting describes ``tool``."""
    return ToolSpec(
        name=tool.name,
        description=tool.description,
        parameters=tool.parameters,
        is_async=tool.is_async,
        timeout=tool.timeout,
        exclusive=tool.exclusive,
        max_output=tool.max_output,
    )


def split_target(target: str) -> tuple[str, str | None]:
    """``"pkg.mod:plugin"`` -> ``("pkg.mod", "plugin")``; no attribute -> ``(target, None)``."""
    module, sep, attribute = target.rpartition(":")
    if sep and module and attribute.isidentifier():
        return module, attribute
    return target, None


class _SourceOnlyLoader(importlib.machinery.SourceFileLoader):
    """Runs the code compiled from the bytes it reads now: never a cached ``.pyc``.

    An approval is of source bytes (``plugins._trust``); the default loader runs
    ``__pycache__/NAME.pyc`` instead whenever its header records the source's
    mtime and size, which anyone who can write there (or a wheel that ships one)
    chooses. Nothing is written back either.
    """

    def get_code(self, fullname: str) -> CodeType:
        path = self.get_filename(fullname)
        return self.source_to_code(self.get_data(path), path)


def _source_only(spec: ModuleSpec) -> ModuleSpec:
    """``spec`` with its loader made ``_SourceOnlyLoader``.

    Raises:
        ImportError: bytecode without its source, or code from a zip archive (its
            pycs are trusted by timestamp, and its files were not hashed).
    """
    loader = spec.loader
    if isinstance(loader, importlib.machinery.SourceFileLoader):
        if not isinstance(loader, _SourceOnlyLoader):
            spec.loader = _SourceOnlyLoader(loader.name, loader.path)
    elif isinstance(loader, importlib.machinery.SourcelessFileLoader):
        raise ImportError(
            f"{spec.name}: {spec.origin} is bytecode without its source; a plugin's code "
            "is imported from source only"
        )
    elif isinstance(loader, zipimport.zipimporter):
        raise ImportError(
            f"{spec.name}: {spec.origin} lies in a zip archive; a plugin's code is imported "
            "from source files only"
        )
    return spec


class _SourceOnlyFinder(importlib.abc.MetaPathFinder):
    """First on ``sys.meta_path``: the modules of one top-level package are found as
    usual (the other finders, editable installs' included), then loaded from source."""

    def __init__(self, top: str) -> None:
        self.top = top

    def find_spec(
        self,
        fullname: str,
        path: Sequence[str] | None,
        target: ModuleType | None = None,
    ) -> ModuleSpec | None:
        if fullname != self.top and not fullname.startswith(self.top + "."):
            return None
        for finder in sys.meta_path:
            find = getattr(finder, "find_spec", None)
            if finder is self or find is None:
                continue
            spec = find(fullname, path, target)
            if spec is not None:
                return _source_only(spec)
        return None


def source_only(top: str) -> None:
    """Import the package (or module) ``top`` and its submodules from source only.

    A package already imported (the kernel's own, in a worker) is left as it is.
    """
    if top in sys.modules or any(
        isinstance(f, _SourceOnlyFinder) and f.top == top for f in sys.meta_path
    ):
        return
    sys.meta_path.insert(0, _SourceOnlyFinder(top))


def _import_plugin(plugin: str) -> ModuleType:
    if plugin.endswith(".py") or os.sep in plugin:
        path = os.path.abspath(plugin)
        stem = os.path.splitext(os.path.basename(path.rstrip(os.sep)))[0]
        name = f"tak_plugin_{stem}"
        if os.path.isdir(path):
            spec = importlib.util.spec_from_file_location(
                name, os.path.join(path, "__init__.py"), submodule_search_locations=[path]
            )
        else:
            spec = importlib.util.spec_from_file_location(name, path)
        if spec is None or spec.loader is None:
            raise ImportError(f"cannot load a plugin from {path}")
        spec = _source_only(spec)
        source_only(name)  # the submodules of a package directory
        assert spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
        return module
    source_only(plugin.partition(".")[0])
    return importlib.import_module(plugin)


def find_plugin(module: ModuleType, attribute: str | None, label: str) -> Plugin | None:
    """The module's ``Plugin``: ``attribute``, else ``plugin``, else the only one.

    Raises:
        SandboxError: ``attribute`` is missing or not a ``Plugin``, or the module
            holds several plugins and none is named ``plugin``.
    """
    if attribute is not None:
        found = getattr(module, attribute, None)
        if not isinstance(found, Plugin):
            raise SandboxError(f"plugin {label}: {attribute!r} is {found!r}, not a Plugin")
        return found
    named = getattr(module, "plugin", None)
    if isinstance(named, Plugin):
        return named
    plugins = [v for v in vars(module).values() if isinstance(v, Plugin)]
    if len(plugins) > 1:
        names = ", ".join(p.name for p in plugins)
        raise SandboxError(
            f"plugin {label} holds several plugins ({names}); name one as 'module:attribute'"
        )
    return plugins[0] if plugins else None


def load_plugin(target: str) -> tuple[Plugin | None, list[Tool]]:
    """The plugin a target names and the tools to serve.

    A module with a ``Plugin`` serves ``plugin.tools``; one without serves its
    ``TOOLS`` list, else its ``Tool`` attributes (and the plugin is ``None``).

    Raises:
        SandboxError: no tools, something in ``TOOLS`` that is not a Tool, or two
            tools with one name.
    """
    name, attribute = split_target(target)
    module = _import_plugin(name)
    plugin = find_plugin(module, attribute, target)
    found: Sequence[Any] | None
    if plugin is not None:
        found = plugin.tools
    else:
        found = getattr(module, "TOOLS", None)
        if found is None:
            found = [value for value in vars(module).values() if isinstance(value, Tool)]
    tools: list[Tool] = []
    names: set[str] = set()
    for item in found:
        if not isinstance(item, Tool):
            raise SandboxError(f"plugin {target}: TOOLS holds {item!r}, which is not a Tool")
        if item.name in names:
            raise SandboxError(f"plugin {target}: two tools are named {item.name!r}")
        if item.fn is None:
            raise SandboxError(f"plugin {target}: tool {item.name!r} has no function")
        names.add(item.name)
        tools.append(item)
    if not tools:
        raise SandboxError(f"plugin {target} defines no tools")
    return plugin, tools
