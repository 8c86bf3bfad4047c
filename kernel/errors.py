"""The project's exception tree: every public exception of ``kernel``, ``sandbox``
and ``plugins``, where it is defined, and what it means.

::

    KernelError
    ├── UsageError              a caller's mistake: bad arguments, duplicate tool names, bad keys
    │   ├── TurnRunning         a turn of the session already runs in this process
    │   ├── ArgumentError       a tool's arguments failed its schema (kernel.tools)
    │   ├── FieldRefused        a record's validator refused a field (kernel.messages; a ValueError)
    │   └── TrustError          a plugin cannot be hashed, or the trust file is unusable (plugins)
    ├── StoreError              the session store could not do what was asked
    │   └── CorruptTranscript   a transcript is damaged somewhere other than its last line
    ├── SandboxError            the sandbox refused something, or could not confine
    │   ├── WorkspaceRefused    the workspace named overlaps what it may not (also a UsageError)
    │   └── WorkerCallError     a call to a confined worker failed; ``kind`` says how (sandbox)
    ├── ModelAPIError           an LLM provider answered with an error
    │   └── ProviderError       which provider, the status, whether a retry may help (kernel.models)
    ├── ProtocolError           a peer broke a protocol (or a frame would break it)
    │   ├── FrameError          a client frame the server refuses, as an error frame (kernel.wire)
    │   ├── HandshakeRefused    the server refused the WebSocket handshake (kernel.wire)
    │   ├── ConnectionLost      the connection ended before the reply came (kernel.wire)
    │   ├── RequestFailed       the reply was an error, or the request was cancelled (kernel.wire)
    │   ├── WorkerFrameError    a frame to or from a sandbox worker (sandbox)
    │   ├── BrokerError         a frame on a worker's network broker channel (sandbox)
    │   └── LineTooLong         an MCP server's line past the limit (plugins; a ValueError)
    ├── ToolFailure             raised by a tool to choose its observation's kind (kernel.tools)
    └── FetchError              the ``web`` plugin could not fetch a URL (plugins.web)
        ├── DNSError            the host name does not resolve
        ├── TLSError            TLS handshake or certificate failure
        ├── ConnectionFailed    refused, reset, unreachable
        ├── HTTPStatusError     a 4xx or 5xx response
        ├── TooManyRedirects    more redirects than ``MAX_REDIRECTS``
        └── ResponseTooLarge    more than the call's ``max_bytes``

Tool failures are never raised to the caller of ``run_tool_calls``: they
become observations (see ``kernel.messages.ToolError``). A class drawn with
"a ValueError" is one too, so ``except ValueError`` still catches it.

Exceptions whose name starts with an underscore stay outside the tree: each is
raised and caught inside its own module (``sandbox._workspace._TreeChanged``,
``plugins.fs._OutOfTime``, ...) and no caller sees it. tests/test_errors_tree.py
checks that every other exception class is drawn here, under its parent.
"""

from __future__ import annotations

__all__ = [
    "CorruptTranscript",
    "KernelError",
    "ModelAPIError",
    "ProtocolError",
    "SandboxError",
    "StoreError",
    "TurnRunning",
    "UsageError",
    "WorkspaceRefused",
]


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
