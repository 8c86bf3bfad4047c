"""The stdio transport's reading of a server's stdout (issue 22, item 6): lines found
in time linear in the bytes (each byte searched once, counted, not timed), and a
line longer than ``MAX_LINE_BYTES`` stopping the server, named, without being
buffered past the bound. bench/bench_mcp_pump.py times it."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kernel import ToolCall, ToolRegistry, run_tool_calls
from kernel.executor import CallLimits
from kernel.home import McpServerConfig
from plugins._mcp import MAX_LINE_BYTES, LineSplitter, LineTooLong, open_mcp_servers
from sandbox import landlock, seccomp

MIB = 1024 * 1024
CHUNK = 65536  # what the pump receives at most at a time


def chunks(data: bytes, size: int = CHUNK) -> list[bytes]:
    return [data[i : i + size] for i in range(0, len(data), size)]


def test_a_16_mib_line_is_searched_once_per_byte() -> None:
    """Today's pump searched the whole buffer again on each chunk: 16 MiB in 64 KiB
    chunks was 2 GiB searched (and copied); this searches each byte once."""
    line = b"x" * (16 * MIB)
    splitter = LineSplitter(MAX_LINE_BYTES)
    got: list[bytes] = []
    for piece in chunks(line + b"\n"):
        got += splitter.feed(piece)
        assert splitter.searched <= len(line) + 1
    assert got == [line]
    assert splitter.searched == len(line) + 1 and splitter.buffered == 0


def test_a_line_past_the_bound_raises_before_it_is_buffered_past_it() -> None:
    limit = 1 * MIB
    splitter = LineSplitter(limit)
    assert splitter.feed(b'{"a": 1}\n' + b"y" * 1000) == [b'{"a": 1}']
    fed = 1000
    with pytest.raises(LineTooLong, match=f"sent a line longer than {limit} bytes"):
        for piece in chunks(b"y" * (2 * limit)):
            splitter.feed(piece)
            fed += len(piece)
            assert splitter.buffered <= limit
    assert fed <= limit  # the chunk that would pass the bound was refused, not kept
    assert splitter.buffered == 0
    # A line of exactly the bound is a line.
    exact = LineSplitter(limit)
    assert [len(x) for p in chunks(b"z" * limit + b"\n") for x in exact.feed(p)] == [limit]


def test_the_bound_holds_inside_one_chunk_too() -> None:
    with pytest.raises(LineTooLong):
        LineSplitter(10).feed(b"short\n" + b"x" * 11 + b"\n")


@given(
    st.lists(st.binary(max_size=40).map(lambda b: b.replace(b"\n", b"")), max_size=20),
    st.lists(st.integers(min_value=1, max_value=17), min_size=1, max_size=8),
)
def test_any_chunking_gives_the_lines_split_gives(parts: list[bytes], sizes: list[int]) -> None:
    data = b"\n".join(parts) + b"\n"
    splitter = LineSplitter(1000)
    got: list[bytes] = []
    position, turn = 0, 0
    while position < len(data):
        size = sizes[turn % len(sizes)]
        got += splitter.feed(data[position : position + size])
        position, turn = position + size, turn + 1
    assert got == data.split(b"\n")[:-1]
    assert splitter.searched == len(data) and splitter.buffered == 0


# -- a real confined server -------------------------------------------------------------

HOSTILE = str(Path(__file__).with_name("hostile_server.py"))

#: Run by the hostile server: its protocol pipe (the SDK moved it off fd 1, which it
#: pointed at stderr), found as the one pipe it writes to.
WIRE = (
    "import fcntl, os, stat\n"
    "def writes_pipe(fd):\n"
    "    try:\n"
    "        mode, flags = os.fstat(fd).st_mode, fcntl.fcntl(fd, fcntl.F_GETFL)\n"
    "    except OSError:\n"
    "        return False\n"
    "    return stat.S_ISFIFO(mode) and flags & os.O_ACCMODE == os.O_WRONLY\n"
    "wire = next(fd for fd in range(3, 1024) if writes_pipe(fd))\n"
)


def flood(data: str, *, then: str = "import time; time.sleep(600)") -> str:
    """Code that writes ``data`` (a Python expression of bytes) on the protocol pipe."""
    return f"{WIRE}os.write(wire, {data})\n{then}\n"


@pytest.mark.skipif(
    landlock.abi_version() < 6 or not seccomp.available(),
    reason="needs Landlock with TCP rules and scopes (ABI 6+) and seccomp",
)
async def test_a_server_sending_a_line_past_the_bound_is_stopped_and_named(
    tmp_path: Path,
) -> None:
    """Today a line under 64 MiB was buffered whole and the call waited for its newline
    until its deadline; now the call fails at the bound, saying which server and why,
    and the next call gets a new server."""
    workspace = tmp_path / "ws"
    workspace.mkdir()
    config = McpServerConfig(command=sys.executable, args=[HOSTILE], startup_timeout=30)
    registry = ToolRegistry()
    code = flood(f"b'x' * {MAX_LINE_BYTES + 1}")
    async with open_mcp_servers({"big": config}, registry, workspace=workspace) as mcp:
        await mcp.list_tools_for(["big.probe"])
        [obs] = await run_tool_calls(
            [ToolCall("1", "big.probe", {"code": code})], registry, limits=CallLimits(timeout=120)
        )
        assert obs.error is not None and obs.error.kind == "crashed", obs
        said = f"MCP server 'big' sent a line longer than {MAX_LINE_BYTES} bytes: it was stopped"
        assert (
            obs.content
            == f"Error (crashed): {said} during the call (it is restarted on the next call)"
        )
        [info] = mcp.info()
        assert said in info.errors and info.state == "crashed"
        [again] = await run_tool_calls(
            [ToolCall("2", "big.probe", {"code": "result = 'fresh'"})], registry
        )
        assert (again.error, again.content) == (None, "fresh")
