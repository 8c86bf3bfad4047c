"""The kernel's exception tree.

::

    KernelError
    ├── UsageError            a caller's mistake: bad arguments, duplicate tool names, bad keys
    │   └── TurnRunning       a turn of the session already runs in this process
    ├── StoreError            the session store could not do what was asked
    │   └── CorruptTranscript a transcript is damaged somewhere other than its last line
    ├── SandboxError          the sandbox refused something, or could not confine
    │   └── WorkspaceRefused  the workspace named overlaps what it may not (also a UsageError)
    ├── ModelAPIError         an LLM provider answered with an error
    └── ProtocolError         a WebSocket peer broke the protocol

Tool failures are never raised to the caller of ``run_tool_calls``: they
become observations (see ``kernel.messages.ToolError``).
"""

from __future__ import annotations


class KernelError(Exception):
    """Root of every error the kernel raises on purpose."""


class UsageError(KernelError):
    """The caller used the API wrongly; the message says what and where."""


class TurnRunning(UsageError):
    """A turn of the session is already running in this process (a resume refuses)."""


class StoreError(KernelError):
    """The session store failed."""


class CorruptTranscript(StoreError):
    """A transcript has damage that cannot be repaired by truncating a torn tail."""

    def __init__(self, path: str, line: int, reason: str) -> None:
        super().__init__(f"{path}:{line}: {reason}")
        self.path = path
        self.line = line
        self.reason = reason


class SandboxError(KernelError):
    """The sandbox refused an operation, or confinement could not be applied."""


class WorkspaceRefused(SandboxError, UsageError):
    """The workspace named overlaps the interpreter, site-packages, the kernel's
    packages or ``$TAK_HOME``: the caller's choice of directory is wrong (bad input,
    exit 2), and the sandbox is what refuses it."""


class ModelAPIError(KernelError):
    """An LLM provider returned an error."""


class ProtocolError(KernelError):
    """A peer sent something the protocol does not allow."""
