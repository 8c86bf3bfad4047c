"""The stdio MCP transport's reading of one long line, beside reading the same bytes.

A 16 MiB line (no newline until its end) is written into a pipe by a thread and
read under Trio in 64 KiB receives, as ``_ConfinedProcess.pump_stdout`` reads a
server's stdout: the baseline only reads it; the pump's way also splits it into
lines (``plugins._mcp.LineSplitter``); the old way (``*lines, buffer = (buffer +
chunk).split(b"\\n")``, which searched and copied the whole buffer on every
chunk) is timed too, for the figure the issue reported. Median of five rounds
each, in the same run. Run: ``.venv/bin/python bench/bench_mcp_pump.py`` (``make
bench``); never fails on timing.
"""

from __future__ import annotations

import os
import statistics
import threading
import time
from collections.abc import Callable

import trio

from plugins._mcp import MAX_LINE_BYTES, LineSplitter

SIZE = 16 * 1024 * 1024
CHUNK = 65536
ROUNDS = 5


def _writer(fd: int) -> None:
    data = memoryview(b"x" * SIZE + b"\n")
    while data:
        data = data[os.write(fd, data[: 1 << 20]) :]
    os.close(fd)


async def _pump(split: Callable[[bytes], list[bytes]]) -> tuple[float, int]:
    """CPU seconds of the Trio thread to read (and ``split``) the line, and lines found."""
    r, w = os.pipe()
    thread = threading.Thread(target=_writer, args=(w,))
    thread.start()
    found = 0
    async with trio.lowlevel.FdStream(r) as stream:
        start = time.thread_time()
        while chunk := await stream.receive_some(CHUNK):
            found += len(split(chunk))
        spent = time.thread_time() - start
    thread.join()
    return spent, found


def read_only() -> Callable[[bytes], list[bytes]]:
    return lambda chunk: []


def line_splitter() -> Callable[[bytes], list[bytes]]:
    return LineSplitter(MAX_LINE_BYTES).feed


def old_split() -> Callable[[bytes], list[bytes]]:
    buffer = b""

    def split(chunk: bytes) -> list[bytes]:
        nonlocal buffer
        *lines, buffer = (buffer + chunk).split(b"\n")
        return lines

    return split


async def main() -> None:
    ways = {"read only": read_only, "LineSplitter": line_splitter, "old split": old_split}
    times: dict[str, list[float]] = {name: [] for name in ways}
    for _ in range(ROUNDS):
        for name, make in ways.items():
            spent, found = await _pump(make())
            assert found == (0 if name == "read only" else 1), (name, found)
            times[name].append(spent)
    base = statistics.median(times["read only"])
    print(f"one {SIZE >> 20} MiB line through a pipe, {CHUNK >> 10} KiB receives, CPU of the")
    print(f"Trio thread (median of {ROUNDS}):")
    for name, rounds in times.items():
        median = statistics.median(rounds)
        print(f"  {name:<13} {median * 1000:9.1f} ms   {median / base:6.1f}x the read alone")


if __name__ == "__main__":
    trio.run(main)
