"""The MCP server side: a kernel's tools served to any MCP client (docs/mcp.md).

Floor 7 (front doors), beside the WebSocket wire: it serves a ``Kernel``. The MCP
client (servers as a tool source) is ``plugins._mcp``, floor 4, beside the plugin
host whose approvals it shares. ``import kernel.mcp`` does not import the SDK.
"""

from ._server import MCP_PATH as MCP_PATH
from ._server import claim_stdio as claim_stdio
from ._server import guarded_app as guarded_app
from ._server import mcp_server as mcp_server
from ._server import serve_http as serve_http
from ._server import serve_stdio as serve_stdio

__all__ = ["MCP_PATH", "claim_stdio", "guarded_app", "mcp_server", "serve_http", "serve_stdio"]
