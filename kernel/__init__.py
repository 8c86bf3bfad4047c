"""trio-agent-kernel: parallel tool calls that fail alone, durable sessions, confined plugins.

``import kernel`` stays cheap (every sandbox worker imports it): the public
names below load their modules on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ._lazy import lazy_exports
from ._version import __version__ as __version__

_EXPORTS: dict[str, str] = {
    # data
    "ToolCall": "messages",
    "Observation": "messages",
    "ToolError": "messages",
    "ToolOutput": "messages",
    "Attachment": "messages",
    "Message": "messages",
    "Text": "messages",
    "converter": "messages",
    "ERROR_KINDS": "messages",
    # tools
    "Tool": "tools",
    "tool": "tools",
    "ToolRegistry": "tools",
    "ToolFailure": "tools",
    # plugins
    "Plugin": "plugin",
    "Permissions": "plugin",
    "ToolContext": "plugin",
    "context": "plugin",
    # executor
    "run_tool_calls": "executor",
    "CallLimits": "executor",
    "BatchHandle": "executor",
    "CallStarted": "executor",
    "CallFinished": "executor",
    "CallEvent": "executor",
    "ordered_observations": "executor",
    # embedding
    "Kernel": "kernel",
    "open_kernel": "kernel",
    "IdleSessions": "kernel",
    "Agent": "agent",
    "RunLimits": "agent",
    "TurnFinished": "agent",
    "Session": "session",
    # the WebSocket protocol's client
    "open_client": "wire",
    # errors
    "KernelError": "errors",
    "UsageError": "errors",
    "TurnRunning": "errors",
    "StoreError": "errors",
    "CorruptTranscript": "errors",
    "SandboxError": "errors",
    "ModelAPIError": "errors",
    "ProtocolError": "errors",
}

__all__ = [*_EXPORTS, "__version__"]

if TYPE_CHECKING:
    from .agent import Agent as Agent
    from .agent import RunLimits as RunLimits
    from .agent import TurnFinished as TurnFinished
    from .errors import CorruptTranscript as CorruptTranscript
    from .errors import KernelError as KernelError
    from .errors import ModelAPIError as ModelAPIError
    from .errors import ProtocolError as ProtocolError
    from .errors import SandboxError as SandboxError
    from .errors import StoreError as StoreError
    from .errors import TurnRunning as TurnRunning
    from .errors import UsageError as UsageError
    from .executor import BatchHandle as BatchHandle
    from .executor import CallEvent as CallEvent
    from .executor import CallFinished as CallFinished
    from .executor import CallLimits as CallLimits
    from .executor import CallStarted as CallStarted
    from .executor import ordered_observations as ordered_observations
    from .executor import run_tool_calls as run_tool_calls
    from .kernel import IdleSessions as IdleSessions
    from .kernel import Kernel as Kernel
    from .kernel import open_kernel as open_kernel
    from .messages import ERROR_KINDS as ERROR_KINDS
    from .messages import Attachment as Attachment
    from .messages import Message as Message
    from .messages import Observation as Observation
    from .messages import Text as Text
    from .messages import ToolCall as ToolCall
    from .messages import ToolError as ToolError
    from .messages import ToolOutput as ToolOutput
    from .messages import converter as converter
    from .plugin import Permissions as Permissions
    from .plugin import Plugin as Plugin
    from .plugin import ToolContext as ToolContext
    from .plugin import context as context
    from .session import Session as Session
    from .tools import Tool as Tool
    from .tools import ToolFailure as ToolFailure
    from .tools import ToolRegistry as ToolRegistry
    from .tools import tool as tool
    from .wire import open_client as open_client


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
