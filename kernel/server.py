"""Moved to ``kernel.wire`` (``kernel/wire/_server.py``); this path keeps working."""

from __future__ import annotations

from .wire._limits import ServerLimits as ServerLimits
from .wire._server import serve_websocket as serve_websocket

__all__ = ["ServerLimits", "serve_websocket"]
