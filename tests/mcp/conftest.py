from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

from kernel.home import McpServerConfig

SERVER = str(Path(__file__).with_name("server.py"))


def stdio_server(**options: Any) -> McpServerConfig:
    """The test server over stdio (tests/mcp/server.py)."""
    return McpServerConfig(command=sys.executable, args=[SERVER], **options)


@pytest.fixture
def server_config() -> McpServerConfig:
    return stdio_server(startup_timeout=10)
