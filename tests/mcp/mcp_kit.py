"""What the MCP tests share (a module of its own: a second ``conftest`` would shadow
tests/plugins' when both directories are collected)."""

from __future__ import annotations

import json
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from kernel.home import McpServerConfig

SERVER = str(Path(__file__).with_name("server.py"))
LIGHT_SERVER = str(Path(__file__).with_name("light_server.py"))
#: The light server's echo tool, as tests/mcp/server.py's ``echo``.
ECHO: Mapping[str, str] = {"name": "echo", "description": "Say ``text`` back.", "echo": "text"}


def light_server_args(
    directory: Path,
    tools: Sequence[Mapping[str, str]] = (ECHO,),
    *,
    name: str = "light",
    stderr: str = "",
) -> list[str]:
    """The arguments that run tests/mcp/light_server.py with ``tools`` (its ``SPEC``
    written into ``directory``), for tests whose subject is the kernel's side."""
    spec = directory / f"{name}.mcp.json"
    spec.write_text(json.dumps({"name": name, "stderr": stderr, "tools": list(tools)}))
    return [LIGHT_SERVER, str(spec)]


def stdio_server(**options: Any) -> McpServerConfig:
    """The test server over stdio (tests/mcp/server.py)."""
    return McpServerConfig(command=sys.executable, args=[SERVER], **options)
