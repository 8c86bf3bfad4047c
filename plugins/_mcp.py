"""MCP servers as a tool source: each server's tools join the kernel's registry.

One ``McpServer`` per ``[mcp.servers.NAME]`` of tak.toml. Its guarantees:

1. One owner task per connection, in the nursery of ``open_mcp_servers``: the
   task enters the transport and the ``ClientSession`` and leaves them (a
   session entered in one task and left in another crashes under Trio); calls
   use the session it hands out (``nursery.start``) from their own tasks.
2. Lazy by default: the process starts on first need (the tool list before a
   turn, or a call); ``start = "eager"`` starts it when the kernel opens.
3. A server that fails to start, dies or stops answering never raises into
   the kernel: calls in flight when the connection closes get ``crashed``,
   a call past its deadline ``timeout`` (the executor's, from ``timeout``);
   the next call restarts it, after a backoff when starting keeps failing.
4. Tools are ``NAME.tool``, their arguments checked by the kernel against the
   server's JSON Schema before anything is sent; the list is cached, and
   fetched again after ``notifications/tools/list_changed`` or a restart.
5. Leaving ``open_mcp_servers`` closes every connection within a bounded time
   (stdin closed, then SIGTERM, then SIGKILL to a stdio server's process group).
6. A stdio server runs confined like a plugin worker: the kernel starts the
   launcher ``sandbox.exec`` (from one thread that lives as long as the servers,
   for ``PDEATHSIG``: ``sandbox.pool``), which confines itself to the server's
   permissions and execs it; a layer that cannot be applied fails the start
   (unless ``allow_unsandboxed``). What was applied is in ``McpServerInfo``.
7. Given a ``home``, a stdio server runs only once approved (``tak mcp trust
   NAME``: the digest of its program and of the code it runs, arguments, env and
   permissions, ``read`` paths resolved); any change
   voids the approval, and its calls are ``denied`` observations that name the
   command to run. Servers the caller ``vouched`` for (named in code) need none.
8. An HTTP server is reached at its ``url`` only: redirects are not followed.

The ``mcp`` package (``tak[mcp]``) is imported here only when a server starts,
never by ``import plugins``.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import logging
import math
import os
import re
import shutil
import signal
import subprocess
import tempfile
from collections.abc import AsyncIterator, Callable, Collection, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, TextIO

import attrs
import trio

from kernel.errors import KernelError, ProtocolError, SandboxError, UsageError
from kernel.home import McpServerConfig, TakHome
from kernel.messages import Attachment, AttachmentKind, ToolOutput
from kernel.tools import RunContext, Tool, ToolFailure, ToolRegistry
from sandbox.exec import (
    ExecPolicy,
    cgroups_limit_memory,
    launcher_argv,
    make_cgroups,
    parse_report,
    program_files,
    remove_cgroups,
    resolve_program,
)
from sandbox.pool import Spawner

from ._trust import (
    MAX_BYTES,
    MCP_TRUST_FILE,
    McpPermissions,
    McpTrustStore,
    TrustedMcpServer,
    TrustError,
    server_code,
)

if TYPE_CHECKING:
    from mcp import ClientSession
    from mcp.types import CallToolResult

    from sandbox import Confinement

logger = logging.getLogger("tak.mcp")

State = Literal[
    "not started", "not approved", "starting", "running", "failed", "crashed", "stopped"
]

#: Seconds before restarting a server whose start failed, doubled on each failure.
FIRST_BACKOFF = 1.0
MAX_BACKOFF = 30.0
#: Seconds a server that missed a call's deadline has to answer a ping (at most its
#: ``startup_timeout``) before it is replaced.
PING_TIMEOUT = 5.0
#: Seconds leaving ``open_mcp_servers`` may take to close every server.
CLOSE_TIMEOUT = 5.0
#: Seconds a stdio server has to exit once its stdin is closed, then once sent SIGTERM.
EXIT_GRACE = 2.0
#: The longest line (one JSON-RPC message) a stdio server may send: a result with
#: all the attachments a result keeps (20 MiB decoded, ``MAX_ATTACHMENTS_BYTES``: 27 MiB
#: of base64) and its text (100 kB by default), with room for JSON's escapes. A longer
#: line stops the server; the kernel never buffers more of it than this.
MAX_LINE_BYTES = 32 * 1024 * 1024
#: A line at least this long is parsed in a thread (pydantic takes ~10 ms a MiB).
_PARSE_IN_THREAD_BYTES = 1024 * 1024
#: Bytes of a tool name on the wire (OpenAI, Anthropic): ``.`` is sent as ``__``.
_MAX_WIRE_NAME = 64
_BAD_NAME_CHARS = re.compile(r"[^A-Za-z0-9_.-]")


@attrs.frozen
class McpServerInfo:
    """One server as ``tak mcp ls`` shows it.

    Attributes:
        name: its name in tak.toml (the tools' namespace).
        transport: ``stdio`` or ``http``.
        state: ``not started``, ``starting``, ``running``, ``failed`` (could
            not start), ``crashed`` (its connection closed), ``stopped``.
        tools: the kernel names of its tools, as last listed.
        errors: what went wrong, one line each (a failed start, a tool left out).
        restarts: how many times it was started again after the first.
        approval: ``approved``, ``not approved``, ``changed: ...`` (void), ``vouched``
            (named in code: none needed), ``not needed`` (HTTP) or ``not checked``.
        confinement: what its launcher applied (stdio, once started), one line.
    """

    name: str
    transport: Literal["stdio", "http"]
    state: State
    tools: tuple[str, ...]
    errors: tuple[str, ...]
    restarts: int
    approval: str = "not checked"
    confinement: str | None = None


def kernel_tool_name(server: str, remote: str) -> str:
    """``server.remote`` made a valid kernel tool name, within the wire's 64 characters.

    Characters a provider refuses become ``_``; a name too long (``.`` counts as
    two, ``__`` on the wire) is cut and ends with a hash of the whole, so two
    long names stay apart.
    """
    clean = _BAD_NAME_CHARS.sub("_", remote) or "_"
    name = f"{server}.{clean}"
    if len(name.replace(".", "__")) <= _MAX_WIRE_NAME and clean == remote:
        return name
    digest = hashlib.sha256(remote.encode()).hexdigest()[:8]
    while len(f"{name}-{digest}".replace(".", "__")) > _MAX_WIRE_NAME:
        name = name[:-1]
    return f"{name}-{digest}"


def observation_output(result: CallToolResult) -> str | ToolOutput:
    """What the model gets of an MCP result: text as is; images, audio and
    binary resources as attachments (``ToolOutput``; the text alone when there
    are none); a resource link as a one-line placeholder; structured content
    as JSON after the text (unless a text part already says the same).

    Media that is not base64, or whose media type is none, becomes a line of
    text saying so: the call succeeded, and the model should know what it missed.

    Raises:
        ToolFailure: ``isError``: kind ``exception``, with the server's text
            (and a placeholder line for each attachment: a failure is text only).
    """
    from mcp import types

    parts: list[str] = []
    values: list[Any] = []  # each text part, as JSON when it is JSON
    attachments: list[Attachment] = []

    def attach(kind: AttachmentKind, media_type: str, data: str, uri: str | None) -> None:
        try:
            attachments.append(Attachment(kind, media_type, data, uri=uri))
        except ValueError as exc:  # FieldRefused: not base64, or not a media type
            where = f"{uri}, " if uri else ""
            parts.append(f"[{kind}: {where}{media_type}, not kept: {exc}]")

    for item in result.content:
        if isinstance(item, types.TextContent):
            parts.append(item.text)
            try:
                values.append(json.loads(item.text))
            except ValueError:
                values.append(item.text)
        elif isinstance(item, types.ImageContent):
            attach("image", item.mime_type, item.data, None)
        elif isinstance(item, types.AudioContent):
            attach("audio", item.mime_type, item.data, None)
        elif isinstance(item, types.ResourceLink):
            mime = f", {item.mime_type}" if item.mime_type else ""
            parts.append(f"[resource link: {item.uri}{mime}]")
        elif isinstance(item, types.EmbeddedResource):
            resource = item.resource
            if isinstance(resource, types.TextResourceContents):
                parts.append(f"[resource: {resource.uri}]\n{resource.text}")
            else:
                mime = resource.mime_type or "application/octet-stream"
                attach("resource", mime, resource.blob, str(resource.uri))
        else:  # a content type of a later protocol version
            parts.append(f"[{getattr(item, 'type', 'unknown')} content]")  # type: ignore[unreachable]
    structured = result.structured_content
    if structured is not None and not _said(structured, values):
        parts.append(json.dumps(structured, ensure_ascii=False))
    if result.is_error:
        text = "\n".join(parts + [f"[{a.describe()}]" for a in attachments])
        raise ToolFailure("exception", text or "the MCP server reported an error", type="McpError")
    text = "\n".join(parts)
    return ToolOutput(text, attachments) if attachments else text


def _said(structured: Any, values: list[Any]) -> bool:
    # Servers send structured content in a text part too (the spec asks them to),
    # and the SDK's servers wrap a plain return value as {"result": value} (a list
    # as one text part per item): don't say it twice.
    if structured in values:
        return True
    if isinstance(structured, dict) and list(structured) == ["result"]:
        value = structured["result"]
        return value in values or value == values
    return False


@attrs.frozen
class _Launch:
    """What the stdio servers of one ``open_mcp_servers`` share.

    Attributes:
        spawner: the thread every launcher is forked from (``PDEATHSIG`` follows it).
        state_dir: ``NAME/`` in it is each server's own directory (``HOME``, ``TMPDIR``).
        workspace: the kernel's workspace (``None``: none to grant).
        home: where approvals are kept (``None``: none are checked).
        vouched: servers named in code, which need no approval.
        allow_unsandboxed: run a server whose confinement is incomplete.
    """

    spawner: Spawner
    state_dir: Path | None = None
    workspace: Path | None = None
    home: TakHome | None = None
    vouched: frozenset[str] = frozenset()
    allow_unsandboxed: bool = False


def _missing_program(config: McpServerConfig) -> str | None:
    """Why a stdio server's program cannot be found, or ``None`` when it can."""
    assert config.command is not None
    try:
        resolve_program(config.command, path=server_environment(config).get("PATH"), cwd=config.cwd)
    except SandboxError as exc:
        return str(exc)
    return None


#: What a stdio server inherits of the kernel's environment: the variables the MCP SDK's
#: stdio client passes on POSIX (``mcp.client.stdio.DEFAULT_INHERITED_ENV_VARS``),
#: written out here because importing that module to read them costs a second of CPU
#: (every `tak mcp ls`, `tak mcp trust` and missing-program check paid it).
INHERITED_ENV_VARS = ("HOME", "LOGNAME", "PATH", "SHELL", "TERM", "USER")


def server_environment(config: McpServerConfig) -> dict[str, str]:
    """A stdio server's environment: a few safe variables (``PATH``, ``HOME``, ...) and
    its ``env``, never the kernel's whole environment (keys, tokens). A value that is
    a shell function (``() {...``) is not passed on, as the SDK does."""
    inherited = {
        key: value
        for key in INHERITED_ENV_VARS
        if (value := os.environ.get(key)) is not None and not value.startswith("()")
    }
    return {**inherited, **config.env}


def mcp_approval(name: str, config: McpServerConfig) -> TrustedMcpServer:
    """The approval ``config`` needs as it is now (blocking: it hashes the program).

    Raises:
        SandboxError: the command is not found.
        TrustError: its code is too large to hash (``server_code``).
        OSError: a file of the program cannot be read.
    """
    assert config.command is not None
    env = server_environment(config)
    command = resolve_program(config.command, path=env.get("PATH"), cwd=config.cwd)
    argv = [command, *config.args]
    files = program_files(argv, path=env.get("PATH"), cwd=config.cwd)
    code = server_code(argv, files.executables, files.prefixes, env=env, cwd=config.cwd)
    env_digest = hashlib.sha256(json.dumps(sorted(config.env.items())).encode()).hexdigest()
    return TrustedMcpServer(
        name=name,
        command=command,
        executables=files.executables,
        sha256=_code_digest(files.digest(), code),
        args=tuple(config.args),
        cwd=config.cwd,
        env_sha256=env_digest,
        permissions=McpPermissions(
            workspace=config.workspace,
            network=tuple(config.network),
            subprocess=config.subprocess,
            # Resolved: a link retargeted after the approval voids it.
            read=tuple(os.path.realpath(os.path.expanduser(p)) for p in config.read),
        ),
    )


def _code_digest(program: str, code: Sequence[tuple[str, str]]) -> str:
    """SHA-256 over the program's digest and ``code``'s names and bytes (``MAX_BYTES`` at
    most).

    Raises:
        TrustError: more than ``MAX_BYTES``.
        OSError: a file cannot be read.
    """
    if not code:
        return program  # as approvals made before code was followed
    total = hashlib.sha256(program.encode())
    size = 0
    for name, path in code:
        total.update(f"\0{name}\0".encode())
        with open(path, "rb") as f:
            while chunk := f.read(1 << 20):
                size += len(chunk)
                if size > MAX_BYTES:
                    raise TrustError(f"{name}: more than {MAX_BYTES} bytes of code to hash")
                total.update(chunk)
    return total.hexdigest()


def trust_mcp_server(home: TakHome, name: str, config: McpServerConfig) -> TrustedMcpServer:
    """Approve the stdio server ``name`` as ``config`` says (``tak mcp trust NAME``).

    Raises:
        UsageError: it is an HTTP server (nothing runs here to approve).
        SandboxError: its command is not found.
        TrustError: the approvals file cannot be read or written, or its code is too
            large to hash.
        OSError: a file of the program cannot be read.
    """
    if config.command is None:
        raise UsageError(f"MCP server {name!r} is an HTTP server: it runs elsewhere, not here")
    approval = mcp_approval(name, config)
    McpTrustStore(home.config / MCP_TRUST_FILE).approve(approval)
    return approval


def approval_status(
    home: TakHome, name: str, config: McpServerConfig
) -> tuple[bool, str, TrustedMcpServer | None]:
    """``(approved, in words, the approval in force)`` for a stdio server (blocking)."""
    try:
        recorded = McpTrustStore(home.config / MCP_TRUST_FILE).load().get(name)
    except KernelError as exc:
        return False, f"not approved: {exc}", None
    if recorded is None:
        return False, "not approved", None
    try:
        now = mcp_approval(name, config)
    except (SandboxError, TrustError, OSError) as exc:
        return False, f"approval void: {_reason(exc)}", recorded
    changes = recorded.changes(now)
    if changes:
        return False, "approval void: " + ", ".join(changes), recorded
    return True, "approved", recorded


def trust_hint(home: TakHome, name: str) -> str:
    """The command that approves ``name``, runnable as printed."""
    from ._host import tak_command

    try:
        default = TakHome.locate().root == home.root
    except Exception:
        default = False
    return tak_command(*(() if default else ("--home", str(home.root))), "mcp", "trust", name)


class McpServer:
    """One configured server: its connection's owner task, its tools, its state."""

    def __init__(
        self,
        name: str,
        config: McpServerConfig,
        *,
        nursery: trio.Nursery,
        registry: ToolRegistry,
        log_dir: Path | None = None,
        launch: _Launch,
    ) -> None:
        self.name = name
        self.config = config
        self._nursery = nursery
        self._registry = registry
        self._log_dir = log_dir
        self._launch = launch
        self._approval = (
            "not needed"
            if config.url is not None
            else "vouched"
            if self._launch.home is None or name in self._launch.vouched
            else "not checked"
        )
        self._confinement: str | None = None
        self._approved_read: tuple[str, ...] | None = None  # resolved when approved
        self._session: ClientSession | None = None
        self._stop: trio.Event | None = None  # set: the owner task leaves the session
        self._closed: trio.Event | None = None  # set by the owner task when it has left
        self._lock = trio.Lock()
        self._state: State = "not started"
        self._start_error: str | None = None
        self._tool_errors: list[str] = []
        self._failures = 0
        self._retry_at = -math.inf
        self._starts = 0
        self._listed = False
        self._remote_names: dict[str, str] = {}  # kernel name -> the server's name
        self._suspect = False  # a call timed out: ping before the next one
        self._transport_error: str | None = None  # why the transport stopped the server

    @property
    def transport(self) -> Literal["stdio", "http"]:
        return "http" if self.config.url is not None else "stdio"

    def info(self) -> McpServerInfo:
        errors = [e for e in (self._start_error, self._transport_error) if e] + self._tool_errors
        return McpServerInfo(
            name=self.name,
            transport=self.transport,
            state=self._state,
            tools=tuple(self._remote_names),
            errors=tuple(errors),
            restarts=max(self._starts - 1, 0),
            approval=self._approval,
            confinement=self._confinement,
        )

    @property
    def needs_approval(self) -> bool:
        return self.config.command is not None and self._approval not in ("vouched", "not needed")

    async def _check_approval(self) -> None:
        """Raises: ToolFailure: ``denied``: not approved, or the approval is void."""
        home = self._launch.home
        if not self.needs_approval or home is None:
            return
        approved, words, recorded = await trio.to_thread.run_sync(
            approval_status, home, self.name, self.config
        )
        self._approval = words
        if approved:
            assert recorded is not None
            self._approved_read = recorded.permissions.read
            return
        missing = await trio.to_thread.run_sync(_missing_program, self.config)
        if missing is not None:
            # No approval could help: say what is missing, not a trust command that fails.
            self._state = "failed"
            self._start_error = missing
            raise ToolFailure("crashed", f"MCP server {self.name!r}: {missing}", type="McpStart")
        if self._state != "not approved":
            logger.warning(
                "MCP server %r: %s: run `%s`", self.name, words, trust_hint(home, self.name)
            )
        self._state = "not approved"
        hint = trust_hint(home, self.name)
        self._start_error = f"{words}; it runs only once approved as configured: run `{hint}`"
        raise ToolFailure(
            "denied", f"MCP server {self.name!r}: {self._start_error}", type="McpNotApproved"
        )

    # -- the connection ---------------------------------------------------------------

    async def session(self) -> ClientSession:
        """The live session, started (or restarted) first when there is none.

        Raises:
            ToolFailure: ``crashed``: it could not start, or is waiting out a backoff.
        """
        if self._suspect and self._session is not None:
            await self._check_alive(self._session)
        session = self._session
        if session is not None:
            return session
        async with self._lock:
            if self._session is not None:
                return self._session
            await self._check_approval()
            now = trio.current_time()
            if now < self._retry_at:
                raise ToolFailure(
                    "crashed",
                    f"MCP server {self.name!r} failed to start ({self._start_error}); "
                    f"next try in {self._retry_at - now:.1f} s",
                    type="McpServerDown",
                )
            return await self._start()

    async def _start(self) -> ClientSession:
        self._state = "starting"
        self._starts += 1
        stop, closed = trio.Event(), trio.Event()
        try:
            with trio.fail_after(self.config.startup_timeout):
                session: ClientSession = await self._nursery.start(self._own, stop, closed)
        except trio.Cancelled:
            self._state = "not started"  # the caller gave up (its deadline): try again later
            raise
        except Exception as exc:  # a start that failed or timed out: never the kernel's
            self._failures += 1
            backoff = min(FIRST_BACKOFF * 2 ** (self._failures - 1), MAX_BACKOFF)
            self._retry_at = trio.current_time() + backoff
            self._state = "failed"
            self._start_error = (
                f"did not start within {self.config.startup_timeout:g} s"
                if isinstance(exc, trio.TooSlowError)
                else f"failed to start: {_reason(exc)}"
            )
            raise ToolFailure(
                "crashed", f"MCP server {self.name!r} {self._start_error}", type="McpServerDown"
            ) from None
        self._failures = 0
        self._start_error = self._transport_error = None
        self._suspect = False
        self._stop, self._closed, self._session = stop, closed, session
        self._state = "running"
        self._listed = False  # a new process may offer other tools
        return session

    async def _own(
        self,
        stop: trio.Event,
        closed: trio.Event,
        *,
        task_status: trio.TaskStatus[ClientSession] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """The owner task: enters the connection, hands the session out, and leaves it
        (on ``stop``, on cancellation, or when the connection ends by itself)."""
        from mcp import ClientSession

        started = False
        ended = False  # the server's side closed by itself (its process died)

        def end() -> None:
            nonlocal ended
            ended = True
            stop.set()

        try:
            async with contextlib.AsyncExitStack() as stack:
                read, write = await stack.enter_async_context(self._transport(stack))
                session = await stack.enter_async_context(
                    ClientSession(_WatchedRead(read, end), write, message_handler=self._on_message)
                )
                await session.initialize()
                task_status.started(session)
                started = True
                await stop.wait()
        except Exception as exc:
            if not started:
                raise  # nursery.start gives it to whoever started us
            logger.warning("MCP server %r: its connection ended: %s", self.name, _reason(exc))
        except BaseExceptionGroup as group:
            # The SDK's task groups wrap what they raise; a failure here is this
            # server's, never the kernel's nursery's. Cancellation goes on.
            cancelled, failures = group.split(trio.Cancelled)
            if failures is not None and not started:
                raise failures from None
            if cancelled is not None:
                raise cancelled from None
        finally:
            closed.set()
            if self._closed is closed:
                self._lost("crashed" if ended or not stop.is_set() else "stopped")

    @contextlib.asynccontextmanager
    async def _transport(self, stack: contextlib.AsyncExitStack) -> AsyncIterator[Any]:
        config = self.config
        if config.url is not None:
            import httpx2
            from mcp.client.streamable_http import streamable_http_client

            # A call's read timeout is its deadline (the executor's), and the server
            # may hold a stream open between calls: no read timeout here.
            client = await stack.enter_async_context(
                httpx2.AsyncClient(
                    headers=dict(config.headers),
                    timeout=httpx2.Timeout(config.startup_timeout, read=None),
                    # Its configured URL only: a redirect elsewhere is an error.
                    follow_redirects=False,
                )
            )
            async with streamable_http_client(config.url, http_client=client) as streams:
                yield streams[0], streams[1]
            return
        async with self._confined_stdio(stack) as streams:
            yield streams

    def _exec_policy(self) -> ExecPolicy:
        """The launcher's policy for this server (blocking: finds the program)."""
        config, launch = self.config, self._launch
        assert config.command is not None
        env = server_environment(config)
        writable: list[str] = []
        if launch.state_dir is not None:
            # A directory of its own, kernel-owned (caches, its settings): HOME and
            # TMPDIR unless its env names others. The kernel's HOME it cannot read.
            # (Python's ctypes.util.find_library, which Trio calls, needs a TMPDIR.)
            own = launch.state_dir / self.name
            (own / "tmp").mkdir(parents=True, exist_ok=True)
            writable.append(str(own))
            env.update(
                {
                    k: v
                    for k, v in (("HOME", str(own)), ("TMPDIR", str(own / "tmp")))
                    if k not in config.env
                }
            )
        tak = launch.workspace / ".tak" if launch.workspace is not None else None
        if tak is not None and config.workspace == "write" and not tak.is_symlink():
            # The launcher makes .tak/ read-only for a writer (plugins load from it):
            # it must be there, as the plugin host makes it. (A symbolic link planted
            # in its place is left for the launcher to refuse.)
            (tak / "tmp").mkdir(parents=True, exist_ok=True)
        command = resolve_program(config.command, path=env.get("PATH"), cwd=config.cwd)
        return ExecPolicy(
            argv=(command, *config.args),
            env=env,
            workspace=str(launch.workspace) if launch.workspace is not None else None,
            workspace_access=config.workspace,  # type: ignore[arg-type]  # checked by the config
            # The paths approved (resolved then): a link retargeted since is not followed.
            read=self._approved_read
            if self._approved_read is not None
            else tuple(os.path.realpath(os.path.expanduser(p)) for p in config.read),
            write=tuple(writable),
            network=tuple(config.network),
            subprocess=config.subprocess,
            limits={
                "memory_bytes": config.memory_bytes,
                "cpu_seconds": config.cpu_seconds,
                "file_size_bytes": config.file_size_bytes,
                "open_files": config.open_files,
                "processes": config.processes,
            },
            kernel_pid=os.getpid(),
            require=not launch.allow_unsandboxed,
        )

    @contextlib.asynccontextmanager
    async def _confined_stdio(self, stack: contextlib.AsyncExitStack) -> AsyncIterator[Any]:
        """The server started through ``sandbox.exec``, spoken to in JSON lines."""

        policy = await trio.to_thread.run_sync(self._exec_policy)
        # The memory of its whole process tree, and its task count, as a worker's.
        try:
            cgroups = await trio.to_thread.run_sync(
                functools.partial(
                    make_cgroups,
                    memory_bytes=self.config.memory_bytes,
                    processes=self.config.processes,
                )
            )
        except OSError as exc:
            logger.warning("MCP server %r: no cgroup (%s): rlimits only", self.name, exc)
            cgroups = []
        try:
            async with self._confined_process(stack, policy, cgroups) as streams:
                yield streams
        finally:
            if cgroups:
                with trio.CancelScope(shield=True):
                    await trio.to_thread.run_sync(remove_cgroups, cgroups)

    @contextlib.asynccontextmanager
    async def _confined_process(
        self, stack: contextlib.AsyncExitStack, policy: ExecPolicy, cgroups: list[str]
    ) -> AsyncIterator[Any]:
        import anyio
        from mcp.shared.message import SessionMessage

        if cgroups:
            limits = dict(policy.limits)
            if cgroups_limit_memory():
                # The cgroup caps the tree: no RLIMIT_AS, which runtimes that reserve
                # much address space up front (Node, the JVM) cannot start under.
                limits["memory_bytes"] = None
            policy = attrs.evolve(policy, cgroups=tuple(cgroups), limits=limits)
        process = await _ConfinedProcess.spawn(
            self._launch.spawner,
            policy,
            cwd=self.config.cwd,
            errlog=self._errlog(stack),
            server=self.name,
        )
        try:
            confinement = await process.confinement()
            self._confinement = _describe(confinement)
            read_send, read_recv = anyio.create_memory_object_stream[SessionMessage | Exception](0)
            write_send, write_recv = anyio.create_memory_object_stream[SessionMessage](0)
            async with trio.open_nursery() as nursery:
                nursery.start_soon(process.pump_stdout, read_send, self._transport_failed)
                nursery.start_soon(process.pump_stdin, write_recv, read_send)
                try:
                    yield read_recv, write_send
                finally:
                    nursery.cancel_scope.cancel()
                    read_recv.close()
                    write_send.close()
        finally:
            with trio.CancelScope(shield=True):
                await process.stop()

    def _errlog(self, stack: contextlib.ExitStack[Any] | contextlib.AsyncExitStack) -> TextIO:
        """Where the server's stderr goes: ``<log_dir>/NAME.log``, else the kernel's stderr."""
        import sys

        if self._log_dir is None:
            return sys.stderr
        self._log_dir.mkdir(parents=True, exist_ok=True)
        return stack.enter_context(open(self._log_dir / f"{self.name}.log", "a"))

    def _transport_failed(self, reason: str) -> None:
        """The transport stopped the server (``reason`` names it): the call waiting
        says it, and so does ``info`` until the next start."""
        logger.warning("%s", reason)
        self._transport_error = reason

    async def _on_message(self, message: Any) -> None:
        if getattr(message, "method", None) == "notifications/tools/list_changed":
            self._listed = False

    def _lost(self, state: State) -> None:
        """The connection is gone: the next call starts a new one."""
        self._session = self._stop = self._closed = None
        self._state = state

    async def _check_alive(self, session: ClientSession) -> None:
        """After a timeout: a server that does not answer a ping is restarted."""
        self._suspect = False
        with trio.move_on_after(min(self.config.startup_timeout, PING_TIMEOUT)):
            try:
                await session.send_ping()
            except Exception:
                pass
            else:
                return
        logger.warning("MCP server %r stopped answering: restarting it", self.name)
        # Its owner task closes it in the background (a deaf process takes seconds to
        # end): the call that found it deaf goes on to a new one at once.
        if self._stop is not None:
            self._stop.set()
        self._lost("crashed")

    async def stop(self) -> None:
        """Leave the session (the owner task closes the connection) and wait for it."""
        stop, closed = self._stop, self._closed
        if stop is None or closed is None:
            return
        self._lost("stopped")
        stop.set()
        await closed.wait()

    # -- tools ------------------------------------------------------------------------

    async def list_tools(self) -> list[str]:
        """Start the server if needed, list its tools (when not cached) and register
        new ones; the names of its tools.

        Raises:
            ToolFailure: the server could not start or answer.
        """
        session = await self.session()
        if self._listed:
            return list(self._remote_names)
        try:
            with trio.fail_after(self.config.startup_timeout):
                listed = await _all_tools(session)
        except Exception as exc:
            raise self._call_failure(exc, "tools/list", session) from None
        self._listed = True
        names: dict[str, str] = {}
        errors: list[str] = []
        allowed = None if self.config.tools is None else set(self.config.tools)
        for remote in listed:
            if allowed is not None and remote.name not in allowed:
                continue
            name = kernel_tool_name(self.name, remote.name)
            if name in names:
                errors.append(f"tool {remote.name!r} left out: {name!r} is taken")
                continue
            existing = self._registry.get(name)
            if existing is None:
                try:
                    self._registry.add(self._tool(name, remote), owner=f"MCP server {self.name}")
                except UsageError as exc:
                    errors.append(f"tool {remote.name!r} left out: {exc}")
                    continue
            elif not isinstance(existing.active_runner, McpRunner):
                errors.append(f"tool {remote.name!r} left out: {name!r} is another tool's name")
                continue
            names[name] = remote.name
        if allowed is not None:
            missing = sorted(allowed - {remote.name for remote in listed})
            errors += [f"tool {name!r} (in tools) is not offered by the server" for name in missing]
        self._remote_names = names
        self._tool_errors = errors
        return list(names)

    def _tool(self, name: str, remote: Any) -> Tool:
        return Tool(
            name=name,
            description=remote.description or remote.title or "",
            parameters=dict(remote.input_schema),
            fn=None,
            is_async=True,
            timeout=self.config.timeout,
            runner=McpRunner(self, name),
        )

    async def call(self, name: str, arguments: dict[str, Any]) -> str | ToolOutput:
        """Call the tool the kernel knows as ``name``; its result as ``observation_output`` gives it.

        Raises:
            ToolFailure: ``crashed`` (no server, or its connection closed during
                the call), ``exception`` (``isError``, or the server refused the call).
        """
        session = await self.session()
        if self._listed and name not in self._remote_names:
            raise ToolFailure(
                "exception", f"MCP server {self.name!r} no longer offers {name!r}", type="McpError"
            )
        remote = self._remote_names.get(name, name.partition(".")[2])
        deadline = trio.current_effective_deadline()
        try:
            result = await session.call_tool(remote, arguments)
        except trio.Cancelled:
            if trio.current_time() >= deadline:
                # Its deadline, not a cancel: ping the server before the next call.
                self._suspect = True
            raise
        except Exception as exc:
            raise self._call_failure(exc, remote, session) from None
        return observation_output(result)

    def _call_failure(self, exc: Exception, what: str, session: ClientSession) -> ToolFailure:
        import anyio
        from mcp.shared.exceptions import MCPError
        from mcp.types import CONNECTION_CLOSED

        if isinstance(exc, trio.TooSlowError):
            self._suspect = True
            return ToolFailure("timeout", f"MCP server {self.name!r}: {what} had no answer")
        closed = isinstance(exc, MCPError) and exc.code == CONNECTION_CLOSED
        if not closed and not isinstance(
            exc, anyio.ClosedResourceError | anyio.BrokenResourceError | anyio.EndOfStream
        ):
            message = exc.message if isinstance(exc, MCPError) else _reason(exc)
            return ToolFailure("exception", f"{what}: {message}", type=type(exc).__name__)
        if self._session is session and self._stop is not None:
            # The owner task closes what is left of it; the next call starts anew.
            self._stop.set()
            self._lost("crashed")
        said = self._transport_error or f"MCP server {self.name!r} closed the connection"
        return ToolFailure(
            "crashed",
            f"{said} during the call (it is restarted on the next call)",
            type="McpServerDown",
        )


class _ConfinedProcess:
    """The launcher (then the server it became), its pipes and its report.

    Forked from the spawner thread: ``PDEATHSIG`` fires when the thread that forked
    a process ends, and Trio's (which ``open_process`` forks from) end after ten
    idle seconds (``sandbox.pool``); the SDK's stdio client forks from those.
    """

    def __init__(
        self,
        popen: subprocess.Popen[bytes],
        pidfd: int,
        stdin: trio.lowlevel.FdStream,
        stdout: trio.lowlevel.FdStream,
        report: trio.lowlevel.FdStream,
        *,
        server: str,
    ) -> None:
        self.popen = popen
        self.server = server
        self._pidfd = pidfd
        self._stdin = stdin
        self._stdout = stdout
        self._report = report

    @classmethod
    async def spawn(
        cls,
        spawner: Spawner,
        policy: ExecPolicy,
        *,
        cwd: str | None,
        errlog: TextIO,
        server: str,
    ) -> _ConfinedProcess:
        """Start the launcher and hand it ``policy``.

        Raises:
            OSError: it could not be started.
        """
        policy_r, policy_w = os.pipe2(os.O_CLOEXEC)
        report_r, report_w = os.pipe2(os.O_CLOEXEC)
        in_r, in_w = os.pipe2(os.O_CLOEXEC)
        out_r, out_w = os.pipe2(os.O_CLOEXEC)
        try:
            stderr = errlog.fileno()
        except (AttributeError, OSError, ValueError):
            stderr = 2

        def spawn() -> tuple[subprocess.Popen[bytes], int]:
            popen = subprocess.Popen(
                launcher_argv(policy_r, report_w),
                stdin=in_r,
                stdout=out_w,
                stderr=stderr,
                pass_fds=(policy_r, report_w),
                cwd=cwd,
                # The launcher replaces it with the server's (policy.env).
                env={"LANG": "C.UTF-8", "PATH": "/usr/bin:/bin"},
                start_new_session=True,
            )
            return popen, os.pidfd_open(popen.pid)

        ours = [policy_w, report_r, in_w, out_r]
        try:
            popen, pidfd = await spawner.run(spawn)
        except BaseException:
            for fd in ours:
                os.close(fd)
            raise
        finally:
            for fd in (policy_r, report_w, in_r, out_w):
                os.close(fd)
        process = cls(
            popen,
            pidfd,
            trio.lowlevel.FdStream(in_w),
            trio.lowlevel.FdStream(out_r),
            trio.lowlevel.FdStream(report_r),
            server=server,
        )
        policy_stream = trio.lowlevel.FdStream(policy_w)
        try:
            await policy_stream.send_all(policy.to_json())
        except (trio.BrokenResourceError, OSError):
            pass  # the launcher is gone: its report and its exit status say why
        finally:
            await policy_stream.aclose()
        return process

    async def confinement(self) -> Confinement:
        """What the launcher applied, once the server runs (its report's end of file).

        Raises:
            SandboxError: the launcher refused (its one-line reason), or ended.
        """
        data = b""
        async with self._report:
            while chunk := await self._report.receive_some(65536):
                data += chunk
                if len(data) > 1 << 20:
                    raise SandboxError("the launcher's report is too long")
        confinement, error = parse_report(data.splitlines())
        if error is not None:
            raise SandboxError(f"sandbox.exec: {error}")
        if confinement is None:
            with trio.move_on_after(EXIT_GRACE):
                await trio.lowlevel.wait_readable(self._pidfd)
            raise SandboxError(
                f"the launcher (sandbox.exec) ended before the server started "
                f"({self.popen.poll()!r} exit status)"
            )
        return confinement

    async def pump_stdout(self, messages: Any, on_failure: Callable[[str], None]) -> None:
        """Each line the server writes, as a message (or the error parsing it).

        A line longer than ``MAX_LINE_BYTES`` ends the connection, once
        ``on_failure`` was told why (the server named).
        """
        import anyio

        lines = LineSplitter(MAX_LINE_BYTES)
        async with messages:
            while True:
                try:
                    chunk = await self._stdout.receive_some(65536)
                except (trio.ClosedResourceError, trio.BrokenResourceError, OSError):
                    return
                if not chunk:
                    return
                try:
                    complete = lines.feed(chunk)
                except LineTooLong as exc:
                    on_failure(f"MCP server {self.server!r} {exc}: it was stopped")
                    return
                for line in complete:
                    if not line.strip():
                        continue
                    if len(line) >= _PARSE_IN_THREAD_BYTES:
                        message = await trio.to_thread.run_sync(_parse_line, line)
                    else:
                        message = _parse_line(line)
                    try:
                        await messages.send(message)
                    except (anyio.ClosedResourceError, anyio.BrokenResourceError):
                        return

    async def pump_stdin(self, outgoing: Any, incoming: Any) -> None:
        """Each message the session sends, as one line; a closed pipe ends the session."""
        async with outgoing:
            async for message in outgoing:
                data = message.message.model_dump_json(by_alias=True, exclude_unset=True)
                try:
                    await self._stdin.send_all(data.encode() + b"\n")
                except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
                    incoming.close()  # the session sees the connection end
                    return

    async def stop(self) -> None:
        """Close stdin, then SIGTERM, then SIGKILL its process group; reap it."""
        await self._stdin.aclose()
        try:
            if not await self._exited(EXIT_GRACE):
                self._signal_group(signal.SIGTERM)
                if not await self._exited(EXIT_GRACE / 2):
                    self._signal_group(signal.SIGKILL)
                    await self._exited(EXIT_GRACE / 2)
            # Whatever it started goes with it (the leader, a zombie until reaped
            # below, keeps the group's id from being reused).
            self._signal_group(signal.SIGKILL)
            self.popen.poll()
        finally:
            await self._stdout.aclose()
            os.close(self._pidfd)

    async def _exited(self, seconds: float) -> bool:
        with trio.move_on_after(seconds):
            await trio.lowlevel.wait_readable(self._pidfd)
            return True
        return False

    def _signal_group(self, signum: int) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.popen.pid, signum)


class LineTooLong(ProtocolError, ValueError):
    """A line passed ``LineSplitter.limit`` before its newline."""


class LineSplitter:
    """Lines of a byte stream, in time linear in its length, each at most ``limit`` bytes.

    Each chunk is searched for newlines once, from where the last search ended
    (never the bytes of a line already buffered); the pieces of the line not yet
    ended are kept in a list and joined once, when its newline comes. A line that
    would pass ``limit`` raises ``LineTooLong`` before any more of it is kept.
    """

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._pieces: list[bytes] = []
        self._size = 0  # bytes in ``_pieces``
        #: Bytes searched for a newline so far: each byte received, once.
        self.searched = 0

    @property
    def buffered(self) -> int:
        """Bytes kept of the line not yet ended."""
        return self._size

    def feed(self, chunk: bytes) -> list[bytes]:
        """The lines ``chunk`` ends (without their newline).

        Raises:
            LineTooLong: the line being read is longer than ``limit``; the
                splitter keeps nothing of it (and should not be fed again).
        """
        lines: list[bytes] = []
        start = 0
        while True:
            end = chunk.find(b"\n", start)
            self.searched += (len(chunk) if end < 0 else end + 1) - start
            stop = len(chunk) if end < 0 else end
            if self._size + stop - start > self.limit:
                self._pieces.clear()
                self._size = 0
                raise LineTooLong(f"sent a line longer than {self.limit} bytes")
            if end < 0:
                if start < len(chunk):
                    self._pieces.append(chunk[start:] if start else chunk)
                    self._size += len(chunk) - start
                return lines
            if self._pieces:
                self._pieces.append(chunk[start:end])
                lines.append(b"".join(self._pieces))
                self._pieces.clear()
                self._size = 0
            else:
                lines.append(chunk[start:end])
            start = end + 1


def _parse_line(line: bytes) -> Any:
    from mcp import types
    from mcp.shared.message import SessionMessage

    try:
        return SessionMessage(types.jsonrpc_message_adapter.validate_json(line, by_name=False))
    except ValueError as exc:
        return exc


def _describe(confinement: Confinement) -> str:
    """What a launcher applied, in one line."""
    parts = [
        f"landlock {confinement.landlock}" if confinement.landlock else None,
        f"seccomp {confinement.seccomp}" if confinement.seccomp else None,
        "no_new_privs" if confinement.no_new_privs else None,
        f"capabilities {confinement.capabilities}" if confinement.capabilities else None,
        f"cgroup {confinement.cgroup}" if confinement.cgroup else None,
    ]
    parts += [f"UNCONFINED: {reason}" for reason in confinement.unconfined]
    return "; ".join(p for p in parts if p)


class _WatchedRead:
    """The session's read stream, saying when it ends: a server that dies while no
    call is waiting is known at once, and the next call starts a new one."""

    def __init__(self, stream: Any, on_end: Callable[[], None]) -> None:
        self._stream = stream
        self._on_end = on_end

    @property
    def last_context(self) -> Any:
        return getattr(self._stream, "last_context", None)

    async def receive(self) -> Any:
        import anyio

        try:
            return await self._stream.receive()
        except (anyio.EndOfStream, anyio.ClosedResourceError, anyio.BrokenResourceError):
            self._on_end()
            raise

    def __aiter__(self) -> _WatchedRead:
        return self

    async def __anext__(self) -> Any:
        import anyio

        try:
            return await self.receive()
        except anyio.EndOfStream:
            raise StopAsyncIteration from None

    async def aclose(self) -> None:
        await self._stream.aclose()

    async def __aenter__(self) -> _WatchedRead:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()


@attrs.frozen
class McpRunner:
    """The ``ToolRunner`` of an MCP tool: the validated JSON, sent to its server."""

    server: McpServer
    name: str

    async def run(self, arguments: dict[str, Any], ctx: RunContext) -> Any:
        return await self.server.call(self.name, arguments)


async def _all_tools(session: ClientSession) -> list[Any]:
    from mcp.types import PaginatedRequestParams

    tools: list[Any] = []
    cursor: str | None = None
    while True:
        params = PaginatedRequestParams(cursor=cursor) if cursor else None
        page = await session.list_tools(params=params)
        tools.extend(page.tools)
        cursor = page.next_cursor
        if not cursor:
            return tools


def _reason(exc: BaseException) -> str:
    if isinstance(exc, BaseExceptionGroup):
        return "; ".join(_reason(e) for e in exc.exceptions)
    text = str(exc) or type(exc).__name__
    return text.splitlines()[0] if text else type(exc).__name__


class McpServers:
    """Every configured server (``Kernel.mcp``), by name, in the config's order."""

    def __init__(self, servers: Sequence[McpServer]) -> None:
        self.servers = {s.name: s for s in servers}

    def info(self) -> list[McpServerInfo]:
        """Each server's state and tools, for ``tak mcp ls``."""
        return [s.info() for s in self.servers.values()]

    async def list_tools(self, names: Sequence[str] | None = None) -> None:
        """Make sure the tools of ``names`` (every server when ``None``) are registered:
        start them if needed, list what is not cached. A server that fails is
        recorded in its state, never raised."""
        chosen = [s for s in self.servers.values() if names is None or s.name in names]
        pending = [s for s in chosen if not (s._listed and s._session is not None)]
        if not pending:
            return

        async def one(server: McpServer) -> None:
            with contextlib.suppress(ToolFailure):
                await server.list_tools()

        async with trio.open_nursery() as nursery:
            for server in pending:
                nursery.start_soon(one, server)

    async def list_tools_for(self, tool_names: Sequence[str]) -> None:
        """``list_tools`` for the servers whose namespace one of ``tool_names`` has."""
        wanted = {n.partition(".")[0] for n in tool_names if "." in n}
        servers = [n for n in wanted if n in self.servers]
        if servers:
            await self.list_tools(servers)

    async def aclose(self) -> None:
        async with trio.open_nursery() as nursery:
            for server in self.servers.values():
                nursery.start_soon(server.stop)


@contextlib.asynccontextmanager
async def open_mcp_servers(
    configs: Mapping[str, McpServerConfig],
    registry: ToolRegistry,
    *,
    log_dir: str | os.PathLike[str] | None = None,
    workspace: str | os.PathLike[str] | None = None,
    home: TakHome | None = None,
    vouched: Collection[str] = (),
    allow_unsandboxed: bool = False,
) -> AsyncIterator[McpServers]:
    """The servers of ``configs``, their tools added to ``registry`` as they are listed.

    Eager servers are started and listed before this yields (a failure is in
    their state, not raised). Leaving closes every server, within
    ``CLOSE_TIMEOUT`` seconds (then their owner tasks are cancelled and a stdio
    server that has not exited is killed).

    Each stdio server runs confined (``sandbox.exec``) with the permissions of its
    config, in ``workspace`` as ``McpServerConfig.workspace`` says (no workspace:
    none granted), with ``log_dir/NAME`` as its own writable directory.
    ``allow_unsandboxed`` runs one whose confinement is incomplete. With ``home``,
    a stdio server not in ``vouched`` runs only once approved there (``tak mcp
    trust NAME``); without it none is checked (the caller chose them all).

    Each server owns the namespace of its name in ``registry`` (``NAME.tool``)
    from the start, listed or not: no other source can register a name there.

    Raises:
        UsageError: another source (a plugin of that name) holds a server's namespace.
    """
    for name in configs:
        registry.claim(name, f"MCP server {name}")
    logs = Path(log_dir) if log_dir is not None else None
    scratch = None
    if logs is None and any(c.command is not None for c in configs.values()):
        scratch = Path(await trio.to_thread.run_sync(tempfile.mkdtemp, None, "tak-mcp-"))
    spawner = Spawner()
    launch = _Launch(
        spawner,
        state_dir=logs if logs is not None else scratch,
        workspace=Path(workspace) if workspace is not None else None,
        home=home,
        vouched=frozenset(vouched),
        allow_unsandboxed=allow_unsandboxed,
    )
    try:
        async with trio.open_nursery() as nursery:
            servers = McpServers(
                [
                    McpServer(
                        name,
                        config,
                        nursery=nursery,
                        registry=registry,
                        log_dir=logs,
                        launch=launch,
                    )
                    for name, config in configs.items()
                ]
            )
            try:
                eager = [n for n, c in configs.items() if c.start == "eager"]
                if eager:
                    await servers.list_tools(eager)
                yield servers
            finally:
                with trio.CancelScope(shield=True) as closing:
                    closing.deadline = trio.current_time() + CLOSE_TIMEOUT
                    await servers.aclose()
                nursery.cancel_scope.cancel()
    except BaseExceptionGroup as group:
        # The owner tasks never raise (a server's failure is its state), so a lone
        # exception is the caller's own, from the body: give it back as it was.
        if len(group.exceptions) == 1:
            raise group.exceptions[0] from None
        raise
    finally:
        # Last: a launcher's PDEATHSIG follows this thread (its servers are closed).
        spawner.close()
        if scratch is not None:
            with trio.CancelScope(shield=True):
                await trio.to_thread.run_sync(functools.partial(shutil.rmtree, scratch, True))
