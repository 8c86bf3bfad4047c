"""What the MCP tests share (a module of its own: a second ``conftest`` would shadow
tests/plugins' when both directories are collected)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from kernel.home import McpServerConfig

SERVER = str(Path(__file__).with_name("server.py"))


def stdio_server(**options: Any) -> McpServerConfig:
    """The test server over stdio (tests/mcp/server.py)."""
    return McpServerConfig(command=sys.executable, args=[SERVER], **options)
