"""The MCP server: a kernel's tools served to any MCP client (``tak mcp serve``).

Built on the official SDK's low-level ``mcp.server.Server`` (its protocol
runner: the handshake, both protocol eras, JSON-RPC) with our own transports,
all under ``trio.run``. The SDK (``tak[mcp]``) is imported only when a server is
made. The MCP *client* (servers as a tool source) is ``plugins._mcp``, beside the
plugin host whose approvals it shares.

1. ``tools/list`` lists every tool of the kernel (built-ins, plugins,
   ``--plugin``) with its description and JSON Schema.
2. ``tools/call`` runs through ``Kernel.call_tools``: arguments are validated by
   the kernel, plugin tools run confined as usual, and the call and its
   observation are recorded in the server's session. The result is the
   observation's text; an error observation is ``isError: true`` with its text
   (bad arguments name the ``$.path``).
3. stdio (``claim_stdio`` + ``serve_stdio``): fd 1 carries only protocol frames.
   While serving, fd 1 points at stderr and fd 0 at ``/dev/null``, so a stray
   ``print`` (ours, a tool's) cannot corrupt the wire; the frames go through
   private duplicates. EOF on the wire ends it.
4. HTTP (``serve_http``): streamable HTTP at ``/mcp`` through hypercorn's trio
   worker; loopback only unless ``allow_remote`` (bind address and ``Host``
   header, against DNS rebinding), and every request must carry
   ``Authorization: Bearer TOKEN`` (else 401).

Why our own stdio transport and not the SDK's ``stdio_server``: that one reads
stdin with a blocking ``readline`` in a worker thread that cannot be abandoned,
so a cancellation (SIGINT while the client keeps stdin open) waits for the next
line. Ours reads through ``trio.lowlevel.FdStream``.
"""

from __future__ import annotations

import contextlib
import fcntl
import hmac
import logging
import os
import sys
import uuid
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import trio

if TYPE_CHECKING:
    from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream
    from mcp.server import Server
    from mcp.shared.message import SessionMessage
    from starlette.types import ASGIApp, Receive, Scope, Send

    from ..kernel import Kernel
    from ..session import Session

#: The path the streamable HTTP endpoint is served at (the SDK's and clients' default).
MCP_PATH = "/mcp"


def mcp_server(kernel: Kernel, session: Session) -> Server[Any]:
    """An MCP server (the SDK's low-level one) whose tools are the kernel's."""
    import mcp_types as types
    from mcp.server import Server, ServerRequestContext

    from .._version import __version__
    from ..messages import ToolCall

    async def list_tools(
        ctx: ServerRequestContext[Any], params: types.PaginatedRequestParams | None
    ) -> types.ListToolsResult:
        return types.ListToolsResult(
            tools=[
                types.Tool(name=t.name, description=t.description, input_schema=t.parameters)
                for t in kernel.tools
            ]
        )

    async def call_tool(
        ctx: ServerRequestContext[Any], params: types.CallToolRequestParams
    ) -> types.CallToolResult:
        call = ToolCall(f"mcp_{uuid.uuid4().hex[:16]}", params.name, params.arguments or {})
        [observation] = await kernel.call_tools(session, [call])
        content: list[types.ContentBlock] = [types.TextContent(text=observation.content)]
        for number, a in enumerate(observation.attachments, 1):
            if a.kind == "image":
                content.append(types.ImageContent(data=a.data, mime_type=a.media_type))
            elif a.kind == "audio":
                content.append(types.AudioContent(data=a.data, mime_type=a.media_type))
            else:
                uri = a.uri or f"tak://attachment/{number}"
                blob = types.BlobResourceContents(uri=uri, blob=a.data, mime_type=a.media_type)
                content.append(types.EmbeddedResource(type="resource", resource=blob))
        return types.CallToolResult(content=content, is_error=observation.is_error)

    return Server(
        "tak",
        version=__version__,
        instructions=f"The tools of a tak kernel; calls are recorded in session {session.key}.",
        on_list_tools=list_tools,
        on_call_tool=call_tool,
    )


# -- stdio ------------------------------------------------------------------------------


