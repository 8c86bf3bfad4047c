"""Built-in plugins (``plugins.fs``, ``shell``, ``web``, ``python``, ``notes``) and the host.

``import plugins`` stays cheap: every worker that serves a built-in imports
this package first. The host and discovery load on first use:

- ``open_plugin_host``, ``PluginHost``: load plugins, one registry of their tools.
- ``LoadedPlugin``, ``PluginLoadError``: what ``tak plugins ls`` shows.
- ``discover_plugins``, ``PluginSource``: entry points and workspace plugins.
- ``BUILTIN_PLUGINS``, ``ENTRY_POINT_GROUP``, ``WORKSPACE_PLUGIN_DIR``.

See docs/plugins.md.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kernel._lazy import lazy_exports

_EXPORTS: dict[str, str] = {
    "open_plugin_host": "_host",
    "PluginHost": "_host",
    "LoadedPlugin": "_host",
    "PluginLoadError": "_host",
    "PluginSpec": "_host",
    "PROBE_POLICY": "_host",
    "PluginSource": "_discovery",
    "discover_plugins": "_discovery",
    "source_for": "_discovery",
    "BUILTIN_PLUGINS": "_discovery",
    "ENTRY_POINT_GROUP": "_discovery",
    "WORKSPACE_PLUGIN_DIR": "_discovery",
}

__all__ = list(_EXPORTS)

if TYPE_CHECKING:
    from ._discovery import BUILTIN_PLUGINS as BUILTIN_PLUGINS
    from ._discovery import ENTRY_POINT_GROUP as ENTRY_POINT_GROUP
    from ._discovery import WORKSPACE_PLUGIN_DIR as WORKSPACE_PLUGIN_DIR
    from ._discovery import PluginSource as PluginSource
    from ._discovery import discover_plugins as discover_plugins
    from ._discovery import source_for as source_for
    from ._host import PROBE_POLICY as PROBE_POLICY
    from ._host import LoadedPlugin as LoadedPlugin
    from ._host import PluginHost as PluginHost
    from ._host import PluginLoadError as PluginLoadError
    from ._host import PluginSpec as PluginSpec
    from ._host import open_plugin_host as open_plugin_host


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
