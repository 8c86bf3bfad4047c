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
only (``source_only``): never a ``.pyc`` beside them (``__pycache__`` is not
hashed), nor bytecode without source, nor a zip archive.

An approved entry point's target is *pinned* (``pin``) to the digest its
approval recorded. The worker then reads every file of the package once
(``package_digest``, the hash ``tak plugins trust`` recorded), refuses to load
when the digest differs, and compiles each module from the bytes it hashed,
kept in memory: a file rewritten or added after the host hashed the package (an
upgrade while ``tak serve`` runs, before a worker starts or restarts) never runs,
and a module found outside the hashed files is refused.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
import zipimport
from collections.abc import Iterator, Mapping, Sequence
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


#: Bounds of an entry point's package, so that hashing it stays quick.
MAX_FILES = 5000
MAX_BYTES = 256 * 1024 * 1024
#: Between a pinned target's top-level name and the digest (``pin``).
_PIN = ".#sha256="


def pin(target: str, sha256: str) -> str:
    """``pkg.mod:plugin`` pinned to ``sha256``: ``pkg.#sha256=HEX.mod:plugin``.

    The pin rides after the top-level name, so what reads a target without knowing
    of pins (the confinement's ``plugin_read_paths``) still finds the package.
    """
    module, attribute = split_target(target)
    top, _, rest = module.partition(".")
    pinned = f"{top}{_PIN}{sha256}" + (f".{rest}" if rest else "")
    return pinned + (f":{attribute}" if attribute is not None else "")


def unpin(target: str) -> tuple[str, str | None]:
    """``(target, sha256)`` of a pinned target; ``(target, None)`` of any other."""
    module, attribute = split_target(target)
    top, sep, tail = module.partition(_PIN)
    if not sep:
        return target, None
    sha256, _, rest = tail.partition(".")
    module = top + (f".{rest}" if rest else "")
    return module + (f":{attribute}" if attribute is not None else ""), sha256


def walk_package(root: str) -> Iterator[tuple[str, str]]:
    """``(relative name, path)`` of every file under ``root`` that a digest covers:
    all but ``__pycache__`` and ``.pyc``/``.pyo`` files, in a stable order."""
    for folder, dirs, names in os.walk(root):  # os.walk never follows directory links
        dirs[:] = sorted(d for d in dirs if d != "__pycache__")
        for name in sorted(names):
            path = os.path.join(folder, name)
            if name.endswith((".pyc", ".pyo")) or not os.path.isfile(path):
                continue
            yield os.path.relpath(path, root), path


def package_files(top: str) -> list[tuple[str, str]]:
    """``(relative name, path)`` of every file of the top-level package ``top``.

    Found with ``importlib.util.find_spec``, which asks the import system where
    the package is without importing it.

    Raises:
        SandboxError: not installed, no source file, in a zip archive, or more
            than ``MAX_FILES`` files.
    """
    try:
        spec = importlib.util.find_spec(top)
    except (ImportError, ValueError) as exc:
        raise SandboxError(f"{top}: {exc}") from None
    if spec is None:
        raise SandboxError(f"module {top} is not installed")
    locations = list(spec.submodule_search_locations or ())
    if not locations:
        if spec.origin is None or not os.path.isfile(spec.origin):
            raise SandboxError(f"{top} has no source file to hash")
        return [(os.path.basename(spec.origin), spec.origin)]
    found: list[tuple[str, str]] = []
    for index, location in enumerate(locations):
        if not os.path.isdir(location):  # a zip archive: nothing here could be walked
            raise SandboxError(
                f"{location} is not a directory; only a package installed as files can be hashed"
            )
        for rel, path in walk_package(location):
            found.append((f"{index}/{rel}", path))
            if len(found) > MAX_FILES:
                raise SandboxError(f"{top}: more than {MAX_FILES} files to hash")
    return sorted(found)


