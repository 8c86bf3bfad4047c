"""A stdio MCP server in plain Python (no SDK): newline-delimited JSON-RPC 2.0 on
stdin/stdout, as the MCP stdio transport specifies. It starts in a few tens of
milliseconds where the SDK's ``MCPServer`` takes about a second of CPU, for the
tests whose subject is the kernel's side (what a server's text does to a
terminal, a command that lists or calls a server's tools); the SDK's and npm's
servers stay in the tests of the protocol itself (tests/mcp).

``python light_server.py SPEC`` serves the tools of ``SPEC``, a JSON file::

    {"name": "light", "stderr": "printed once at start",
     "tools": [{"name": "say", "description": "...", "reply": "fixed text"},
               {"name": "echo", "description": "...", "echo": "text"}]}

A tool with ``reply`` answers that text; one with ``echo`` answers its argument of
that name. ``initialize``, ``ping``, ``tools/list`` and ``tools/call`` are answered;
notifications are read and ignored; any other request is a ``-32601`` error.
"""

from __future__ import annotations

import json
import sys
from typing import Any


def _schema(tool: dict[str, Any]) -> dict[str, Any]:
    if "echo" in tool:
        name = tool["echo"]
        return {"type": "object", "properties": {name: {"type": "string"}}, "required": [name]}
    return {"type": "object", "properties": {}}


def _answer(spec: dict[str, Any], method: str, params: dict[str, Any]) -> dict[str, Any]:
    tools = {t["name"]: t for t in spec["tools"]}
    if method == "initialize":
        return {
            "protocolVersion": params.get("protocolVersion", "2025-06-18"),
            "capabilities": {"tools": {"listChanged": False}},
            "serverInfo": {"name": spec.get("name", "light"), "version": "1"},
        }
    if method == "ping":
        return {}
    if method == "tools/list":
        return {
            "tools": [
                {
                    "name": t["name"],
                    "description": t.get("description", ""),
                    "inputSchema": _schema(t),
                }
                for t in spec["tools"]
            ]
        }
    if method == "tools/call":
        tool = tools.get(params.get("name", ""))
        if tool is None:
            raise LookupError(f"no tool {params.get('name')!r}")
        arguments = params.get("arguments") or {}
        text = str(arguments.get(tool["echo"], "")) if "echo" in tool else tool["reply"]
        return {"content": [{"type": "text", "text": text}], "isError": False}
    raise NotImplementedError(method)


def main(path: str) -> None:
    with open(path, encoding="utf-8") as f:
        spec = json.load(f)
    if spec.get("stderr"):
        print(spec["stderr"], file=sys.stderr, flush=True)
    for line in sys.stdin:
        if not line.strip():
            continue
        message = json.loads(line)
        if "id" not in message or "method" not in message:
            continue  # a notification, or a reply to a request this server never sends
        reply: dict[str, Any] = {"jsonrpc": "2.0", "id": message["id"]}
        try:
            reply["result"] = _answer(spec, message["method"], message.get("params") or {})
        except NotImplementedError:
            reply["error"] = {"code": -32601, "message": f"no method {message['method']}"}
        except LookupError as exc:
            reply["error"] = {"code": -32602, "message": str(exc)}
        sys.stdout.write(json.dumps(reply) + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    main(sys.argv[1])
