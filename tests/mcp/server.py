"""A stdio MCP server for the tests, written with the SDK's ``MCPServer``.

Run as ``python tests/mcp/server.py [--http PORT]``: stdio by default; with
``--http`` the same tools over streamable HTTP (hypercorn's Trio worker, on
127.0.0.1). ``pid`` tells a test which process to kill.
"""

from __future__ import annotations

import os
import sys
from typing import Annotated

import trio
from mcp.server.mcpserver import Context, Image, MCPServer
from mcp.server.mcpserver.exceptions import ToolError
from pydantic import Field

server = MCPServer("tak-test")

# A 1x1 PNG.
PNG = bytes.fromhex(
    "89504e470d0a1a0a0000000d4948445200000001000000010806000000"
    "1f15c4890000000d49444154789c6360000002000154a24f1b0000000049454e44ae426082"
)


@server.tool()
def echo(text: str) -> str:
    """Say ``text`` back."""
    return text


@server.tool()
async def sleep(seconds: float) -> str:
    """Sleep, then say so."""
    await trio.sleep(seconds)
    return f"slept {seconds}"


_meetings: dict[int, tuple[list[int], trio.Event]] = {}


@server.tool()
async def meet(parties: int) -> str:
    """Answer ``met`` once ``parties`` calls of it wait at once: they run concurrently
    (one alone gives up after a minute: ``alone``)."""
    count, everyone = _meetings.setdefault(parties, ([0], trio.Event()))
    count[0] += 1
    if count[0] >= parties:
        everyone.set()
    with trio.move_on_after(60):
        await everyone.wait()
        return "met"
    return "alone"


@server.tool()
def fail(message: str) -> str:
    """Raise (the server answers isError)."""
    raise ToolError(message)


@server.tool()
def image() -> Image:
    """A small PNG."""
    return Image(data=PNG, format="png")


@server.tool()
async def hang() -> str:
    """Never answer."""
    await trio.sleep_forever()
    return "unreachable"


@server.tool()
async def exit_now(after: float = 0.0) -> str:
    """End the server's process in the middle of the call."""
    await trio.sleep(after)
    os._exit(3)


@server.tool()
def pid() -> int:
    """The server's process id."""
    # As the kernel sees it (in a PID namespace of its own, getpid() is 2): /proc is
    # the kernel's, and Landlock does not govern readlink.
    return int(os.readlink("/proc/self"))


@server.tool()
async def add_tool(name: str, ctx: Context) -> str:  # type: ignore[type-arg]
    """Offer one more tool (``name``, an echo) and tell the client its tool list changed."""
    server.add_tool(echo, name=name)
    await ctx.session.send_tool_list_changed()
    return f"added {name}"


@server.tool()
def odd_names(max_results: Annotated[int, Field(alias="max-results")] = 3) -> int:
    """A parameter whose name is no Python identifier: the kernel cannot check it."""
    return max_results


@server.tool()
def env(name: str) -> str:
    """An environment variable of the server ('' when unset)."""
    return os.environ.get(name, "")


# What a confined server may not do: each answers what happened, never raises, so
# that a refused operation is an observation the test reads.


def _refused(exc: OSError) -> str:
    return f"refused: {exc.strerror or exc}"


@server.tool()
def read_file(path: str) -> str:
    """The text of ``path``, or why it could not be read."""
    try:
        with open(path) as f:
            return "read: " + f.read()
    except OSError as exc:
        return _refused(exc)


@server.tool()
def write_file(path: str, text: str) -> str:
    """Write ``text`` to ``path``."""
    try:
        with open(path, "w") as f:
            f.write(text)
    except OSError as exc:
        return _refused(exc)
    return "written"


@server.tool()
def setuid_file(path: str) -> str:
    """Create ``path`` with the setuid bit."""
    try:
        os.close(os.open(path, os.O_CREAT | os.O_WRONLY, 0o4755))
    except OSError as exc:
        return _refused(exc)
    return "created"


@server.tool()
def connect(port: int) -> str:
    """Open a TCP connection to 127.0.0.1:``port``."""
    import socket

    try:
        with socket.create_connection(("127.0.0.1", port), timeout=10):
            return "connected"
    except OSError as exc:
        return _refused(exc)


@server.tool()
def run_program() -> str:
    """Start ``/bin/true`` as a child process."""
    import subprocess

    try:
        subprocess.run(["/bin/true"], check=True)
    except (OSError, subprocess.SubprocessError) as exc:
        return f"refused: {exc}"
    return "ran"


async def serve_http(port: int) -> None:
    from hypercorn.config import Config
    from hypercorn.trio import serve

    config = Config()
    config.bind = [f"127.0.0.1:{port}"]
    app = server.streamable_http_app(stateless_http=True)
    await serve(app, config)  # type: ignore[arg-type]


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--http":
        trio.run(serve_http, int(sys.argv[2]))
    else:
        trio.run(server.run_stdio_async)
