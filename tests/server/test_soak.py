"""A long-running ``tak serve``: its descriptors stay flat however many sessions come and go.

A real ``tak serve`` process (a ``FileStore`` under its home, the default
``IdleSessions``) and the real client: sessions, each a connection with a
``call_tools``, an agent turn that calls a tool and one that does not, some
of them returning to a session released long ago. The server's open
descriptors are counted (``/proc/PID/fd``) after a warm-up, in the middle and
at the end: they must not grow with the number of sessions (they grew by 3
per session: each transcript, its directory and its lock file stayed open).

``make test`` runs 48 sessions; ``make stress`` (``--stress``) drives them
for 30 minutes (``TAK_SOAK_SECONDS`` to change it) and prints descriptors and
resident memory at start, middle and end.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import trio

from kernel import ToolCall
from kernel.kernel import IdleSessions
from kernel.wire import open_client

CLIENTS = 4  # sessions at once
KEEP = IdleSessions().keep
# Per session the store may keep 3 descriptors (transcript, directory, lock file):
# KEEP idle ones, CLIENTS in use; plus a little for sockets and the page.
BOUND = 3 * (KEEP + CLIENTS) + 8
SLACK = 8  # what the end may exceed the middle by (sockets closing, a worker's pipes)
PAUSE = 0.5  # between a client's sessions under --stress: thousands in 30 minutes


def open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


async def one_session(url: str, number: int) -> None:
    # Every 8th session comes back to one released long ago: it is read back from disk.
    session = f"s{number - 40}" if number % 8 == 7 and number >= 40 else f"s{number}"
    with trio.fail_after(60):
        async with open_client(url) as client:
            result = await client.call_tools(
                session, [ToolCall(f"c{number}", "add", {"a": number, "b": 1})]
            )
            assert result.observations[0].content == str(number + 1)
            await client.run(session, '/call echo {"text": "' + "x" * 2000 + '"}')
            reply = await client.run(session, f"hello {number}")
            assert reply.text is not None and f"hello {number}" in reply.text


@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="needs /proc")
async def test_tak_serve_descriptors_stay_flat_over_many_sessions(
    tmp_path: Path, stress: bool, capsys: pytest.CaptureFixture[str]
) -> None:
    seconds = float(os.environ.get("TAK_SOAK_SECONDS", "1800")) if stress else None
    sessions = 48  # bounded run: three times KEEP
    log = (tmp_path / "serve.log").open("wb")
    home = str(tmp_path / "home")
    command = [sys.executable, "-m", "kernel.cli", "--home", home, "--plugin", "demo"]
    server = await trio.lowlevel.open_process(
        [*command, "serve", "--port", "0"],
        stdout=subprocess.PIPE,
        stderr=log,
    )
    try:
        assert server.stdout is not None
        buffer = b""
        with trio.fail_after(60):
            while b"\n" not in buffer:
                chunk = await server.stdout.receive_some()
                assert chunk, "tak serve ended before printing its URL"
                buffer += chunk
        url = buffer.split(b"\n", 1)[0].decode()
        pid = server.pid

        done = 0
        rows: list[tuple[str, int, int, float]] = []

        def sample(when: str) -> None:
            rows.append((when, done, open_fds(pid), rss_mib(pid)))

        async def drive(until: int | None, deadline: float | None) -> None:
            nonlocal done
            numbers = iter(range(done, 10**9))

            async def client() -> None:
                nonlocal done
                while (until is None or done < until) and (
                    deadline is None or trio.current_time() < deadline
                ):
                    await one_session(url, next(numbers))
                    done += 1
                    if deadline is not None:
                        await trio.sleep(PAUSE)  # a soak, not a load test: the fds must stay

            async with trio.open_nursery() as nursery:
                for _ in range(CLIENTS):
                    nursery.start_soon(client)

        await drive(KEEP + CLIENTS, None)  # warm-up: the idle sessions kept are all there
        sample("start")
        if seconds is None:
            await drive(2 * sessions // 3, None)
            sample("middle")
            await drive(sessions, None)
        else:
            end = trio.current_time() + seconds
            await drive(None, trio.current_time() + seconds / 2)
            sample("middle")
            await drive(None, end)
        sample("end")
        if stress:
            with capsys.disabled():
                print()
                for when, count, fds, rss in rows:
                    print(
                        f"tak serve soak {when:>6}: {count:5d} sessions, {fds:4d} open fds, "
                        f"{rss:6.1f} MiB RSS"
                    )
        (_, _, start, _), (_, _, middle, _), (_, _, final, _) = rows
        assert start <= BOUND + 20, rows  # 20: the process's own (log, listener, pipes)
        assert final <= middle + SLACK, rows
        assert final <= start + SLACK + 3 * CLIENTS, rows
        if stress:
            assert done >= 200, rows
    finally:
        server.send_signal(signal.SIGTERM)
        with trio.move_on_after(30):
            await server.wait()
        if server.returncode is None:
            server.kill()
            await server.wait()
        log.close()