@contextlib.contextmanager
def claim_stdio() -> Iterator[tuple[int, int]]:
    """Yield private duplicates ``(wire_in, wire_out)`` of fds 0 and 1, and meanwhile
    point fd 0 at ``/dev/null`` and fd 1 at stderr (guarantee 3); restored on exit."""
    wire_in = fcntl.fcntl(0, fcntl.F_DUPFD_CLOEXEC, 3)
    wire_out = fcntl.fcntl(1, fcntl.F_DUPFD_CLOEXEC, 3)
    sys.stdout.flush()
    devnull = os.open(os.devnull, os.O_RDONLY)
    try:
        os.dup2(devnull, 0)
        os.dup2(2, 1)
    finally:
        os.close(devnull)
    try:
        yield wire_in, wire_out
    finally:
        with contextlib.suppress(OSError, ValueError):
            sys.stdout.flush()
        os.dup2(wire_in, 0)
        os.dup2(wire_out, 1)
        os.close(wire_in)
        os.close(wire_out)


async def serve_stdio(server: Server[Any], wire_in: int, wire_out: int) -> None:
    """Serve one MCP connection on newline-delimited JSON-RPC until EOF on ``wire_in``."""
    import anyio
    from mcp.shared.message import SessionMessage

    read_send, read_receive = anyio.create_memory_object_stream[SessionMessage | Exception](0)
    write_send, write_receive = anyio.create_memory_object_stream[SessionMessage](0)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(_read_frames, wire_in, read_send, write_send.clone())
        nursery.start_soon(_write_frames, wire_out, write_receive)
        await server.run(read_receive, write_send, server.create_initialization_options())
        nursery.cancel_scope.cancel()


#: The longest frame a client may send on stdio; a longer one is answered with a parse
#: error and skipped to its newline (the buffer never holds more than this).
MAX_FRAME_BYTES = 16 * 1024 * 1024
#: A frame at least this long is parsed in a thread.
_PARSE_IN_THREAD_BYTES = 1024 * 1024


async def _read_frames(
    fd: int,
    out: MemoryObjectSendStream[SessionMessage | Exception],
    replies: MemoryObjectSendStream[SessionMessage],
) -> None:
    """Frames from ``fd`` to the protocol runner; a line that is no JSON-RPC message is
    answered here, as JSON-RPC 2.0 says (the runner only logs it): a parse error, or an
    invalid request with its id when it has one (``null`` when not)."""
    import mcp_types as types
    from mcp.shared.message import SessionMessage

    async def refuse(code: int, text: str, request_id: int | str | None) -> None:
        error = types.ErrorData(code=code, message=text)
        reply = types.JSONRPCError(jsonrpc="2.0", id=request_id, error=error)
        await replies.send(SessionMessage(reply))

    from plugins._mcp import LineSplitter, LineTooLong

    def parse(line: bytes) -> Any:
        return types.jsonrpc_message_adapter.validate_json(line, by_name=False)

    # A duplicate: FdStream closes what it is given, and sets it non-blocking
    # (restored when closed).
    stream = trio.lowlevel.FdStream(os.dup(fd))
    async with stream, out, replies:
        splitter = LineSplitter(MAX_FRAME_BYTES)  # linear in the bytes, bounded
        skipping = False  # inside a frame that was too long, until its newline
        while chunk := await stream.receive_some(65536):
            if skipping:
                end = chunk.find(b"\n")
                if end < 0:
                    continue
                chunk, skipping = chunk[end + 1 :], False
            try:
                lines = splitter.feed(chunk)
            except LineTooLong:
                # Only the frame still open can pass the limit (a chunk is far
                # shorter), so nothing before it in the chunk is lost: skip to its end.
                await refuse(types.PARSE_ERROR, f"frame longer than {MAX_FRAME_BYTES} bytes", None)
                end = chunk.find(b"\n")
                skipping = end < 0
                lines = [] if skipping else splitter.feed(chunk[end + 1 :])
            for line in lines:
                if not line.strip():
                    continue
                try:
                    if len(line) < _PARSE_IN_THREAD_BYTES:
                        message = parse(line)
                    else:  # pydantic takes ~10 ms a MiB: not on the Trio thread
                        message = await trio.to_thread.run_sync(parse, line)
                except Exception as exc:
                    await refuse(*_refusal(line))
                    await out.send(exc)  # the runner logs it
                    continue
                await out.send(SessionMessage(message))


def _refusal(line: bytes) -> tuple[int, str, int | str | None]:
    """The JSON-RPC error for a line that is no message: (code, message, id)."""
    import json

    import mcp_types as types

    try:
        value = json.loads(line)
    except ValueError:  # UnicodeDecodeError too
        return types.PARSE_ERROR, "Parse error: not JSON", None
    request_id = value.get("id") if isinstance(value, dict) else None
    if isinstance(request_id, bool) or not isinstance(request_id, int | str):
        request_id = None
    return types.INVALID_REQUEST, "Invalid Request: not a JSON-RPC 2.0 message", request_id