def package_digest(files: Sequence[tuple[str, str]], label: str) -> tuple[str, dict[str, bytes]]:
    """The SHA-256 of ``files`` (``package_files``), each read once; and the bytes
    read of each ``.py`` file, by absolute path: what a pinned import compiles.

    Raises:
        SandboxError: more than ``MAX_BYTES`` bytes.
    """
    total = hashlib.sha256()
    size = 0
    sources: dict[str, bytes] = {}
    for rel, path in files:
        with open(path, "rb") as f:
            content = f.read(MAX_BYTES + 1 - size)
        size += len(content)
        if size > MAX_BYTES:
            raise SandboxError(f"{label}: its package is more than {MAX_BYTES} bytes")
        total.update(f"{rel}\0{len(content)}\0".encode())
        total.update(content)
        if path.endswith(".py"):
            sources[os.path.abspath(path)] = content
    return total.hexdigest(), sources


class _SourceOnlyLoader(importlib.machinery.SourceFileLoader):
    """Runs the code compiled from source bytes: never a cached ``.pyc``.

    An approval is of source bytes (``plugins._trust``); the default loader runs
    ``__pycache__/NAME.pyc`` instead whenever its header records the source's
    mtime and size, which anyone who can write there (or a wheel that ships one)
    chooses. Nothing is written back either. With ``sources`` (a pinned import),
    the bytes are those hashed, not read again; a file not among them is refused.
    """

    def __init__(self, fullname: str, path: str, sources: Mapping[str, bytes] | None) -> None:
        super().__init__(fullname, path)
        self.sources = sources

    def get_code(self, fullname: str) -> CodeType:
        path = self.get_filename(fullname)
        if self.sources is None:
            return self.source_to_code(self.get_data(path), path)
        content = self.sources.get(os.path.abspath(path))
        if content is None:
            raise ImportError(
                f"{fullname}: {path} is not among the files of the approved package; a "
                "pinned plugin runs only the code its approval hashed"
            )
        return self.source_to_code(content, path)


def _source_only(spec: ModuleSpec, sources: Mapping[str, bytes] | None = None) -> ModuleSpec:
    """``spec`` with its loader made ``_SourceOnlyLoader``.

    Raises:
        ImportError: bytecode without its source, or code from a zip archive (its
            pycs are trusted by timestamp, and its files were not hashed); with
            ``sources``, any loader but one of source files.
    """
    loader = spec.loader
    if isinstance(loader, importlib.machinery.SourceFileLoader):
        if not isinstance(loader, _SourceOnlyLoader):
            spec.loader = _SourceOnlyLoader(loader.name, loader.path, sources)
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
    elif sources is not None and spec.origin not in (None, "namespace"):
        # An extension module, or a loader of some finder's own: its bytes were
        # hashed (or not), but it would read them again.
        if not (spec.origin and os.path.abspath(spec.origin) in sources):
            raise ImportError(
                f"{spec.name}: {spec.origin} is loaded by {type(loader).__name__}, not "
                "from the approved source bytes"
            )
    return spec


class _SourceOnlyFinder(importlib.abc.MetaPathFinder):
    """First on ``sys.meta_path``: the modules of one top-level package are found as
    usual (the other finders, editable installs' included), then loaded from source."""

    def __init__(self, top: str, sources: Mapping[str, bytes] | None = None) -> None:
        self.top = top
        self.sources = sources

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
                return _source_only(spec, self.sources)
        return None


def source_only(top: str, sources: Mapping[str, bytes] | None = None) -> None:
    """Import the package (or module) ``top`` and its submodules from source only;
    with ``sources``, from those bytes only (see ``_SourceOnlyLoader``).

    A package already imported (the kernel's own, in a worker) is left as it is.
    """
    if top in sys.modules or any(
        isinstance(f, _SourceOnlyFinder) and f.top == top for f in sys.meta_path
    ):
        return
    sys.meta_path.insert(0, _SourceOnlyFinder(top, sources))


def _import_plugin(plugin: str, sha256: str | None = None) -> ModuleType:
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
    top = plugin.partition(".")[0]
    if sha256 is None:
        source_only(top)
        return importlib.import_module(plugin)
    if top in sys.modules:  # imported before the pin could hold: not what was approved
        raise SandboxError(f"plugin {top}: already imported in the worker; it cannot be pinned")
    digest, sources = package_digest(package_files(top), top)
    if digest != sha256:
        raise SandboxError(
            f"plugin {top}: its files changed since it was approved (sha256 {digest[:16]}, "
            f"approved {sha256[:16]}); approve it again"
        )
    source_only(top, sources)
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
    target, sha256 = unpin(target)
    name, attribute = split_target(target)
    module = _import_plugin(name, sha256)
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
