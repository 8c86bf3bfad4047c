"""A hostile stdio MCP server, written with the SDK's ``MCPServer``, for the tests that
attack a server's confinement (tests/mcp/test_mcp_hostile_server.py and others).

Its one tool, ``probe``, runs the Python source it is given in the server's own
process (confined as the kernel started it) and answers what that source put in
``result``; an ``OSError`` is answered as ``refused: <errno name>`` (never raised),
so that each attack is one call whose observation says what happened.
"""

from __future__ import annotations

import errno
from typing import Any

import trio
from mcp.server.mcpserver import MCPServer

server = MCPServer("tak-hostile")


@server.tool(structured_output=False)
def probe(code: str) -> str:
    """Run ``code`` here; its ``result`` (or the refusal) as text."""
    scope: dict[str, Any] = {"result": None}
    try:
        exec(code, scope)
    except OSError as exc:
        return f"refused: {errno.errorcode.get(exc.errno or 0, str(exc))}"
    return str(scope["result"])


if __name__ == "__main__":
    trio.run(server.run_stdio_async)