async def _write_frames(fd: int, frames: MemoryObjectReceiveStream[SessionMessage]) -> None:
    def write_all(data: bytes) -> None:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]

    async with frames:
        async for frame in frames:
            data = frame.message.model_dump_json(by_alias=True, exclude_unset=True) + "\n"
            # A thread rather than a non-blocking fd: fd 1 may share its open file
            # with stderr, which logging writes to and must stay blocking.
            await trio.to_thread.run_sync(write_all, data.encode(), abandon_on_cancel=True)


# -- streamable HTTP --------------------------------------------------------------------


async def serve_http(
    server: Server[Any],
    host: str,
    port: int,
    token: str,
    *,
    allow_remote: bool = False,
    task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve streamable HTTP at ``http://HOST:PORT/mcp`` until cancelled; started with
    the URL.

    Raises:
        UsageError: ``host`` is not a loopback address and ``allow_remote`` is not set.
    """
    from urllib.parse import quote

    from hypercorn.config import Config
    from hypercorn.trio import serve
    from mcp.server.streamable_http_manager import StreamableHTTPSessionManager

    from ..wire._handshake import refuse_remote_bind

    await refuse_remote_bind(host, allow_remote=allow_remote)
    manager = StreamableHTTPSessionManager(app=server)
    config = Config()
    config.bind = [f"[{host}]:{port}" if ":" in host else f"{host}:{port}"]
    config.accesslog = None
    config.errorlog = logging.getLogger("tak.mcp.http")
    app = guarded_app(manager.handle_request, token, allow_remote=allow_remote)
    async with manager.run():
        async with trio.open_nursery() as nursery:
            binds = await nursery.start(serve, app, config)
            task_status.started(f"{binds[0]}{MCP_PATH}?token={quote(token, safe='')}")


def guarded_app(inner: ASGIApp, token: str, *, allow_remote: bool) -> ASGIApp:
    """``inner`` behind the checks of docs/protocol.md: a loopback ``Host`` (unless
    ``allow_remote``), then ``Authorization: Bearer TOKEN``; only ``/mcp`` is served."""
    from ..wire._handshake import is_loopback_name

    expected = token.encode()

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            # Nothing to start or stop: serve_http runs the session manager around hypercorn.
            while True:
                event = (await receive())["type"]
                if event == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
                elif event == "lifespan.shutdown":
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        if scope["type"] != "http":
            return
        headers: dict[bytes, bytes] = dict(scope["headers"])
        host = headers.get(b"host", b"").decode("latin-1")
        hostname = host.rpartition(":")[0] if not host.endswith("]") else host
        hostname = (hostname or host).strip("[]").lower()
        if not allow_remote and not is_loopback_name(hostname):
            await _plain(send, 403, "Host is not a loopback name")
        elif not hmac.compare_digest(_offered_token(scope, headers), expected):
            await _plain(send, 401, "wrong token", authenticate=True)
        elif scope["path"].rstrip("/") != MCP_PATH:
            await _plain(send, 404, f"not found: the MCP endpoint is {MCP_PATH}")
        else:
            await inner(scope, receive, send)

    return app


def _offered_token(scope: Scope, headers: dict[bytes, bytes]) -> bytes:
    """The token in ``Authorization: Bearer TOKEN``, else in the query (``?token=``)."""
    from urllib.parse import parse_qs

    scheme, _, credentials = headers.get(b"authorization", b"").partition(b" ")
    if scheme.lower() == b"bearer":
        return credentials.strip()
    # The query is ASCII with %-escapes of UTF-8 (as the printed URL quotes the token);
    # anything else cannot be the token, and is compared as what it decodes to.
    query_string: bytes = scope.get("query_string", b"")
    query = parse_qs(query_string.decode("ascii", "replace"), errors="replace")
    return query.get("token", [""])[0].encode("utf-8", "surrogatepass")


async def _plain(send: Send, status: int, text: str, *, authenticate: bool = False) -> None:
    headers = [(b"content-type", b"text/plain; charset=utf-8")]
    if authenticate:
        headers.append((b"www-authenticate", b"Bearer"))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": text.encode() + b"\n"})


__all__ = ["MCP_PATH", "claim_stdio", "guarded_app", "mcp_server", "serve_http", "serve_stdio"]
