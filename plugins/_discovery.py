"""Where plugins come from: built-ins, the ``tak.plugins`` entry points, the workspace.

Discovery only names plugins; it imports nothing. A discovered plugin is
third-party code: the host imports it only inside a sandbox worker.
"""

from __future__ import annotations

import importlib.metadata
import os
from pathlib import Path
from typing import Literal

import attrs

#: The entry-point group a plugin package declares: ``name = "module:plugin"``.
ENTRY_POINT_GROUP = "tak.plugins"
#: Where a workspace keeps its own plugins, one ``.py`` file each.
WORKSPACE_PLUGIN_DIR = ".tak/plugins"
#: The built-in plugins, in the order their tools are registered.
BUILTIN_PLUGINS = ("fs", "shell", "web", "python", "notes")
#: Built-ins loaded only when named (``tak --plugin demo``).
OPTIONAL_PLUGINS = ("demo",)

SourceKind = Literal["builtin", "entry_point", "workspace", "path", "module", "object"]


@attrs.frozen
class PluginSource:
    """Where one plugin comes from.

    Attributes:
        kind: ``builtin`` (``plugins.<name>``), ``entry_point``, ``workspace``
            (``<workspace>/.tak/plugins/*.py``), ``path`` or ``module`` (named by the
            embedder), ``object`` (a ``Plugin`` or module object the embedder holds).
        target: what a worker imports: ``module``, ``module:attribute`` or a path.
        label: how ``tak plugins ls`` shows the source.
        path: directories a worker appends to ``sys.path`` to find ``target``.
        name: the entry point's name, or a workspace file's stem: what
            ``tak plugins trust`` takes (besides a path).
    """

    kind: SourceKind
    target: str
    label: str
    path: tuple[str, ...] = ()
    name: str = ""

    @property
    def trusted(self) -> bool:
        """Code of the kernel or of the embedder: imported in the kernel's process.

        Everything else is imported only inside a sandbox worker, and may not run
        in process whatever it declares.
        """
        return self.kind in ("builtin", "object")


def builtin_sources(names: tuple[str, ...] = BUILTIN_PLUGINS) -> list[PluginSource]:
    return [PluginSource("builtin", f"plugins.{name}", "built-in") for name in names]


def entry_point_sources() -> list[PluginSource]:
    """The ``tak.plugins`` entry points of installed distributions, sorted by name."""
    found = []
    for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        dist = ep.dist
        where = f" ({dist.name} {dist.version})" if dist is not None else ""
        found.append(
            PluginSource(
                "entry_point",
                ep.value.replace(" ", ""),
                f"entry point {ep.name}{where}",
                name=ep.name,
            )
        )
    return sorted(found, key=lambda s: (s.label, s.target))


def workspace_sources(workspace: str | os.PathLike[str]) -> list[PluginSource]:
    """``<workspace>/.tak/plugins/*.py``, sorted by file name (``_``-prefixed files skipped).

    A ``.tak`` or ``.tak/plugins`` that is a symbolic link is not followed: whoever
    wrote the workspace (a tool) would choose which directory the kernel lists.
    A file that is a link is listed, and refused when the host reads it.
    """
    folder = Path(workspace) / WORKSPACE_PLUGIN_DIR
    try:
        if folder.parent.is_symlink() or folder.is_symlink() or not folder.is_dir():
            return []
        files = sorted(p for p in folder.glob("*.py") if not p.name.startswith("_"))
    except OSError:
        return []
    return [
        PluginSource(
            "workspace",
            str(p.absolute()),
            f"{WORKSPACE_PLUGIN_DIR}/{p.name}",
            name=p.stem,
        )
        for p in files
        if p.is_symlink() or p.is_file()
    ]


def discover_plugins(workspace: str | os.PathLike[str]) -> list[PluginSource]:
    """Entry points, then the workspace's own plugins."""
    return [*entry_point_sources(), *workspace_sources(workspace)]


def source_for(spec: str) -> PluginSource:
    """A source named by a string: a built-in name, a ``.py``/package path, or a module.

    ``"fs"`` is the built-in; ``"./x.py"`` or ``"dir/pkg"`` a path;
    ``"pkg.mod"`` or ``"pkg.mod:plugin"`` a module.
    """
    if spec in BUILTIN_PLUGINS or spec in OPTIONAL_PLUGINS:
        return builtin_sources((spec,))[0]
    if spec.endswith(".py") or os.sep in spec or Path(spec).is_dir():
        path = os.path.abspath(spec)
        return PluginSource("path", path, path)
    return PluginSource("module", spec, spec)
