"""The plugins floor: loading plugins, the host, the worker program, the built-ins.

Above the authoring API (``kernel.plugin``) and the sandbox's mechanism
(``sandbox``), below the agent. Built-in plugins: ``plugins.fs``, ``shell``,
``web``, ``python``, ``notes``. The worker program every plugin worker runs is
``python -I -m plugins._worker FD`` (confine, load the plugin, serve frames).

``import plugins`` stays cheap: every worker imports this package first. The
host and discovery load on first use:

- ``open_plugin_host``, ``PluginHost``: load plugins, one registry of their tools.
- ``LoadedPlugin``, ``PluginLoadError``: what ``tak plugins ls`` shows.
- ``discover_plugins``, ``PluginSource``: entry points and workspace plugins.
- ``BUILTIN_PLUGINS``, ``ENTRY_POINT_GROUP``, ``WORKSPACE_PLUGIN_DIR``.
- ``policy_for``: a plugin's ``Permissions`` as the sandbox's ``Policy``;
  ``remote_tools``: a started ``sandbox.Worker``'s tools, ready for the executor.
- ``find_plugin``, ``load_plugin``: the ``Plugin`` in a module or target.
- ``trust_plugin``, ``TrustStore``, ``TrustedPlugin``, ``TRUST_FILE``,
  ``source_key``: approvals of discovered plugins (``tak plugins trust``);
  ``approval_states``, ``ApprovalState``: whether each is approved as it is now
  (``tak doctor``).
- ``scaffold_plugin``, ``package_name``: a new plugin project (``tak plugins new``).
- ``open_mcp_servers``, ``McpServers``, ``McpServerInfo``: MCP servers as a tool
  source (docs/mcp.md; the ``mcp`` package loads only when a server starts).
- ``trust_mcp_server``, ``mcp_approval``, ``McpTrustStore``, ``TrustedMcpServer``,
  ``MCP_TRUST_FILE``: approvals of stdio MCP servers (``tak mcp trust``).

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
    "trust_plugin": "_host",
    "tak_command": "_host",
    "python_command": "_host",
    "SkipReport": "_host",
    "policy_for": "_remote",
    "remote_tools": "_remote",
    "find_plugin": "_loading",
    "load_plugin": "_loading",
    "TrustStore": "_trust",
    "TrustedPlugin": "_trust",
    "TrustError": "_trust",
    "TRUST_FILE": "_trust",
    "source_key": "_trust",
    "approval_states": "_trust",
    "ApprovalState": "_trust",
    "scaffold_plugin": "_scaffold",
    "package_name": "_scaffold",
    "PluginSource": "_discovery",
    "discover_plugins": "_discovery",
    "source_for": "_discovery",
    "BUILTIN_PLUGINS": "_discovery",
    "ENTRY_POINT_GROUP": "_discovery",
    "WORKSPACE_PLUGIN_DIR": "_discovery",
    "open_mcp_servers": "_mcp",
    "McpServers": "_mcp",
    "McpServerInfo": "_mcp",
    "trust_mcp_server": "_mcp",
    "mcp_approval": "_mcp",
    "McpTrustStore": "_trust",
    "TrustedMcpServer": "_trust",
    "MCP_TRUST_FILE": "_trust",
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
    from ._host import SkipReport as SkipReport
    from ._host import open_plugin_host as open_plugin_host
    from ._host import python_command as python_command
    from ._host import tak_command as tak_command
    from ._host import trust_plugin as trust_plugin
    from ._loading import find_plugin as find_plugin
    from ._loading import load_plugin as load_plugin
    from ._mcp import McpServerInfo as McpServerInfo
    from ._mcp import McpServers as McpServers
    from ._mcp import mcp_approval as mcp_approval
    from ._mcp import open_mcp_servers as open_mcp_servers
    from ._mcp import trust_mcp_server as trust_mcp_server
    from ._remote import policy_for as policy_for
    from ._remote import remote_tools as remote_tools
    from ._scaffold import package_name as package_name
    from ._scaffold import scaffold_plugin as scaffold_plugin
    from ._trust import MCP_TRUST_FILE as MCP_TRUST_FILE
    from ._trust import TRUST_FILE as TRUST_FILE
    from ._trust import ApprovalState as ApprovalState
    from ._trust import McpTrustStore as McpTrustStore
    from ._trust import TrustedMcpServer as TrustedMcpServer
    from ._trust import TrustedPlugin as TrustedPlugin
    from ._trust import TrustError as TrustError
    from ._trust import TrustStore as TrustStore
    from ._trust import approval_states as approval_states
    from ._trust import source_key as source_key


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
